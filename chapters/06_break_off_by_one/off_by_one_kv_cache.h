#pragma once
// Chapter 06's lesson: the right values in the wrong slot are just as wrong. This is chapter 03's
// preallocated cache with one bug: position p is written to slot p + shift (shift = +1 or -1) while every
// read still takes slot r for position r. Values are right; their positions are not.
//
// What a read sees (the bug is in write_slot; the reads are chapter 03's):
//   shift +1  slot 0 is never written, and slot r holds position r - 1: a query at p reads a zero key and
//             value labelled position 0, then every earlier position one slot late, and never its own key
//             (it sits in slot p + 1, past the rows the query may see);
//   shift -1  slot r holds position r + 1: in a prefill every query but the last also reads the *next*
//             position's key and value (the future leaks in); when decoding, the query at p reads slot p,
//             which position p + 1 has not written yet: zeros. Position 0 is never read at all.
// A slot that was never written holds zeros, a defined value: the storage is zero-filled when it is
// allocated (never uninitialised memory). At the ends of the buffer, slot -1 (position 0 with shift -1)
// and slot max_positions (the last position with shift +1) are two spare rows this cache owns: the bug
// moves data inside the storage it allocated and never corrupts the heap, and a write outside the prepared
// positions is refused as in every cache (check_write).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend.h"
#include "config.h"
#include "kv_cache.h"

namespace kvs::ch06 {

// The bug, in one place: the slot position `pos` is written to.
inline int write_slot(int pos, int shift) { return pos + shift; }

class OffByOneKvCache final : public KvCache {
 public:
  OffByOneKvCache(Backend& backend, const ModelConfig& config, int max_positions, int shift)
      : backend_(backend),
        kv_dim_(config.kv_dim()),
        n_layers_(config.n_layers),
        max_positions_(max_positions),
        shift_(check_shift(shift)),
        storage_(backend, std::size_t(config.n_layers) * 2 * (max_positions + 2) * config.kv_dim()) {
    const std::vector<float> zeros(storage_.size(), 0.0f);  // never-written slots read as zeros
    backend.from_host(storage_.data(), zeros.data(), zeros.size());
  }

  void prepare(int pos, int n) override {
    if (pos > length_ || pos + n > max_positions_)
      throw std::invalid_argument("OffByOneKvCache: positions " + std::to_string(pos) + ".." + std::to_string(pos + n - 1) +
                                  " after " + std::to_string(length_) + " cached, in a cache of " +
                                  std::to_string(max_positions_));
    length_ = pos + n;
  }

  void write(int layer, int pos, int n, const int*, const float* k, const float* v) override {
    check_write("OffByOneKvCache", layer, n_layers_, pos, n, length_);
    const int s = write_slot(pos, shift_);
    backend_.copy(storage_.data() + offset(layer, 0, s), k, std::size_t(n) * kv_dim_);
    backend_.copy(storage_.data() + offset(layer, 1, s), v, std::size_t(n) * kv_dim_);
  }

  // Chapter 03's read: slots 0 .. length-1 as positions 0 .. length-1.
  KvView view(int layer) const override {
    return KvView{.keys = storage_.data() + offset(layer, 0, 0), .values = storage_.data() + offset(layer, 1, 0),
                  .rows = length_, .row_stride = kv_dim_};
  }

  int length() const override { return length_; }
  // Where the cache actually keeps `position` (the slot it was written to).
  KvRow row(int layer, int position) override {
    if (layer < 0 || layer >= n_layers_ || position < 0 || position >= length_)
      throw row_error("OffByOneKvCache", layer, position, "it holds positions 0.." + std::to_string(length_ - 1));
    const int s = write_slot(position, shift_);
    return {storage_.data() + offset(layer, 0, s), storage_.data() + offset(layer, 1, s)};
  }
  int shift() const { return shift_; }

 private:
  static int check_shift(int shift) {
    if (shift != 1 && shift != -1) throw std::invalid_argument("OffByOneKvCache: a shift of +1 or -1, not " + std::to_string(shift));
    return shift;
  }
  // Slot s (-1 .. max_positions) of a layer's keys (kv = 0) or values (kv = 1): storage row s + 1 of a
  // (max_positions + 2, kv_dim) block.
  std::size_t offset(int layer, int kv, int s) const {
    return ((std::size_t(layer) * 2 + kv) * (max_positions_ + 2) + (s + 1)) * kv_dim_;
  }

  Backend& backend_;
  int kv_dim_, n_layers_, max_positions_, shift_;
  Buffer storage_;  // (layers, 2, max_positions + 2, kv_dim), zero-filled
  int length_ = 0;
};

}  // namespace kvs::ch06
