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
  };
  const Known known[] = {
      {"this model (fp32)", ours, 4, ours.seq_len},
      {"Llama-2-7B, MHA (fp16)", {.dim = 4096, .n_layers = 32, .n_heads = 32, .n_kv_heads = 32}, 2, 4096},
      {"Llama-3-8B, GQA 8 KV (fp16)", {.dim = 4096, .n_layers = 32, .n_heads = 32, .n_kv_heads = 8}, 2, 8192},
      {"Llama-2-7B as MQA, 1 KV (fp16)", {.dim = 4096, .n_layers = 32, .n_heads = 32, .n_kv_heads = 1}, 2, 4096},
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
  std::fprintf(stderr, "\ncontext wall: the longest context whose KV cache fits in %s (cache only, batch 1)\n",
               format_bytes(budget_bytes).c_str());
  for (const Known& k : known) {
    const std::int64_t positions = budget_bytes / kv_cache_bytes(k.config, 1, 1, k.bytes_per_element);
    std::fprintf(stderr, "  %-32s %12lld positions%s\n", k.name, static_cast<long long>(positions),
                 positions > k.trained_context ? "  (more than the model was trained for)" : "");
  }
}

}  // namespace kvs::ch03
