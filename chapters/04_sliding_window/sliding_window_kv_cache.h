#pragma once
// Chapter 04's lesson: a KV cache that forgets. It holds a fixed number of slots, allocated once, and
// writes position p into slot ring.write_slot(p) (common/ring.h): the first `sinks` positions keep their
// slots forever (attention sinks), every later position overwrites the oldest non-sink one. Memory is
// 2 · layers · kv_heads · head_dim · slots · 4 bytes however long the generation runs.
//
// What each query sees is decided by the one masking rule, key_visible with the cache's Window: the sinks
// and the window.size - sinks most recent positions. The ring holds window.size + max_tokens_per_call - 1
// slots, because a forward pass writes all its positions before its queries attend (see ring.h): decoding
// (one position per call) needs exactly window.size slots; a prefill in chunks of C needs C - 1 more.
//
// Where keys sit for RoPE, two variants (KeyPositions):
//   kAbsolute      keys are stored rotated at their absolute position, as the model computes them: exact
//                  inside the model's trained context, refused past it (a sink's distance from the query
//                  would grow past anything the model saw in training);
//   kWithinWindow  keys are stored unrotated and attention rotates them, and the query, at their positions
//                  within the window (StreamingLLM; kv_cache.h's rotary_*_position): no angle exceeds
//                  window.size - 1, so generation runs on past the trained context with constant memory. The
//                  price: every step rotates every visible key again (O(window) rotations per layer and
//                  head), and the sinks no longer sit at their true distance.
// Before the first eviction the two compute the same thing (the rotary positions are the absolute ones).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend.h"
#include "config.h"
#include "kv_cache.h"
#include "resident_memory.h"
#include "ring.h"

namespace kvs::ch04 {

enum class KeyPositions { kAbsolute, kWithinWindow };

inline const char* to_string(KeyPositions positions) {
  return positions == KeyPositions::kAbsolute ? "absolute" : "within-window";
}

// The ring's slots for a window of `window_size` positions fed `max_tokens_per_call` at a time (why: above).
inline int ring_slots(int window_size, int max_tokens_per_call) { return window_size + max_tokens_per_call - 1; }

class SlidingWindowKvCache final : public KvCache {
 public:
  SlidingWindowKvCache(Backend& backend, const ModelConfig& config, Window window, int max_tokens_per_call,
                       KeyPositions positions = KeyPositions::kAbsolute)
      : backend_(backend),
        kv_dim_(config.kv_dim()),
        n_layers_(config.n_layers),
        max_positions_(config.seq_len),
        max_tokens_per_call_(max_tokens_per_call),
        positions_(positions),
        window_(check(window, max_tokens_per_call, positions, config.seq_len)),
        ring_{ring_slots(window.size, max_tokens_per_call), window.sinks},
        storage_(backend, std::size_t(config.n_layers) * 2 * ring_.slots * config.kv_dim()),
        slot_positions_(ring_.slots, -1),
        row_positions_(backend, ring_.slots) {
    backend.from_host(row_positions_.data(), slot_positions_.data(), slot_positions_.size());  // all -1: empty
    if (positions_ == KeyPositions::kWithinWindow) {  // [cos, sin] of positions 0 .. window - 1, once
      read_rope_ = Buffer(backend, std::size_t(window.size) * config.head_dim());
      backend.rope_table(read_rope_.data(), consecutive_positions(backend, 0, window.size).data(), window.size,
                         config.head_dim());
    }
  }

  void prepare(int pos, int n) override {
    if (pos != length_)
      throw std::invalid_argument("SlidingWindowKvCache: position " + std::to_string(pos) + " after " +
                                  std::to_string(length_) + " cached positions; a ring can only append");
    if (n > max_tokens_per_call_)
      throw std::invalid_argument("SlidingWindowKvCache: " + std::to_string(n) + " positions in one call; this ring "
                                  "was built for calls of at most " + std::to_string(max_tokens_per_call_) +
                                  " (prefill in chunks of that size)");
    if (positions_ == KeyPositions::kAbsolute && pos + n > max_positions_)
      throw std::invalid_argument("SlidingWindowKvCache: position " + std::to_string(pos + n - 1) +
                                  " is past the model's trained context of " + std::to_string(max_positions_) +
                                  "; keys rotated at absolute positions are only exact inside it (use the "
                                  "within-window positions to generate further)");
    for (int p = pos; p < pos + n; ++p) slot_positions_[ring_.write_slot(p)] = p;
    length_ = pos + n;
  }

  // The backend turns each position (read from backend memory) into its slot, ring.h's write_slot, for the
  // rows and for the view's row positions alike: nothing here depends on the position, so a decode step
  // can be recorded once and replayed (replayable()). Every layer shares the row positions: written once per
  // forward pass, with layer 0 (kv_cache.h: the model writes the layers in order).
  void write(int layer, int pos, int n, const int* positions, const float* k, const float* v) override {
    check_write("SlidingWindowKvCache", layer, n_layers_, pos, n, length_);
    backend_.write_key_value_rows(storage_.data() + block(layer, 0), storage_.data() + block(layer, 1), kv_dim_, positions,
                                  ring_, k, v, n, kv_dim_);
    if (layer == 0) backend_.write_positions(row_positions_.data(), positions, ring_, n);
  }

  // Every slot, in slot order: row r holds position row_positions[r] (-1 until first written).
  KvView view(int layer) const override {
    return KvView{.keys = storage_.data() + block(layer, 0), .values = storage_.data() + block(layer, 1),
                  .rows = ring_.slots, .row_stride = kv_dim_, .row_positions = row_positions_.data(),
                  .first_position = 0, .window = window_, .read_rope = read_rope_.data()};
  }
  bool replayable() const override { return true; }

  int length() const override { return length_; }
  KvRow row(int layer, int position) override {
    const int slot = position >= 0 ? ring_.write_slot(position) : 0;
    if (layer < 0 || layer >= n_layers_ || position < 0 || slot_positions_[slot] != position)
      throw row_error("SlidingWindowKvCache", layer, position,
                      position >= 0 && position < length_ ? "evicted from the ring" : "not in the ring");
    const std::size_t row = std::size_t(slot) * kv_dim_;
    return {storage_.data() + block(layer, 0) + row, storage_.data() + block(layer, 1) + row};
  }
  bool rotates_at_read() const override { return positions_ == KeyPositions::kWithinWindow; }
  KeyPositions positions() const { return positions_; }
  int slots() const { return ring_.slots; }
  const Window& window() const { return window_; }
  // The keys and values: the formula's 2 · layers · kv_heads · head_dim · slots · 4 bytes. Beside them and not
  // counted here: the slots' positions (slots ints) and, within-window, the rotation table (window · head_dim
  // floats), bookkeeping that does not grow with the layers.
  std::int64_t allocated_bytes() const { return std::int64_t(storage_.size()) * sizeof(float); }
  // -1 when the cache is not in host memory (a GPU's pages are not the operating system's to count).
  std::int64_t resident_bytes() const {
    if (!backend_.host_memory()) return -1;
    return kvs::resident_bytes(storage_.data(), storage_.size() * sizeof(float));
  }

 private:
  static Window check(Window window, int max_tokens_per_call, KeyPositions positions, int seq_len) {
    if (window.size < 1 || window.sinks < 0 || window.sinks >= window.size || max_tokens_per_call < 1)
      throw std::invalid_argument("SlidingWindowKvCache: a window of " + std::to_string(window.size) + " keys with " +
                                  std::to_string(window.sinks) + " sinks and calls of " +
                                  std::to_string(max_tokens_per_call) +
                                  " positions; need 0 <= sinks < window and calls of at least 1 position");
    if (positions == KeyPositions::kWithinWindow && window.size > seq_len)
      throw std::invalid_argument("SlidingWindowKvCache: a window of " + std::to_string(window.size) +
                                  " keys rotated within the window reaches positions past the model's trained "
                                  "context of " + std::to_string(seq_len) + "; use a window of at most that");
    return window;
  }
  // Offset of a layer's keys (kv = 0) or values (kv = 1): a (slots, kv_dim) block.
  std::size_t block(int layer, int kv) const { return (std::size_t(layer) * 2 + kv) * ring_.slots * kv_dim_; }

  Backend& backend_;
  int kv_dim_, n_layers_, max_positions_, max_tokens_per_call_;
  KeyPositions positions_;
  Window window_;
  Ring ring_;
  Buffer storage_;                   // (layers, 2, slots, kv_dim)
  std::vector<int> slot_positions_;  // (slots) the position each slot holds, -1: never written (host: row())
  IntBuffer row_positions_;          // (slots) the same, in backend memory, written by the backend: view()
  Buffer read_rope_;                 // (window, head_dim/2, 2), kWithinWindow only
  int length_ = 0;
};

}  // namespace kvs::ch04
