// Chapter 04 — the sliding-window cache: bounded memory, what the model forgets, attention sinks, and
// generating past the trained context.
//
// The cache (sliding_window_kv_cache.h) is a ring of window + chunk - 1 slots allocated once; the query at
// position p sees the `sinks` first positions and the window - sinks most recent ones (kv_cache.h's
// key_visible). --experiment generate (the default) streams a generation and shows that memory stays flat;
// the other experiments measure what the window costs (experiments.h).
#include <algorithm>
#include <cstdio>
#include <iostream>

#include "cli.h"
#include "experiments.h"
#include "generate.h"
#include "runtime.h"
#include "timing.h"

namespace {

constexpr const char* kDefaultPrompt = "And God said, ";
constexpr const char* kExperiments = "generate, perplexity, recall, induction, fluency, stream, memory, samples";

// "full,1024,64" -> {0, 1024, 64}; 0 stands for no window.
std::vector<int> parse_windows(const std::string& text, int seq_len) {
  std::vector<int> windows;
  for (const std::string& item : kvs::split_commas(text)) {  // an empty item too ("full,8,"): refused below
    try {
      windows.push_back(item == "full" ? 0 : kvs::parse_int_list("--windows", item, 1, seq_len).front());
    } catch (const kvs::UsageError&) {
      throw kvs::UsageError("--windows: '" + item + "' is not 'full' or a window of 1.." + std::to_string(seq_len) +
                            " keys; give a comma-separated list such as full,256,32");
    }
  }
  return windows;
}

}  // namespace

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  options.max_new_tokens = 300;
  std::string experiment = "generate", positions_name = "absolute";
  std::string windows_text = "full,1024,512,256,128,64,32,16,8,4", recall_windows_text = "full,1024,512,256,128,64,32";
  std::string distances_text = "128,256,512,1024";
  int window = 256, sinks = 0, chunk = 64, max_bytes = 16384, context = 0, stream_bytes = 0;
  kvs::ArgParser parser(
      "04_sliding_window",
      "Chapter 04: a sliding-window KV cache. A ring of --window + --chunk - 1 slots is allocated once; each\n"
      "query sees the --sinks first positions and the most recent --window - --sinks. --positions absolute\n"
      "stores keys rotated at their absolute positions (exact, refused past the trained context);\n"
      "within-window rotates them as they are read, by their place in the window (StreamingLLM), so\n"
      "generation runs on past the trained context in the same memory.\n"
      "--experiment (one of " + std::string(kExperiments) + "):\n"
      "  generate    stream a generation (text to stdout); memory, p50/p99 per token to stderr\n"
      "  perplexity  bits/byte of the held-out text per window, without and with --sinks (default 4)\n"
      "  recall      exact recall of a passage (a verse; word salad) seen d bytes earlier, per window and d\n"
      "              (--distances)\n"
      "  induction   per layer and head, the attention from a repeated passage's bytes onto the byte after\n"
      "              their earlier occurrence (an induction head), at the largest of --distances\n"
      "  fluency     local fluency (known words) and topic (names from the prompt) per window\n"
      "  stream      bits/byte over one stream of 4x the trained context, window without and with sinks;\n"
      "              the attention the first positions receive, per layer\n"
      "  memory      time and memory per token vs generated length, full cache vs --window (the full\n"
      "              cache stops at the model's context, the window runs all of --max-new-tokens)\n"
      "  samples     the same prompt at --windows (default full,256,32), texts to stdout\n"
      "CSV columns (--csv), per experiment:\n"
      "  generate    window, sinks, positions, prompt_tokens, new_tokens, slots, allocated_bytes, resident_bytes,\n"
      "              peak_rss_growth_bytes, decode_ms_p50, decode_ms_p99, total_s\n"
      "  perplexity  window, sinks, bits_per_byte, bytes, context\n"
      "  recall      passage_kind, window, sinks, distance, recalled_share, passages\n"
      "  induction   layer, head, next_byte_weight, same_byte_weight, previous_byte_weight, distance\n"
      "  fluency     window, sinks, known_word_share, words, names_from_prompt_share, names\n"
      "  stream      measure, config, window, sinks, layer, value, even_spread\n"
      "  memory      cache, generated, ms_p50, ms_p99, allocated_bytes, resident_bytes, peak_rss_bytes");
  kvs::add_common_flags(parser, options, '"' + std::string(kDefaultPrompt) + '"');
  parser.add_string("--experiment", "NAME", "what to run (default generate; see above)", &experiment);
  parser.add_int("--window", "keys each query sees, sinks included (default 256, or the model's context if shorter)", &window, 1, 1 << 21);
  parser.add_int("--sinks", "first positions kept forever (default 0; recall and fluency: in every window; perplexity and stream compare 0 with this, default 4 there)",
                 &sinks, 0, 1 << 21);
  parser.add_string("--positions", "KIND", "absolute or within-window (default absolute; see above)", &positions_name);
  parser.add_int("--chunk", "positions per forward call: prefill and evaluation (default 64, or the model's context if shorter)", &chunk, 1, 4096);
  parser.add_string("--windows", "LIST", "windows for perplexity, recall, fluency and samples, e.g. full,256,32", &windows_text);
  parser.add_string("--distances", "LIST", "recall and induction: distances d of 98 or more bytes (default 128,256,512,1024)",
                    &distances_text);
  parser.add_int("--max-bytes", "perplexity: held-out bytes to evaluate (default 16384)", &max_bytes, 2, 1 << 30);
  parser.add_int("--context", "perplexity: positions per sequence (default: the model's context)", &context, 1, 1 << 21);
  parser.add_int("--stream-bytes", "stream: bytes of the held-out stream (default 4x the model's context)", &stream_bytes,
                 2, 1 << 30);
  parser.add_check([&] {
    if (positions_name != "absolute" && positions_name != "within-window")
      return "--positions '" + positions_name + "': use absolute or within-window";
    for (const char* name : {"generate", "perplexity", "recall", "induction", "fluency", "stream", "memory", "samples"})
      if (experiment == name) return std::string();
    return "--experiment '" + experiment + "': use one of " + kExperiments;
  });
  // What each experiment reads (experiments.cpp): the generating ones the prompt and the sampler; recall, induction
  // and perplexity the held-out text, teacher-forced; stream its own ring, rotated within the window; induction a
  // full cache. --model, --threads, --backend, --memory-limit and --chunk: every one.
  const std::vector<std::string> generating = {"generate", "memory", "samples"},
                                 sampling = {"generate", "fluency", "memory", "samples"},
                                 one_window = {"generate", "stream", "memory"},          // --window
                                 several_windows = {"perplexity", "recall", "fluency", "samples"};  // --windows
  parser.add_read_only_by(
      "--experiment", &experiment,
      {{"--prompt", generating},
       {"--prompt-file", generating},
       {"--max-new-tokens", sampling},
       {"--temperature", sampling},
       {"--top-k", sampling},
       {"--seed", sampling},
       {"--csv", {"generate", "perplexity", "recall", "induction", "fluency", "stream", "memory"}},
       {"--window", one_window},
       {"--sinks", {"generate", "perplexity", "recall", "fluency", "stream", "memory", "samples"}},
       {"--positions", {"generate", "perplexity", "recall", "fluency", "memory", "samples"}},
       {"--windows", several_windows},
       {"--distances", {"recall", "induction"}},
       {"--max-bytes", {"perplexity"}},
       {"--context", {"perplexity"}},
       {"--stream-bytes", {"stream"}}});
  parser.add_check([&] {  // with none, nothing goes through the window (generation stops before the prefill)
    if (options.max_new_tokens >= 1 || std::ranges::find(sampling, experiment) == sampling.end())  // not read there
      return std::string();
    return std::string("--max-new-tokens: at least 1 (what the window does shows as tokens go through it)");
  });
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    const auto positions =
        positions_name == "absolute" ? kvs::ch04::KeyPositions::kAbsolute : kvs::ch04::KeyPositions::kWithinWindow;
    // The model takes calls of up to --chunk positions, and its attention reads up to the context's rows
    // (a full cache) or window + chunk - 1 ring slots: both need the context, so read it first.
    const int seq_len = kvs::Checkpoint(kvs::resolve_model_path(options)).config().seq_len;
    if (!parser.given("--window")) window = std::min(window, seq_len);  // a small model's context may be shorter
    if (!parser.given("--chunk")) chunk = std::min(chunk, seq_len);      // (defaults only: a given value is refused)
    if (!parser.given("--sinks") && (experiment == "perplexity" || experiment == "stream")) sinks = std::min(4, window - 1);
    if (std::ranges::count(one_window, experiment) > 0 && sinks >= window)
      throw kvs::UsageError("--sinks " + std::to_string(sinks) + " must be smaller than --window " + std::to_string(window));
    if (chunk > seq_len) throw kvs::UsageError("--chunk " + std::to_string(chunk) + " exceeds the model's context of " + std::to_string(seq_len));
    if (window > seq_len)
      throw kvs::UsageError("--window " + std::to_string(window) + " exceeds the model's context of " + std::to_string(seq_len) +
                            " positions; a longer window is a full cache (chapter 03)");
    if (experiment == "stream" && stream_bytes != 0 && stream_bytes < seq_len + 2)
      throw kvs::UsageError("--stream-bytes " + std::to_string(stream_bytes) + ": the stream must go past the model's context of " +
                            std::to_string(seq_len) + " positions to score anything there; give at least " +
                            std::to_string(seq_len + 2) + " (default " + std::to_string(4 * seq_len) + ")");
    if (context == 0) context = seq_len;
    if (context > seq_len) throw kvs::UsageError("--context " + std::to_string(context) + " exceeds the model's context of " + std::to_string(seq_len));
    // The windows an experiment compares (0: a full cache), and the rows its attention may read: a ring's
    // window + chunk - 1 slots, or the longest sequence it keeps in a full cache. Sized for this run, not
    // for the model's context (a model may have a context of millions).
    const std::string default_windows = experiment == "perplexity" ? windows_text
                                        : experiment == "recall"    ? recall_windows_text
                                        : experiment == "fluency"   ? "full,512,128,32,8"
                                        : experiment == "samples"   ? "full,256,32"
                                                                    : "";
    const std::vector<int> windows =
        default_windows.empty() ? std::vector<int>{} : parse_windows(parser.given("--windows") ? windows_text : default_windows, seq_len);
    // Recall, fluency and samples keep the sinks in every window they run (perplexity compares without and with
    // them, its table showing "-" where a window is too small to hold them).
    if (std::ranges::count(several_windows, experiment) > 0 && experiment != "perplexity")
      for (int w : windows)
        if (w > 0 && sinks >= w)
          throw kvs::UsageError("--sinks " + std::to_string(sinks) + " must be smaller than every window of --windows; " +
                                std::to_string(w) + " is not");
    // The recall probe's text is a 96-byte passage, a newline, unrelated text, a newline, the passage again.
    const std::vector<int> distances = kvs::parse_int_list("--distances", distances_text, 98, 1 << 20);
    const int longest_distance = std::ranges::max(distances);
    const int new_tokens = options.max_new_tokens;
    const int generated = static_cast<int>(kvs::resolve_prompt(options, kDefaultPrompt).size()) + new_tokens;
    const int full_rows = experiment == "perplexity" ? context
                          : experiment == "recall" || experiment == "induction" ? longest_distance + 96  // the longest text
                          : experiment == "fluency"  ? 1024 + new_tokens
                          : experiment == "stream"   ? seq_len  // its full cache restarts every seq_len positions
                          : experiment == "generate" ? 0
                          : experiment == "memory"   ? std::min(seq_len, generated)  // its full cache stops there
                                                     : generated;                  // samples
    int widest = experiment == "generate" || experiment == "stream" || experiment == "memory" ? window : 0;
    for (int w : windows) widest = std::max(widest, w);
    const bool uses_full = experiment != "generate" && (windows.empty() || std::ranges::count(windows, 0) > 0 ||
                                                        experiment == "recall" || experiment == "induction");
    // A full cache keeps absolute positions: past the trained context, its keys sit at positions the model
    // never saw. Refused, like the ring's absolute variant, rather than measured.
    if (uses_full && full_rows > seq_len)
      throw kvs::UsageError("--experiment " + experiment + " runs a full cache over " + std::to_string(full_rows) +
                            " positions, past the model's context of " + std::to_string(seq_len) + "; " +
                            (experiment == "recall" || experiment == "induction"
                                ? "it needs a model with a context of at least " + std::to_string(full_rows) + " (or shorter --distances)"
                                                    : std::string("leave 'full' out of --windows") +
                                                          (full_rows - new_tokens < seq_len ? ", or ask for fewer --max-new-tokens" : "")));
    const int kv_rows = std::max(uses_full ? full_rows : 0, widest > 0 ? kvs::ch04::ring_slots(widest, chunk) : 0);
    kvs::Runtime rt(options, kDefaultPrompt, kvs::PromptFit::kCutByCaller, chunk, kv_rows);
    const kvs::ModelConfig& c = rt.model.config();
    const int prompt_tokens = static_cast<int>(rt.prompt.size());
    // Positions the generating experiments feed: the prompt and every new token but the last.
    auto check_fits = [&](int prompt, int new_tokens) {
      if (positions == kvs::ch04::KeyPositions::kAbsolute && prompt + new_tokens - 1 > seq_len)
        throw kvs::UsageError("the prompt (" + std::to_string(prompt) + " tokens) plus " + std::to_string(new_tokens) +
                              " new tokens go past the model's context of " + std::to_string(seq_len) +
                              " positions, where keys rotated at absolute positions are not exact; use --positions "
                              "within-window (or fewer --max-new-tokens)");
    };
    const kvs::ch04::Lab lab{rt, chunk, positions,
                             experiment == "generate" ? std::string()
                                                      : kvs::read_input_file("the held-out text",
                                                                             kvs::find_data_file("kjv/valid.txt"), 1u << 30)};
    if (experiment == "recall" || experiment == "induction")
      if (const int longest_possible = kvs::ch04::longest_recall_distance(lab.held_out); longest_distance > longest_possible)
        throw kvs::UsageError("--distances " + std::to_string(longest_distance) + ": the filler between the copies comes "
                              "from the held-out text's second half, each passage's from its own place; give distances of "
                              "at most " + std::to_string(longest_possible));
    if (experiment == "generate" || experiment == "memory" || experiment == "samples")
      check_fits(prompt_tokens, options.max_new_tokens);
    if (experiment == "fluency") check_fits(1024, options.max_new_tokens);  // its own prompts, 1024 bytes (not --prompt)
    if (experiment == "memory" && prompt_tokens >= seq_len)  // its full cache stops at the context: nothing left to time
      throw kvs::UsageError("--experiment memory compares the window with a full cache, which needs a prompt shorter than "
                            "the model's context of " + std::to_string(seq_len) + " positions; this one has " +
                            std::to_string(prompt_tokens) + " tokens");
    // The largest cache an experiment holds at once: a ring, or a full cache.
    rt.plan_kv_cache(kvs::kv_cache_bytes(c, kv_rows));
    std::cerr << rt.describe() << "\n";

    if (experiment == "generate") {
      kvs::CsvWriter csv({"--csv", options.csv},
                         "window,sinks,positions,prompt_tokens,new_tokens,slots,allocated_bytes,resident_bytes,"
                         "peak_rss_growth_bytes,decode_ms_p50,decode_ms_p99,total_s", rt.inputs());
      std::cerr << "window " << window << " keys (" << sinks << " sinks), " << kvs::ch04::to_string(positions)
                << " positions, " << options.max_new_tokens << " new tokens after a " << prompt_tokens
                << "-token prompt, prefill in chunks of " << chunk << "\n\n";
      rt.model.forward(std::span<const int>(rt.prompt).first(std::min(prompt_tokens, chunk)), 0);  // warm-up
      const std::int64_t rss_before = kvs::peak_resident_bytes();
      kvs::ch04::SlidingWindowKvCache cache(rt.backend, c, {window, sinks}, chunk, positions);
      kvs::Sampler sampler = rt.new_sampler();
      for (int token : rt.prompt) kvs::emit_token(token);
      const kvs::Stopwatch wall;
      const kvs::Generation g = kvs::generate_cached(rt.model, cache, sampler, rt.prompt, options.max_new_tokens, chunk,
                                                     kvs::emit_token);
      const double total_s = wall.milliseconds() / 1000;
      const std::int64_t rss_growth = kvs::peak_resident_bytes() - rss_before;
      std::fflush(stdout);
      const int cached = cache.length();
      std::fprintf(stderr, "\n\n%d positions went through a ring of %d slots (window %d + chunk %d - 1)\n", cached,
                   cache.slots(), window, chunk);
      std::fprintf(stderr, "  allocated: 2 * %d layers * %d kv_heads * %d head_dim * %d slots * 4 bytes = %lld bytes (%s)\n",
                   c.n_layers, c.n_kv_heads, c.head_dim(), cache.slots(), static_cast<long long>(cache.allocated_bytes()),
                   kvs::format_bytes(double(cache.allocated_bytes())).c_str());
      const std::int64_t resident = cache.resident_bytes();
      std::fprintf(stderr, "  resident (mincore): %s; peak RSS growth during the run: %s\n",
                   resident < 0 ? "not measured (GPU memory)" : kvs::format_bytes(double(resident)).c_str(),
                   kvs::format_bytes(double(std::max<std::int64_t>(0, rss_growth))).c_str());
      std::fprintf(stderr, "  a full cache of the same %d positions: %s\n", cached,
                   kvs::format_bytes(double(kvs::kv_cache_bytes(c, cached))).c_str());
      if (options.max_new_tokens > 1)
        std::fprintf(stderr, "decode: p50 %.4f ms, p99 %.4f ms per token over %d steps; %.3f s in all\n",
                     g.decode_percentile_ms(50), g.decode_percentile_ms(99), options.max_new_tokens - 1, total_s);
      csv.row(window, sinks, kvs::ch04::to_string(positions), prompt_tokens, options.max_new_tokens, cache.slots(),
              cache.allocated_bytes(), resident, rss_growth, g.decode_percentile_ms(50), g.decode_percentile_ms(99), total_s);
      csv.commit();
    } else if (experiment == "perplexity") {
      kvs::CsvWriter csv({"--csv", options.csv}, "window,sinks,bits_per_byte,bytes,context", rt.inputs());
      kvs::ch04::perplexity_vs_window(lab, windows, sinks, context, max_bytes, csv);
    } else if (experiment == "recall") {
      kvs::CsvWriter csv({"--csv", options.csv}, "passage_kind,window,sinks,distance,recalled_share,passages", rt.inputs());
      kvs::ch04::recall_vs_window(lab, windows, sinks, distances, csv);
    } else if (experiment == "induction") {
      kvs::CsvWriter csv({"--csv", options.csv}, "layer,head,next_byte_weight,same_byte_weight,previous_byte_weight,distance",
                         rt.inputs());
      kvs::ch04::induction_heads(lab, longest_distance, csv);
    } else if (experiment == "fluency") {
      kvs::CsvWriter csv({"--csv", options.csv}, "window,sinks,known_word_share,words,names_from_prompt_share,names", rt.inputs());
      kvs::ch04::topic_and_fluency(lab, windows, sinks, options.max_new_tokens, csv);
    } else if (experiment == "stream") {
      kvs::CsvWriter csv({"--csv", options.csv}, "measure,config,window,sinks,layer,value,even_spread", rt.inputs());
      kvs::ch04::stream_past_context(lab, {window, sinks}, stream_bytes ? stream_bytes : 4 * seq_len, csv);
    } else if (experiment == "memory") {
      kvs::CsvWriter csv({"--csv", options.csv}, "cache,generated,ms_p50,ms_p99,allocated_bytes,resident_bytes,peak_rss_bytes",
                         rt.inputs());
      kvs::ch04::memory_vs_length(lab, {window, sinks}, options.max_new_tokens, csv);
    } else {  // samples
      kvs::ch04::samples(lab, windows, sinks, options.max_new_tokens);
    }
    if (!options.csv.empty()) std::cerr << "wrote " << options.csv << "\n";
    return 0;
  });
}
