#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "sampler.h"
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
