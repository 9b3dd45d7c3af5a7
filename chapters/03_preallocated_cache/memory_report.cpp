#include "memory_report.h"

#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace kvs::ch03 {

std::int64_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KB" || unit == "KiB") scale = 1024.0;
  else if (unit == "M" || unit == "MB" || unit == "MiB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GB" || unit == "GiB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TB" || unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  const double bytes = value * scale;
  if (used == 0 || scale == 0 || !std::isfinite(bytes) || bytes <= 0 || bytes > 9.0e18)
    throw std::invalid_argument("expects a positive size such as 512MiB or 16GiB, got '" + text + "'");
  return static_cast<std::int64_t>(bytes);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char out[32];
  std::snprintf(out, sizeof out, bytes == std::floor(bytes) ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return out;
}

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
