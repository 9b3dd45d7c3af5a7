#include "generate.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "progress.h"
#include "timing.h"

namespace kvs {

double Generation::decode_median_ms() const {
  return step_ms.size() < 2 ? 0.0 : median(std::vector<double>(step_ms.begin() + 1, step_ms.end()));
}

double Generation::decode_percentile_ms(double q) const {
  return step_ms.size() < 2 ? 0.0 : percentile(std::vector<double>(step_ms.begin() + 1, step_ms.end()), q);
}

double Generation::total_ms() const {
  double total = 0;
  for (double ms : step_ms) total += ms;
  return total;
}

namespace {

Generation start(std::span<const int> prompt, int max_new_tokens) {
  // The first token is sampled from the prompt's last logits: without a prompt there are none.
  if (prompt.empty()) throw std::invalid_argument("generate: an empty prompt; give at least one token");
  if (max_new_tokens < 0) throw std::invalid_argument("generate: a negative number of new tokens");
  Generation g;
  g.tokens.reserve(prompt.size() + max_new_tokens);  // the loops below never reallocate
  g.tokens.assign(prompt.begin(), prompt.end());
  g.step_ms.reserve(max_new_tokens);
  return g;
}

void accept(Generation& g, int step, int token, std::span<const float> logits, const Stopwatch& timer,
            const OnToken& on_token, const OnLogits& on_logits) {
  g.step_ms.push_back(timer.milliseconds());
  g.tokens.push_back(token);
  if (on_logits) on_logits(step, logits);
  if (on_token) on_token(token);
}

}  // namespace

Generation generate_naive(Model& model, Sampler& sampler, std::span<const int> prompt, int max_new_tokens,
                          const OnToken& on_token, const OnLogits& on_logits) {
  Generation g = start(prompt, max_new_tokens);
  for (int step = 0; step < max_new_tokens; ++step) {
    const Stopwatch timer;
    // The whole sequence, from position 0, no cache: every key and value is computed again.
    const auto logits = model.forward(g.tokens, /*pos=*/0, /*cache=*/nullptr);
    accept(g, step, sampler.sample(logits), logits, timer, on_token, on_logits);
  }
  return g;
}

Generation generate_cached(Model& model, KvCache& cache, Sampler& sampler, std::span<const int> prompt,
                           int max_new_tokens, int prefill_chunk, const OnToken& on_token,
                           const OnLogits& on_logits, std::span<const int> forced_tokens,
                           DecodeSteps decode_steps) {
  Generation g = start(prompt, max_new_tokens);
  if (!forced_tokens.empty() && static_cast<int>(forced_tokens.size()) < max_new_tokens)
    throw std::invalid_argument("generate_cached: " + std::to_string(forced_tokens.size()) + " forced tokens for " +
                                std::to_string(max_new_tokens) + " new tokens; give one per new token");
  // The token generated at `step`: the sampler's choice, or the forced one.
  auto next = [&](int step, std::span<const float> logits) {
    return forced_tokens.empty() ? sampler.sample(logits) : forced_tokens[step];
  };
  if (cache.length() != 0)
    throw std::invalid_argument("generate_cached: the cache already holds " + std::to_string(cache.length()) +
                                " positions; start from an empty cache");
  if (max_new_tokens == 0) return g;
  std::optional<RecordedDecode> recorded;  // refuses a backend or cache that cannot, before any work
  if (decode_steps == DecodeSteps::kRecorded) recorded.emplace(model, cache);
  const int prompt_len = static_cast<int>(prompt.size());
  const int chunk = prefill_chunk > 0 ? prefill_chunk : prompt_len;

  // Prefill: every prompt position once, chunk by chunk; each chunk attends to the cached prefix and
  // causally within itself. Only the last chunk's last logits are needed. A long prompt shows progress (a
  // 1.2 MB prompt file through chapter 04 took 92 s on 2 cores); a short one prints nothing (progress.h).
  Stopwatch timer;
  std::span<const float> logits;
  Progress progress("prefill", "positions");
  for (int pos = 0; pos < prompt_len; pos += chunk) {
    const int n = std::min(chunk, prompt_len - pos);
    logits = model.forward(prompt.subspan(pos, n), pos, &cache);
    progress.update(pos + n, prompt_len);
  }
  accept(g, 0, next(0, logits), logits, timer, on_token, on_logits);

  // Decode: one new position per step; everything before it is read from the cache.
  for (int step = 1; step < max_new_tokens; ++step) {
    timer = Stopwatch();
    const int pos = static_cast<int>(g.tokens.size()) - 1;  // the token generated last is not cached yet
    logits = recorded ? recorded->step(g.tokens[pos], pos)
                      : model.forward(std::span<const int>(&g.tokens[pos], 1), pos, &cache);
    accept(g, step, next(step, logits), logits, timer, on_token, on_logits);
  }
  return g;
}

}  // namespace kvs
