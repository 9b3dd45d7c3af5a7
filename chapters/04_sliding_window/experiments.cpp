#include "experiments.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <sstream>

#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "generate.h"
#include "perplexity.h"
#include "text_probes.h"
#include "timing.h"
#include "tokenizer.h"

namespace kvs::ch04 {
namespace {

// Nats summed over the scored predictions, how many, and how many the model got right (its most likely
// next byte was the true one).
struct Nats {
  double sum = 0;
  long scored = 0, correct = 0;
  void operator+=(const Nats& o) { sum += o.sum, scored += o.scored, correct += o.correct; }
  double bits_per_byte() const { return scored ? sum / scored / std::log(2.0) : 0.0; }
};

// Every prediction, and those made at positions >= late_from.
struct Scores {
  Nats all, late;
};

Scores teacher_forced(const Lab& lab, KvCache& cache, std::span<const int> tokens, int late_from = 0) {
  Model& model = lab.rt.model;
  const int n = static_cast<int>(tokens.size()), vocab = model.config().vocab_size;
  Scores scores;
  for (int pos = 0; pos < n - 1; pos += lab.chunk) {
    const int len = std::min(lab.chunk, n - 1 - pos);  // inputs; the targets are the next len tokens
    const auto logits = model.forward(tokens.subspan(pos, len), pos, &cache, Logits::kAllPositions);
    for (int i = 0; i < len; ++i) {
      const float* row = logits.data() + std::size_t(i) * vocab;
      const int target = tokens[pos + i + 1];
      const Nats one{next_token_nats(row, vocab, target), 1, std::max_element(row, row + vocab) - row == target};
      scores.all += one;
      if (pos + i >= late_from) scores.late += one;
    }
  }
  return scores;
}

// The resident bytes of either kind of cache this chapter builds (-1 off the host).
std::int64_t cache_resident_bytes(const KvCache& cache) {
  if (const auto* ring = dynamic_cast<const SlidingWindowKvCache*>(&cache)) return ring->resident_bytes();
  return static_cast<const ch03::PreallocatedKvCache&>(cache).resident_bytes();
}
std::int64_t cache_allocated_bytes(const KvCache& cache) {
  if (const auto* ring = dynamic_cast<const SlidingWindowKvCache*>(&cache)) return ring->allocated_bytes();
  return static_cast<const ch03::PreallocatedKvCache&>(cache).allocated_bytes();
}

Generation generate_with(const Lab& lab, KvCache& cache, std::span<const int> prompt, int new_tokens,
                         const OnLogits& on_logits = {}) {
  Sampler sampler = lab.rt.new_sampler();
  return generate_cached(lab.rt.model, cache, sampler, prompt, new_tokens, lab.chunk, {}, on_logits);
}

std::string generated_text(const Generation& g, std::size_t prompt_tokens) {
  return decode_bytes(std::span(g.tokens).subspan(prompt_tokens));
}

// The held-out text cut at a line start at or after `offset`.
std::size_t line_start(const std::string& text, std::size_t offset) {
  if (offset == 0) return 0;
  const std::size_t newline = text.find('\n', offset);
  return newline == std::string::npos ? 0 : newline + 1;
}

}  // namespace

Window window_with_sinks(int size, int sinks) { return {size, size > sinks ? sinks : 0}; }

std::unique_ptr<KvCache> make_cache(const Lab& lab, Window window, int max_positions) {
  if (window.size == 0) return std::make_unique<ch03::PreallocatedKvCache>(lab.rt.backend, lab.rt.model.config(), max_positions);
  return std::make_unique<SlidingWindowKvCache>(lab.rt.backend, lab.rt.model.config(), window, lab.chunk, lab.positions);
}

std::string window_name(int size) { return size == 0 ? "full" : std::to_string(size); }

void perplexity_vs_window(const Lab& lab, const std::vector<int>& windows, int sinks, int context, int max_bytes,
                          CsvWriter& csv) {
  const std::vector<int> tokens = encode_bytes(lab.held_out.substr(0, max_bytes));
  const int n = static_cast<int>(tokens.size());
  std::fprintf(stderr, "bits per byte of the first %d held-out bytes, in sequences of %d positions, each through a fresh "
                       "cache, %d positions per call\n\n  %-8s %14s %14s\n", n, context, lab.chunk, "window", "no sinks",
               (std::to_string(sinks) + " sinks").c_str());
  for (int size : windows) {
    std::fprintf(stderr, "  %-8s", window_name(size).c_str());
    for (int column = 0; column < 2; ++column) {  // no sinks, then --sinks
      const int s = column == 0 ? 0 : sinks;
      if (column == 1 && (sinks == 0 || size == 0 || s >= size)) {  // no such configuration (or the first column's)
        std::fprintf(stderr, " %14s", "-");
        continue;
      }
      Nats nats;
      for (int start = 0; start < n - 1; start += context) {
        const int len = std::min(context + 1, n - start);  // context inputs and the byte after the last
        auto cache = make_cache(lab, {size, s}, context);
        nats += teacher_forced(lab, *cache, std::span<const int>(tokens).subspan(start, len)).all;
      }
      std::fprintf(stderr, " %14.4f", nats.bits_per_byte());
      csv.row(window_name(size), s, nats.bits_per_byte(), nats.scored, context);
      csv.commit();  // a long run keeps what it finished
    }
    std::fprintf(stderr, "\n");
  }
}

namespace {

// K passages of `passage_bytes` from long verses of the held-out text, spread over it.
std::vector<std::string> verses(const std::string& text, int count, std::size_t passage_bytes) {
  std::vector<std::string> lines, chosen;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.size() >= passage_bytes) lines.push_back(line.substr(0, passage_bytes));
  for (int k = 0; k < count && !lines.empty(); ++k) chosen.push_back(lines[lines.size() * k / count]);
  return chosen;
}

// K passages of word salad: words of the held-out text (text_probes.h's words_of) drawn at random, joined
// by spaces, cut to `passage_bytes`. Nothing in the language predicts a salad's next word, only an earlier
// occurrence can, so it scores copying alone; a verse is two-thirds predictable without being seen.
// mt19937's raw output, not a <random> distribution: the same passages with every standard library.
std::vector<std::string> word_salads(const std::string& text, int count, std::size_t passage_bytes) {
  const std::vector<std::string> all = words_of(text);
  const std::set<std::string> unique(all.begin(), all.end());
  const std::vector<std::string> words(unique.begin(), unique.end());
  std::mt19937 draw(2023);
  std::vector<std::string> chosen;
  for (int k = 0; k < count; ++k) {
    std::string salad;
    while (salad.size() < passage_bytes) salad += words[draw() % words.size()] + " ";
    chosen.push_back(salad.substr(0, passage_bytes));
  }
  return chosen;
}

// The recall probe's text: a passage (96 bytes) + "\n" + unrelated text + "\n" + the passage again, so
// that each byte of the repeat sits `distance` bytes after its first occurrence (96 + 1 + filler + 1).
// The unrelated text comes from the other half of the held-out text, a different stretch for each k.
std::size_t filler_start(const std::string& held_out, std::size_t k) {
  return line_start(held_out, (held_out.size() / 2 + k * 9973) % held_out.size());
}
std::vector<int> repeat_text(const Lab& lab, const std::string& first, const std::string& passage, std::size_t k,
                             int distance) {
  const int filler = distance - static_cast<int>(passage.size()) - 2;
  return encode_bytes(first + "\n" + lab.held_out.substr(filler_start(lab.held_out, k), filler) + "\n" + passage);
}

constexpr int kPassage = 96, kCue = 32, kPassages = 8;

}  // namespace

int longest_recall_distance(const std::string& held_out) {
  std::size_t room = held_out.size();  // the filler's bytes: what is left of the held-out text after its start
  for (int k = 0; k < kPassages; ++k) room = std::min(room, held_out.size() - filler_start(held_out, k));
  return static_cast<int>(std::min<std::size_t>(room + kPassage + 2, 1 << 30));
}

void recall_vs_window(const Lab& lab, const std::vector<int>& windows, int sinks, const std::vector<int>& distances,
                      CsvWriter& csv) {
  // Teacher-forced, so one early mistake does not decide the score: the share of the second passage's last
  // 64 bytes that the model predicts exactly (its most likely next byte is the true one), given everything
  // before. The first 32 bytes of the repeat are the cue; the last row is the same text without the first
  // occurrence (what the model guesses without having seen the passage). Two kinds of passage: verses, and
  // word salad (copying alone).
  const std::pair<const char*, std::vector<std::string>> kinds[] = {
      {"verses", verses(lab.held_out, kPassages, kPassage)}, {"word salad", word_salads(lab.held_out, kPassages, kPassage)}};
  std::fprintf(stderr, "exact recall: the share of a passage's last %d bytes predicted exactly (teacher-forced) when the\n"
                       "passage was seen `d` bytes earlier; mean of %d passages; windows with %d sinks. [brackets]: W = d,\n"
                       "the smallest window that still holds the first occurrence of every byte to predict (key_visible:\n"
                       "distance < W - sinks; with sinks that edge moves to W = d + sinks)\n",
               kPassage - kCue, kPassages, sinks);
  for (const auto& [kind, chosen] : kinds) {
    std::fprintf(stderr, "\n  %-12s", kind);
    for (int d : distances) std::fprintf(stderr, " %9s", ("d=" + std::to_string(d)).c_str());
    std::fprintf(stderr, "\n");
    std::vector<int> rows = windows;
    rows.push_back(-1);  // no first occurrence, full cache
    for (int size : rows) {
      std::fprintf(stderr, "  %-12s", size < 0 ? "not seen" : window_name(size).c_str());
      for (int distance : distances) {
        long correct = 0, scored = 0;
        for (std::size_t k = 0; k < chosen.size(); ++k) {
          const std::string first = size < 0 ? std::string(kPassage, ' ') : chosen[k];  // not seen: blanks instead
          const std::vector<int> text = repeat_text(lab, first, chosen[k], k, distance);
          const int n = static_cast<int>(text.size()), scored_bytes = kPassage - kCue;
          auto cache = make_cache(lab, window_with_sinks(std::max(size, 0), sinks), n);
          // The last scored_bytes bytes are predicted at the positions just before them.
          const Nats repeat = teacher_forced(lab, *cache, text, n - scored_bytes - 1).late;
          correct += repeat.correct, scored += repeat.scored;
        }
        const double share = double(correct) / scored;
        char cell[16];
        std::snprintf(cell, sizeof cell, size == distance ? "[%.2f]" : "%.2f ", share);
        std::fprintf(stderr, " %9s", cell);
        csv.row(kind, size < 0 ? "not seen" : window_name(size), window_with_sinks(size, sinks).sinks, distance, share,
                chosen.size());
      }
      csv.commit();
      std::fprintf(stderr, "\n");
    }
  }
}

namespace {

// Where each head looks from the bytes of a repeated passage: the weight on the byte after the passage's
// earlier occurrence of the query's byte (what an induction head attends to: it copies that byte), on that
// earlier occurrence itself, and on the byte just before the query (a previous-token head, which is what
// lets an induction head's keys say which byte preceded them). Queries: the repeat's bytes but its last.
struct WhereRepeatsLook final : AttentionObserver {
  int heads, distance, repeat_begin, repeat_end;
  std::vector<double> induction, same_byte, previous;  // (layers, heads), summed over queries
  std::vector<long> queries;                           // (layers)
  // The weights of `traced` queries on the first occurrence's positions 0 .. kPassage - 1, per layer and
  // head, for the text heat map: (traced, layers, heads, kPassage).
  std::vector<int> traced;
  std::vector<float> traced_weights;

  WhereRepeatsLook(int layers, int heads, int distance, int repeat_begin, std::vector<int> traced)
      : heads(heads), distance(distance), repeat_begin(repeat_begin), repeat_end(repeat_begin + kPassage - 1),
        induction(std::size_t(layers) * heads), same_byte(induction.size()), previous(induction.size()), queries(layers),
        traced(std::move(traced)), traced_weights(this->traced.size() * layers * heads * kPassage) {}

  void on_attention(int layer, int pos, int n, const KvView& view, std::span<const float> weights) override {
    for (int i = 0; i < n; ++i) {
      const int q = pos + i;
      if (q < repeat_begin || q >= repeat_end) continue;
      ++queries[layer];
      const auto trace = std::ranges::find(traced, q - repeat_begin);
      for (int h = 0; h < heads; ++h) {
        const float* w = weights.data() + (std::size_t(i) * heads + h) * view.rows;
        const std::size_t at = std::size_t(layer) * heads + h;
        for (int r = 0; r < view.rows; ++r) {
          const int key = view.position_of(r);
          if (key == q - distance + 1) induction[at] += w[r];
          if (key == q - distance) same_byte[at] += w[r];
          if (key == q - 1) previous[at] += w[r];
          if (trace != traced.end() && key >= 0 && key < kPassage)
            traced_weights[((std::size_t(trace - traced.begin()) * queries.size() + layer) * heads + h) * kPassage + key] = w[r];
        }
      }
    }
  }
};

// A weight as a character, darker for more: the text heat map's scale.
char shade(float weight) {
  constexpr const char* kShades = " .:-=+*#%@";
  return kShades[std::clamp(static_cast<int>(weight * 10), 0, 9)];
}

}  // namespace

void induction_heads(const Lab& lab, int distance, CsvWriter& csv) {
  const ModelConfig& c = lab.rt.model.config();
  const std::vector<std::string> salads = word_salads(lab.held_out, kPassages, kPassage);
  const std::vector<int> traced = {40, 60, 80};  // repeat bytes whose attention the heat map shows
  WhereRepeatsLook look(c.n_layers, c.n_heads, distance, distance, traced);
  for (std::size_t k = 0; k < salads.size(); ++k) {
    if (k == 1) look.traced.clear();  // the heat map shows the first passage
    const std::vector<int> text = repeat_text(lab, salads[k], salads[k], k, distance);
    auto cache = make_cache(lab, {0, 0}, static_cast<int>(text.size()));
    lab.rt.model.observe_attention(&look);
    teacher_forced(lab, *cache, text);
    lab.rt.model.observe_attention(nullptr);
  }
  std::fprintf(stderr, "where each head looks from the bytes of a repeated word salad (%d passages of %d bytes, seen %d bytes\n"
                       "earlier, full cache); mean attention weight per query on:\n"
                       "  next      the byte after the earlier occurrence of the query's byte (what an induction head copies)\n"
                       "  same      that earlier occurrence itself\n"
                       "  previous  the byte just before the query (a previous-token head)\n\n"
                       "  %-6s %-5s %8s %8s %9s   next, as a bar\n", kPassages, kPassage, distance, "layer", "head", "next",
               "same", "previous");
  std::size_t best = 0;
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_heads; ++h) {
      const std::size_t at = std::size_t(l) * c.n_heads + h;
      const double q = double(look.queries[l]), next = look.induction[at] / q;
      if (next > look.induction[best] / look.queries[best / c.n_heads]) best = at;
      std::fprintf(stderr, "  %-6d %-5d %8.3f %8.3f %9.3f   %s\n", l, h, next, look.same_byte[at] / q, look.previous[at] / q,
                   std::string(static_cast<std::size_t>(std::lround(next * 40)), '#').c_str());
      csv.row(l, h, next, look.same_byte[at] / q, look.previous[at] / q, distance);
    }
  csv.commit();
  const int layer = static_cast<int>(best / c.n_heads), head = static_cast<int>(best % c.n_heads);
  std::fprintf(stderr, "\nthe head with the most weight on the byte to copy: layer %d, head %d. Its attention from three bytes of\n"
                       "the repeat onto the passage's first occurrence (darker: more weight, scale \" .:-=+*#%%@\" in tenths;\n"
                       "^ marks the byte after the query's own earlier occurrence, the one to predict):\n\n"
                       "  %-20s |%s|\n", layer, head, "first occurrence", salads[0].c_str());
  for (std::size_t t = 0; t < traced.size(); ++t) {
    std::string bar(kPassage, ' '), mark(kPassage, ' ');
    for (int key = 0; key < kPassage; ++key)
      bar[key] = shade(look.traced_weights[((t * c.n_layers + layer) * c.n_heads + head) * kPassage + key]);
    mark[traced[t] + 1] = '^';
    const std::string query = "query '" + salads[0].substr(traced[t], 1) + "' (byte " + std::to_string(traced[t]) + ")";
    std::fprintf(stderr, "  %-20s |%s|\n  %-20s |%s|\n", query.c_str(), bar.c_str(), "", mark.c_str());
  }
}

void topic_and_fluency(const Lab& lab, const std::vector<int>& windows, int sinks, int new_tokens, CsvWriter& csv) {
  constexpr int kPrompts = 16, kPromptBytes = 1024;
  const Lexicon lexicon(lab.held_out);
  std::vector<std::string> prompts;
  for (int k = 0; k < kPrompts; ++k)
    prompts.push_back(lab.held_out.substr(line_start(lab.held_out, lab.held_out.size() * k / kPrompts), kPromptBytes));
  std::fprintf(stderr, "%d prompts of %d held-out bytes, %d new bytes each (the run's sampling settings), %d sinks\n"
                       "  local fluency: the share of generated words that are words of the held-out text\n"
                       "  topic: of the proper names generated, the share that the prompt contains\n\n"
                       "  %-8s %14s %8s %14s %8s\n", kPrompts, kPromptBytes, new_tokens, sinks, "window", "known words", "words",
               "names in prompt", "names");
  for (int size : windows) {
    int words = 0, names = 0;
    double known = 0, from_prompt = 0;
    for (const std::string& text : prompts) {
      const std::vector<int> prompt = encode_bytes(text);
      auto cache = make_cache(lab, window_with_sinks(size, sinks), int(prompt.size()) + new_tokens);
      const std::string continuation = generated_text(generate_with(lab, *cache, prompt, new_tokens), prompt.size());
      const ProbeScore fluency = known_word_share(continuation, lexicon);
      const ProbeScore topic = names_from_prompt_share(text, continuation, lexicon);
      words += fluency.counted, known += fluency.share * fluency.counted;
      names += topic.counted, from_prompt += topic.share * topic.counted;
    }
    const double known_share = words ? known / words : 0, prompt_share = names ? from_prompt / names : 0;
    std::fprintf(stderr, "  %-8s %14.3f %8d %14.3f %8d\n", window_name(size).c_str(), known_share, words, prompt_share, names);
    csv.row(window_name(size), window_with_sinks(size, sinks).sinks, known_share, words, prompt_share, names);
    csv.commit();
  }
}

namespace {

// The attention weight queries put on positions 0 .. first-1, per layer, for queries at positions >= from,
// and what an even spread over the rows each query sees would give them.
struct FirstPositionsAttention final : AttentionObserver {
  int first, from;
  std::vector<double> weight, uniform;
  std::vector<long> queries;
  FirstPositionsAttention(int layers, int first, int from)
      : first(first), from(from), weight(layers), uniform(layers), queries(layers) {}

  void on_attention(int layer, int pos, int n, const KvView& view, std::span<const float> weights) override {
    const int heads = static_cast<int>(weights.size() / (std::size_t(n) * view.rows));
    for (int i = 0; i < n; ++i) {
      if (pos + i < from) continue;
      int visible = 0, visible_first = 0;
      for (int r = 0; r < view.rows; ++r)
        if (key_visible(pos + i, view.position_of(r), view.window)) {
          ++visible;
          visible_first += view.position_of(r) < first;
        }
      for (int h = 0; h < heads; ++h) {
        const float* w = weights.data() + (std::size_t(i) * heads + h) * view.rows;
        for (int r = 0; r < view.rows; ++r)
          if (view.position_of(r) >= 0 && view.position_of(r) < first) weight[layer] += w[r];
        uniform[layer] += double(visible_first) / visible;
        ++queries[layer];
      }
    }
  }
};

}  // namespace

void stream_past_context(const Lab& lab, Window window, int stream_bytes, CsvWriter& csv) {
  const ModelConfig& c = lab.rt.model.config();
  const std::vector<int> tokens = encode_bytes(lab.held_out.substr(0, stream_bytes));
  const int n = static_cast<int>(tokens.size()), first = std::max(window.sinks, 1);
  std::fprintf(stderr, "one stream of %d held-out bytes (%.1f x the trained context of %d), teacher-forced\n\n", n,
               double(n) / c.seq_len, c.seq_len);

  // The baseline a full cache allows: restart every seq_len positions (the model's own context).
  Scores restarted;
  for (int start = 0; start < n - 1; start += c.seq_len) {
    auto cache = make_cache(lab, {0, 0}, c.seq_len);
    const int len = std::min(c.seq_len + 1, n - start);
    const Scores chunk = teacher_forced(lab, *cache, std::span<const int>(tokens).subspan(start, len));
    restarted.all += chunk.all;
    if (start >= c.seq_len) restarted.late += chunk.all;
  }
  auto report = [&](const std::string& config, int size, int sinks, const Scores& s) {
    std::fprintf(stderr, "  %-46s %8.4f bits/byte, %.4f past position %d\n", config.c_str(), s.all.bits_per_byte(),
                 s.late.bits_per_byte(), c.seq_len);
    csv.row("bits_per_byte", config, size, sinks, "", s.all.bits_per_byte(), "");
    csv.row("bits_per_byte_past_context", config, size, sinks, "", s.late.bits_per_byte(), "");
  };
  report("full cache, restarted every " + std::to_string(c.seq_len), 0, 0, restarted);

  std::vector<int> sink_counts = {0};
  if (window.sinks > 0) sink_counts.push_back(window.sinks);
  for (int sinks : sink_counts) {
    SlidingWindowKvCache cache(lab.rt.backend, c, {window.size, sinks}, lab.chunk, KeyPositions::kWithinWindow);
    FirstPositionsAttention observer(c.n_layers, first, window.size);  // queries past the window
    lab.rt.model.observe_attention(&observer);
    const Scores s = teacher_forced(lab, cache, tokens, c.seq_len);
    lab.rt.model.observe_attention(nullptr);
    const std::string config = "window " + std::to_string(window.size) + ", " + std::to_string(sinks) + " sinks";
    report(config, window.size, sinks, s);
    if (sinks > 0)
      for (int l = 0; l < c.n_layers; ++l)
        csv.row("attention_on_first_positions", config, window.size, sinks, l, observer.weight[l] / observer.queries[l],
                observer.uniform[l] / observer.queries[l]);
  }

  // Does this model have attention sinks? With a full cache, inside the trained context: the weight the
  // first positions get from queries far from them, against an even spread.
  auto full = make_cache(lab, {0, 0}, c.seq_len);
  FirstPositionsAttention observer(c.n_layers, first, c.seq_len / 4);
  lab.rt.model.observe_attention(&observer);
  teacher_forced(lab, *full, std::span<const int>(tokens).subspan(0, std::min(n, c.seq_len)));
  lab.rt.model.observe_attention(nullptr);
  std::fprintf(stderr, "\nattention on the first %d positions, full cache, queries at positions %d..%d (mean over heads):\n"
                       "  %-6s %10s %14s %8s\n", first, c.seq_len / 4, std::min(n, c.seq_len) - 2, "layer", "weight",
               "even spread", "ratio");
  for (int l = 0; l < c.n_layers; ++l) {
    const double w = observer.weight[l] / observer.queries[l], even = observer.uniform[l] / observer.queries[l];
    std::fprintf(stderr, "  %-6d %10.4f %14.4f %8.1f\n", l, w, even, w / even);
    csv.row("attention_on_first_positions", "full cache", 0, first, l, w, even);
  }
  csv.commit();
}

void memory_vs_length(const Lab& lab, Window window, int new_tokens, CsvWriter& csv) {
  const ModelConfig& c = lab.rt.model.config();
  const std::vector<int>& prompt = lab.rt.prompt;
  constexpr int kBlock = 256;  // steps per row
  std::fprintf(stderr, "  %-10s %9s %10s %10s %14s %14s %12s\n", "cache", "generated", "p50 ms", "p99 ms", "allocated",
               "resident", "peak RSS");
  for (const Window w : {window, Window{0, 0}}) {  // the window first: peak RSS only grows
    // The full cache cannot go past the trained context; the window can, with within-window positions.
    const int tokens = w.size == 0 ? std::min(new_tokens, c.seq_len - int(prompt.size())) : new_tokens;
    auto cache = make_cache(lab, w, int(prompt.size()) + tokens);
    std::vector<std::int64_t> resident, rss;  // (tokens / kBlock, rounded up) a row each, reserved: no allocation in the run
    resident.reserve(tokens / kBlock + 1), rss.reserve(tokens / kBlock + 1);
    const Generation g = generate_with(lab, *cache, prompt, tokens, [&](int step, std::span<const float>) {
      if ((step + 1) % kBlock == 0 || step + 1 == tokens) resident.push_back(cache_resident_bytes(*cache)), rss.push_back(kvs::peak_resident_bytes());
    });
    const std::string name = w.size == 0 ? "full" : "window " + std::to_string(w.size);
    for (std::size_t b = 0; b < resident.size(); ++b) {
      const std::size_t end = std::min<std::size_t>((b + 1) * kBlock, g.step_ms.size()), begin = std::max<std::size_t>(1, b * kBlock);
      const std::vector<double> block(g.step_ms.begin() + begin, g.step_ms.begin() + end);  // decode steps only
      const double p50 = percentile(block, 50), p99 = percentile(block, 99);
      std::fprintf(stderr, "  %-10s %9zu %10.4f %10.4f %14s %14s %12s\n", name.c_str(), end, p50, p99,
                   format_bytes(double(cache_allocated_bytes(*cache))).c_str(),
                   resident[b] < 0 ? "-" : format_bytes(double(resident[b])).c_str(), format_bytes(double(rss[b])).c_str());
      csv.row(name, end, p50, p99, cache_allocated_bytes(*cache), resident[b], rss[b]);
    }
    csv.commit();
  }
}

void samples(const Lab& lab, const std::vector<int>& windows, int sinks, int new_tokens) {
  for (int size : windows) {
    const Window w = window_with_sinks(size, sinks);
    auto cache = make_cache(lab, w, int(lab.rt.prompt.size()) + new_tokens);
    const Generation g = generate_with(lab, *cache, lab.rt.prompt, new_tokens);
    std::printf("--- window %s%s ---\n%s\n\n", window_name(size).c_str(),
                w.sinks ? (", " + std::to_string(w.sinks) + " sinks").c_str() : "", decode_bytes(g.tokens).c_str());
    std::fflush(stdout);
  }
}

}  // namespace kvs::ch04
