#pragma once
// What a KV cache costs: 2 · layers · batch · kv_heads · head_dim · positions · bytes_per_element
// (config.h, kv_cache_bytes), for this model and for well-known ones, and how long a context fits in a
// memory budget.
#include <cstdint>
#include <string>

#include "config.h"

namespace kvs::ch03 {

// Reads "512MiB", "16GiB", "1.5G", "1000000" (bytes); K/M/G/T are binary (KiB = 1024 bytes). Throws
// std::invalid_argument naming the text for anything else.
std::int64_t parse_bytes(const std::string& text);
std::string format_bytes(double bytes);

// Prints, to stderr, per-token KV bytes and totals at 4k/32k/128k for this model and for well-known
// configurations, and the context wall (longest context whose cache fits) for `budget_bytes`.
void print_memory_comparison(const ModelConfig& ours, std::int64_t budget_bytes);

}  // namespace kvs::ch03
