#include "cpu_backend.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <new>

#include "cli.h"
#include "rope.h"
#include "worker_pool.h"

namespace kvs {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::OuterStride<>;
constexpr float kRmsEps = 1e-5f;

// Work is handed to other threads in tasks of at least this many multiply-adds (~10 us on one core):
// handing a task over costs a round trip between cores (worker_pool.h), and a decode step of the shipped
// model is ~40 operations of 1-30 us. Measured there with 2 threads (03_benchmark --breakdown): splitting
// every matrix product into 32-column tasks made a step at context 32 slower, 0.112 ms against 0.089 with
// one thread; products of its size now run on one core, attention over long contexts on two.
constexpr std::int64_t kTaskMultiplyAdds = 1 << 17;

// A matrix product's tasks: whole groups of 16 output columns (rows of the weight matrix), each at least
// kTaskMultiplyAdds. The split depends on the shapes only, never on the thread count, so every output is
// the same sum in the same order on 1 or 2 threads (bit-identical results, tested).
int matmul_columns_per_task(int n, int d_in, int d_out) {
  const std::int64_t per_column = std::int64_t(n) * d_in;
  const std::int64_t columns = (kTaskMultiplyAdds + per_column - 1) / per_column;
  return static_cast<int>(std::min<std::int64_t>(d_out, (columns + 15) / 16 * 16));
}

// Softmax in place over s[0, count): scaled scores in, probabilities out. Vectorised: Eigen's exp runs on
// whole SIMD registers (std::exp in a loop ran one float at a time and was most of attention's time at long
// context). A -inf score weighs ~0, not always 0: Eigen's exp clamps its argument on some instruction sets
// (without -march=native, exp(-inf) came out as 2e-36). Whoever masks with -inf zeroes those rows after.
// (Selecting 0 for -inf inside the expression made Eigen 3.4 evaluate it one float at a time: attention
// at 512 positions took 0.117 ms instead of 0.046.)
void softmax(float* s, int count) {
  Eigen::Map<Eigen::ArrayXf> a(s, count);
  a = (a - a.maxCoeff()).exp();
  a *= 1.0f / a.sum();
}

}  // namespace

// Nothing process-wide is set here: two backends in one process must not change each other's thread count.
// Each backend owns its team of threads; Eigen itself always runs on the calling thread.
CpuBackend::CpuBackend(int threads)
    : threads_(threads > 0 ? threads : available_cores()), pool_(std::make_unique<WorkerPool>(threads_)) {}

CpuBackend::~CpuBackend() = default;

float* CpuBackend::allocate(std::size_t floats) {
  // Uninitialised, like malloc: every buffer is written before it is read, and the operating system
  // only backs pages with memory when they are first written (chapter 03 measures that).
  try {
    return static_cast<float*>(Eigen::internal::aligned_malloc(std::max<std::size_t>(floats, 1) * sizeof(float)));
  } catch (const std::bad_alloc&) {
    throw std::runtime_error("cannot allocate " + format_bytes(double(floats) * sizeof(float)) +
                             " of memory; use fewer positions or a smaller model");
  }
}

void CpuBackend::release(float* p) { Eigen::internal::aligned_free(p); }

int* CpuBackend::allocate_ints(std::size_t count) {
  static_assert(sizeof(int) == sizeof(float));
  return reinterpret_cast<int*>(allocate(count));  // the same aligned block; freed by release(int*)
}

void CpuBackend::release(int* p) { Eigen::internal::aligned_free(p); }

void CpuBackend::from_host(int* dst, const int* host, std::size_t count) {
  if (count > 0 && dst != host) std::memcpy(dst, host, count * sizeof(int));
}

std::string CpuBackend::describe() const {
  return std::string(name()) + ", " + std::to_string(threads_) + " thread" + (threads_ > 1 ? "s" : "");
}

void CpuBackend::copy(float* dst, const float* src, std::size_t floats) {
  check_no_overlap(dst, src, floats);
  if (floats > 0) std::memcpy(dst, src, floats * sizeof(float));
}

std::size_t CpuBackend::attention_scratch_floats(const AttentionShape& shape, int max_rows) const {
  return std::size_t(shape.n_heads) * kQueryBlock * max_rows;
}

void CpuBackend::embed(float* x, const float* table, const int* tokens, int n, int dim) {
  for (std::size_t i = 0; i < std::size_t(n); ++i)
    std::memcpy(x + i * dim, table + std::size_t(tokens[i]) * dim, dim * sizeof(float));
}

void CpuBackend::matmul(float* out, const float* x, const float* w, int n, int d_in, int d_out) {
  Eigen::Map<const RowMajor> X(x, n, d_in);
  const int columns_per_task = matmul_columns_per_task(n, d_in, d_out);
  pool_->run((d_out + columns_per_task - 1) / columns_per_task, [&](int task) {
    const int first = task * columns_per_task, columns = std::min(columns_per_task, d_out - first);
    Eigen::Map<const RowMajor> W(w + std::size_t(first) * d_in, columns, d_in);     // (columns, d_in)
    Eigen::Map<RowMajor, 0, Strided> Out(out + first, n, columns, Strided(d_out));  // (n, columns)
    // One position is a matrix-vector product (Eigen dispatches it to GEMV), many are a GEMM.
    Out.noalias() = X * W.transpose();
  });
}

void CpuBackend::rmsnorm(float* out, const float* x, const float* weight, int n, int dim) {
  Eigen::Map<const Eigen::VectorXf> w(weight, dim);
  for (int i = 0; i < n; ++i) {
    Eigen::Map<const Eigen::VectorXf> xi(x + std::size_t(i) * dim, dim);
    const float inv_rms = 1.0f / std::sqrt(xi.squaredNorm() / dim + kRmsEps);
    Eigen::Map<Eigen::VectorXf>(out + std::size_t(i) * dim, dim) = (xi * inv_rms).cwiseProduct(w);
  }
}

void CpuBackend::rope_table(float* table, const int* positions, int n, int head_dim) {
  const int pairs = head_dim / 2;
  for (int i = 0; i < n; ++i)
    for (int p = 0; p < pairs; ++p) rope_cos_sin(positions[i], p, head_dim, table + (std::size_t(i) * pairs + p) * 2);
}

void CpuBackend::rope(float* x, const float* table, int n, int heads, int head_dim) {
  const int pairs = head_dim / 2;
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < heads; ++h) {
      float* head = x + (std::size_t(i) * heads + h) * head_dim;
      for (int p = 0; p < pairs; ++p) rope_rotate(head + 2 * p, table + (std::size_t(i) * pairs + p) * 2);
    }
}

void CpuBackend::attention(float* out, const float* q, const int* positions, int n, const KvView& kv,
                           const AttentionShape& shape, std::span<float> scratch, float* weights) {
  const int pos = positions[0];  // queries i at pos + i (backend.h)
  // Each head owns a fixed slice of the scratch, (kQueryBlock, max_rows) scores, whatever this view's size.
  const std::size_t head_stride = scratch.size() / shape.n_heads;
  if (std::size_t(kQueryBlock) * kv.rows > head_stride)
    throw std::invalid_argument("attention: the view has " + std::to_string(kv.rows) +
                                " rows, more than the scratch was sized for");
  if (kv.read_rope && kv.window.size < 1)
    throw std::invalid_argument("attention: read-time rotation needs a window (its table covers its positions)");
  const int head_dim = shape.head_dim, dim = shape.n_heads * head_dim;
  const int group = shape.n_heads / shape.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const float minus_inf = -std::numeric_limits<float>::infinity();

  // Keys cached unrotated (chapter 04's streaming variant): a query at a time, each visible key rotated by
  // its position within the window as it is read (kv_cache.h), into one dot product. The softmax and the
  // weighted sum are the same as below; only the scores differ in how they are made.
  auto one_head_rotating_at_read = [&](int h) {
    const int kv_head = h / group, pairs = head_dim / 2;
    float* scores = scratch.data() + h * head_stride;  // (rows)
    for (int i = 0; i < n; ++i) {
      const int query_pos = pos + i;
      const float* table = kv.read_rope;  // (window.size, pairs, 2)
      const float* query = q + std::size_t(i) * dim + h * head_dim;  // unrotated: rotated pair by pair below
      const float* query_cos_sin = table + std::size_t(rotary_query_position(query_pos, kv.window)) * pairs * 2;
      float max_score = minus_inf;
      for (int r = 0; r < kv.rows; ++r) {
        const int key_pos = kv.position_of(r);
        scores[r] = minus_inf;
        if (!key_visible(query_pos, key_pos, kv.window)) continue;
        const float* key = kv.keys + std::size_t(r) * kv.row_stride + kv_head * head_dim;
        const float* cos_sin = table + std::size_t(rotary_key_position(query_pos, key_pos, kv.window)) * pairs * 2;
        float dot = 0.0f;
        for (int p = 0; p < pairs; ++p) {
          float k_pair[2] = {key[2 * p], key[2 * p + 1]}, q_pair[2] = {query[2 * p], query[2 * p + 1]};
          rope_rotate(k_pair, cos_sin + 2 * p);
          rope_rotate(q_pair, query_cos_sin + 2 * p);  // recomputed per row: no scratch for a rotated query
          dot += q_pair[0] * k_pair[0] + q_pair[1] * k_pair[1];
        }
        scores[r] = dot * scale;
        max_score = std::max(max_score, scores[r]);
      }
      float* o = out + std::size_t(i) * dim + h * head_dim;
      float* observed = weights ? weights + (std::size_t(i) * shape.n_heads + h) * kv.rows : nullptr;
      std::fill(o, o + head_dim, 0.0f);
      if (observed) std::fill(observed, observed + kv.rows, 0.0f);
      if (max_score == minus_inf) continue;  // nothing visible: 0, as below
      float sum = 0.0f;
      for (int r = 0; r < kv.rows; ++r)
        if (scores[r] != minus_inf) sum += (scores[r] = std::exp(scores[r] - max_score));
      for (int r = 0; r < kv.rows; ++r) {
        if (scores[r] == minus_inf) continue;  // never read: the row may hold anything
        const float weight = scores[r] / sum;
        if (observed) observed[r] = weight;
        const float* value = kv.values + std::size_t(r) * kv.row_stride + kv_head * head_dim;
        for (int d = 0; d < head_dim; ++d) o[d] += weight * value[d];
      }
    }
  };

  auto one_head = [&](int h) {
    if (kv.read_rope) return one_head_rotating_at_read(h);
    const int kv_head = h / group;  // the KV head this query head reads
    float* scores_mem = scratch.data() + h * head_stride;
    for (int q0 = 0; q0 < n; q0 += kQueryBlock) {
      const int nq = std::min(kQueryBlock, n - q0);
      const int first_query = pos + q0, last_query = pos + q0 + nq - 1;
      // The rows the block reads, [begin, end). Rows past its last query are future for every query of the
      // block: not even multiplied. Where each query's visible rows are one run (visible_rows), the block
      // reads the union of the runs, every row of which some query sees; elsewhere key_visible decides row
      // by row below.
      int begin = 0, end = kv.rows_to_visit(last_query), first_end = 0, last_begin = 0;
      const bool runs = kv.visible_rows(first_query, begin, first_end) && kv.visible_rows(last_query, last_begin, end);
      const int rows = end - begin;
      Eigen::Map<const RowMajor, 0, Strided> K(kv.keys + std::size_t(begin) * kv.row_stride + kv_head * head_dim, rows,
                                               head_dim, Strided(kv.row_stride));
      Eigen::Map<const RowMajor, 0, Strided> V(kv.values + std::size_t(begin) * kv.row_stride + kv_head * head_dim,
                                               rows, head_dim, Strided(kv.row_stride));
      Eigen::Map<const RowMajor, 0, Strided> Q(q + std::size_t(q0) * dim + h * head_dim, nq, head_dim, Strided(dim));
      Eigen::Map<RowMajor, 0, Strided> O(out + std::size_t(q0) * dim + h * head_dim, nq, head_dim, Strided(dim));
      Eigen::Map<RowMajor> S(scores_mem, nq, rows);  // (nq, rows): row r of S is view row begin + r
      // The scale is applied to the visible scores below: folded into the product, it makes Eigen allocate
      // a temporary for a single query, i.e. on every decode step.
      S.noalias() = Q * K.transpose();
      // A row that no query of the block may see (an empty slot, a row outside the window) must not enter
      // the product below, whatever its bytes. Checked at the block's first and last query: a row only a
      // middle query sees is flagged too, which costs the exact path below, never a wrong result.
      bool unseen_row = false;
      for (int r = 0; r < rows && !runs && !unseen_row; ++r)
        unseen_row = !key_visible(last_query, kv.position_of(r), kv.window) &&
                     !key_visible(first_query, kv.position_of(r), kv.window);
      for (int i = 0; i < nq; ++i) {
        float* s = S.row(i).data();
        const int query_pos = first_query + i;
        int visible_begin = 0, visible_end = rows;
        if (runs) {  // the query's run, then every score outside it a weight of 0
          kv.visible_rows(query_pos, visible_begin, visible_end);
          visible_begin -= begin;
          visible_end -= begin;
          std::fill(s, s + visible_begin, 0.0f);
          std::fill(s + visible_end, s + rows, 0.0f);
        } else {  // a masked score is -inf: a weight of exactly 0 after the softmax
          for (int r = 0; r < rows; ++r)
            if (!key_visible(query_pos, kv.position_of(r), kv.window)) s[r] = minus_inf;
          if (std::find_if(s, s + rows, [&](float v) { return v != minus_inf; }) == s + rows) visible_end = 0;
        }
        if (visible_end <= visible_begin) {  // nothing visible (only a deliberately broken cache gets here)
          std::fill(s, s + rows, 0.0f);
          continue;
        }
        Eigen::Map<Eigen::ArrayXf>(s + visible_begin, visible_end - visible_begin) *= scale;
        softmax(s + visible_begin, visible_end - visible_begin);
        if (!runs)  // a masked row weighs exactly 0 (see softmax)
          for (int r = 0; r < rows; ++r)
            if (!key_visible(query_pos, kv.position_of(r), kv.window)) s[r] = 0.0f;
      }
      if (weights)  // rows outside [begin, end) are invisible to every query of the block: weight 0
        for (int i = 0; i < nq; ++i) {
          float* observed = weights + (std::size_t(q0 + i) * shape.n_heads + h) * kv.rows;
          std::fill(observed, observed + kv.rows, 0.0f);
          std::copy(S.row(i).data(), S.row(i).data() + rows, observed + begin);
        }
      if (!unseen_row) {
        O.noalias() = S * V;  // every row is seen by some query of the block: its bytes are real keys/values
        continue;
      }
      // Some rows hold nothing this block may read: a weight of 0 times a NaN in such a row would still be
      // NaN, so the output sums over the visible rows only.
      for (int i = 0; i < nq; ++i) {
        O.row(i).setZero();
        const int query_pos = first_query + i;
        for (int r = 0; r < rows; ++r)
          if (key_visible(query_pos, kv.position_of(r), kv.window)) O.row(i).noalias() += S(i, r) * V.row(r);
      }
    }
  };
  // Heads are independent: a task each, on other threads only when there is enough work to pay for it
  // (kTaskMultiplyAdds; with the shipped model, decode from 512 positions on). Same results either way.
  // Counted over the rows attention reads, not the view's: a preallocated cache shows its whole buffer
  // (counting its rows sent 32-position steps of a 2048-position cache to two threads).
  const std::int64_t multiply_adds = 2 * std::int64_t(n) * kv.rows_to_visit(pos + n - 1) * shape.n_heads * head_dim;
  if (multiply_adds >= kTaskMultiplyAdds) pool_->run(shape.n_heads, one_head);
  else for (int h = 0; h < shape.n_heads; ++h) one_head(h);
}

void CpuBackend::write_rows(float* rows, int row_stride, const int* slots, const float* src, int n, int width) {
  for (int i = 0; i < n; ++i)
    copy(rows + std::size_t(slots[i]) * row_stride, src + std::size_t(i) * width, std::size_t(width));
}

void CpuBackend::swiglu(float* gate, const float* up, std::size_t count) {
  // silu(g) * up, vectorised (Eigen's exp).
  Eigen::Map<Eigen::ArrayXf> g(gate, count);
  g = g / (1.0f + (-g).exp()) * Eigen::Map<const Eigen::ArrayXf>(up, count);
}

void CpuBackend::add(float* x, const float* y, std::size_t count) {
  Eigen::Map<Eigen::VectorXf>(x, count) += Eigen::Map<const Eigen::VectorXf>(y, count);
}

}  // namespace kvs
