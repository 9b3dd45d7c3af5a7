#pragma once
// Picks the next token from logits: greedy (temperature 0: argmax, ties to the lowest id), or a draw
// from softmax(logits / temperature), optionally restricted to the top_k largest logits. Seeded with its
// own generator, so a seed gives the same tokens on every run and with any thread count.
#include <cstdint>
#include <span>
#include <vector>

namespace kvs {

struct SamplerSettings {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = the whole vocabulary
  std::uint64_t seed = 42;
};

// Index of the largest value; the lowest index among equals. A NaN is never the largest (0 if all are NaN).
int argmax(std::span<const float> values);

class Sampler {
 public:
  Sampler(int vocab_size, SamplerSettings settings);
  // Allocates nothing. Throws std::invalid_argument for logits of another length than the vocabulary, and, when
  // drawing (temperature > 0), std::runtime_error for a NaN or +inf logit, or all -inf: nothing to draw from.
  int sample(std::span<const float> logits);
  const SamplerSettings& settings() const { return settings_; }

 private:
  double uniform();  // [0, 1), 53 random bits
  SamplerSettings settings_;
  std::uint64_t state_;
  std::vector<int> order_;       // (vocab) candidate ids
  std::vector<double> weights_;  // (vocab) unnormalised probabilities
};

}  // namespace kvs
