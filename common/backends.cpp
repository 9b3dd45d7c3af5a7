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
  if (name == "cuda-harness") {
#if defined(KVS_HAVE_CUDA_HARNESS_MODULE)
    return "";
#else
    return "this build has no CUDA harness (Boost.Context was not found when it was configured: install "
           "libboost-context-dev and configure again); run with --backend cpu";
#endif
  }
  return "unknown backend '" + name + "'; use --backend cpu, --backend cuda or --backend cuda-harness";
}

std::string timed_run_refuses_harness(const std::string& name, const std::string& what) {
  if (name != "cuda-harness") return "";
  return what + " times its steps, and --backend cuda-harness runs the CUDA kernels on the CPU, one fiber per GPU "
         "thread: its timings are neither GPU nor CPU numbers; use --backend cuda (a GPU) or cpu";
}

namespace {

#if defined(KVS_HAVE_CUDA) || defined(KVS_HAVE_CUDA_HARNESS_MODULE)
// A backend module beside the running binary (`file`), loaded once and never unloaded (its backends' code
// lives there), and its entry point `create`.
std::unique_ptr<Backend> make_module_backend(const char* file, const char* create_name, const char* what) {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::string path = (exe.parent_path() / file).string();
  void* module = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // the same handle on every later call
  if (!module)
    throw std::runtime_error(std::string("cannot load the ") + what + " (" + dlerror() + "); run with --backend cpu");
  auto* create = reinterpret_cast<Backend* (*)()>(dlsym(module, create_name));
  if (!create) throw std::runtime_error(std::string(file) + " has no " + create_name + "; rebuild it");
  return std::unique_ptr<Backend>(create());
}
#endif

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& name, int cpu_threads) {
  if (const std::string why = backend_unavailable(name); !why.empty()) throw std::runtime_error(why);
#if defined(KVS_HAVE_CUDA)
  if (name == "cuda") return make_module_backend("libkvs_cuda.so", "kvs_create_cuda_backend", "CUDA backend");
#endif
#if defined(KVS_HAVE_CUDA_HARNESS_MODULE)
  if (name == "cuda-harness")
    return make_module_backend("libkvs_cuda_harness.so", "kvs_create_cuda_harness_backend", "CUDA harness");
#endif
  return std::make_unique<CpuBackend>(cpu_threads);
}

}  // namespace kvs
