// CTest's "cuda: GPU" entry: exits 0 naming the GPU that the CUDA tests of this run used, or 77 (which CTest
// reports as "skipped") when this build or machine has none - the CUDA kernels were then checked through
// the CUDA harness only.
#include <cstdio>
#include <exception>

#include "backends.h"

int main() {
  const std::string why = kvs::backend_unavailable("cuda");
  if (!why.empty()) {
    std::printf("skipped: %s\n", why.c_str());
    return 77;
  }
  try {
    const auto backend = kvs::make_backend("cuda", 0);
    std::printf("the CUDA tests ran on %s\n", backend->describe().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::printf("skipped: %s\n", e.what());
    return 77;
  }
}
