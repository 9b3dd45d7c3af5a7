// The loader rejects every malformed file with its own one-line message, and the writer round-trips.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "checkpoint.h"
#include "cpu_backend.h"
#include "model.h"
#include "test_util.h"

using namespace kvs;
using kvs::test::TempDir;

namespace {

const ModelConfig kSmall{.dim = 32, .hidden_dim = 40, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2,
                         .vocab_size = 50, .seq_len = 16, .shared_classifier = false};

// The message the loader gives for `path`, or "" if it loads.
std::string load_error(const std::string& path) {
  try {
    Checkpoint checkpoint(path);
    return "";
  } catch (const CheckpointError& e) {
    return e.what();
  }
}

// A file with the given header followed by `floats` zero floats.
void write_raw(const std::string& path, const int (&header)[7], std::size_t floats) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  const std::vector<float> zeros(floats);
  out.write(reinterpret_cast<const char*>(zeros.data()), floats * sizeof(float));
}

}  // namespace

TEST_CASE("checkpoint: writer -> loader round trip keeps the header and every tensor bit for bit") {
  TempDir dir;
  for (bool shared : {true, false}) {
    ModelConfig c = kSmall;
    c.shared_classifier = shared;
    const HostWeights w = kvs::test::random_weights(c, 7);
    const std::string path = dir.file(shared ? "shared.bin" : "separate.bin");
    write_checkpoint(path, c, w);
    const Checkpoint loaded(path);
    const ModelConfig& l = loaded.config();
    CHECK(l.dim == c.dim);
    CHECK(l.hidden_dim == c.hidden_dim);
    CHECK(l.n_layers == c.n_layers);
    CHECK(l.n_heads == c.n_heads);
    CHECK(l.n_kv_heads == c.n_kv_heads);
    CHECK(l.vocab_size == c.vocab_size);
    CHECK(l.seq_len == c.seq_len);
    CHECK(l.shared_classifier == shared);
    CHECK(loaded.file_bytes() == checkpoint_bytes(c));
    const TensorPointers& t = loaded.tensors();
    auto same = [](const float* p, const std::vector<float>& v) {
      return std::memcmp(p, v.data(), v.size() * sizeof(float)) == 0;
    };
    CHECK(same(t.token_embedding, w.token_embedding));
    CHECK(same(t.rms_att, w.rms_att));
    CHECK(same(t.wq, w.wq));
    CHECK(same(t.wk, w.wk));
    CHECK(same(t.wv, w.wv));
    CHECK(same(t.wo, w.wo));
    CHECK(same(t.rms_ffn, w.rms_ffn));
    CHECK(same(t.w1, w.w1));
    CHECK(same(t.w2, w.w2));
    CHECK(same(t.w3, w.w3));
    CHECK(same(t.rms_final, w.rms_final));
    if (shared) CHECK(t.classifier == t.token_embedding);
    else CHECK(same(t.classifier, w.classifier));
  }
}

TEST_CASE("checkpoint: the C++ writer gives back the very bytes of the Python writer's files") {
  // The round trip above checks the writer with its own loader, which skips the legacy RoPE tables: a writer that
  // wrote them wrong (sin before cos: 3 checks here fail) passed it. The golden files come from data/model.py: the
  // loaded tensors, written again, must be the same file, byte for byte (gqa.bin has a classifier of its own, mha.bin
  // and mqa.bin share it).
  TempDir dir;
  for (const std::string name : {"mha.bin", "gqa.bin", "mqa.bin"}) {
    CAPTURE(name);
    const Checkpoint loaded(test::golden_path(name));
    const ModelConfig& c = loaded.config();
    const TensorPointers& t = loaded.tensors();
    const std::size_t dim = c.dim, kv_dim = c.kv_dim(), hidden = c.hidden_dim, layers = c.n_layers, vocab = c.vocab_size;
    auto copy = [](const float* p, std::size_t floats) { return std::vector<float>(p, p + floats); };
    HostWeights w{copy(t.token_embedding, vocab * dim), copy(t.rms_att, layers * dim), copy(t.wq, layers * dim * dim),
                  copy(t.wk, layers * kv_dim * dim),    copy(t.wv, layers * kv_dim * dim), copy(t.wo, layers * dim * dim),
                  copy(t.rms_ffn, layers * dim),        copy(t.w1, layers * hidden * dim), copy(t.w2, layers * dim * hidden),
                  copy(t.w3, layers * hidden * dim),    copy(t.rms_final, dim),
                  c.shared_classifier ? std::vector<float>{} : copy(t.classifier, vocab * dim)};
    const std::string again = dir.file(name);
    write_checkpoint(again, c, w);
    auto bytes = [](const std::string& path) {
      std::ifstream in(path, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    const std::string original = bytes(test::golden_path(name)), written = bytes(again);
    CHECK(written.size() == original.size());
    CHECK(written == original);
  }
}

TEST_CASE("checkpoint: the writer refuses tensors of the wrong size") {
  TempDir dir;
  HostWeights w = kvs::test::random_weights(kSmall, 1);
  w.wk.pop_back();
  CHECK_THROWS_WITH_AS(write_checkpoint(dir.file("x.bin"), kSmall, w), doctest::Contains("tensor wk holds"),
                       CheckpointError);
}

TEST_CASE("checkpoint: malformed files are rejected, each with its own message naming the file") {
  TempDir dir;
  const std::string good = dir.file("good.bin");
  write_checkpoint(good, kSmall, kvs::test::random_weights(kSmall, 3));
  const auto good_bytes = std::filesystem::file_size(good);
  const std::size_t good_floats = (good_bytes - 28) / 4;
  REQUIRE(load_error(good).empty());

  SUBCASE("missing file") {
    const std::string e = load_error(dir.file("nope.bin"));
    CHECK(e.find("nope.bin: cannot open") != std::string::npos);
  }
  SUBCASE("shorter than the header") {
    const std::string p = dir.file("tiny.bin");
    std::ofstream(p, std::ios::binary) << "abc";
    CHECK(load_error(p).find("tiny.bin: file is 3 bytes, smaller than the 28-byte header") != std::string::npos);
  }
  SUBCASE("truncated") {
    const std::string p = dir.file("truncated.bin");
    std::filesystem::copy_file(good, p);
    std::filesystem::resize_file(p, good_bytes - 4);
    const std::string e = load_error(p);
    CHECK(e.find("truncated.bin: file is " + std::to_string(good_bytes - 4) + " bytes but its header") !=
          std::string::npos);
    CHECK(e.find("implies " + std::to_string(good_bytes) + " bytes (truncated?)") != std::string::npos);
  }
  SUBCASE("header and size disagree") {
    const std::string p = dir.file("long.bin");
    const int header[7] = {32, 40, 3, 4, 2, -50, 16};  // one layer more than the data holds
    write_raw(p, header, good_floats);
    CHECK(load_error(p).find("long.bin: file is " + std::to_string(good_bytes)) != std::string::npos);
    const std::string trailing = dir.file("trailing.bin");
    std::filesystem::copy_file(good, trailing);
    std::ofstream(trailing, std::ios::binary | std::ios::app) << "xxxx";
    CHECK(load_error(trailing).find("(trailing data?)") != std::string::npos);
  }
  SUBCASE("zero dim") {
    const std::string p = dir.file("zero.bin");
    write_raw(p, {0, 40, 2, 4, 2, 50, 16}, good_floats);
    CHECK(load_error(p) == p + ": header field dim = 0 must be positive (is this a llama2.c version-0 checkpoint?)");
  }
  SUBCASE("negative dims") {
    const std::string p = dir.file("negative.bin");
    write_raw(p, {32, 40, -2, 4, 2, 50, 16}, good_floats);
    CHECK(load_error(p).find("header field n_layers = -2 must be positive") != std::string::npos);
    write_raw(p, {32, 40, 2, 4, 2, 50, -16}, good_floats);
    CHECK(load_error(p).find("header field seq_len = -16 must be positive") != std::string::npos);
  }
  SUBCASE("absurdly large dims") {
    const std::string p = dir.file("huge.bin");
    write_raw(p, {32, 40, 2, 4, 2, 50, 1 << 30}, good_floats);
    CHECK(load_error(p).find("header field seq_len = 1073741824 is larger than the limit") != std::string::npos);
  }
  SUBCASE("n_heads not divisible by n_kv_heads") {
    const std::string p = dir.file("kv.bin");
    write_raw(p, {32, 40, 2, 4, 3, 50, 16}, good_floats);
    CHECK(load_error(p) == p + ": header field n_kv_heads = 3 must divide n_heads = 4");
  }
  SUBCASE("dim not divisible by n_heads") {
    const std::string p = dir.file("heads.bin");
    write_raw(p, {30, 40, 2, 4, 2, 50, 16}, good_floats);
    CHECK(load_error(p) == p + ": header field dim = 30 must be a multiple of n_heads = 4");
  }
  SUBCASE("odd head_dim") {
    const std::string p = dir.file("odd.bin");
    write_raw(p, {36, 40, 2, 4, 2, 50, 16}, good_floats);
    CHECK(load_error(p) == p + ": head_dim = dim / n_heads = 9 must be even (RoPE rotates pairs of dimensions)");
  }
}

TEST_CASE("checkpoint: a NaN or an infinity among the weights is refused, naming the tensor, layer and element") {
  TempDir dir;
  const std::string path = dir.file("nan.bin");
  write_checkpoint(path, kSmall, kvs::test::random_weights(kSmall, 3));
  // kSmall's file order: token_embedding 50 x 32, rms_att 2 x 32, wq 2 x 32 x 32, then wk 2 x (16 x 32).
  const std::size_t wk_layer1_element5 = 50 * 32 + 2 * 32 + 2 * 32 * 32 + 16 * 32 + 5;
  auto poke = [&](std::size_t index, float value) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(28 + index * sizeof(float));
    f.write(reinterpret_cast<const char*>(&value), sizeof value);
  };
  {
    const Checkpoint finite(path);
    CHECK_NOTHROW(finite.require_finite_weights());
  }
  poke(wk_layer1_element5, std::nanf(""));
  const Checkpoint checkpoint(path);  // the header and size are fine: loading maps it
  std::string message;
  try {
    checkpoint.require_finite_weights();
  } catch (const CheckpointError& e) {
    message = e.what();
  }
  CHECK(message == path + ": tensor wk of layer 1 holds NaN at element 5; the weights are corrupt (a diverged training "
                          "run or a damaged file): retrain or restore the file");
  // The model checks as it copies the weights, before any forward pass.
  CpuBackend backend(1);
  CHECK_THROWS_AS(Model(checkpoint, backend), CheckpointError);
  poke(wk_layer1_element5, 0.5f);
  poke(std::filesystem::file_size(path) / 4 - 7 - 32 * 50 + 3, -INFINITY);  // the unshared classifier, element 3
  const Checkpoint infinite(path);
  CHECK_THROWS_WITH(infinite.require_finite_weights(),
                    doctest::Contains("tensor classifier holds an infinity at element 3"));
}
