#pragma once
// Functions marked KVS_HOST_DEVICE are the project's one definition of an idea (RoPE angles, the masking
// rule, ring-buffer slots) and compile for the CPU and, under nvcc, for CUDA kernels too.
#if defined(__CUDACC__)
#define KVS_HOST_DEVICE __host__ __device__
#else
#define KVS_HOST_DEVICE
#endif
