#pragma once
// The CUDA backend (cuda_backend.cu). Plain C++: nothing here needs CUDA's headers.
#include <memory>

#include "backend.h"

// The entry point of the CUDA backend module (libkvs_cuda.so, built by nvcc beside the binaries), which
// make_backend("cuda") loads with dlopen: a new backend on device 0, or std::runtime_error ("no CUDA device
// found ...; run with --backend cpu") when no device can be used.
extern "C" kvs::Backend* kvs_create_cuda_backend();
// The entry point of the CUDA harness module (libkvs_cuda_harness.so, built by g++ where the harness is),
// which make_backend("cuda-harness") loads: the CUDA backend's kernels run on the CPU.
extern "C" kvs::Backend* kvs_create_cuda_harness_backend();

namespace kvs {

// The same source compiled by g++, its kernels run on the CPU by the CUDA harness: for tests and for
// stepping through a kernel in a debugger, never for timings. Only where the harness is built
// (KVS_HAVE_CUDA_HARNESS).
std::unique_ptr<Backend> make_cuda_harness_backend();

}  // namespace kvs
