#pragma once
// What every chapter sets up the same way: the checkpoint, the backend (--backend), the model, the prompt's
// tokens and the sampler, checked against each other - and against --memory-limit - before anything
// is allocated.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "checkpoint.h"
#include "cli.h"
#include "csv.h"
#include "model.h"
#include "sampler.h"

namespace kvs {

// One line for stderr: model shape, backend and threads.
std::string describe_setup(const Checkpoint& checkpoint, const Backend& backend);

// The checkpoint at --model (default: the shipped one), refused with std::runtime_error unless its vocabulary
// is the byte tokenizer's 256 tokens: every chapter reads and writes bytes.
Checkpoint load_byte_level_checkpoint(const CommonOptions& options);

// The memory a run will use, known before anything is allocated.
struct MemoryPlan {
  std::int64_t weights = 0;         // the model's weights in backend memory (Model::weight_bytes)
  std::int64_t working = 0;         // the model's working buffers (Model::working_bytes)
  std::int64_t kv_cache = 0;        // the KV caches the chapter planned, at their peak (plan_kv_cache; 0 until then)
  int positions = 0;                // the longest call: what the buffers and the cache are sized for
  int kv_rows = 0;                  // the most rows a cache shows attention
  std::int64_t host_weights = 0;    // --synthetic: the generated weights the host holds (a file's are mapped)
  std::int64_t other = 0;           // what a run allocates beside the model and its caches (0: nothing)
  std::string other_what;           // what that is, for the line describe() prints
  std::int64_t total() const { return weights + working + kv_cache + host_weights + other; }
  std::string describe() const;     // one line for stderr
};
// The plan for a model whose calls take up to `positions` tokens and whose attention reads up to
// `kv_rows` rows (0: `positions`), with a KV cache of `cache_positions` positions.
MemoryPlan plan_memory(const Checkpoint& checkpoint, const Backend& backend, int positions, int cache_positions,
                       int kv_rows = 0);
// Throws UsageError, naming --memory-limit and what needs the memory, when the plan exceeds `limit`.
// `who` starts the line: what needs the memory.
void check_memory(const MemoryPlan& plan, std::int64_t limit, const std::string& who = "this run");

// Whether the prompt plus --max-new-tokens must fit the model's context (a chapter), or the caller cuts
// its own prompts from a longer text (a benchmark).
enum class PromptFit { kMustFit, kCutByCaller };

class Runtime {
 public:
  // Throws UsageError or std::runtime_error (CheckpointError) with a one-line reason when something does
  // not fit. The model's buffers are sized for `longest_sequence` positions (0: the prompt plus
  // --max-new-tokens), at most the model's context, and for caches that show attention up to `kv_rows`
  // rows (0: as many as the positions; a ring cache shows more rows than one call's positions; -1: the model's
  // whole context, for sequences that grow step by step in calls shorter than they are).
  Runtime(const CommonOptions& options, const std::string& default_prompt, PromptFit fit = PromptFit::kMustFit,
          int longest_sequence = 0, int kv_rows = 0);
  Runtime(const Runtime&) = delete;

  // The KV caches this run will hold at its peak, in bytes (the constructor's plan has none: every chapter's
  // caches differ): re-checks --memory-limit (throws UsageError) and updates the plan. A chapter calls it before
  // it makes its caches.
  void plan_kv_cache(std::int64_t bytes);
  // Memory the run allocates beside the model and the KV caches (a second model, measurement buffers: `what`
  // says which), host or backend: re-checks --memory-limit (throws UsageError) and updates the plan.
  void plan_other(std::int64_t bytes, const std::string& what);

  // Setup and memory plan, two lines for stderr.
  std::string describe() const { return describe_setup(checkpoint, backend) + "\n" + memory.describe(); }
  // The files this run reads, which no output may overwrite.
  // (A --synthetic model has no file: its path() "synthetic" is no file an output could overwrite.)
  std::vector<NamedPath> inputs() const {
    return {{"--model", checkpoint.generated() ? std::string() : checkpoint.path()}, {"--prompt-file", prompt_file}};
  }

  // The CPU backend's threads; 0 with another backend.
  int cpu_threads() const;

  // A sampler at the start of its random sequence: every run of a comparison gets a fresh one.
  Sampler new_sampler() const { return Sampler(checkpoint.config().vocab_size, sampling); }

  Checkpoint checkpoint;
  std::string prompt_file;  // empty unless --prompt-file was given
  std::vector<int> prompt;  // the prompt's tokens (bytes)
  SamplerSettings sampling;
  std::int64_t memory_limit;
  std::unique_ptr<Backend> backend_owner;
  Backend& backend;
  MemoryPlan memory;
  Model model;
};

// Writes one generated token's byte to stdout at once, so the text streams as it is produced.
inline void emit_token(int token) {
  std::fputc(token, stdout);
  std::fflush(stdout);
}

}  // namespace kvs
