#include "runtime.h"

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "backends.h"
#include "cpu_backend.h"
#include "tokenizer.h"

namespace kvs {
namespace {

// --synthetic DIM,LAYERS,HEADS,KV_HEADS: the hidden size Llama's rule gives (8/3 · dim, rounded up to a
// multiple of 256), the byte vocabulary, a context of 2^16 positions.
Checkpoint synthetic_model(const std::string& shape, std::int64_t memory_limit) {
  const std::vector<int> v = parse_int_list("--synthetic", shape, 1, 1 << 14);
  if (v.size() != 4) throw UsageError("--synthetic takes four numbers, DIM,LAYERS,HEADS,KV_HEADS (e.g. 2048,16,16,4)");
  if (std::max({v[1], v[2], v[3]}) > 1024)  // a checkpoint's bounds (checkpoint.cpp), which the header is checked against
    throw UsageError("--synthetic " + shape + ": LAYERS, HEADS and KV_HEADS go up to 1024");
  ModelConfig c{.dim = v[0], .hidden_dim = (8 * v[0] / 3 + 255) / 256 * 256, .n_layers = v[1], .n_heads = v[2],
                .n_kv_heads = v[3], .vocab_size = kByteVocab, .seq_len = 1 << 16, .shared_classifier = true};
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || (c.dim / c.n_heads) % 2 != 0)
    throw UsageError("--synthetic " + shape + ": DIM must be a multiple of HEADS with an even quotient, and KV_HEADS must "
                     "divide HEADS");
  // Refused before gigabytes are generated: the host's copy (the checkpoint's bytes, llama2.c's legacy RoPE tables
  // for 2^16 positions included) and the backend's weights alone exceed the limit.
  const std::int64_t host = std::int64_t(checkpoint_bytes(c)), backend = Model::weight_bytes(c);
  if (host + backend > memory_limit)
    throw UsageError("--synthetic " + shape + ": its weights need " + format_bytes(double(host)) + " on the host and " +
                     format_bytes(double(backend)) + " in the backend, more than --memory-limit " +
                     format_bytes(double(memory_limit)) + "; choose a smaller shape or raise --memory-limit");
  return Checkpoint::synthetic(c);
}

Checkpoint load_for_chapters(const CommonOptions& options) {
  if (!options.synthetic.empty()) {
    if (!options.model.empty()) throw UsageError("--synthetic replaces --model; give one of them");
    return synthetic_model(options.synthetic, options.memory_limit);
  }
  return load_byte_level_checkpoint(options);
}

// The longest sequence the run will process, after checking that the prompt fits; then the memory check.
MemoryPlan plan_run(const CommonOptions& options, const Checkpoint& checkpoint, const Backend& backend,
                    std::size_t prompt_tokens, PromptFit fit, int longest_sequence, int kv_rows) {
  const int context = checkpoint.config().seq_len;
  if (prompt_tokens == 0) throw UsageError("the prompt is empty; pass --prompt TEXT");
  const long needed = static_cast<long>(prompt_tokens) + options.max_new_tokens;
  if (fit == PromptFit::kMustFit && needed > context)
    throw UsageError("the prompt (" + std::to_string(prompt_tokens) + " tokens) plus --max-new-tokens " +
                     std::to_string(options.max_new_tokens) + " exceeds the model's context of " +
                     std::to_string(context) + " positions; shorten the prompt or lower --max-new-tokens");
  const int positions = static_cast<int>(std::min<long>(longest_sequence > 0 ? longest_sequence : needed, context));
  if (kv_rows < 0) kv_rows = context;
  // No KV cache yet: each chapter plans its own (Runtime::plan_kv_cache: none, a ring, several at once), and a
  // guess here refused runs that fit (chapter 01, which keeps none, was refused for a cache it never made).
  // What is checked now is what the model allocates when it is made: its weights and working buffers.
  MemoryPlan plan = plan_memory(checkpoint, backend, std::max(positions, 1), 0, kv_rows);
  check_memory(plan, options.memory_limit, "the model, before any KV cache,");
  return plan;
}

}  // namespace

Checkpoint load_byte_level_checkpoint(const CommonOptions& options) {
  Checkpoint checkpoint(resolve_model_path(options));
  if (checkpoint.config().vocab_size != kByteVocab)
    throw std::runtime_error(checkpoint.path() + " has a vocabulary of " +
                             std::to_string(checkpoint.config().vocab_size) +
                             " tokens; the chapters use the byte-level tokenizer, which needs exactly 256");
  return checkpoint;
}

Runtime::Runtime(const CommonOptions& options, const std::string& default_prompt, PromptFit fit, int longest_sequence,
                 int kv_rows)
    : checkpoint(load_for_chapters(options)),
      prompt_file(options.prompt_file),
      prompt(encode_bytes(resolve_prompt(options, default_prompt))),
      sampling{options.temperature, options.top_k, options.seed},
      memory_limit(options.memory_limit),
      backend_owner(make_backend(options.backend, options.threads)),
      backend(*backend_owner),
      memory(plan_run(options, checkpoint, backend, prompt.size(), fit, longest_sequence, kv_rows)),
      model(checkpoint, backend, memory.positions, memory.kv_rows) {
  // --csv checked (and its folder tried) now, before a chapter prints or runs anything: a run that could not
  // write its results does not start. The chapter's own CsvWriter checks again when it writes.
  const CsvWriter early_check({"--csv", options.csv}, "", inputs());
}

int Runtime::cpu_threads() const {
  const auto* cpu = dynamic_cast<const CpuBackend*>(&backend);
  return cpu ? cpu->threads() : 0;
}

void Runtime::plan_kv_cache(std::int64_t bytes) {
  MemoryPlan plan = memory;
  plan.kv_cache = bytes;
  check_memory(plan, memory_limit);
  memory = plan;
}

void Runtime::plan_other(std::int64_t bytes, const std::string& what) {
  MemoryPlan plan = memory;
  plan.other = bytes, plan.other_what = what;
  check_memory(plan, memory_limit);
  memory = plan;
}

MemoryPlan plan_memory(const Checkpoint& checkpoint, const Backend& backend, int positions, int cache_positions,
                       int kv_rows) {
  const ModelConfig& c = checkpoint.config();
  if (kv_rows <= 0) kv_rows = positions;
  return MemoryPlan{.weights = Model::weight_bytes(c),
                    .working = Model::working_bytes(c, backend, positions, kv_rows),
                    .kv_cache = kv_cache_bytes(c, cache_positions),
                    .positions = positions,
                    .kv_rows = kv_rows,
                    .host_weights = checkpoint.generated() ? std::int64_t(checkpoint.file_bytes()) : 0,
                    .other = 0,
                    .other_what = {}};
}

std::string MemoryPlan::describe() const {
  std::string line = "memory: weights " + format_bytes(double(weights)) + " + working buffers " +
                     format_bytes(double(working)) + " for " + std::to_string(positions) +
                     (positions == 1 ? " position" : " positions");
  if (kv_cache > 0) line += " + KV cache " + format_bytes(double(kv_cache));
  if (host_weights > 0) line += " + generated weights on the host " + format_bytes(double(host_weights));
  if (other > 0) line += " + " + other_what + " " + format_bytes(double(other));
  return line + " = " + format_bytes(double(total()));
}

void check_memory(const MemoryPlan& plan, std::int64_t limit, const std::string& who) {
  if (plan.total() <= limit) return;
  std::string needs = format_bytes(double(plan.total())), allowed = format_bytes(double(limit));
  if (needs == allowed)  // "needs 4.1 MiB, more than 4.1 MiB": both in bytes then
    needs = std::to_string(plan.total()) + " bytes", allowed = std::to_string(limit) + " bytes";
  throw UsageError(who + " needs " + needs + " (" + plan.describe().substr(8) + "), more than --memory-limit " + allowed +
                   "; use fewer positions or raise --memory-limit");
}

std::string describe_setup(const Checkpoint& checkpoint, const Backend& backend) {
  const ModelConfig& c = checkpoint.config();
  std::ostringstream out;
  out << "model " << std::filesystem::path(checkpoint.path()).filename().string() << ": dim " << c.dim << ", "
      << c.n_layers << (c.n_layers == 1 ? " layer, " : " layers, ") << c.n_heads << " query heads / " << c.n_kv_heads
      << " KV heads of " << c.head_dim() << ", hidden " << c.hidden_dim << ", vocab " << c.vocab_size << ", context "
      << c.seq_len << "; backend " << backend.describe();
  return out.str();
}

}  // namespace kvs
