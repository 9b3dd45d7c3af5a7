#pragma once
// A backend owns memory and runs the operations the forward pass is made of. The model decides what is
// computed (common/model.cpp); a backend decides how (Eigen on the CPU, CUDA kernels on a GPU). Every
// pointer passed to an operation is memory of that backend; shapes are row-major.
//
// Ordering: operations run in the order they are called. A GPU backend may return before an operation has
// finished; to_host returns once its data has arrived (so after every earlier operation), and
// synchronize() waits for everything called so far: a timer must call one of the two before it reads the
// clock.
//
// Recording (a CUDA graph on a GPU): the operations called between begin_recording() and end_recording()
// are recorded, not run; replay() runs them again, in order, with the very same arguments - the same
// pointers, sizes and counts. Whatever must differ from one replay to the next (a decode step's token and
// its position) is therefore read by the operations from backend memory, which a transfer before replay()
// updates. Transfers are not recorded. A new recording replaces the last one.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "block_table.h"
#include "kv_cache.h"
#include "ring.h"

namespace kvs {

// The row a cache write of position `pos` lands in: a ring's slot (ring.h; Ring::unbounded() for row = position)
// or a block table's physical row (block_table.h). Backend::write_rows and write_paged_rows are one scatter
// over either.
KVS_HOST_DEVICE inline int write_row(const Ring& ring, int pos) { return ring.write_slot(pos); }
KVS_HOST_DEVICE inline int write_row(const BlockTable& table, int pos) { return table.physical_row(pos); }

struct AttentionShape {
  int n_heads;
  int n_kv_heads;
  int head_dim;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // One line for a run's header: the backend, its device or thread count.
  virtual std::string describe() const = 0;
  // Whether the backend's memory is host memory a program may read directly (the CPU's; a GPU's is not:
  // chapters measure resident pages only on the CPU).
  virtual bool host_memory() const = 0;

  // ---- memory ----
  virtual float* allocate(std::size_t floats) = 0;  // uninitialised
  virtual void release(float* p) = 0;
  // Integers in backend memory (token ids, positions): what operations read instead of launch arguments, so
  // that a recorded step can be replayed at another position.
  virtual int* allocate_ints(std::size_t count) = 0;  // uninitialised
  virtual void release(int* p) = 0;
  virtual void from_host(int* dst, const int* host, std::size_t count) = 0;
  virtual void to_host(int* host, const int* src, std::size_t count) = 0;
  // Weights the operations can read, copied into backend memory once and held until the backend is
  // destroyed: a vector or a table (embedding rows) as it is; a weight matrix (rows, cols), row-major on the
  // host, in the layout this backend's matmul reads (the CPU stores it transposed, cpu_backend.cpp says why;
  // a GPU as it is). The host copy (a mapped checkpoint) may go away afterwards.
  virtual const float* upload_weights(const float* host, std::size_t floats) = 0;
  virtual const float* upload_matrix(const float* host, int rows, int cols) = 0;
  // Within the backend. The two ranges must not overlap (a GPU copy of overlapping ranges is undefined):
  // both backends refuse it (check_no_overlap).
  virtual void copy(float* dst, const float* src, std::size_t floats) = 0;
  virtual void to_host(float* host, const float* src, std::size_t floats) = 0;
  virtual void from_host(float* dst, const float* host, std::size_t floats) = 0;
  // Returns once every operation called so far has finished (see Ordering above).
  virtual void synchronize() = 0;
  // Bytes the backend could still allocate, where the device says (a GPU: its free memory); -1 where it
  // does not (the CPU, whose operating system hands out address space lazily: a stated budget,
  // --memory-limit, is its limit instead).
  virtual std::int64_t free_memory_bytes() const { return -1; }
  // Scratch floats attention needs for views of up to max_rows rows, in calls of up to max_sequences
  // sequences (attention_batch), allocated once by the model.
  virtual std::size_t attention_scratch_floats(const AttentionShape& shape, int max_rows, int max_sequences) const = 0;

  // ---- recording (see Recording above) ----
  virtual bool can_record() const { return false; }
  // Returns the recording's number, which replay() takes: replaying anything but the last recording is
  // refused (std::logic_error), since an older one may point at memory freed since.
  virtual int begin_recording() { throw std::logic_error(std::string(name()) + " cannot record operations"); }
  virtual void end_recording() { throw std::logic_error(std::string(name()) + " cannot record operations"); }
  virtual void replay(int /*recording*/) { throw std::logic_error(std::string(name()) + " cannot record operations"); }
  // How many launches the last recording holds (kernels and copies: a CUDA graph's nodes), 0 before one.
  virtual int recorded_launches() const { return 0; }

  // ---- operations ----
  // Integer arguments in backend memory: tokens (n) token ids, positions (n) absolute positions.
  // x (n, dim) = table[tokens[i]] rows
  virtual void embed(float* x, const float* table, const int* tokens, int n, int dim) = 0;
  // out (n, d_out) = x (n, d_in) · wᵀ, w (d_out, d_in) uploaded by upload_matrix(host, d_out, d_in)
  virtual void matmul(float* out, const float* x, const float* w, int n, int d_in, int d_out) = 0;
  // out (n, dim) = x / sqrt(mean(x²) + eps) ⊙ weight, row by row
  virtual void rmsnorm(float* out, const float* x, const float* weight, int n, int dim) = 0;
  // table (n, head_dim/2, 2) = [cos, sin] of positions[0 .. n-1] (see rope.h)
  virtual void rope_table(float* table, const int* positions, int n, int head_dim) = 0;
  // rotate x (n, heads, head_dim) in place with the table of the same n positions
  virtual void rope(float* x, const float* table, int n, int heads, int head_dim) = 0;
  // out (n, n_heads·head_dim) = softmax(q kᵀ / sqrt(head_dim), masked by key_visible) v for queries
  // q (n, n_heads·head_dim) at positions[0 .. n-1] (consecutive: positions[i] = positions[0] + i), over the
  // rows of `kv`. If `weights` is not null it receives the softmax weights themselves, (n, n_heads, kv.rows),
  // 0 on rows a query may not see: the one attention implementation, observed (chapters 04-05), not a
  // second copy of it. reference_attention.h says the same in plain loops; every backend is tested against it.
  virtual void attention(float* out, const float* q, const int* positions, int n, const KvView& kv,
                         const AttentionShape& shape, std::span<float> scratch, float* weights) = 0;
  // One sequence's queries in attention_batch: rows [offset, offset + n) of q, out and positions, over its view.
  struct AttentionPart {
    int offset;
    int n;
    KvView kv;
  };
  // attention() for the sequences of a batch (chapter 08), each part's queries over its own view, no observer.
  // Defined as one attention() call per part, in order - the default implementation; a backend may run the
  // parts as one operation, because a decode step of B sequences is B attention calls of one query each: on
  // the CPU too small to be worth handing to another thread one by one, on a GPU launches that take longer
  // than their work. Either way each part gets the bits its attention() call alone gives (tested).
  virtual void attention_batch(float* out, const float* q, const int* positions, std::span<const AttentionPart> parts,
                               const AttentionShape& shape, std::span<float> scratch) {
    const std::size_t dim = std::size_t(shape.n_heads) * shape.head_dim;
    for (const AttentionPart& p : parts)
      attention(out + p.offset * dim, q + p.offset * dim, positions + p.offset, p.n, p.kv, shape, scratch, nullptr);
  }
  // rows[ring.write_slot(positions[i])] (width floats, rows row_stride floats apart) = src[i] (n, width): a
  // cache write whose positions are read from backend memory and turned into rows there (ring.h's one
  // definition of the slot; Ring::unbounded() for row p = position p), so a recorded decode step writes the
  // right row at every position.
  virtual void write_rows(float* rows, int row_stride, const int* positions, Ring ring, const float* src, int n,
                          int width) = 0;
  // A layer's cache write, keys and values alike: write_rows of k (n, width) into `keys`, then of v into `values`,
  // the two with one stride, positions and ring - the definition, the default implementation. A GPU does both in
  // one launch, since a decode step's write is two rows of a few hundred bytes and a launch costs more than its
  // copy (a backend whose fused_tokens() is 0 runs the definition).
  virtual void write_key_value_rows(float* keys, float* values, int row_stride, const int* positions, Ring ring,
                                    const float* k, const float* v, int n, int width) {
    write_rows(keys, row_stride, positions, ring, k, n, width);
    write_rows(values, row_stride, positions, ring, v, n, width);
  }
  // slot_positions[ring.write_slot(positions[i])] = positions[i] for i < n: which position each slot of a ring
  // holds (a KvView's row_positions), kept in backend memory by the same arithmetic as write_rows.
  virtual void write_positions(int* slot_positions, const int* positions, Ring ring, int n) = 0;
  // rows[table.physical_row(positions[i])] = src[i] (n, width): a paged cache's write (chapter 08,
  // block_table.h), the table's blocks in backend memory; rows row_stride floats apart from `rows`, the pool.
  virtual void write_paged_rows(float* rows, int row_stride, const int* positions, BlockTable table, const float* src,
                                int n, int width) = 0;
  // Quantize on write (chapter 10): row write_row(ring, positions[i]) of `rows` = src[i] (n, rows.width), coded
  // in rows.format - each row's groups by CodedRows::encode_group, the one definition; rows' codes and scales
  // in backend memory. write_paged_coded_rows: the row table.physical_row(positions[i]) of a paged pool.
  virtual void write_coded_rows(const CodedRows& rows, const int* positions, Ring ring, const float* src, int n) = 0;
  virtual void write_paged_coded_rows(const CodedRows& rows, const int* positions, BlockTable table, const float* src,
                                      int n) = 0;
  // One sequence of a write_paged_batch: rows [offset, offset + n) of positions, k and v, through its block table.
  struct PagedPart {
    int offset;
    int n;
    BlockTable table;
  };
  // One layer's cache write for the sequences of a batch whose caches share a pool (chapter 08, KvCache::
  // paged_write): each part's rows of k (n, keys.width) into `keys` and of v into `values`, at the rows its table
  // maps their positions to. A side whose format is kFp32 is float rows (its codes, width floats a row); another
  // is coded as it is written (chapter 10). Parts in order of offset, none overlapping the next. Defined as
  // write_paged_rows (or write_paged_coded_rows) for each part, keys then values, in order: the default
  // implementation. A GPU writes them all in one launch: at batch 64 a layer would otherwise launch 128 kernels of
  // a row each, a launch costing more than its copy. Two parts mapping a position to the same row (only the break
  // experiments do: chapter 08's block freed twice, chapter 09's copy-on-write turned off) land in the
  // definition's order, the last part's row whole; in one launch the row may end up any mix of the two.
  virtual void write_paged_batch(const CodedRows& keys, const CodedRows& values, const int* positions,
                                 std::span<const PagedPart> parts, const float* k, const float* v) {
    for (const PagedPart& p : parts)
      for (const auto& [side, src] : {std::pair{&keys, k}, std::pair{&values, v}}) {
        const float* rows = src + std::size_t(p.offset) * side->width;
        if (side->format == KvFormat::kFp32)
          write_paged_rows(reinterpret_cast<float*>(side->codes), side->width, positions + p.offset, p.table, rows, p.n,
                           side->width);
        else
          write_paged_coded_rows(*side, positions + p.offset, p.table, rows, p.n);
      }
  }
  // Per-channel quantize (chapter 10, KIVI's keys): token groups [first_group, first_group + groups) of `rows`
  // (rows.token_group > 0), now complete, from src (groups · rows.token_group, rows.width) floats - each channel
  // pair of each group by CodedRows::encode_channel_pair, the one definition.
  virtual void encode_channel_groups(const CodedRows& rows, int first_group, int groups, const float* src) = 0;
  // gate (count) = silu(gate) ⊙ up
  virtual void swiglu(float* gate, const float* up, std::size_t count) = 0;
  // x (count) += y
  virtual void add(float* x, const float* y, std::size_t count) = 0;

  // ---- fused operations ----
  // What a layer does around its attention, as three calls a backend may run as fewer, larger kernels: for
  // the few tokens of a decode step a GPU spends longer launching an operation than running it, and reads the
  // weights once whatever the kernel does with them (book 07). Each is defined by the operations above; that
  // definition is the default implementation (the CPU's, bit for bit what the model computed before), and
  // its intermediates are the buffers the caller passes, which a fusing backend may leave untouched.
  // fused_tokens(): the most tokens per call a backend runs them fused (0: never; larger calls take the
  // definition).
  virtual int fused_tokens() const { return 0; }

  // One product of norm_products: out (n, d_out) = normed · wᵀ (w uploaded by upload_matrix), then, when
  // `rope` is not null, RoPE with that table (n, head_dim/2, 2) on out's d_out / head_dim heads; then, when
  // `cache_rows` is not null, out's rows written into a cache as write_rows(cache_rows, cache_row_stride,
  // positions, cache_ring, out, n, d_out) writes them: a layer's cache write (KvCache::rows_write), on a GPU
  // stored by the product's own kernel.
  struct Product {
    float* out;
    const float* w;
    int d_out;
    const float* rope = nullptr;
    float* cache_rows = nullptr;
    int cache_row_stride = 0;
    Ring cache_ring = Ring::unbounded();
    const int* positions = nullptr;  // (n), backend memory
  };
  // normed (n, d_in) = rmsnorm(x, norm_weight), then each product of normed: a sub-layer's input products
  // (attention's q, k, v; the classifier).
  virtual void norm_products(float* normed, const float* x, const float* norm_weight, int n, int d_in, int head_dim,
                             std::span<const Product> products) {
    rmsnorm(normed, x, norm_weight, n, d_in);
    for (const Product& p : products) {
      matmul(p.out, normed, p.w, n, d_in, p.d_out);
      if (p.rope) rope(p.out, p.rope, n, p.d_out / head_dim, head_dim);
      if (p.cache_rows) write_rows(p.cache_rows, p.cache_row_stride, p.positions, p.cache_ring, p.out, n, p.d_out);
    }
  }
  // gate (n, hidden) = silu(normed · w1ᵀ) ⊙ (normed · w3ᵀ), normed (n, d_in) = rmsnorm(x, norm_weight), up
  // (n, hidden) = normed · w3ᵀ: the MLP's first half.
  virtual void norm_swiglu(float* gate, float* up, float* normed, const float* x, const float* norm_weight,
                           const float* w1, const float* w3, int n, int d_in, int hidden) {
    rmsnorm(normed, x, norm_weight, n, d_in);
    matmul(gate, normed, w1, n, d_in, hidden);
    matmul(up, normed, w3, n, d_in, hidden);
    swiglu(gate, up, std::size_t(n) * hidden);
  }
  // x (n, d_out) += product (n, d_out) = in (n, d_in) · wᵀ: a sub-layer's output added to the residual stream.
  virtual void matmul_add(float* x, float* product, const float* in, const float* w, int n, int d_in, int d_out) {
    matmul(product, in, w, n, d_in, d_out);
    add(x, product, std::size_t(n) * d_out);
  }
};

// Throws std::invalid_argument when [dst, dst + floats) and [src, src + floats) overlap.
inline void check_no_overlap(const float* dst, const float* src, std::size_t floats) {
  if (floats > 0 && dst < src + floats && src < dst + floats)
    throw std::invalid_argument("copy: the source and destination ranges overlap");
}

// Backend memory that frees itself: floats (Buffer) or integers (IntBuffer).
template <typename T>
class BackendArray {
 public:
  BackendArray() = default;
  BackendArray(Backend& backend, std::size_t count) : backend_(&backend), data_(allocate(backend, count)), size_(count) {}
  ~BackendArray() { reset(); }
  BackendArray(BackendArray&& o) noexcept : backend_(o.backend_), data_(o.data_), size_(o.size_) {
    o.data_ = nullptr, o.size_ = 0;
  }
  BackendArray& operator=(BackendArray&& o) noexcept {
    if (this != &o) {
      reset();
      backend_ = o.backend_, data_ = o.data_, size_ = o.size_;
      o.data_ = nullptr, o.size_ = 0;
    }
    return *this;
  }
  BackendArray(const BackendArray&) = delete;
  BackendArray& operator=(const BackendArray&) = delete;

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  static T* allocate(Backend& backend, std::size_t count) {
    if constexpr (std::is_same_v<T, int>) return backend.allocate_ints(count);
    else return backend.allocate(count);
  }
  void reset() {
    if (data_) backend_->release(data_);
    data_ = nullptr, size_ = 0;
  }
  Backend* backend_ = nullptr;
  T* data_ = nullptr;
  std::size_t size_ = 0;
};
using Buffer = BackendArray<float>;
using IntBuffer = BackendArray<int>;

// Positions first .. first + n - 1 in backend memory (for a rope_table outside a forward pass, and tests).
inline IntBuffer consecutive_positions(Backend& backend, int first, int n) {
  std::vector<int> host(std::size_t(std::max(n, 0)));
  for (int i = 0; i < n; ++i) host[i] = first + i;
  IntBuffer positions(backend, host.size());
  backend.from_host(positions.data(), host.data(), host.size());
  return positions;
}

}  // namespace kvs
