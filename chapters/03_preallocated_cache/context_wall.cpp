#include "context_wall.h"

#include <algorithm>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli.h"
#include "preallocated_kv_cache.h"

namespace kvs::ch03 {
namespace {

// The most positions tried: the largest cache a KvView's int rows can index, whatever the memory.
constexpr std::int64_t kMostPositions = std::int64_t(1) << 30;

struct Attempt {
  bool fits;
  std::string refused_by;  // "--memory-limit" or "allocation"; empty when it fits
  std::string reason;      // the refusal's own message
};

// Plans a cache of `positions` against --memory-limit, allocates it and writes its last position (every
// layer's key and value): the whole cache exists and its last row is usable.
Attempt try_cache(Runtime& rt, int positions) {
  const ModelConfig& c = rt.model.config();
  try {
    rt.plan_kv_cache(kv_cache_bytes(c, positions));
  } catch (const UsageError& e) {
    return {false, "--memory-limit", e.what()};
  }
  try {
    PreallocatedKvCache cache(rt.backend, c, positions);
    cache.prepare(0, positions);
    const std::vector<float> ones(std::size_t(c.kv_dim()), 1.0f);
    for (int layer = 0; layer < c.n_layers; ++layer) {
      const KvRow last = cache.row(layer, positions - 1);
      rt.backend.from_host(last.key, ones.data(), ones.size());
      rt.backend.from_host(last.value, ones.data(), ones.size());
    }
    rt.backend.synchronize();
    return {true, "", ""};
  } catch (const std::bad_alloc&) {
    return {false, "allocation", "the allocator refused"};
  } catch (const std::runtime_error& e) {
    return {false, "allocation", e.what()};
  }
}

}  // namespace

void measure_context_wall(Runtime& rt, CsvWriter& csv) {
  const ModelConfig& c = rt.model.config();
  const std::int64_t per_position = kv_cache_bytes(c, 1);
  // What the model holds already: its weights and buffers, and --synthetic's generated copy on the host, which
  // --memory-limit counts too (MemoryPlan::total).
  const std::int64_t before = rt.memory.weights + rt.memory.working + rt.memory.host_weights;
  const std::int64_t free_bytes = rt.backend.free_memory_bytes();
  // The formula's walls: the budget left after the model, and (on a GPU) the free device memory.
  const std::int64_t budget_wall = std::max<std::int64_t>(0, rt.memory_limit - before) / per_position;
  const std::int64_t device_wall = free_bytes >= 0 ? free_bytes / per_position : -1;
  std::fprintf(stderr, "KV cache per position: 2 x %d layers x %d kv_heads x %d head_dim x 4 bytes = %lld bytes\n",
               c.n_layers, c.n_kv_heads, c.head_dim(), static_cast<long long>(per_position));
  std::fprintf(stderr, "predicted by --memory-limit %s - model %s: %lld positions\n",
               format_bytes(double(rt.memory_limit)).c_str(), format_bytes(double(before)).c_str(),
               static_cast<long long>(budget_wall));
  if (device_wall >= 0)
    std::fprintf(stderr, "predicted by the device's free memory, %s: %lld positions\n",
                 format_bytes(double(free_bytes)).c_str(), static_cast<long long>(device_wall));
  else
    std::fprintf(stderr, "(this backend's memory is the host's, allocated lazily: --memory-limit is the wall)\n");
  std::fprintf(stderr, "\n%14s %12s  %s\n", "positions", "KV cache", "result");

  std::int64_t fits = 0, refused = -1;  // the largest length that fit, the smallest refused
  Attempt last_refusal;
  auto attempt = [&](std::int64_t positions) {
    const Attempt a = try_cache(rt, static_cast<int>(positions));
    std::fprintf(stderr, "%14lld %12s  %s\n", static_cast<long long>(positions),
                 format_bytes(double(kv_cache_bytes(c, positions))).c_str(),
                 a.fits ? "allocated, last position written" : ("refused by " + a.refused_by).c_str());
    csv.row(positions, kv_cache_bytes(c, positions), a.fits ? "fits" : "refused by " + a.refused_by);
    csv.commit();
    if (a.fits) fits = std::max(fits, positions);
    else refused = refused < 0 ? positions : std::min(refused, positions), last_refusal = a;
  };
  // Doubling until a refusal, then bisection until the gap is 0.1% of the wall (at least one position).
  for (std::int64_t positions = 1024; refused < 0 && positions <= kMostPositions; positions *= 2) attempt(positions);
  if (refused < 0) {
    std::fprintf(stderr, "\nno refusal up to %lld positions (the most a view can index)\n",
                 static_cast<long long>(kMostPositions));
    return;
  }
  while (refused - fits > std::max<std::int64_t>(1, fits / 1000)) attempt(fits + (refused - fits) / 2);

  const std::int64_t predicted = device_wall >= 0 ? std::min(budget_wall, device_wall) : budget_wall;
  std::fprintf(stderr, "\ncontext wall: %lld positions fit, %lld do not (refused by %s: %s)\n",
               static_cast<long long>(fits), static_cast<long long>(refused), last_refusal.refused_by.c_str(),
               last_refusal.reason.c_str());
  // The wall lies between `fits` and `refused`: the prediction agrees when it falls in that bracket.
  const bool agrees = fits <= predicted && predicted < refused;
  const std::int64_t off_by = predicted < fits ? fits - predicted : predicted - refused + 1;
  std::fprintf(stderr, "predicted %lld positions: %s\n", static_cast<long long>(predicted),
               agrees ? "between the longest that fit and the shortest refused, as the formula says"
                      : ((predicted < fits ? "more fit than predicted, by " : "fewer fit than predicted, by ") +
                         std::to_string(off_by) + " positions (" + format_bytes(double(off_by * per_position)) +
                         "): memory the prediction does not see")
                            .c_str());
}

}  // namespace kvs::ch03
