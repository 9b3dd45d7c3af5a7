#pragma once
// Chapter 03's lesson: one buffer for every layer's keys and values, allocated once for the longest
// sequence the run will need, written in place by position. Nothing is allocated or copied after the
// constructor, so the decode loop allocates nothing and every buffer keeps its address (on a GPU that is
// what lets a whole decode step be captured once as a graph and replayed).
//
// Layout: [layer][K or V][position][kv_dim], i.e. per layer a (max_positions, kv_dim) block of keys and
// one of values. Why this order:
//  - the k and v the model computes for n new positions are (n, kv_dim) rows: a write is one contiguous
//    copy per layer for K and one for V;
//  - the rows attention reads are a prefix of the block, positions 0 .. the query's, in order;
//  - a head's head_dim columns are read with a stride of kv_dim, which the CPU's matrix products take
//    as an outer stride at no cost. A GPU kernel that wants each head's keys contiguous would pick
//    [layer][kv_head][position][head_dim] instead, at the price of n_kv_heads copies per write.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "backend.h"
#include "config.h"
#include "kv_cache.h"
#include "resident_memory.h"

namespace kvs::ch03 {

class PreallocatedKvCache final : public KvCache {
 public:
  PreallocatedKvCache(Backend& backend, const ModelConfig& config, int max_positions)
      : backend_(backend),
        kv_dim_(config.kv_dim()),
        n_layers_(config.n_layers),
        max_positions_(max_positions),
        storage_(backend, std::size_t(config.n_layers) * 2 * max_positions * config.kv_dim()) {}

  void prepare(int pos, int n) override {
    if (pos > length_)
      throw std::invalid_argument("PreallocatedKvCache: position " + std::to_string(pos) + " leaves a gap after the " +
                                  std::to_string(length_) + " cached positions");
    if (pos + n > max_positions_)
      throw std::invalid_argument("PreallocatedKvCache: positions up to " + std::to_string(pos + n) +
                                  " do not fit; the cache was allocated for " + std::to_string(max_positions_));
    length_ = pos + n;  // pos < length_ rewinds: later rows are overwritten
  }

  // Row p of a layer's block holds position p (a ring that never wraps): write_key_value_rows reads the positions
  // from backend memory, so a recorded decode step writes the row of the position it is replayed at.
  void write(int layer, int pos, int n, const int* positions, const float* k, const float* v) override {
    const RowsWrite rows = *rows_write(layer, pos, n);
    backend_.write_key_value_rows(rows.keys, rows.values, rows.row_stride, positions, rows.ring, k, v, n, kv_dim_);
  }
  // The same write, for the model to have the products that compute k and v store it (backend.h, Product).
  std::optional<RowsWrite> rows_write(int layer, int pos, int n) override {
    check_write("PreallocatedKvCache", layer, n_layers_, pos, n, length_);
    return RowsWrite{storage_.data() + block(layer, 0), storage_.data() + block(layer, 1), kv_dim_, Ring::unbounded()};
  }

  // The whole block, every allocated row, whatever the length: the rows past a query's position are in its
  // future, which attention never reads (key_visible), and a view that does not change with the length is
  // what lets one recorded decode step serve every position (replayable()).
  KvView view(int layer) const override {
    return KvView{.keys = storage_.data() + block(layer, 0), .values = storage_.data() + block(layer, 1),
                  .rows = max_positions_, .row_stride = kv_dim_};
  }
  bool replayable() const override { return true; }

  int length() const override { return length_; }
  // Forgets every position, keeping the memory (and its pages): the next sequence starts at position 0 in
  // the same buffer, as a server reuses one cache for request after request.
  void clear() { length_ = 0; }
  KvRow row(int layer, int position) override {
    if (layer < 0 || layer >= n_layers_ || position < 0 || position >= length_)
      throw row_error("PreallocatedKvCache", layer, position,
                      "it holds positions 0.." + std::to_string(length_ - 1) + " of layers 0.." + std::to_string(n_layers_ - 1));
    const std::size_t row = std::size_t(position) * kv_dim_;
    return {storage_.data() + block(layer, 0) + row, storage_.data() + block(layer, 1) + row};
  }
  int max_positions() const { return max_positions_; }
  std::int64_t allocated_bytes() const { return std::int64_t(storage_.size()) * sizeof(float); }
  // Of those, the bytes physically in memory now: the pages written so far (see resident_memory.h).
  // -1 when the cache is not in host memory (a GPU's pages are not the operating system's to count).
  std::int64_t resident_bytes() const {
    if (!backend_.host_memory()) return -1;
    return kvs::resident_bytes(storage_.data(), storage_.size() * sizeof(float));
  }

 private:
  // Offset of a layer's keys (kv = 0) or values (kv = 1): a (max_positions, kv_dim) block.
  std::size_t block(int layer, int kv) const { return (std::size_t(layer) * 2 + kv) * max_positions_ * kv_dim_; }

  Backend& backend_;
  int kv_dim_, n_layers_, max_positions_;
  Buffer storage_;  // (layers, 2, max_positions, kv_dim)
  int length_ = 0;
};

}  // namespace kvs::ch03
