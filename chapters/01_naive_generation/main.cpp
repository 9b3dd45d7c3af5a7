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

// Per-step times for about a dozen steps spread over the run, so the growth is visible at a glance.
void print_report(const std::vector<double>& step_ms, int prompt_tokens, double total_ms) {
  const int steps = static_cast<int>(step_ms.size());
  if (steps == 0) return;
  std::fprintf(stderr, "%8s %10s %12s\n", "step", "context", "ms/token");
  const int stride = std::max(1, steps / 10);
  for (int s = 0; s < steps; s += stride)
    std::fprintf(stderr, "%8d %10d %12.3f\n", s, prompt_tokens + s, step_ms[s]);
  if ((steps - 1) % stride != 0)
    std::fprintf(stderr, "%8d %10d %12.3f\n", steps - 1, prompt_tokens + steps - 1, step_ms.back());
  std::fprintf(stderr, "\n%d tokens in %.1f ms: %.1f tokens/s\n", steps, total_ms, steps / (total_ms / 1000.0));
  if (steps > 2)  // step 0 also pays for first-touch warm-up, so compare against step 1
    std::fprintf(stderr, "time per token grew %.1fx from context %d to context %d\n", step_ms.back() / step_ms[1],
                 prompt_tokens + 1, prompt_tokens + steps - 1);
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
