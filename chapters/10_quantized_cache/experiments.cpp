#include "experiments.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <span>

#include "cli.h"
#include "equivalence.h"
#include "generate.h"
#include "perplexity.h"
#include "progress.h"
#include "quantized_kv_cache.h"
#include "sampler.h"
#include "timing.h"
#include "tokenizer.h"

namespace kvs::ch10 {
namespace {

std::unique_ptr<QuantizedKvCache> make_cache(const Lab& lab, CacheFormat f, int positions) {
  return std::make_unique<QuantizedKvCache>(lab.rt.backend, lab.rt.model.config(), positions, f.format, lab.group, f.keys);
}

// The name a table and a CSV give a format: int4 and KIVI's with their group.
std::string format_name(const Lab& lab, CacheFormat f) {
  if (f.keys == Keys::kPerChannel) return "kivi/g" + std::to_string(lab.group);
  if (f.keys == Keys::kPerTokenOpen) return "int4o/g" + std::to_string(lab.group);
  return f.format == KvFormat::kInt4 ? "int4/g" + std::to_string(lab.group) : to_string(f.format);
}

// Bytes a cached position costs in every layer, keys and values, scales included (KIVI's: int4's, its scales per
// channel and group of positions instead of per group of channels; not the open group's floats).
std::int64_t bytes_per_position(const Lab& lab, const ModelConfig& c, CacheFormat f) {
  return kv_bytes_per_position(f.format, c.n_kv_heads, c.head_dim(), lab.group) * c.n_layers;
}

// Teacher-forced decoding of `text` from position `first` on, one position per call (the cache holds [0, first)
// already): on_logits(p, logits) with the logits that predict text[p + 1].
void decode_along(Runtime& rt, KvCache& cache, std::span<const int> text, int first,
                  const std::function<void(int, std::span<const float>)>& on_logits) {
  for (int p = first; p + 1 < static_cast<int>(text.size()); ++p) on_logits(p, rt.model.forward(text.subspan(p, 1), p, &cache));
}

// Bits per byte as evaluate_perplexity scores them (chunks of `context` from position 0), but one position per
// call: what a cache that reads a call's own keys differently from earlier ones (KIVI's) is scored by.
double decoded_bits_per_byte(Runtime& rt, QuantizedKvCache& cache, std::span<const int> tokens, int context,
                             Progress& progress) {
  const int vocab = rt.model.config().vocab_size, n = static_cast<int>(tokens.size());
  double nats = 0;
  const int chunks = (n - 1 + context - 1) / context;
  for (int start = 0, chunk = 0; start < n - 1; start += context, ++chunk) {
    cache.clear();
    decode_along(rt, cache, tokens.subspan(start, std::min(context + 1, n - start)), 0,
                 [&](int p, std::span<const float> logits) { nats += next_token_nats(logits.data(), vocab, tokens[start + p + 1]); });
    progress.update(chunk + 1, chunks);
  }
  return nats / (n - 1) / std::log(2.0);
}

std::size_t line_start(const std::string& text, std::size_t offset) {
  const std::size_t newline = text.find('\n', offset);
  return newline == std::string::npos ? 0 : newline + 1;
}

}  // namespace

void compare(const Lab& lab, int new_tokens, CsvWriter& csv) {
  Runtime& rt = lab.rt;
  const int positions = static_cast<int>(rt.prompt.size()) + new_tokens;
  const int vocab = rt.model.config().vocab_size;
  // fp32's greedy run: its tokens are what the other formats are forced along, its logits what they are
  // compared with.
  std::vector<float> reference_logits(std::size_t(new_tokens) * vocab);
  auto fp32 = make_cache(lab, CacheFormat{}, positions);
  Sampler sampler = rt.new_sampler();
  const Generation reference = generate_cached(
      rt.model, *fp32, sampler, rt.prompt, new_tokens, 0, {}, [&](int step, std::span<const float> logits) {
        std::copy(logits.begin(), logits.end(), reference_logits.begin() + std::size_t(step) * vocab);
      });
  const std::span<const int> reference_tokens(reference.tokens.data() + rt.prompt.size(), new_tokens);
  std::vector<std::string> texts;  // each format's greedy continuation
  std::fprintf(
      stderr,
      "the prompt (%zu bytes) continued for %d tokens with each format's cache; teacher-forced along fp32's "
      "tokens: KL(fp32 || format) per step and the steps whose most likely token is not fp32's\n\n",
      rt.prompt.size(), new_tokens);
  std::fprintf(stderr, "%-8s %9s %10s %10s %11s %12s %13s\n", "format", "B/pos", "KL mean", "KL max",
               "top-1 diff", "first diff", "text differs");
  for (CacheFormat format : lab.formats) {
    auto cache = make_cache(lab, format, positions);
    double kl_sum = 0, kl_max = 0;
    int top_differs = 0, first_top_differs = -1;
    Sampler forced_sampler = rt.new_sampler();
    generate_cached(
        rt.model, *cache, forced_sampler, rt.prompt, new_tokens, 0, {},
        [&](int step, std::span<const float> logits) {
          const std::span<const float> ref(reference_logits.data() + std::size_t(step) * vocab, vocab);
          const double kl = logit_divergence(ref, logits).kl;
          const bool same_top = argmax(logits) == reference_tokens[step];
          kl_sum += kl, kl_max = worst_difference(kl_max, kl);  // NaN stays, as in the sum
          if (!same_top && first_top_differs < 0) first_top_differs = step;
          top_differs += !same_top;
          csv.row(format_name(lab, format), step, kl, same_top ? 1 : 0);
        },
        reference_tokens);
    // Free-running: the text this cache gives a reader.
    cache->clear();
    Sampler free_sampler = rt.new_sampler();
    const Generation own = generate_cached(rt.model, *cache, free_sampler, rt.prompt, new_tokens);
    const std::span<const int> own_tokens(own.tokens.data() + rt.prompt.size(), new_tokens);
    const auto differs = std::mismatch(own_tokens.begin(), own_tokens.end(), reference_tokens.begin());
    const int first_text_diff =
        differs.first == own_tokens.end() ? -1 : static_cast<int>(differs.first - own_tokens.begin());
    const std::int64_t per_position = bytes_per_position(lab, rt.model.config(), format);
    std::fprintf(stderr, "%-8s %9lld %10.2e %10.2e %5d of %-3d %12s %13s\n", format_name(lab, format).c_str(),
                 static_cast<long long>(per_position), kl_sum / new_tokens, kl_max, top_differs, new_tokens,
                 first_top_differs < 0 ? "none" : ("step " + std::to_string(first_top_differs)).c_str(),
                 first_text_diff < 0 ? "no" : ("at byte " + std::to_string(first_text_diff)).c_str());
    texts.push_back("[" + format_name(lab, format) + "] " + decode_on_one_line(own_tokens));
    csv.commit();
  }
  // The texts after the table, so that the two streams do not interleave on a terminal.
  std::fflush(stderr);
  std::printf("%s\n", decode_on_one_line(rt.prompt).c_str());
  for (const std::string& text : texts) std::printf("%s\n", text.c_str());
}

void memory(const Lab& lab, std::int64_t budget, CsvWriter& csv) {
  const ModelConfig& c = lab.rt.model.config();
  // A larger model's shape for the same arithmetic (Llama 3 8B's cache: 32 layers, 8 KV heads of 128), never
  // allocated.
  ModelConfig large = c;
  large.n_layers = 32, large.n_heads = 32, large.n_kv_heads = 8, large.dim = 32 * 128;
  std::fprintf(
      stderr,
      "bytes per cached position, keys and values of every layer, scales included: 2 · layers · (codes + "
      "scales) per row\n");
  std::fprintf(stderr, "%-9s | %-43s | %-36s | %s\n", "", "this model, allocated for its whole context",
               "the context a budget holds", "Llama-3-8B's shape (formula)");
  std::fprintf(stderr, "%-9s | %12s %12s %16s | %12s %12s %10s | %12s %14s\n", "format", "B/position",
               "vs fp32", "allocated", "formula", "budget", "positions", "B/position", "pos. in 16 GiB");
  std::int64_t fp32_per_position = 0;
  for (CacheFormat format : lab.formats) {
    // Allocated for the model's whole context: the bytes the allocator handed out, divided by the positions
    // (KIVI's include its open group's fp32 keys, a decode step's worth).
    auto cache = make_cache(lab, format, c.seq_len);
    const std::int64_t allocated = cache->allocated_bytes(), per_position = allocated / c.seq_len;
    const std::int64_t formula = bytes_per_position(lab, c, format);
    if (format.format == KvFormat::kFp32) fp32_per_position = per_position;
    // The most positions whose cache fits the budget (QuantizedKvCache::bytes: what the constructor would
    // allocate).
    int fits = 0;
    for (int step = 1 << 30; step > 0; step /= 2)
      if (fits + step <= (1 << 30) - 1 &&
          QuantizedKvCache::bytes(c, fits + step, format.format, lab.group, format.keys) <= budget)
        fits += step;
    const std::int64_t large_per_position =
        large.head_dim() % lab.group == 0 || format.format != KvFormat::kInt4
            ? bytes_per_position(lab, large, format)
            : -1;
    std::fprintf(
        stderr, "%-9s | %12lld %11.2fx %16s | %12lld %12s %10d | %12lld %14lld\n",
        format_name(lab, format).c_str(), static_cast<long long>(per_position),
        double(fp32_per_position) / per_position, format_bytes(double(allocated)).c_str(),
        static_cast<long long>(formula), format_bytes(double(budget)).c_str(), fits,
        static_cast<long long>(large_per_position),
        static_cast<long long>(large_per_position > 0 ? (std::int64_t{16} << 30) / large_per_position : 0));
    csv.row(format_name(lab, format), per_position, allocated, c.seq_len, formula, budget, fits,
            large_per_position);
  }
  csv.commit();
}

void quality(const Lab& lab, const std::vector<int>& contexts, int text_bytes, CsvWriter& csv) {
  Runtime& rt = lab.rt;
  const std::vector<int> tokens =
      encode_bytes(std::string_view(lab.held_out).substr(0, std::size_t(text_bytes)));
  std::fprintf(
      stderr,
      "bits per byte of the first %d bytes of held-out text, each chunk of `context` bytes through each "
      "format's cache\n(every position reads every earlier one, and its own, from the cache: what "
      "teacher-forced decoding through it scores)\n\n%-9s",
      text_bytes, "format");
  for (int context : contexts)
    std::fprintf(stderr, " %12s %10s", ("ctx " + std::to_string(context)).c_str(), "vs fp32");
  std::fprintf(stderr, "\n");
  std::vector<double> fp32(contexts.size(), 0.0);
  for (CacheFormat format : lab.formats) {
    std::vector<double> bits(contexts.size());
    for (std::size_t i = 0; i < contexts.size(); ++i) {
      auto cache = make_cache(lab, format, contexts[i]);
      Progress progress("  " + format_name(lab, format) + ", context " + std::to_string(contexts[i]),
                        "chunks");
      bits[i] = format.keys != Keys::kPerToken
                    ? decoded_bits_per_byte(rt, *cache, tokens, contexts[i], progress)
                    : evaluate_perplexity(
                          rt.model, tokens, contexts[i], [&](int done, int total) { progress.update(done, total); },
                          cache.get())
                          .bits_per_byte;
      if (format.format == KvFormat::kFp32) fp32[i] = bits[i];
      csv.row(format_name(lab, format), bytes_per_position(lab, rt.model.config(), format), contexts[i], text_bytes,
              bits[i], bits[i] - fp32[i]);
    }
    std::fprintf(stderr, "%-9s",
                 format_name(lab, format).c_str());  // the row once its progress lines are done
    for (std::size_t i = 0; i < contexts.size(); ++i)
      std::fprintf(stderr, " %12.4f %+10.5f", bits[i], bits[i] - fp32[i]);
    std::fprintf(stderr, "\n");
    csv.commit();
  }
}

void recall(const Lab& lab, const std::vector<int>& distances, CsvWriter& csv) {
  Runtime& rt = lab.rt;
  constexpr int kPassage = 96, kCue = 32, kPassages = 16;
  std::fprintf(
      stderr,
      "exact recall: the share of a passage's last %d bytes predicted exactly (teacher-forced) when the "
      "passage was seen d bytes earlier; %d passages of held-out text\n\n%-9s",
      kPassage - kCue, kPassages, "format");
  for (int d : distances) std::fprintf(stderr, " %8s", ("d=" + std::to_string(d)).c_str());
  std::fprintf(stderr, "\n");
  for (CacheFormat format : lab.formats) {
    std::fprintf(stderr, "%-9s", format_name(lab, format).c_str());
    for (int distance : distances) {
      long correct = 0, scored = 0;
      for (int k = 0; k < kPassages; ++k) {
        // passage + "\n" + unrelated text + "\n" + passage: each byte of the repeat `distance` bytes after
        // its first.
        const std::size_t at = line_start(lab.held_out, (std::size_t(k) * 7919) % (lab.held_out.size() / 2));
        const std::string passage = lab.held_out.substr(at, kPassage);
        const std::size_t from = line_start(lab.held_out, lab.held_out.size() / 2 + std::size_t(k) * 9973);
        const std::vector<int> text =
            encode_bytes(passage + "\n" + lab.held_out.substr(from, std::size_t(distance - kPassage - 2)) +
                         "\n" + passage);
        const int n = static_cast<int>(text.size());
        // Everything before the scored bytes in one call (a prompt), then one position per call (generation): the
        // scored positions read the first passage from the cache as decoding does, in every format.
        auto cache = make_cache(lab, format, n);
        const int first_scored = n - (kPassage - kCue) - 1;  // predicts the byte at first_scored + 1
        rt.model.forward(std::span<const int>(text).first(first_scored), 0, cache.get());
        decode_along(rt, *cache, text, first_scored, [&](int p, std::span<const float> logits) {
          correct += argmax(logits) == text[p + 1], ++scored;
        });
      }
      const double share = double(correct) / scored;
      std::fprintf(stderr, " %8.2f", share);
      csv.row(format_name(lab, format), distance, share, kPassages);
    }
    std::fprintf(stderr, "\n");
    csv.commit();
  }
}

void speed(const Lab& lab, const std::vector<int>& contexts, int steps, CsvWriter& csv) {
  Runtime& rt = lab.rt;
  const ModelConfig& c = rt.model.config();
  const AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim()};
  std::fprintf(
      stderr,
      "a decode step at `context` cached positions, %d steps each (p50 / p99, ms); attention alone: every "
      "layer's attention over the cache for one query, timed apart, and the rate it reads the cache's bytes at (GB/s)\n\n",
      steps);
  std::fprintf(stderr, "%-9s %8s | %9s %9s | %9s %9s %12s\n", "format", "context", "step p50", "p99",
               "attn p50", "p99", "K/V GB/s");
  Buffer query(rt.backend, std::size_t(c.dim)), out(rt.backend, std::size_t(c.dim));
  Buffer scratch(rt.backend, rt.backend.attention_scratch_floats(shape, c.seq_len, 1));
  rt.backend.from_host(query.data(), std::vector<float>(c.dim, 0.1f).data(), c.dim);
  for (int context : contexts) {
    const std::vector<int> text =
        encode_bytes(std::string_view(lab.held_out).substr(0, std::size_t(context) + 1));
    for (CacheFormat format : lab.formats) {
      auto cache = make_cache(lab, format, context + 1);
      for (int pos = 0; pos < context; pos += rt.model.max_tokens_per_call())  // prefill `context` positions
        rt.model.forward(
            std::span<const int>(text).subspan(pos, std::min(context - pos, rt.model.max_tokens_per_call())),
            pos, cache.get());
      const IntBuffer position = consecutive_positions(rt.backend, context, 1);
      std::vector<double> step_ms, attention_ms;
      {
        Progress progress("  " + format_name(lab, format) + " at " + std::to_string(context), "steps");
        for (int s = 0; s < steps; ++s) {
          Stopwatch step;
          rt.model.forward(std::span<const int>(text).subspan(context, 1), context,
                           cache.get());  // rewinds to `context`
          step_ms.push_back(step.milliseconds());
          Stopwatch attention;
          for (int layer = 0; layer < c.n_layers; ++layer)
            rt.backend.attention(out.data(), query.data(), position.data(), 1, cache->view(layer), shape,
                                 {scratch.data(), scratch.size()}, nullptr);
          rt.backend.synchronize();
          attention_ms.push_back(attention.milliseconds());
          progress.update(s + 1, steps);
        }
      }  // the progress line ends before the row
      // What attention reads per step: the context's rows, codes and scales, keys and values, every layer.
      const double bytes = double(bytes_per_position(lab, c, format)) * (context + 1);
      const double attention_p50 = median(attention_ms);
      std::fprintf(stderr, "%-9s %8d | %9.3f %9.3f | %9.3f %9.3f %12.1f\n", format_name(lab, format).c_str(),
                   context, median(step_ms), percentile(step_ms, 99), attention_p50,
                   percentile(attention_ms, 99), bytes / attention_p50 / 1e6);
      csv.row(format_name(lab, format), context, steps, median(step_ms), percentile(step_ms, 99),
              attention_p50, percentile(attention_ms, 99), bytes);
      csv.commit();
    }
  }
}

}  // namespace kvs::ch10
