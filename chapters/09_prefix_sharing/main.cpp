// Chapter 09 — requests that share a prefix share its cache: prefix caching, copy-on-write, parallel sampling.
//
// Chapter 08's scheduler and pool, with the blocks counted and remembered (prefix_cache.h): a request whose
// tokens begin like an earlier one's starts with that one's blocks and skips their prefill; N samples of one
// prompt hold its blocks once (parallel_sampling.h). --experiment picks what to measure (experiments.h).
#include <cstdio>
#include <iostream>
#include <string>

#include "08_paged_batching/scheduler.h"
#include "cli.h"
#include "experiments.h"
#include "runtime.h"

namespace {
constexpr const char* kDefaultPrompt =
    "And it came to pass, when the king heard the words of the book of the law, that he rent his clothes. ";
}

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  options.max_new_tokens = 48;
  options.temperature = 0.8f;  // the samples of one prompt differ only if they are drawn
  std::string experiment = "samples", counts = "1,2,4,8,16,32,64";
  int samples = 4, block_size = 16, prefix_length = 1024, question_length = 32, token_budget = 256, requests = 64;
  std::uint64_t trace_seed = 1;
  std::int64_t kv_memory = std::int64_t{4} << 20;
  kvs::ArgParser parser(
      "09_prefix_sharing",
      "Chapter 09: requests that share a prefix share its cache. Chapter 08's paged pool with reference counts:\n"
      "a finished request's full blocks stay cached (evicted least recently used first) and a later request whose\n"
      "tokens match them - compared token by token - starts with them and skips their prefill; a sequence about\n"
      "to write into a block another holds gets its own copy first (copy-on-write).\n"
      "--experiment: samples (default: --samples N continuations of the prompt, drawn with --temperature, sample i\n"
      "seeded --seed + i; the prompt's blocks shared; checked against each sample alone), prefix (N requests with\n"
      "one long document: KV held, prefill, time to first token, hit rate, with and without sharing), sampling\n"
      "(memory of N samples shared vs not, blocks copied on write), mixed (shared and unshared prompts under a\n"
      "small pool, against chapter 08), break (copy-on-write off: siblings overwrite the block they share).\n"
      "Text goes to stdout, tables and progress to stderr, one CSV per experiment with --csv.");
  kvs::add_common_flags(parser, options, '"' + std::string(kDefaultPrompt) + '"');
  parser.add_string("--experiment", "NAME", "samples, prefix, sampling, mixed or break (default samples)", &experiment);
  parser.add_int("--samples", "continuations of the prompt (samples, break; default 4)", &samples, 1, 256);
  parser.add_int("--block-size", "positions per block of the cache (default 16)", &block_size, 1, 1 << 16);
  parser.add_string("--counts", "LIST", "prefix, sampling: values of N (default 1,2,4,8,16,32,64)", &counts);
  parser.add_int("--prefix-length", "prefix: bytes of the shared document (default 1024)", &prefix_length, 1, 1 << 20);
  parser.add_int("--question-length", "prefix: bytes of each request's own question (default 32)", &question_length, 1, 1 << 20);
  parser.add_int("--token-budget", "prefix, mixed: tokens in one scheduler step (default 256, or the model's context if shorter)", &token_budget, 1, 1 << 16);
  parser.add_int("--requests", "mixed: requests in the trace (default 64)", &requests, 1, 100000);
  parser.add_u64("--trace-seed", "mixed: seed of the trace (default 1)", &trace_seed);
  parser.add_bytes("--kv-memory", "mixed: memory of the block pool (default 4MiB)", &kv_memory);
  parser.add_check([&] {
    for (const char* name : {"samples", "prefix", "sampling", "mixed", "break"})
      if (experiment == name) return std::string();
    return "--experiment " + experiment + " is not one of samples, prefix, sampling, mixed, break";
  });
  parser.add_check([&] {
    if (experiment != "break" || samples >= 2) return std::string();
    return std::string("--experiment break needs --samples 2 or more: one sample to write, a sibling to read what it wrote");
  });
  parser.add_check([&] {
    if (options.max_new_tokens >= 1) return std::string();
    return std::string("--max-new-tokens must be at least 1: a sample or a request generates something");
  });
  // What each experiment reads (experiments.cpp): prefix and mixed cut their requests from the held-out text and
  // decode greedily (prefix with --max-new-tokens, mixed 16 to 64 tokens each); the others continue the prompt.
  const std::vector<std::string> prompted = {"samples", "sampling", "break"};
  parser.add_read_only_by("--experiment", &experiment,
                          {{"--prompt", prompted},
                           {"--prompt-file", prompted},
                           {"--temperature", prompted},
                           {"--top-k", prompted},
                           {"--seed", prompted},
                           {"--max-new-tokens", {"samples", "prefix", "sampling", "break"}},
                           {"--samples", {"samples", "break"}},
                           {"--counts", {"prefix", "sampling"}},
                           {"--prefix-length", {"prefix"}},
                           {"--question-length", {"prefix"}},
                           {"--requests", {"mixed"}},
                           {"--trace-seed", {"mixed"}},
                           {"--kv-memory", {"mixed"}},
                           {"--token-budget", {"prefix", "mixed"}}});
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    const std::vector<int> count_list = kvs::parse_int_list("--counts", counts, 1, 4096);
    // The most sequences a step carries: the samples, or the largest N of --counts (mixed: its budget's).
    const int largest = experiment == "prefix" || experiment == "sampling" ? std::ranges::max(count_list)
                        : experiment == "mixed"                          ? 1
                                                                         : samples;
    const bool sampling = experiment == "samples" || experiment == "sampling" || experiment == "break";
    if (experiment == "prefix" && largest > token_budget)
      throw kvs::UsageError("--counts up to " + std::to_string(largest) + " exceed --token-budget " +
                            std::to_string(token_budget) + ": every request of a step brings at least one token");
    // A call carries a scheduler step, a decode step of every sample, or a chunk of the prompt; attention reads up
    // to the whole context. The prompt must fit with the new tokens only where it is used.
    kvs::Runtime rt(options, kDefaultPrompt, sampling ? kvs::PromptFit::kMustFit : kvs::PromptFit::kCutByCaller,
                    std::max({token_budget, largest}), -1);
    if (!sampling)  // (the sampling experiments take no --token-budget)
      token_budget = kvs::ch08::step_token_budget(token_budget, parser.given("--token-budget"), rt.model.config().seq_len);
    kvs::ch09::Setup setup{.rt = rt, .text = {}, .samples = samples, .new_tokens = options.max_new_tokens, .block_size = block_size,
                           .prefix_length = prefix_length, .question_length = question_length, .token_budget = token_budget,
                           .counts = count_list, .requests = requests, .kv_memory = kv_memory, .trace_seed = trace_seed,
                           .csv = options.csv};
    if (!sampling) setup.text = kvs::read_input_file("the held-out text", kvs::find_data_file("kjv/valid.txt"), std::size_t{64} << 20);
    if (experiment == "prefix" && prefix_length + question_length + options.max_new_tokens > rt.model.config().seq_len)
      throw kvs::UsageError("--prefix-length " + std::to_string(prefix_length) + " + --question-length " +
                            std::to_string(question_length) + " + --max-new-tokens " + std::to_string(options.max_new_tokens) +
                            " exceed the model's context of " + std::to_string(rt.model.config().seq_len) + " positions");
    if (experiment == "prefix") kvs::ch09::check_prefix(setup);
    if (experiment == "mixed") kvs::ch09::check_mixed(setup);
    rt.plan_kv_cache(kvs::ch09::largest_pool_bytes(setup, experiment));  // pools one at a time: the largest
    std::cerr << rt.describe() << "\n";
    try {
      if (experiment == "prefix") return kvs::ch09::shared_prefix(setup);
      if (experiment == "sampling") return kvs::ch09::sampling_memory(setup);
      if (experiment == "mixed") return kvs::ch09::mixed_trace(setup);
      if (experiment == "break") return kvs::ch09::break_copy_on_write(setup);
      return kvs::ch09::samples(setup);
    } catch (const std::invalid_argument& e) {  // a request that can never fit: the command line's to fix
      throw kvs::UsageError(e.what());
    }
  });
}
