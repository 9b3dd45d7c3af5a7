#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "random.h"
#include "sampler.h"
#include "test_util.h"
#include "tokenizer.h"

using namespace kvs;

TEST_CASE("tokenizer: every byte value, and arbitrary non-UTF-8 bytes, round-trip") {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::vector<int> ids = encode_bytes(all);
  REQUIRE(ids.size() == 256);
  for (int b = 0; b < 256; ++b) CHECK(ids[b] == b);
  CHECK(decode_bytes(ids) == all);

  std::mt19937 gen(5);
  std::string noise(4096, '\0');
  for (char& c : noise) c = static_cast<char>(gen() & 0xFF);
  noise += "\xC3\x28 \xF0\x9F\x98\x80 invalid then valid UTF-8";
  CHECK(decode_bytes(encode_bytes(noise)) == noise);
  CHECK(encode_bytes("").empty());
}

TEST_CASE("sampler: greedy is argmax and ties go to the lowest id") {
  const std::vector<float> logits{0.5f, 2.0f, -1.0f, 2.0f, 2.0f};
  CHECK(argmax(logits) == 1);
  Sampler greedy(5, {.temperature = 0.0f});
  CHECK(greedy.sample(logits) == 1);
  const std::vector<float> flat(7, 3.0f);
  CHECK(argmax(flat) == 0);
  // top-k with k = 1 is greedy too, whatever the temperature, with the same tie rule.
  Sampler top1(5, {.temperature = 1.5f, .top_k = 1, .seed = 9});
  for (int i = 0; i < 20; ++i) CHECK(top1.sample(logits) == 1);
}

// Logits a draw cannot use: NaN or +inf (overflowed activations), all -inf, or not one per token of the vocabulary. A
// +inf logit had given a NaN total, and the draw fell through to the least likely candidate; a longer span had
// written past the sampler's buffers. Greedy still takes +inf as the largest and never a NaN.
TEST_CASE("sampler: a NaN or +inf logit (or all -inf) is refused by a draw, logits of another length by every call") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const std::vector<float>& bad : {std::vector<float>{0.0f, inf, 0.0f, 1.0f}, std::vector<float>{0.0f, nan, 0.0f, 1.0f},
                                        std::vector<float>(4, -inf)}) {
    Sampler draw(4, {.temperature = 0.8f, .seed = 3}), draw_top2(4, {.temperature = 0.8f, .top_k = 2, .seed = 3});
    CHECK_THROWS_WITH_AS(draw.sample(bad), doctest::Contains(bad[0] == -inf ? "every logit is -infinity" : "NaN or +infinity"),
                         std::runtime_error);
    CHECK_THROWS_AS(draw_top2.sample(bad), std::runtime_error);
  }
  Sampler draw_masked(4, {.temperature = 5.0f, .seed = 4});  // a -inf logit: a token never drawn, weight 0
  for (int i = 0; i < 200; ++i) CHECK(draw_masked.sample(std::vector<float>{0.0f, -inf, 0.0f, 0.0f}) != 1);
  CHECK(argmax(std::vector<float>{0.0f, inf, 0.0f, 1.0f}) == 1);
  CHECK(argmax(std::vector<float>{nan, -1.0f, 2.0f, nan}) == 2);
  CHECK(argmax(std::vector<float>{nan, nan}) == 0);
  Sampler greedy(4, {}), draw(4, {.temperature = 1.0f});
  const std::vector<float> five(5, 1.0f), three(3, 1.0f);
  CHECK_THROWS_WITH_AS(greedy.sample(five), doctest::Contains("5 logits for a vocabulary of 4"), std::invalid_argument);
  CHECK_THROWS_AS(draw.sample(five), std::invalid_argument);
  CHECK_THROWS_AS(draw.sample(three), std::invalid_argument);
}

TEST_CASE("sampler: a seed gives the same tokens every time, another seed other tokens") {
  std::vector<float> logits(256);
  for (int i = 0; i < 256; ++i) logits[i] = std::sin(0.37f * i) * 3.0f;
  auto draw = [&](SamplerSettings s) {
    Sampler sampler(256, s);
    std::vector<int> out;
    for (int i = 0; i < 500; ++i) out.push_back(sampler.sample(logits));
    return out;
  };
  const SamplerSettings a{.temperature = 0.9f, .top_k = 40, .seed = 1234};
  CHECK(draw(a) == draw(a));
  SamplerSettings b = a;
  b.seed = 1235;
  CHECK(draw(a) != draw(b));
  // Pinned values: the generator is ours (splitmix64), so this sequence is the same on every platform.
  const std::vector<int> first = draw(a);
  MESSAGE("first draws: " << first[0] << " " << first[1] << " " << first[2] << " " << first[3]);
  CHECK(std::vector<int>(first.begin(), first.begin() + 4) == std::vector<int>{209, 107, 123, 72});
}

TEST_CASE("sampler: top-k never leaves the k most likely tokens") {
  std::vector<float> logits(50);
  for (int i = 0; i < 50; ++i) logits[i] = static_cast<float>((i * 17) % 50);  // a permutation of 0..49
  Sampler sampler(50, {.temperature = 5.0f, .top_k = 3, .seed = 3});
  std::vector<int> seen(50, 0);
  for (int i = 0; i < 3000; ++i) ++seen[sampler.sample(logits)];
  for (int id = 0; id < 50; ++id) {
    CAPTURE(id);
    if (logits[id] >= 47.0f) CHECK(seen[id] > 0);
    else CHECK(seen[id] == 0);
  }
}

TEST_CASE("sampler: temperature sampling follows softmax(logits / T)") {
  const std::vector<float> logits{1.0f, 2.0f, 0.0f};
  const float temperature = 0.7f;
  Sampler sampler(3, {.temperature = temperature, .seed = 77});
  std::vector<int> counts(3, 0);
  const int draws = 40000;
  for (int i = 0; i < draws; ++i) ++counts[sampler.sample(logits)];
  double z = 0;
  for (float l : logits) z += std::exp(l / temperature);
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    // The standard error of a frequency over 40000 draws is at most 0.0025: 0.01 is four of them.
    CHECK(std::abs(counts[i] / double(draws) - std::exp(logits[i] / temperature) / z) < 0.01);
  }
}

// common/random.h: the draws chapters 05, 08 and 09 make. With libstdc++ its integers and exponentials are
// std::uniform_int_distribution's and std::exponential_distribution's bits (the traces the book shows); on any
// library its first draws are the numbers below; and its normals have mean 0 and variance 1.
TEST_CASE("random: libstdc++'s integers and exponentials, the same first draws everywhere, normals of variance 1") {
#if defined(_GLIBCXX_RELEASE) && _GLIBCXX_RELEASE >= 11  // Lemire's method since GCC 11; divisions before
  // Ranges of 1, 2, 7 (no power of two), 2^32 + 1, 3 · 2^62 + 1 (which rejects about a quarter of the draws), 2^64.
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min(), kMax = std::numeric_limits<std::int64_t>::max();
  const std::vector<std::pair<std::int64_t, std::int64_t>> ranges{
      {5, 5}, {0, 1}, {-3, 3}, {100000, 100000 + (std::int64_t(1) << 32)}, {kMin, std::int64_t(1) << 62}, {kMin, kMax}};
  for (std::uint64_t seed : {1ull, 20261127ull}) {
    CAPTURE(seed);
    for (const auto& [lo, hi] : ranges) {
      CAPTURE_BINDING(hi);
      Random ours(seed);
      std::mt19937_64 engine(seed);
      std::uniform_int_distribution<std::int64_t> theirs(lo, hi);
      int same = 0;
      for (int i = 0; i < 2000; ++i) same += ours.uniform_int(lo, hi) == theirs(engine) ? 1 : 0;
      CHECK(same == 2000);
    }
    for (double rate : {1.0, 1.0 / 4}) {
      Random ours(seed);
      std::mt19937_64 engine(seed);
      std::exponential_distribution<double> theirs(rate);
      int same = 0;
      for (int i = 0; i < 2000; ++i) same += ours.exponential(rate) == theirs(engine) ? 1 : 0;
      CHECK(same == 2000);
    }
  }
#endif
  // The first draws of seed 1, whatever the library: integers exactly; a normal from the library's log and sqrt,
  // within 1e-12 (a libm may round its last bit differently).
  Random integers(1);
  std::vector<std::int64_t> drawn;
  for (int i = 0; i < 8; ++i) drawn.push_back(integers.uniform_int(0, 9));
  CHECK(drawn == std::vector<std::int64_t>{1, 1, 4, 0, 3, 9, 4, 0});
  Random normals(1);
  for (double expected : {-0.38683168572455229, -0.039399992446396144, 0.6868238330500418, -0.24894799097524481}) CHECK(std::abs(normals.normal() - expected) < 1e-12);

  // Moments over 200,000 draws, at about 4 standard errors: the mean's is 1/sqrt(n) = 0.0022, the variance's
  // sqrt(2/n) = 0.0032; the exponential's mean (4) has 4/sqrt(n) = 0.009.
  Random random(7);
  const int n = 200000;
  double sum = 0, squares = 0, exponentials = 0;
  std::vector<int> counts(7, 0);
  for (int i = 0; i < n; ++i) {
    const double z = random.normal();
    sum += z, squares += z * z;
    exponentials += random.exponential(0.25);
    ++counts[random.uniform_int(-3, 3) + 3];
  }
  CHECK(std::abs(sum / n) < 0.01);
  CHECK(std::abs(squares / n - 1.0) < 0.015);
  CHECK(std::abs(exponentials / n - 4.0) < 0.04);
  for (int c : counts) CHECK(std::abs(c - n / 7.0) < 4 * std::sqrt(n / 7.0));  // each value 1/7 of the time
}
