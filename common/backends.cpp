#include "backends.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>

#include "cpu_backend.h"

namespace kvs {

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

namespace {

#if defined(KVS_HAVE_CUDA)
// The CUDA backend module beside the running binary, loaded once and never unloaded (its backends' code
// lives there).
std::unique_ptr<Backend> make_cuda_backend() {
  static void* module = nullptr;
  static std::string load_error;
  if (!module && load_error.empty()) {
    std::error_code ec;
    const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    const std::string path = (exe.parent_path() / "libkvs_cuda.so").string();
    module = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!module) load_error = "cannot load the CUDA backend (" + std::string(dlerror()) + "); run with --backend cpu";
  }
  if (!module) throw std::runtime_error(load_error);
  auto* create = reinterpret_cast<Backend* (*)()>(dlsym(module, "kvs_create_cuda_backend"));
  if (!create) throw std::runtime_error("the CUDA backend module has no kvs_create_cuda_backend; rebuild it");
  return std::unique_ptr<Backend>(create());
}
#endif

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& name, int cpu_threads) {
  if (const std::string why = backend_unavailable(name); !why.empty()) throw std::runtime_error(why);
#if defined(KVS_HAVE_CUDA)
  if (name == "cuda") return make_cuda_backend();
#endif
  return std::make_unique<CpuBackend>(cpu_threads);
}

}  // namespace kvs
