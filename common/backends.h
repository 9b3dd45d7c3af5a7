#pragma once
// Choosing a backend by name (--backend): "cpu" in every build, "cuda" in builds with nvcc, "cuda-harness"
// (the CUDA kernels run on the CPU by the CUDA harness; for stepping through a kernel, never for timings) in
// builds with Boost.Context.
#include <memory>
#include <string>

#include "backend.h"

namespace kvs {

// Why `name` cannot be used in this build (one line naming what to do instead), or empty.
std::string backend_unavailable(const std::string& name);
// Why a run that `what` (e.g. "03_benchmark", "--experiment speed") cannot take `name`: the CUDA harness runs the
// kernels on the CPU, one fiber per GPU thread, so its timings are neither a GPU's nor a CPU's. Empty for any other
// backend. For the command-line checks of the runs whose tables are timings (03_benchmark's sweep and breakdown,
// chapter 08's batching, chapter 10's speed).
std::string timed_run_refuses_harness(const std::string& name, const std::string& what);
// A backend by name; `cpu_threads` only for the CPU (0 = every core). Throws std::runtime_error when the
// backend cannot start (no CUDA device: "no CUDA device found ...; run with --backend cpu").
std::unique_ptr<Backend> make_backend(const std::string& name, int cpu_threads);

}  // namespace kvs
