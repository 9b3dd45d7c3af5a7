#pragma once
// The CUDA harness: runs the project's CUDA source (.cu files, unchanged) on the CPU, compiled by g++, so
// that kernels really execute on machines without a GPU (CI, most readers) and under AddressSanitizer.
//
// What it models:
//   - a launch runs every block of the grid, one block after another (in order, in reverse or shuffled, as
//     KVS_CUDA_HARNESS_ORDER says below: a GPU promises no order); each thread of a block is a
//     user-space context (Boost.Context fibers) on one OS thread, so __syncthreads() and the warp
//     operations have their real semantics: a thread stops there until the others arrive;
//   - threadIdx / blockIdx / blockDim / gridDim; static __shared__ memory (one copy per kernel, which is
//     per block because blocks run one at a time; it keeps the previous block's bytes) and dynamic shared
//     memory (KVS_DYNAMIC_SHARED, filled with NaN bytes at the start of every block so a read before a
//     write shows);
//   - warps of 32 lanes: __shfl_sync / _up / _down / _xor, __ballot_sync, __any_sync, __all_sync and
//     __syncwarp, with their masks honoured: every lane named in a mask must make the same call with the
//     same mask, and a shuffle may read only a lane of its mask;
//   - atomics (trivially: one thread runs at a time);
//   - the runtime calls the backend uses (cudaMalloc, cudaMemcpy, ...), on host memory;
//   - stream capture and graphs: between cudaStreamBeginCapture and cudaStreamEndCapture, launches,
//     asynchronous copies and the harness's matrix products are recorded (kernel arguments by value, as a
//     launch copies them), not run; cudaGraphLaunch runs the recording. A synchronous copy or memset, a
//     synchronisation, an allocation, a free, destroying a graph or a second capture while capturing is
//     refused, as CUDA refuses it, and (but for the second capture) invalidates the capture, as CUDA does: its
//     end then fails and returns no graph;
//   - programmatic dependent launch (cuda_support.h): a kernel launched programmatically may start before the
//     kernel ahead of it has finished, its blocks waiting in KVS_WAIT_FOR_PREVIOUS_KERNEL(). So the last kernel
//     launched stays pending, its first block stopped at that wait, and finishes only when the next kernel,
//     if programmatic, has run its first block up to its own wait - or before anything else runs (a plain
//     launch, a copy, a synchronisation, a free, a graph's start and end). What a kernel reads before its wait
//     is what memory held before the kernel ahead of it ran, and what it writes there, that kernel may
//     overwrite or read: breaking the rule gives a wrong result here, as it can on a GPU. Only the first block
//     runs early (a GPU may start any), and an error of a pending kernel surfaces at the call that finishes it.
//     Two first blocks may then be alive at once, of the same kernel function too, sharing its static
//     __shared__ memory: harmless, as nothing before the wait may touch shared memory (a barrier there is
//     reported). The next kernel's first block runs before the pending kernel's other blocks reach their wait,
//     which a GPU never does (it schedules the next kernel once every block has passed its wait): harmless while
//     code before a wait reads only what no kernel writes.
// Errors it reports, naming the kernel: a thread that reaches a synchronisation point or its end without
// KVS_WAIT_FOR_PREVIOUS_KERNEL() (cuda_support.h: every kernel's first statement), a __syncthreads() that some
// threads of the block never reach (they exited or wait elsewhere), a warp operation that a lane of its mask
// never joins or joins with another mask, a shuffle reading a lane outside its mask. A deadlock is reported,
// never a hang. And what a GPU refuses at launch: a block of more than 1,024 threads, a grid of more than 65,535
// blocks in y or z (2^31 - 1 in x), dynamic shared memory over 227 KB, or over 48 KB unless
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ...) allowed that kernel as much.
// Not modelled there: a kernel's static __shared__ bytes, which a GPU counts against the same limits (48 KB less
// them without the attribute; the attribute plus them within the device's 227 KB). No kernel of the backend has
// both: the tiled prefill's shared memory is all dynamic.
// KVS_CUDA_HARNESS_ORDER=sequential (default) | reverse | random:SEED sets the order in which a launch's
// blocks run, and the threads of a block between two synchronisation points: a missing barrier shows as a
// wrong result under some order, and so does a kernel that expects a certain block to finish last.
//
// What it does not model: separate host and device memory (a host pointer passed to a kernel works here
// and faults on a GPU), asynchronous streams and events (everything runs in order, but for the overlap
// above), any
// notion of performance (never time anything here), warp-synchronous code without *_sync operations
// (lanes here run independently between synchronisation points), memory-ordering subtleties, and
// floating-point differences between the GPU's and the CPU's maths functions (exp, rsqrt, fused
// multiply-add contraction).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <functional>
#include <string>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One copy per kernel function: blocks run one at a time (but for a first block stopped before its wait, which
// touches no shared memory), so this is the block's shared memory.
#define __shared__ static

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
// CUDA's 16-byte vector (a kernel's widest load is one of these, from a 16-byte aligned address), and its 8-byte one.
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Set by the scheduler before it resumes a thread. One launch runs at a time in a process (the harness is
// not thread-safe).
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
inline constexpr int warpSize = 32;

namespace kvs::cuda_harness {

// Runs `body` (which calls the kernel) for every thread of every block; throws std::runtime_error naming
// `kernel` on a launch error or a synchronisation error.
// programmatic: launched programmatically dependent (cuda_support.h's LaunchQueue), so that its first block
// runs up to KVS_WAIT_FOR_PREVIOUS_KERNEL() before the kernel ahead of it finishes (see below).
// kernel_address: the kernel function, for the dynamic shared memory it was allowed (set_max_dynamic_shared).
void launch(const char* kernel, const void* kernel_address, dim3 grid, dim3 block, std::size_t dynamic_shared_bytes,
            bool programmatic, const std::function<void()>& body);
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes): a launch of that kernel may ask
// for up to `bytes` of dynamic shared memory; without it, up to 48 KB (as on a GPU, which refuses the launch).
void set_max_dynamic_shared(const void* kernel_address, std::size_t bytes);
// KVS_LAUNCH: the arguments are copied, as a CUDA launch copies them, so a recorded launch (stream capture)
// does not refer to the caller's variables. A grid of no blocks launches nothing, as kvs::cuda::launch does.
template <typename Kernel, typename... Args>
void launch_kernel(const char* name, dim3 grid, dim3 block, std::size_t dynamic_shared_bytes, bool programmatic,
                   Kernel* kernel, Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  launch(name, reinterpret_cast<const void*>(kernel), grid, block, dynamic_shared_bytes, programmatic,
         [=] { kernel(args...); });
}
// The last kernel launched, finished: what every call that synchronises, copies or frees does first.
void finish_pending_kernel();
// Work on the stream outside a kernel (a copy, the harness's matrix product): runs now, or is recorded
// while a stream capture is active.
void run_or_record(const std::function<void()>& work);
bool capturing();
// The order in which the threads of a block run between synchronisation points: "sequential", "reverse"
// or "random:SEED" (what KVS_CUDA_HARNESS_ORDER sets at the first launch). Throws on another value.
void set_thread_order(const std::string& order);
// Reads KVS_CUDA_HARNESS_ORDER now (std::runtime_error for a bad value), so that a backend made for the harness
// refuses it in one line before anything runs (first read inside a cudaFree, it could only abort the process).
void check_order_setting();
// The calling block's dynamic shared memory.
void* dynamic_shared_memory();

// KVS_WAIT_FOR_PREVIOUS_KERNEL(): the previous kernel has finished here (launches run in order); marks the calling
// thread as having waited, which every thread must before it synchronises or ends.
void wait_for_previous_kernel();
// Block barrier.
void syncthreads();
// A warp operation of the calling lane: waits until every lane of `mask` made the same call with the same
// mask. kind: what the call is (for the error messages and to check lanes agree).
enum class WarpOp { kShuffle, kVote, kSync };
// Shuffle: returns the value `source_lane` passed (this lane's own when source_lane is itself).
std::uint64_t warp_shuffle(unsigned mask, std::uint64_t value, int source_lane);
// Vote: returns the ballot of `predicate` over the lanes of mask.
unsigned warp_ballot(unsigned mask, bool predicate);
void warp_sync(unsigned mask);
int lane_id();

template <class T>
std::uint64_t to_bits(T value) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable_v<T>);
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}
template <class T>
T from_bits(std::uint64_t bits) {
  T value;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}
// The first lane of the caller's segment of `width` lanes (width: a power of two up to 32).
inline int segment_base(int lane, int width) { return lane & ~(width - 1); }

}  // namespace kvs::cuda_harness

inline void __syncthreads() { kvs::cuda_harness::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { kvs::cuda_harness::warp_sync(mask); }

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  namespace h = kvs::cuda_harness;
  const int lane = h::lane_id();
  const int source = h::segment_base(lane, width) + (src_lane & (width - 1));
  return h::from_bits<T>(h::warp_shuffle(mask, h::to_bits(var), source));
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  namespace h = kvs::cuda_harness;
  const int lane = h::lane_id();
  const int in_segment = (lane & (width - 1)) + static_cast<int>(delta);
  const int source = in_segment < width ? lane + static_cast<int>(delta) : lane;
  return h::from_bits<T>(h::warp_shuffle(mask, h::to_bits(var), source));
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  namespace h = kvs::cuda_harness;
  const int lane = h::lane_id();
  const int source = (lane & (width - 1)) >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
  return h::from_bits<T>(h::warp_shuffle(mask, h::to_bits(var), source));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  namespace h = kvs::cuda_harness;
  const int lane = h::lane_id();
  const int target = lane ^ lane_mask;
  const int source = target < h::segment_base(lane, width) + width ? target : lane;
  return h::from_bits<T>(h::warp_shuffle(mask, h::to_bits(var), source));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return kvs::cuda_harness::warp_ballot(mask, predicate != 0);
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }

// One thread runs at a time, and a block's writes are in memory before the next block starts: a fence has
// nothing to order (what the harness cannot check, the header says).
inline void __threadfence() {}

// One thread runs at a time: atomics are plain read-modify-writes.
template <class T>
T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}
template <class T>
T atomicMax(T* address, T value) {
  const T old = *address;
  *address = old < value ? value : old;
  return old;
}

// The maths intrinsics the kernels use, as the C library computes them.
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <class T>
T __ldg(const T* p) {
  return *p;
}

// ---- the runtime API, on host memory ----
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorLaunchFailure = 719,
  cudaErrorNoDevice = 100,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorIllegalState = 401
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct CUgraph_st;
using cudaGraph_t = CUgraph_st*;
struct CUgraphExec_st;
using cudaGraphExec_t = CUgraphExec_st*;
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1, cudaStreamCaptureModeRelaxed = 2 };
inline constexpr unsigned cudaStreamNonBlocking = 1;

cudaError_t cudaMalloc(void** pointer, std::size_t bytes);
template <class T>
cudaError_t cudaMalloc(T** pointer, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(pointer), bytes);
}
cudaError_t cudaFree(void* pointer);
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* dst, int value, std::size_t bytes);
cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
struct CUgraphNode_st;
using cudaGraphNode_t = CUgraphNode_st*;
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes, std::size_t* count);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
const char* cudaGetErrorString(cudaError_t error);
// What a block may have of dynamic shared memory: an H100's limit (the harness's launch checks hold kernels to it).
constexpr std::size_t kHarnessMaxDynamicShared = 227 * 1024;
// The device's attributes the backend asks for: an H100's.
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = static_cast<int>(kHarnessMaxDynamicShared);
  return cudaSuccess;
}
// A kernel's attributes (the dynamic shared memory it may ask for).
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <class Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute, int value) {
  if (value < 0 || std::size_t(value) > kHarnessMaxDynamicShared) return cudaErrorInvalidValue;
  kvs::cuda_harness::set_max_dynamic_shared(reinterpret_cast<const void*>(kernel), std::size_t(value));
  return cudaSuccess;
}
