#pragma once
// Where chapter 08's requests come from: a file (one request a line), or drawn from the held-out text.
#include <cstdint>
#include <string>
#include <vector>

#include "scheduler.h"

namespace kvs::ch08 {

// The file format, for --help: "ARRIVAL_STEP MAX_NEW_TOKENS PROMPT" a line, the prompt the rest of the line
// after one space ("\n" in it is a newline, "\\" a backslash); empty lines and lines starting with # are
// skipped. Throws std::runtime_error naming the file and the line for anything else.
extern const char* const kTraceFormat;
std::vector<Request> parse_trace(const std::string& text, const std::string& name);

// `count` requests: prompts are slices of `text` at random offsets, prompt and output lengths uniform in
// [min, max] (inclusive), arrival gaps exponential with mean `mean_gap` steps (0: all at step 0); `seed`
// fixes all of it.
struct TraceShape {
  int count = 32;
  int prompt_min = 16, prompt_max = 256;
  int output_min = 16, output_max = 128;
  double mean_gap = 0;
  std::uint64_t seed = 1;
};
std::vector<Request> generate_trace(const std::string& text, const TraceShape& shape);

}  // namespace kvs::ch08
