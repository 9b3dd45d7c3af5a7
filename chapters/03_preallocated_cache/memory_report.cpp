#include "memory_report.h"

#include <cstdio>

#include "cli.h"

namespace kvs::ch03 {

void print_memory_comparison(const ModelConfig& ours, std::int64_t budget_bytes) {
  struct Known {
    const char* name;
    ModelConfig config;  // only n_layers, n_heads, n_kv_heads and dim (for head_dim) matter here
    int bytes_per_element;
    int trained_context;
    double parameters;  // the weights share the same memory
  };
  // Our parameters: embedding (and classifier), per layer the four attention and three MLP matrices and
  // two norms, the final norm. Llama-2-7B has 6.74e9; as MQA its K and V projections shrink 32-fold.
  const double ours_parameters =
      double(ours.vocab_size) * ours.dim * (ours.shared_classifier ? 1 : 2) + ours.dim +
      double(ours.n_layers) * (2.0 * ours.dim * ours.dim + 2.0 * ours.kv_dim() * ours.dim +
                               3.0 * ours.hidden_dim * ours.dim + 2.0 * ours.dim);
  const Known known[] = {
      {"this model (fp32)", ours, 4, ours.seq_len, ours_parameters},
      {"Llama-2-7B, MHA (fp16)", {.dim = 4096, .n_layers = 32, .n_heads = 32, .n_kv_heads = 32}, 2, 4096, 6.74e9},
      {"Llama-3-8B, GQA 8 KV (fp16)", {.dim = 4096, .n_layers = 32, .n_heads = 32, .n_kv_heads = 8}, 2, 8192, 8.03e9},
      {"Llama-2-7B as MQA, 1 KV (fp16)", {.dim = 4096, .n_layers = 32, .n_heads = 32, .n_kv_heads = 1}, 2, 4096,
       6.74e9 - 32 * 2 * 4096.0 * (4096 - 128)},
  };
  std::fprintf(stderr, "\n%-32s %6s %8s %8s %5s %11s %10s %10s %10s\n", "per sequence (batch 1)", "layers", "kv_heads",
               "head_dim", "bytes", "per token", "4k", "32k", "128k");
  for (const Known& k : known) {
    const auto per_token = kv_cache_bytes(k.config, 1, 1, k.bytes_per_element);
    std::fprintf(stderr, "%-32s %6d %8d %8d %5d %11s %10s %10s %10s\n", k.name, k.config.n_layers,
                 k.config.n_kv_heads, k.config.head_dim(), k.bytes_per_element, format_bytes(per_token).c_str(),
                 format_bytes(per_token * 4096.0).c_str(), format_bytes(per_token * 32768.0).c_str(),
                 format_bytes(per_token * 131072.0).c_str());
  }
  std::fprintf(stderr, "\ncontext wall in %s (--memory-budget, e.g. one GPU): the weights take their share, the KV cache\n"
               "gets the rest: the longest context of one sequence, or how many sequences of the trained context\n",
               format_bytes(budget_bytes).c_str());
  std::fprintf(stderr, "%-32s %10s %11s %26s %12s\n", "", "weights", "left for KV",
               "longest context (x trained)", "sequences");
  for (const Known& k : known) {
    const double weights = k.parameters * k.bytes_per_element, left = double(budget_bytes) - weights;
    if (left <= 0) {
      std::fprintf(stderr, "%-32s %10s %11s %26s\n", k.name, format_bytes(weights).c_str(), "-",
                   "the weights alone do not fit");
      continue;
    }
    const std::int64_t per_token = kv_cache_bytes(k.config, 1, 1, k.bytes_per_element);
    const auto positions = static_cast<std::int64_t>(left / per_token);
    const auto sequences = static_cast<std::int64_t>(left / (double(per_token) * k.trained_context));
    char context[32];
    std::snprintf(context, sizeof context, "%lld (%.1fx)", static_cast<long long>(positions),
                  double(positions) / k.trained_context);
    std::fprintf(stderr, "%-32s %10s %11s %26s %12lld\n", k.name, format_bytes(weights).c_str(),
                 format_bytes(left).c_str(), context, static_cast<long long>(sequences));
  }
}

}  // namespace kvs::ch03
