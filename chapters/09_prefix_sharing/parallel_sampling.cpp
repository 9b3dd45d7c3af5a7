#include "parallel_sampling.h"

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "generate.h"
#include "timing.h"

namespace kvs::ch09 {

SamplingRun sample_in_parallel(Model& model, PrefixCache& cache, std::span<const int> prompt, int samples,
                               int new_tokens, const SamplerSettings& settings, bool share) {
  const int length = static_cast<int>(prompt.size());
  ch08::BlockPool& pool = cache.pool();
  if (length < 1 || samples < 1 || new_tokens < 1 || length + new_tokens > model.config().seq_len ||
      length + new_tokens > model.max_kv_rows() || samples > model.max_tokens_per_call() ||
      samples > pool.sequences() || length + new_tokens > pool.table_width() * pool.block_size())
    throw std::invalid_argument("parallel sampling: " + std::to_string(samples) + " samples of " + std::to_string(new_tokens) +
                                " tokens after a " + std::to_string(length) + "-token prompt do not fit this model and pool");
  const int vocab = model.config().vocab_size;
  SamplingRun run;
  std::vector<Sampler> samplers;
  std::vector<std::unique_ptr<ch08::PagedSequence>> sequences;
  for (int i = 0; i < samples; ++i) {
    samplers.emplace_back(vocab, sample_settings(settings, i));
    sequences.push_back(std::make_unique<ch08::PagedSequence>(pool, &cache));
    run.outputs.emplace_back().reserve(new_tokens);
  }
  std::vector<SequenceStep> batch(samples);
  std::vector<int> next(samples);  // (samples) each sample's newest token
  const long copies_before = cache.stats().cow_copies;
  const Stopwatch clock;
  auto took = [&](int sample, std::span<const float> logits) {
    next[sample] = samplers[sample].sample(logits);
    run.outputs[sample].push_back(next[sample]);
  };

  // The prompt: once and forked N ways, or once per sample. Either way each sample draws its first token.
  for (int i = 0; i < samples; ++i) {
    if (share && i > 0) {
      sequences[i]->start_from(sequences[0]->blocks(), length);  // every prompt block, held once more
      continue;
    }
    std::span<const float> logits;  // the prompt's last position's, after its last chunk
    for (int pos = 0; pos < length; pos += model.max_tokens_per_call())
      logits = model.forward(prompt.subspan(pos, std::min(length - pos, model.max_tokens_per_call())), pos, sequences[i].get());
    run.prefill_tokens += length;
    if (!share) took(i, logits);
    else for (int j = 0; j < samples; ++j) took(j, logits);  // the one prompt's logits, N draws
  }
  run.peak_held_blocks = cache.held_blocks();
  // Decode: one batched step gives every sample its next token.
  for (int step = 1; step < new_tokens; ++step) {
    for (int i = 0; i < samples; ++i)
      batch[i] = SequenceStep{std::span<const int>(&next[i], 1), length + step - 1, sequences[i].get()};
    const std::span<const float> logits = model.forward(batch);  // (samples, vocab)
    for (int i = 0; i < samples; ++i) took(i, logits.subspan(std::size_t(i) * vocab, vocab));
    run.peak_held_blocks = std::max(run.peak_held_blocks, cache.held_blocks());
  }
  run.wall_ms = clock.milliseconds();
  run.cow_copies = cache.stats().cow_copies - copies_before;
  return run;
}

std::vector<int> sample_alone(Model& model, std::span<const int> prompt, int new_tokens, const SamplerSettings& settings,
                              int sample) {
  ch03::PreallocatedKvCache cache(model.backend(), model.config(), static_cast<int>(prompt.size()) + new_tokens);
  Sampler sampler(model.config().vocab_size, sample_settings(settings, sample));
  const Generation g = generate_cached(model, cache, sampler, prompt, new_tokens, model.max_tokens_per_call());
  return {g.tokens.begin() + static_cast<long>(prompt.size()), g.tokens.end()};
}

}  // namespace kvs::ch09
