#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace kvs {

int argmax(std::span<const float> values) {
  int best = 0;
  for (int i = 1; i < static_cast<int>(values.size()); ++i)
    if (values[i] > values[best] || (std::isnan(values[best]) && !std::isnan(values[i]))) best = i;  // ties: the lower id
  return best;
}

Sampler::Sampler(int vocab_size, SamplerSettings settings)
    : settings_(settings), state_(settings.seed), order_(vocab_size), weights_(vocab_size) {}

double Sampler::uniform() {
  // splitmix64: a tiny, well-mixed generator with a fully specified output, unlike std:: distributions.
  std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

int Sampler::sample(std::span<const float> logits) {
  if (logits.size() != order_.size())
    throw std::invalid_argument("Sampler: " + std::to_string(logits.size()) + " logits for a vocabulary of " +
                                std::to_string(order_.size()));
  if (settings_.temperature == 0.0f) return argmax(logits);
  // exp(l - max) of a max of +inf is NaN for every weight, and NaN breaks the ordering partial_sort needs: the draw
  // had returned the least likely token. Overflowed activations are the model's failure, said as such. (A -inf
  // logit is a token never drawn, weight 0; all of them -inf leave nothing to draw.)
  bool any_finite = false;
  for (float l : logits) {
    if (std::isnan(l) || l == std::numeric_limits<float>::infinity())
      throw std::runtime_error("Sampler: a logit is NaN or +infinity (the model's numbers overflowed); no token can "
                               "be drawn from them");
    any_finite = any_finite || std::isfinite(l);
  }
  if (!any_finite) throw std::runtime_error("Sampler: every logit is -infinity; no token can be drawn");
  const int vocab = static_cast<int>(logits.size());
  const int k = settings_.top_k > 0 ? std::min(settings_.top_k, vocab) : vocab;
  std::iota(order_.begin(), order_.begin() + vocab, 0);
  if (k < vocab)  // the k largest logits first, ties by lower id, so the candidate set is deterministic
    std::partial_sort(order_.begin(), order_.begin() + k, order_.begin() + vocab,
                      [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  float max_logit = logits[order_[0]];
  for (int i = 1; i < k; ++i) max_logit = std::max(max_logit, logits[order_[i]]);
  double total = 0.0;
  for (int i = 0; i < k; ++i)
    total += weights_[i] = std::exp((static_cast<double>(logits[order_[i]]) - max_logit) / settings_.temperature);
  const double target = uniform() * total;
  double cumulative = 0.0;
  for (int i = 0; i < k; ++i) {
    cumulative += weights_[i];
    if (target < cumulative) return order_[i];
  }
  return order_[k - 1];  // rounding left target == total
}

}  // namespace kvs
