#pragma once
// The backends the backend-generic tests run on: the CPU always; the CUDA kernels on the CPU through the
// CUDA harness, where it is built; the CUDA backend on a GPU, where the build has CUDA and a device is
// present (elsewhere the "cuda: GPU tests" CTest entry reports them skipped).
#include <doctest/doctest.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "backends.h"
#include "cpu_backend.h"
#include "cuda/cuda_backend.h"
#include "test_util.h"

namespace kvs::test {

// Whether this build has the CUDA backend and a device it can use.
inline bool gpu_present() {
#if defined(KVS_HAVE_CUDA)
  static const bool present = [] {
    try {
      make_backend("cuda", 0);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return present;
#else
  return false;
#endif
}

// "cpu", then "cuda-harness" and "cuda" where available.
inline std::vector<std::string> test_backend_names() {
  std::vector<std::string> names{"cpu"};
#if defined(KVS_HAVE_CUDA_HARNESS)
  names.push_back("cuda-harness");
#endif
  if (gpu_present()) names.push_back("cuda");
  return names;
}

inline std::unique_ptr<Backend> make_test_backend(const std::string& name) {
#if defined(KVS_HAVE_CUDA_HARNESS)
  if (name == "cuda-harness") return make_cuda_harness_backend();
#endif
  if (name == "cuda") return make_backend("cuda", 0);
  return std::make_unique<CpuBackend>(test_threads());
}

// Runs check(backend) on a fresh backend of each name in `names`, the name captured in any failure.
template <typename Check>
void for_each_backend(const std::vector<std::string>& names, Check&& check) {
  for (const std::string& name : names) {
    CAPTURE(name);
    const std::unique_ptr<Backend> backend = make_test_backend(name);
    check(*backend);
  }
}

// Whether a test may read the backend's memory in place, after synchronize(): the CPU's, and the CUDA harness's
// (cudaMalloc there is malloc, and its kernels run on the CPU); not a GPU's, which it must copy first.
inline bool readable_in_place(Backend& backend) {
  backend.synchronize();
  return backend.host_memory() || backend.describe().find("CUDA harness") != std::string::npos;
}

// Host data in a backend's memory, and back.
inline Buffer to_backend(Backend& backend, const std::vector<float>& host) {
  Buffer b(backend, host.size());
  backend.from_host(b.data(), host.data(), host.size());
  return b;
}
// `floats` of backend memory holding NaN: a scratch buffer that a kernel reads before it writes shows in the result.
inline Buffer nan_buffer(Backend& backend, std::size_t floats) {
  return to_backend(backend, std::vector<float>(floats, std::numeric_limits<float>::quiet_NaN()));
}
inline std::vector<float> from_backend(Backend& backend, const Buffer& b) {
  std::vector<float> host(b.size());
  backend.to_host(host.data(), b.data(), b.size());
  return host;
}

}  // namespace kvs::test
