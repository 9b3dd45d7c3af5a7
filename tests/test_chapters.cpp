// The chapter binaries, run end to end as a reader would run them.
#include <doctest/doctest.h>

#include <fstream>
#include <string>

#include "test_util.h"

using kvs::test::golden_path;
using kvs::test::run_command;

namespace {

std::string binary(const std::string& name) { return std::string(KVS_BIN_DIR) + "/" + name; }

int count_lines(const std::string& path) {
  std::ifstream in(path);
  int lines = 0;
  for (std::string line; std::getline(in, line);) ++lines;
  return lines;
}

}  // namespace

TEST_CASE("chapter 01: generates on a small checkpoint; stdout holds exactly the text") {
  kvs::test::TempDir dir;
  const std::string csv = dir.file("steps.csv");
  const auto r = run_command(binary("01_naive_generation") + " --model " + golden_path("mha.bin") +
                             " --prompt 'In the beginning' --max-new-tokens 20 --threads 1 --csv " + csv);
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.size() == 16 + 20);  // the prompt's 16 bytes, then one byte per new token
  CHECK(r.out.rfind("In the beginning", 0) == 0);
  CHECK(r.err.find("tokens/s") != std::string::npos);
  CHECK(count_lines(csv) == 1 + 20);  // header + one row per step

  // Greedy generation is deterministic from run to run.
  const auto again = run_command(binary("01_naive_generation") + " --model " + golden_path("mha.bin") +
                                 " --prompt 'In the beginning' --max-new-tokens 20 --threads 2");
  CHECK(again.out == r.out);
}

TEST_CASE("chapter 01: bad input exits non-zero with one line saying what is wrong") {
  const std::string ch01 = binary("01_naive_generation");
  SUBCASE("unknown flag") {
    const auto r = run_command(ch01 + " --frobnicate");
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("unknown option '--frobnicate'") != std::string::npos);
    CHECK(r.out.empty());
  }
  SUBCASE("bad value") {
    const auto r = run_command(ch01 + " --top-k lots");
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("--top-k expects a whole number") != std::string::npos);
  }
  SUBCASE("malformed model file") {
    kvs::test::TempDir dir;
    const std::string bad = dir.file("bad.bin");
    std::ofstream(bad, std::ios::binary) << "not a checkpoint at all, just text";
    const auto r = run_command(ch01 + " --model " + bad);
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("bad.bin: header field") != std::string::npos);
  }
  SUBCASE("prompt plus new tokens longer than the context") {
    const auto r = run_command(ch01 + " --model " + golden_path("mha.bin") + " --max-new-tokens 200");
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("exceeds the model's context of 96 positions") != std::string::npos);
  }
  SUBCASE("a model whose vocabulary is not byte-level") {
    const auto r = run_command(ch01 + " --model " + golden_path("mqa.bin"));
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("vocabulary of 203 tokens") != std::string::npos);
  }
  SUBCASE("--help") {
    const auto r = run_command(ch01 + " --help");
    CHECK(r.exit_code == 0);
    CHECK(r.out.find("--max-new-tokens N") != std::string::npos);
  }
}
