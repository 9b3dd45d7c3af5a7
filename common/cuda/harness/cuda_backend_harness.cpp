// The CUDA backend's source, compiled by g++ for the CUDA harness (no source is rewritten: the .cu file
// is included as it is, with KVS_CUDA_HARNESS set).
#define KVS_CUDA_HARNESS 1
#include "cuda/cuda_backend.cu"
