#pragma once
// Chapter 05's lesson: the cache is live model state. Overwrite one cached key (or value) vector - one
// layer, one KV head, one position - between two decode steps, and every later query of that layer reads
// it. Nothing in the model notices: it trusts whatever the cache holds.
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend.h"
#include "config.h"
#include "kv_cache.h"
#include "random.h"

namespace kvs::ch05 {

enum class Part { kKey, kValue };
enum class Kind { kNormal, kZeros, kScale };

inline const char* to_string(Part part) { return part == Part::kKey ? "key" : "value"; }
inline const char* to_string(Kind kind) {
  return kind == Kind::kNormal ? "normal" : kind == Kind::kZeros ? "zeros" : "scale";
}

struct Corruption {
  int layer = 0;
  int kv_head = 0;
  int position = 0;    // the cached position whose vector is overwritten
  int at_step = 0;     // overwritten right after generated token at_step is produced (0: after the prefill)
  Part part = Part::kKey;
  Kind kind = Kind::kNormal;
  float amount = 1;    // kNormal: standard deviation of the random vector; kScale: the factor
  std::uint64_t seed = 1;
};

// The head_dim floats of one head in a cached row (kv_dim floats: n_kv_heads heads of head_dim).
inline float* head_of(KvRow row, Part part, int kv_head, int head_dim) {
  return (part == Part::kKey ? row.key : row.value) + std::size_t(kv_head) * head_dim;
}

// The vector that replaces `original` (head_dim floats).
inline std::vector<float> corrupted_vector(const Corruption& c, std::span<const float> original) {
  std::vector<float> out(original.begin(), original.end());
  if (c.kind == Kind::kZeros) {
    std::fill(out.begin(), out.end(), 0.0f);
  } else if (c.kind == Kind::kScale) {
    for (float& x : out) x *= c.amount;
  } else {
    Random random(c.seed);  // the same vector with every compiler and library (common/random.h)
    for (float& x : out) x = static_cast<float>(random.normal() * c.amount);
  }
  return out;
}

// Overwrites the chosen vector in `cache` and returns what it held, so that restore can put it back.
// Throws std::out_of_range when the cache does not hold the position (KvCache::row).
inline std::vector<float> corrupt(Backend& backend, KvCache& cache, const ModelConfig& config, const Corruption& c) {
  float* head = head_of(cache.row(c.layer, c.position), c.part, c.kv_head, config.head_dim());
  std::vector<float> original(config.head_dim());
  backend.to_host(original.data(), head, original.size());
  const std::vector<float> replacement = corrupted_vector(c, original);
  backend.from_host(head, replacement.data(), replacement.size());
  return original;
}

inline void restore(Backend& backend, KvCache& cache, const ModelConfig& config, const Corruption& c,
                    std::span<const float> original) {
  float* head = head_of(cache.row(c.layer, c.position), c.part, c.kv_head, config.head_dim());
  backend.from_host(head, original.data(), original.size());
}

}  // namespace kvs::ch05
