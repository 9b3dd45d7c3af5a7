// Cached greedy decoding reproduces naive decoding token for token, for every cache policy and prefill
// chunking, on the shipped model and on a random GQA checkpoint with awkward sizes.
//
// The check itself (tolerance, near-ties) is common/equivalence.h's: chapter 06 runs the same one.
#include <doctest/doctest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "02_dynamic_cache/growing_kv_cache.h"
#include "03_preallocated_cache/malloc_counter.h"
#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "04_sliding_window/sliding_window_kv_cache.h"
#include "08_paged_batching/paged_kv_cache.h"
#include "10_quantized_cache/quantized_kv_cache.h"
#include "cli.h"
#include "cpu_backend.h"
#include "equivalence.h"
#include "generate.h"
#include "test_backends.h"
#include "test_util.h"
#include "tokenizer.h"

using namespace kvs;

namespace {

using Run = RecordedRun;

// Compares `run` with the naive `reference`; returns the number of steps compared.
int compare(const Run& reference, const Run& run, int prompt_len, float& worst) {
  const Equivalence e = check_equivalence(reference, run, prompt_len);
  CHECK(e.first_token_mismatch == -1);
  worst = worst_difference(worst, e.worst_logit_difference);
  return e.steps - (e.near_tie >= 0 ? 1 : 0);  // tokens compared before the first near-tie
}

using test::validation_text;

// Every cache policy on `backend_name` reproduces naive greedy decoding on the CPU (on a backend other than
// the CPU, naive decoding there too).
void check_all_policies(const std::string& model_path, const std::vector<std::string>& prompts, int new_tokens,
                        const std::string& backend_name = "cpu") {
  const Checkpoint checkpoint(model_path);
  const ModelConfig& c = checkpoint.config();
  CpuBackend cpu(test::test_threads());
  Model cpu_model(checkpoint, cpu);
  const std::unique_ptr<Backend> other = backend_name == "cpu" ? nullptr : test::make_test_backend(backend_name);
  Backend& backend = other ? *other : cpu;
  std::optional<Model> other_model;
  if (other) other_model.emplace(checkpoint, *other);
  Model& model = other ? *other_model : cpu_model;
  for (const std::string& text : prompts) {
    const std::vector<int> prompt = encode_bytes(text);
    const int n = static_cast<int>(prompt.size());
    REQUIRE(n + new_tokens <= c.seq_len);
    CAPTURE(n);
    auto sampler = [&] { return Sampler(c.vocab_size, {}); };
    const Run naive = record([&](const OnLogits& on_logits) {
      Sampler s = sampler();
      return generate_naive(cpu_model, s, prompt, new_tokens, {}, on_logits);
    });
    struct Method {
      std::string name;
      std::function<std::unique_ptr<KvCache>()> make;
      int prefill_chunk;
    };
    std::vector<Method> methods = {
        {"concatenate", [&] { return std::make_unique<ch02::GrowingKvCache>(backend, c, ch02::Growth::kConcatenate); }, 0},
        {"chunked growth", [&] { return std::make_unique<ch02::GrowingKvCache>(backend, c, ch02::Growth::kChunked); }, 0},
        {"geometric growth", [&] { return std::make_unique<ch02::GrowingKvCache>(backend, c, ch02::Growth::kGeometric); }, 0},
        {"preallocated", [&] { return std::make_unique<ch03::PreallocatedKvCache>(backend, c, n + new_tokens); }, 0},
        {"prefill C=1", [&] { return std::make_unique<ch03::PreallocatedKvCache>(backend, c, n + new_tokens); }, 1},
        {"prefill C=7", [&] { return std::make_unique<ch03::PreallocatedKvCache>(backend, c, n + new_tokens); }, 7},
        {"prefill C=64", [&] { return std::make_unique<ch03::PreallocatedKvCache>(backend, c, n + new_tokens); }, 64},
    };
    if (other) methods.insert(methods.begin(), Method{"naive", nullptr, 0});
    // The CUDA harness runs every kernel thread as a fiber: slow. The policies differ only on the host
    // side (covered on the CPU); one of each kind of view and write is enough there.
    if (backend_name == "cuda-harness")
      std::erase_if(methods, [](const Method& m) {
        return m.name != "naive" && m.name != "concatenate" && m.name != "preallocated" && m.name != "prefill C=7";
      });
    for (const Method& m : methods) {
      CAPTURE(m.name);
      const Run cached = record([&](const OnLogits& on_logits) {
        Sampler s = sampler();
        if (!m.make) return generate_naive(model, s, prompt, new_tokens, {}, on_logits);
        auto cache = m.make();
        return generate_cached(model, *cache, s, prompt, new_tokens, m.prefill_chunk, {}, on_logits);
      });
      float worst = 0;
      const int compared = compare(naive, cached, n, worst);
      MESSAGE(backend_name << ", " << m.name << ", prompt " << n << ": " << compared << " of " << new_tokens
                     << " tokens identical before the first near-tie; largest logit difference " << worst);
      CHECK(worst <= kLogitTolerance);
      CHECK(compared >= std::min(new_tokens, 50));  // a near-tie this early would make the test toothless
    }
  }
}

}  // namespace

TEST_CASE("equivalence: every cache policy reproduces naive greedy decoding on the shipped model") {
  const std::string valid = validation_text();
  // Under the sanitizers the same comparison, shorter: naive decoding recomputes every position at every step,
  // so its cost is new tokens x positions (50 tokens after 1,030 took 651 s of the suite's 14 minutes). 20
  // tokens after 1,010 still make the geometric cache double while decoding (at 1,011 positions). (The chunked
  // cache reserves 2,048 positions at its first prefill, this model's whole context: it reallocates only in
  // test_caches.cpp, on a model of 4,096.)
  if (test::sanitizer_run())
    check_all_policies(find_data_file("kjv-gpt.bin"), {"And God said, ", valid.substr(5000, 1010)}, 20);
  else
    check_all_policies(find_data_file("kjv-gpt.bin"),
                       {"And God said, ", valid.substr(0, 300), valid.substr(5000, 1100)}, 200);
}

TEST_CASE("equivalence: the same on a random GQA checkpoint (3 query heads per KV head, odd sizes)") {
  std::string prompt;
  for (int i = 0; i < 70; ++i) prompt.push_back(static_cast<char>((i * 37 + 11) % 256));
  check_all_policies(test::golden_path("gqa.bin"), {prompt.substr(0, 5), prompt}, 96 - 70);
}

TEST_CASE("equivalence: on every other backend, every cache policy reproduces the CPU's naive greedy decoding") {
  // The CUDA kernels through the harness (slow: the random GQA checkpoint only) and on a GPU (the shipped
  // model too, 200 tokens from each prompt).
  std::string prompt;
  for (int i = 0; i < 70; ++i) prompt.push_back(static_cast<char>((i * 37 + 11) % 256));
  const std::vector<std::string> names = test::test_backend_names();
  if (names.size() == 1) MESSAGE("this build has no backend but the CPU: nothing to compare");
  for (const std::string& name : names) {
    if (name == "cpu") continue;
    CAPTURE(name);
    if (name == "cuda-harness")  // 40 positions cross a warp's 32; naive decoding recomputes them at every step
      check_all_policies(test::golden_path("gqa.bin"), {prompt.substr(0, 40)}, 10, name);
    else
      check_all_policies(test::golden_path("gqa.bin"), {prompt.substr(0, 5), prompt}, 96 - 70, name);
    if (name == "cuda") {
      const std::string valid = validation_text();
      check_all_policies(find_data_file("kjv-gpt.bin"), {"And God said, ", valid.substr(0, 300), valid.substr(5000, 1100)},
                         200, name);
    }
  }
}

TEST_CASE("equivalence: a NaN logit is a mismatch, also where the greedy tokens agree") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(max_abs_difference(std::vector<float>{1, 2, 3}, std::vector<float>{1, 2.5f, 3}) == 0.5f);
  CHECK(std::isnan(max_abs_difference(std::vector<float>{1, 2, 3}, std::vector<float>{1, nan, 3})));
  CHECK(std::isnan(max_abs_difference(std::vector<float>{nan, 2, 3}, std::vector<float>{1, 2, 9})));  // not 6
  CHECK_THROWS_AS(max_abs_difference(std::vector<float>{1}, std::vector<float>{1, 2}), std::invalid_argument);
  CHECK(worst_difference(1.0f, 2.0f) == 2.0f);
  CHECK(std::isnan(worst_difference(nan, 2.0f)));
  CHECK(std::isnan(worst_difference(2.0f, nan)));  // std::max(2, nan) is 2
  CHECK(std::isnan(worst_difference(2.0, double(nan))));
  // Token 1 wins both steps in both runs (argmax skips NaN); step 1 of the run has a NaN where the reference has 0.
  const Run reference{{7, 1, 1}, {{0, 5, 1}, {0, 5, 1}}}, run{{7, 1, 1}, {{0, 5, 1}, {nan, 5, 1}}};
  const Equivalence e = check_equivalence(reference, run, 1);
  CHECK(e.first_token_mismatch == -1);
  CHECK(e.first_logit_mismatch == 1);
  CHECK(std::isnan(e.worst_logit_difference));
  CHECK_FALSE(e.passed());
  CHECK(std::isnan(logit_divergence(reference.logits[1], run.logits[1]).max_abs_logit));
  CHECK(std::isnan(logit_divergence(reference.logits[1], run.logits[1]).kl));  // not 0, "the same distribution"
}

TEST_CASE("equivalence: the comparison catches a cache that hides its newest key") {
  // A preallocated cache whose view leaves out the last row: each query misses its own key.
  struct ForgetfulCache final : KvCache {
    ch03::PreallocatedKvCache inner;
    ForgetfulCache(Backend& b, const ModelConfig& c, int n) : inner(b, c, n) {}
    void prepare(int pos, int n) override { inner.prepare(pos, n); }
    void write(int layer, int pos, int n, const int* positions, const float* k, const float* v) override {
      inner.write(layer, pos, n, positions, k, v);
    }
    KvView view(int layer) const override {
      KvView v = inner.view(layer);
      v.rows = inner.length() - 1;  // the view ends just before the newest position
      return v;
    }
    int length() const override { return inner.length(); }
    KvRow row(int layer, int position) override { return inner.row(layer, position); }
  };
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  CpuBackend backend(test::test_threads());
  Model model(checkpoint, backend);
  const std::vector<int> prompt = encode_bytes("And God said, ");
  const Run naive = record([&](const OnLogits& on_logits) {
    Sampler s(256, {});
    return generate_naive(model, s, prompt, 20, {}, on_logits);
  });
  const Run broken = record([&](const OnLogits& on_logits) {
    ForgetfulCache cache(backend, checkpoint.config(), 64);
    Sampler s(256, {});
    return generate_cached(model, cache, s, prompt, 20, 0, {}, on_logits);
  });
  float worst = 0;
  for (std::size_t step = 0; step < naive.logits.size(); ++step)
    worst = worst_difference(worst, max_abs_difference(naive.logits[step], broken.logits[step]));
  MESSAGE("largest logit difference with the broken cache: " << worst);
  CHECK(worst > 100 * kLogitTolerance);
  const Equivalence e = check_equivalence(naive, broken, static_cast<int>(prompt.size()));
  CHECK(!e.passed());
  CHECK(e.first_logit_mismatch == 0);
}

TEST_CASE("decode allocates nothing: no heap allocation in 50 decode steps, on 1 and 2 threads") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    CpuBackend backend(threads);
    Model model(checkpoint, backend);
    ch03::PreallocatedKvCache cache(backend, checkpoint.config(), 600);
    Sampler sampler(checkpoint.config().vocab_size, {.temperature = 0.8f, .top_k = 20, .seed = 3});
    const std::vector<int> prompt = encode_bytes(validation_text().substr(0, 500));
    int token = sampler.sample(model.forward(prompt, 0, &cache));  // prefill (may allocate: GEMM workspace)
    token = sampler.sample(model.forward(std::span<const int>(&token, 1), 500, &cache));  // first decode step
    const long before = heap_allocations();
    for (int pos = 501; pos < 551; ++pos) {
      const auto logits = model.forward(std::span<const int>(&token, 1), pos, &cache);
      token = sampler.sample(logits);
    }
    CHECK(heap_allocations() - before == 0);
    // The counter does count: a vector allocates.
    const long probe = heap_allocations();
    std::vector<float> v(1000);
    asm volatile("" : : "g"(v.data()) : "memory");  // the vector escapes: its allocation cannot be elided
    CHECK(heap_allocations() > probe);
  }
}

// The later chapters' caches keep the rule: chapter 04's ring (both position variants), chapter 10's coded caches
// (KIVI's open group of keys included), and a batch of chapter 08's paged sequences, fp32 and int8 pools, whose
// steps take blocks from the pool (a block table reserved up front, never grown on the heap).
TEST_CASE("decode allocates nothing through the later chapters' caches, a batch of paged sequences included") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const ModelConfig& c = checkpoint.config();
  CpuBackend backend(2);
  Model model(checkpoint, backend, 128, 256);
  const std::vector<int> prompt = encode_bytes(validation_text().substr(0, 100));
  auto decode_allocations = [&](KvCache& cache) {
    int token = argmax(model.forward(prompt, 0, &cache));
    token = argmax(model.forward(std::span<const int>(&token, 1), 100, &cache));  // the first step may allocate
    const long before = heap_allocations();
    for (int pos = 101; pos < 160; ++pos) token = argmax(model.forward(std::span<const int>(&token, 1), pos, &cache));
    return heap_allocations() - before;
  };
  SUBCASE("chapter 04: a window of 32 with 4 sinks, its ring of 131 slots wrapping") {
    ch04::SlidingWindowKvCache absolute(backend, c, {32, 4}, 100), within(backend, c, {32, 4}, 100,
                                                                         ch04::KeyPositions::kWithinWindow);
    CHECK(decode_allocations(absolute) == 0);
    CHECK(decode_allocations(within) == 0);
  }
  SUBCASE("chapter 10: int8, int4 and KIVI's per-channel keys") {
    for (const auto& [format, keys] : {std::pair{KvFormat::kInt8, ch10::Keys::kPerToken},
                                       std::pair{KvFormat::kInt4, ch10::Keys::kPerToken},
                                       std::pair{KvFormat::kInt4, ch10::Keys::kPerChannel}}) {
      const int format_id = int(format), keys_id = int(keys);  // not the bindings: see CAPTURE_BINDING
      CAPTURE(format_id);
      CAPTURE(keys_id);
      ch10::QuantizedKvCache cache(backend, c, 160, format, 32, keys);
      CHECK(decode_allocations(cache) == 0);
    }
  }
  SUBCASE("chapter 08: 8 paged sequences in one batch, blocks of 8 taken as they fill") {
    ch08::BlockPool fp32_pool(backend, c, 200, 8, 8, 256), int8_pool(backend, c, 200, 8, 8, 256, {KvFormat::kInt8});
    std::vector<std::unique_ptr<ch08::PagedSequence>> caches;
    std::vector<int> next(8);
    std::vector<SequenceStep> batch;
    for (int i = 0; i < 8; ++i) {
      caches.push_back(std::make_unique<ch08::PagedSequence>(i % 2 ? int8_pool : fp32_pool));
      const std::span<const int> own_prompt(prompt.data(), std::size_t(90 + i));  // every offset in a block of 8
      next[i] = argmax(model.forward(own_prompt, 0, caches[i].get()));
      batch.push_back({std::span(next).subspan(std::size_t(i), 1), 90 + i, caches[i].get()});
    }
    auto step = [&] {
      const std::span<const float> logits = model.forward(batch);
      for (int i = 0; i < 8; ++i) next[i] = argmax(logits.subspan(std::size_t(i) * c.vocab_size, c.vocab_size));
      for (SequenceStep& s : batch) ++s.pos;
    };
    step();  // the first batched step may allocate
    const long before = heap_allocations();
    for (int k = 0; k < 40; ++k) step();  // 5 blocks taken by every sequence
    CHECK(heap_allocations() - before == 0);
  }
}

TEST_CASE("threads: two backends in one process each keep their own thread count, and decode still allocates nothing") {
  // Tests run each case in its own process; this one deliberately builds two backends in the same one.
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  CpuBackend two(2);
  CpuBackend one(1);  // set the process-wide counts to 1 before the fix
  Model model(checkpoint, two);
  ch03::PreallocatedKvCache cache(two, checkpoint.config(), 600);
  Sampler sampler(checkpoint.config().vocab_size, {});
  const std::vector<int> prompt = encode_bytes(validation_text().substr(0, 500));
  int token = sampler.sample(model.forward(prompt, 0, &cache));
  token = sampler.sample(model.forward(std::span<const int>(&token, 1), 500, &cache));
  const long before = heap_allocations();
  for (int pos = 501; pos < 551; ++pos) token = sampler.sample(model.forward(std::span<const int>(&token, 1), pos, &cache));
  CHECK(heap_allocations() - before == 0);  // the OpenMP backend once allocated a one-thread team 250 times here
  CHECK(two.threads() == 2);  // each backend owns its team: building `one` changed nothing of `two`'s
  CHECK(one.threads() == 1);
}

TEST_CASE("generation: an empty prompt or a cache that already holds positions is refused") {
  const Checkpoint checkpoint(test::golden_path("mha.bin"));
  CpuBackend backend(1);
  Model model(checkpoint, backend);
  Sampler sampler(256, {.temperature = 0.8f, .top_k = 0, .seed = 1});
  const std::vector<int> none, prompt{1, 2, 3};
  ch03::PreallocatedKvCache cache(backend, checkpoint.config(), 32);
  CHECK_THROWS_WITH(generate_cached(model, cache, sampler, none, 5), doctest::Contains("empty prompt"));
  CHECK_THROWS_WITH(generate_naive(model, sampler, none, 5), doctest::Contains("empty prompt"));
  generate_cached(model, cache, sampler, prompt, 5);
  CHECK_THROWS_WITH(generate_cached(model, cache, sampler, prompt, 5), doctest::Contains("already holds 7 positions"));
}
