#pragma once
// How a broken run differs from the clean one, step by step, and the two texts side by side. Chapters 05
// and 06 report the same way.
#include <iosfwd>
#include <span>
#include <string>
#include <vector>

#include "equivalence.h"

namespace kvs::ch05 {

struct StepDivergence {
  bool tokens_match = true;  // the two runs generated the same token at this step
  double kl = 0;             // KL(clean || broken) of the next-token distributions, nats
  float max_abs_logit = 0;   // max |Δlogit|
};
// One entry per generated token. Both runs generated the same number of tokens after the same prompt.
std::vector<StepDivergence> step_divergence(const RecordedRun& clean, const RecordedRun& broken, int prompt_len);
// The first step whose generated token differs, -1 if none.
int first_mismatch(const std::vector<StepDivergence>& steps);

// Whether to colour the output: stdout is a terminal that takes colour (and NO_COLOR is not set to a non-empty value).
bool colour_output();

// The generated parts of two runs in two columns of `width` characters (newlines shown as '|', other
// unprintable bytes as '.'), the divergence marked from byte `first_difference` on: red on a terminal,
// otherwise '[' before the first differing byte of each text. first_difference -1: identical.
void print_side_by_side(std::ostream& out, const std::string& left_title, std::span<const int> left,
                        const std::string& right_title, std::span<const int> right, int first_difference,
                        bool colour, int width = 38);

// A layer x position map as text: one row per layer, one character per bucket of positions, darker for
// larger values (max over the bucket); the scale is printed under it.
void print_heatmap(std::ostream& out, const std::string& title, const std::vector<std::vector<float>>& by_layer,
                   int first_position, int columns = 64);

}  // namespace kvs::ch05
