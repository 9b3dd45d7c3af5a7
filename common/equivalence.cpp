#include "equivalence.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace kvs {

RecordedRun record(const std::function<Generation(const OnLogits&)>& generate) {
  RecordedRun run;
  const Generation g = generate([&](int, std::span<const float> logits) { run.logits.emplace_back(logits.begin(), logits.end()); });
  run.tokens = g.tokens;
  return run;
}

namespace {

float top2_gap(const std::vector<float>& logits) {
  if (logits.size() < 2) return INFINITY;
  std::vector<float> sorted = logits;
  std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
  return sorted[0] - sorted[1];
}

// log softmax(logits)[i] for every i, in double.
std::vector<double> log_softmax(std::span<const float> logits) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(double(l) - max);
  const double log_z = max + std::log(sum);
  std::vector<double> out(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = double(logits[i]) - log_z;
  return out;
}

}  // namespace

Equivalence check_equivalence(const RecordedRun& reference, const RecordedRun& run, int prompt_len, float tolerance) {
  const std::size_t steps = reference.logits.size();
  if (run.logits.size() != steps || reference.tokens.size() != std::size_t(prompt_len) + steps ||
      run.tokens.size() != reference.tokens.size())
    throw std::invalid_argument("check_equivalence: the runs generated " + std::to_string(steps) + " and " +
                                std::to_string(run.logits.size()) + " tokens after a prompt of " +
                                std::to_string(prompt_len) + "; compare runs of the same length");
  Equivalence e;
  for (int step = 0; step < static_cast<int>(steps); ++step) {
    const auto& a = reference.logits[step];
    const auto& b = run.logits[step];
    if (a.size() != b.size()) throw std::invalid_argument("check_equivalence: logits of different vocabularies");
    const float worst = max_abs_difference(a, b);
    if (!(worst <= tolerance) && e.first_logit_mismatch < 0) e.first_logit_mismatch = step;  // NaN counts too
    e.worst_logit_difference = worst_difference(e.worst_logit_difference, worst);
    e.steps = step + 1;
    if (top2_gap(a) <= tolerance) {  // near-tie: either token is a correct answer from here on
      e.near_tie = step;
      break;
    }
    if (e.first_token_mismatch < 0 && run.tokens[prompt_len + step] != reference.tokens[prompt_len + step])
      e.first_token_mismatch = step;
  }
  return e;
}

float max_abs_difference(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size())
    throw std::invalid_argument("max_abs_difference: vectors of " + std::to_string(a.size()) + " and " +
                                std::to_string(b.size()) + " numbers");
  float worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const float difference = std::abs(a[i] - b[i]);
    if (std::isnan(difference)) return difference;
    worst = std::max(worst, difference);
  }
  return worst;
}

LogitDivergence logit_divergence(std::span<const float> reference, std::span<const float> other) {
  if (reference.size() != other.size() || reference.empty())
    throw std::invalid_argument("logit_divergence: two distributions over the same, non-empty vocabulary");
  const std::vector<double> p = log_softmax(reference), q = log_softmax(other);
  LogitDivergence d;
  for (std::size_t i = 0; i < p.size(); ++i) d.kl += std::exp(p[i]) * (p[i] - q[i]);
  d.max_abs_logit = max_abs_difference(reference, other);
  if (d.kl < 0) d.kl = 0;  // rounding can leave -1e-17 for identical distributions (std::max(0.0, NaN) is 0: kept NaN)
  return d;
}

}  // namespace kvs
