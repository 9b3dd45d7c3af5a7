#pragma once
// The narrow interface between the model's attention step and whatever keeps keys and values.
//
// For each forward pass over positions [pos, pos + n) the model calls, in this order:
//   prepare(pos, n)                         once, before the first layer (a cache may grow here);
//   write(layer, pos, n, k, v)              per layer: store the new positions' keys and values;
//   view(layer)                             per layer: the rows this layer's attention may read.
// A cache policy (a chapter's lesson) decides where K/V live and which rows are visible; the forward
// pass never changes from one chapter to the next.
#include <cstddef>

namespace kvs {

// Whether a query at `query_pos` may attend to the key at `key_pos`: causal (never the future), and,
// with a window W > 0, only the W most recent positions including itself (query_pos - key_pos < W).
// window == 0 means no window; a negative key_pos marks an empty row. The one masking rule; every
// backend calls it.
inline bool key_visible(int query_pos, int key_pos, int window) {
  return key_pos >= 0 && key_pos <= query_pos && (window == 0 || query_pos - key_pos < window);
}

// The keys and values one layer may attend to: `rows` rows of kv_dim floats (n_kv_heads heads of
// head_dim each), consecutive rows `row_stride` floats apart, in the backend's memory.
struct KvView {
  const float* keys = nullptr;    // (rows, row_stride), first kv_dim floats of a row used
  const float* values = nullptr;  // (rows, row_stride)
  int rows = 0;
  int row_stride = 0;
  // Row r holds position row_positions[r] (a negative value marks an empty row), or, when
  // row_positions is null, position first_position + r.
  const int* row_positions = nullptr;
  int first_position = 0;
  int window = 0;  // see key_visible

  int position_of(int row) const { return row_positions ? row_positions[row] : first_position + row; }
};

class KvCache {
 public:
  virtual ~KvCache() = default;
  // Positions [pos, pos + n) are about to be written by every layer.
  virtual void prepare(int pos, int n) = 0;
  // Store the keys and values of positions [pos, pos + n) for one layer. k, v: (n, kv_dim), backend memory,
  // valid only during this call.
  virtual void write(int layer, int pos, int n, const float* k, const float* v) = 0;
  // What this layer's attention reads; includes the positions just written.
  virtual KvView view(int layer) const = 0;
  // Positions cached so far: the next forward pass starts here (0 for a fresh cache).
  virtual int length() const = 0;
};

// "No cache": the keys and values of the current call only, read straight from the model's k and v
// buffers; nothing survives the call. Attending over a whole sequence from position 0 is exactly naive
// generation's full recompute.
class CallLocalKv final : public KvCache {
 public:
  explicit CallLocalKv(int kv_dim) : kv_dim_(kv_dim) {}
  void prepare(int pos, int n) override { pos_ = pos, n_ = n; }
  void write(int, int, int, const float* k, const float* v) override { k_ = k, v_ = v; }
  KvView view(int) const override {
    return KvView{.keys = k_, .values = v_, .rows = n_, .row_stride = kv_dim_, .first_position = pos_};
  }
  int length() const override { return 0; }  // nothing survives a call

 private:
  int kv_dim_;
  int pos_ = 0, n_ = 0;
  const float* k_ = nullptr;
  const float* v_ = nullptr;
};

}  // namespace kvs
