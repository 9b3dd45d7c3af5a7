// Chapter 03 — preallocated KV cache, prefill/decode, and what the cache costs in memory.
//
// One buffer for all layers, allocated once for the longest sequence of the run (preallocated_kv_cache.h).
// The prompt is prefilled in one batched forward pass (matrix-matrix products), or in chunks of
// --prefill-chunk positions; then each new token is one position (matrix-vector products) whose
// attention reads the cache. The decode loop allocates nothing: the binary counts heap allocations.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "cli.h"
#include "equivalence.h"
#include "generate.h"
#include "malloc_counter.h"
#include "memory_report.h"
#include "preallocated_kv_cache.h"
#include "runtime.h"

namespace {

constexpr const char* kDefaultPrompt = "And God said, ";

}  // namespace

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  int max_context = 0, prefill_chunk = 0;
  std::int64_t budget = std::int64_t{24} << 30;  // a 24 GB GPU
  kvs::ArgParser parser(
      "03_preallocated_cache",
      "Chapter 03: a preallocated KV cache. One buffer for all layers is allocated once; the prompt is\n"
      "prefilled in one forward pass (or in chunks), then tokens are decoded one position at a time with\n"
      "no allocation. The text streams to stdout; timings, heap allocations during decode, the cache's\n"
      "analytic and allocated bytes, peak RSS growth, per-token KV bytes of well-known models and the\n"
      "context wall for --memory-budget go to stderr.\n"
      "CSV columns (--csv): prompt_tokens, new_tokens, prefill_chunk, prefill_ms, decode_ms_median,\n"
      "tokens_per_s, cache_positions, analytic_bytes, allocated_bytes, resident_bytes, peak_rss_growth_bytes,\n"
      "decode_ms_p99, total_ms (prefill + decode).");
  kvs::add_common_flags(parser, options, '"' + std::string(kDefaultPrompt) + '"');
  parser.add_int("--max-context", "positions to allocate the cache for (default: prompt + new tokens)", &max_context, 1,
                 1 << 21);
  parser.add_int("--prefill-chunk", "prefill the prompt in chunks of N positions (default 0: all at once)",
                 &prefill_chunk, 0, 1 << 21);
  parser.add_bytes("--memory-budget", "memory (weights + KV cache) for the context-wall table, e.g. 80GiB (default 24GiB)", &budget);
  parser.add_check([&] {  // with none there is no prefill either: the CSV would hold a row of zeros as timings
    if (options.max_new_tokens >= 1) return std::string();
    return std::string("--max-new-tokens: at least 1 (the prefill makes the first new token)");
  });
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    // --max-context against the model's context first (the checkpoint's header), before attention is sized for it: 2^21
    // rows of scores were refused for memory, or allocated, before the value was.
    if (const int context = kvs::Checkpoint(kvs::resolve_model_path(options)).config().seq_len; max_context > context)
      throw kvs::UsageError("--max-context " + std::to_string(max_context) + " exceeds the model's context of " +
                            std::to_string(context) + " positions");
    // The model's calls are the prompt's (or its chunks) and single tokens: its buffers are for the prompt plus the
    // new tokens (0), and attention's for a view of --max-context rows. (Sized for --max-context positions, a
    // 14-token prompt in a cache of 2,048 planned 17.3 MiB of buffers for calls of 2,048 tokens it never makes.)
    kvs::Runtime rt(options, kDefaultPrompt, kvs::PromptFit::kMustFit, 0, max_context);
    const kvs::ModelConfig& c = rt.model.config();
    const int needed = static_cast<int>(rt.prompt.size()) + options.max_new_tokens;
    if (max_context == 0) max_context = needed;
    if (max_context < needed)
      throw kvs::UsageError("--max-context " + std::to_string(max_context) + " is shorter than the prompt plus "
                            "--max-new-tokens (" + std::to_string(needed) + " positions)");
    // The cache, and with --prefill-chunk a second one holding the prompt, to check against one-shot prefill.
    rt.plan_kv_cache(kvs::kv_cache_bytes(c, max_context) +
                     (prefill_chunk > 0 ? kvs::kv_cache_bytes(c, rt.prompt.size()) : 0));
    kvs::CsvWriter csv({"--csv", options.csv},
                       "prompt_tokens,new_tokens,prefill_chunk,prefill_ms,decode_ms_median,tokens_per_s,"
                       "cache_positions,analytic_bytes,allocated_bytes,resident_bytes,peak_rss_growth_bytes,decode_ms_p99,total_ms",
                       rt.inputs());
    std::cerr << rt.describe() << "\n" << options.max_new_tokens << " new tokens after a " << rt.prompt.size()
              << "-token prompt, prefill " << (prefill_chunk ? "in chunks of " + std::to_string(prefill_chunk) : "in one pass")
              << "\n\n";

    // Warm-up without a cache: the model's own working buffers get written once, so that the RSS growth
    // measured below is the cache's.
    rt.model.forward(rt.prompt, 0);
    const std::int64_t rss_before = kvs::peak_resident_bytes();
    kvs::ch03::PreallocatedKvCache cache(rt.backend, c, max_context);  // the only allocation of the cache
    kvs::Sampler sampler = rt.new_sampler();
    long allocations_at_first_token = 0;
    std::vector<float> first_logits(c.vocab_size);
    for (int token : rt.prompt) kvs::emit_token(token);
    const kvs::Generation g = kvs::generate_cached(
        rt.model, cache, sampler, rt.prompt, options.max_new_tokens, prefill_chunk, kvs::emit_token,
        [&](int step, std::span<const float> logits) {
          if (step == 0) {
            std::copy(logits.begin(), logits.end(), first_logits.begin());
            allocations_at_first_token = kvs::heap_allocations();
          }
        });
    const long decode_allocations = kvs::heap_allocations() - allocations_at_first_token;
    const std::int64_t rss_growth = kvs::peak_resident_bytes() - rss_before;
    std::fflush(stdout);

    std::fprintf(stderr, "\n\nprefill (time to first token): %.2f ms for %zu positions\n", g.ttft_ms(), rt.prompt.size());
    // Loading the model allocates, so a counter that saw nothing before the first token is not counting (a
    // build whose malloc the counter does not replace): then its 0 during decode would prove nothing.
    const std::string counted = allocations_at_first_token > 0 ? std::to_string(decode_allocations)
                                                               : "not counted (this build's malloc is not the counter's)";
    if (options.max_new_tokens > 1)
      std::fprintf(stderr, "decode: p50 %.4f ms, p99 %.4f ms per token (%.0f tokens/s at the p50); heap allocations "
                           "during the %d decode steps: %s\n", g.decode_median_ms(), g.decode_percentile_ms(99),
                   g.decode_tokens_per_s(), options.max_new_tokens - 1, counted.c_str());
    std::fprintf(stderr, "the whole generation (prefill + decode): %.1f ms\n", g.total_ms());

    if (prefill_chunk > 0) {
      // Chunked prefill must give the logits of one-shot prefill: compare on a fresh cache.
      kvs::ch03::PreallocatedKvCache reference(rt.backend, c, static_cast<int>(rt.prompt.size()));
      const auto one_shot = rt.model.forward(rt.prompt, 0, &reference);
      const float worst = kvs::max_abs_difference(one_shot, first_logits);
      std::fprintf(stderr, "chunked prefill (C = %d) vs one-shot prefill: largest logit difference %.2e\n",
                   prefill_chunk, worst);
    }

    const std::int64_t analytic = kvs::kv_cache_bytes(c, max_context);
    std::fprintf(stderr, "\nKV cache memory\n");
    std::fprintf(stderr, "  2 * layers * batch * kv_heads * head_dim * positions * bytes\n");
    std::fprintf(stderr, "  = 2 * %d * 1 * %d * %d * %d * 4 = %lld bytes (%s)\n", c.n_layers, c.n_kv_heads,
                 c.head_dim(), max_context, static_cast<long long>(analytic), kvs::format_bytes(analytic).c_str());
    std::fprintf(stderr, "  allocated by the cache: %lld bytes (%s the formula)\n",
                 static_cast<long long>(cache.allocated_bytes()), cache.allocated_bytes() == analytic ? "equal to" : "NOT equal to");
    const std::int64_t resident = cache.resident_bytes();
    if (resident >= 0)
      std::fprintf(stderr, "  resident in memory (pages written, measured with mincore): %lld bytes (%s)\n",
                   static_cast<long long>(resident), kvs::format_bytes(double(resident)).c_str());
    else
      std::fprintf(stderr, "  resident in memory: not measured (the cache is in GPU memory)\n");
    std::fprintf(stderr, "  peak RSS growth during the run: %s (pages are only backed when first written)\n",
                 kvs::format_bytes(std::max<std::int64_t>(0, rss_growth)).c_str());
    kvs::ch03::print_memory_comparison(c, budget);
    csv.row(rt.prompt.size(), options.max_new_tokens, prefill_chunk, g.ttft_ms(), g.decode_median_ms(),
            g.decode_tokens_per_s(), max_context, analytic, cache.allocated_bytes(), resident, rss_growth,
            g.decode_percentile_ms(99), g.total_ms());
    csv.commit();
    if (csv.enabled()) std::cerr << "wrote " << csv.path() << "\n";
    return 0;
  });
}
