#include "backends.h"

#include <stdexcept>

#include "cpu_backend.h"
#include "cuda/cuda_backend.h"

namespace kvs {

std::vector<std::string> built_backends() {
#if defined(KVS_HAVE_CUDA)
  return {"cpu", "cuda"};
#else
  return {"cpu"};
#endif
}

std::string backend_unavailable(const std::string& name) {
  if (name == "cpu") return "";
  if (name == "cuda") {
#if defined(KVS_HAVE_CUDA)
    return "";
#else
    return "this build has no CUDA backend (nvcc was not found when it was configured: install the CUDA toolkit "
           "and configure again); run with --backend cpu";
#endif
  }
  return "unknown backend '" + name + "'; use --backend cpu or --backend cuda";
}

std::unique_ptr<Backend> make_backend(const std::string& name, int cpu_threads) {
  if (const std::string why = backend_unavailable(name); !why.empty()) throw std::runtime_error(why);
#if defined(KVS_HAVE_CUDA)
  if (name == "cuda") return make_cuda_backend();
#endif
  return std::make_unique<CpuBackend>(cpu_threads);
}

}  // namespace kvs
