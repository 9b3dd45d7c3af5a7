// Chapter 08 — many sequences at once: a paged KV cache, batched decoding and continuous batching.
//
// Requests (a trace file, or drawn from the held-out text) are served by a scheduler (scheduler.h) that runs
// one batched forward pass a step over every running sequence, each reading and writing its own blocks of
// one shared pool (paged_kv_cache.h). --experiment picks what to measure (experiments.h).
#include <cstdio>
#include <iostream>
#include <string>

#include "backends.h"
#include "cli.h"
#include "experiments.h"
#include "runtime.h"

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  std::string experiment = "serve", trace_file, batching = "continuous", kv_format = "fp32", prompt_lengths = "16,256",
              output_lengths = "16,128", batch_sizes = "1,2,4,8,16,32,64", block_sizes = "1,4,16,64,256",
              token_counts = "1,2,4,8,16,32,64,128,256";
  kvs::ch08::TraceShape shape;
  float mean_gap = 0;
  std::uint64_t seed = 1;
  int block_size = 16, max_batch = 64, token_budget = 256, int4_group = 32, watermark = 0, rounds = 3;
  kvs::ch08::PoolFormat pool_format;
  std::int64_t kv_memory = std::int64_t{32} << 20;
  kvs::ArgParser parser(
      "08_paged_batching",
      "Chapter 08: many sequences at once. A scheduler serves a queue of requests with continuous batching:\n"
      "every step is one forward pass over all running sequences (one token each, or a chunk of a prompt),\n"
      "each with its own blocks of one shared, paged KV cache; requests join as blocks allow and leave when\n"
      "done, and a sequence is preempted (its blocks freed, recomputed later) when the pool runs short.\n"
      "--experiment: serve (default: serve the trace, then check every output against the request served\n"
      "alone), throughput (decode step time and tokens/s per batch size, against the roofline), memory\n"
      "(reserved vs live K/V per block size, and a max-length reservation), batching (continuous vs static),\n"
      "preemption (a small pool: outputs unchanged, tokens recomputed; watermarks 0-8), break (a block freed twice),\n"
      "products (the CPU backend's few-token product against Eigen's GEMM, per token count: which is faster here).\n"
      "Requests: --trace FILE, " + std::string(kvs::ch08::kTraceFormat) + ";\n"
      "or --requests N drawn from data/kjv/valid.txt (prompt and output lengths uniform in the given ranges,\n"
      "arrival gaps exponential with mean --mean-gap steps, all fixed by --seed). Text goes to stdout, tables\n"
      "and progress to stderr, one CSV per experiment with --csv (columns named in its header).");
  kvs::add_common_flags(parser, options, "", kvs::CommonFlags::kModelOnly);
  parser.add_string("--experiment", "NAME", "serve, throughput, memory, batching, preemption, break or products (default serve)", &experiment);
  parser.add_string("--trace", "PATH", "read the requests from this file (format above)", &trace_file);
  parser.add_int("--requests", "requests to draw from the held-out text (default 32)", &shape.count, 1, 100000);
  parser.add_string("--prompt-lengths", "MIN,MAX", "prompt tokens of a drawn request (default 16,256; throughput: every prompt MIN)", &prompt_lengths);
  parser.add_string("--output-lengths", "MIN,MAX", "new tokens of a drawn request (default 16,128; throughput: every request MAX)", &output_lengths);
  parser.add_float("--mean-gap", "mean steps between two drawn requests' arrivals (default 0: all at once)", &mean_gap, 0, 1e6f);
  parser.add_u64("--seed", "seed of the drawn requests (default 1)", &seed);
  parser.add_int("--block-size", "positions per block of the cache (default 16)", &block_size, 1, 1 << 16);
  parser.add_bytes("--kv-memory", "memory of the block pool, e.g. 64MiB (default 32MiB)", &kv_memory);
  parser.add_string("--kv-format", "NAME", "how the pool stores K/V: fp32 (default), fp16, bf16, int8 or int4 (chapter 10)",
                    &kv_format);
  parser.add_int("--group", "int4: channels per scale and minimum (default 32), as chapter 10's --group", &int4_group, 2, 1 << 16);
  parser.add_string("--batching", "KIND", "continuous (default) or static", &batching);
  parser.add_int("--max-batch", "sequences in one step (default 64)", &max_batch, 1, 4096);
  parser.add_int("--token-budget", "tokens in one step, decode tokens and prompt chunks (default 256, or the model's context if shorter)", &token_budget, 1, 1 << 16);
  parser.add_int("--watermark", "blocks an admission leaves free while sequences run (default 0)", &watermark, 0, 1 << 30);
  parser.add_string("--batch-sizes", "LIST", "throughput: batch sizes (default 1,2,4,8,16,32,64)", &batch_sizes);
  parser.add_int("--rounds", "throughput: measurements of every batch size, the sizes in turn; batching: runs of each\n"
                 "kind, the kinds in turn, after one untimed; products: measurements of every token count and path;\n"
                 "the table shows the median (default 3)", &rounds, 1, 1000);
  parser.add_string("--synthetic", "DIM,LAYERS,HEADS,KV_HEADS",
                    "throughput and products: instead of the shipped model, random weights of this shape (as\n"
                    "03_benchmark's, e.g. 1024,8,8,2: 0.4 GB), a model too large for the caches, where batching pays\n"
                    "(throughput: give --kv-memory for its batch; products times layer 0 alone: LAYERS 1 will do)",
                    &options.synthetic);
  parser.add_string("--tokens", "LIST", "products: tokens a product takes (default 1,2,4,8,16,32,64,128,256)", &token_counts);
  parser.add_string("--block-sizes", "LIST", "memory: block sizes besides the max-length reservation (default 1,4,16,64,256)",
                    &block_sizes);
  parser.add_check([&] {
    for (const char* name : {"serve", "throughput", "memory", "batching", "preemption", "break", "products"})
      if (experiment == name) return std::string();
    return "--experiment " + experiment + " is not one of serve, throughput, memory, batching, preemption, break, products";
  });
  // The batching experiment's table is timings (the others count blocks, tokens, preemptions). Throughput's is too,
  // but through the harness it is the one way to run its GPU path (the device's copy bandwidth as the floor)
  // without a GPU, which a test does: it runs, and says that its times mean nothing.
  parser.add_check([&] {
    return experiment == "batching" ? kvs::timed_run_refuses_harness(options.backend, "--experiment batching") : std::string();
  });
  parser.add_check([&] {
    if (experiment != "products" || options.backend == "cpu") return std::string();
    return "--experiment products times the CPU backend's two product paths, not --backend " + options.backend +
           "'s: drop --backend";
  });
  // The products experiment times layer 0's products: no requests, no pool, no steps.
  parser.add_check([&] {
    if (experiment != "products") return std::string();
    for (const char* flag : {"--trace", "--requests", "--prompt-lengths", "--output-lengths", "--seed", "--kv-memory",
                             "--kv-format", "--group", "--token-budget"})
      if (parser.given(flag))
        return std::string(flag) + " is not read by --experiment products (one layer's products: no requests, no pool): "
                                   "drop it";
    return std::string();
  });
  parser.add_check([&] {
    if (options.synthetic.empty() || experiment == "throughput" || experiment == "products") return std::string();
    return "--synthetic: random weights write gibberish, which only --experiment throughput or products (timings) can "
           "use, not " + experiment;
  });
  parser.add_check([&] {
    if (kvs::parse_kv_format(kv_format, pool_format.format)) return std::string();
    return "--kv-format " + kv_format + " is not one of fp32, fp16, bf16, int8, int4";
  });
  parser.add_check([&] {
    if (experiment != "preemption" || !parser.given("--watermark")) return std::string();
    return std::string("--experiment preemption runs watermarks 0, 1, 2, 4 and 8 itself: drop --watermark");
  });
  parser.add_check([&] {
    if (batching == "continuous" || batching == "static") return std::string();
    return "--batching " + batching + " is not continuous or static";
  });
  parser.add_check([&] {
    if (max_batch <= token_budget || experiment == "throughput" || experiment == "memory" || experiment == "products")
      return std::string();
    return "--max-batch " + std::to_string(max_batch) + " exceeds --token-budget " + std::to_string(token_budget) +
           ": every sequence of a step brings at least one token";
  });
  parser.add_check([&] {
    if (kv_format == "int4" || !parser.given("--group")) return std::string();
    return "--group is for --kv-format int4, not " + kv_format + ": drop it";
  });
  // What each experiment reads (experiments.cpp): throughput runs its own batches (every sequence decoding, all
  // at once, continuous), memory sweeps --block-sizes with a step as wide as the token budget, batching runs
  // both kinds, preemption its own watermarks (refused above, by name).
  parser.add_read_only_by("--experiment", &experiment,
                          {{"--batch-sizes", {"throughput"}},
                           {"--tokens", {"products"}},
                           {"--rounds", {"throughput", "batching", "products"}},
                           {"--block-sizes", {"memory"}},
                           {"--block-size", {"serve", "throughput", "batching", "preemption", "break"}},
                           {"--mean-gap", {"serve", "memory", "batching", "preemption", "break"}},
                           {"--batching", {"serve", "memory", "preemption", "break"}},
                           {"--max-batch", {"serve", "batching", "preemption", "break"}},
                           {"--watermark", {"serve", "memory", "batching", "break"}}});
  parser.add_check([&] {
    if (trace_file.empty() || !(parser.given("--requests") || parser.given("--prompt-lengths") ||
                                parser.given("--output-lengths") || parser.given("--mean-gap") || parser.given("--seed")))
      return std::string();
    return std::string("--trace gives the requests; --requests, --prompt-lengths, --output-lengths, --mean-gap and --seed "
                       "draw them instead: give one or the other");
  });
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    const auto prompts = kvs::parse_int_list("--prompt-lengths", prompt_lengths, 1, 1 << 20);
    const auto outputs = kvs::parse_int_list("--output-lengths", output_lengths, 1, 1 << 20);
    if (prompts.size() != 2 || prompts[0] > prompts[1] || outputs.size() != 2 || outputs[0] > outputs[1])
      throw kvs::UsageError("--prompt-lengths and --output-lengths take MIN,MAX with MIN <= MAX");
    shape.prompt_min = prompts[0], shape.prompt_max = prompts[1], shape.output_min = outputs[0], shape.output_max = outputs[1];
    shape.mean_gap = mean_gap, shape.seed = seed;
    const std::vector<int> batch_list = kvs::parse_int_list("--batch-sizes", batch_sizes, 1, 4096);
    const std::vector<int> block_list = kvs::parse_int_list("--block-sizes", block_sizes, 1, 1 << 16);
    const std::vector<int> token_list = kvs::parse_int_list("--tokens", token_counts, 1, 4096);
    if (experiment == "throughput") {  // its batches are --batch-sizes (--max-batch is refused there)
      const int largest_batch = std::ranges::max(batch_list);
      if (largest_batch > token_budget)
        throw kvs::UsageError("--batch-sizes up to " + std::to_string(largest_batch) + " exceed --token-budget " +
                              std::to_string(token_budget) + ": raise the budget");
      if (batch_list.front() != 1)
        throw kvs::UsageError("--batch-sizes " + batch_sizes + ": start the list with 1, the batch every other is "
                              "compared with (the table's 'vs B=1')");
    }

    // The model's calls carry up to token_budget tokens; a sequence's attention reads up to the whole context -
    // but a synthetic model's context is 65,536 positions, and its throughput runs read prompt + new tokens at
    // most: attention's scratch is sized for that. (The default prompt "x" is unused: requests bring their own.)
    const bool synthetic = !options.synthetic.empty();
    kvs::Runtime rt(options, "x", kvs::PromptFit::kCutByCaller, token_budget, synthetic ? prompts[0] + outputs[1] : -1);
    const kvs::ModelConfig& c = rt.model.config();
    if (experiment != "products")  // (which takes no --token-budget)
      token_budget = kvs::ch08::step_token_budget(token_budget, parser.given("--token-budget"), c.seq_len);
    if (const std::string why = kvs::kv_format_shape_error(pool_format.format, c.head_dim(), int4_group); !why.empty())
      throw kvs::UsageError("--group " + std::to_string(int4_group) + ": " + why);
    pool_format.int4_group = int4_group;  // before the plan below sizes blocks of this format
    // The pool, and the cache a request served alone uses for the check (chapter 03's, or a one-sequence pool); the
    // throughput experiment checks nothing against a request alone.
    // (The products experiment makes no cache.)
    if (experiment != "products")
      rt.plan_kv_cache(kv_memory + (experiment == "throughput" ? 0
                                    : kvs::ch08::BlockPool::block_bytes(c, kvs::blocks_needed(c.seq_len, block_size) * block_size,
                                                                        pool_format)));
    std::vector<kvs::ch08::Request> requests;  // none for the products experiment, which serves nothing
    if (experiment != "products" && !trace_file.empty()) {
      requests = kvs::ch08::parse_trace(kvs::read_input_file("--trace", trace_file, std::size_t{64} << 20), trace_file);
    } else if (experiment != "products") {
      const std::string text = kvs::read_input_file("the held-out text", kvs::find_data_file("kjv/valid.txt"), std::size_t{64} << 20);
      requests = kvs::ch08::generate_trace(text, shape);
    }
    kvs::ch08::Setup setup{.rt = rt, .requests = requests, .shape = shape, .block_size = block_size, .kv_memory = kv_memory,
                           .format = pool_format,
                           .options = {.batching = batching == "static" ? kvs::ch08::Batching::kStatic
                                                                        : kvs::ch08::Batching::kContinuous,
                                       .max_batch = max_batch, .token_budget = token_budget,
                                       .watermark_blocks = watermark},
                           .batch_sizes = batch_list, .block_sizes = block_list, .token_counts = token_list,
                           .rounds = rounds, .csv = options.csv};
    try {
      if (experiment != "products") kvs::ch08::check_pools(setup, experiment);
      if (experiment == "throughput") rt.plan_other(kvs::ch08::throughput_probe_bytes(setup), "roofline probes");
      if (experiment == "products") rt.plan_other(kvs::ch08::products_bytes(setup), "the products' inputs and outputs");
      std::cerr << rt.describe() << "\n";
      if (experiment == "throughput" && options.backend == "cuda-harness")
        std::cerr << "(the CUDA kernels on the CPU, one fiber per GPU thread: this run checks the GPU path; its timings "
                     "are neither GPU nor CPU numbers)\n";
      if (experiment == "throughput") return kvs::ch08::throughput(setup);
      if (experiment == "memory") return kvs::ch08::memory_waste(setup);
      if (experiment == "batching") return kvs::ch08::batching(setup);
      if (experiment == "preemption") return kvs::ch08::preemption(setup);
      if (experiment == "break") return kvs::ch08::break_double_free(setup);
      if (experiment == "products") return kvs::ch08::products(setup);
      return kvs::ch08::serve_trace(setup);
    } catch (const std::invalid_argument& e) {  // a request that can never fit: the command line's to fix
      throw kvs::UsageError(e.what());
    }
  });
}
