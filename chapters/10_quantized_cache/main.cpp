// Chapter 10 — a smaller cache: K and V in 16, 8 and 4 bits.
//
// The cache costs 2 · layers · kv_heads · head_dim · positions · bytes, and `bytes` is the factor a runtime can
// change without retraining. QuantizedKvCache (quantized_kv_cache.h) is chapter 03's cache storing each number as
// fp16, bf16, int8 (a scale per token and head) or int4 (a scale and minimum per group of channels): quantized as
// it is written, decoded inside attention as it is read (common/kv_format.h, the one definition). --experiment
// picks what to measure (experiments.h); channels (channels.h) measures why keys and values differ.
#include <algorithm>
#include <cstdio>
#include <string>

#include "channels.h"
#include "backends.h"
#include "cli.h"
#include "csv.h"
#include "experiments.h"
#include "kv_format.h"
#include "quantized_kv_cache.h"
#include "runtime.h"
#include "tokenizer.h"

namespace {
constexpr const char* kDefaultPrompt = "And God said, Let there be light: and there was light. And God saw the light, ";

// --formats: a comma-separated list of format names, fp32 always first (the baseline); "kivi" is int4 with the keys
// per channel (QuantizedKvCache's Keys::kPerChannel), "int4o" int4 per token with KIVI's open group (kPerTokenOpen).
std::vector<kvs::ch10::CacheFormat> parse_formats(const std::string& text) {
  std::vector<kvs::ch10::CacheFormat> formats{kvs::ch10::CacheFormat{}};
  for (const std::string& name : kvs::split_commas(text)) {
    kvs::ch10::CacheFormat f;
    if (name == "kivi")
      f = {kvs::KvFormat::kInt4, kvs::ch10::Keys::kPerChannel};
    else if (name == "int4o")
      f = {kvs::KvFormat::kInt4, kvs::ch10::Keys::kPerTokenOpen};
    else if (!kvs::parse_kv_format(name, f.format))
      throw kvs::UsageError("--formats: '" + name + "' is not one of fp32, fp16, bf16, int8, int4, kivi, int4o");
    if (std::find(formats.begin(), formats.end(), f) == formats.end()) formats.push_back(f);
  }
  return formats;
}
}  // namespace

// --experiment channels: the cached keys and values of --text-bytes of held-out text channel by channel, and how
// far each format's rounding moves them (channels.h).
int channels(const kvs::CommonOptions& options, int text_bytes, int offset, int group, const std::string& errors_csv) {
  kvs::Runtime rt(options, "x", kvs::PromptFit::kCutByCaller, 256, -1);
  const kvs::ModelConfig& c = rt.model.config();
  const int head_dim = c.head_dim();
  if (text_bytes > c.seq_len)
    throw kvs::UsageError("--text-bytes " + std::to_string(text_bytes) + " exceeds the model's context of " +
                          std::to_string(c.seq_len) + " positions");
  if (const std::string why = kvs::kv_format_shape_error(kvs::KvFormat::kInt4, head_dim, group); !why.empty())
    throw kvs::UsageError("--group " + std::to_string(group) + ": " + why);
  const std::string text = kvs::read_input_file("the held-out text", kvs::find_data_file("kjv/valid.txt"), std::size_t{64} << 20);
  if (std::size_t(offset) + text_bytes > text.size())
    throw kvs::UsageError("--offset " + std::to_string(offset) + " + --text-bytes " + std::to_string(text_bytes) +
                          " pass the end of the held-out text (" + std::to_string(text.size()) + " bytes)");
  rt.plan_kv_cache(kvs::kv_cache_bytes(c, text_bytes));
  rt.plan_other(kvs::kv_cache_bytes(c, text_bytes), "the cached keys and values copied to the host");
  // Both outputs checked before anything runs: neither may be an input, nor the other.
  kvs::CsvWriter csv({"--csv", options.csv}, "layer,kind,channel,mean_abs,max_abs", rt.inputs());
  kvs::CsvWriter errors({"--errors-csv", errors_csv}, "layer,kind,format,group,relative_error", csv.taken());
  std::fprintf(stderr, "%s\n", rt.describe().c_str());
  const kvs::ch10::CachedRows rows = kvs::ch10::cache_rows(rt.model, kvs::encode_bytes(text.substr(offset, text_bytes)));

  std::fprintf(stderr, "%d positions of held-out text cached; per layer, each channel's mean |x| over the positions: the "
                       "median channel, the largest, and which one\n", rows.positions);
  std::fprintf(stderr, "%5s | %8s %8s %7s %8s | %8s %8s %7s %8s\n", "layer", "K median", "K max", "ratio", "channel",
               "V median", "V max", "ratio", "channel");
  for (int layer = 0; layer < rows.layers; ++layer) {
    std::fprintf(stderr, "%5d |", layer);
    for (const auto* which : {&rows.keys, &rows.values}) {
      std::vector<double> mean(rows.kv_dim, 0.0), largest(rows.kv_dim, 0.0);
      for (int p = 0; p < rows.positions; ++p)
        for (int ch = 0; ch < rows.kv_dim; ++ch) {
          const double x = std::abs(rows.row(*which, layer, p)[ch]);
          mean[ch] += x / rows.positions, largest[ch] = std::max(largest[ch], x);
        }
      std::vector<double> sorted = mean;
      std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
      const double median = sorted[sorted.size() / 2];
      const int top = static_cast<int>(std::max_element(mean.begin(), mean.end()) - mean.begin());
      std::fprintf(stderr, " %8.3f %8.3f %6.1fx %8d |", median, mean[top], mean[top] / median, top);
      for (int ch = 0; ch < rows.kv_dim; ++ch) csv.row(layer, which == &rows.keys ? "key" : "value", ch, mean[ch], largest[ch]);
    }
    std::fprintf(stderr, "\n");
  }
  csv.commit();

  using kvs::ch10::Grouping;
  const Grouping groupings[] = {Grouping::kFp16, Grouping::kBf16, Grouping::kInt8PerTokenHead, Grouping::kInt4PerToken,
                                Grouping::kInt4PerChannel};
  std::fprintf(stderr, "\nrelative error ||x - stored(x)|| / ||x|| per layer (int4 groups of %d: channels of a token, or "
                       "tokens of a channel)\n%-24s", group, "format");
  for (int layer = 0; layer < rows.layers; ++layer) std::fprintf(stderr, "   K l%d   V l%d", layer, layer);
  std::fprintf(stderr, "\n");
  for (Grouping g : groupings) {
    std::fprintf(stderr, "%-24s", kvs::ch10::to_string(g));
    for (int layer = 0; layer < rows.layers; ++layer)
      for (const auto* which : {&rows.keys, &rows.values}) {
        const double e = kvs::ch10::relative_error(rows, *which, layer, head_dim, g, group);
        std::fprintf(stderr, " %6.4f", e);
        errors.row(layer, which == &rows.keys ? "key" : "value", kvs::ch10::to_string(g), group, e);
      }
    std::fprintf(stderr, "\n");
  }
  errors.commit();
  for (const auto* written : {&csv, &errors})
    if (written->enabled()) std::fprintf(stderr, "wrote %s\n", written->path().c_str());
  return 0;
}
int main(int argc, char** argv) {
  kvs::CommonOptions options;
  options.max_new_tokens = 120;
  std::string experiment = "compare", formats_flag = "fp16,bf16,int8,int4,kivi", contexts_flag, distances_flag = "256,1024,1900",
              errors_csv;
  int text_bytes = 2048, group = 32, offset = 0, steps = 200;
  std::int64_t budget = std::int64_t{512} << 10;
  kvs::ArgParser parser(
      "10_quantized_cache",
      "Chapter 10: a smaller cache. Chapter 03's cache storing K and V as fp16, bf16, int8 (a scale per token and\n"
      "head) or int4 (a scale and a minimum per --group channels), or KIVI's int4 (kivi: keys per channel over\n"
      "--group positions, the open group's keys in fp32): quantized on write, decoded inside attention.\n"
      "--experiment: compare (default: the prompt continued greedily with each format's cache; teacher-forced along\n"
      "fp32's tokens, the KL per step and where the most likely token first differs), memory (bytes per position from\n"
      "the allocator, the context a --budget holds), quality (bits per byte of held-out text at each --contexts),\n"
      "recall (a passage repeated --distances bytes later: exact recall; use --model data/kjv-gpt-copy.bin, the model\n"
      "that copies), speed (decode step and attention time at each --contexts), channels (the cached keys and values\n"
      "channel by channel, and each format's error: why keys want per-channel scales).\n"
      "Text goes to stdout, tables and progress to stderr, one CSV per experiment with --csv.");
  kvs::add_common_flags(parser, options, '"' + std::string(kDefaultPrompt) + '"', kvs::CommonFlags::kGreedy);
  parser.add_string("--experiment", "NAME", "compare, memory, quality, recall, speed or channels (default compare)", &experiment);
  parser.add_string("--formats", "LIST", "formats besides fp32, which always runs first (default fp16,bf16,int8,int4,kivi; kivi: int4 with the keys per channel over --group positions and the newest, open group in fp32; int4o: int4 per token with that open group, a control)",
                    &formats_flag);
  parser.add_int("--group", "int4: channels per scale and minimum; kivi and channels: also positions per channel group of the keys (default 32)",
                 &group, 2, 1 << 16);
  parser.add_bytes("--budget", "memory: the KV cache budget whose context is counted (default 512KiB)", &budget);
  parser.add_string("--contexts", "LIST", "quality: contexts (default 512,2048); speed: cached positions (default 512,1024,2047)",
                    &contexts_flag);
  parser.add_int("--text-bytes", "quality, channels: bytes of held-out text (default: quality 65536, channels 2048)", &text_bytes, 2,
                 1 << 24);
  parser.add_string("--distances", "LIST", "recall: bytes between a passage and its repeat (default 256,1024,1900)", &distances_flag);
  parser.add_int("--steps", "speed: decode steps timed per format and context (default 200)", &steps, 1, 1000000);
  parser.add_int("--offset", "channels: where in the held-out text to start (default 0)", &offset, 0, 1 << 30);
  parser.add_string("--errors-csv", "PATH", "channels: write the relative errors here (layer, kind, format, group, relative_error)",
                    &errors_csv);
  parser.add_check([&] {
    for (const char* name : {"compare", "memory", "quality", "recall", "speed", "channels"})
      if (experiment == name) return std::string();
    return "--experiment " + experiment + " is not one of compare, memory, quality, recall, speed, channels";
  });
  parser.add_check([&] {
    return experiment == "speed" ? kvs::timed_run_refuses_harness(options.backend, "--experiment speed") : std::string();
  });
  parser.add_check([&] {
    if (experiment != "compare" || options.max_new_tokens >= 1) return std::string();
    return std::string("--max-new-tokens must be at least 1: compare generates with each format");
  });
  // What each experiment reads (experiments.cpp): compare continues the prompt; the others cut their text from the
  // held-out text, or (memory) write no text at all; channels takes its own groupings instead of --formats.
  parser.add_read_only_by("--experiment", &experiment,
                          {{"--prompt", {"compare"}},
                           {"--prompt-file", {"compare"}},
                           {"--max-new-tokens", {"compare"}},
                           {"--formats", {"compare", "memory", "quality", "recall", "speed"}},
                           {"--budget", {"memory"}},
                           {"--contexts", {"quality", "speed"}},
                           {"--text-bytes", {"quality", "channels"}},
                           {"--distances", {"recall"}},
                           {"--steps", {"speed"}},
                           {"--offset", {"channels"}},
                           {"--errors-csv", {"channels"}}});
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    if (experiment == "channels") return channels(options, parser.given("--text-bytes") ? text_bytes : 2048, offset, group, errors_csv);
    const std::vector<kvs::ch10::CacheFormat> formats = parse_formats(formats_flag);
    if (parser.given("--group") && std::ranges::none_of(formats, [](kvs::ch10::CacheFormat f) {
          return f.format == kvs::KvFormat::kInt4 || f.keys != kvs::ch10::Keys::kPerToken;
        }))
      throw kvs::UsageError("--group is for --formats with int4, kivi or int4o (or --experiment channels): drop it");
    const bool is_speed = experiment == "speed";
    const std::vector<int> contexts = kvs::parse_int_list(
        "--contexts", contexts_flag.empty() ? (is_speed ? "512,1024,2047" : "512,2048") : contexts_flag, 1, 1 << 20);
    const std::vector<int> distances = kvs::parse_int_list("--distances", distances_flag, 100, 1 << 20);
    if (!parser.given("--text-bytes")) text_bytes = 65536;
    // The longest call: a compare run's prompt, a quality chunk, a recall text (a prefill chunk of 256 for speed).
    const int longest_context = *std::max_element(contexts.begin(), contexts.end());
    const int longest_distance = *std::max_element(distances.begin(), distances.end());
    const int longest = experiment == "quality" ? longest_context : experiment == "recall" ? longest_distance + 96 : 0;
    kvs::Runtime rt(options, kDefaultPrompt, experiment == "compare" ? kvs::PromptFit::kMustFit : kvs::PromptFit::kCutByCaller,
                    is_speed ? 256 : experiment == "memory" ? 1 : longest, -1);
    const kvs::ModelConfig& c = rt.model.config();
    for (kvs::ch10::CacheFormat f : formats) {
      if (const std::string why = kvs::kv_format_shape_error(f.format, c.head_dim(), group); !why.empty())
        throw kvs::UsageError("--group " + std::to_string(group) + ": " + why);
      if (const std::string why = kvs::channel_group_error(group); f.keys != kvs::ch10::Keys::kPerToken && !why.empty())
        throw kvs::UsageError("--group " + std::to_string(group) + ": " + why);
    }
    // speed: a context of cached positions and the one its timed step adds
    if (const int asked = is_speed ? longest_context + 1 : longest; asked > c.seq_len)
      throw kvs::UsageError(std::string(experiment == "recall" ? "--distances" : "--contexts") + " ask for " +
                            std::to_string(asked) + " positions; the model's context is " + std::to_string(c.seq_len));
    // The largest cache a run holds at once: fp32's (compare holds fp32's and one other format's).
    const int cached = experiment == "compare" ? static_cast<int>(rt.prompt.size()) + options.max_new_tokens
                       : experiment == "memory" ? c.seq_len
                       : is_speed ? longest_context + 1 : longest;
    const std::int64_t fp32_bytes = kvs::ch10::QuantizedKvCache::bytes(c, cached, kvs::KvFormat::kFp32, group);
    rt.plan_kv_cache(experiment == "compare" ? 2 * fp32_bytes : fp32_bytes);
    std::fprintf(stderr, "%s\n", rt.describe().c_str());
    const std::string held_out =
        experiment == "compare" || experiment == "memory"
            ? std::string()
            : kvs::read_input_file("the held-out text", kvs::find_data_file("kjv/valid.txt"), std::size_t{64} << 20);
    if (experiment == "quality" && std::size_t(text_bytes) > held_out.size())
      throw kvs::UsageError("--text-bytes " + std::to_string(text_bytes) + " exceeds the held-out text's " +
                            std::to_string(held_out.size()) + " bytes");
    const kvs::ch10::Lab lab{rt, formats, group, held_out};
    const char* header = experiment == "compare"   ? "format,step,kl_nats,same_top_token"
                         : experiment == "memory"  ? "format,bytes_per_position,allocated_bytes,positions,formula_bytes_per_position,budget_bytes,positions_in_budget,llama3_8b_bytes_per_position"
                         : experiment == "quality" ? "format,bytes_per_position,context,text_bytes,bits_per_byte,vs_fp32"
                         : experiment == "recall"  ? "format,distance,exact_recall,passages"
                                                   : "format,context,steps,step_p50_ms,step_p99_ms,attention_p50_ms,attention_p99_ms,kv_bytes_read";
    kvs::CsvWriter csv({"--csv", options.csv}, header, rt.inputs());
    if (experiment == "compare") kvs::ch10::compare(lab, options.max_new_tokens, csv);
    if (experiment == "memory") kvs::ch10::memory(lab, budget, csv);
    if (experiment == "quality") kvs::ch10::quality(lab, contexts, text_bytes, csv);
    if (experiment == "recall") kvs::ch10::recall(lab, distances, csv);
    if (is_speed) kvs::ch10::speed(lab, contexts, steps, csv);
    if (csv.enabled()) std::fprintf(stderr, "wrote %s\n", csv.path().c_str());
    return 0;
  });
}
