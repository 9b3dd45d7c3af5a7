#pragma once
// The one place the project calls cuBLAS (included by cuda_backend.cu only; the CUDA harness has its own
// Blas with the same function, harness/blas_harness.h).
#include <cublas_v2.h>

#include <string>

#include "cuda/cuda_support.h"

#define KVS_CUBLAS_CHECK(call)                                                                          \
  do {                                                                                                  \
    const cublasStatus_t kvs_status_ = (call);                                                          \
    if (kvs_status_ != CUBLAS_STATUS_SUCCESS)                                                           \
      ::kvs::cuda::fail(#call, cublasGetStatusString(kvs_status_), __FILE__, __LINE__);                \
  } while (0)

namespace kvs {
namespace {

class Blas {
 public:
  explicit Blas(cudaStream_t stream) {
    KVS_CUBLAS_CHECK(cublasCreate(&handle_));
    // Plain fp32 arithmetic: no TF32 tensor-core shortcut, so the logits stay within the CPU's tolerance.
    KVS_CUBLAS_CHECK(cublasSetMathMode(handle_, CUBLAS_PEDANTIC_MATH));
    KVS_CUBLAS_CHECK(cublasSetStream(handle_, stream));
    // A workspace of our own: cuBLAS then never allocates inside a stream capture (a recorded decode step),
    // where an allocation is not allowed. 32 MiB is NVIDIA's advice for Hopper.
    KVS_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
    KVS_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, kWorkspaceBytes));
  }
  ~Blas() {
    cublasDestroy(handle_);
    cudaFree(workspace_);
  }
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // out (n, d_out) = x (n, d_in) · wᵀ, w (d_out, d_in), all row-major device memory. cuBLAS is
  // column-major: a row-major (r, c) matrix is its column-major (c, r) transpose, so this asks for
  // outᵀ (d_out, n) = w (from wᵀ column-major, transposed back) · xᵀ.
  void matmul_rows(float* out, const float* x, const float* w, int n, int d_in, int d_out) {
    const float one = 1.0f, zero = 0.0f;
    KVS_CUBLAS_CHECK(cublasSgemm(handle_, CUBLAS_OP_T, CUBLAS_OP_N, d_out, n, d_in, &one, w, d_in, x, d_in, &zero, out,
                                 d_out));
  }

 private:
  static constexpr std::size_t kWorkspaceBytes = std::size_t(32) << 20;
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

}  // namespace
}  // namespace kvs
