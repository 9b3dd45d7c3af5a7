#pragma once
// What every .cu file of the project includes first: the CUDA runtime under nvcc, or the CUDA harness
// (common/cuda/harness) when g++ compiles the same source with KVS_CUDA_HARNESS defined; the checks that
// name file and line; and the constructs whose spelling differs between the two: a kernel launch, dynamic
// shared memory and an unrolling request. Nothing else in a .cu file knows which of the two compiles it.
#include <stdexcept>
#include <string>

#if defined(KVS_CUDA_HARNESS)
#include "harness/cuda_runtime_harness.h"
#else
#include <cuda_runtime.h>
#endif

namespace kvs::cuda {
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

#if defined(KVS_CUDA_HARNESS)
// Every thread of every block runs `kernel(args...)` on the CPU (see harness/cuda_runtime_harness.h); the
// stream is ignored (everything runs in order), unless a capture records the launch.
#define KVS_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  ::kvs::cuda_harness::launch_kernel(#kernel, grid, block, shared_bytes, kernel, __VA_ARGS__)
#define KVS_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::kvs::cuda_harness::dynamic_shared_memory())
// nvcc's loop-unrolling request (registers indexed by an unrolled loop's counter stay registers); g++ ignores it.
#define KVS_UNROLL
#else
#define KVS_LAUNCH(kernel, grid, block, shared_bytes, stream, ...)      \
  do {                                                                 \
    kernel<<<grid, block, shared_bytes, stream>>>(__VA_ARGS__);        \
    KVS_CUDA_CHECK(cudaGetLastError());                                \
  } while (0)
#define KVS_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define KVS_UNROLL _Pragma("unroll")
#endif
