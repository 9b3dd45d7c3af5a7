#pragma once
// The narrow interface between the model's attention step and whatever keeps keys and values.
//
// For each forward pass over positions [pos, pos + n) the model calls, in this order:
//   prepare(pos, n)                         once, before the first layer (a cache may grow here);
//   write(layer, pos, n, positions, k, v)   per layer: store the new positions' keys and values;
//   view(layer)                             per layer: the rows this layer's attention may read;
// the layers in order, 0 first: per layer write(layer), then view(layer). A cache that keeps its rows in a pool
// other sequences share (chapter 08) may say where a write goes instead (paged_write): the model then writes
// it, with the other sequences of a batch in that pool, in place of write(). So may a cache whose write is plain
// float rows (rows_write, chapter 03's): the products that compute the keys and values then store them there too.
// A cache policy (a chapter's lesson) decides where K/V live and which rows are visible; the forward
// pass never changes from one chapter to the next. Between forward passes an experiment may read or
// overwrite what the cache holds, one row at a time (row(); chapter 05 corrupts a key that way).
#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>

#include "block_table.h"
#include "host_device.h"
#include "kv_format.h"
#include "ring.h"

namespace kvs {

// Which earlier keys a query may see besides being causal. size == 0: all of them. size W > 0: at most W
// keys - the `sinks` first positions of the sequence, kept forever (StreamingLLM's attention sinks), and
// the W - sinks most recent positions, the query's own included. 0 <= sinks < W.
struct Window {
  int size = 0;
  int sinks = 0;
};

// Whether a query at `query_pos` may attend to the key at `key_pos`: causal (never the future), and
// within the window. A negative key_pos marks an empty row, never visible. The one masking rule; every
// backend, every cache and every test calls it.
KVS_HOST_DEVICE inline bool key_visible(int query_pos, int key_pos, Window window) {
  if (key_pos < 0 || key_pos > query_pos) return false;
  if (window.size == 0 || key_pos < window.sinks) return true;
  return query_pos - key_pos < window.size - window.sinks;
}

// Read-time rotation (chapter 04, StreamingLLM's "positions within the cache"): keys are cached as the model
// projected them, unrotated, and attention rotates the query and each key it reads by their positions
// *within the window*: the sinks at 0 .. sinks-1, the recent keys after them in order, the query last. No
// angle then exceeds window.size - 1, however long the text, while the distance from the query to each
// recent key stays the true one (RoPE scores depend on that distance only); only the sinks move closer.
// Before the window is full these are the absolute positions. The one definition, host and device.
KVS_HOST_DEVICE inline int rotary_query_position(int query_pos, Window window) {
  return window.size == 0 || query_pos < window.size ? query_pos : window.size - 1;
}
// For a key the query may see (key_visible).
KVS_HOST_DEVICE inline int rotary_key_position(int query_pos, int key_pos, Window window) {
  if (key_pos < window.sinks) return key_pos;
  return rotary_query_position(query_pos, window) - (query_pos - key_pos);
}

// The keys and values one layer may attend to: `rows` rows of kv_dim floats (n_kv_heads heads of
// head_dim each), consecutive rows `row_stride` floats apart, in the backend's memory - or, in a paged view
// (`paged.blocks` not null, chapter 08), row r at physical row paged.physical_row(r) of the pool that `keys`
// and `values` start. Attention finds a row through row_offset(), whatever the layout. Chapter 10's caches store
// the rows coded instead (key_codes, value_codes: fp16, bf16, int8, int4); a reader that wants a number whatever
// the storage calls key() and value().
struct KvView {
  const float* keys = nullptr;    // (rows, row_stride), first kv_dim floats of a row used
  const float* values = nullptr;  // (rows, row_stride)
  int rows = 0;
  int row_stride = 0;
  // Row r holds position row_positions[r] (backend memory, like the rows: a ring cache keeps it there with
  // Backend::write_positions; a negative value marks an empty row), or, when row_positions is null, position
  // first_position + r. A row that no query of the call may see (key_visible) never contributes to the output,
  // whatever its bytes: an empty slot may hold anything, NaN included. (A row that only the call's later queries
  // see, written by the call itself, is multiplied by a weight of 0 for the earlier ones in a prefill's products,
  // on the CPU and in the GPU's tiles: a NaN the model put there reaches them as 0 · NaN. The reference skips it.)
  const int* row_positions = nullptr;
  int first_position = 0;
  Window window = Window{};  // see key_visible
  // Null: keys were rotated (RoPE) at their absolute positions before they were cached, as the query was.
  // Otherwise keys and queries are unrotated and attention rotates each by its rotary_*_position, with this
  // table of [cos, sin] for positions 0 .. window.size - 1: (window.size, head_dim/2, 2), backend memory.
  const float* read_rope = nullptr;
  // Not null: a paged view (block_table.h); its table lives in backend memory like the rows.
  BlockTable paged = BlockTable{};
  // A side whose format is not kFp32 is stored coded (kv_format.h, chapter 10): its row r is the codes' and
  // scales' physical_row(r), `keys` (or `values`) is null, and attention decodes each number as it reads it -
  // no decoded copy of the cache is ever made. kFp32 (the default): the float rows above.
  CodedRows key_codes = CodedRows{}, value_codes = CodedRows{};

  // Floats from keys (or values) to the start of row r.
  KVS_HOST_DEVICE std::size_t row_offset(int r) const {
    return std::size_t(physical_row(r)) * row_stride;
  }
  // The end of the run of rows from r on that lie row_stride floats apart, at most `end`: `end` itself in a
  // contiguous view, the end of r's block in a paged one. A fast path that reads rows as a strided matrix
  // reads one such run at a time.
  KVS_HOST_DEVICE int run_end(int r, int end) const { return paged.blocks ? paged.run_end(r, end) : end; }

  // The row of the pool (or of the contiguous rows) that holds view row r.
  KVS_HOST_DEVICE int physical_row(int r) const { return paged.blocks ? paged.physical_row(r) : r; }
  KVS_HOST_DEVICE bool coded() const { return key_codes.format != KvFormat::kFp32 || value_codes.format != KvFormat::kFp32; }
  // Number `channel` (of kv_dim) of row r's key, or value: stored or decoded. What a plain reader calls (the
  // reference attention, the CUDA kernels); the CPU's fast paths read float rows in place and decode a head of
  // coded rows at a time (CodedRows::decode_run).
  KVS_HOST_DEVICE float key(int r, int channel) const {
    return key_codes.format == KvFormat::kFp32 ? keys[row_offset(r) + channel] : key_codes.decode(physical_row(r), channel);
  }
  KVS_HOST_DEVICE float value(int r, int channel) const {
    return value_codes.format == KvFormat::kFp32 ? values[row_offset(r) + channel]
                                                 : value_codes.decode(physical_row(r), channel);
  }

  KVS_HOST_DEVICE int position_of(int row) const {
    return row_positions ? row_positions[row] : first_position + row;
  }
  // How many leading rows a query at `query_pos` (or any earlier one) may see: rows of a view without
  // row_positions hold increasing positions, so the rows past the query's own are its future and need not
  // be visited at all (a preallocated cache shows its whole buffer; its unwritten rows are never read);
  // with row_positions, every row. The rows within still go through key_visible.
  KVS_HOST_DEVICE int rows_to_visit(int query_pos) const {
    if (row_positions) return rows;
    const int prefix = query_pos - first_position + 1;
    return prefix < 0 ? 0 : prefix < rows ? prefix : rows;
  }
  // The rows a query at `query_pos` may see, [begin, end), when they are one run of consecutive rows: in a
  // view without row_positions (increasing positions) and without sinks, key_visible's keys are the rows from
  // the window's start to the query's own. False where they need not be one run (row_positions, sinks): ask
  // key_visible row by row there. Lets attention skip the per-row test; agrees with it at every row (tested).
  KVS_HOST_DEVICE bool visible_rows(int query_pos, int& begin, int& end) const {
    if (row_positions || window.sinks > 0) return false;
    end = rows_to_visit(query_pos);
    begin = window.size == 0 ? 0 : query_pos - window.size + 1 - first_position;
    begin = begin < 0 ? 0 : begin > end ? end : begin;
    return true;
  }
};

// One cached position of one layer: its key and its value, kv_dim floats each (n_kv_heads heads of
// head_dim), in the backend's memory and writable.
struct KvRow {
  float* key = nullptr;
  float* value = nullptr;
};

// Where a cache's write of one layer goes when it is one block-table scatter into a pool of rows (chapter 08):
// the keys into `keys`, the values into `values` (float rows, or chapter 10's coded rows), each position at
// the row `table` maps it to (block_table.h).
struct PagedWrite {
  CodedRows keys, values;
  BlockTable table;
};

// Where a cache's write of one layer goes when it is one Backend::write_key_value_rows: keys into `keys`, values
// into `values`, float rows `row_stride` floats apart, position p at row ring.write_slot(p).
struct RowsWrite {
  float* keys = nullptr;
  float* values = nullptr;
  int row_stride = 0;
  Ring ring = Ring::unbounded();
};

class KvCache {
 public:
  virtual ~KvCache() = default;
  // Positions [pos, pos + n) are about to be written by every layer.
  virtual void prepare(int pos, int n) = 0;
  // Store the keys and values of positions [pos, pos + n) for one layer. k, v: (n, kv_dim), backend memory,
  // valid only during this call. `positions` holds the same n positions in backend memory (what a write
  // reads when the decode step is recorded and replayed, see replayable()).
  virtual void write(int layer, int pos, int n, const int* positions, const float* k, const float* v) = 0;
  // Where write(layer, pos, n, ...) puts the rows, when this cache's rows lie in a pool that other sequences'
  // caches share (chapter 08's paged sequences), after the checks write() makes: the model then writes the
  // sequences of a batch that share a pool together, one Backend::write_paged_batch a layer (on a GPU one launch
  // where a write() per sequence is two), and does not call write(). Such a cache's write() is that call for
  // its one sequence (through the backend the model runs on, whose memory the rows are), so both ways store the
  // same bytes. nullopt (the default): the model calls write().
  virtual std::optional<PagedWrite> paged_write(int /*layer*/, int /*pos*/, int /*n*/) const { return std::nullopt; }
  // Where write(layer, pos, n, ...) puts the rows, when that write is exactly one Backend::write_key_value_rows
  // with these arguments (after the checks write() makes): the model may then have the rows stored by the
  // products that compute them (Backend::Product::cache_rows; on a GPU the layer's write is then no launch of its
  // own) and not call write(). nullopt (the default): the model calls write(). Not const: it hands out the rows to
  // write.
  virtual std::optional<RowsWrite> rows_write(int /*layer*/, int /*pos*/, int /*n*/) { return std::nullopt; }
  // What this layer's attention reads; includes the positions just written.
  virtual KvView view(int layer) const = 0;
  // Positions cached so far: the next forward pass starts here (0 for a fresh cache).
  virtual int length() const = 0;
  // Whether the model must leave q and k unrotated, because attention rotates them as it reads (the
  // views carry read_rope). Only chapter 04's streaming variant says yes.
  virtual bool rotates_at_read() const { return false; }
  // Whether a decode step through this cache may be recorded once and replayed at every later position
  // (backend.h, Recording): its views are the same whatever the length, and its writes find their rows
  // through `positions` (Backend::write_rows), so nothing a step hands the backend depends on the position.
  // Only between prepare() calls does the cache's own bookkeeping run, and prepare() is never recorded.
  virtual bool replayable() const { return false; }
  // Where `layer` keeps `position`, for an experiment that reads or overwrites a cached row between forward
  // passes (valid until the next prepare). Throws std::out_of_range (see row_error) for a layer the cache
  // does not have or a position it does not hold: not written yet, or evicted.
  virtual KvRow row(int layer, int position) = 0;
};

// What every cache's write checks first: the layer exists and [pos, pos + n) lies inside the positions the
// last prepare announced (so inside the storage the cache owns). A write anywhere else is refused, never
// carried out: a shifted index (chapter 06) must not corrupt the heap.
inline void check_write(const char* cache, int layer, int n_layers, int pos, int n, int prepared_end) {
  if (layer < 0 || layer >= n_layers || pos < 0 || n < 0 || pos + n > prepared_end)
    throw std::out_of_range(std::string(cache) + ": a write of positions " + std::to_string(pos) + ".." +
                            std::to_string(pos + n - 1) + " in layer " + std::to_string(layer) + " is outside the " +
                            std::to_string(prepared_end) + " prepared positions of " + std::to_string(n_layers) +
                            " layers; call prepare first and write only what it announced");
}

// The one message of KvCache::row's refusal.
inline std::out_of_range row_error(const char* cache, int layer, int position, const std::string& why) {
  return std::out_of_range(std::string(cache) + ": no row for layer " + std::to_string(layer) + ", position " +
                           std::to_string(position) + ": " + why);
}

// "No cache": the keys and values of the current call only, read straight from the model's k and v
// buffers; nothing survives the call. Attending over a whole sequence from position 0 is exactly naive
// generation's full recompute.
class CallLocalKv final : public KvCache {
 public:
  explicit CallLocalKv(int kv_dim) : kv_dim_(kv_dim) {}
  void prepare(int pos, int n) override { pos_ = pos, n_ = n; }
  void write(int, int, int, const int*, const float* k, const float* v) override { k_ = k, v_ = v; }
  KvView view(int) const override {
    return KvView{.keys = k_, .values = v_, .rows = n_, .row_stride = kv_dim_, .first_position = pos_};
  }
  int length() const override { return 0; }  // nothing survives a call
  KvRow row(int layer, int position) override { throw row_error("CallLocalKv", layer, position, "it keeps nothing"); }

 private:
  int kv_dim_;
  int pos_ = 0, n_ = 0;
  const float* k_ = nullptr;
  const float* v_ = nullptr;
};

}  // namespace kvs
