#pragma once
// The two generation loops every chapter, benchmark and test runs: naive (recompute everything for
// every token) and cached (prefill the prompt into a cache once, then decode one position per step).
// The cache policy is the caller's; these loops only decide which positions each forward pass sees.
#include <functional>
#include <span>
#include <vector>

#include "kv_cache.h"
#include "model.h"
#include "sampler.h"

namespace kvs {

struct Generation {
  std::vector<int> tokens;      // prompt, then the generated tokens
  std::vector<double> step_ms;  // step_ms[s]: wall time to produce generated token s; s = 0 is the time to
                                // first token (the prompt's forward pass), s > 0 are decode steps
  double ttft_ms() const { return step_ms.empty() ? 0.0 : step_ms[0]; }
  double decode_median_ms() const;  // median of step_ms[1..]; 0 without decode steps
  double decode_percentile_ms(double q) const;  // percentile q of step_ms[1..] (timing.h); 0 without decode steps
  double total_ms() const;  // the whole generation, prefill and every decode step: what the user waited
  double decode_tokens_per_s() const {
    const double ms = decode_median_ms();
    return ms > 0 ? 1000.0 / ms : 0.0;
  }
};

using OnToken = std::function<void(int token)>;
// Logits the sampler saw for generated token `step` (on the host, valid during the call).
using OnLogits = std::function<void(int step, std::span<const float> logits)>;

// Chapter 01: token s comes from a forward pass over the whole sequence so far, from position 0, with
// no cache.
Generation generate_naive(Model& model, Sampler& sampler, std::span<const int> prompt, int max_new_tokens,
                          const OnToken& on_token = {}, const OnLogits& on_logits = {});

// Chapters 02-03: prefill - the prompt's positions go through the model once, in chunks of
// `prefill_chunk` positions (0 = the whole prompt in one call) - and their K/V into `cache`; then decode -
// each new token is one forward pass over one position that reads every earlier position from the cache.
// The cache must be empty (nothing cached yet). Both loops throw std::invalid_argument for an empty prompt.
// Teacher forcing (chapters 05-06): with `forced_tokens`, generated token s is forced_tokens[s] whatever the
// logits say (the sampler is not asked), so two runs see the same context and differ only in their caches;
// it must hold max_new_tokens tokens. on_logits may read or overwrite the cache (KvCache::row): it runs
// between forward passes.
// DecodeSteps::kRecorded: the decode steps go through RecordedDecode (model.h) - the first one records the
// step, the others replay it with one launch (a CUDA graph); the same logits. Throws std::invalid_argument
// before the prefill when the backend or the cache cannot do that.
enum class DecodeSteps { kForward, kRecorded };
Generation generate_cached(Model& model, KvCache& cache, Sampler& sampler, std::span<const int> prompt,
                           int max_new_tokens, int prefill_chunk = 0, const OnToken& on_token = {},
                           const OnLogits& on_logits = {}, std::span<const int> forced_tokens = {},
                           DecodeSteps decode_steps = DecodeSteps::kForward);

}  // namespace kvs
