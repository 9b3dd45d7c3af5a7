#include "trace.h"

#include <cstdint>
#include <sstream>
#include <stdexcept>

#include "cli.h"
#include "random.h"
#include "tokenizer.h"

namespace kvs::ch08 {
namespace {
constexpr int kMaxArrivalStep = 1 << 24;  // a request arriving later than 16.7M steps in is a mistake
}  // namespace

// One line (an error message quotes it; --help wraps it).
const char* const kTraceFormat =
    "one request a line, \"ARRIVAL_STEP MAX_NEW_TOKENS PROMPT\": the prompt is the rest of the line after one "
    "space (\\n in it is a newline, \\\\ a backslash); empty lines and lines starting with # are skipped; a line "
    "may end in \\r\\n (a file written on Windows)";

std::vector<Request> parse_trace(const std::string& text, const std::string& name) {
  std::vector<Request> requests;
  std::istringstream lines(text);
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();  // CRLF: the \r is the line's end, not the prompt's
    if (line.empty() || line[0] == '#') continue;
    auto fail = [&](const std::string& what) {
      return std::runtime_error(name + ":" + std::to_string(number) + ": " + what + "; expected " +
                                "ARRIVAL_STEP MAX_NEW_TOKENS PROMPT");
    };
    std::size_t at = 0;
    auto number_field = [&](const char* what, long max) {
      const std::size_t end = line.find(' ', at);
      const std::string field = line.substr(at, end == std::string::npos ? std::string::npos : end - at);
      if (field.empty() || field.find_first_not_of("0123456789") != std::string::npos || field.size() > 9 ||
          std::stol(field) > max)
        throw fail(std::string(what) + " \"" + field + "\" is not a whole number from 0 to " + std::to_string(max));
      at = end == std::string::npos ? line.size() : end + 1;
      return static_cast<int>(std::stol(field));
    };
    Request r;
    r.arrival_step = number_field("ARRIVAL_STEP", kMaxArrivalStep);
    r.max_new_tokens = number_field("MAX_NEW_TOKENS", 1 << 20);
    if (r.max_new_tokens < 1) throw fail("MAX_NEW_TOKENS must be at least 1");
    std::string prompt;
    for (std::size_t i = at; i < line.size(); ++i) {
      if (line[i] != '\\') {
        prompt += line[i];
        continue;
      }
      if (i + 1 < line.size() && line[i + 1] == 'n') prompt += '\n';
      else if (i + 1 < line.size() && line[i + 1] == '\\') prompt += '\\';
      else throw fail("a backslash not followed by n or \\");
      ++i;
    }
    if (prompt.empty()) throw fail("the prompt is empty");
    r.prompt = encode_bytes(prompt);
    requests.push_back(std::move(r));
  }
  if (requests.empty()) throw std::runtime_error(name + " holds no request (" + kTraceFormat + ")");
  return requests;
}

std::vector<Request> generate_trace(const std::string& text, const TraceShape& shape) {
  if (text.size() <= std::size_t(shape.prompt_max))
    throw std::runtime_error("the text to cut prompts from is shorter than the longest prompt");
  Random random(shape.seed);  // the same trace with every compiler and library (common/random.h)
  const std::int64_t last_offset = std::int64_t(text.size()) - shape.prompt_max - 1;
  std::vector<Request> requests;
  double arrival = 0;
  for (int i = 0; i < shape.count; ++i) {
    Request r;
    const int length = static_cast<int>(random.uniform_int(shape.prompt_min, shape.prompt_max));
    const std::size_t offset = static_cast<std::size_t>(random.uniform_int(0, last_offset));
    r.prompt = encode_bytes(std::string_view(text).substr(offset, length));
    r.max_new_tokens = static_cast<int>(random.uniform_int(shape.output_min, shape.output_max));
    if (shape.mean_gap > 0 && i > 0) arrival += random.exponential(1.0 / shape.mean_gap);
    if (arrival > kMaxArrivalStep) {  // a trace file's bound too; past INT_MAX the conversion is undefined
      std::ostringstream why;
      why << "--mean-gap " << shape.mean_gap << " over " << shape.count << " requests: arrivals pass step "
          << kMaxArrivalStep << "; give a shorter gap or fewer requests";
      throw UsageError(why.str());
    }
    r.arrival_step = static_cast<int>(arrival);
    requests.push_back(std::move(r));
  }
  return requests;
}

}  // namespace kvs::ch08
