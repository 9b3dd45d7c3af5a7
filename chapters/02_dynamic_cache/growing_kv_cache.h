#pragma once
// Chapter 02's lesson: a KV cache that grows as the sequence grows.
//
// Each layer keeps its keys and values as (capacity, kv_dim) buffers, positions in order. When a
// forward pass needs more positions than fit, every buffer is replaced by a larger one and the cached
// rows are copied over - what torch.cat does on every step in a naive PyTorch cache. The growth policy
// decides how much larger:
//   kConcatenate  exactly the positions needed: a new allocation and a full copy on every decode step,
//                 so the bytes copied grow with the square of the sequence length;
//   kChunked      the positions needed plus 1024, rounded up to a multiple of 1024 (nanochat's policy): a
//                 copy only every ~1024 steps - but each copy moves everything cached so far, so the bytes
//                 copied still grow with the square of the length, divided by 1024;
//   kGeometric    double the capacity (std::vector's policy): log2(N) copies whose sizes sum to less than
//                 2N rows, so the bytes copied grow only linearly, at the price of up to N rows of slack.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend.h"
#include "config.h"
#include "kv_cache.h"
#include "resident_memory.h"

namespace kvs::ch02 {

enum class Growth { kConcatenate, kChunked, kGeometric };

inline const char* growth_name(Growth g) {
  return g == Growth::kConcatenate ? "concatenate" : g == Growth::kChunked ? "chunked" : "geometric";
}

// The capacity (positions) a cache holding `capacity` moves to when `needed` positions must fit.
inline int grown_capacity(Growth growth, int capacity, int needed) {
  constexpr int kChunk = 1024;
  if (needed <= capacity) return capacity;
  if (growth == Growth::kConcatenate) return needed;
  if (growth == Growth::kGeometric) return std::max(needed, 2 * capacity);
  return (needed + kChunk + kChunk - 1) / kChunk * kChunk;
}

// The most positions a cache of this policy holds at once (old and new buffers during a copy) when it is
// prefilled with `prefill` positions and then grows one position at a time to `total`.
inline std::int64_t peak_positions(Growth growth, int prefill, int total) {
  int capacity = grown_capacity(growth, 0, prefill);
  std::int64_t peak = capacity;
  for (int needed = prefill + 1; needed <= total; ++needed) {
    const int grown = grown_capacity(growth, capacity, needed);
    if (grown != capacity) peak = std::max<std::int64_t>(peak, std::int64_t(capacity) + grown);
    capacity = grown;
  }
  return peak;
}

class GrowingKvCache final : public KvCache {
 public:
  GrowingKvCache(Backend& backend, const ModelConfig& config, Growth growth)
      : backend_(backend), kv_dim_(config.kv_dim()), growth_(growth), keys_(config.n_layers), values_(config.n_layers) {}

  void prepare(int pos, int n) override {
    if (pos > length_)
      throw std::invalid_argument("GrowingKvCache: position " + std::to_string(pos) + " leaves a gap after the " +
                                  std::to_string(length_) + " cached positions");
    const int needed = pos + n;
    const int capacity = grown_capacity(growth_, capacity_, needed);
    if (capacity != capacity_) {
      for (auto* buffers : {&keys_, &values_})
        for (Buffer& old : *buffers) {
          Buffer bigger(backend_, std::size_t(capacity) * kv_dim_);  // (capacity, kv_dim)
          live_bytes_ += bigger.size() * sizeof(float);
          peak_bytes_ = std::max(peak_bytes_, live_bytes_);  // old and new are both alive right now
          backend_.copy(bigger.data(), old.data(), std::size_t(pos) * kv_dim_);
          bytes_copied_ += std::int64_t(pos) * kv_dim_ * sizeof(float);
          live_bytes_ -= old.size() * sizeof(float);
          old = std::move(bigger);
          ++allocations_;
        }
      capacity_ = capacity;
    }
    length_ = needed;
  }

  void write(int layer, int pos, int n, const int*, const float* k, const float* v) override {
    check_write("GrowingKvCache", layer, static_cast<int>(keys_.size()), pos, n, length_);
    backend_.copy(keys_[layer].data() + std::size_t(pos) * kv_dim_, k, std::size_t(n) * kv_dim_);
    backend_.copy(values_[layer].data() + std::size_t(pos) * kv_dim_, v, std::size_t(n) * kv_dim_);
  }

  KvView view(int layer) const override {
    return KvView{.keys = keys_[layer].data(), .values = values_[layer].data(), .rows = length_, .row_stride = kv_dim_};
  }

  int length() const override { return length_; }
  KvRow row(int layer, int position) override {
    if (layer < 0 || layer >= static_cast<int>(keys_.size()) || position < 0 || position >= length_)
      throw row_error("GrowingKvCache", layer, position,
                      "it holds positions 0.." + std::to_string(length_ - 1) + " of layers 0.." + std::to_string(keys_.size() - 1));
    const std::size_t row = std::size_t(position) * kv_dim_;
    return {keys_[layer].data() + row, values_[layer].data() + row};
  }
  int capacity() const { return capacity_; }
  std::int64_t allocations() const { return allocations_; }    // buffers allocated so far
  std::int64_t bytes_copied() const { return bytes_copied_; }  // old rows copied into new buffers
  std::int64_t capacity_bytes() const { return live_bytes_; }  // K and V of every layer, as allocated
  std::int64_t peak_bytes() const { return peak_bytes_; }      // most bytes alive at once (during a copy)
  std::int64_t resident_bytes() const {  // of capacity_bytes(), the pages in memory now; -1 on a GPU
    if (!backend_.host_memory()) return -1;
    std::int64_t total = 0;
    for (const auto* buffers : {&keys_, &values_})
      for (const Buffer& b : *buffers) total += kvs::resident_bytes(b.data(), b.size() * sizeof(float));
    return total;
  }

 private:
  Backend& backend_;
  int kv_dim_;
  Growth growth_;
  std::vector<Buffer> keys_, values_;  // per layer: (capacity, kv_dim)
  int length_ = 0, capacity_ = 0;
  std::int64_t allocations_ = 0, bytes_copied_ = 0, live_bytes_ = 0, peak_bytes_ = 0;
};

}  // namespace kvs::ch02
