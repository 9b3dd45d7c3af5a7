#pragma once
// What every chapter sets up the same way: the checkpoint, the CPU backend, the model, the prompt's
// tokens and the sampler, checked against each other before anything runs.
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "cli.h"
#include "cpu_backend.h"
#include "model.h"
#include "sampler.h"

namespace kvs {

// One line for stderr: model shape, backend and threads.
std::string describe_setup(const Checkpoint& checkpoint, const CpuBackend& backend);

// Whether the prompt plus --max-new-tokens must fit the model's context (a chapter), or the caller cuts
// its own prompts from a longer text (a benchmark).
enum class PromptFit { kMustFit, kCutByCaller };

class Runtime {
 public:
  // Throws std::runtime_error (or CheckpointError) with a one-line reason when something does not fit.
  Runtime(const CommonOptions& options, const std::string& default_prompt, PromptFit fit = PromptFit::kMustFit);
  Runtime(const Runtime&) = delete;

  std::string describe() const { return describe_setup(checkpoint, backend); }

  // A sampler at the start of its random sequence: every run of a comparison gets a fresh one.
  Sampler new_sampler() const { return Sampler(checkpoint.config().vocab_size, sampling); }

  Checkpoint checkpoint;
  CpuBackend backend;
  Model model;
  std::vector<int> prompt;  // the prompt's tokens (bytes)
  SamplerSettings sampling;
};

// Writes one generated token's byte to stdout at once, so the text streams as it is produced.
inline void emit_token(int token) {
  std::fputc(token, stdout);
  std::fflush(stdout);
}

// A CSV file opened before the work starts (so a bad path fails early); with an empty path it writes
// nothing.
class CsvWriter {
 public:
  CsvWriter(const std::string& path, const std::string& header) : path_(path) {
    if (path.empty()) return;
    out_.open(path, std::ios::trunc);
    if (!out_) throw std::runtime_error("cannot write --csv " + path);
    out_ << header << '\n';
  }
  template <typename... Values>
  void row(const Values&... values) {
    if (!out_.is_open()) return;
    const char* sep = "";
    ((out_ << sep << values, sep = ","), ...);
    out_ << '\n';
  }
  bool enabled() const { return out_.is_open(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

}  // namespace kvs
