#pragma once
// What every .cu file of the project includes first: the CUDA runtime under nvcc, or the CUDA harness
// (common/cuda/harness) when g++ compiles the same source with KVS_CUDA_HARNESS defined; the checks that
// name file and line; and the constructs whose spelling differs between the two: a kernel launch, dynamic
// shared memory, an unrolling request and the wait for the kernel before. Nothing else in a .cu file knows which
// of the two compiles it.
#include <cstddef>
#include <stdexcept>
#include <string>

#if defined(KVS_CUDA_HARNESS)
#include "harness/cuda_runtime_harness.h"
#else
#include <cuda_runtime.h>
#endif

namespace kvs::cuda {
// Where a kernel goes: its stream, and whether it is launched programmatically dependent on the kernel before it
// on that stream (Hopper's programmatic dependent launch, compute capability 9.0 on; book 07): it may then be
// scheduled while that kernel still runs, its blocks waiting in KVS_WAIT_FOR_PREVIOUS_KERNEL, so that the gap
// between two small kernels - the second one's launch, the first one's drain - is spent overlapped.
struct LaunchQueue {
  cudaStream_t stream;
  bool programmatic;
};
// Whether a launch on `queue` is programmatic: a LaunchQueue says; a bare stream (the harness's own tests) is plain.
inline bool programmatic(const LaunchQueue& queue) { return queue.programmatic; }
inline bool programmatic(cudaStream_t) { return false; }

[[noreturn]] inline void fail(const char* call, const char* error, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error at ") + file + ":" + std::to_string(line) + ": " + call + ": " + error);
}
}  // namespace kvs::cuda

// Every CUDA runtime call goes through this.
#define KVS_CUDA_CHECK(call)                                                                        \
  do {                                                                                              \
    const cudaError_t kvs_error_ = (call);                                                          \
    if (kvs_error_ != cudaSuccess) ::kvs::cuda::fail(#call, cudaGetErrorString(kvs_error_), __FILE__, __LINE__); \
  } while (0)

// A grid of no blocks launches nothing (CUDA itself refuses it): an operation on no tokens does nothing, as the CPU
// backend's does, without a check of its own in each.
#if defined(KVS_CUDA_HARNESS)
// Every thread of every block runs `kernel(args...)` on the CPU (see harness/cuda_runtime_harness.h), in order,
// except that a launch on a programmatic queue runs its first block up to its wait before the kernel ahead of
// it finishes, as a GPU may; or a capture records the launch.
#define KVS_LAUNCH(kernel, grid, block, shared_bytes, queue, ...) \
  ::kvs::cuda_harness::launch_kernel(#kernel, grid, block, shared_bytes, ::kvs::cuda::programmatic(queue), kernel, __VA_ARGS__)
// The harness checks that every thread calls this before any barrier or warp operation and before it ends, and
// in a programmatic launch's first block holds each thread here until the kernel before has finished.
#define KVS_WAIT_FOR_PREVIOUS_KERNEL() ::kvs::cuda_harness::wait_for_previous_kernel()
#define KVS_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::kvs::cuda_harness::dynamic_shared_memory())
// nvcc's loop-unrolling request (registers indexed by an unrolled loop's counter stay registers); g++ ignores it.
#define KVS_UNROLL
// nvcc's request to unroll a loop of unknown length 8 times (its iterations' loads issued together); g++ ignores it.
#define KVS_UNROLL_8
#else
namespace kvs::cuda {
// kernel<<<grid, block, shared_bytes, queue.stream>>>(args...), with the programmatic attribute when queue asks.
template <typename... Params, typename... Args>
cudaError_t launch(LaunchQueue queue, dim3 grid, dim3 block, std::size_t shared_bytes, void (*kernel)(Params...),
                   Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;  // see KVS_LAUNCH
  cudaLaunchAttribute programmatic{};
  programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  programmatic.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = queue.stream;
  config.attrs = &programmatic;
  config.numAttrs = queue.programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}
}  // namespace kvs::cuda
#define KVS_LAUNCH(kernel, grid, block, shared_bytes, queue, ...) \
  KVS_CUDA_CHECK(::kvs::cuda::launch(queue, grid, block, shared_bytes, kernel, __VA_ARGS__))
// The first statement of every kernel (after loads of weights, which no kernel writes, at most). Launched
// programmatically, a kernel may start while the one before it still runs: griddepcontrol.wait returns once that
// kernel has finished and its writes are visible (nothing before it may read what that kernel writes, or write
// what it reads); launch_dependents then lets the kernel after this one be scheduled as soon as every block of
// this one has got here. Launched plainly, or before compute capability 9.0, both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVS_WAIT_FOR_PREVIOUS_KERNEL()                             \
  do {                                                             \
    asm volatile("griddepcontrol.wait;" ::: "memory");             \
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
  } while (0)
#else
#define KVS_WAIT_FOR_PREVIOUS_KERNEL() \
  do {                                 \
  } while (0)
#endif
#define KVS_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define KVS_UNROLL _Pragma("unroll")
#define KVS_UNROLL_8 _Pragma("unroll 8")
#endif
