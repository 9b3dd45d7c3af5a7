#include "report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ostream>

namespace kvs::ch05 {

std::vector<StepDivergence> step_divergence(const RecordedRun& clean, const RecordedRun& broken, int prompt_len) {
  if (clean.logits.size() != broken.logits.size() || clean.tokens.size() != broken.tokens.size())
    throw std::invalid_argument("step_divergence: runs of different lengths");
  std::vector<StepDivergence> steps(clean.logits.size());
  for (std::size_t s = 0; s < steps.size(); ++s) {
    const LogitDivergence d = logit_divergence(clean.logits[s], broken.logits[s]);
    steps[s] = {clean.tokens[prompt_len + s] == broken.tokens[prompt_len + s], d.kl, d.max_abs_logit};
  }
  return steps;
}

int first_mismatch(const std::vector<StepDivergence>& steps) {
  for (std::size_t s = 0; s < steps.size(); ++s)
    if (!steps[s].tokens_match) return static_cast<int>(s);
  return -1;
}

bool colour_output() {
  const char* term = std::getenv("TERM");
  const char* no_color = std::getenv("NO_COLOR");  // no-color.org: set and not empty
  return isatty(STDOUT_FILENO) && !(no_color && *no_color) && term && std::string(term) != "dumb";
}

namespace {

char printable(int byte) {
  if (byte == '\n') return '|';
  return byte >= 32 && byte < 127 ? static_cast<char>(byte) : '.';
}

// Cells of one column: each is one printed character, with a marker or colour code around it.
std::vector<std::string> cells(std::span<const int> text, int first_difference, bool colour) {
  std::vector<std::string> out;
  for (int i = 0; i < static_cast<int>(text.size()); ++i) {
    const bool diverged = first_difference >= 0 && i >= first_difference;
    std::string cell(1, printable(text[i]));
    if (diverged && colour) cell = "\033[31m" + cell + "\033[0m";
    if (!colour && i == first_difference) out.push_back("[");
    out.push_back(cell);
  }
  return out;
}

}  // namespace

void print_side_by_side(std::ostream& out, const std::string& left_title, std::span<const int> left,
                        const std::string& right_title, std::span<const int> right, int first_difference,
                        bool colour, int width) {
  const std::vector<std::string> a = cells(left, first_difference, colour), b = cells(right, first_difference, colour);
  auto line = [&](const std::vector<std::string>& c, std::size_t from) {
    std::string s;
    int shown = 0;
    for (std::size_t i = from; i < c.size() && shown < width; ++i, ++shown) s += c[i];
    return s + std::string(width - shown, ' ');
  };
  out << left_title << std::string(std::max<int>(1, width - int(left_title.size())), ' ') << " | " << right_title << "\n";
  for (std::size_t from = 0; from < std::max(a.size(), b.size()); from += width)
    out << line(a, from) << " | " << line(b, from) << "\n";
}

void print_heatmap(std::ostream& out, const std::string& title, const std::vector<std::vector<float>>& by_layer,
                   int first_position, int columns) {
  static const char kShades[] = " .:-=+*#%@";
  float top = 0;
  for (const auto& row : by_layer)
    for (float v : row) top = std::max(top, v);
  const int positions = by_layer.empty() ? 0 : static_cast<int>(by_layer[0].size());
  const int per_column = std::max(1, (positions + columns - 1) / columns);
  out << title << " (one column per " << per_column << " position" << (per_column > 1 ? "s" : "") << ", from position "
      << first_position << "; ' ' = 0, '@' = " << top << ")\n";
  for (int layer = static_cast<int>(by_layer.size()) - 1; layer >= 0; --layer) {
    out << "  layer " << layer << " |";
    for (int c = 0; c * per_column < positions; ++c) {
      float v = 0;
      for (int p = c * per_column; p < std::min(positions, (c + 1) * per_column); ++p) v = std::max(v, by_layer[layer][p]);
      const int shade = v <= 0 || top <= 0 ? 0 : 1 + std::min(8, static_cast<int>(8 * v / top));
      out << kShades[shade];
    }
    out << "|\n";
  }
}

}  // namespace kvs::ch05
