// Chapter 02 — dynamic KV cache: keep every position's keys and values, growing the cache as the
// sequence grows, and compare three growth policies (growing_kv_cache.h) against each other and against
// chapter 01's naive recompute.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>

#include "cli.h"
#include "generate.h"
#include "growing_kv_cache.h"
#include "runtime.h"

namespace {

constexpr const char* kDefaultPrompt = "And God said, ";

double mib(std::int64_t bytes) { return bytes / (1024.0 * 1024.0); }

// A time per decode step for the table, "-" when the run had no decode step (one new token is the
// prompt's forward pass alone): a 0.0000 there would read as a measurement.
std::string step_ms(const kvs::Generation& g, double ms) {
  if (g.step_ms.size() < 2) return "-";
  char cell[32];
  std::snprintf(cell, sizeof cell, "%.4f", ms);
  return cell;
}

// Page faults so far: the kernel handing the process a fresh page the first time it is touched. Every
// buffer the allocator gets from the kernel (large ones are mapped anew) costs one per 4 KiB page written.
long page_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt + usage.ru_majflt;
}

}  // namespace

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  bool skip_naive = false;
  kvs::ArgParser parser("02_dynamic_cache",
                        "Chapter 02: a KV cache that grows. The prompt is prefilled once, then every new token is\n"
                        "one position whose attention reads all earlier keys and values from the cache. Three growth\n"
                        "policies run one after the other: 'concatenate' (a new buffer one position longer and a\n"
                        "full copy on every step, like torch.cat), 'chunked' (grow to need+1024 rounded up to\n"
                        "1024, like nanochat) and 'geometric' (double, like std::vector). The first policy's text\n"
                        "streams to stdout; per-policy allocations, bytes copied, page faults, peak cache bytes\n"
                        "and timings go to stderr, with a check against naive generation.\n"
                        "CSV columns (--csv): policy, allocations, bytes_copied, page_faults, peak_cache_bytes,\n"
                        "prefill_ms, decode_ms_median, tokens_per_s, decode_ms_p99, total_ms (prefill + decode).");
  kvs::add_common_flags(parser, options, '"' + std::string(kDefaultPrompt) + '"');
  parser.add_switch("--skip-naive", "do not run chapter 01's naive generation to compare the tokens", &skip_naive);
  parser.add_check([&] {  // with none, no policy allocates, copies or times anything: a table of zeros
    if (options.max_new_tokens >= 1) return std::string();
    return std::string("--max-new-tokens: at least 1 (the policies grow as tokens are generated)");
  });
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    using kvs::ch02::Growth;
    kvs::Runtime rt(options, kDefaultPrompt);
    // One policy's cache at a time; the plan is the largest peak of the three.
    const int prompt_tokens = static_cast<int>(rt.prompt.size()), total = prompt_tokens + options.max_new_tokens;
    std::int64_t peak = 0;
    for (Growth growth : {Growth::kConcatenate, Growth::kChunked, Growth::kGeometric})
      peak = std::max(peak, kvs::ch02::peak_positions(growth, prompt_tokens, total));
    rt.plan_kv_cache(kvs::kv_cache_bytes(rt.model.config(), peak));
    kvs::CsvWriter csv({"--csv", options.csv},
                       "policy,allocations,bytes_copied,page_faults,peak_cache_bytes,prefill_ms,decode_ms_median,tokens_per_s,"
                       "decode_ms_p99,total_ms",
                       rt.inputs());
    std::cerr << rt.describe() << "\n" << options.max_new_tokens << " new tokens after a " << rt.prompt.size()
              << "-token prompt\n";

    // Warm-up without a cache, so the first timed run does not pay for touching the model's buffers.
    rt.model.forward(rt.prompt, 0);
    kvs::Generation naive;
    if (!skip_naive) {
      std::cerr << "naive generation (chapter 01) for reference...\n";
      kvs::Sampler sampler = rt.new_sampler();
      naive = kvs::generate_naive(rt.model, sampler, rt.prompt, options.max_new_tokens);
    }

    std::string table;  // printed once every run is done, after the streamed text
    char line[256];
    std::vector<int> reference = naive.tokens;  // with --skip-naive, the first policy's tokens instead
    for (Growth growth : {Growth::kConcatenate, Growth::kChunked, Growth::kGeometric}) {
      kvs::ch02::GrowingKvCache cache(rt.backend, rt.model.config(), growth);
      kvs::Sampler sampler = rt.new_sampler();
      const bool stream = growth == Growth::kConcatenate;
      if (stream) for (int token : rt.prompt) kvs::emit_token(token);
      const long faults_before = page_faults();
      const kvs::Generation g = kvs::generate_cached(rt.model, cache, sampler, rt.prompt, options.max_new_tokens, 0,
                                                     stream ? kvs::OnToken(kvs::emit_token) : kvs::OnToken());
      const long faults = page_faults() - faults_before;
      if (stream) {
        std::fflush(stdout);
        std::cerr << "\n";
      }
      const char* same = reference.empty()        ? "(reference)"
                         : g.tokens != reference ? "DIFFERENT"
                         : skip_naive            ? "= concat"
                                                 : "= naive";
      if (reference.empty()) reference = g.tokens;
      std::snprintf(line, sizeof line, "%-12s %11lld %10.2f MiB %11ld %9.3f MiB %11.2f %8s %8s %9.1f %12s\n",
                   kvs::ch02::growth_name(growth), static_cast<long long>(cache.allocations()), mib(cache.bytes_copied()),
                   faults, mib(cache.peak_bytes()), g.ttft_ms(), step_ms(g, g.decode_median_ms()).c_str(),
                   step_ms(g, g.decode_percentile_ms(99)).c_str(),
                   g.total_ms(), same);
      table += line;
      csv.row(kvs::ch02::growth_name(growth), cache.allocations(), cache.bytes_copied(), faults, cache.peak_bytes(),
              g.ttft_ms(), g.decode_median_ms(), g.decode_tokens_per_s(), g.decode_percentile_ms(99), g.total_ms());
    }
    std::fprintf(stderr, "\n%-12s %11s %14s %11s %13s %11s %8s %8s %9s %12s\n%s", "policy", "allocations",
                 "bytes copied", "page faults", "peak cache", "prefill ms", "p50 ms", "p99 ms", "total ms", "same tokens",
                 table.c_str());
    if (!skip_naive && options.max_new_tokens > 1)
      std::fprintf(stderr, "%-12s %11s %14s %11s %13s %11.2f %8.4f %8.4f %9.1f\n", "(naive)", "-", "-", "-", "-",
                   naive.ttft_ms(), naive.decode_median_ms(), naive.decode_percentile_ms(99), naive.total_ms());
    std::cerr << "\nprefill = time to first token (the whole prompt in one forward pass); p50, p99 = percentiles of "
                 "the time per token over the following steps; total = prefill + every step\n";
    csv.commit();
    if (csv.enabled()) std::cerr << "wrote " << csv.path() << "\n";
    return 0;
  });
}
