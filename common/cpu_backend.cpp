#include "cpu_backend.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <new>
#include <string>
#include <type_traits>

#include "cli.h"
#include "rope.h"
#include "worker_pool.h"

namespace kvs {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::OuterStride<>;
constexpr float kRmsEps = 1e-5f;

// Work is handed to other threads only where it is at least this many multiply-adds (~10 us on one core): a
// matrix product's every task, decode attention as a whole. Handing a task over costs a round trip between
// cores (worker_pool.h), and a decode step of the shipped model is ~40 products and attention calls of
// 1-30 us (and ~50 smaller operations). Measured there with 2 threads (03_benchmark --breakdown): splitting
// every matrix product into 32-column tasks made a step at context 32 slower, 0.112 ms against 0.089 with
// one thread; products of its size now run on one core, attention over long contexts on two.
constexpr std::int64_t kTaskMultiplyAdds = 1 << 17;

// A matrix product's tasks: whole groups of 16 output columns (rows of the weight matrix), each at least
// kTaskMultiplyAdds (a few-token product of one tile takes wider ones: few_token_task_columns, in matmul). The
// split depends on the shapes only, never on the thread count, so every output is the same sum in the same order
// on 1 or 2 threads (bit-identical results, tested).
int matmul_columns_per_task(int n, int d_in, int d_out) {
  const std::int64_t per_column = std::int64_t(n) * d_in;
  const std::int64_t columns = (kTaskMultiplyAdds + per_column - 1) / per_column;
  return static_cast<int>(std::min<std::int64_t>(d_out, (columns + 15) / 16 * 16));
}

// Softmax in place over s[0, count) of the scores times `scale` (1/sqrt(head_dim)): scores in, probabilities
// out. Vectorised: Eigen's exp runs on
// whole SIMD registers (std::exp in a loop ran one float at a time and was most of attention's time at long
// context). A -inf score weighs ~0, not always 0: Eigen's exp clamps its argument on some instruction sets
// (without -march=native, exp(-inf) came out as 2e-36). Whoever masks with -inf zeroes those rows after.
// (Selecting 0 for -inf inside the expression made Eigen 3.4 evaluate it one float at a time: attention
// at 512 positions took 0.117 ms instead of 0.046.)
void softmax(float* s, int count, float scale) {
  Eigen::Map<Eigen::ArrayXf> a(s, count);
  a *= scale;
  a = (a - a.maxCoeff()).exp();
  a *= 1.0f / a.sum();
}

// What an attention observer receives for one query and head (backend.h): the weights of view rows
// [begin, begin + count), 0 on every other of the view's rows.
void observe_weights(float* observed, int view_rows, const float* run, int begin, int count) {
  std::fill(observed, observed + view_rows, 0.0f);
  std::copy(run, run + count, observed + begin);
}

// ---- decode attention over one run of rows ----
// Eigen's SIMD registers ("packets"): kLanes floats, 4 with SSE, 8 with AVX, 16 with AVX-512.
using Packet = Eigen::internal::packet_traits<float>::type;
constexpr int kLanes = Eigen::internal::packet_traits<float>::size;

// One query (a decode step) over the rows [begin, end) all its heads see, for the query heads of KV heads
// [c0, c1) (group query heads each); scratch + h · head_stride holds head h's scores, then its weights:
//   1. one sweep down the rows: each head's score against the row's key of its KV head;
//   2. each head's softmax;
//   3. one sweep down the rows: out (heads, head_dim) += weight · the row's value of its KV head.
// Why sweeps over rows with the heads inside: a cache row holds every KV head side by side (kv_dim floats);
// Eigen's products (the general path below) run a head at a time, and a head reading its part of each
// row costs about as much as reading the whole row (the prefetcher fetches the cache lines it skips).
// Why packets: a dot product of head_dim floats is kPackets multiply-adds and one sum across the register,
// with kPackets known at compile time (a loop bound known only at run time made it 2x slower). Why kRows
// rows at a time: their dot products are independent, so the core overlaps them, and out is loaded and
// stored once per kRows rows. Measured on the shipped model (5 layers, 1984 positions, one thread, AMD EPYC
// with AVX-512): Eigen's per-head products 0.13-0.19 ms; a row at a time 0.117 ms; 2, 4, 8 and 16 rows at a
// time 0.110, 0.103, 0.093 and 0.104 ms (book 03 also has what was tried and dropped). __restrict: out and
// scratch share no memory with the cache or q.
constexpr int kRows = 8;
// In a paged view (chapter 08) a sweep prefetches the rows kPrefetchRows ahead of the group it reads. A block of
// 16 positions holds one layer's keys (or values) of the shipped model in 16 rows of 256 bytes, 4 KiB, a page's
// size, and the next block is any other page of the pool: the core's prefetcher, which follows a stream within a
// page, starts over at every block and the sweep waits on memory there. A contiguous view needs none of this (the same
// prefetch there made attention at 1,848 positions 27% slower, one thread). Measured on chapter 08's light batching
// trace (16 sequences of ~170 positions, a pool in use for a while), one thread, each kind alone, 9 rounds a run,
// old and new builds interleaved, AMD EPYC: continuous batching +8.6% tokens/s (median of 5 pairs, -1% to +12%),
// static batching +1% (4 pairs, -2% to +5%); decode steps of 80 positions (its throughput experiment) unchanged
// within the noise. A prefetch changes no result. Coded rows (chapter 10) take none: the same prefetch of their
// codes and scales, on the same trace, measured int8 +2% (median of 6 pairs), int4 -1% (4 pairs), too little to keep.
// Nor did a block-table lookup a run instead of a row pay (continuous batching -3%, median of 6 pairs: noise).
constexpr int kPrefetchRows = 16;
// sums[j] = the sum of dot[j]'s lanes, for j < n: a dot product's last step, for n rows at once. One row at a time
// (Eigen's predux) is a ladder of extracts, shuffles and adds per row, ~9 instructions on AVX-512 (~7 on AVX):
// at head_dim 32 more than the row's 2 multiply-adds and 2 loads per query head, about a quarter of attention at
// 1,984 positions. For 8 rows the registers are instead added into each other while they are folded (a transposed
// reduction), so each shuffle and add serves several rows: ~25 instructions for the 8 rows on AVX-512, ~21 on
// AVX. Measured (book 03½, plots/data/cpu_score_sums): attention at 1,848 positions on one thread 0.206 -> 0.166
// ms, median of 15 interleaved runs. The sums add the same numbers in another order, so they differ from predux's
// in the last bits; the attention tests compare both with the plain-loop reference. Other instruction sets (SSE:
// CI's build) keep predux.
template <int n>
void store_sums(const Packet (&dot)[n], float* __restrict sums) {
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (n == 8) {
    // Quarters (128 bits) of rows a and b: [a0 + a2, a1 + a3, b0 + b2, b1 + b3], 8 floats of each row's sum.
    auto halve = [](__m512 a, __m512 b) {
      return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    };
    // Two halved pairs: [a, b, c, d], a quarter (4 floats of its sum) each.
    auto quarter = [](__m512 ab, __m512 cd) {
      return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    };
    const __m512 abcd = quarter(halve(dot[0], dot[1]), halve(dot[2], dot[3]));
    const __m512 efgh = quarter(halve(dot[4], dot[5]), halve(dot[6], dot[7]));
    // In each quarter k, rows k and 4 + k: [u0 + u2, v0 + v2, u1 + u3, v1 + v3], then + its 64-bit halves swapped:
    // row k's sum in float 4k, row 4 + k's in float 4k + 1.
    const __m512 pairs = _mm512_add_ps(_mm512_unpacklo_ps(abcd, efgh), _mm512_unpackhi_ps(abcd, efgh));
    const __m512 totals = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_ps(sums, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, totals)));
    return;
  }
#elif defined(EIGEN_VECTORIZE_AVX)
  if constexpr (n == 8) {
    // hadd adds neighbours within each half (128 bits): after two rounds, half h holds rows 0-3's (and 4-7's)
    // sums over that half's floats; adding the two halves gives the 8 sums in order.
    const __m256 rows03 = _mm256_hadd_ps(_mm256_hadd_ps(dot[0], dot[1]), _mm256_hadd_ps(dot[2], dot[3]));
    const __m256 rows47 = _mm256_hadd_ps(_mm256_hadd_ps(dot[4], dot[5]), _mm256_hadd_ps(dot[6], dot[7]));
    _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_permute2f128_ps(rows03, rows47, 0x20),
                                         _mm256_permute2f128_ps(rows03, rows47, 0x31)));
    return;
  }
#endif
  for (int j = 0; j < n; ++j) sums[j] = Eigen::internal::predux(dot[j]);
}

// Rows [row, row + count) of KV head `kv_head` of a coded side (chapter 10) decoded into `decoded`
// (count, head_dim): what every CPU path reads when the view's rows are not floats in place.
void decode_head_rows(const KvView& kv, const CodedRows& codes, int row, int count, int kv_head, int head_dim,
                      float* __restrict decoded) {
  for (int j = 0; j < count; ++j)
    codes.decode_run(kv.physical_row(row + j), kv_head * head_dim, head_dim, decoded + std::size_t(j) * head_dim);
}
// Rows of a coded view (chapter 10) the general path below decodes for one product: enough rows that Eigen's
// product stays efficient, few enough that they stay in L1 (32 KB at head_dim 256).
constexpr int kDecodedRows = 32;
template <int kPackets>
void attend_one_query(float* __restrict out, const float* q, const KvView& kv, int begin, int end, int c0, int c1,
                      int group, float scale, float* __restrict scratch, std::size_t head_stride) {
  using namespace Eigen::internal;
  constexpr int head_dim = kPackets * kLanes;
  const int rows = end - begin;
  const std::size_t stride = kv.row_stride;

  // 1. scores of rows r .. r + n - 1 for the query heads of KV head c, whose keys start at `key` (row r + j at j · step)
  auto score_rows = [&]<int n>(const float* key, std::size_t step, int c, int r, std::integral_constant<int, n>) {
    for (int h = c * group; h < (c + 1) * group; ++h) {
      const float* query = q + h * head_dim;
      Packet dot[n];
      for (int j = 0; j < n; ++j) dot[j] = pmul(ploadu<Packet>(query), ploadu<Packet>(key + j * step));
      for (int p = 1; p < kPackets; ++p) {
        const Packet query_part = ploadu<Packet>(query + p * kLanes);
        for (int j = 0; j < n; ++j) dot[j] = pmadd(query_part, ploadu<Packet>(key + j * step + p * kLanes), dot[j]);
      }
      store_sums(dot, scratch + h * head_stride + r);
    }
  };
  // 3. out += the weighted values of rows r .. r + n - 1 of KV head c, starting at `value` (out: a few KB, stays in L1)
  auto add_value_rows = [&]<int n>(const float* value, std::size_t step, int c, int r, std::integral_constant<int, n>) {
    for (int h = c * group; h < (c + 1) * group; ++h) {
      Packet weight[n];
      for (int j = 0; j < n; ++j) weight[j] = pset1<Packet>(scratch[h * head_stride + r + j]);
      float* o = out + h * head_dim;
      for (int p = 0; p < kPackets; ++p) {
        Packet sum = ploadu<Packet>(o + p * kLanes);
        for (int j = 0; j < n; ++j) sum = pmadd(weight[j], ploadu<Packet>(value + j * step + p * kLanes), sum);
        pstoreu(o + p * kLanes, sum);
      }
    }
  };
  // Each sweep goes down the runs of rows stored stride apart (the whole range in a contiguous view; a block
  // at a time in a paged one, KvView::run_end), kRows at a time within a run. Float rows are read in place;
  // coded rows (chapter 10) are decoded first, kRows rows of one head at a time into `decoded` on the stack,
  // which the same products then read: the decoded numbers exist for one group of rows, never for the cache.
  auto sweep = [&](const float* base, const CodedRows& codes, auto&& rows_at) {
    alignas(64) float decoded[kRows * head_dim];
    auto rows_from = [&]<int n>(int r, std::integral_constant<int, n> count) {
      if (codes.format == KvFormat::kFp32) {
        const float* first = base + kv.row_offset(begin + r);
        for (int c = c0; c < c1; ++c) rows_at(first + c * head_dim, stride, c, r, count);
        return;
      }
      for (int c = c0; c < c1; ++c) {
        decode_head_rows(kv, codes, begin + r, n, c, head_dim, decoded);
        rows_at(decoded, head_dim, c, r, count);
      }
    };
    const bool prefetch = kv.paged.blocks && codes.format == KvFormat::kFp32;  // see kPrefetchRows
    const int row_bytes = (c1 - c0) * head_dim * int(sizeof(float));  // the KV heads this sweep reads, of a row
    for (int run = 0; run < rows;) {
      const int run_stop = kv.run_end(begin + run, end) - begin;
      int r = run;
      for (; r + kRows <= run_stop; r += kRows) {
        if (prefetch && r + kPrefetchRows + kRows <= rows)
          for (int j = 0; j < kRows; ++j) {
            const float* ahead = base + kv.row_offset(begin + r + kPrefetchRows + j) + c0 * head_dim;
            const char* row = reinterpret_cast<const char*>(ahead);
            for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);  // a cache line at a time
          }
        rows_from(r, std::integral_constant<int, kRows>{});
      }
      for (; r < run_stop; ++r) rows_from(r, std::integral_constant<int, 1>{});
      run = run_stop;
    }
  };
  sweep(kv.keys, kv.key_codes, score_rows);
  for (int h = c0 * group; h < c1 * group && rows > 0; ++h) softmax(scratch + h * head_stride, rows, scale);  // 2. weights
  std::fill(out + c0 * group * head_dim, out + c1 * group * head_dim, 0.0f);
  sweep(kv.values, kv.value_codes, add_value_rows);
}

// attend_one_query for this head_dim, or null where head_dim is not 1, 2, 4 or 8 packets (the general path).
using OneQueryKernel = void (*)(float*, const float*, const KvView&, int, int, int, int, int, float, float*, std::size_t);
OneQueryKernel one_query_kernel(int head_dim) {
  switch (head_dim % kLanes == 0 ? head_dim / kLanes : 0) {
    case 1: return attend_one_query<1>;
    case 2: return attend_one_query<2>;
    case 4: return attend_one_query<4>;
    case 8: return attend_one_query<8>;
    default: return nullptr;
  }
}

// Whether attention's decode fast path takes the `n` queries at positions[0 ..] over `kv`: one query, keys rotated
// already (no read-time rotation), its visible rows one run [begin, end), a head of whole packets. Returns the kernel
// (null: the general path). attention() and attention_batch() ask the same question here. The position is read only
// for one query (a part of no queries has none).
OneQueryKernel one_query_run(const KvView& kv, int n, const int* positions, int head_dim, int& begin, int& end) {
  if (n != 1 || kv.read_rope) return nullptr;
  const OneQueryKernel kernel = one_query_kernel(head_dim);
  return kernel && kv.visible_rows(positions[0], begin, end) ? kernel : nullptr;
}

// ---- products for a few tokens (decode steps, batches, short prompts) ----
// out (n, columns) = x (n, d_in) · W_T (d_in, columns) for any n (matmul takes it up to few_token_limit_,
// kFewTokens unless set), W_T a slice of a transposed weight
// matrix (upload_matrix), its rows w_stride floats apart. Why not Eigen: it takes one token through its GEMV and
// two or more through its GEMM, which first copies ("packs") the weight slice it will read - for a few tokens that
// copy costs more than the product: a decode step of two sequences took 2.7x the time of one (0.147 against 0.053
// ms, book 08 before this path). Here each packet of weights is loaded once and multiplied into the sums of up to
// kTileTokens tokens, with up to kAccumulators packets of running sums: with AVX-512 a tile of one token spans 8
// packets of outputs, of two tokens 8 or 4, of more tokens fewer (with 16 registers: 6 packets for one token, 3, 2
// and 1 for two, three and four). (The totals, as many packets again, may not all fit in registers beside them;
// the compiler keeps the rest on the stack, in L1, where Eigen's GEMV keeps all of its.)
// More tokens than a tile: the tiles of tokens take the slice's inputs a chunk at a time (kChunkBytes of weights),
// every tile through one chunk before the next, so the chunk is read from memory once and by the other tiles from
// L1; between chunks a tile's totals wait in `out`. Without chunks, 32 tokens of a synthetic model of dim 1024
// re-read their 16-column slices - a 64-byte line of each 4 KiB-strided row - from L2 for every tile: its 2816 x
// 1024 product took 4.5-4.8 ms, Eigen's GEMM 2.8-3.0, chunks 2.7-2.8 (one thread, AMD EPYC, AVX-512, two runs).
// Every output element is the same sum whatever n and whatever tile or chunk computes it: its inputs in blocks of
// kSumBlock, each block summed from zero by multiply-adds in input order, then added to the element's total. That
// is the order of Eigen 3.4's GEMV for d_in >= 128 and d_out < 8000 (GeneralMatrixVector.h: blocks of 16 columns
// of its matrix; whole products below 128, blocks of 4 above 8000), so one token of the shipped model gets the
// bits it got before (tested against Eigen); and a token in a batch gets the bits it gets alone (tested): chapter
// 08's decode step of up to kFewTokens sequences computes each one exactly as a step of that sequence alone.
// kFewTokens = 64, measured (one thread, AMD EPYC, AVX-512, two runs, this path against Eigen's GEMM): the shipped
// model's products at 16, 32 and 64 tokens take half to two thirds of GEMM's time (w1, microseconds: 8 vs 15, 16
// vs 33, 44 vs 68); a dim-1024 model's at 32 tokens 0.75x to 1.04x of GEMM's, at 64 between 0.78x (1024 x 2816)
// and 1.2x (1024 x 1024) - about even over a layer. Above 64 tokens (prefill) GEMM's packing pays for itself.
// `08_paged_batching --experiment products` times both paths on the model's layer 0, on any machine (book 08).
constexpr int kFewTokens = 64;
// A tile's running sums and totals (2 x kAccumulators packets), its weights and an input must fit the registers.
// Where there are 16 (x86 without AVX-512), 8 sums spilled: a tile of 4 tokens took 2 packets, 8 + 8 + 2 + 1 = 19.
// 6 keeps that tile at one packet (10 registers). Measured on the shipped model's four products of a layer,
// microseconds a token, one thread, an AMD EPYC running an AVX2 build (-march=haswell: a stand-in for an AVX2
// machine, two runs): 8 tokens 5.95-6.49 -> 3.69-3.71, 64 tokens 5.89-6.01 -> 3.54-3.56 (Eigen's GEMM 3.23-3.29),
// one token 4.4-5.4 either way (noise); an SSE2 build (CI's) one token 11.7-13.8 -> 7.6, 64 tokens 10.7-12.2 -> 8.8-9.2.
// A dim-1024 model's at 64 tokens 449-469 -> 495-498, at 8 and one token within the noise; both about twice Eigen's
// GEMM's time (216-242 at 64 tokens): kFewTokens above was measured with AVX-512 only, and on AVX2 Eigen would be
// faster for 2 to 64 tokens, but would give a token in a batch other bits than alone. Each element's sum is the
// same whatever the tile (above), so kAccumulators changes no bits.
#ifdef EIGEN_VECTORIZE_AVX512
constexpr int kTileTokens = 8, kAccumulators = 16;  // 32 registers
#elif defined(__x86_64__) || defined(__i386__)
constexpr int kTileTokens = 4, kAccumulators = 6;  // 16 registers (SSE, AVX)
#else
constexpr int kTileTokens = 4, kAccumulators = 8;  // other instruction sets (NEON's 32 registers): not measured
#endif
constexpr int kSumBlock = 16;
constexpr int kChunkBytes = 32 * 1024;  // an L1 data cache (AMD Zen; 48 KiB on recent Intel); 16, 64 KiB: slower

// Tokens [0, kTokens) of x (rows x_stride floats apart), inputs [0, inputs), outputs [0, kPackets · kLanes) of a
// tile; `add`: out already holds the totals of earlier inputs (an earlier chunk). kPartial: the tile is the last
// `columns` < kLanes outputs, its weights and totals read through a zero-padded packet (the same arithmetic).
template <int kTokens, int kPackets, bool kPartial = false>
void few_token_tile(float* __restrict out, int out_stride, const float* x, int x_stride, int inputs, const float* w,
                    int w_stride, bool add, int columns = kLanes) {
  using namespace Eigen::internal;
  alignas(64) float padded[kLanes] = {};  // kPartial: a row of weights or of totals, zeros past `columns`
  Packet total[kTokens][kPackets], sum[kTokens][kPackets];
  for (int t = 0; t < kTokens; ++t) {
    const float* o = out + std::size_t(t) * out_stride;
    for (int p = 0; p < kPackets; ++p) {
      if (!add) {
        total[t][p] = pset1<Packet>(0.0f);
      } else if constexpr (kPartial) {
        std::copy(o, o + columns, padded);
        total[t][p] = pload<Packet>(padded);
      } else {
        total[t][p] = ploadu<Packet>(o + p * kLanes);
      }
    }
  }
  for (int begin = 0; begin < inputs; begin += kSumBlock) {
    const int end = std::min(begin + kSumBlock, inputs);
    for (int t = 0; t < kTokens; ++t)
      for (int p = 0; p < kPackets; ++p) sum[t][p] = pset1<Packet>(0.0f);
    for (int i = begin; i < end; ++i) {
      const float* row = w + std::size_t(i) * w_stride;
      Packet weight[kPackets];
      if constexpr (kPartial) {
        std::copy(row, row + columns, padded);
        weight[0] = pload<Packet>(padded);
      } else {
        for (int p = 0; p < kPackets; ++p) weight[p] = ploadu<Packet>(row + p * kLanes);
      }
      for (int t = 0; t < kTokens; ++t) {
        const Packet input = pset1<Packet>(x[std::size_t(t) * x_stride + i]);
        for (int p = 0; p < kPackets; ++p) sum[t][p] = pmadd(weight[p], input, sum[t][p]);
      }
    }
    for (int t = 0; t < kTokens; ++t)
      for (int p = 0; p < kPackets; ++p) total[t][p] = padd(sum[t][p], total[t][p]);
  }
  for (int t = 0; t < kTokens; ++t) {
    float* o = out + std::size_t(t) * out_stride;
    if constexpr (kPartial) {
      pstore(padded, total[t][0]);
      std::copy(padded, padded + columns, o);
    } else {
      for (int p = 0; p < kPackets; ++p) pstoreu(o + p * kLanes, total[t][p]);
    }
  }
}

// kTokens tokens through all `columns` outputs, for inputs [0, inputs): the widest tiles first, then one of the
// packets left where it fits (else narrower), then a partial packet.
template <int kTokens>
void few_token_rows(float* out, int out_stride, const float* x, int x_stride, int inputs, const float* w,
                    int w_stride, int columns, bool add) {
  int c = 0;
  auto tiles = [&]<int kPackets>(std::integral_constant<int, kPackets>) {
    if constexpr (kTokens * kPackets <= kAccumulators)
      for (; c + kPackets * kLanes <= columns; c += kPackets * kLanes)
        few_token_tile<kTokens, kPackets>(out + c, out_stride, x, x_stride, inputs, w + c, w_stride, add);
  };
  // Packets left after the widest tiles in one tile where the sums fit: two passes over a task of 48 columns
  // (2 packets, then 1) took a token of a dim-1024 model's 2816 x 1024 product (w2) 1.25 ms, one pass 0.67,
  // Eigen's GEMV's time: each pass reads the strided rows of weights from memory.
  tiles(std::integral_constant<int, 8>{});
  tiles(std::integral_constant<int, 7>{});
  tiles(std::integral_constant<int, 6>{});
  tiles(std::integral_constant<int, 5>{});
  tiles(std::integral_constant<int, 4>{});
  tiles(std::integral_constant<int, 3>{});
  tiles(std::integral_constant<int, 2>{});
  tiles(std::integral_constant<int, 1>{});
  if (c < columns)
    few_token_tile<kTokens, 1, true>(out + c, out_stride, x, x_stride, inputs, w + c, w_stride, add, columns - c);
}

// The fewest output columns a task of a few-token product of n tokens takes: when one tile holds every token, the
// width of its widest tile (kAccumulators / n packets, at most 8), rounded up to whole groups of 16. The split by
// multiply-adds alone (matmul_columns_per_task) gives a dim-1024 model's products of 1,024 inputs tasks of 16
// columns from 8 tokens on (its w2, of 2,816 inputs, from 3 tokens on): a tile of one packet then reads one
// 64-byte line of each weight row, rows 4 KiB apart, and waits on memory at every row (perf: most of its time on
// that load). Measured (four products of a dim-1024 layer: q, k, w1 and w2; one thread, AMD EPYC, AVX-512, six
// interleaved runs, microseconds a token): 8 tokens 690-710 -> 430-470, 4 tokens 790-815 -> 485-520, 2 tokens
// 905-1005 -> 560-760; chapter 08's decode step of the dim-1024 model, 2 threads, B = 8 37.7-38.1 -> 25.2-25.4 ms,
// B = 4 22.5-23.0 -> 17.5-17.9 ms. Not for more tokens than a tile: at 9 to 16 tokens a minimum of 32 or 64 columns
// measured slower (9 tokens 340-390 -> 430-510), where the tiles share each chunk's weights (why narrow tasks suit
// that is not understood). A minimum of 256 or 512 columns for every count: no better than this, within the noise.
// Measured with AVX-512 only (with AVX's 16 registers the widest tiles are 48 columns for one token, 24 for two, 16
// for three, 8 for four: tasks of 48, 32, 16, 16), and on one and two threads: on many cores, fewer and wider tasks
// may leave some idle (a dim-1024 q at 2 tokens: 8 tasks where there were 16).
int few_token_task_columns(int n) {
  if (n > kTileTokens) return 0;
  return (kLanes * std::min(8, kAccumulators / n) + 15) / 16 * 16;
}

// Inputs per chunk: whole blocks of kSumBlock whose weights for `columns` outputs fill kChunkBytes; all of d_in
// when one tile holds every token (nothing would read a chunk twice).
int few_token_chunk(int n, int d_in, int columns) {
  if (n <= kTileTokens) return d_in;
  const int row_bytes = (columns + kLanes - 1) / kLanes * kLanes * int(sizeof(float));
  return std::max(kSumBlock, kChunkBytes / row_bytes / kSumBlock * kSumBlock);
}

void few_token_product(float* out, int out_stride, const float* x, int n, int d_in, const float* w, int w_stride,
                       int columns) {
  const int chunk = few_token_chunk(n, d_in, columns);
  for (int begin = 0; begin < d_in; begin += chunk) {
    const int inputs = std::min(chunk, d_in - begin);
    const float* w_chunk = w + std::size_t(begin) * w_stride;
    const bool add = begin > 0;
    for (int t = 0; t < n; t += kTileTokens) {
      float* o = out + std::size_t(t) * out_stride;
      const float* xt = x + std::size_t(t) * d_in + begin;
      switch (std::min(kTileTokens, n - t)) {  // 5 to 8 only where kTileTokens is 8 (AVX-512)
        case 1: few_token_rows<1>(o, out_stride, xt, d_in, inputs, w_chunk, w_stride, columns, add); break;
        case 2: few_token_rows<2>(o, out_stride, xt, d_in, inputs, w_chunk, w_stride, columns, add); break;
        case 3: few_token_rows<3>(o, out_stride, xt, d_in, inputs, w_chunk, w_stride, columns, add); break;
        case 4: few_token_rows<4>(o, out_stride, xt, d_in, inputs, w_chunk, w_stride, columns, add); break;
        case 5: few_token_rows<5>(o, out_stride, xt, d_in, inputs, w_chunk, w_stride, columns, add); break;
        case 6: few_token_rows<6>(o, out_stride, xt, d_in, inputs, w_chunk, w_stride, columns, add); break;
        case 7: few_token_rows<7>(o, out_stride, xt, d_in, inputs, w_chunk, w_stride, columns, add); break;
        default: few_token_rows<8>(o, out_stride, xt, d_in, inputs, w_chunk, w_stride, columns, add); break;
      }
    }
  }
}

}  // namespace

// Nothing process-wide is set here: two backends in one process must not change each other's thread count.
// Each backend owns its team of threads; Eigen itself always runs on the calling thread.
CpuBackend::CpuBackend(int threads)
    : pool_(std::make_unique<WorkerPool>(threads > 0 ? threads : available_cores())), few_token_limit_(kFewTokens) {}

void CpuBackend::set_few_token_limit(int tokens) {
  if (tokens < 0) throw std::invalid_argument("few-token limit " + std::to_string(tokens) + ": give 0 or more tokens");
  few_token_limit_ = tokens;
}

int CpuBackend::threads() const { return pool_->threads(); }

CpuBackend::~CpuBackend() {
  for (float* w : weights_) release(w);
}

float* CpuBackend::allocate_weights(std::size_t floats) {
  float* weights = allocate(floats);
  weights_.push_back(weights);
  weight_bytes_ += std::int64_t(floats) * std::int64_t{sizeof(float)};
  return weights;
}

const float* CpuBackend::upload_weights(const float* host, std::size_t floats) {
  float* copy = allocate_weights(floats);
  if (floats > 0) std::memcpy(copy, host, floats * sizeof(float));
  return copy;
}

// Transposed: (cols, rows), so that a decode step's matrix-vector product reads the matrix column by column
// of the original, i.e. row by row here, and each input value scales one contiguous row of outputs
// (out += x[i] · row i): whole registers of outputs, no sums across a register. Eigen reads a row-major
// (d_out, d_in) matrix as one dot product per output instead, each ending in a sum across the register;
// and the checkpoint's tensors start 28 bytes into the file, so every register load read from the mapped file
// straddled two cache lines. Measured on the shipped model's 36 products per token (one thread, AMD EPYC,
// AVX-512): from the mapped file 47-55 us, from an aligned row-major copy 43-50 us, transposed 40 us.
const float* CpuBackend::upload_matrix(const float* host, int rows, int cols) {
  float* copy = allocate_weights(std::size_t(rows) * cols);
  Eigen::Map<RowMajor>(copy, cols, rows) = Eigen::Map<const RowMajor>(host, rows, cols).transpose();
  return copy;
}

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

void CpuBackend::to_host(int* host, const int* src, std::size_t count) {
  if (count > 0 && host != src) std::memcpy(host, src, count * sizeof(int));
}

std::string CpuBackend::describe() const {
  return std::string(name()) + ", " + std::to_string(threads()) + " thread" + (threads() > 1 ? "s" : "");
}

void CpuBackend::copy(float* dst, const float* src, std::size_t floats) {
  check_no_overlap(dst, src, floats);
  if (floats > 0) std::memcpy(dst, src, floats * sizeof(float));
}

// (n_heads, kQueryBlock, max_rows rounded up to whole packets): a row of scores starts at a packet's alignment
// (the backend's memory is aligned so) whatever max_rows is. softmax's vectorised sum adds the leading floats
// up to an aligned address one by one, the rest a packet at a time: aligned scores make a decode step's sum the
// same in a scratch of any size and in any task's row (attention_batch), so the same bits alone and in a batch.
std::size_t CpuBackend::attention_scratch_floats(const AttentionShape& shape, int max_rows, int /*max_sequences*/) const {
  const std::size_t row = (std::size_t(std::max(max_rows, 0)) + kLanes - 1) / kLanes * kLanes;
  return std::size_t(shape.n_heads) * kQueryBlock * row;
}

void CpuBackend::embed(float* x, const float* table, const int* tokens, int n, int dim) {
  for (std::size_t i = 0; i < std::size_t(n); ++i)
    std::memcpy(x + i * dim, table + std::size_t(tokens[i]) * dim, dim * sizeof(float));
}

void CpuBackend::matmul(float* out, const float* x, const float* w, int n, int d_in, int d_out) {
  if (n == 0) return;  // no tokens (the split into tasks divides by n)
  Eigen::Map<const RowMajor> X(x, n, d_in);
  const bool few_tokens = n <= few_token_limit_;  // read once: every task of one product takes the same path
  const int columns_per_task =
      std::min(d_out, std::max(matmul_columns_per_task(n, d_in, d_out), few_tokens ? few_token_task_columns(n) : 0));
  pool_->run((d_out + columns_per_task - 1) / columns_per_task, [&](int task) {
    const int first = task * columns_per_task, columns = std::min(columns_per_task, d_out - first);
    // w is wᵀ (d_in, d_out) (upload_matrix): this task's output columns are its columns [first, first + columns).
    if (few_tokens) return few_token_product(out + first, d_out, x, n, d_in, w + first, d_out, columns);
    Eigen::Map<const RowMajor, 0, Strided> W_T(w + first, d_in, columns, Strided(d_out));  // (d_in, columns)
    Eigen::Map<RowMajor, 0, Strided> Out(out + first, n, columns, Strided(d_out));       // (n, columns)
    // More tokens than few_token_limit_ (kFewTokens): Eigen's GEMM (it packs the slice once for them all).
    Out.noalias() = X * W_T;
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
  if (n == 0) return;  // no queries: no positions[0] to read
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
  if (kv.coded() && head_dim > kMaxCodedHeadDim)
    throw std::invalid_argument("attention: a coded cache's heads may have up to " + std::to_string(kMaxCodedHeadDim) +
                                " numbers; this model's have " + std::to_string(head_dim));
  // View row r's key or value of KV head kv_head (head_dim floats): in place, or decoded into `decoded`.
  auto row_of = [&](const float* base, const CodedRows& codes, int r, int kv_head, float* decoded) -> const float* {
    if (codes.format == KvFormat::kFp32) return base + kv.row_offset(r) + kv_head * head_dim;
    decode_head_rows(kv, codes, r, 1, kv_head, head_dim, decoded);
    return decoded;
  };

  // A decode step over one run of rows (through chapter 02's and 03's caches): every head in sweeps over
  // the rows (attend_one_query). Heads of one KV head stay together on one thread; each head's
  // arithmetic is the same however the heads are split, so 1 and 2 threads give the same bits.
  int run_begin = 0, run_end = 0;
  if (const OneQueryKernel one_query = one_query_run(kv, n, positions, head_dim, run_begin, run_end)) {
    const int run_rows = run_end - run_begin;  // visible_rows keeps begin <= end
    auto kv_heads = [&](int first_kv_head, int kv_head_count) {
      const int c1 = first_kv_head + kv_head_count, h0 = first_kv_head * group, h1 = c1 * group;
      one_query(out, q, kv, run_begin, run_end, first_kv_head, c1, group, scale, scratch.data(), head_stride);
      if (weights)
        for (int h = h0; h < h1; ++h)
          observe_weights(weights + std::size_t(h) * kv.rows, kv.rows, scratch.data() + h * head_stride, run_begin, run_rows);
    };
    const std::int64_t multiply_adds = 2 * std::int64_t(run_rows) * shape.n_heads * head_dim;
    if (threads() > 1 && multiply_adds >= kTaskMultiplyAdds) pool_->run(shape.n_kv_heads, [&](int kv_head) { kv_heads(kv_head, 1); });
    else kv_heads(0, shape.n_kv_heads);  // one sweep reads each row once
    return;
  }

  // Keys cached unrotated (chapter 04's streaming variant): a query at a time, each visible key rotated by
  // its position within the window as it is read (kv_cache.h), into one dot product. The softmax and the
  // weighted sum are the same as below; only the scores differ in how they are made.
  auto one_head_rotating_at_read = [&](int h) {
    const int kv_head = h / group, pairs = head_dim / 2;
    alignas(64) float decoded[kMaxCodedHeadDim];  // a coded row's head, decoded as it is read
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
        const float* key = row_of(kv.keys, kv.key_codes, r, kv_head, decoded);
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
        const float* value = row_of(kv.values, kv.value_codes, r, kv_head, decoded);
        for (int d = 0; d < head_dim; ++d) o[d] += weight * value[d];
      }
    }
  };

  auto one_head = [&](int h) {
    if (kv.read_rope) return one_head_rotating_at_read(h);
    const int kv_head = h / group;  // the KV head this query head reads
    float* scores_mem = scratch.data() + h * head_stride;
    alignas(64) float decoded[kDecodedRows * kMaxCodedHeadDim];  // coded rows of this head, decoded (32 KB, this thread's stack)
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
      // View rows [row, row + count) of this KV head's keys or values: (count, head_dim), rows row_stride apart
      // in place; or, from a coded side (chapter 10), decoded into `decoded` (count <= kDecodedRows) and read there.
      auto rows_of = [&](const float* base, const CodedRows& codes, int row, int count) {
        if (codes.format == KvFormat::kFp32)
          return Eigen::Map<const RowMajor, 0, Strided>(base + kv.row_offset(row) + kv_head * head_dim, count, head_dim,
                                                        Strided(kv.row_stride));
        decode_head_rows(kv, codes, row, count, kv_head, head_dim, decoded);
        return Eigen::Map<const RowMajor, 0, Strided>(decoded, count, head_dim, Strided(head_dim));
      };
      auto keys_of = [&](int row, int count) { return rows_of(kv.keys, kv.key_codes, row, count); };
      auto values_of = [&](int row, int count) { return rows_of(kv.values, kv.value_codes, row, count); };
      // f(first row, rows) for each run of rows [begin, end) stored row_stride apart: the whole range in a
      // contiguous view, a block at a time in a paged one (KvView::run_end); in a coded view at most kDecodedRows
      // rows at a time, what `decoded` holds. One product per run.
      auto each_run = [&](auto&& f) {
        for (int run = begin, stop; run < end; run = stop) {
          stop = kv.run_end(run, end);
          if (kv.coded()) stop = std::min(stop, run + kDecodedRows);
          f(run, stop - run);
        }
      };
      Eigen::Map<const RowMajor, 0, Strided> Q(q + std::size_t(q0) * dim + h * head_dim, nq, head_dim, Strided(dim));
      Eigen::Map<RowMajor, 0, Strided> O(out + std::size_t(q0) * dim + h * head_dim, nq, head_dim, Strided(dim));
      Eigen::Map<RowMajor> S(scores_mem, nq, rows);  // (nq, rows): row r of S is view row begin + r
      // The scale is applied to the visible scores below: folded into the product, it makes Eigen allocate
      // a temporary for a single query, i.e. on every decode step.
      each_run([&](int run, int count) { S.middleCols(run - begin, count).noalias() = Q * keys_of(run, count).transpose(); });
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
        softmax(s + visible_begin, visible_end - visible_begin, scale);
        if (!runs)  // a masked row weighs exactly 0 (see softmax)
          for (int r = 0; r < rows; ++r)
            if (!key_visible(query_pos, kv.position_of(r), kv.window)) s[r] = 0.0f;
      }
      if (weights)  // rows outside [begin, end) are invisible to every query of the block: weight 0
        for (int i = 0; i < nq; ++i) {
          observe_weights(weights + (std::size_t(q0 + i) * shape.n_heads + h) * kv.rows, kv.rows, S.row(i).data(), begin, rows);
        }
      if (!unseen_row) {  // every row is seen by some query of the block: its bytes are real keys/values
        O.setZero();  // += onto exact zeros: the sums of a single run are those of O = S · V
        each_run([&](int run, int count) { O.noalias() += S.middleCols(run - begin, count) * values_of(run, count); });
        continue;
      }
      // Some rows hold nothing this block may read: a weight of 0 times a NaN in such a row would still be
      // NaN, so the output sums over the visible rows only.
      for (int i = 0; i < nq; ++i) {
        O.row(i).setZero();
        const int query_pos = first_query + i;
        for (int r = 0; r < rows; ++r)
          if (key_visible(query_pos, kv.position_of(begin + r), kv.window))
            O.row(i).noalias() += S(i, r) * values_of(begin + r, 1).row(0);
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

// A step of several sequences (chapter 08): the parts the fast path of attention() above takes - one query over one
// run of rows, attend_one_query - are tasks of one pool run, each part whole on one thread. One attention() call per
// part would hand each part's KV heads to the other threads only when the part alone is worth it (kTaskMultiplyAdds),
// so a step of 64 sequences of 80 positions ran all its attention on one thread while the others waited. Each part
// is the same call of attend_one_query that attention() makes (every KV head in one sweep; split by KV head, each
// head's arithmetic is the same), so it gets the same bits. The other parts - a prefill chunk, read-time rotation,
// a head the fast path lacks - take attention() one by one, first. (Once one such part sent the whole step to the
// definition: in continuous batching a step with a new prompt's chunk, one in six of book 08's trace, ran its decode
// attention on one thread, one reason static batching finished that trace sooner.)
void CpuBackend::attention_batch(float* out, const float* q, const int* positions, std::span<const AttentionPart> parts,
                                 const AttentionShape& shape, std::span<float> scratch) {
  const int head_dim = shape.head_dim, dim = shape.n_heads * head_dim, group = shape.n_heads / shape.n_kv_heads;
  // Each head's slice of the scratch holds kQueryBlock rows of max_rows scores (attention_scratch_floats):
  // task t takes row t of every head's slice, so tasks running at once never share scores.
  const std::size_t head_stride = scratch.size() / shape.n_heads, slot_floats = head_stride / kQueryBlock;
  // The kernel of a part the fast path takes and its visible rows [begin, end); null where attention() must take it.
  auto fast_kernel = [&](const AttentionPart& p, int& begin, int& end) -> OneQueryKernel {
    const OneQueryKernel kernel = one_query_run(p.kv, p.n, positions + p.offset, head_dim, begin, end);
    return kernel && std::size_t(p.kv.rows) <= slot_floats && !(p.kv.coded() && head_dim > kMaxCodedHeadDim) ? kernel
                                                                                                              : nullptr;
  };
  int fast_parts = 0;
  std::int64_t multiply_adds = 0;
  for (const AttentionPart& p : parts) {
    int begin = 0, end = 0;
    if (fast_kernel(p, begin, end)) ++fast_parts, multiply_adds += 2 * std::int64_t(end - begin) * shape.n_heads * head_dim;
  }
  for (const AttentionPart& p : parts) {  // the parts not taken below (all of them where one or none is fast)
    int begin = 0, end = 0;
    const std::size_t at = std::size_t(p.offset) * dim;
    if (fast_parts <= 1 || !fast_kernel(p, begin, end))
      attention(out + at, q + at, positions + p.offset, p.n, p.kv, shape, scratch, nullptr);
  }
  if (fast_parts <= 1) return;  // one fast part or none, all taken above (attention() splits KV heads where worth it)

  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int tasks = static_cast<int>(std::min<std::size_t>(parts.size(), kQueryBlock));
  auto task = [&](int t) {  // parts t, t + tasks, ...: one part each for up to kQueryBlock parts
    for (std::size_t i = t; i < parts.size(); i += tasks) {
      const AttentionPart& p = parts[i];
      int begin = 0, end = 0;
      const OneQueryKernel one_query = fast_kernel(p, begin, end);
      if (!one_query) continue;  // taken by attention() above
      const std::size_t at = std::size_t(p.offset) * dim;
      one_query(out + at, q + at, p.kv, begin, end, 0, shape.n_kv_heads, group, scale, scratch.data() + t * slot_floats,
                head_stride);
    }
  };
  if (threads() > 1 && multiply_adds >= kTaskMultiplyAdds) pool_->run(tasks, task);
  else for (int t = 0; t < tasks; ++t) task(t);
}

// rows[write_row(where, positions[i])] = src[i], `where` a Ring or a BlockTable (backend.h).
template <typename Where>
void CpuBackend::scatter_rows(float* rows, int row_stride, const int* positions, Where where, const float* src, int n,
                              int width) {
  for (int i = 0; i < n; ++i)
    copy(rows + std::size_t(write_row(where, positions[i])) * row_stride, src + std::size_t(i) * width, std::size_t(width));
}

void CpuBackend::write_rows(float* rows, int row_stride, const int* positions, Ring ring, const float* src, int n,
                            int width) {
  scatter_rows(rows, row_stride, positions, ring, src, n, width);
}

void CpuBackend::write_positions(int* slot_positions, const int* positions, Ring ring, int n) {
  for (int i = 0; i < n; ++i) slot_positions[ring.write_slot(positions[i])] = positions[i];
}

void CpuBackend::write_paged_rows(float* rows, int row_stride, const int* positions, BlockTable table,
                                  const float* src, int n, int width) {
  scatter_rows(rows, row_stride, positions, table, src, n, width);
}

// Row write_row(where, positions[i]) of `rows` = src[i] coded, group by group (kv_format.h).
template <typename Where>
void CpuBackend::encode_rows(const CodedRows& rows, const int* positions, Where where, const float* src, int n) {
  for (int i = 0; i < n; ++i) {
    const std::size_t row = write_row(where, positions[i]);
    for (int g = 0; g < rows.groups(); ++g) rows.encode_group(row, g, src + std::size_t(i) * rows.width + g * rows.group);
  }
}

void CpuBackend::write_coded_rows(const CodedRows& rows, const int* positions, Ring ring, const float* src, int n) {
  encode_rows(rows, positions, ring, src, n);
}

void CpuBackend::write_paged_coded_rows(const CodedRows& rows, const int* positions, BlockTable table, const float* src,
                                        int n) {
  encode_rows(rows, positions, table, src, n);
}

void CpuBackend::encode_channel_groups(const CodedRows& rows, int first_group, int groups, const float* src) {
  for (int t = 0; t < groups; ++t)
    for (int ch = 0; ch < rows.width; ch += 2)
      rows.encode_channel_pair(first_group + t, ch, src + std::size_t(t) * rows.token_group * rows.width);
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
