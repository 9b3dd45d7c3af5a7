// Chapters 01-03 measured side by side: for each prompt length, time to first token and median decode
// time per token for naive recompute, both growing caches (chapter 02) and the preallocated cache - and,
// on a backend that can record (CUDA), the preallocated cache with each decode step replayed as one CUDA
// graph launch. Greedy, warm-up excluded, threads stated. A benchmark executable, never a timed test.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <thread>

#include "../02_dynamic_cache/growing_kv_cache.h"
#include "backends.h"
#include "breakdown.h"
#include "context_wall.h"
#include "cli.h"
#include "generate.h"
#include "preallocated_kv_cache.h"
#include "runtime.h"
#include "timing.h"

namespace {

using kvs::ch02::Growth;

struct Row {
  std::string method;
  int prompt_tokens;
  double ttft_ms, decode_ms;
  int decode_steps;
  std::int64_t cache_bytes;
};

// The prompt lengths that run, in order: a length that leaves no room for the new tokens in the context runs
// at context - new tokens, and only once (on a small model the default list would otherwise measure that one
// length again and again); `note` says what was shortened, for the run's header.
std::vector<int> lengths_that_fit(const std::vector<int>& asked, int context, int new_tokens, std::string& note) {
  const int longest_prompt = context - new_tokens;
  if (context < 3)  // a one-token prompt and the 2 new tokens a timed decode step needs
    throw kvs::UsageError("the model's context of " + std::to_string(context) + " position" + (context > 1 ? "s" : "") +
                          " holds no prompt and 2 new tokens (the fewest that time a decode step); use a model with "
                          "a context of at least 3");
  if (longest_prompt < 1)
    throw kvs::UsageError("--max-new-tokens " + std::to_string(new_tokens) + " leaves no room for a prompt in the "
                          "model's context of " + std::to_string(context) + "; give at most " + std::to_string(context - 1));
  std::vector<int> lengths;
  std::string shortened;
  int shortened_count = 0;
  for (int length : asked) {
    if (length > longest_prompt) shortened += (shortened_count++ ? ", " : "") + std::to_string(length);
    const int prompt_len = std::min(length, longest_prompt);
    if (std::find(lengths.begin(), lengths.end(), prompt_len) == lengths.end()) lengths.push_back(prompt_len);
  }
  if (shortened_count > 0)
    note = (shortened_count > 1 ? "lengths " : "length ") + shortened + (shortened_count > 1 ? " leave" : " leaves") +
           " no room for " + std::to_string(new_tokens) + " new tokens in the context of " + std::to_string(context) +
           ": run once at " + std::to_string(longest_prompt) + "\n";
  return lengths;
}

}  // namespace

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  options.max_new_tokens = 64;
  std::string lengths_text = "32,128,512,1024,2048", memory_csv;
  int naive_tokens = 8, repeats = 3;
  bool breakdown = false, context_wall = false;
  kvs::ArgParser parser(
      "03_benchmark",
      "Sweep over prompt lengths: time to first token (TTFT) and median per-token decode time for naive\n"
      "recompute (chapter 01), the concatenate and chunked growing caches (chapter 02) and the preallocated\n"
      "cache (chapter 03), greedy, on the same prompt (the start of the validation text); with --backend cuda also\n"
      "preallocated+graph: the decode step recorded once as a CUDA graph and replayed, one launch per token\n"
      "(chapter 07). Each method runs once untimed first (warm-up), then --repeats times; TTFT and decode times\n"
      "are medians over the runs. A prompt length that leaves no room for the new tokens within the model's\n"
      "context is shortened to context - new tokens (once, however many ask for it). Prints a table with\n"
      "speedups relative to naive.\n"
      "CSV (--csv): method, prompt_tokens, ttft_ms, decode_ms_median, decode_steps, cache_bytes, threads (0 on\n"
      "a GPU).\n"
      "--memory-csv: method, positions, allocated_bytes, resident_bytes, analytic_bytes: at the end of a run,\n"
      "the bytes the cache allocated, those physically in memory (pages written, measured with mincore), and\n"
      "the formula's bytes for `positions`, the prompt plus the new tokens: what a cache is sized for (chapter 03),\n"
      "one more than it holds, since the last new token is never fed (the concatenating cache allocates exactly\n"
      "what it holds: one position's bytes below the formula).\n"
      "--breakdown: instead of the sweep, where a decode step's time goes (preallocated cache): per length, the\n"
      "mean step split into weight matrix products, attention and everything else, the bytes it reads and the\n"
      "rate that makes against this machine's read bandwidth for as many bytes (measured by the benchmark; on a GPU\n"
      "the device's copy bandwidth).\n"
      "  CSV (--csv): prompt_tokens, step_ms_mean, step_ms_p50, step_ms_p99, matmul_ms, attention_ms, other_ms,\n"
      "  weight_bytes, kv_bytes, achieved_gbs, limit_gbs, threads (0 on a GPU), operations (backend operations per\n"
      "  step), graph_ms_p50 (the step replayed as a CUDA graph; 0 where the backend cannot record), prefill_ms,\n"
      "  prefill_gflops (the prompt's forward pass: its GFLOP/s), peak_gflops (a 1024^3 matrix product's GFLOP/s),\n"
      "  graph_launches (the launches the replayed step holds; 0 without a graph).\n"
      "--context-wall: instead of the sweep, the longest KV cache that fits, measured: preallocated caches of\n"
      "1024, 2048, 4096, ... positions, each allocated and its last position written, until the memory refuses\n"
      "one (a GPU's allocator; on the CPU, which backs pages lazily, --memory-limit), then bisection to 0.1%;\n"
      "printed next to the formula's prediction.\n"
      "  CSV (--csv): positions, cache_bytes, result.");
  kvs::add_common_flags(parser, options, "data/kjv/valid.txt, the held-out text", kvs::CommonFlags::kGreedy);
  parser.add_string("--lengths", "LIST", "prompt lengths up to the model's context, comma-separated (default 32,128,512,1024,2048); "
                    "one that leaves no room for --max-new-tokens runs at context - max-new-tokens, and only once",
                    &lengths_text);
  parser.add_int("--naive-tokens", "new tokens for naive generation, which is slow at long contexts (default 8, or\n"
                 "--max-new-tokens where that is fewer); at most --max-new-tokens", &naive_tokens, 2, 1 << 20);
  parser.add_int("--repeats", "timed runs per method and length; medians are reported (default 3)", &repeats, 1, 1000);
  parser.add_string("--memory-csv", "PATH", "write the cache bytes measured at the end of each run", &memory_csv);
  parser.add_string("--synthetic", "DIM,LAYERS,HEADS,KV_HEADS",
                    "instead of the shipped model, random weights of this shape generated in memory (e.g.\n"
                    "2048,16,16,4: 3 GB): gibberish text, real timings and bytes - a model too large for the caches",
                    &options.synthetic);
  parser.add_switch("--breakdown", "where a decode step's time goes, against the read bandwidth (see above)", &breakdown);
  parser.add_switch("--context-wall", "the longest KV cache the memory holds, measured by allocation (see above)",
                    &context_wall);
  parser.add_check([&] {
    for (const char* flag : {"--naive-tokens", "--repeats", "--memory-csv"})
      if ((breakdown || context_wall) && parser.given(flag))
        return std::string(flag) + " is for the sweep, not " + (breakdown ? "--breakdown" : "--context-wall");
    for (const char* flag : {"--breakdown", "--lengths", "--max-new-tokens", "--prompt", "--prompt-file"})
      if (context_wall && parser.given(flag)) return std::string(flag) + " does not apply to --context-wall";
    // Naive generation is the reference whose tokens every cache must reproduce: it never runs further than they do.
    if (parser.given("--naive-tokens") && naive_tokens > options.max_new_tokens)
      return "--naive-tokens " + std::to_string(naive_tokens) + " is more than --max-new-tokens " +
             std::to_string(options.max_new_tokens) + "; give at most " + std::to_string(options.max_new_tokens);
    // The sweep and the breakdown are timings; the context wall counts bytes and allocations, which the harness
    // runs as the CPU does.
    return context_wall ? std::string() : kvs::timed_run_refuses_harness(options.backend, "03_benchmark");
  });
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    const std::vector<int> asked_lengths = kvs::parse_int_list("--lengths", lengths_text, 1, 1 << 30);
    if (options.max_new_tokens < 2) throw kvs::UsageError("--max-new-tokens must be at least 2 to time decoding");
    std::string default_prompt;  // the held-out validation text: real prose the model never trained on
    std::vector<kvs::NamedPath> inputs;
    if (options.prompt.empty() && options.prompt_file.empty()) {
      inputs.push_back({"the validation text", kvs::find_data_file("kjv/valid.txt")});
      default_prompt = kvs::read_input_file(inputs[0].flag, inputs[0].path, 1 << 30);
    }
    // The sweep takes prefixes of the prompt; the longest run is the longest length plus its new tokens.
    const int longest = *std::max_element(asked_lengths.begin(), asked_lengths.end()) + options.max_new_tokens;
    // --context-wall runs no model: its buffers for one token, not the sweep's longest (they are part of the
    // "model" its prediction subtracts from the budget).
    kvs::Runtime rt(options, default_prompt, kvs::PromptFit::kCutByCaller, context_wall ? 1 : longest);
    const kvs::ModelConfig& c = rt.model.config();
    if (const int too_long = *std::max_element(asked_lengths.begin(), asked_lengths.end());
        parser.given("--lengths") && too_long > c.seq_len)
      throw kvs::UsageError("--lengths: " + std::to_string(too_long) + " exceeds the model's context of " +
                            std::to_string(c.seq_len) + " positions; give lengths up to " + std::to_string(c.seq_len));
    if (context_wall) {
      std::cerr << rt.describe() << "\n";
      for (const kvs::NamedPath& input : rt.inputs()) inputs.push_back(input);
      kvs::CsvWriter wall_csv({"--csv", options.csv}, "positions,cache_bytes,result", inputs);
      kvs::ch03::measure_context_wall(rt, wall_csv);
      if (wall_csv.enabled()) std::cerr << "wrote " << wall_csv.path() << "\n";
      return 0;
    }
    std::string shortened;  // printed under the run's header
    const std::vector<int> lengths = lengths_that_fit(asked_lengths, c.seq_len, options.max_new_tokens, shortened);
    if (breakdown) {
      rt.plan_kv_cache(kvs::ch03::breakdown_cache_bytes(c, lengths, options.max_new_tokens));
      rt.plan_other(kvs::ch03::breakdown_other_bytes(c, rt.backend, lengths, options.max_new_tokens),
                    "profiled model and probes");
    } else {
      std::int64_t peak = 0;  // one cache at a time: the largest peak over lengths and policies
      for (int prompt_len : lengths) {
        const int total = prompt_len + options.max_new_tokens;
        for (Growth growth : {Growth::kConcatenate, Growth::kChunked})
          peak = std::max(peak, kvs::ch02::peak_positions(growth, prompt_len, total));
      }
      rt.plan_kv_cache(kvs::kv_cache_bytes(c, peak));
    }
    // Rows are committed as they are measured: an interrupted sweep keeps every finished row.
    for (const kvs::NamedPath& input : rt.inputs()) inputs.push_back(input);
    kvs::CsvWriter csv({"--csv", options.csv},
                       "method,prompt_tokens,ttft_ms,decode_ms_median,decode_steps,cache_bytes,threads", inputs);
    kvs::CsvWriter mem_csv({"--memory-csv", memory_csv},
                           "method,positions,allocated_bytes,resident_bytes,analytic_bytes", csv.taken());

    // Prompts are prefixes of the text, repeated if a length asks for more than it holds.
    std::vector<int> all_tokens = rt.prompt;
    while (static_cast<int>(all_tokens.size()) < c.seq_len) all_tokens.insert(all_tokens.end(), rt.prompt.begin(), rt.prompt.end());

    if (breakdown) {
      std::cerr << rt.describe() << "\n" << shortened;
      kvs::CsvWriter breakdown_csv({"--csv", options.csv},
                                   "prompt_tokens,step_ms_mean,step_ms_p50,step_ms_p99,matmul_ms,attention_ms,other_ms,"
                                   "weight_bytes,kv_bytes,achieved_gbs,limit_gbs,threads,operations,graph_ms_p50,"
                                   "prefill_ms,prefill_gflops,peak_gflops,graph_launches", inputs);
      kvs::ch03::decode_breakdown(rt, all_tokens, lengths, options.max_new_tokens, breakdown_csv);
      if (breakdown_csv.enabled()) std::cerr << "wrote " << breakdown_csv.path() << "\n";
      return 0;
    }
    const int naive_new_tokens = std::min(naive_tokens, options.max_new_tokens);  // the default 8 may be more
    std::cerr << rt.describe() << "\n" << shortened << options.max_new_tokens << " new tokens per cached run, "
              << naive_new_tokens << " per naive run; machine: " << std::thread::hardware_concurrency() << " cores\n\n";

    std::vector<std::string> methods = {"naive", "concatenate", "chunked", "preallocated"};
    const bool graph = rt.backend.can_record();
    if (graph) methods.push_back("preallocated+graph");
    const std::size_t per_length = methods.size();
    std::vector<Row> rows;
    for (int prompt_len : lengths) {
      const std::span<const int> prompt(all_tokens.data(), prompt_len);
      std::vector<int> reference;  // naive's tokens: every cached method must reproduce them
      for (const std::string& method : methods) {
        const int new_tokens = method == "naive" ? naive_new_tokens : options.max_new_tokens;
        std::int64_t cache_bytes = 0, resident_bytes = 0;  // allocated, and physically in memory at the end
        auto run = [&](bool record) {
          kvs::Sampler sampler = rt.new_sampler();
          if (method == "naive") return kvs::generate_naive(rt.model, sampler, prompt, new_tokens);
          if (method.starts_with("preallocated")) {
            kvs::ch03::PreallocatedKvCache cache(rt.backend, c, prompt_len + new_tokens);
            const auto steps = method == "preallocated+graph" ? kvs::DecodeSteps::kRecorded : kvs::DecodeSteps::kForward;
            auto g = kvs::generate_cached(rt.model, cache, sampler, prompt, new_tokens, 0, {}, {}, {}, steps);
            if (record) cache_bytes = cache.allocated_bytes(), resident_bytes = cache.resident_bytes();
            return g;
          }
          kvs::ch02::GrowingKvCache cache(rt.backend, c, method == "concatenate" ? Growth::kConcatenate : Growth::kChunked);
          auto g = kvs::generate_cached(rt.model, cache, sampler, prompt, new_tokens);
          if (record) cache_bytes = cache.capacity_bytes(), resident_bytes = cache.resident_bytes();
          return g;
        };
        run(false);  // warm-up
        std::vector<double> ttfts, decodes;
        kvs::Generation g;
        for (int r = 0; r < repeats; ++r) {
          g = run(r == 0);
          ttfts.push_back(g.ttft_ms());
          decodes.push_back(g.decode_median_ms());
        }
        const double ttft = kvs::median(ttfts), decode = kvs::median(decodes);
        const std::vector<int> generated(g.tokens.begin() + prompt_len, g.tokens.end());
        if (method == "naive") reference = generated;
        const bool same = std::equal(reference.begin(), reference.end(), generated.begin());
        rows.push_back({method, prompt_len, ttft, decode, new_tokens - 1, cache_bytes});
        std::fprintf(stderr, "  prompt %5d  %-12s ttft %9.2f ms  decode %9.4f ms/token%s\n", prompt_len, method.c_str(),
                     ttft, decode, same ? "" : "  (tokens differ from naive!)");
        csv.row(method, prompt_len, ttft, decode, new_tokens - 1, cache_bytes, rt.cpu_threads());
        csv.commit();
        if (method != "naive") {
          mem_csv.row(method, prompt_len + new_tokens, cache_bytes, resident_bytes,
                      kvs::kv_cache_bytes(c, prompt_len + new_tokens));
          mem_csv.commit();
        }
      }
    }

    std::fprintf(stderr, "\ndecode ms/token (speedup vs naive) and time to first token, %s\n",
                 rt.backend.describe().c_str());
    std::fprintf(stderr, "%7s %10s %20s %20s %20s %12s %12s%s\n", "prompt", "naive", "concatenate", "chunked",
                 "preallocated", "prealloc vs", "TTFT ms", graph ? "  preallocated+graph" : "");
    std::fprintf(stderr, "%7s %10s %20s %20s %20s %12s %12s\n", "", "", "", "", "", "concatenate", "(prealloc)");
    for (std::size_t i = 0; i + per_length - 1 < rows.size(); i += per_length) {
      const Row &naive = rows[i], &concat = rows[i + 1], &chunked = rows[i + 2], &pre = rows[i + 3];
      auto cell = [&](const Row& r) {
        char out[32];
        const double speedup = naive.decode_ms / r.decode_ms;  // below 10 with a decimal: a GPU's 0.44 printed "0x"
        std::snprintf(out, sizeof out, speedup < 9.95 ? "%.4f (%.1fx)" : "%.4f (%.0fx)", r.decode_ms, speedup);
        return std::string(out);
      };
      std::fprintf(stderr, "%7d %10.3f %20s %20s %20s %11.2fx %12.2f", naive.prompt_tokens, naive.decode_ms,
                   cell(concat).c_str(), cell(chunked).c_str(), cell(pre).c_str(), concat.decode_ms / pre.decode_ms,
                   pre.ttft_ms);
      if (graph) std::fprintf(stderr, "  %s, %.2fx prealloc", cell(rows[i + 4]).c_str(), pre.decode_ms / rows[i + 4].decode_ms);
      std::fprintf(stderr, "\n");
    }
    if (csv.enabled()) std::cerr << "wrote " << csv.path() << "\n";
    if (!memory_csv.empty()) std::cerr << "wrote " << memory_csv << "\n";
    return 0;
  });
}
