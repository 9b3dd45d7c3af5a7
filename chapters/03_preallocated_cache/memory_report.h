#pragma once
// What a KV cache costs: 2 · layers · batch · kv_heads · head_dim · positions · bytes_per_element
// (config.h, kv_cache_bytes), for this model and for well-known ones, and how long a context fits in a
// memory budget.
#include <cstdint>
#include <string>

#include "config.h"

namespace kvs::ch03 {

// Prints, to stderr, per-token KV bytes and totals at 4k/32k/128k for this model and for well-known
// configurations, and the context wall for `budget_bytes`: what is left beside the weights, the longest
// context that fits in it and how many sequences of the trained context.
void print_memory_comparison(const ModelConfig& ours, std::int64_t budget_bytes);

}  // namespace kvs::ch03
