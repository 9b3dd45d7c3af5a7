#pragma once
// Chapter 08's scheduler: continuous batching over a paged cache (Orca's iteration-level scheduling, vLLM's
// block manager), and static batching as the comparison.
//
// Every step is one batched forward pass (Model::forward over several sequences):
//   1. requests that have arrived join the waiting queue;
//   2. every running sequence gets its next tokens: one for a sequence that is decoding, a chunk of its
//      prompt for one that is prefilling (the step's token budget caps the tokens of a step, so a long
//      prompt cannot stall everyone else's next token). If the pool has too few free blocks for them, the
//      most recently admitted sequence is preempted: its blocks go back to the pool and it waits at the front
//      of the queue, to be recomputed (its prompt and the tokens it had generated, prefilled again) when
//      blocks are free - what vLLM does by default;
//   3. continuous batching admits waiting requests into the same step while sequence slots, the token budget
//      and free blocks allow (a whole prompt's blocks must be free); static batching admits a batch only when
//      the previous one has completely finished, as many sequences as slots and free blocks allow, their prompts
//      then prefilled within the token budget over the next steps;
//   4. each sequence whose prompt is all in the cache samples its next token (greedy); a sequence that has
//      its max_new_tokens finishes and gives its blocks back.
// Steps are the clock requests arrive by (Request::arrival_step); wall times are measured.
#include <algorithm>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "generate.h"
#include "model.h"
#include "paged_kv_cache.h"

namespace kvs::ch08 {

struct Request {
  std::vector<int> prompt;  // token ids (bytes)
  int max_new_tokens = 1;   // >= 1
  int arrival_step = 0;     // the scheduler knows the request from this step on
};

enum class Batching { kContinuous, kStatic };
inline const char* to_string(Batching b) { return b == Batching::kContinuous ? "continuous" : "static"; }

struct SchedulerOptions {
  Batching batching = Batching::kContinuous;
  int max_batch = 64;      // sequences in one step
  int token_budget = 256;  // tokens in one step, decode tokens and prefill chunks together
  // The most sequences a step runs: max_batch, or the budget where that is smaller, since every sequence of a step
  // brings at least one token. The scheduler admits up to this many and counts its slots; a pool for these options
  // needs block tables for this many sequences.
  int batch_limit() const { return std::min(max_batch, token_budget); }
  // Blocks an admission must leave free while other sequences run (vLLM's watermark): a request admitted into
  // the pool's last free blocks is the first preempted when the running ones grow (the most recently admitted
  // goes first), its prefill thrown away; a few blocks held back give the running sequences room to grow. With
  // nothing running it does not apply (there is no one to make room for, and a request that fits the pool
  // must not wait forever).
  int watermark_blocks = 0;
  // Before every forward pass, check that each block of the pool is either free or held by exactly one sequence
  // (check_block_ownership); off only to watch chapter 08's break experiment do its damage.
  bool audit_blocks = true;
};

// Throws std::logic_error naming the block when a block is neither free nor held (leaked), or free twice, free and
// held, or held by two sequences (or twice by one): what a leak, a double free or a stale block table looks like
// from the pool.
// `holders`: scratch, resized to the pool's blocks (a scheduler passes the same one every step).
void check_block_ownership(const BlockPool& pool, const std::vector<const PagedSequence*>& sequences,
                           std::vector<int>& holders);
inline void check_block_ownership(const BlockPool& pool, const std::vector<const PagedSequence*>& sequences) {
  std::vector<int> holders;
  check_block_ownership(pool, sequences, holders);
}

// Where serve's sequences keep their keys and values: a pool of blocks and the caches over it. Chapter 08's
// (PlainCaches) gives every sequence an empty cache of its own blocks. Chapter 09's prefix cache starts a
// sequence with the blocks of the longest prefix of its tokens it has cached, and keeps the blocks sequences
// fill for later ones.
class SequenceCaches {
 public:
  virtual ~SequenceCaches() = default;
  virtual BlockPool& pool() = 0;
  // A cache for a sequence that will feed `tokens` (a prompt; after a preemption, the prompt and the tokens it
  // had generated). Its length() first positions are cached already, at most tokens.size() - 1: the last token
  // must run, to give the logits of the next.
  virtual std::unique_ptr<PagedSequence> start(std::span<const int> tokens) = 0;
  // After each forward pass: `cache` holds the first cache.length() of `tokens`.
  virtual void filled(PagedSequence& /*cache*/, std::span<const int> /*tokens*/) {}
  // Blocks the sequences may still take: free ones (and, in chapter 09, cached blocks no sequence holds).
  virtual int available_blocks() const = 0;
  // Blocks that at least one sequence holds.
  virtual int held_blocks() const = 0;
  // Throws std::logic_error naming the block when the pool's bookkeeping disagrees with the block tables of
  // the running sequences (SchedulerOptions::audit_blocks).
  virtual void audit(const std::vector<const PagedSequence*>& running) = 0;
};

// Chapter 08's: every sequence starts empty and holds its blocks alone.
class PlainCaches final : public SequenceCaches {
 public:
  explicit PlainCaches(BlockPool& pool) : pool_(pool) {}
  BlockPool& pool() override { return pool_; }
  std::unique_ptr<PagedSequence> start(std::span<const int>) override { return std::make_unique<PagedSequence>(pool_); }
  int available_blocks() const override { return pool_.free_blocks(); }
  int held_blocks() const override { return pool_.used_blocks(); }
  void audit(const std::vector<const PagedSequence*>& running) override { check_block_ownership(pool_, running, holders_); }

 private:
  BlockPool& pool_;
  std::vector<int> holders_;  // check_block_ownership's scratch
};

struct RequestResult {
  std::vector<int> output;  // the generated tokens
  double arrival_ms = 0, first_token_ms = 0, finish_ms = 0;  // wall clock from the start of the run
  int preemptions = 0;
  int cached_prompt_tokens = 0;  // prompt tokens found in the cache when it was first admitted (chapter 09)
  double time_to_first_token_ms() const { return first_token_ms - arrival_ms; }
  double latency_ms() const { return finish_ms - arrival_ms; }
  // Time per output token after the first (0 for a 1-token request: none came after its first).
  double time_per_output_token_ms() const {
    return output.size() > 1 ? (finish_ms - first_token_ms) / double(output.size() - 1) : 0.0;
  }
};

struct RunStats {
  int steps = 0;                 // forward passes
  long generated_tokens = 0;     // sampled tokens
  long prefill_tokens = 0;       // prompt tokens put through the model, recomputed ones included
  long recomputed_tokens = 0;    // of those, tokens a preempted sequence had cached before
  long cached_prompt_tokens = 0; // prompt tokens found in the cache at admission, not put through the model
  int preemptions = 0;
  int peak_running = 0;          // the most sequences in one step
  int peak_used_blocks = 0;      // blocks held by sequences (SequenceCaches::held_blocks)
  double wall_ms = 0;
  std::vector<double> step_ms;   // (steps) each forward pass and its sampling
  std::vector<int> step_sequences;  // (steps) sequences in the step
  std::vector<int> step_tokens;     // (steps) tokens in the step (= sequences: every one decoding)
  // Summed over steps, after each step: positions in blocks handed out (reserved) and positions holding
  // K/V (live). reserved - live is the internal fragmentation: the unused tails of last blocks.
  double reserved_position_steps = 0, live_position_steps = 0;
  long idle_slot_steps = 0;      // sequence slots left empty while an arrived request waited
  long slot_steps = 0;           // batch_limit() · steps
  double tokens_per_s() const { return wall_ms > 0 ? 1000.0 * generated_tokens / wall_ms : 0.0; }
};

// After every step: the run so far, and how many requests have finished.
using OnStep = std::function<void(const RunStats& stats, int finished, int requests)>;

// Throws std::invalid_argument naming the first request that could never run (no prompt, no new tokens, longer
// than the model serves, or than the `pool_positions` one sequence of the pool may hold), or a step the model
// cannot take. serve() calls it; an experiment calls it first for every pool it will make, before it runs any.
void check_requests(const Model& model, int pool_positions, const std::vector<Request>& requests,
                    const SchedulerOptions& options);
// The tokens of a step on a model of `context` positions (a step's tokens go through the model in one call): the
// --token-budget `budget` where `given`, else that default cut to a small model's context. A budget given past the
// context is refused (UsageError: one line, before anything runs).
int step_token_budget(int budget, bool given, int context);
// The positions one sequence may hold in a pool of `blocks` blocks of `block_size` whose block tables have
// `table_width` entries: its table's width or the whole pool, the smaller.
inline int pool_positions(int table_width, int blocks, int block_size) {
  return std::min(table_width, blocks) * block_size;
}

// Serves `requests` through `model` with the caches of `caches`, writes each request's result (same order), and
// returns the run's statistics. A request the pool or the model can never hold (its prompt plus
// max_new_tokens exceeds the positions one sequence of the pool may have, the pool's blocks, or the model's
// context) is refused before anything runs: std::invalid_argument naming it; so is a pool with block tables for
// fewer sequences than a step may run (SchedulerOptions::batch_limit(), or the requests if fewer).
RunStats serve(Model& model, SequenceCaches& caches, const std::vector<Request>& requests, const SchedulerOptions& options,
               std::vector<RequestResult>& results, const OnStep& on_step = {});
// Chapter 08's: every sequence its own blocks of `pool`.
inline RunStats serve(Model& model, BlockPool& pool, const std::vector<Request>& requests, const SchedulerOptions& options,
                      std::vector<RequestResult>& results, const OnStep& on_step = {}) {
  PlainCaches caches(pool);
  return serve(model, caches, requests, options, results, on_step);
}

// What serve must reproduce: the greedy tokens `request` gets alone, through chapter 03's preallocated cache -
// or, for a pool that stores its rows coded (chapter 10), through a one-sequence pool of the same format and block
// size, so that the check compares batching with batching's absence, not one format with another. on_logits: each
// step's logits (generate.h).
std::vector<int> serve_alone(Model& model, const Request& request, PoolFormat format = {}, int block_size = 16,
                             const OnLogits& on_logits = {});
// The index of the first token where two outputs differ (the shorter one's length if one is a prefix of the
// other; equal outputs: their length).
std::size_t first_difference(const std::vector<int>& a, const std::vector<int>& b);

}  // namespace kvs::ch08
