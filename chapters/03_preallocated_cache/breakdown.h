#pragma once
// Where a decode step's time goes (03_benchmark --breakdown): per context length, the step split into the
// weight matrix products, attention over the cache and everything else (ProfilingBackend), the bytes a
// step must read - every weight once, and the K/V rows it attends to - and the achieved read rate against
// this machine's own read bandwidth for a working set of the same size, measured here.
#include <cstdint>
#include <span>
#include <vector>

#include "csv.h"
#include "runtime.h"

namespace kvs::ch03 {

// Bytes one decode step must read at `positions` cached positions: weights (every matrix once, one
// embedding row) and K/V rows (2 · layers · kv_dim · positions floats).
struct StepBytes {
  std::int64_t weights = 0, kv = 0;
  std::int64_t total() const { return weights + kv; }
};
StepBytes decode_step_bytes(const ModelConfig& c, int positions);

// Floating-point operations of the forward pass over a prompt of `positions` (its products, causal attention
// and the last position's logits): prefill's work, against which its time is a rate.
double prefill_flops(const ModelConfig& c, int positions);

// GFLOP/s of a 1024 x 1024 x 1024 matrix product through the backend's own matmul, best of several after a
// warm-up: the arithmetic peak prefill could reach on this machine, with these threads.
constexpr int kPeakSize = 1024;
double measure_matmul_gflops(Backend& backend);

// Read bandwidth in GB/s (1e9 bytes/s) of summing `bytes` of floats, on `threads` threads (each its own
// contiguous part), best of several timed passes after a warm-up: the limit a decode step that reads as much
// could reach.
double measure_read_gbs(std::int64_t bytes, int threads);

// Bandwidth in GB/s of copying `bytes` within the backend's memory, counting the read and the write, best
// of several timed rounds after a warm-up: the limit on a device whose memory the host cannot read.
double measure_copy_gbs(Backend& backend, std::int64_t bytes);

// What the roofline's two probes allocate, host and backend memory together: measure_matmul_gflops's matrices,
// and the bandwidth probe's buffers for a step of `step_bytes` (measure_read_gbs: one host copy; measure_copy_gbs:
// two in the backend and the host array that fills them).
std::int64_t roofline_probe_bytes(const Backend& backend, std::int64_t step_bytes);

// The KV cache bytes decode_breakdown holds for the whole sweep: two caches (the plain and the profiled
// runs') of the longest length plus new_tokens positions. For the run's memory plan.
std::int64_t breakdown_cache_bytes(const ModelConfig& c, const std::vector<int>& lengths, int new_tokens);

// What else decode_breakdown allocates, host and backend memory together, for the run's memory plan: the
// second, profiled model (its weights and working buffers) and the roofline probes for the bytes of the longest
// step. Gigabytes for a large --synthetic model.
std::int64_t breakdown_other_bytes(const ModelConfig& c, const Backend& backend, const std::vector<int>& lengths,
                                   int new_tokens);

// The breakdown for each prompt length in `lengths` (prefixes of `tokens`; each plus `new_tokens` within the
// model's context), `new_tokens` greedy tokens through a preallocated cache; a table on stderr, one CSV row
// per length.
void decode_breakdown(Runtime& rt, std::span<const int> tokens, const std::vector<int>& lengths, int new_tokens,
                      CsvWriter& csv);

}  // namespace kvs::ch03
