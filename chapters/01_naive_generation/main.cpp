// Chapter 01 — naive generation.
//
// To generate token t+1, run the model over the whole sequence 0..t (prompt plus everything generated so
// far) from position 0, with no cache, and keep the last position's logits. Every step recomputes the
// keys and values of every earlier position, although they have not changed: step t costs O(t) matrix
// work and O(t²) attention, so the time per token grows with the context. Chapters 02 and 03 keep those
// keys and values instead.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <vector>

#include "cli.h"
#include "generate.h"
#include "runtime.h"
#include "timing.h"

namespace {

constexpr const char* kDefaultPrompt = "And God said, ";

// Ten rows (fewer below ten decode steps), each the median time of a window of consecutive steps: one step's time
// is noisy (a timer interrupt, the other core's work), the median of a window is not. The windows split the steps
// evenly, their sizes at most one apart: a fixed size left a short last window (9 steps after ten of 99), and "grew
// Nx" divided by its median. Step 0 is left out: it is the prompt's forward pass and also pays for first-touch
// warm-up.
void print_report(const std::vector<double>& step_ms, int prompt_tokens, double total_ms) {
  const int steps = static_cast<int>(step_ms.size());
  if (steps == 0) return;
  std::fprintf(stderr, "%14s %16s %16s\n", "steps", "context", "median ms/token");
  const int decode_steps = steps - 1, windows = std::min(10, decode_steps);
  std::vector<double> medians;
  for (int w = 0; w < windows; ++w) {
    const int s = 1 + w * decode_steps / windows, end = 1 + (w + 1) * decode_steps / windows;
    medians.push_back(kvs::median(std::vector<double>(step_ms.begin() + s, step_ms.begin() + end)));
    std::fprintf(stderr, "%6d - %5d %7d - %6d %16.3f\n", s, end - 1, prompt_tokens + s, prompt_tokens + end - 1,
                 medians.back());
  }
  std::fprintf(stderr, "\n%d tokens in %.1f ms: %.1f tokens/s (step 0, the prompt: %.3f ms)\n", steps, total_ms,
               steps / (total_ms / 1000.0), step_ms[0]);
  if (medians.size() > 1)
    std::fprintf(stderr, "median time per token grew %.1fx from the first window of steps to the last\n",
                 medians.back() / medians.front());
}

}  // namespace

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  kvs::ArgParser parser("01_naive_generation",
                        "Chapter 01: naive generation. For every new token the model re-runs over the whole\n"
                        "sequence so far, from position 0, with no cache. The text (prompt included) streams to\n"
                        "stdout; per-step times as the context grows, and tokens/s, go to stderr.\n"
                        "CSV columns (--csv): step, context_tokens, ms.");
  kvs::add_common_flags(parser, options, '"' + std::string(kDefaultPrompt) + '"');
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    kvs::Runtime rt(options, kDefaultPrompt);
    rt.plan_kv_cache(0);  // naive generation keeps no cache
    kvs::CsvWriter csv({"--csv", options.csv}, "step,context_tokens,ms", rt.inputs());
    std::cerr << rt.describe() << "\nnaive generation of " << options.max_new_tokens << " tokens after a "
              << rt.prompt.size() << "-token prompt\n\n";

    for (int token : rt.prompt) kvs::emit_token(token);
    kvs::Sampler sampler = rt.new_sampler();
    const kvs::Stopwatch total;
    // common/generate.cpp, generate_naive: for every new token, forward(whole sequence, pos 0, no cache).
    const kvs::Generation g = kvs::generate_naive(rt.model, sampler, rt.prompt, options.max_new_tokens, kvs::emit_token);
    const double total_ms = total.milliseconds();
    const std::vector<double>& step_ms = g.step_ms;
    for (std::size_t step = 0; step < step_ms.size(); ++step) csv.row(step, rt.prompt.size() + step, step_ms[step]);
    std::cerr << "\n";
    print_report(step_ms, static_cast<int>(rt.prompt.size()), total_ms);
    csv.commit();
    if (csv.enabled()) std::cerr << "wrote " << csv.path() << "\n";
    return 0;
  });
}
