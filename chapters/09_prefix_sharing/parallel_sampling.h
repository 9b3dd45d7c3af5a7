#pragma once
// Chapter 09's parallel sampling (vLLM's SamplingParams.n): N continuations of one prompt. Shared, the prompt
// runs through the model once; the N samples all start from its logits, each drawing with its own sampler, and
// each continues in a sequence forked from the prompt's: every block of the prompt is held once, the partly
// filled last one too, until each sample writes its first token there and gets its own copy of it
// (copy-on-write); after that, only the samples' own blocks are private. Not shared, each sample is a request
// of its own: its own prefill, its own blocks.
// Either way one batched forward pass a step serves every sample.
#include <span>
#include <vector>

#include "model.h"
#include "prefix_cache.h"
#include "sampler.h"

namespace kvs::ch09 {

// Sample i draws with settings.seed + i: the seeds a comparison (shared, not shared, alone) repeats.
inline SamplerSettings sample_settings(SamplerSettings settings, int sample) {
  settings.seed += static_cast<std::uint64_t>(sample);
  return settings;
}

struct SamplingRun {
  std::vector<std::vector<int>> outputs;  // (samples, new_tokens) generated tokens
  int peak_held_blocks = 0;               // the most blocks the samples held at once
  long prefill_tokens = 0;                // prompt tokens put through the model
  long cow_copies = 0;                    // blocks copied before a write
  double wall_ms = 0;
};

// `cache`'s pool must have a sequence slot per sample and room for them (the memory experiment sizes it).
// Throws std::invalid_argument for a prompt, a sample count or a length the model or the pool cannot take.
SamplingRun sample_in_parallel(Model& model, PrefixCache& cache, std::span<const int> prompt, int samples,
                               int new_tokens, const SamplerSettings& settings, bool share);

// What sample `sample` must equal: the prompt alone through chapter 03's cache, with that sample's seed.
std::vector<int> sample_alone(Model& model, std::span<const int> prompt, int new_tokens, const SamplerSettings& settings,
                              int sample);

}  // namespace kvs::ch09
