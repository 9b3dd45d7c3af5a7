// Chapter 04's ring cache: it equals a full cache masked to the same window (the brute-force reference)
// across the wrap points, with and without sinks; chunked prefill through the ring equals token-by-token
// filling; a window as long as the sequence is the full cache; memory stays the slots it was built with.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "04_sliding_window/sliding_window_kv_cache.h"
#include "04_sliding_window/text_probes.h"
#include "cli.h"
#include "cpu_backend.h"
#include "equivalence.h"
#include "generate.h"
#include "model.h"
#include "test_backends.h"
#include "test_util.h"
#include "tokenizer.h"

using namespace kvs;

namespace {

// The brute-force reference: every position kept (a full-length cache), the window applied as a mask only.
// With rotate_at_read, keys are kept unrotated and rotated by attention at their positions within the
// window, as the within-window ring does; only the ring's slot arithmetic is missing.
struct MaskedFullCache final : KvCache {
  ch03::PreallocatedKvCache full;
  Window window;
  Buffer table;  // backend memory: [cos, sin] of positions 0 .. w.size - 1, when rotating at read time
  MaskedFullCache(Backend& b, const ModelConfig& c, int n, Window w, bool rotate_at_read = false)
      : full(b, c, n), window(w), table(rotate_at_read ? test::to_backend(b, test::rope_table(w.size, c.head_dim())) : Buffer{}) {}
  void prepare(int pos, int n) override { full.prepare(pos, n); }
  void write(int layer, int pos, int n, const int* positions, const float* k, const float* v) override {
    full.write(layer, pos, n, positions, k, v);
  }
  KvView view(int layer) const override {
    KvView v = full.view(layer);
    v.window = window;
    v.read_rope = table.size() ? table.data() : nullptr;
    return v;
  }
  int length() const override { return full.length(); }
  KvRow row(int layer, int position) override { return full.row(layer, position); }
  bool rotates_at_read() const override { return table.size() > 0; }
};

// Logits of every position of `tokens`, fed through `cache` in calls of `chunk` positions.
std::vector<float> all_logits(Model& model, KvCache& cache, const std::vector<int>& tokens, int chunk) {
  std::vector<float> out;
  const int n = static_cast<int>(tokens.size());
  for (int pos = 0; pos < n; pos += chunk) {
    const auto logits = model.forward(std::span<const int>(tokens).subspan(pos, std::min(chunk, n - pos)), pos, &cache,
                                      Logits::kAllPositions);
    out.insert(out.end(), logits.begin(), logits.end());
  }
  return out;
}

std::vector<int> random_tokens(int n, int vocab, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<int> tokens(n);
  for (int& t : tokens) t = static_cast<int>(gen() % vocab);
  return tokens;
}

// The same model, the same keys; only the order of rows in attention's sums differs (ring slots against
// positions), which moves logits of magnitude ~10 by ~1e-6. A missing, stale or extra key moves them by
// far more than 1e-4.
constexpr float kTolerance = 1e-4f;

}  // namespace

TEST_CASE("sliding window: the ring equals a full cache masked to the window, across the wrap points, on every backend") {
  const Checkpoint checkpoint(test::golden_path("gqa.bin"));  // 3 query heads per KV head
  const ModelConfig& c = checkpoint.config();
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    Model model(checkpoint, backend);
    const int W = 13;  // not a power of two
    // Within-window positions: the reference keeps unrotated keys and rotates them the same way; only the
    // ring's slot arithmetic differs.
    for (const ch04::KeyPositions positions : {ch04::KeyPositions::kAbsolute, ch04::KeyPositions::kWithinWindow})
      for (const Window window : {Window{W, 0}, Window{W, 4}})
        for (int length : test::sanitizer_run() ? std::vector<int>{W, W + 1, 2 * W + 1}  // the wraps, in less time
                                                : std::vector<int>{W - 1, W, W + 1, 2 * W, 2 * W + 1}) {
          CAPTURE(ch04::to_string(positions));
          CAPTURE(window.sinks);
          CAPTURE(length);
          const std::vector<int> tokens = random_tokens(length, c.vocab_size, length);
          MaskedFullCache reference(backend, c, length, window, positions == ch04::KeyPositions::kWithinWindow);
          const std::vector<float> expected = all_logits(model, reference, tokens, 1);
          for (int chunk : {1, 5, length}) {  // token by token, in chunks, in one call
            CAPTURE(chunk);
            ch04::SlidingWindowKvCache ring(backend, c, window, chunk, positions);
            CHECK(ring.slots() == W + chunk - 1);
            CHECK(max_abs_difference(expected, all_logits(model, ring, tokens, chunk)) <= kTolerance);
          }
        }
  });
}

TEST_CASE("sliding window: the window matters - past it, a ring and a full unmasked cache disagree, on every backend") {
  const Checkpoint checkpoint(test::golden_path("gqa.bin"));
  const ModelConfig& c = checkpoint.config();
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    Model model(checkpoint, backend);
    const std::vector<int> tokens = random_tokens(30, c.vocab_size, 3);
    ch03::PreallocatedKvCache full(backend, c, 30);
    ch04::SlidingWindowKvCache ring(backend, c, {8, 0}, 1);
    const std::vector<float> a = all_logits(model, full, tokens, 1), b = all_logits(model, ring, tokens, 1);
    const std::size_t inside = std::size_t(8) * c.vocab_size;  // the first 8 positions see everything in both
    CHECK(max_abs_difference({a.begin(), a.begin() + inside}, {b.begin(), b.begin() + inside}) <= kTolerance);
    CHECK(max_abs_difference(a, b) > 100 * kTolerance);
  });
}

TEST_CASE("sliding window: both position variants agree until the first eviction, then differ only with sinks, on every backend") {
  const Checkpoint checkpoint(test::golden_path("gqa.bin"));
  const ModelConfig& c = checkpoint.config();
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    Model model(checkpoint, backend);
    const int W = 16;
    const std::vector<int> tokens = random_tokens(3 * W, c.vocab_size, 9);
    const std::size_t before_eviction = std::size_t(W) * c.vocab_size;  // positions 0 .. W-1 see every key
    for (int sinks : {0, 4}) {
      CAPTURE(sinks);
      ch04::SlidingWindowKvCache absolute(backend, c, {W, sinks}, 1), within(backend, c, {W, sinks}, 1,
                                                                            ch04::KeyPositions::kWithinWindow);
      const std::vector<float> a = all_logits(model, absolute, tokens, 1), b = all_logits(model, within, tokens, 1);
      CHECK(max_abs_difference({a.begin(), a.begin() + before_eviction}, {b.begin(), b.begin() + before_eviction}) <= kTolerance);
      // RoPE scores depend on the distance between query and key only: without sinks every distance is the
      // true one in both variants, so they stay equal; sinks sit closer in the within-window variant.
      if (sinks == 0) CHECK(max_abs_difference(a, b) <= kTolerance);
      else CHECK(max_abs_difference(a, b) > 100 * kTolerance);
    }
    // Greedy tokens on the shipped model, a prompt shorter than the window: the same text.
    const Checkpoint kjv(find_data_file("kjv-gpt.bin"));
    Model kjv_model(kjv, backend);
    const std::vector<int> prompt = encode_bytes("And God said, ");
    ch04::SlidingWindowKvCache absolute(backend, kjv.config(), {64, 4}, 1),
        within(backend, kjv.config(), {64, 4}, 1, ch04::KeyPositions::kWithinWindow);
    Sampler s1(256, {}), s2(256, {});
    const Generation a = generate_cached(kjv_model, absolute, s1, prompt, 64 - int(prompt.size()), 1);
    const Generation b = generate_cached(kjv_model, within, s2, prompt, 64 - int(prompt.size()), 1);
    CHECK(a.tokens == b.tokens);
  });
}

TEST_CASE("sliding window, within-window positions: generation runs past the trained context in the same memory, on every backend") {
  const Checkpoint checkpoint(test::golden_path("gqa.bin"));
  const ModelConfig& c = checkpoint.config();
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    // Under the sanitizers past the context by 4 windows' rings, not twice the context: the same wraps, the same
    // positions past the trained ones, in less time (the harness's part of this test took 48 s of the suite).
    const int length = test::sanitizer_run() ? c.seq_len + 4 * (8 + 4 - 1) : 3 * c.seq_len;
    Model model(checkpoint, backend, 4, length);  // attention over the reference's rows: every position
    ch04::SlidingWindowKvCache cache(backend, c, {8, 2}, 4, ch04::KeyPositions::kWithinWindow);
    Sampler sampler(c.vocab_size, {});
    const Generation g = generate_cached(model, cache, sampler, random_tokens(6, c.vocab_size, 5), length - 6, 4);
    CHECK(cache.length() == length - 1);  // the last token generated is not fed back
    CHECK(cache.allocated_bytes() == kv_cache_bytes(c, 8 + 4 - 1));
    REQUIRE(g.tokens.size() == std::size_t(length));
    // Past the context too, every position's logits are the masked full cache's, rotating its keys the same way (a
    // token always in range proves nothing: greedy argmax picks one even from NaN logits).
    ch04::SlidingWindowKvCache ring(backend, c, {8, 2}, 4, ch04::KeyPositions::kWithinWindow);
    MaskedFullCache reference(backend, c, length, {8, 2}, /*rotate_at_read=*/true);
    CHECK(max_abs_difference(all_logits(model, reference, g.tokens, 1), all_logits(model, ring, g.tokens, 4)) <= kTolerance);
    CHECK_THROWS_WITH(ch04::SlidingWindowKvCache(backend, c, {c.seq_len + 1, 0}, 1, ch04::KeyPositions::kWithinWindow),
                      doctest::Contains("past the model's trained context"));
  });
}

TEST_CASE("sliding window: a window as long as the sequence is the full cache, tokens and logits") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const ModelConfig& c = checkpoint.config();
  CpuBackend backend(test::test_threads());
  Model model(checkpoint, backend, 0, c.seq_len + 15);  // the ring shows its seq_len + 16 - 1 slots
  const std::vector<int> prompt = encode_bytes("And God said, Let there be light: and there was light. And God saw");
  const int new_tokens = test::sanitizer_run() ? 30 : 100;  // under the sanitizers the same comparison, shorter
  std::vector<std::vector<float>> full_logits, ring_logits;
  ch03::PreallocatedKvCache full(backend, c, int(prompt.size()) + new_tokens);
  ch04::SlidingWindowKvCache ring(backend, c, {c.seq_len, 0}, 16);
  Sampler s1(256, {}), s2(256, {});
  const Generation a = generate_cached(model, full, s1, prompt, new_tokens, 16, {},
                                       [&](int, std::span<const float> l) { full_logits.emplace_back(l.begin(), l.end()); });
  const Generation b = generate_cached(model, ring, s2, prompt, new_tokens, 16, {},
                                       [&](int, std::span<const float> l) { ring_logits.emplace_back(l.begin(), l.end()); });
  CHECK(a.tokens == b.tokens);
  float worst = 0;
  for (std::size_t s = 0; s < full_logits.size(); ++s) worst = worst_difference(worst, max_abs_difference(full_logits[s], ring_logits[s]));
  CHECK(worst <= kTolerance);
}

TEST_CASE("sliding window: position-tagged keys - each query sees exactly its window, sinks never evicted") {
  const ModelConfig c{.dim = 8, .hidden_dim = 8, .n_layers = 2, .n_heads = 2, .n_kv_heads = 1, .vocab_size = 4,
                      .seq_len = 1000};
  const int kv_dim = c.kv_dim();
  CpuBackend backend(1);
  for (int W : {1, 2, 3, 8, 64})
    for (int sinks : {0, 1, 4}) {
      if (sinks >= W) continue;
      CAPTURE(W);
      CAPTURE(sinks);
      const Window window{W, sinks};
      ch04::SlidingWindowKvCache cache(backend, c, window, 1);
      CHECK(cache.allocated_bytes() == kv_cache_bytes(c, W));  // decode only: exactly W slots
      std::vector<float> k(kv_dim), v(kv_dim);
      for (int pos = 0; pos < 3 * W; ++pos) {
        CAPTURE(pos);
        cache.prepare(pos, 1);
        for (int layer = 0; layer < c.n_layers; ++layer) {
          for (int j = 0; j < kv_dim; ++j) k[j] = float(layer * 100000 + pos * 10 + j), v[j] = -k[j];
          cache.write(layer, pos, 1, &pos, k.data(), v.data());  // a CPU cache: &pos is backend memory
        }
        // The query at `pos` must see exactly the positions key_visible allows, each with its own key.
        std::set<int> expected, seen;
        for (int key = 0; key <= pos; ++key)
          if (key_visible(pos, key, window)) expected.insert(key);
        for (int layer = 0; layer < c.n_layers; ++layer) {
          const KvView view = cache.view(layer);
          seen.clear();
          for (int r = 0; r < view.rows; ++r) {
            const int p = view.position_of(r);
            if (!key_visible(pos, p, view.window)) continue;
            seen.insert(p);
            CHECK(view.keys[std::size_t(r) * view.row_stride] == float(layer * 100000 + p * 10));
            CHECK(view.values[std::size_t(r) * view.row_stride + 1] == -float(layer * 100000 + p * 10 + 1));
          }
          CHECK(seen == expected);
        }
      }
    }
}

TEST_CASE("sliding window: after 10 W tokens the cache is still its slots, and past the context it refuses") {
  const Checkpoint checkpoint(test::golden_path("gqa.bin"));
  const ModelConfig& c = checkpoint.config();
  CpuBackend backend(1);
  Model model(checkpoint, backend);
  ch04::SlidingWindowKvCache cache(backend, c, {8, 2}, 4);
  Sampler sampler(c.vocab_size, {});
  const std::vector<int> prompt = random_tokens(6, c.vocab_size, 5);
  generate_cached(model, cache, sampler, prompt, 80, 4);  // 85 positions cached, 10 windows
  CHECK(cache.length() == 85);
  CHECK(cache.allocated_bytes() == kv_cache_bytes(c, 8 + 4 - 1));
  CHECK(cache.resident_bytes() <= cache.allocated_bytes() + 2 * 4096);
  CHECK_THROWS_WITH(cache.prepare(85, 12), doctest::Contains("calls of at most 4"));
  CHECK_THROWS_WITH(cache.prepare(84, 1), doctest::Contains("a ring can only append"));
  CHECK_THROWS_WITH(cache.prepare(85, c.seq_len), doctest::Contains("calls of at most 4"));
  ch04::SlidingWindowKvCache tail(backend, c, {8, 2}, 1);
  for (int pos = 0; pos < c.seq_len; ++pos) tail.prepare(pos, 1);
  CHECK_THROWS_WITH(tail.prepare(c.seq_len, 1), doctest::Contains("past the model's trained context"));
  CHECK_THROWS_WITH(ch04::SlidingWindowKvCache(backend, c, {4, 4}, 1), doctest::Contains("0 <= sinks < window"));
}

TEST_CASE("attention observer: every layer's weights, summing to 1 over the visible rows, and observing changes nothing") {
  const Checkpoint checkpoint(test::golden_path("gqa.bin"));
  const ModelConfig& c = checkpoint.config();
  CpuBackend backend(1);
  Model model(checkpoint, backend, 4);
  struct Recorder final : AttentionObserver {
    int heads = 0, calls = 0;
    double worst_sum_error = 0, hidden_weight = 0;
    void on_attention(int, int pos, int n, const KvView& view, std::span<const float> weights) override {
      ++calls;
      REQUIRE(weights.size() == std::size_t(n) * heads * view.rows);
      for (int i = 0; i < n; ++i)
        for (int h = 0; h < heads; ++h) {
          double sum = 0;
          for (int r = 0; r < view.rows; ++r) {
            const float w = weights[(std::size_t(i) * heads + h) * view.rows + r];
            if (key_visible(pos + i, view.position_of(r), view.window)) sum += w;
            else hidden_weight += std::abs(w);
          }
          worst_sum_error = worst_difference(worst_sum_error, std::abs(sum - 1));  // NaN stays NaN (std::max drops it)
        }
    }
  } recorder;
  recorder.heads = c.n_heads;
  const std::vector<int> tokens = random_tokens(30, c.vocab_size, 4);
  ch04::SlidingWindowKvCache plain(backend, c, {8, 2}, 4), observed(backend, c, {8, 2}, 4);
  const std::vector<float> want = all_logits(model, plain, tokens, 4);
  model.observe_attention(&recorder);
  const std::vector<float> got = all_logits(model, observed, tokens, 4);
  model.observe_attention(nullptr);
  CHECK(got == want);
  CHECK(recorder.calls == c.n_layers * 8);  // 30 positions in calls of 4: 8 calls
  CHECK(recorder.worst_sum_error < 1e-5);
  CHECK(recorder.hidden_weight == 0);
}

TEST_CASE("chapter 04's text probes: known words, names from the prompt") {
  const ch04::Lexicon lexicon("And Paul said unto the saints at Ephesus, and the Lord and my lord said");
  CHECK(lexicon.is_name("Paul"));
  CHECK(lexicon.is_name("Ephesus"));
  CHECK_FALSE(lexicon.is_name("And"));   // also written "and"
  CHECK_FALSE(lexicon.is_name("Lord"));  // also written "lord"
  const ch04::ProbeScore fluency = ch04::known_word_share("Paul said xqzt unto", lexicon);
  CHECK(fluency.counted == 4);
  CHECK(fluency.share == doctest::Approx(0.75));
  const ch04::ProbeScore topic = ch04::names_from_prompt_share("Paul wrote", "Paul and Ephesus and Paul", lexicon);
  CHECK(topic.counted == 3);
  CHECK(topic.share == doctest::Approx(2.0 / 3));
  CHECK(ch04::names_from_prompt_share("x", "no names here", lexicon).counted == 0);
}
