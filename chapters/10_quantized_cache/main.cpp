// Chapter 10 (in progress, issue #27) — a smaller cache: K and V in 16, 8 and 4 bits.
//
// What is here so far: the formats (common/kv_format.h) and the measurement that decides how to group their
// scales: the shipped model's cached keys and values channel by channel, and how far each format's rounding
// moves them (channels.h). The quantized cache itself - quantize on write, dequantize inside attention - is
// the next step.
#include <algorithm>
#include <cstdio>
#include <string>

#include "channels.h"
#include "cli.h"
#include "csv.h"
#include "kv_format.h"
#include "runtime.h"
#include "tokenizer.h"

int main(int argc, char** argv) {
  kvs::CommonOptions options;
  std::string experiment = "channels", errors_csv;
  int text_bytes = 2048, group = 32, offset = 0;
  kvs::ArgParser parser(
      "10_quantized_cache",
      "Chapter 10 (in progress): a smaller cache. --experiment channels: prefill --text-bytes of the held-out\n"
      "text (data/kjv/valid.txt, from --offset) and measure the cached keys and values channel by channel (mean\n"
      "and largest |x| per layer and channel: --csv), then store them as each format would - fp16, bf16, int8\n"
      "with a scale per token and head, int4 with a scale and minimum per --group channels of a token, and int4\n"
      "per --group tokens of a channel (KIVI's per-channel keys) - and print each one's relative error per layer\n"
      "(--errors-csv). Keys are cached after RoPE, as chapter 03's cache holds them.");
  kvs::add_common_flags(parser, options, "", kvs::CommonFlags::kModelOnly);
  parser.add_string("--experiment", "NAME", "channels (default; the only one so far)", &experiment);
  parser.add_int("--text-bytes", "bytes of held-out text to prefill: the positions measured (default 2048)", &text_bytes, 2, 1 << 20);
  parser.add_int("--offset", "where in the held-out text to start (default 0)", &offset, 0, 1 << 30);
  parser.add_int("--group", "int4 group: channels of a token, or tokens of a channel (default 32)", &group, 2, 1 << 16);
  parser.add_string("--errors-csv", "PATH", "write the relative errors here (layer, kind, format, group, relative_error)",
                    &errors_csv);
  parser.add_check([&] {
    if (experiment == "channels") return std::string();
    return "--experiment " + experiment + " is not channels (the only experiment of this chapter so far)";
  });
  parser.parse(argc, argv);

  return kvs::run_main(parser, [&] {
    kvs::Runtime rt(options, "x", kvs::PromptFit::kCutByCaller, 256, -1);
    const kvs::ModelConfig& c = rt.model.config();
    const int head_dim = c.head_dim();
    if (text_bytes > c.seq_len)
      throw kvs::UsageError("--text-bytes " + std::to_string(text_bytes) + " exceeds the model's context of " +
                            std::to_string(c.seq_len) + " positions");
    if (const std::string why = kvs::kv_format_shape_error(kvs::KvFormat::kInt4, head_dim, group); !why.empty())
      throw kvs::UsageError("--group " + std::to_string(group) + ": " + why);
    const std::string text = kvs::read_input_file("held-out text", kvs::find_data_file("kjv/valid.txt"), std::size_t{64} << 20);
    if (std::size_t(offset) + text_bytes > text.size())
      throw kvs::UsageError("--offset " + std::to_string(offset) + " + --text-bytes " + std::to_string(text_bytes) +
                            " pass the end of the held-out text (" + std::to_string(text.size()) + " bytes)");
    rt.plan_kv_cache(kvs::kv_cache_bytes(c, text_bytes));
    rt.plan_other(kvs::kv_cache_bytes(c, text_bytes), "the cached keys and values copied to the host");
    std::fprintf(stderr, "%s\n", rt.describe().c_str());
    const kvs::ch10::CachedRows rows = kvs::ch10::cache_rows(rt.model, kvs::encode_bytes(text.substr(offset, text_bytes)));

    std::fprintf(stderr, "%d positions of held-out text cached; per layer, each channel's mean |x| over the positions: the "
                         "median channel, the largest, and which one\n", rows.positions);
    std::fprintf(stderr, "%5s | %8s %8s %7s %8s | %8s %8s %7s %8s\n", "layer", "K median", "K max", "ratio", "channel",
                 "V median", "V max", "ratio", "channel");
    kvs::CsvWriter csv({"--csv", options.csv}, "layer,kind,channel,mean_abs,max_abs", rt.inputs());
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
    kvs::CsvWriter errors({"--errors-csv", errors_csv}, "layer,kind,format,group,relative_error", rt.inputs());
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
  });
}
