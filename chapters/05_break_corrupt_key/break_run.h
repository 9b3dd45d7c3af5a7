#pragma once
// Chapter 05's runs: a clean greedy baseline, and the same prompt with one cached vector corrupted -
// free-running (the broken run picks its own tokens: what a user sees) or teacher-forced (it is fed the
// clean run's tokens, so every difference comes from the damaged cache alone) - optionally restored some
// steps later.
#include <memory>
#include <span>
#include <vector>

#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "corruption.h"
#include "equivalence.h"
#include "model.h"

namespace kvs::ch05 {

// The softmax weight each query head of one KV head's group puts on one cached position of one layer, seen
// through the model's one attention implementation (Model::observe_attention), at every decode step.
class AttentionOnPosition final : public AttentionObserver {
 public:
  AttentionOnPosition(const ModelConfig& config, int layer, int kv_head, int position);
  void on_attention(int layer, int pos, int n, const KvView& view, std::span<const float> weights) override;
  // (group) weights of the last query the layer saw; 0 where the position was not visible.
  std::span<const float> last() const { return last_; }

 private:
  int layer_, kv_head_, position_, n_heads_, group_;
  std::vector<float> last_;
};

// What happens some steps after the corruption.
enum class Restore {
  kNever,
  kVector,    // the corrupted vector gets its original bytes back
  kAllRows,   // every row of every layer gets the clean run's bytes back (the rows written since included)
};

struct BreakOptions {
  const Corruption* corruption = nullptr;  // null: the clean run
  std::span<const int> forced = {};        // teacher forcing: the clean run's generated tokens
  Restore restore = Restore::kNever;
  int restore_at_step = -1;                // restored right after generated token restore_at_step is produced
  KvCache* clean_cache = nullptr;          // Restore::kAllRows copies from it (same positions, same tokens)
  AttentionOnPosition* attention = nullptr;
};

struct BreakRun {
  RecordedRun recorded;
  std::vector<std::vector<float>> attention;  // per generated token: the observer's (group) weights, if any
  std::unique_ptr<ch03::PreallocatedKvCache> cache;  // as the run left it
};

// A greedy run of `new_tokens` tokens after `prompt` through a fresh preallocated cache. Throws
// std::invalid_argument (with a line naming the flag) for a corruption the run cannot make.
BreakRun run_greedy(Model& model, std::span<const int> prompt, int new_tokens, const BreakOptions& options);

// Checks a corruption against the model and the run: a layer, KV head and position it has, a position
// already cached at the step it is corrupted at, a step within the run. Throws UsageError naming the flag.
void check_corruption(const Corruption& c, const ModelConfig& config, int prompt_len, int new_tokens);
// The KV head alone (the sweep picks layers and positions itself): UsageError naming --kv-head.
void check_kv_head(const Corruption& c, const ModelConfig& config);

// The default --position: kDefaultDistance positions before the newest one the cache holds when the
// corruption happens (right after generated token at_step: prompt_len + at_step positions cached) - position
// 200 after the default 229-byte prompt, the book's run. Why a distance, not a fixed position: what a
// corrupted key does depends on how far back it lies from the queries that read it (the sweep measures it by
// position), so a distance keeps the default the same experiment whatever the prompt's length. The default
// needs the cache to hold at least kDefaultMinCached positions then (the experiment the book follows:
// "once the cache holds at least 100 tokens"); throws UsageError saying how long the prompt must be.
constexpr int kDefaultDistance = 28;
constexpr int kDefaultMinCached = 100;
int default_position(int prompt_len, int at_step);

// max |a - b| over each row (kv_dim floats) of two caches holding the same positions: [layer][position].
struct CacheDifference {
  std::vector<std::vector<float>> keys, values;
};
CacheDifference compare_caches(Backend& backend, const ModelConfig& config, KvCache& a, KvCache& b);

}  // namespace kvs::ch05
