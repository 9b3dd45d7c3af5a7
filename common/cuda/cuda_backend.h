#pragma once
// The CUDA backend (cuda_backend.cu). Plain C++: nothing here needs CUDA's headers.
#include <memory>

#include "backend.h"

namespace kvs {

// The backend compiled by nvcc, on device 0. Throws std::runtime_error ("no CUDA device found ...; run with
// --backend cpu") when no device can be used. Only in builds with CUDA (KVS_HAVE_CUDA).
std::unique_ptr<Backend> make_cuda_backend();

// The same source compiled by g++, its kernels run on the CPU by the CUDA harness: for tests and for
// stepping through a kernel in a debugger, never for timings. Only where the harness is built
// (KVS_HAVE_CUDA_HARNESS).
std::unique_ptr<Backend> make_cuda_harness_backend();

}  // namespace kvs
