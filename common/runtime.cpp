#include "runtime.h"

#include <filesystem>
#include <sstream>

#include "tokenizer.h"

namespace kvs {
namespace {

Checkpoint load_for_chapters(const CommonOptions& options) {
  Checkpoint checkpoint(resolve_model_path(options));
  if (checkpoint.config().vocab_size != kByteVocab)
    throw std::runtime_error(checkpoint.path() + " has a vocabulary of " +
                             std::to_string(checkpoint.config().vocab_size) +
                             " tokens; the chapters use the byte-level tokenizer, which needs exactly 256");
  return checkpoint;
}

}  // namespace

Runtime::Runtime(const CommonOptions& options, const std::string& default_prompt, PromptFit fit)
    : checkpoint(load_for_chapters(options)),
      backend(options.threads),
      model(checkpoint, backend),
      prompt(encode_bytes(resolve_prompt(options, default_prompt))),
      sampling{options.temperature, options.top_k, options.seed} {
  const int context = checkpoint.config().seq_len;
  if (prompt.empty()) throw std::runtime_error("the prompt is empty; pass --prompt TEXT");
  if (fit == PromptFit::kMustFit && static_cast<long>(prompt.size()) + options.max_new_tokens > context)
    throw std::runtime_error("the prompt (" + std::to_string(prompt.size()) + " tokens) plus --max-new-tokens " +
                             std::to_string(options.max_new_tokens) + " exceeds the model's context of " +
                             std::to_string(context) + " positions; shorten the prompt or lower --max-new-tokens");
}

std::string describe_setup(const Checkpoint& checkpoint, const CpuBackend& backend) {
  const ModelConfig& c = checkpoint.config();
  std::ostringstream out;
  out << "model " << std::filesystem::path(checkpoint.path()).filename().string() << ": dim " << c.dim << ", "
      << c.n_layers << " layers, " << c.n_heads << " query heads / " << c.n_kv_heads << " KV heads of "
      << c.head_dim() << ", hidden " << c.hidden_dim << ", vocab " << c.vocab_size << ", context " << c.seq_len
      << "; backend " << backend.name() << ", " << backend.threads() << " thread" << (backend.threads() > 1 ? "s" : "");
  return out.str();
}

}  // namespace kvs
