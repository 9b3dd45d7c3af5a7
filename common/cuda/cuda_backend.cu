// The CUDA backend: the operations of backend.h as CUDA kernels, matrix products through cuBLAS (behind
// blas.h's one function). The same file is compiled twice: by nvcc into the GPU backend, and by g++ with
// KVS_CUDA_HARNESS into a backend whose kernels run on the CPU through the CUDA harness (tests).
//
// Memory layout: every tensor row-major fp32, as backend.h states; a KvView's rows are `row_stride`
// floats apart with the KV heads side by side in a row (chapter 03's layout). Every kernel below states
// its launch geometry. Kernels that reduce across a warp need whole warps: their block sizes are multiples
// of 32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cuda/cuda_support.h"
#include "backend.h"
#include "cuda/cuda_backend.h"
#include "kv_cache.h"
#include "number_text.h"
#include "rope.h"

#if defined(KVS_CUDA_HARNESS)
#include "cuda/harness/blas_harness.h"
#else
#include "cuda/blas_cublas.h"
#endif

namespace kvs {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr float kRmsEps = 1e-5f;  // as the CPU backend and llama2.c

// ---- kernels ----
// Every kernel starts with KVS_WAIT_FOR_PREVIOUS_KERNEL() (cuda_support.h): launched programmatically, as this
// backend launches them on compute capability 9.0 and later, a kernel may start before the one ahead of it has
// finished, and must not touch memory before that wait - but weights, which no kernel writes (gemv_kernel loads
// its first ones there). The harness runs a kernel's first block up to the wait before the kernel ahead finishes
// and reports a thread that synchronises or ends before it; a test reads each kernel's source for it.

// Sum of v over the 32 lanes of the calling warp, in every lane.
__device__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Sums each of kValues values (a power of two) over the warp's 32 lanes, halving the values each lane keeps at
// every step (a reduce-scatter): 31 shuffles for 32 values where a warp_sum each would take 160. Afterwards
// lane l holds the sums of values l · kValues / 32 + i in values[i], i < max(1, kValues / 32) (for fewer than
// 32 values, 32 / kValues lanes hold each sum).
template <int kValues>
__device__ void warp_sum_each(float (&values)[kValues]) {
  const int lane = threadIdx.x % kWarp;
  int count = kValues;
  KVS_UNROLL
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    if (count == 1) {  // nothing left to halve: a plain sum
      values[0] += __shfl_xor_sync(kFullMask, values[0], offset);
      continue;
    }
    const int half = count / 2;
    const bool upper = lane & offset;  // keeps the upper half of its values, sends its partner the lower
    KVS_UNROLL
    for (int i = 0; i < kValues / 2; ++i) {
      if (i >= half) break;
      const float send = upper ? values[i] : values[i + half], keep = upper ? values[i + half] : values[i];
      values[i] = keep + __shfl_xor_sync(kFullMask, send, offset);
    }
    count = half;
  }
}

template <int kWidth>
struct Floats {
  float v[kWidth];
};
// kWidth floats from p in one load where kWidth is 4 (p on 16 bytes) or 2 (p on 8 bytes), one at a time otherwise:
// the products' weight loads and the decoding kernel's row loads.
template <int kWidth>
__device__ Floats<kWidth> load_floats(const float* p) {
  Floats<kWidth> f;
  if constexpr (kWidth == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    f.v[0] = q.x, f.v[1] = q.y, f.v[2] = q.z, f.v[3] = q.w;
  } else if constexpr (kWidth == 2) {
    const float2 q = *reinterpret_cast<const float2*>(p);
    f.v[0] = q.x, f.v[1] = q.y;
  } else {
    for (int k = 0; k < kWidth; ++k) f.v[k] = p[k];
  }
  return f;
}

// Sum of v over the block, in every thread. blockDim.x: a multiple of 32, at most 1024. Every thread of the
// block must call it (it holds two barriers).
__device__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  __shared__ float total;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < warps ? warp_sums[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// 1 / sqrt(mean(x²) + eps) of a row of `dim` floats whose squares sum to sum_of_squares: RMSNorm's scale, for
// rmsnorm_kernel and the norm gemv_kernel folds into its products.
__device__ float inverse_rms(float sum_of_squares, int dim) { return 1.0f / sqrtf(sum_of_squares / dim + kRmsEps); }

// silu(gate) ⊙ up for one element: swiglu_kernel's, and gemv_kernel's when it fuses SwiGLU.
__device__ float swiglu_of(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

// x (n, dim) = table[tokens[i]] rows. Grid (n), block 256: block i copies row i, its threads stride over dim.
__global__ void embed_kernel(float* x, const float* table, const int* tokens, int dim) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const std::size_t i = blockIdx.x;
  const float* row = table + std::size_t(tokens[i]) * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) x[i * dim + d] = row[d];
}

// out (n, dim) = x / sqrt(mean(x²) + eps) ⊙ weight. Grid (n), block 256 (a multiple of 32): block i owns
// row i; its threads stride over dim for the sum of squares, then for the output.
__global__ void rmsnorm_kernel(float* out, const float* x, const float* weight, int dim) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const std::size_t row = std::size_t(blockIdx.x) * dim;
  float squares = 0.0f;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) squares += x[row + d] * x[row + d];
  const float inv_rms = inverse_rms(block_sum(squares), dim);
  for (int d = threadIdx.x; d < dim; d += blockDim.x) out[row + d] = x[row + d] * inv_rms * weight[d];
}

// table (n, head_dim/2, 2) = [cos, sin] of positions[0 .. n-1] (device memory): rope.h's one definition.
// Grid (ceil(n · pairs / 256)), block 256: one thread per (position, pair).
__global__ void rope_table_kernel(float* table, const int* positions, int n, int head_dim) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const int pairs = head_dim / 2;
  const long index = long(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= long(n) * pairs) return;
  rope_cos_sin(positions[index / pairs], int(index % pairs), head_dim, table + std::size_t(index) * 2);
}

// What a write_rows_kernel launch copies: src[side] into rows[side], side = blockIdx.y - one side (write_rows), or
// keys and values (write_key_value_rows: a layer's cache write in one launch, not two).
struct RowSides {
  float* rows[2];
  const float* src[2];
};

// rows[write_row(where, positions[i])] = src[i]: row i of src (n, width) into the row of its position in
// `rows` (row_stride floats apart), `where` a Ring or a BlockTable (backend.h); positions and a table's blocks in
// device memory. Grid (n, sides), block 256: block (i, side) copies row i of that side, its threads stride over width.
template <typename Where>
__global__ void write_rows_kernel(RowSides sides, int row_stride, const int* positions, Where where, int width) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const std::size_t i = blockIdx.x;
  const float* src = sides.src[blockIdx.y] + i * width;
  float* row = sides.rows[blockIdx.y] + std::size_t(write_row(where, positions[i])) * row_stride;
  for (int d = threadIdx.x; d < width; d += blockDim.x) row[d] = src[d];
}

// Quantize on write (chapter 10): row write_row(where, positions[i]) of `rows` = src[i] (n, rows.width) coded.
// Grid (n), block 256: block i codes row i, a thread per group (CodedRows::encode_group, kv_format.h).
template <typename Where>
__global__ void write_coded_rows_kernel(CodedRows rows, const int* positions, Where where, const float* src) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const std::size_t i = blockIdx.x, row = write_row(where, positions[i]);
  for (int g = threadIdx.x; g < rows.groups(); g += blockDim.x) rows.encode_group(row, g, src + i * rows.width + g * rows.group);
}

// The sequences of a batch one launch takes: a batched cache write's parts (below), a decoding launch's views.
// Passed by value as kernel arguments, so a batch needs no copy to device memory first.
constexpr int kMaxBatchSequences = 64;
struct PagedParts {
  Backend::PagedPart part[kMaxBatchSequences];  // 1.5 KB
};

// A batch's cache write (write_paged_batch): row i of k into `keys` and of v into `values` (blockIdx.y: 0 keys,
// 1 values), at the row its sequence's table maps positions[i] to; float rows (kFp32, a group of one number) or
// coded ones alike. Grid (tokens, 2), block 256: block (i, side) writes row i of that side, a thread per group
// (CodedRows::encode_group). Row i's sequence: the last of the `count` parts that starts at or before it - parts
// are in order of offset, a scan of kernel arguments that every thread makes alike; a row in no part is skipped.
__global__ void write_paged_batch_kernel(CodedRows keys, CodedRows values, const int* positions, PagedParts parts,
                                         int count, const float* k, const float* v) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const int i = blockIdx.x;
  int p = 0;
  while (p + 1 < count && parts.part[p + 1].offset <= i) ++p;
  if (i >= parts.part[p].offset + parts.part[p].n) return;
  const CodedRows side = blockIdx.y == 0 ? keys : values;
  const float* src = (blockIdx.y == 0 ? k : v) + std::size_t(i) * side.width;
  const std::size_t row = write_row(parts.part[p].table, positions[i]);
  for (int g = threadIdx.x; g < side.groups(); g += blockDim.x) side.encode_group(row, g, src + g * side.group);
}

// Per-channel quantize (KIVI's keys): token group first_group + blockIdx.x from src's rows blockIdx.x · token_group
// on. Grid (groups), block 256: a thread per channel pair (CodedRows::encode_channel_pair; a pair shares each byte).
__global__ void encode_channel_groups_kernel(CodedRows rows, int first_group, const float* src) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const int t = blockIdx.x;
  for (int ch = 2 * threadIdx.x; ch < rows.width; ch += 2 * blockDim.x)
    rows.encode_channel_pair(first_group + t, ch, src + std::size_t(t) * rows.token_group * rows.width);
}

// slot_positions[ring.write_slot(positions[i])] = positions[i], i < n. Grid (1), block 256 (n: a call's
// positions, at most a prefill chunk), threads stride over i.
__global__ void write_positions_kernel(int* slot_positions, const int* positions, Ring ring, int n) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  for (int i = threadIdx.x; i < n; i += blockDim.x) slot_positions[ring.write_slot(positions[i])] = positions[i];
}

// Rotates x (n, heads, head_dim) in place. Grid (ceil(n · heads · pairs / 256)), block 256: one thread per
// (position, head, pair).
__global__ void rope_kernel(float* x, const float* table, int n, int heads, int head_dim) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const int pairs = head_dim / 2;
  const long index = long(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= long(n) * heads * pairs) return;
  const long i = index / (long(heads) * pairs), pair = index % pairs;  // position and pair; the head between
  rope_rotate(x + index * 2, table + (i * pairs + pair) * 2);
}

// Attention of one query head over the view, with an online softmax: no score buffer; the running
// maximum, sum and weighted values are rescaled as larger scores arrive, so any number of rows needs no
// scratch. A query visits only KvView::rows_to_visit rows, so a view of a whole preallocated buffer costs
// what its written prefix costs - and stays the same view at every step (a recorded decode step relies on
// that). A row that key_visible hides is skipped whole (its keys and values are never read, so an empty
// slot's bytes, NaN included, cannot leak in). Within a row, lane l holds the elements l, l + 32, ... of
// q, k, v (head_dim <= kMaxHeadDim) - or, in the decoding kernel over plain rows, elements l · kElements, ...,
// l · kElements + kElements - 1, side by side (lane_element). Two kernels use the pieces below:
//   attention_kernel: one block per (query, head) visits all the query's rows (prefill; an observed step);
//   attention_decode_kernel: decoding, one query ("flash-decoding"). One query
//     has only n_heads blocks' worth of work, too few to keep a GPU's memory busy (16 blocks on 132 SMs read
//     K/V at 37 GB/s at 16k positions), so the rows are split into chunks, one block per (KV head, group of
//     its query heads, chunk, sequence); the block serves up to 4 query heads that read that KV head (GQA:
//     each row read once, not once per query head), and each warp loads several rows before it uses any (a
//     row at a time left each warp waiting out a memory latency per row). The last block of a (KV head, group,
//     sequence) to finish merges the chunks' partial softmaxes (a second kernel did until version 4). Measured
//     on an H100, book/07.
constexpr int kMaxAttentionWarps = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / kWarp;

// The element of a head that lane `lane` holds as its j-th of kElements: lane + 32 j (a warp's 32 lanes read 32
// consecutive floats, one 4-byte load each), or, kSideBySide, lane · kElements + j (a lane's elements side by side,
// so that it loads them 16 bytes at a time: the decoding kernel over plain rows).
template <int kElements, bool kSideBySide>
__device__ __forceinline__ int lane_element(int lane, int j) { return kSideBySide ? lane * kElements + j : lane + j * kWarp; }

// Lane `lane`'s elements of a query head (0 past head_dim), rotated by the query's rotary position when
// the view rotates at read time (kv.read_rope, chapter 04; the table holds [cos, sin] per pair).
template <bool kSideBySide, int kElements>
__device__ void load_query(float (&query)[kElements], const float* query_row, const KvView& kv, int query_pos,
                           int head_dim, int lane) {
  const int pairs = head_dim / 2;
  const float* cos_sin = kv.read_rope ? kv.read_rope + std::size_t(rotary_query_position(query_pos, kv.window)) * pairs * 2 : nullptr;
  for (int j = 0; j < kElements; ++j) {
    const int d = lane_element<kElements, kSideBySide>(lane, j);
    query[j] = d >= head_dim ? 0.0f
               : cos_sin     ? rope_rotated_element(query_row, d, cos_sin + (d / 2) * 2)
                             : query_row[d];
  }
}

// Element d of view row r's key (position key_pos) in the KV head at kv_offset, as the query at query_pos
// sees it: as stored, or rotated by its rotary position when the view rotates at read time.
// KvView::key reads it as stored, or decodes it from a coded cache (chapter 10).
__device__ float key_element(const KvView& kv, int r, int key_pos, int query_pos, int kv_offset, int d, int head_dim) {
  if (!kv.read_rope) return kv.key(r, kv_offset + d);
  const float* cos_sin = kv.read_rope + std::size_t(rotary_key_position(query_pos, key_pos, kv.window)) * (head_dim / 2) * 2;
  return rope_rotated_element(kv.key(r, kv_offset + (d & ~1)), kv.key(r, kv_offset + (d | 1)), d, cos_sin + (d / 2) * 2);
}

// The scaled score q·k / sqrt(head_dim) of view row r (key at key_pos), the same in every lane of the warp.
__device__ float score_of(const float (&query)[kPerLane], const KvView& kv, int r, int key_pos, int query_pos,
                          int kv_offset, int head_dim, int lane) {
  float dot = 0.0f;
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + j * kWarp;
    if (d < head_dim) dot += query[j] * key_element(kv, r, key_pos, query_pos, kv_offset, d, head_dim);
  }
  return warp_sum(dot) * (1.0f / sqrtf(static_cast<float>(head_dim)));
}

// The larger of a and b, or NaN where either is NaN. Every running maximum of a softmax here takes it, never fmaxf,
// which returns the other operand when one is NaN: a NaN score (a NaN in a visible key, kv_format.h's promise) was
// then dropped as if its row were hidden, and the output came out finite where the reference's is NaN. With a NaN
// maximum every exp(x - max) is NaN, so the NaN reaches the sums and the output.
__device__ __forceinline__ float max_keeping_nan(float a, float b) { return a > b || a != a ? a : b; }  // a != a: NaN

// What a softmax's sums divide by at the end: o / total, 0 where no row was visible (total exactly 0, a deliberately
// broken cache: 0, as the CPU backend), NaN where total is NaN. (total > 0 ? o / total : 0 turned NaN into 0.)
__device__ __forceinline__ float normalised(float o, float total) { return total == 0.0f ? 0.0f : o / total; }

// A softmax over some rows, not yet normalised: the largest score (-inf: no row visible), the sum of
// exp(score - max), and (per element, elsewhere) the sum of exp(score - max) · v.
struct PartialSoftmax {
  float max;
  float total;
};

// The warps' partial softmaxes for each of the kHeads query heads a block serves, merged through shared
// memory at the end of a kernel: per warp and head the largest score, the sum and Σ exp(score - max) · v.
template <int kWarps, int kHeads>
struct WarpPartials {
  float warp_max[kWarps][kHeads];
  float warp_total[kWarps][kHeads];
  float warp_values[kWarps][kHeads][kMaxHeadDim];

  // Warp `warp`'s partial for head t (lane l holds elements lane_element(l, j) of its values); every lane calls it.
  template <bool kSideBySide, int kElements>
  __device__ void store(int warp, int t, float max, float total, const float (&values)[kElements], int head_dim) {
    const int lane = threadIdx.x % kWarp;
    if (lane == 0) warp_max[warp][t] = max, warp_total[warp][t] = total;
    for (int j = 0; j < kElements; ++j) {
      const int d = lane_element<kElements, kSideBySide>(lane, j);
      if (d < head_dim) warp_values[warp][t][d] = values[j];
    }
  }
  // After a barrier: the block's largest score and sum for head t, over its `warps` warps.
  __device__ PartialSoftmax merged(int t, int warps) const {
    PartialSoftmax block{-INFINITY, 0.0f};
    for (int w = 0; w < warps; ++w) block.max = max_keeping_nan(block.max, warp_max[w][t]);
    for (int w = 0; w < warps; ++w)
      if (warp_max[w][t] != -INFINITY) block.total += warp_total[w][t] * expf(warp_max[w][t] - block.max);
    return block;
  }
  // Element d of the block's Σ exp(score - block_max) · v for head t.
  __device__ float merged_value(int t, int d, float block_max, int warps) const {
    float o = 0.0f;
    for (int w = 0; w < warps; ++w)
      if (warp_max[w][t] != -INFINITY) o += warp_values[w][t][d] * expf(warp_max[w][t] - block_max);
    return o;
  }
};
using HeadPartials = WarpPartials<kMaxAttentionWarps, 1>;  // attention_kernel: a block serves one head

// One block's online softmax over the view rows [row_begin, row_end) for one query head: warp w visits rows
// row_begin + w, + warps, ...; every thread of the block must call it (it ends with a barrier). Returns the
// block's merged maximum and sum in every thread; parts.merged_value(0, ...) gives its weighted values.
__device__ PartialSoftmax attend_rows(HeadPartials& parts, const float (&query)[kPerLane], const KvView& kv,
                                      int row_begin, int row_end, int query_pos, int kv_offset, int head_dim) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  float values[kPerLane] = {};
  float running_max = -INFINITY, total = 0.0f;
  for (int r = row_begin + warp; r < row_end; r += warps) {
    const int key_pos = kv.position_of(r);
    if (!key_visible(query_pos, key_pos, kv.window)) continue;  // the same r in every lane
    const float score = score_of(query, kv, r, key_pos, query_pos, kv_offset, head_dim, lane);
    const float new_max = max_keeping_nan(running_max, score);
    const float rescale = expf(running_max - new_max);  // 0 for the first visible row
    const float weight = expf(score - new_max);
    total = total * rescale + weight;
    for (int j = 0; j < kPerLane; ++j) {
      const int d = lane + j * kWarp;
      if (d < head_dim) values[j] = values[j] * rescale + weight * kv.value(r, kv_offset + d);
    }
    running_max = new_max;
  }
  parts.store<false>(warp, 0, running_max, total, values, head_dim);
  __syncthreads();
  return parts.merged(0, warps);
}

// out (n, n_heads · head_dim), q (n, n_heads · head_dim) at positions[0 .. n-1] (device memory).
// Grid (n, n_heads) - queries in x, whose limit is 2^31 - 1 blocks, not y's 65,535 - block warps · 32
// (warps <= kMaxAttentionWarps, chosen by the caller): block (i, h) computes query i's head h over all the rows it visits. With `weights` (n, n_heads, rows) the warps then
// visit their rows again and write each row's softmax weight (0 for a hidden row): an observer's second
// pass, off by default.
__global__ void __launch_bounds__(kMaxAttentionWarps * kWarp)
    attention_kernel(float* out, float* weights, const float* q, const int* positions, KvView kv, int n_heads,
                     int group, int head_dim) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  __shared__ HeadPartials parts;
  const int i = blockIdx.x, h = blockIdx.y;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int query_pos = positions[i], kv_offset = (h / group) * head_dim, dim = n_heads * head_dim;
  const int row_end = kv.rows_to_visit(query_pos);  // the rows past the query's own position are its future
  float query[kPerLane];
  load_query<false>(query, q + std::size_t(i) * dim + h * head_dim, kv, query_pos, head_dim, lane);
  const PartialSoftmax block = attend_rows(parts, query, kv, 0, row_end, query_pos, kv_offset, head_dim);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    // Nothing visible (only a deliberately broken cache gets here): 0, as the CPU backend.
    out[std::size_t(i) * dim + h * head_dim + d] = normalised(parts.merged_value(0, d, block.max, warps), block.total);
  }
  if (!weights) return;
  float* observed = weights + (std::size_t(i) * n_heads + h) * kv.rows;
  for (int r = warp; r < kv.rows; r += warps) {
    const int key_pos = kv.position_of(r);
    const bool visible = r < row_end && key_visible(query_pos, key_pos, kv.window);
    const float weight =
        visible ? expf(score_of(query, kv, r, key_pos, query_pos, kv_offset, head_dim, lane) - block.max) / block.total : 0.0f;
    if (lane == 0) observed[r] = weight;
  }
}

// Prefill: tiles of queries and keys (FlashAttention's scheme, in fp32 on the CUDA cores). attention_kernel
// gives each (query, head) a block that reads every key and value it sees from memory: at 16,384 positions
// the synthetic model's prefill ran at 11% of the GPU's matrix-product rate (book 07). Here a block takes
// kTile consecutive queries of one head and walks the view's rows kTile at a time: each tile of keys and
// values is loaded into shared memory once and used by all the block's queries; a 16 × 16 grid of threads
// computes S = Q Kᵀ for the tile (thread (ty, tx) holds query rows ty + 16i and key columns tx + 16j, i, j
// < 4: strided, so the 16 rows a half-warp reads sit in 16 different banks) and O += P V (4 query rows of O
// each, columns tx + 16c); the softmax is online (a running maximum and sum per query row, rescaled when a
// larger score arrives). Tiles no query of the block may see are never visited (the causal future; the
// past before a window, where the view is one run of rows); within a tile key_visible decides each pair, the
// one masking rule. A row no query of the block may see (an empty ring slot; a row past the last query,
// unwritten; a row between the sinks and every query's window) is never read: zeros stand in its place. Queries
// past n (the last block) see nothing.
// Grid (n_heads, ceil(n / kTile)), block 16 · 16, dynamic shared memory attention_tiled_shared_bytes.
constexpr int kTile = 64;
constexpr int kTileSide = 16;                   // threads per side of the grid
constexpr int kTilePer = kTile / kTileSide;     // query rows and key columns per thread
// Bytes of shared memory a block needs for heads of head_dim (rounded up as the kernel is compiled). Heads up
// to 128 take this kernel where the device has that much (CudaBackend's constructor); others attention_kernel.
constexpr std::size_t attention_tiled_shared_bytes(int head_dim) {
  // q and k tiles padded by a float a row (bank spread), v, p (kTile, kTile + 1), and the key tile's positions
  return sizeof(float) * (2 * std::size_t(kTile) * (head_dim + 1) + std::size_t(kTile) * head_dim + std::size_t(kTile) * (kTile + 1)) +
         sizeof(int) * kTile;
}

template <int kHeadDim>  // head_dim rounded up to 32, 64 or 128; the columns past head_dim hold zeros
__global__ void __launch_bounds__(kTileSide * kTileSide)
    attention_tiled_kernel(float* out, const float* q, const int* positions, int n, KvView kv, int n_heads, int group,
                           int head_dim) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  KVS_DYNAMIC_SHARED(float, shared);
  constexpr int kPadded = kHeadDim + 1, kColumns = kHeadDim / kTileSide;
  float* q_tile = shared;                     // (kTile, kPadded): the block's queries, scaled by 1/sqrt(head_dim)
  float* k_tile = q_tile + kTile * kPadded;   // (kTile, kPadded)
  float* v_tile = k_tile + kTile * kPadded;   // (kTile, kHeadDim)
  float* p_tile = v_tile + kTile * kHeadDim;  // (kTile, kTile + 1): this tile's softmax numerators
  int* tile_positions = reinterpret_cast<int*>(p_tile + kTile * (kTile + 1));  // (kTile): the key tile's positions
  const int h = blockIdx.x, first = blockIdx.y * kTile, tx = threadIdx.x % kTileSide, ty = threadIdx.x / kTileSide;
  const int dim = n_heads * head_dim, kv_offset = (h / group) * head_dim;
  const int last = (first + kTile < n ? first + kTile : n) - 1;  // the block's last query
  const int first_pos = positions[first], last_pos = positions[last];
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));
  for (int e = threadIdx.x; e < kTile * kHeadDim; e += blockDim.x) {
    const int i = e / kHeadDim, d = e % kHeadDim;
    q_tile[i * kPadded + d] = first + i < n && d < head_dim ? q[std::size_t(first + i) * dim + h * head_dim + d] * scale : 0.0f;
  }
  int query_pos[kTilePer];
  float o[kTilePer][kColumns] = {}, row_max[kTilePer], row_sum[kTilePer];  // row_sum: this thread's columns' share
  KVS_UNROLL
  for (int i = 0; i < kTilePer; ++i) {
    const int query = first + ty + kTileSide * i;
    query_pos[i] = query < n ? positions[query] : -1;  // -1 sees nothing (key_visible)
    row_max[i] = -INFINITY, row_sum[i] = 0.0f;
  }
  // The rows any of the block's queries may see: one run from the first query's window start to the last
  // query's own row where the view says so (visible_rows), else every row up to the last query's.
  int begin = 0, end = kv.rows_to_visit(last_pos), first_begin, first_end, last_begin;
  if (kv.visible_rows(first_pos, first_begin, first_end) && kv.visible_rows(last_pos, last_begin, end)) begin = first_begin;

  for (int tile = begin; tile < end; tile += kTile) {
    __syncthreads();  // the last tile's k, v, p and positions are used up (and, the first time, q_tile is written)
    // A row's position, or -1 for a row no query of the block may see, once per row. The queries that see a key
    // form one run of positions from the key's own on, so the block's first query at or after it decides: the
    // rows between the sinks and a window, read before, came in as 0 · value, NaN where a value was not finite.
    if (const int j = threadIdx.x; j < kTile) {
      const int key_pos = tile + j < end ? kv.position_of(tile + j) : -1;
      const bool seen = key_pos >= 0 && key_visible(key_pos > first_pos ? key_pos : first_pos, key_pos, kv.window);
      tile_positions[j] = seen ? key_pos : -1;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kTile * kHeadDim; e += blockDim.x) {
      const int j = e / kHeadDim, d = e % kHeadDim;
      const int key_pos = tile_positions[j];
      const bool read = key_pos >= 0 && key_pos <= last_pos && d < head_dim;  // a row some query may see
      k_tile[j * kPadded + d] = read ? kv.key(tile + j, kv_offset + d) : 0.0f;  // stored or decoded (chapter 10)
      v_tile[j * kHeadDim + d] = read ? kv.value(tile + j, kv_offset + d) : 0.0f;
    }
    int key_pos[kTilePer];
    KVS_UNROLL
    for (int j = 0; j < kTilePer; ++j) key_pos[j] = tile_positions[tx + kTileSide * j];
    __syncthreads();
    float score[kTilePer][kTilePer] = {};
    for (int d = 0; d < kHeadDim; ++d) {
      float query[kTilePer], key[kTilePer];
      KVS_UNROLL
      for (int i = 0; i < kTilePer; ++i) query[i] = q_tile[(ty + kTileSide * i) * kPadded + d];
      KVS_UNROLL
      for (int j = 0; j < kTilePer; ++j) key[j] = k_tile[(tx + kTileSide * j) * kPadded + d];
      KVS_UNROLL
      for (int i = 0; i < kTilePer; ++i)
        KVS_UNROLL
        for (int j = 0; j < kTilePer; ++j) score[i][j] += query[i] * key[j];
    }
    KVS_UNROLL
    for (int i = 0; i < kTilePer; ++i) {
      float tile_max = -INFINITY;
      KVS_UNROLL
      for (int j = 0; j < kTilePer; ++j) {
        if (!key_visible(query_pos[i], key_pos[j], kv.window)) score[i][j] = -INFINITY;
        tile_max = max_keeping_nan(tile_max, score[i][j]);
      }
      for (int offset = kTileSide / 2; offset > 0; offset /= 2)  // over the 16 lanes of the row (tx)
        tile_max = max_keeping_nan(tile_max, __shfl_xor_sync(kFullMask, tile_max, offset));
      const float new_max = max_keeping_nan(row_max[i], tile_max);
      // Nothing visible to this query yet: no numerators, nothing to rescale (exp(-inf - -inf) is NaN).
      const float rescale = new_max == -INFINITY ? 1.0f : expf(row_max[i] - new_max);
      row_sum[i] *= rescale;
      KVS_UNROLL
      for (int c = 0; c < kColumns; ++c) o[i][c] *= rescale;
      KVS_UNROLL
      for (int j = 0; j < kTilePer; ++j) {
        const float p = new_max == -INFINITY ? 0.0f : expf(score[i][j] - new_max);  // 0 for a hidden key
        row_sum[i] += p;
        p_tile[(ty + kTileSide * i) * (kTile + 1) + tx + kTileSide * j] = p;
      }
      row_max[i] = new_max;
    }
    __syncthreads();
    for (int j = 0; j < kTile; ++j) {
      float p[kTilePer];
      KVS_UNROLL
      for (int i = 0; i < kTilePer; ++i) p[i] = p_tile[(ty + kTileSide * i) * (kTile + 1) + j];
      KVS_UNROLL
      for (int c = 0; c < kColumns; ++c) {
        const float value = v_tile[j * kHeadDim + tx + kTileSide * c];
        KVS_UNROLL
        for (int i = 0; i < kTilePer; ++i) o[i][c] += p[i] * value;
      }
    }
  }
  KVS_UNROLL
  for (int i = 0; i < kTilePer; ++i) {
    float total = row_sum[i];
    for (int offset = kTileSide / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(kFullMask, total, offset);
    const int query = first + ty + kTileSide * i;
    if (query >= n) continue;
    KVS_UNROLL
    for (int c = 0; c < kColumns; ++c) {
      const int d = tx + kTileSide * c;
      // Nothing visible (only a deliberately broken cache gets here): 0, as the CPU backend.
      if (d < head_dim) out[std::size_t(query) * dim + h * head_dim + d] = normalised(o[i][c], total);
    }
  }
}

// Decoding: one query per sequence - sequence z (blockIdx.z; one for a single decode step, up to
// kMaxBatchSequences for a batch's) at positions[z], its q and out rows z (n_heads · head_dim each), over
// views.view[z] - the rows it visits (KvView::rows_to_visit) split into chunks by `chunks` (DecodeChunks).
// Block (x, s, z) takes KV head x / tiles and `tile` of the query heads that read it (tiles = group / tile; tile
// <= kMaxTile), over chunk s (a block past the chunks the query's rows make - the grid has the most chunks any
// query of any of its views can make - leaves at once, and the merge reads the query's chunks alone: each sequence
// gets the bits it gets alone). Warp w takes kRowsInFlight consecutive rows at a time (rows row_begin + (w + k ·
// warps) · kRowsInFlight ...), a round: it loads their keys and values first - independent loads, all in flight at
// once, and issued before the round ahead of them is used - then scores them for each of its query heads (the
// round's sums across the warp reduced together) and updates that head's online softmax. The block's warps merge
// through shared memory; in a grid of one chunk the block writes out (sequences, n_heads · head_dim) itself,
// otherwise partials (sequences, n_heads, grid's splits, 2 + head_dim) = [max, total, Σ exp(score - max) · v],
// unnormalised, a chunk with nothing visible writing max -inf, and the last of a (KV head, tile, sequence)'s blocks
// to finish merges them (merge_partials), counting arrivals in arrivals (sequences, n_kv_heads · tiles), zero
// before the launch and after it. Lane l holds kElements elements of a row (kElements = 1, 2, 4, 8 for head_dim up
// to 32, 64, 128, 256: registers for what the head needs, not for the largest head). kPlainRows: every view of the
// launch stores float rows (contiguous or paged; not chapter 10's codes) rotated before they were cached (not
// chapter 04's read-time rotation), each head on 16 bytes where kElements > 1 (aligned_heads); lane l holds elements
// l · kElements ... l · kElements + kElements - 1, side by side, read with 16-byte loads from each row's start
// (load_lane). Otherwise lane l holds l, l + 32, ... (a warp's load of one number from each lane, 128 consecutive
// bytes of floats) and each number goes through KvView::key and value, and key_element's rotation.
// Grid (n_kv_heads · tiles, grid's splits, sequences), block kDecodeWarps · 32.
constexpr int kMaxTile = 4;
constexpr int kRowsInFlight = 4;
constexpr int kDecodeWarps = 4;
// The arrival counters a backend holds for split decoding: a launch's blocks (x, z), KV heads · tiles by
// sequences, up to 256 query heads at a batch's kMaxBatchSequences (64 KB).
constexpr std::size_t kArrivalCounters = 256 * kMaxBatchSequences;

// Decoding's chunks (DecodeChunks): the rows a query visits cut into at most max_splits chunks of min_rows rows or
// more each (the last one may be shorter). By default at most 64 chunks of 16 rows or more (one round of a block's
// warps, kRowsInFlight rows each): up to 1,024 rows, chunks of 16, so that a short context still gives the GPU
// blocks to run (at 512 positions, 33 chunks a KV head, 132 blocks of the synthetic model for an H100's 132 SMs,
// where chunks of 64 rows made 9, 36 blocks: chunks of 16 made its step 11-13% shorter, and the shipped model's
// from 32 positions 21-23%: H100, 2026-11-27, one run each, book 07); past 1,024 rows, 61 to 64 chunks of more
// rows (from 4,033 rows on the cut of the former default, chunks of 64 rows or more, measured at 4,096 and 16,384
// positions; between, not yet measured). No more than 64: the merge reads every chunk's partial, and at 16,384
// positions 256 chunks of 64 rows made the synthetic model's step 3.9-4.1 ms, 64 chunks of 256 rows 3.4-3.5 (H100,
// one run, the merge then a kernel of its own; 8 warps per block: 2-6% faster at 512 and 4,096 positions, 5-9%
// slower at 16,384; 8 rows in flight: slower at each). A query of one chunk needs no merge.
// The chunks cut the rows a query visits, not the view's rows: a preallocated buffer of 16,416 rows cut by its
// size made chunks of 257 rows, and a query at position 512 kept 2 or 3 blocks a KV head busy while the others saw
// nothing (its step 2.59 ms, against 1.72 in a buffer of 4,128 rows, whose chunks are 65 rows long: H100,
// 2026-11-26). So a view of a whole buffer and one of its written prefix give the same bits (tested). The kernel
// cuts each sequence's rows; the host sizes the grid for the most chunks any query of a view can make
// (grid_splits). Never by the batch's size: a sequence is cut the same alone and in a batch, so it gets the same
// bits.
constexpr int kRowsPerRound = kDecodeWarps * kRowsInFlight;  // the rows a block's warps load at once
constexpr int kMaxSplits = 256;  // the most chunks KVS_DECODE_CHUNKS may ask for (the merge's weights in shared memory)

struct DecodeChunks {
  int max_splits = 64;
  int min_rows = kRowsPerRound;

  // The rows of each chunk of a query that visits `rows` rows (the kernel's cut; the last chunk may be shorter).
  KVS_HOST_DEVICE int rows_per_split(int rows) const {
    const int even = (rows + max_splits - 1) / max_splits;
    return even > min_rows ? even : min_rows;
  }
  // The grid's chunks for a view of `rows` rows: the most that any query visiting up to `rows` of them is cut into
  // (rows_per_split(r) cuts r rows into at most max_splits chunks, and into at most ceil(r / min_rows)). Not the cut
  // of `rows` itself: cut into at most 256 chunks (256,1), 1,100 rows are 220 chunks of 5, and a query visiting 701
  // of them needs 234 chunks of 3 (a chunk past the grid would never be read). The blocks past a query's chunks
  // leave at once.
  int grid_splits(int rows) const {
    return std::clamp((rows + min_rows - 1) / min_rows, 1, max_splits);
  }
};

// `text` as a whole number (number_text.h) from low to high, or nothing.
std::optional<long> whole_number_within(std::string_view text, long low, long high) {
  const std::optional<long> number = whole_number<long>(text);
  return number && *number >= low && *number <= high ? number : std::nullopt;
}

// The chunks decoding cuts views into on this run: DecodeChunks' default, or KVS_DECODE_CHUNKS=SPLITS,ROWS where set
// (at most SPLITS chunks, 1 to kMaxSplits, of ROWS rows or more, 1 to 65,536; a query's last chunk may be
// shorter). Why a variable: how many blocks keep an H100's memory busy, against what the merge of more chunks
// costs, is a GPU's measurement (DecodeChunks above says what was measured), and tests/gpu_session.sh makes it with
// one build (its chunks step).
DecodeChunks decode_chunks() {
  const char* value = std::getenv("KVS_DECODE_CHUNKS");
  if (!value) return {};
  DecodeChunks chunks;
  const std::string_view text(value);
  const std::size_t comma = text.find(',');
  const std::optional<long> splits = whole_number_within(text.substr(0, comma), 1, kMaxSplits),
                            rows = comma == std::string_view::npos ? std::nullopt
                                                                   : whole_number_within(text.substr(comma + 1), 1, 65536);
  if (!splits || !rows)
    throw std::invalid_argument(std::string("KVS_DECODE_CHUNKS=") + value +
                                ": expected SPLITS,ROWS (at most SPLITS chunks, 1 to " + std::to_string(kMaxSplits) +
                                ", of ROWS rows or more, 1 to 65536, e.g. 128,16); unset it for " +
                                std::to_string(chunks.max_splits) + "," + std::to_string(chunks.min_rows));
  chunks.max_splits = static_cast<int>(*splits), chunks.min_rows = static_cast<int>(*rows);
  return chunks;
}

// The views a decoding launch reads, one per sequence (blockIdx.z), passed by value as a kernel argument: a
// batch's views need no copy to device memory first. kMaxBatchSequences views are ~11 KB, within the 32 KB a
// kernel's arguments may take since CUDA 12.1 (Volta and later).
template <int kViews>
struct DecodeViews {
  KvView view[kViews];
};

// out (head_dim) = one head's chunks' partial softmaxes (splits <= kMaxSplits, 2 + head_dim) merged by one warp:
// each rescaled by exp(its max - the largest max), summed, divided by the summed totals (0 where no row was
// visible, as attention_kernel). A chunk with nothing visible (max -inf, total 0, values 0) gets weight 0 and
// adds exactly 0. The lanes share out the chunks to find the largest max and each chunk's weight (into `weight`,
// shared memory), then each lane adds the chunks' values of its elements (lane + 32 j: a warp's loads of a partial
// 128 consecutive bytes each), chunk after chunk, the same order in every launch (a batch's sequence gets its bits alone).
// Eight chunks' loads are issued before any is added (KVS_UNROLL_8, loads that no branch guards): a chunk at a
// time waited out a load from L2 per chunk - 64 of them at the end of every layer's launch at 4,096 positions.
// `head` was written by other blocks of the same launch: plain loads, never __ldg or a __restrict__ on it (the
// read-only path may not see another block's writes).
template <int kElements>
__device__ void merge_partials(float* out, const float* head, int splits, int head_dim, float (&weight)[kMaxSplits]) {
  const int lane = threadIdx.x % kWarp, stride = 2 + head_dim;
  float max = -INFINITY;
  for (int s = lane; s < splits; s += kWarp) max = max_keeping_nan(max, head[std::size_t(s) * stride]);
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    max = max_keeping_nan(max, __shfl_xor_sync(kFullMask, max, offset));
  for (int s = lane; s < splits; s += kWarp) {
    const float chunk_max = head[std::size_t(s) * stride];
    weight[s] = chunk_max == -INFINITY ? 0.0f : expf(chunk_max - max);  // 0: nothing visible in the chunk
  }
  __syncwarp();
  // A lane past head_dim reads the head's last element instead (never stored): every load in bounds, none behind
  // a branch.
  int element[kElements];
  KVS_UNROLL
  for (int j = 0; j < kElements; ++j) element[j] = lane + j * kWarp < head_dim ? lane + j * kWarp : head_dim - 1;
  float total = 0.0f, o[kElements] = {};
  KVS_UNROLL_8
  for (int s = 0; s < splits; ++s) {
    const float* partial = head + std::size_t(s) * stride;
    total += partial[1] * weight[s];
    KVS_UNROLL
    for (int j = 0; j < kElements; ++j) o[j] += partial[2 + element[j]] * weight[s];
  }
  KVS_UNROLL
  for (int j = 0; j < kElements; ++j)
    if (lane + j * kWarp < head_dim) out[lane + j * kWarp] = normalised(o[j], total);
}

// Lane `lane`'s kElements numbers of one head of a float row (`head`: its first number), side by side
// (lane_element): 16-byte loads (one of 8 bytes for kElements = 2; a float for 1), each of numbers all inside the
// head or all past it (those not loaded: 0), and none at all where !load. Where kElements > 1 the host sees to it
// that every head starts on 16 bytes and head_dim is a multiple of 4 (aligned_heads).
template <int kElements>
__device__ void load_lane(float (&out)[kElements], const float* head, int lane, int head_dim, bool load) {
  constexpr int kLoad = kElements < 4 ? kElements : 4;  // the numbers one load takes
  const int first = lane * kElements;
  KVS_UNROLL
  for (int c = 0; c < kElements; c += kLoad) {
    const Floats<kLoad> v = load && first + c < head_dim ? load_floats<kLoad>(head + first + c) : Floats<kLoad>{};
    for (int k = 0; k < kLoad; ++k) out[c + k] = v.v[k];
  }
}

template <int kElements, int kViews, bool kPlainRows>
__global__ void __launch_bounds__(kDecodeWarps * kWarp)
    attention_decode_kernel(float* out, float* partials, unsigned* arrivals, const float* q, const int* positions,
                            DecodeViews<kViews> views, DecodeChunks chunks, int n_heads, int group, int tile,
                            int head_dim) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  __shared__ WarpPartials<kDecodeWarps, kMaxTile> parts;
  const int sequence = blockIdx.z;
  const KvView kv = views.view[sequence];
  const int tiles = group / tile, kv_head = blockIdx.x / tiles;
  const int first_head = kv_head * group + int(blockIdx.x % tiles) * tile, kv_offset = kv_head * head_dim;
  const int split = blockIdx.y, grid_splits = gridDim.y;  // partials are laid out by the grid's chunks
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int query_pos = positions[sequence], rows = kv.rows_to_visit(query_pos);
  const int rows_per_split = chunks.rows_per_split(rows);
  // The chunks this query's rows make, at least one (a query that sees nothing still writes its zeros). The grid
  // may hold more - it is sized for the most chunks any query of the view can make, so that a recorded step
  // replays at every position - and a block past them leaves at once: the merge waits for these alone (a
  // preallocated buffer of 16,416 rows at position 512 visits 513 rows, 33 chunks of the grid's 64). A split
  // launch's query of one chunk is still "merged", from its one partial: the same bits as writing out directly
  // (its weight is exp(0) = 1), where telling the two apart cost 21 registers (ptxas -v: 117 against 96).
  const int splits = rows > rows_per_split ? (rows + rows_per_split - 1) / rows_per_split : 1;
  if (split >= splits) return;
  const int row_begin = split * rows_per_split;
  const int row_end = row_begin + rows_per_split < rows ? row_begin + rows_per_split : rows;
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));

  float query[kMaxTile][kElements], values[kMaxTile][kElements], running_max[kMaxTile], total[kMaxTile];
  KVS_UNROLL
  for (int t = 0; t < kMaxTile; ++t) {
    for (int j = 0; j < kElements; ++j) query[t][j] = 0.0f, values[t][j] = 0.0f;  // a head past the tile: zeros
    if (t < tile)
      load_query<kPlainRows>(query[t], q + (std::size_t(sequence) * n_heads + first_head + t) * head_dim, kv,
                             query_pos, head_dim, lane);
    running_max[t] = -INFINITY, total[t] = 0.0f;
  }
  // A round: the kRowsInFlight rows of a warp from `first` - their keys and values (0 for a row that is not read),
  // and whether each is visible (the same in every lane).
  struct Round {
    float key[kRowsInFlight][kElements], value[kRowsInFlight][kElements];
    bool visible[kRowsInFlight];
  };
  auto load_round = [&](int first, Round& round) {
    KVS_UNROLL
    for (int i = 0; i < kRowsInFlight; ++i) {
      // A row past the chunk looks up the chunk's last row instead (its position, its place in a paged view's
      // table), so that nothing below reads past a row table; its numbers are never loaded.
      const int r = first + i, row = r < row_end ? r : row_end - 1, key_pos = kv.position_of(row);
      const bool visible = r < row_end && key_visible(query_pos, key_pos, kv.window);
      round.visible[i] = visible;
      if constexpr (kPlainRows) {
        // Plain rows: the row's start found once (a paged view's table read once), then the lane's numbers in
        // 16-byte loads with nothing between them but their condition. KvView::key's checks at every number
        // (coded? paged?) cost 238 registers against 107 and kept the loads from being in flight together: the
        // synthetic model's attention ran at 214 GB/s (H100, 2026-11-26); the read-time rotation's test put each
        // load behind a branch too.
        const std::size_t start = kv.row_offset(row) + kv_offset;
        load_lane(round.key[i], kv.keys + start, lane, head_dim, visible);  // a hidden row is never read: it may be NaN
        load_lane(round.value[i], kv.values + start, lane, head_dim, visible);
      } else {
        for (int j = 0; j < kElements; ++j) {
          const int d = lane_element<kElements, false>(lane, j);
          const bool load = visible && d < head_dim;
          round.key[i][j] = load ? key_element(kv, r, key_pos, query_pos, kv_offset, d, head_dim) : 0.0f;
          round.value[i][j] = load ? kv.value(r, kv_offset + d) : 0.0f;
        }
      }
    }
  };
  // The round's dot products, every head of the tile with every row: kScores sums across the warp.
  constexpr int kScores = kMaxTile * kRowsInFlight;
  static_assert(kScores <= kWarp && (kScores & (kScores - 1)) == 0, "warp_sum_each: a power of two, a lane each");
  const int first_row = row_begin + warp * kRowsInFlight;
  Round next;
  if (first_row < row_end) load_round(first_row, next);
  for (int first = first_row; first < row_end; first += kRowsPerRound) {
    const Round round = next;
    // The next round's loads go out before this round's arithmetic, so that they are in flight while it runs:
    // loads, then their use, a round at a time, left each warp waiting out a memory latency per round (version 7:
    // 36% of attention's warps waiting on memory, book 07).
    if (first + kRowsPerRound < row_end) load_round(first + kRowsPerRound, next);
    float dots[kScores];  // dots[t · kRowsInFlight + i]: head t, row i; this lane's share
    KVS_UNROLL
    for (int t = 0; t < kMaxTile; ++t)
      KVS_UNROLL
      for (int i = 0; i < kRowsInFlight; ++i) {
        float dot = 0.0f;
        KVS_UNROLL
        for (int j = 0; j < kElements; ++j) dot += query[t][j] * round.key[i][j];
        dots[t * kRowsInFlight + i] = dot;
      }
    // All of them summed across the warp together (a reduce-scatter: 16 shuffles for 16 sums, where a warp_sum each
    // took 5 per head and row, 80 for a tile of 4 heads; shuffles and exponentials held 16% of attention's warps in
    // version 7), the sum of dots[v] then in lane v · 32 / kScores, from where each head of the tile takes its own
    // (one shuffle a sum: 16 + 4 · tile shuffles a round, where there were 20 · tile). A head past the tile has a zero
    // query: its sums are made, never used.
    warp_sum_each(dots);
    KVS_UNROLL
    for (int t = 0; t < kMaxTile; ++t) {
      if (t >= tile) break;
      float score[kRowsInFlight], new_max = running_max[t];
      KVS_UNROLL
      for (int i = 0; i < kRowsInFlight; ++i) {
        const float dot = __shfl_sync(kFullMask, dots[0], (t * kRowsInFlight + i) * (kWarp / kScores));
        score[i] = round.visible[i] ? dot * scale : -INFINITY;
        new_max = max_keeping_nan(new_max, score[i]);
      }
      if (new_max == -INFINITY) continue;  // nothing visible yet (the same in every lane)
      const float rescale = expf(running_max[t] - new_max);  // 0 for the first visible rows
      total[t] *= rescale;
      for (int j = 0; j < kElements; ++j) values[t][j] *= rescale;
      for (int i = 0; i < kRowsInFlight; ++i) {
        const float weight = expf(score[i] - new_max);  // 0 for a hidden row, whose value is 0 too
        total[t] += weight;
        for (int j = 0; j < kElements; ++j) values[t][j] += weight * round.value[i][j];
      }
      running_max[t] = new_max;
    }
  }
  KVS_UNROLL
  for (int t = 0; t < kMaxTile; ++t) {
    if (t >= tile) break;
    parts.store<kPlainRows>(warp, t, running_max[t], total[t], values[t], head_dim);
  }
  __syncthreads();
  KVS_UNROLL
  for (int t = 0; t < kMaxTile; ++t) {
    if (t >= tile) break;
    const PartialSoftmax block = parts.merged(t, kDecodeWarps);
    const std::size_t h = std::size_t(sequence) * n_heads + first_head + t;  // the head's row of out
    float* partial = partials ? partials + (h * grid_splits + split) * (2 + head_dim) : nullptr;
    if (partial && threadIdx.x == 0) partial[0] = block.max, partial[1] = block.total;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
      const float o = parts.merged_value(t, d, block.max, kDecodeWarps);
      if (partial) partial[2 + d] = o;
      else out[h * head_dim + d] = normalised(o, block.total);
    }
  }
  if (!partials) return;
  // Split: the block of (x, sequence) that finishes last merges the chunks' partials, instead of a merge kernel
  // launched after this one (a launch costs more than a merge's work). CUDA's last-block pattern (the programming
  // guide's __threadfence() example): every thread's partial writes ordered before the block's arrival is
  // counted; the block that counts the last arrival fences again before it reads the others' partials, and sets
  // the count back to 0 for the next launch (a replayed graph's too: nothing else clears it).
  static_assert(kMaxTile <= kDecodeWarps, "the last block merges a head per warp");
  __shared__ bool last;
  // merge_partials' chunk weights, a row per warp (DecodeChunks never gives more than kMaxSplits chunks)
  __shared__ float chunk_weight[kMaxTile][kMaxSplits];
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* arrived = arrivals + std::size_t(sequence) * gridDim.x + blockIdx.x;
    last = atomicAdd(arrived, 1u) == unsigned(splits - 1);
    if (last) *arrived = 0;  // every other block of (x, sequence) has counted itself: none reads it again
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (warp < tile) {  // warp t merges the tile's head t
    const std::size_t h = std::size_t(sequence) * n_heads + first_head + warp;
    merge_partials<kElements>(out + h * head_dim, partials + h * grid_splits * (2 + head_dim), splits, head_dim,
                              chunk_weight[warp]);
  }
}

// ---- products for a few tokens (decode): the fused operations of backend.h, one kernel each ----
// out (n, d_out) = x (n, d_in) · wᵀ for n <= kGemvMaxTokens, every weight read once for a tile of up to kGemvTokens
// tokens (and from memory once for all n: see the tiles below). A decode
// step is weight reads: cuBLAS's product with one row of activations ran at ~1.1 TB/s on an H100, and a
// layer took 17 launches, 10 of them tiny kernels between the products (book 07). Here a block computes
// kGemvRows output rows for every token; its warps (enough for d_in, up to kGemvWarps) split d_in, each lane loading kWidth
// consecutive floats of each of the block's weight rows (kWidth = 4: 16-byte loads, the widest one thread
// can issue), the rows' loads independent and in flight together. What the fused operations add rides on
// those loads instead of costing a launch and a pass of its own:
//   - the norm: norm(x) · w = inv_rms · Σ (x ⊙ g) w, and the lanes that read x for the products sum x² too;
//   - RoPE: rows 2i and 2i+1 of a head are one block's rows, rotated together before they are stored;
//   - SwiGLU: the block computes the same rows of w1 and w3 and stores silu(a) ⊙ b;
//   - the residual add: out += instead of out =.
// Up to kGemvMaxProducts products of one input share a launch (attention's q, k and v: one launch of 3072
// rows instead of three, two of them too small to fill the GPU). More than kGemvTokens tokens (a batch of
// chapter 08's sequences, up to kGemvMaxTokens) are tiles of kGemvTokens, a block per tile and group of rows:
// the registers of a block's sums grow with its tokens, so a tile of 8 is as wide as a block goes. A tile's
// tokens are summed exactly as they would be alone (each token's sums are its own), so every token of a batch
// gets the bits of its step alone (tested). Grid (ceil(rows / kGemvRows) · ceil(n / kGemvTokens)), block up to
// kGemvWarps · 32.
constexpr int kGemvTokens = 8;     // a block's tokens (its tile)
constexpr int kGemvMaxTokens = 64;  // a launch's: chapter 08's largest batch; more (prefill) takes cuBLAS

// The whole number environment variable `name` sets, from low to high, or `unset` where it is not set; anything else
// refuses the backend, saying what the number is (`what`).
int whole_number_variable(const char* name, int low, int high, int unset, const char* what) {
  const char* value = std::getenv(name);
  if (!value) return unset;
  const std::optional<long> number = whole_number_within(value, low, high);
  if (!number)
    throw std::invalid_argument(std::string(name) + "=" + value + ": expected a whole number from " + std::to_string(low) +
                                " to " + std::to_string(high) + " (" + what + "); unset it for " + std::to_string(unset));
  return static_cast<int>(*number);
}
// The most tokens the fused products take on this run: kGemvMaxTokens, or KVS_GEMV_MAX_TOKENS (1 to 64) where set.
// Why a variable: whether tiles of 8 beat cuBLAS for a large model's batch of 9 to 64 is a GPU's measurement, and
// tests/gpu_session.sh makes it with one build (chapter 08's throughput with the limit at 8 and at 64).
int gemv_max_tokens() {
  return whole_number_variable("KVS_GEMV_MAX_TOKENS", 1, kGemvMaxTokens, kGemvMaxTokens,
                               "the most tokens a fused product takes");
}
// Whether to launch the kernels programmatically dependent (cuda_support.h's LaunchQueue) where the GPU can, on
// compute capability 9.0 and later: yes, unless KVS_PROGRAMMATIC_LAUNCH=0. Why a variable: what it saves is a
// GPU's measurement, and tests/gpu_session.sh makes it with one build (the same decode step off and on).
bool programmatic_launch_wanted() {
  const char* value = std::getenv("KVS_PROGRAMMATIC_LAUNCH");
  if (!value) return true;
  if (std::string(value) != "0" && std::string(value) != "1")
    throw std::invalid_argument(std::string("KVS_PROGRAMMATIC_LAUNCH=") + value +
                                ": expected 0 (each kernel waits for the one before to finish) or 1 (on where the GPU "
                                "has it, compute capability 9.0 on); unset it for 1");
  return value[0] == '1';
}
constexpr int kGemvRows = 4;  // even: a RoPE pair (rows 2i, 2i+1 of a product starting at an even row) stays in one block
constexpr int kGemvWarps = 4;
constexpr int kGemvMaxProducts = 3;

// The most warps a product's block takes on this run: kGemvWarps, or KVS_GEMV_WARPS (1 to 4) where set. Why a
// variable: an H100 read the layers' smaller products at 1.6 TB/s where the largest reached 2.5 (book 07), and one
// suspect is the grid's waves - q/k/v's 768 blocks of 4 warps against 660 a wave (5 a multiprocessor at 94
// registers), a second wave of 108 - where blocks of 1 warp, each sweeping all of d_in, all fit at once. Which
// wins is a GPU's measurement, and tests/gpu_session.sh makes it with one build (its chunks step).
int gemv_warps() {
  return whole_number_variable("KVS_GEMV_WARPS", 1, kGemvWarps, kGemvWarps, "the most warps a product's block takes");
}

enum class GemvStore { kSet, kAdd, kSwiglu };

// A product of the launch: Backend::Product, with its first row among the launch's rows.
struct GemvProduct {
  float* out = nullptr;         // (n, d_out)
  const float* w = nullptr;     // (d_out, d_in)
  int d_out = 0;
  const float* rope = nullptr;  // (n, head_dim/2, 2), or null
  int first_row = 0;
  float* cache_rows = nullptr;  // or null: out's rows also at cache_ring.write_slot(position), cache_row_stride apart
  int cache_row_stride = 0;
  Ring cache_ring = Ring::unbounded();
};
struct GemvArgs {
  const float* x = nullptr;            // (n, d_in)
  const float* norm_weight = nullptr;  // (d_in), or null: x as it is
  const float* up = nullptr;           // kSwiglu: w3 (d_out, d_in); products[0] holds w1 and the output
  GemvProduct products[kGemvMaxProducts];
  int count = 0, rows = 0;             // products, and their rows together
  int n = 0, d_in = 0, head_dim = 0;
  const int* positions = nullptr;      // (n): where the products with cache_rows store each token's row
};

// The launch's row `row` (< a.rows): its product and its row there.
__device__ void find_row(const GemvArgs& a, int row, GemvProduct& product, int& local) {
  product = a.products[0];
  KVS_UNROLL
  for (int p = 1; p < kGemvMaxProducts; ++p)
    if (p < a.count && row >= a.products[p].first_row) product = a.products[p];
  local = row - product.first_row;
}

// Warp 0's lanes hold the block's sums (warp_sum_each): into totals (kValues).
template <int kValues>
__device__ void store_sums(float* totals, const float (&values)[kValues]) {
  const int lane = threadIdx.x % kWarp;
  constexpr int kHeld = kValues >= kWarp ? kValues / kWarp : 1, kLanesPerSum = kValues >= kWarp ? 1 : kWarp / kValues;
  if (lane % kLanesPerSum == 0)
    for (int i = 0; i < kHeld; ++i) totals[lane * kValues / kWarp + i] = values[i];
}

template <int kTokens, int kWidth, GemvStore kStore>
__global__ void __launch_bounds__(kGemvWarps * kWarp) gemv_kernel(GemvArgs a) {
  // This kernel alone does work before its wait for the kernel ahead (cuda_support.h): it loads weights, which no
  // kernel writes, so that launched programmatically its first loads overlap the end of the kernel ahead instead
  // of starting after it - a product's first memory latency, paid 4 times a layer. Before the wait it reads
  // only the kernel's parameters and weight rows; x, the norm's weights and every output come after it.
  constexpr int kMatrices = kStore == GemvStore::kSwiglu ? 2 : 1;
  constexpr int kValues = kMatrices * kGemvRows * kTokens;  // dot products
  static_assert((kValues & (kValues - 1)) == 0 && (kTokens & (kTokens - 1)) == 0, "warp_sum_each halves powers of two");
  // The block's rows and tile of tokens. The tile varies fastest, so the blocks that read the same weight rows
  // run side by side: the first reads them from memory, the others from L2.
  const int tiles = (a.n + kTokens - 1) / kTokens, tile = blockIdx.x % tiles;
  const int first = blockIdx.x / tiles * kGemvRows, first_token = tile * kTokens;
  // The block's weight rows; past the launch's last row, the last row again (read, never stored), so that
  // every load below is unconditional.
  const float* w_rows[kMatrices][kGemvRows];
  KVS_UNROLL
  for (int r = 0; r < kGemvRows; ++r) {
    GemvProduct product;
    int local = 0;
    find_row(a, first + r < a.rows ? first + r : a.rows - 1, product, local);
    w_rows[0][r] = product.w + std::size_t(local) * a.d_in;
    if constexpr (kMatrices == 2) w_rows[1][r] = a.up + std::size_t(local) * a.d_in;
  }
  // The block's threads sweep d_in, kWidth columns each per sweep. kSweeps sweeps' weight loads are issued
  // together before any is used: one sweep's loads at a time left each block waiting out a memory latency
  // per sweep (a d_in of 2048 is 4 sweeps of 512 floats), and the GPU's bandwidth needs many bytes in flight.
  // Fewer at once where the accumulators already take the registers.
  constexpr int kSweeps = kMatrices * kTokens <= 2 ? 4 : kMatrices * kTokens <= 8 ? 2 : 1;
  const int stride = blockDim.x * kWidth;
  Floats<kWidth> w[kSweeps][kMatrices][kGemvRows];
  // The weights of the kSweeps sweeps from column c; a sweep past d_in reads column 0 again (never used), so
  // that the loads are unconditional.
  auto load_sweeps = [&](int c) {
    KVS_UNROLL
    for (int s = 0; s < kSweeps; ++s) {
      const int column = c + s * stride < a.d_in ? c + s * stride : 0;
      KVS_UNROLL
      for (int m = 0; m < kMatrices; ++m)
        KVS_UNROLL
        for (int r = 0; r < kGemvRows; ++r) w[s][m][r] = load_floats<kWidth>(w_rows[m][r] + column);
    }
  };
  int c = threadIdx.x * kWidth;
  if (c < a.d_in) load_sweeps(c);
  KVS_WAIT_FOR_PREVIOUS_KERNEL();

  __shared__ float lanes[kGemvWarps][kValues + kTokens][kWarp];  // each lane's partial sums (when warps > 1)
  __shared__ float totals[kValues], square_totals[kTokens];       // the block's sums
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int n = a.n - first_token < kTokens ? a.n - first_token : kTokens;  // the tile's tokens
  const float* x_tile = a.x + std::size_t(first_token) * a.d_in;  // (n, d_in)
  float acc[kValues] = {}, square[kTokens] = {};  // acc[(m · kGemvRows + r) · kTokens + t]: matrix m, row r, token t
  // Columns [c, c + kWidth) of the block's rows, their weights w: into acc and square.
  auto accumulate = [&](int c, const Floats<kWidth> (&w)[kMatrices][kGemvRows]) {
    Floats<kWidth> g;
    if (a.norm_weight) g = load_floats<kWidth>(a.norm_weight + c);
    KVS_UNROLL
    for (int t = 0; t < kTokens; ++t) {
      if (t >= n) break;
      Floats<kWidth> x = load_floats<kWidth>(x_tile + std::size_t(t) * a.d_in + c);
      KVS_UNROLL
      for (int k = 0; k < kWidth; ++k) {
        square[t] += x.v[k] * x.v[k];
        if (a.norm_weight) x.v[k] *= g.v[k];
      }
      KVS_UNROLL
      for (int m = 0; m < kMatrices; ++m)
        KVS_UNROLL
        for (int r = 0; r < kGemvRows; ++r)
          KVS_UNROLL
          for (int k = 0; k < kWidth; ++k) acc[(m * kGemvRows + r) * kTokens + t] += w[m][r].v[k] * x.v[k];
    }
  };
  while (c < a.d_in) {  // the sweeps in order, kSweeps at a time, each group's loads issued before its use
    KVS_UNROLL
    for (int s = 0; s < kSweeps; ++s)
      if (c + s * stride < a.d_in) accumulate(c + s * stride, w[s]);
    c += kSweeps * stride;
    if (c < a.d_in) load_sweeps(c);
  }
  // The block's sums: the warps' partial sums added through shared memory, then warp 0's lanes together.
  if (warps > 1) {
    KVS_UNROLL
    for (int v = 0; v < kValues; ++v) lanes[warp][v][lane] = acc[v];
    KVS_UNROLL
    for (int t = 0; t < kTokens; ++t) lanes[warp][kValues + t][lane] = square[t];
    __syncthreads();
    if (warp == 0) {
      for (int w = 1; w < warps; ++w) {
        KVS_UNROLL
        for (int v = 0; v < kValues; ++v) acc[v] += lanes[w][v][lane];
        KVS_UNROLL
        for (int t = 0; t < kTokens; ++t) square[t] += lanes[w][kValues + t][lane];
      }
    }
  }
  if (warp == 0) {
    warp_sum_each(acc);
    warp_sum_each(square);
    store_sums(totals, acc);
    store_sums(square_totals, square);
  }
  __syncthreads();

  // Thread (r, t) of the first kGemvRows · kTokens finishes the block's row r for the tile's token t.
  const int r = threadIdx.x / kTokens, t = threadIdx.x % kTokens;
  if (r >= kGemvRows || t >= n || first + r >= a.rows) return;
  const float inv_rms = a.norm_weight ? inverse_rms(square_totals[t], a.d_in) : 1.0f;
  auto value = [&](int m, int row) { return totals[(m * kGemvRows + row) * kTokens + t] * inv_rms; };
  GemvProduct product;
  int local = 0;
  find_row(a, first + r, product, local);
  const std::size_t token = std::size_t(first_token) + t;  // in the launch
  float* out = product.out + token * product.d_out + local;
  // The layer's cache write, fused: the same values into the token's cache row, the row write_rows_kernel finds.
  float* cached = product.cache_rows ? product.cache_rows +
                                           std::size_t(write_row(product.cache_ring, a.positions[token])) *
                                               product.cache_row_stride + local
                                     : nullptr;
  if constexpr (kStore == GemvStore::kSwiglu) {
    *out = swiglu_of(value(0, r), value(1, r));
  } else if constexpr (kStore == GemvStore::kAdd) {
    *out += value(0, r);
  } else if (!product.rope) {
    *out = value(0, r);
    if (cached) *cached = *out;
  } else if (local % 2 == 0) {  // the pair's first row rotates and stores both (the launch checked r + 1 is its partner)
    float pair[2] = {value(0, r), value(0, r + 1)};
    const int pairs = a.head_dim / 2;
    rope_rotate(pair, product.rope + (token * pairs + (local % a.head_dim) / 2) * 2);
    out[0] = pair[0], out[1] = pair[1];
    if (cached) cached[0] = pair[0], cached[1] = pair[1];
  }
}

// gate (count) = silu(gate) ⊙ up. Grid (min(ceil(count / 256), kMaxBlocks)), block 256, grid-stride loop.
__global__ void swiglu_kernel(float* gate, const float* up, std::size_t count) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += std::size_t(gridDim.x) * blockDim.x) {
    gate[i] = swiglu_of(gate[i], up[i]);
  }
}

// x (count) += y. Grid and block as swiglu_kernel.
__global__ void add_kernel(float* x, const float* y, std::size_t count) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += std::size_t(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

// ---- the backend ----

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 4096;

// Query heads per decoding block: the largest divisor of the group (query heads per KV head) up to kMaxTile.
int decode_tile(int group) {
  for (int tile = kMaxTile; tile > 1; --tile)
    if (group % tile == 0) return tile;
  return 1;
}

// A thread per element: for kernels without a stride loop (the RoPE table's and the rotation's).
unsigned blocks_for_each(std::size_t count) { return static_cast<unsigned>((count + kThreads - 1) / kThreads); }
// Capped at kMaxBlocks: for grid-stride kernels.
unsigned blocks_for(std::size_t count) { return std::min<unsigned>(blocks_for_each(count), kMaxBlocks); }

// Every operation is queued on the backend's own stream (the legacy default stream cannot be captured);
// the copies to the host wait for it.
// The backend's stream, destroyed after every member that uses it: members go in the reverse of their order, and
// the Blas handle, bound to the stream, is declared after it (its destructor ran on a destroyed stream when the
// backend's destructor destroyed the stream itself). A member whose constructor throws also gives it back.
struct OwnedStream {
  cudaStream_t stream = nullptr;
  OwnedStream() { KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~OwnedStream() { cudaStreamDestroy(stream); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
};

class CudaBackend final : public Backend {
 public:
  // programmatic: launch the kernels programmatically dependent (LaunchQueue in cuda_support.h).
  CudaBackend(std::string name, bool programmatic)
      : name_(std::move(name)),
        gemv_max_tokens_(gemv_max_tokens()),
        gemv_warps_(gemv_warps()),
        chunks_(decode_chunks()),
        stream_(owned_stream_.stream),
        queue_{stream_, programmatic},
        blas_(stream_) {
    // The tiled prefill attention's shared memory is over the 48 KB a kernel gets without asking, for heads
    // over 32: asked for where the device has it (A100, H100: 163 and 227 KB a block), else those heads keep
    // attention_kernel (a GPU with 99 KB, such as many laptops', tiles heads up to 64).
    int device = 0, shared_limit = 0;
    KVS_CUDA_CHECK(cudaGetDevice(&device));
    KVS_CUDA_CHECK(cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (std::size_t(shared_limit) >= attention_tiled_shared_bytes(64)) {
      KVS_CUDA_CHECK(cudaFuncSetAttribute(attention_tiled_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(attention_tiled_shared_bytes(64))));
      tiled_max_head_dim_ = 64;
    }
    if (std::size_t(shared_limit) >= attention_tiled_shared_bytes(128)) {
      KVS_CUDA_CHECK(cudaFuncSetAttribute(attention_tiled_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(attention_tiled_shared_bytes(128))));
      tiled_max_head_dim_ = 128;
    }
    arrivals_ = static_cast<unsigned*>(allocate_bytes(kArrivalCounters * sizeof(unsigned)));
    // On the backend's stream, so that it is done before the first launch (a plain cudaMemset goes on the legacy
    // default stream, which a non-blocking stream does not wait for); the kernel leaves them 0.
    KVS_CUDA_CHECK(cudaMemsetAsync(arrivals_, 0, kArrivalCounters * sizeof(unsigned), stream_));
  }
  ~CudaBackend() override {
    cudaFree(arrivals_);
    if (graph_) cudaGraphExecDestroy(graph_);
    for (float* w : weights_) cudaFree(w);
  }
  const char* name() const override { return name_.c_str(); }
  std::string describe() const override { return name_; }
  bool host_memory() const override { return false; }
#if !defined(KVS_CUDA_HARNESS)  // the harness's memory is the host's: no device to ask
  std::int64_t free_memory_bytes() const override {
    std::size_t free = 0, total = 0;
    KVS_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<std::int64_t>(free);
  }
#endif

  float* allocate(std::size_t floats) override { return static_cast<float*>(allocate_bytes(floats * sizeof(float))); }
  // Not checked: Buffer calls this from its destructor, which must not throw; a failed free leaves the
  // error for the next checked call to report.
  void release(float* p) override { cudaFree(p); }
  int* allocate_ints(std::size_t count) override { return static_cast<int*>(allocate_bytes(count * sizeof(int))); }
  void release(int* p) override { cudaFree(p); }
  const float* upload_weights(const float* host, std::size_t floats) override {
    float* device = allocate(floats);
    weights_.push_back(device);
    from_host(device, host, floats);
    return device;
  }
  // cuBLAS reads the row-major (rows, cols) matrix as it is (matmul below).
  const float* upload_matrix(const float* host, int rows, int cols) override {
    return upload_weights(host, std::size_t(rows) * cols);
  }
  void copy(float* dst, const float* src, std::size_t floats) override {
    check_no_overlap(dst, src, floats);
    if (floats) KVS_CUDA_CHECK(cudaMemcpyAsync(dst, src, floats * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  void to_host(float* host, const float* src, std::size_t floats) override {
    if (!floats) return;
    KVS_CUDA_CHECK(cudaMemcpyAsync(host, src, floats * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  // From pageable host memory the copy is staged before the call returns: `host` may change right after.
  void from_host(float* dst, const float* host, std::size_t floats) override {
    if (floats) KVS_CUDA_CHECK(cudaMemcpyAsync(dst, host, floats * sizeof(float), cudaMemcpyHostToDevice, stream_));
  }
  void from_host(int* dst, const int* host, std::size_t count) override {
    if (count) KVS_CUDA_CHECK(cudaMemcpyAsync(dst, host, count * sizeof(int), cudaMemcpyHostToDevice, stream_));
  }
  void to_host(int* host, const int* src, std::size_t count) override {
    if (!count) return;
    KVS_CUDA_CHECK(cudaMemcpyAsync(host, src, count * sizeof(int), cudaMemcpyDeviceToHost, stream_));
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void synchronize() override { KVS_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  // Decoding's partial softmaxes (attention_decode_kernel), when split: sequences · n_heads · splits · (2 +
  // head_dim), for up to kMaxBatchSequences sequences at once (attention_batch).
  std::size_t attention_scratch_floats(const AttentionShape& shape, int max_rows, int max_sequences) const override {
    const int splits = chunks_.grid_splits(max_rows), sequences = std::clamp(max_sequences, 1, kMaxBatchSequences);
    return splits > 1 ? std::size_t(sequences) * shape.n_heads * splits * (2 + shape.head_dim) : 0;
  }

  // Recording is CUDA stream capture: the operations queued between the two calls become a graph, which
  // replay() launches with one call.
  bool can_record() const override { return true; }
  int begin_recording() override {
    KVS_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    return ++recordings_;
  }
  void end_recording() override {
    // The capture ends before anything else: in thread-local mode CUDA refuses the capturing thread's "potentially
    // unsafe" calls, destroying an executable graph among them (CUDA 13 on an H100 did, 2026-11-27, when this
    // destroyed the older graph first). The older graph goes before either status is checked: a capture that
    // failed to end (a launch inside it failed) must leave nothing that replay() would take for this recording.
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    const cudaGraphExec_t older = std::exchange(graph_, nullptr);
    const cudaError_t destroyed = older ? cudaGraphExecDestroy(older) : cudaSuccess;
    KVS_CUDA_CHECK(ended);
    if (destroyed != cudaSuccess) cudaGraphDestroy(graph);
    KVS_CUDA_CHECK(destroyed);
    std::size_t nodes = 0;
    const cudaError_t counted = cudaGraphGetNodes(graph, nullptr, &nodes);
    recorded_launches_ = counted == cudaSuccess ? static_cast<int>(nodes) : 0;
    // Into a handle of its own first: a failed instantiation leaves graph_ null, never a value CUDA left undefined
    // that replay() would launch.
    cudaGraphExec_t instance = nullptr;
    const cudaError_t instantiated = cudaGraphInstantiate(&instance, graph, 0);
    cudaGraphDestroy(graph);
    KVS_CUDA_CHECK(instantiated);
    graph_ = instance;
  }
  int recorded_launches() const override { return recorded_launches_; }
  void replay(int recording) override {
    if (recording != recordings_ || !graph_)
      throw std::logic_error("replay: recording " + std::to_string(recording) + " is not the last one recorded");
    KVS_CUDA_CHECK(cudaGraphLaunch(graph_, stream_));
  }

  // An operation on no tokens (n or count 0) launches a grid of no blocks, which KVS_LAUNCH skips (cuda_support.h).
  void embed(float* x, const float* table, const int* tokens, int n, int dim) override {
    KVS_LAUNCH(embed_kernel, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, queue_, x, table, tokens, dim);
  }
  void matmul(float* out, const float* x, const float* w, int n, int d_in, int d_out) override {
    blas_.matmul_rows(out, x, w, n, d_in, d_out);
  }
  void rmsnorm(float* out, const float* x, const float* weight, int n, int dim) override {
    KVS_LAUNCH(rmsnorm_kernel, dim3(n), dim3(kThreads), 0, queue_, out, x, weight, dim);
  }
  void rope_table(float* table, const int* positions, int n, int head_dim) override {
    // A thread per (position, pair), not blocks_for's capped grid: the kernel has no stride loop, and a prefill of
    // 16,385 positions with heads of 128 (over 4,096 blocks) left the table's later rows unwritten.
    KVS_LAUNCH(rope_table_kernel, dim3(blocks_for_each(std::size_t(n) * (head_dim / 2))), dim3(kThreads), 0, queue_,
               table, positions, n, head_dim);
  }
  void rope(float* x, const float* table, int n, int heads, int head_dim) override {
    KVS_LAUNCH(rope_kernel, dim3(blocks_for_each(std::size_t(n) * heads * head_dim / 2)), dim3(kThreads), 0, queue_, x,
               table, n, heads, head_dim);
  }
  void attention(float* out, const float* q, const int* positions, int n, const KvView& kv,
                 const AttentionShape& shape, std::span<float> scratch, float* weights) override {
    if (shape.head_dim > kMaxHeadDim)
      throw std::invalid_argument("attention: head_dim " + std::to_string(shape.head_dim) +
                                  " is larger than the CUDA kernel's " + std::to_string(kMaxHeadDim));
    if (kv.read_rope && kv.window.size < 1)
      throw std::invalid_argument("attention: read-time rotation needs a window (its table covers its positions)");
    const int group = shape.n_heads / shape.n_kv_heads;
    if (n == 1 && !weights) {
      // Decoding. The grid depends on the view's rows only, never on the position, so a recorded step replays the
      // same launches (each block finds its chunk of the rows the query visits from the position in device memory).
      if (scratch.size() < attention_scratch_floats(shape, kv.rows, 1))
        throw std::invalid_argument("attention: a view of " + std::to_string(kv.rows) +
                                    " rows needs more scratch than the model allocated");
      decode(out, q, positions, DecodeViews<1>{{kv}}, 1, chunks_.grid_splits(kv.rows), shape, scratch.data());
      return;
    }
    // Prefill in tiles, where the view is rotated already and the head fits the tiles' shared memory.
    if (!weights && !kv.read_rope && shape.head_dim <= tiled_max_head_dim_) {
      const dim3 grid(shape.n_heads, (n + kTile - 1) / kTile), block(kTileSide * kTileSide);
      if (shape.head_dim <= 32)
        KVS_LAUNCH(attention_tiled_kernel<32>, grid, block, attention_tiled_shared_bytes(32), queue_, out, q, positions,
                   n, kv, shape.n_heads, group, shape.head_dim);
      else if (shape.head_dim <= 64)
        KVS_LAUNCH(attention_tiled_kernel<64>, grid, block, attention_tiled_shared_bytes(64), queue_, out, q, positions,
                   n, kv, shape.n_heads, group, shape.head_dim);
      else
        KVS_LAUNCH(attention_tiled_kernel<128>, grid, block, attention_tiled_shared_bytes(128), queue_, out, q,
                   positions, n, kv, shape.n_heads, group, shape.head_dim);
      return;
    }
    // Prefill otherwise (a block per query and head: 4 warps each: read-time rotation, larger heads) and an
    // observed step (one block per head: more warps share the rows, one per 64 rows, up to 16).
    const int warps = n == 1 ? std::clamp(kv.rows / 64, 1, kMaxAttentionWarps) : 4;
    KVS_LAUNCH(attention_kernel, dim3(n, shape.n_heads), dim3(warps * kWarp), 0, queue_, out, weights, q, positions,
               kv, shape.n_heads, group, shape.head_dim);
  }
  // A step of several sequences (chapter 08): its decode queries (parts of one query) as launches of the decoding
  // kernel for up to kMaxBatchSequences sequences each instead of one per sequence - at batch 64 a layer would
  // otherwise launch 64 kernels of a few blocks each, where a launch costs more than its work. A launch takes a run
  // of such parts whose queries are rows one after another (the scheduler puts a step's new prompt chunks after its
  // decode tokens, so a step is mostly one run). Any other part (a prefill chunk) takes attention() alone, in turn;
  // one decode part or none, the definition. (Once one chunk sent the whole step to the definition, a launch per
  // part; the CPU's batched attention had the same rule, measured in book 08.)
  void attention_batch(float* out, const float* q, const int* positions, std::span<const AttentionPart> parts,
                       const AttentionShape& shape, std::span<float> scratch) override {
    auto decoding = [&](const AttentionPart& p) {  // what attention() would take through decode() too
      return p.n == 1 && shape.head_dim <= kMaxHeadDim && (!p.kv.read_rope || p.kv.window.size >= 1);
    };
    int decode_parts = 0, max_rows = 0;
    for (const AttentionPart& p : parts)
      if (decoding(p)) ++decode_parts, max_rows = std::max(max_rows, p.kv.rows);
    if (decode_parts <= 1) return Backend::attention_batch(out, q, positions, parts, shape, scratch);
    const int largest_launch = std::min(decode_parts, kMaxBatchSequences);
    if (scratch.size() < attention_scratch_floats(shape, max_rows, largest_launch))
      throw std::invalid_argument("attention: a batch of " + std::to_string(decode_parts) + " views of up to " +
                                  std::to_string(max_rows) + " rows needs more scratch than the model allocated");
    const std::size_t dim = std::size_t(shape.n_heads) * shape.head_dim;
    for (std::size_t i = 0; i < parts.size();) {
      if (!decoding(parts[i])) {
        const AttentionPart& p = parts[i++];
        attention(out + p.offset * dim, q + p.offset * dim, positions + p.offset, p.n, p.kv, shape, scratch, nullptr);
        continue;
      }
      const int first_row = parts[i].offset;  // the run: parts i, i + 1, ... at rows first_row, first_row + 1, ...
      // A launch's views all take the kernel's 16-byte path or all its other one (plain_view), which sums in
      // another order: a view of the other kind ends the run, so each sequence gets the bits it gets alone.
      const bool plain = plain_view(parts[i].kv, shape.head_dim);
      DecodeViews<kMaxBatchSequences> views;
      int count = 0, splits = 1;  // the grid's: the most any view of the launch has
      for (; i < parts.size() && count < kMaxBatchSequences && decoding(parts[i]) && parts[i].offset == first_row + count &&
             plain_view(parts[i].kv, shape.head_dim) == plain;
           ++i, ++count) {
        views.view[count] = parts[i].kv;
        splits = std::max(splits, chunks_.grid_splits(views.view[count].rows));
      }
      decode(out + first_row * dim, q + first_row * dim, positions + first_row, views, count, splits, shape, scratch.data());
    }
  }
  // The decoding kernel over `sequences` views (one query each, rows of q and out one after another) in
  // `splits` chunks of rows at most, merged by the last block of each (KV head, tile, sequence) where there is
  // more than one: one block per (KV head, tile of its query heads, chunk, sequence), one launch.
  template <int kViews>
  void decode(float* out, const float* q, const int* positions, const DecodeViews<kViews>& views, int sequences,
              int splits, const AttentionShape& shape, float* scratch) {
    const int group = shape.n_heads / shape.n_kv_heads, tile = decode_tile(group);
    float* partials = splits > 1 ? scratch : nullptr;
    const dim3 grid(shape.n_kv_heads * (group / tile), splits, sequences), block(kDecodeWarps * kWarp);
    if (partials && std::size_t(grid.x) * grid.z > kArrivalCounters)
      throw std::invalid_argument("attention: " + std::to_string(shape.n_heads) + " query heads x " +
                                  std::to_string(sequences) + " sequences in one decoding launch; the CUDA backend "
                                  "merges split chunks for at most " + std::to_string(kArrivalCounters) +
                                  " (query heads / " + std::to_string(tile) + " x sequences): decode fewer sequences at once");
    const int per_lane = shape.head_dim <= kWarp ? 1 : shape.head_dim <= 2 * kWarp ? 2 : shape.head_dim <= 4 * kWarp ? 4 : 8;
    bool plain_rows = true;  // every view's rows loaded 16 bytes at a time (kPlainRows; attention_batch's runs agree)
    for (int z = 0; z < sequences; ++z) plain_rows = plain_rows && plain_view(views.view[z], shape.head_dim);
#define KVS_DECODE(elements, plain)                                                                              \
  KVS_LAUNCH((attention_decode_kernel<elements, kViews, plain>), grid, block, 0, queue_, out, partials, arrivals_, \
             q, positions, views, chunks_, shape.n_heads, group, tile, shape.head_dim)
#define KVS_DECODE_ROWS(elements)                                    \
  do {                                                                \
    if (plain_rows) KVS_DECODE(elements, true);                       \
    else KVS_DECODE(elements, false);                                 \
  } while (0)
    if (per_lane == 1) KVS_DECODE_ROWS(1);
    else if (per_lane == 2) KVS_DECODE_ROWS(2);
    else if (per_lane == 4) KVS_DECODE_ROWS(4);
    else KVS_DECODE_ROWS(8);
#undef KVS_DECODE_ROWS
#undef KVS_DECODE
  }
  // The fused operations (backend.h) as one gemv_kernel launch each for calls of up to gemv_max_tokens_ tokens;
  // larger calls (prefill) take the definition: cuBLAS's products and the small kernels.
  int fused_tokens() const override { return gemv_max_tokens_; }
  void norm_products(float* normed, const float* x, const float* norm_weight, int n, int d_in, int head_dim,
                     std::span<const Product> products) override {
    GemvArgs a = gemv_args(x, norm_weight, n, d_in, head_dim);
    bool fits = n <= gemv_max_tokens_ && products.size() <= std::size_t(kGemvMaxProducts);
    for (std::size_t p = 0; fits && p < products.size(); ++p) {
      const Product& product = products[p];
      // RoPE's pairs must be pairs of a block's rows: rows 2i, 2i+1 of whole heads, from an even row on.
      if (product.rope && (a.rows % 2 != 0 || head_dim % 2 != 0 || product.d_out % head_dim != 0)) fits = false;
      // The cache rows' positions are the launch's one positions array.
      if (product.cache_rows && a.positions && product.positions != a.positions) fits = false;
      if (product.cache_rows) a.positions = product.positions;
      a.products[p] = GemvProduct{product.out,        product.w,   product.d_out,    product.rope, a.rows,
                                  product.cache_rows, product.cache_row_stride, product.cache_ring};
      a.rows += product.d_out;
      a.count += 1;
    }
    if (!fits) return Backend::norm_products(normed, x, norm_weight, n, d_in, head_dim, products);
    launch_gemv<GemvStore::kSet>(a);
  }
  void norm_swiglu(float* gate, float* up, float* normed, const float* x, const float* norm_weight, const float* w1,
                   const float* w3, int n, int d_in, int hidden) override {
    if (n > gemv_max_tokens_) return Backend::norm_swiglu(gate, up, normed, x, norm_weight, w1, w3, n, d_in, hidden);
    GemvArgs a = gemv_args(x, norm_weight, n, d_in, 0);
    a.products[0] = GemvProduct{gate, w1, hidden}, a.up = w3, a.count = 1, a.rows = hidden;
    launch_gemv<GemvStore::kSwiglu>(a);
  }
  void matmul_add(float* x, float* product, const float* in, const float* w, int n, int d_in, int d_out) override {
    if (n > gemv_max_tokens_) return Backend::matmul_add(x, product, in, w, n, d_in, d_out);
    GemvArgs a = gemv_args(in, nullptr, n, d_in, 0);
    a.products[0] = GemvProduct{x, w, d_out}, a.count = 1, a.rows = d_out;
    launch_gemv<GemvStore::kAdd>(a);
  }

  void write_rows(float* rows, int row_stride, const int* positions, Ring ring, const float* src, int n,
                  int width) override {
    KVS_LAUNCH(write_rows_kernel<Ring>, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, queue_,
               RowSides{{rows, nullptr}, {src, nullptr}}, row_stride, positions, ring, width);
  }
  // One launch for any number of rows (a (positions, 2) grid; a prefill's too).
  void write_key_value_rows(float* keys, float* values, int row_stride, const int* positions, Ring ring, const float* k,
                            const float* v, int n, int width) override {
    KVS_LAUNCH(write_rows_kernel<Ring>, dim3(static_cast<unsigned>(n), 2), dim3(kThreads), 0, queue_,
               RowSides{{keys, values}, {k, v}}, row_stride, positions, ring, width);
  }
  void write_positions(int* slot_positions, const int* positions, Ring ring, int n) override {
    KVS_LAUNCH(write_positions_kernel, dim3(1), dim3(kThreads), 0, queue_, slot_positions, positions, ring, n);
  }
  void write_paged_rows(float* rows, int row_stride, const int* positions, BlockTable table, const float* src, int n,
                        int width) override {
    KVS_LAUNCH(write_rows_kernel<BlockTable>, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, queue_,
               RowSides{{rows, nullptr}, {src, nullptr}}, row_stride, positions, table, width);
  }
  // Up to kMaxBatchSequences sequences a launch (a decode step of 64 sequences: one launch a layer, not 128).
  void write_paged_batch(const CodedRows& keys, const CodedRows& values, const int* positions,
                         std::span<const PagedPart> parts, const float* k, const float* v) override {
    for (std::size_t i = 0; i < parts.size(); ++i)  // what the kernel's scan for a row's part relies on
      if (parts[i].n < 0 || parts[i].offset < (i == 0 ? 0 : parts[i - 1].offset + parts[i - 1].n))
        throw std::invalid_argument("write_paged_batch: parts must be in order of offset and must not overlap");
    for (std::size_t first = 0; first < parts.size(); first += kMaxBatchSequences) {
      const int count = static_cast<int>(std::min<std::size_t>(kMaxBatchSequences, parts.size() - first));
      const int base = parts[first].offset;  // the launch's rows from here: offsets relative to it
      PagedParts launch;
      for (int j = 0; j < count; ++j) {
        const PagedPart& p = parts[first + j];
        launch.part[j] = PagedPart{p.offset - base, p.n, p.table};
      }
      const int end = launch.part[count - 1].offset + launch.part[count - 1].n;  // the rows of the launch
      KVS_LAUNCH(write_paged_batch_kernel, dim3(static_cast<unsigned>(end), 2), dim3(kThreads), 0, queue_, keys, values,
                 positions + base, launch, count, k + std::size_t(base) * keys.width, v + std::size_t(base) * values.width);
    }
  }
  void write_coded_rows(const CodedRows& rows, const int* positions, Ring ring, const float* src, int n) override {
    KVS_LAUNCH(write_coded_rows_kernel<Ring>, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, queue_, rows,
               positions, ring, src);
  }
  void write_paged_coded_rows(const CodedRows& rows, const int* positions, BlockTable table, const float* src,
                              int n) override {
    KVS_LAUNCH(write_coded_rows_kernel<BlockTable>, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, queue_, rows,
               positions, table, src);
  }
  void encode_channel_groups(const CodedRows& rows, int first_group, int groups, const float* src) override {
    KVS_LAUNCH(encode_channel_groups_kernel, dim3(static_cast<unsigned>(groups)), dim3(kThreads), 0, queue_, rows,
               first_group, src);
  }
  void swiglu(float* gate, const float* up, std::size_t count) override {
    KVS_LAUNCH(swiglu_kernel, dim3(blocks_for(count)), dim3(kThreads), 0, queue_, gate, up, count);
  }
  void add(float* x, const float* y, std::size_t count) override {
    KVS_LAUNCH(add_kernel, dim3(blocks_for(count)), dim3(kThreads), 0, queue_, x, y, count);
  }

 private:
  static GemvArgs gemv_args(const float* x, const float* norm_weight, int n, int d_in, int head_dim) {
    GemvArgs a;
    a.x = x, a.norm_weight = norm_weight, a.n = n, a.d_in = d_in, a.head_dim = head_dim;
    return a;
  }
  // 16-byte loads where every row the kernel reads starts on 16 bytes; one float at a time otherwise.
  template <GemvStore kStore>
  void launch_gemv(const GemvArgs& a) {
    bool aligned = a.d_in % 4 == 0 && aligned16(a.x) && aligned16(a.norm_weight) && aligned16(a.up);
    for (int p = 0; p < a.count; ++p) aligned = aligned && aligned16(a.products[p].w);
    if (aligned) launch_gemv_tokens<4, kStore>(a);
    else launch_gemv_tokens<1, kStore>(a);
  }
  template <int kWidth, GemvStore kStore>
  void launch_gemv_tokens(const GemvArgs& a) {  // the kernel's registers for the tokens the call has
    // Warps enough for d_in (the shipped model's 128 floats are one warp's 16-byte loads), up to gemv_warps_.
    const int warps = std::clamp((a.d_in + kWarp * kWidth - 1) / (kWarp * kWidth), 1, gemv_warps_);
    const int tiles = (a.n + kGemvTokens - 1) / kGemvTokens;  // 1 up to kGemvTokens tokens
    const dim3 grid((a.rows + kGemvRows - 1) / kGemvRows * tiles), block(warps * kWarp);
    if (a.n == 1) KVS_LAUNCH((gemv_kernel<1, kWidth, kStore>), grid, block, 0, queue_, a);
    else if (a.n == 2) KVS_LAUNCH((gemv_kernel<2, kWidth, kStore>), grid, block, 0, queue_, a);
    else if (a.n <= 4) KVS_LAUNCH((gemv_kernel<4, kWidth, kStore>), grid, block, 0, queue_, a);
    else KVS_LAUNCH((gemv_kernel<kGemvTokens, kWidth, kStore>), grid, block, 0, queue_, a);
  }
  static bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }
  // Every head of every row of a float view starts on 16 bytes (the decoding kernel's 16-byte loads): the model's
  // caches do (backend memory, rows and heads multiples of 4 floats). A view that does not (head_dim or row_stride
  // not a multiple of 4, rows not on 16 bytes) takes the kernel's other path, each number through KvView::key as a
  // coded view's: correct, slower (book 07), and only the tests' views so far.
  static bool aligned_heads(const KvView& v, int head_dim) {
    return head_dim % 4 == 0 && v.row_stride % 4 == 0 && aligned16(v.keys) && aligned16(v.values);
  }
  // Whether the decoding kernel reads the view's rows on its 16-byte path (kPlainRows): floats as the model stored
  // them, each head on 16 bytes where a lane holds more than one number of a row (head_dim > 32).
  static bool plain_view(const KvView& v, int head_dim) {
    return !v.coded() && !v.read_rope && (head_dim <= kWarp || aligned_heads(v, head_dim));
  }

  void* allocate_bytes(std::size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<std::size_t>(bytes, 1)) != cudaSuccess) {
      cudaGetLastError();  // clear the error so later calls do not report it
      throw std::runtime_error("cannot allocate " + std::to_string(bytes) +
                               " bytes of GPU memory; use fewer positions or a smaller model");
    }
    return p;
  }

  std::string name_;
  int gemv_max_tokens_;  // fused products up to this many tokens (gemv_max_tokens)
  int gemv_warps_;       // a product's block takes at most this many warps (gemv_warps)
  DecodeChunks chunks_;  // how decoding cuts a view's rows (decode_chunks)
  OwnedStream owned_stream_;
  cudaStream_t stream_;  // owned_stream_'s
  cuda::LaunchQueue queue_;  // stream_, and whether kernels go on it programmatically dependent
  Blas blas_;
  std::vector<float*> weights_;
  cudaGraphExec_t graph_ = nullptr;
  int recordings_ = 0;
  int recorded_launches_ = 0;
  int tiled_max_head_dim_ = 32;  // the largest head the tiled prefill attention takes on this device
  // attention_decode_kernel's arrival counts (grid x · z of a split launch), zero between launches.
  unsigned* arrivals_ = nullptr;
};

}  // namespace

#if defined(KVS_CUDA_HARNESS)
std::unique_ptr<Backend> make_cuda_harness_backend() {
  cuda_harness::check_order_setting();
  // Programmatic unless KVS_PROGRAMMATIC_LAUNCH=0, as on an H100: the harness then runs each kernel's first block
  // up to its wait before the kernel ahead of it finishes (harness/cuda_runtime_harness.h).
  return std::make_unique<CudaBackend>("cuda kernels on the CPU (CUDA harness, for tests; never time it)",
                                       programmatic_launch_wanted());
}
#endif

}  // namespace kvs

#if defined(KVS_CUDA_HARNESS)
extern "C" kvs::Backend* kvs_create_cuda_harness_backend() { return kvs::make_cuda_harness_backend().release(); }
#else
extern "C" kvs::Backend* kvs_create_cuda_backend() {
  int devices = 0;
  const cudaError_t error = cudaGetDeviceCount(&devices);
  if (error != cudaSuccess || devices == 0) {
    cudaGetLastError();
    throw std::runtime_error(std::string("no CUDA device found (") +
                             (error != cudaSuccess ? cudaGetErrorString(error) : "the driver reports none") +
                             "); run with --backend cpu");
  }
  cudaDeviceProp properties{};
  KVS_CUDA_CHECK(cudaGetDeviceProperties(&properties, 0));
  // The wait is compiled only into code generated for compute capability 9.0 on (cuda_support.h): a build for
  // older targets alone (CMAKE_CUDA_ARCHITECTURES=80) runs on an H100 from their PTX, and its kernels would not wait.
  cudaFuncAttributes kernel{};
  KVS_CUDA_CHECK(cudaFuncGetAttributes(&kernel, kvs::embed_kernel));
  const bool programmatic = kvs::programmatic_launch_wanted() && properties.major >= 9 && kernel.ptxVersion >= 90;
  return new kvs::CudaBackend(std::string("cuda (") + properties.name + ", cuBLAS" +
                                  (programmatic ? ", programmatic launch" : "") + ")",
                              programmatic);
}
#endif
