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
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_support.h"
#include "backend.h"
#include "cuda/cuda_backend.h"
#include "kv_cache.h"
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

// Sum of v over the 32 lanes of the calling warp, in every lane.
__device__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
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

// x (n, dim) = table[tokens[i]] rows. Grid (n), block 256: block i copies row i, its threads stride over dim.
__global__ void embed_kernel(float* x, const float* table, const int* tokens, int dim) {
  const std::size_t i = blockIdx.x;
  const float* row = table + std::size_t(tokens[i]) * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) x[i * dim + d] = row[d];
}

// out (n, dim) = x / sqrt(mean(x²) + eps) ⊙ weight. Grid (n), block 256 (a multiple of 32): block i owns
// row i; its threads stride over dim for the sum of squares, then for the output.
__global__ void rmsnorm_kernel(float* out, const float* x, const float* weight, int dim) {
  const std::size_t row = std::size_t(blockIdx.x) * dim;
  float squares = 0.0f;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) squares += x[row + d] * x[row + d];
  const float inv_rms = 1.0f / sqrtf(block_sum(squares) / dim + kRmsEps);
  for (int d = threadIdx.x; d < dim; d += blockDim.x) out[row + d] = x[row + d] * inv_rms * weight[d];
}

// table (n, head_dim/2, 2) = [cos, sin] of positions[0 .. n-1] (device memory): rope.h's one definition.
// Grid (ceil(n · pairs / 256)), block 256: one thread per (position, pair).
__global__ void rope_table_kernel(float* table, const int* positions, int n, int head_dim) {
  const int pairs = head_dim / 2;
  const int index = blockIdx.x * blockDim.x + threadIdx.x;
  if (index >= n * pairs) return;
  rope_cos_sin(positions[index / pairs], index % pairs, head_dim, table + std::size_t(index) * 2);
}

// rows[slots[i]] = src[i]: row i of src (n, width) into row slots[i] of `rows` (row_stride floats apart);
// slots in device memory. Grid (n), block 256: block i copies row i, its threads stride over width.
__global__ void write_rows_kernel(float* rows, int row_stride, const int* slots, const float* src, int width) {
  const std::size_t i = blockIdx.x;
  float* row = rows + std::size_t(slots[i]) * row_stride;
  for (int d = threadIdx.x; d < width; d += blockDim.x) row[d] = src[i * width + d];
}

// Rotates x (n, heads, head_dim) in place. Grid (ceil(n · heads · pairs / 256)), block 256: one thread per
// (position, head, pair).
__global__ void rope_kernel(float* x, const float* table, int n, int heads, int head_dim) {
  const int pairs = head_dim / 2;
  const long index = long(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= long(n) * heads * pairs) return;
  const long i = index / (long(heads) * pairs), pair = index % pairs;  // position and pair; the head between
  rope_rotate(x + index * 2, table + (i * pairs + pair) * 2);
}

// Attention of one query head over the view, with an online softmax (no score buffer: the running maximum,
// sum and weighted values are rescaled as larger scores arrive), so any number of rows needs no scratch.
//   out (n, n_heads · head_dim), q (n, n_heads · head_dim) at positions[0 .. n-1] (device memory).
// A query visits only KvView::rows_to_visit rows, so a view of a whole preallocated buffer costs what its
// written prefix costs - and stays the same view at every step (a recorded decode step relies on that).
// Grid (n_heads, n), block warps · 32 (warps <= kMaxAttentionWarps, chosen by the caller): block (h, i)
// computes query i's head h. Warp w visits rows w, w + warps, ...; a row that key_visible hides is skipped whole (its keys and values are
// never read, so an empty slot's bytes, NaN included, cannot leak in). Within a row, lane l holds the
// elements l, l + 32, ... of q, k, v (head_dim <= kMaxHeadDim). At the end the warps' partial results are
// merged through shared memory. With `weights` (n, n_heads, rows) the warps then visit their rows again
// and write each row's softmax weight (0 for a hidden row): an observer's second pass, off by default.
constexpr int kMaxAttentionWarps = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / kWarp;

__global__ void __launch_bounds__(kMaxAttentionWarps * kWarp)
    attention_kernel(float* out, float* weights, const float* q, const int* positions, KvView kv, int n_heads,
                     int group, int head_dim) {
  __shared__ float warp_max[kMaxAttentionWarps];
  __shared__ float warp_total[kMaxAttentionWarps];
  __shared__ float warp_values[kMaxAttentionWarps][kMaxHeadDim];
  const int h = blockIdx.x, i = blockIdx.y;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int query_pos = positions[i], kv_offset = (h / group) * head_dim, dim = n_heads * head_dim;
  const int row_end = kv.rows_to_visit(query_pos);  // the rows past the query's own position are its future
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));
  const float minus_inf = -INFINITY;

  // Read-time rotation (kv.read_rope, chapter 04): the query and each key are rotated as they are loaded,
  // by their rotary positions (kv_cache.h), with the table's [cos, sin] of each element's pair.
  const float* table = kv.read_rope;  // (window.size, pairs, 2) or null: q and keys arrive rotated
  const int pairs = head_dim / 2;
  const float* query_row = q + std::size_t(i) * dim + h * head_dim;
  const float* query_cos_sin = table ? table + std::size_t(rotary_query_position(query_pos, kv.window)) * pairs * 2 : nullptr;
  float query[kPerLane], values[kPerLane];
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + j * kWarp;
    query[j] = d >= head_dim ? 0.0f
               : table       ? rope_rotated_element(query_row, d, query_cos_sin + (d / 2) * 2)
                             : query_row[d];
    values[j] = 0.0f;
  }
  // The scaled score of visible row r (the same in every lane of the warp).
  auto score_of = [&](int r, int key_pos) {
    const float* key = kv.keys + std::size_t(r) * kv.row_stride + kv_offset;
    const float* key_cos_sin =
        table ? table + std::size_t(rotary_key_position(query_pos, key_pos, kv.window)) * pairs * 2 : nullptr;
    float dot = 0.0f;
    for (int j = 0; j < kPerLane; ++j) {
      const int d = lane + j * kWarp;
      if (d < head_dim) dot += query[j] * (table ? rope_rotated_element(key, d, key_cos_sin + (d / 2) * 2) : key[d]);
    }
    return warp_sum(dot) * scale;
  };
  float running_max = minus_inf, total = 0.0f;
  for (int r = warp; r < row_end; r += warps) {
    const int key_pos = kv.position_of(r);
    if (!key_visible(query_pos, key_pos, kv.window)) continue;  // the same r in every lane
    const float* value = kv.values + std::size_t(r) * kv.row_stride + kv_offset;
    const float score = score_of(r, key_pos);
    const float new_max = fmaxf(running_max, score);
    const float rescale = expf(running_max - new_max);  // 0 for the first visible row
    const float weight = expf(score - new_max);
    total = total * rescale + weight;
    for (int j = 0; j < kPerLane; ++j) {
      const int d = lane + j * kWarp;
      if (d < head_dim) values[j] = values[j] * rescale + weight * value[d];
    }
    running_max = new_max;
  }
  if (lane == 0) warp_max[warp] = running_max, warp_total[warp] = total;
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + j * kWarp;
    if (d < head_dim) warp_values[warp][d] = values[j];
  }
  __syncthreads();
  float block_max = minus_inf, block_total = 0.0f;
  for (int w = 0; w < warps; ++w) block_max = fmaxf(block_max, warp_max[w]);
  for (int w = 0; w < warps; ++w)
    if (warp_max[w] != minus_inf) block_total += warp_total[w] * expf(warp_max[w] - block_max);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < warps; ++w)
      if (warp_max[w] != minus_inf) o += warp_values[w][d] * expf(warp_max[w] - block_max);
    // Nothing visible (only a deliberately broken cache gets here): 0, as the CPU backend.
    out[std::size_t(i) * dim + h * head_dim + d] = block_total > 0.0f ? o / block_total : 0.0f;
  }
  if (!weights) return;
  float* observed = weights + (std::size_t(i) * n_heads + h) * kv.rows;
  for (int r = warp; r < kv.rows; r += warps) {
    const int key_pos = kv.position_of(r);
    const bool visible = r < row_end && key_visible(query_pos, key_pos, kv.window);
    const float weight = visible ? expf(score_of(r, key_pos) - block_max) / block_total : 0.0f;
    if (lane == 0) observed[r] = weight;
  }
}

// gate (count) = silu(gate) ⊙ up. Grid (min(ceil(count / 256), kMaxBlocks)), block 256, grid-stride loop.
__global__ void swiglu_kernel(float* gate, const float* up, std::size_t count) {
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += std::size_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    gate[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// x (count) += y. Grid and block as swiglu_kernel.
__global__ void add_kernel(float* x, const float* y, std::size_t count) {
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += std::size_t(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

// ---- the backend ----

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 4096;

unsigned blocks_for(std::size_t count) {
  return static_cast<unsigned>(std::min<std::size_t>((count + kThreads - 1) / kThreads, kMaxBlocks));
}

// Every operation is queued on the backend's own stream (the legacy default stream cannot be captured);
// the copies to the host wait for it.
cudaStream_t new_stream() {
  cudaStream_t stream = nullptr;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(std::string name) : name_(std::move(name)), stream_(new_stream()), blas_(stream_) {}
  ~CudaBackend() override {
    if (graph_) cudaGraphExecDestroy(graph_);
    for (float* w : weights_) cudaFree(w);
    cudaFree(row_positions_);
    cudaStreamDestroy(stream_);
  }
  const char* name() const override { return name_.c_str(); }
  std::string describe() const override { return name_; }
  bool host_memory() const override { return false; }

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
  void synchronize() override { KVS_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  std::size_t attention_scratch_floats(const AttentionShape&, int) const override { return 0; }

  // Recording is CUDA stream capture: the operations queued between the two calls become a graph, which
  // replay() launches with one call.
  bool can_record() const override { return true; }
  int begin_recording() override {
    KVS_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    return ++recordings_;
  }
  void end_recording() override {
    cudaGraph_t graph = nullptr;
    KVS_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    if (graph_) KVS_CUDA_CHECK(cudaGraphExecDestroy(graph_));
    graph_ = nullptr;
    const cudaError_t instantiated = cudaGraphInstantiate(&graph_, graph, 0);
    cudaGraphDestroy(graph);
    KVS_CUDA_CHECK(instantiated);
  }
  void replay(int recording) override {
    if (recording != recordings_ || !graph_)
      throw std::logic_error("replay: recording " + std::to_string(recording) + " is not the last one recorded");
    KVS_CUDA_CHECK(cudaGraphLaunch(graph_, stream_));
  }

  void embed(float* x, const float* table, const int* tokens, int n, int dim) override {
    KVS_LAUNCH(embed_kernel, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, stream_, x, table, tokens, dim);
  }
  void matmul(float* out, const float* x, const float* w, int n, int d_in, int d_out) override {
    blas_.matmul_rows(out, x, w, n, d_in, d_out);
  }
  void rmsnorm(float* out, const float* x, const float* weight, int n, int dim) override {
    KVS_LAUNCH(rmsnorm_kernel, dim3(n), dim3(kThreads), 0, stream_, out, x, weight, dim);
  }
  void rope_table(float* table, const int* positions, int n, int head_dim) override {
    KVS_LAUNCH(rope_table_kernel, dim3(blocks_for(std::size_t(n) * head_dim / 2)), dim3(kThreads), 0, stream_, table,
               positions, n, head_dim);
  }
  void rope(float* x, const float* table, int n, int heads, int head_dim) override {
    const std::size_t threads = std::size_t(n) * heads * head_dim / 2;
    KVS_LAUNCH(rope_kernel, dim3(static_cast<unsigned>((threads + kThreads - 1) / kThreads)), dim3(kThreads), 0, stream_,
               x, table, n, heads, head_dim);
  }
  void attention(float* out, const float* q, const int* positions, int n, const KvView& kv,
                 const AttentionShape& shape, std::span<float>, float* weights) override {
    if (shape.head_dim > kMaxHeadDim)
      throw std::invalid_argument("attention: head_dim " + std::to_string(shape.head_dim) +
                                  " is larger than the CUDA kernel's " + std::to_string(kMaxHeadDim));
    if (kv.read_rope && kv.window.size < 1)
      throw std::invalid_argument("attention: read-time rotation needs a window (its table covers its positions)");
    KvView device_view = kv;
    // Per-row positions live in host memory today (a cache's bookkeeping): the kernel reads a copy.
    if (kv.row_positions) device_view.row_positions = row_positions_on_device(kv.row_positions, kv.rows);
    // Decoding, one query per head: few blocks, so more warps per block share the rows (one per 64 rows, up
    // to 16). Prefill has a block per query and head already: 4 warps.
    const int warps = n == 1 ? std::clamp(kv.rows / 64, 1, kMaxAttentionWarps) : 4;
    KVS_LAUNCH(attention_kernel, dim3(shape.n_heads, n), dim3(warps * kWarp), 0, stream_, out, weights, q, positions,
               device_view, shape.n_heads, shape.n_heads / shape.n_kv_heads, shape.head_dim);
  }
  void write_rows(float* rows, int row_stride, const int* slots, const float* src, int n, int width) override {
    KVS_LAUNCH(write_rows_kernel, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, stream_, rows, row_stride, slots,
               src, width);
  }
  void swiglu(float* gate, const float* up, std::size_t count) override {
    KVS_LAUNCH(swiglu_kernel, dim3(blocks_for(count)), dim3(kThreads), 0, stream_, gate, up, count);
  }
  void add(float* x, const float* y, std::size_t count) override {
    KVS_LAUNCH(add_kernel, dim3(blocks_for(count)), dim3(kThreads), 0, stream_, x, y, count);
  }

 private:
  void* allocate_bytes(std::size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<std::size_t>(bytes, 1)) != cudaSuccess) {
      cudaGetLastError();  // clear the error so later calls do not report it
      throw std::runtime_error("cannot allocate " + std::to_string(bytes) +
                               " bytes of GPU memory; use fewer positions or a smaller model");
    }
    return p;
  }
  // Copies a view's row positions into a device buffer that grows when a view has more rows than any before
  // (a ring's rows are fixed: never during decoding). Not recordable (a copy from pageable memory): only
  // the ring cache has row positions, and it is not replayable.
  const int* row_positions_on_device(const int* host, int rows) {
    if (std::size_t(rows) > row_positions_capacity_) {
      KVS_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffer may still be read by queued work
      KVS_CUDA_CHECK(cudaFree(row_positions_));
      row_positions_ = nullptr;
      KVS_CUDA_CHECK(cudaMalloc(&row_positions_, rows * sizeof(int)));
      row_positions_capacity_ = rows;
    }
    // On the stream, so it lands after the queued kernels have read the previous rows.
    KVS_CUDA_CHECK(cudaMemcpyAsync(row_positions_, host, rows * sizeof(int), cudaMemcpyHostToDevice, stream_));
    return row_positions_;
  }

  std::string name_;
  cudaStream_t stream_;
  Blas blas_;
  std::vector<float*> weights_;
  int* row_positions_ = nullptr;
  std::size_t row_positions_capacity_ = 0;
  cudaGraphExec_t graph_ = nullptr;
  int recordings_ = 0;
};

}  // namespace

#if defined(KVS_CUDA_HARNESS)
std::unique_ptr<Backend> make_cuda_harness_backend() {
  return std::make_unique<CudaBackend>("cuda kernels on the CPU (CUDA harness, for tests; never time it)");
}
#endif

}  // namespace kvs

#if !defined(KVS_CUDA_HARNESS)
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
  return new kvs::CudaBackend(std::string("cuda (") + properties.name + ", cuBLAS)");
}
#endif
