#pragma once
// The equivalence check: does a run with a cache produce what the reference run (naive recompute, or a
// cache known to be right) produces? The tests run it on every cache policy; chapter 06 runs it on a broken
// cache to show that it is the check that catches the bug.
//
// Per-step logits must agree within kLogitTolerance. Why not bit for bit: naive recomputes each position's
// keys with a matrix-matrix product over the whole sequence, the cache computed them once with a
// product over one token (or over a chunk); the sums run in other orders, which leaves differences
// of about 1e-5 on logits of magnitude ~10. Any real error - a row written at the wrong position, a
// missing key, a wrong mask - moves logits by much more than 1e-3.
// Greedy tokens are compared up to the first near-tie: a step where the reference's two best logits are
// within the tolerance, so rounding may legitimately pick either (transformers' cached-vs-recompute test
// does the same); logits are compared up to and including that step.
#include <algorithm>
#include <cmath>
#include <concepts>
#include <functional>
#include <span>
#include <vector>

#include "generate.h"

namespace kvs {

inline constexpr float kLogitTolerance = 1e-3f;

// A generation with the logits of every generated token.
struct RecordedRun {
  std::vector<int> tokens;                 // prompt, then the generated tokens
  std::vector<std::vector<float>> logits;  // per generated token: (vocab)
};
// Runs `generate` with an on_logits that keeps every step's logits.
RecordedRun record(const std::function<Generation(const OnLogits&)>& generate);

struct Equivalence {
  int steps = 0;                    // generated tokens compared (all, or up to the first near-tie)
  int near_tie = -1;                // first step where the reference's two best logits are within the tolerance; -1: none
  int first_token_mismatch = -1;    // first step whose generated token differs; -1: none
  int first_logit_mismatch = -1;    // first step with a logit off by more than the tolerance; -1: none
  float worst_logit_difference = 0; // largest |Δlogit| over the compared steps
  bool passed() const { return first_token_mismatch < 0 && first_logit_mismatch < 0; }
};
// Compares `run` with `reference` step by step (both generated the same number of tokens after the same
// prompt of prompt_len tokens). Throws std::invalid_argument when they did not.
Equivalence check_equivalence(const RecordedRun& reference, const RecordedRun& run, int prompt_len,
                              float tolerance = kLogitTolerance);

// max |a[i] - b[i]| over two vectors of one size (throws std::invalid_argument otherwise); NaN where any difference is
// NaN (either side NaN, or both infinite alike), so that no tolerance passes it. (std::max(worst, NaN) keeps worst:
// a loop of it passed NaN logits as equal.)
float max_abs_difference(std::span<const float> a, std::span<const float> b);
// The larger of two such differences (or divergences), NaN where either is: for a worst over several comparisons.
template <std::floating_point T>
T worst_difference(T a, T b) {
  return std::isnan(a) ? a : std::isnan(b) ? b : std::max(a, b);
}

// The difference between two next-token distributions given as logits (vocab each).
struct LogitDivergence {
  double kl = 0;              // KL(p || q) in nats, p = softmax(reference), q = softmax(other)
  float max_abs_logit = 0;    // max over the vocabulary of |reference - other|
};
LogitDivergence logit_divergence(std::span<const float> reference, std::span<const float> other);

}  // namespace kvs
