// The C++ forward pass reproduces the independent PyTorch reference (data/reference/model.py) on random
// checkpoints of three attention shapes: MHA, GQA (3 query heads per KV head, separate classifier) and
// MQA (one KV head).
//
// Tolerance: 1e-4 absolute on logits of magnitude up to ~40. Both sides compute in fp32 but sum in
// different orders (Eigen's blocked GEMM vs PyTorch's BLAS), which over 2-3 layers leaves differences
// of a few 1e-6 (the largest seen is printed by the test); 1e-4 keeps a wide margin for other CPUs,
// while any real mistake (a wrong RoPE pair, KV head or mask) moves logits by 0.1 or more, as the
// changed-token check below shows.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_backend.h"
#include "equivalence.h"
#include "model.h"
#include "test_backends.h"
#include "test_util.h"

using namespace kvs;

namespace {

constexpr float kTolerance = 1e-4f;

}  // namespace

TEST_CASE("golden: C++ logits equal the PyTorch reference for MHA, GQA and MQA checkpoints, on every backend") {
  // The CPU on 1 and 2 threads, then the CUDA kernels (harness, GPU) where this build has them. A wrong
  // query-head -> KV-head mapping in a backend is caught here: the equivalence tests compare two paths
  // through the same attention.
  std::vector<std::pair<std::string, int>> runs = {{"cpu", 1}, {"cpu", 2}};
  for (const std::string& name : test::test_backend_names())
    if (name != "cpu") runs.emplace_back(name, 0);
  for (const std::string name : {"mha", "gqa", "mqa"}) {
    for (const auto& [backend_name, threads] : runs) {
      CAPTURE(name);
      CAPTURE_BINDING(backend_name);
      CAPTURE_BINDING(threads);
      const Checkpoint checkpoint(test::golden_path(std::string(name) + ".bin"));
      const test::GoldenLogits golden = test::read_golden_logits(test::golden_path(std::string(name) + ".logits"));
      REQUIRE(golden.vocab == checkpoint.config().vocab_size);
      std::unique_ptr<Backend> backend =
          threads > 0 ? std::make_unique<CpuBackend>(threads) : test::make_test_backend(backend_name);
      Model model(checkpoint, *backend);

      const auto all = model.forward(golden.tokens, 0, nullptr, Logits::kAllPositions);
      const float worst = max_abs_difference(all, golden.logits);
      MESSAGE(name << ", " << backend->describe() << ": largest |C++ - PyTorch| = " << worst);
      CHECK(worst <= kTolerance);

      // Asking for the last position only gives that same row - not bit for bit: one row goes through
      // the CPU's few-token product (a GPU's gemv), many rows through a GEMM, and they sum in different orders.
      const std::vector<float> last_row(all.end() - golden.vocab, all.end());
      const auto last = model.forward(golden.tokens, 0, nullptr, Logits::kLastPosition);
      CHECK(max_abs_difference(last, last_row) <= kTolerance);

      // A prefix is a causal model's own earlier output: logits of the first 10 tokens do not depend on
      // what follows them.
      const std::span<const int> prefix(golden.tokens.data(), 10);
      const auto head = model.forward(prefix, 0, nullptr, Logits::kAllPositions);
      CHECK(max_abs_difference(head, std::span<const float>(golden.logits.data(), head.size())) <= kTolerance);
    }
  }
}

TEST_CASE("golden: RoPE is relative, and the comparison can fail") {
  const Checkpoint checkpoint(test::golden_path("gqa.bin"));
  const test::GoldenLogits golden = test::read_golden_logits(test::golden_path("gqa.logits"));
  CpuBackend backend(1);
  Model model(checkpoint, backend);
  const auto shifted = model.forward(golden.tokens, 1, nullptr, Logits::kAllPositions);
  // Every position moves by one but every query-key distance stays the same, and RoPE scores depend on
  // distances only: the logits agree to the same tolerance.
  CHECK(max_abs_difference(shifted, golden.logits) <= kTolerance);
  // A wrong token, on the other hand, changes every later logit far beyond the tolerance.
  std::vector<int> tokens = golden.tokens;
  tokens[5] = (tokens[5] + 1) % golden.vocab;
  const auto changed = model.forward(tokens, 0, nullptr, Logits::kAllPositions);
  CHECK(max_abs_difference(changed, golden.logits) > 0.1f);
}

TEST_CASE("model: calls that do not fit are refused with a reason") {
  const Checkpoint checkpoint(test::golden_path("mha.bin"));
  CpuBackend backend(1);
  Model model(checkpoint, backend, 16);
  const std::vector<int> seventeen(17, 1), bad_token{1, 256};
  CHECK_THROWS_WITH(model.forward(seventeen, 0), doctest::Contains("17 tokens in one call"));
  CHECK_THROWS_WITH(model.forward(bad_token, 0), doctest::Contains("token id 256 is outside the vocabulary"));
  CHECK_THROWS_WITH(model.forward(std::span<const int>(bad_token.data(), 1), -1),
                    doctest::Contains("negative position"));
  // A call's end, pos + n, must be an int (caches compute it; it had wrapped negative, undefined behaviour, and
  // attention saw no key).
  const std::vector<int> three(3, 1);
  CHECK_THROWS_WITH(model.forward(three, std::numeric_limits<int>::max() - 1), doctest::Contains("passes the largest int"));
  CHECK_THROWS_WITH(model.forward(std::span<const int>(three.data(), 2), std::numeric_limits<int>::max()),
                    doctest::Contains("passes the largest int"));
}
