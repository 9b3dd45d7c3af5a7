#pragma once
// Helpers shared by the tests: golden files, random checkpoints, temporary files, running binaries.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "cli.h"
#include "cpu_backend.h"

// doctest's CAPTURE of a structured binding (`for (const auto& [flags, message] : ...)`), through a copy: CAPTURE
// names its argument inside a lambda, which C++20 allows for a binding, but Clang implements that only from 16 (g++
// from 8). It prints what CAPTURE prints ("flags := ..."); at block scope only, since it declares a variable.
#define CAPTURE_BINDING(binding)             \
  const auto binding##_captured = (binding); \
  INFO(#binding " := ", binding##_captured)

namespace kvs::test {

// Unsets an environment variable a backend reads when it goes out of scope, whatever happened (another test case
// may run in this process).
struct UnsetAtExit {
  const char* name;
  ~UnsetAtExit() { unsetenv(name); }
};

inline std::string golden_path(const std::string& file) { return std::string(KVS_GOLDEN_DIR) + "/" + file; }

// The shipped model's held-out text (data/kjv/valid.txt), whole.
inline std::string validation_text() {
  return read_input_file("the validation text", find_data_file("kjv/valid.txt"), std::size_t(1) << 30);
}

// Under AddressSanitizer + UBSan (the `sanitize` test preset sets KVS_SANITIZE=1) the code runs several
// times slower and both cores already run a test each: the long shipped-model comparisons use shorter
// runs on one thread, so the suite stays within its time budget. Every code path still runs.
inline bool sanitizer_run() {
  const char* value = std::getenv("KVS_SANITIZE");
  return value && std::string(value) == "1";
}
inline int test_threads() { return sanitizer_run() ? 1 : 2; }

// [cos, sin] of positions 0 .. positions-1 for every pair of a head (positions, head_dim/2, 2): the CPU
// backend's table, in host memory (a read-time rotation table for a test's view).
inline std::vector<float> rope_table(int positions, int head_dim) {
  std::vector<float> table(std::size_t(positions) * head_dim);
  CpuBackend cpu(1);
  cpu.rope_table(table.data(), consecutive_positions(cpu, 0, positions).data(), positions, head_dim);
  return table;
}

// tokens and the PyTorch reference's logits (n_tokens, vocab), as written by data/reference/make_golden.py
struct GoldenLogits {
  std::vector<int> tokens;
  int vocab = 0;
  std::vector<float> logits;
};

inline GoldenLogits read_golden_logits(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::int32_t n = 0, vocab = 0;
  in.read(reinterpret_cast<char*>(&n), 4).read(reinterpret_cast<char*>(&vocab), 4);
  GoldenLogits g{std::vector<int>(n), vocab, std::vector<float>(std::size_t(n) * vocab)};
  in.read(reinterpret_cast<char*>(g.tokens.data()), 4 * n);
  in.read(reinterpret_cast<char*>(g.logits.data()), 4 * g.logits.size());
  if (!in) throw std::runtime_error(path + " is truncated");
  return g;
}

// A fresh directory under /tmp, removed with the object.
class TempDir {
 public:
  TempDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "kvs-test-XXXXXX").string();
    if (!mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed");
    path_ = templ;
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// Random weights of the right sizes for `c`.
inline HostWeights random_weights(const ModelConfig& c, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  auto tensor = [&](std::size_t n) {
    std::vector<float> t(n);
    for (float& x : t) x = normal(gen);
    return t;
  };
  const std::size_t dim = c.dim, kv = c.kv_dim(), hidden = c.hidden_dim, L = c.n_layers, vocab = c.vocab_size;
  return HostWeights{tensor(vocab * dim),      tensor(L * dim),          tensor(L * dim * dim),
                     tensor(L * kv * dim),     tensor(L * kv * dim),     tensor(L * dim * dim),
                     tensor(L * dim),          tensor(L * hidden * dim), tensor(L * dim * hidden),
                     tensor(L * hidden * dim), tensor(dim),              c.shared_classifier ? std::vector<float>{}
                                                                                             : tensor(vocab * dim)};
}

// A CSV file the binaries wrote: one vector of fields per line, the header first (no quoting: ours have none).
inline std::vector<std::vector<std::string>> read_csv(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::vector<std::string>> lines;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string>& fields = lines.emplace_back();
    std::stringstream text(line);
    for (std::string field; std::getline(text, field, ',');) fields.push_back(field);
  }
  return lines;
}

struct CommandResult {
  int exit_code = -1;
  std::string out, err;
};

// Runs a shell command, capturing stdout and stderr separately.
inline CommandResult run_command(const std::string& command) {
  TempDir dir;
  const std::string out = dir.file("out"), err = dir.file("err");
  const int status = std::system((command + " > " + out + " 2> " + err + " < /dev/null").c_str());
  auto slurp = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

}  // namespace kvs::test
