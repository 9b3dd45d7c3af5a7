#pragma once
// Choosing a backend by name (--backend): "cpu" in every build, "cuda" in builds with nvcc.
#include <memory>
#include <string>

#include "backend.h"

namespace kvs {

// Why `name` cannot be used in this build (one line naming what to do instead), or empty.
std::string backend_unavailable(const std::string& name);
// A backend by name; `cpu_threads` only for the CPU (0 = every core). Throws std::runtime_error when the
// backend cannot start (no CUDA device: "no CUDA device found ...; run with --backend cpu").
std::unique_ptr<Backend> make_backend(const std::string& name, int cpu_threads);

}  // namespace kvs
