#pragma once
// The CUDA harness's stand-in for cuBLAS: the same function as cuda/blas_cublas.h, as a plain loop on
// host memory (included by cuda_backend.cu when g++ compiles it with KVS_CUDA_HARNESS).
namespace kvs {
namespace {

class Blas {
 public:
  explicit Blas(cudaStream_t) {}  // the harness runs everything in order: no stream to bind
  // out (n, d_out) = x (n, d_in) · wᵀ, w (d_out, d_in), all row-major. Recorded, like a launch, while a
  // stream capture is active.
  void matmul_rows(float* out, const float* x, const float* w, int n, int d_in, int d_out) {
    cuda_harness::run_or_record([=] {
      for (int i = 0; i < n; ++i)
        for (int o = 0; o < d_out; ++o) {
          float sum = 0.0f;
          for (int k = 0; k < d_in; ++k) sum += x[std::size_t(i) * d_in + k] * w[std::size_t(o) * d_in + k];
          out[std::size_t(i) * d_out + o] = sum;
        }
    });
  }
};

}  // namespace
}  // namespace kvs
