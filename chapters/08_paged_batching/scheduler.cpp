#include "scheduler.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "cli.h"
#include "generate.h"
#include "sampler.h"
#include "timing.h"

namespace kvs::ch08 {
namespace {

// A request the scheduler has admitted: its cache, and the tokens to feed - the prompt, then every token
// it generated (after a preemption the cache is rebuilt from all of them).
struct Running {
  int request;
  std::unique_ptr<PagedSequence> cache;
  std::vector<int> tokens;  // prompt + output so far
  int fed = 0;              // tokens[0, fed) are in the cache
  int take = 0;             // tokens this step feeds
  // tokens[0, prefill_end) are prefill: the prompt, and after a preemption every token but the last, which were
  // all fed once (however far a recompute got before a second preemption) and are recomputed. The last one, sampled
  // and never fed, is a decode token, as it would have been.
  int prefill_end = 0;
  int pending() const { return static_cast<int>(tokens.size()) - fed; }
};

}  // namespace

int step_token_budget(int budget, bool given, int context) {
  if (!given) return std::min(budget, context);
  if (budget > context)
    throw UsageError("--token-budget " + std::to_string(budget) + " exceeds the model's context of " +
                     std::to_string(context) + " positions; give at most " + std::to_string(context));
  return budget;
}

void check_requests(const Model& model, int pool_positions, const std::vector<Request>& requests,
                    const SchedulerOptions& options) {
  if (options.max_batch < 1 || options.token_budget < 1)
    throw std::invalid_argument("the scheduler: a step needs room for at least one sequence and one token");
  if (options.token_budget > model.max_tokens_per_call())
    throw std::invalid_argument("the scheduler: a step of " + std::to_string(options.token_budget) +
                                " tokens; the model was set up for calls of " +
                                std::to_string(model.max_tokens_per_call()) + " tokens");
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    const long positions = long(r.prompt.size()) + r.max_new_tokens;
    const std::string which = "request " + std::to_string(i) + " (" + std::to_string(r.prompt.size()) + "-token prompt, " +
                              std::to_string(r.max_new_tokens) + " new tokens)";
    if (r.prompt.empty() || r.max_new_tokens < 1 || r.arrival_step < 0)
      throw std::invalid_argument("the scheduler: " + which + " needs a prompt, at least one new token and an arrival step >= 0");
    if (positions > model.config().seq_len || positions > model.max_kv_rows())
      throw std::invalid_argument("the scheduler: " + which + " needs " + std::to_string(positions) + " positions, past the " +
                                  std::to_string(std::min(model.config().seq_len, model.max_kv_rows())) +
                                  " this model serves");
    if (positions > pool_positions)
      throw std::invalid_argument("the scheduler: " + which + " needs " + std::to_string(positions) +
                                  " positions of cache; the pool holds at most " + std::to_string(pool_positions) +
                                  " for one sequence: give it more memory");
  }
}

void check_block_ownership(const BlockPool& pool, const std::vector<const PagedSequence*>& sequences,
                           std::vector<int>& holders) {
  holders.assign(pool.blocks(), 0);  // free-list entries and table entries per block
  // sequence: the running sequence whose table holds the block, -1 for the free list (the message is built
  // only when it throws: this runs before every audited step, over every block)
  auto hold = [&](int block, int sequence) {
    if (block < 0 || block >= pool.blocks() || ++holders[block] > 1)
      throw std::logic_error("block " + std::to_string(block) + " is handed out twice (" +
                             (sequence < 0 ? std::string("the free list")
                                           : "the block table of running sequence " + std::to_string(sequence)) +
                             "): two sequences would write each other's keys and values");
  };
  for (int block : pool.free_list()) hold(block, -1);
  for (std::size_t s = 0; s < sequences.size(); ++s)
    for (int block : sequences[s]->blocks()) hold(block, int(s));
  for (int block = 0; block < pool.blocks(); ++block)
    if (holders[block] == 0)
      throw std::logic_error("block " + std::to_string(block) + " is neither free nor held by a running sequence: it "
                             "leaked, and the pool has one block less for good");
}

std::vector<int> serve_alone(Model& model, const Request& request, PoolFormat format, int block_size,
                             const OnLogits& on_logits) {
  const int positions = int(request.prompt.size()) + request.max_new_tokens;
  std::optional<BlockPool> pool;  // before the cache that gives its blocks back to it
  std::unique_ptr<KvCache> cache;
  if (format.format == KvFormat::kFp32) {
    cache = std::make_unique<ch03::PreallocatedKvCache>(model.backend(), model.config(), positions);
  } else {
    pool.emplace(model.backend(), model.config(), blocks_needed(positions, block_size), block_size, 1, positions, format);
    cache = std::make_unique<PagedSequence>(*pool);
  }
  Sampler greedy(model.config().vocab_size, SamplerSettings{});
  const Generation g = generate_cached(model, *cache, greedy, request.prompt, request.max_new_tokens,
                                       model.max_tokens_per_call(), {}, on_logits);  // a prompt longer than a call: in chunks
  return {g.tokens.begin() + long(request.prompt.size()), g.tokens.end()};
}

std::size_t first_difference(const std::vector<int>& a, const std::vector<int>& b) {
  std::size_t at = 0;
  while (at < a.size() && at < b.size() && a[at] == b[at]) ++at;
  return at;
}

RunStats serve(Model& model, SequenceCaches& caches, const std::vector<Request>& requests, const SchedulerOptions& options,
               std::vector<RequestResult>& results, const OnStep& on_step) {
  BlockPool& pool = caches.pool();
  check_requests(model, pool_positions(pool.table_width(), pool.blocks(), pool.block_size()), requests, options);
  // Else a step would find no block table for a sequence it admits (never more at once than the requests).
  if (const int at_once = std::min<int>(options.batch_limit(), int(requests.size())); pool.sequences() < at_once)
    throw std::invalid_argument("the scheduler: a step may run " + std::to_string(at_once) +
                                " sequences, and the pool has block tables for " + std::to_string(pool.sequences()) +
                                " at once; make the pool for SchedulerOptions::batch_limit() sequences");
  const int count = static_cast<int>(requests.size());
  results.assign(requests.size(), RequestResult{});
  std::vector<int> arrival_order(requests.size());  // requests by arrival step, ties in file order
  for (int i = 0; i < count; ++i) arrival_order[i] = i;
  std::stable_sort(arrival_order.begin(), arrival_order.end(),
                   [&](int a, int b) { return requests[a].arrival_step < requests[b].arrival_step; });

  RunStats stats;
  std::deque<int> waiting;              // request ids; a preempted one goes back to the front
  std::vector<std::vector<int>> resume(requests.size());  // a preempted request's tokens so far
  std::vector<int> lost(requests.size(), 0);               // and how many of them it had cached
  std::vector<Running> running;         // in admission order
  std::vector<SequenceStep> batch;      // this step's forward pass
  batch.reserve(options.batch_limit());
  std::vector<const PagedSequence*> audited;
  audited.reserve(options.batch_limit());
  // A step feeds at least one token: without preemptions, at most every request's prompt and outputs in steps. (So
  // the per-step records grow without allocating inside a timed step, but after a preemption's recomputing.)
  std::size_t most_steps = 0;
  for (const Request& r : requests) most_steps += r.prompt.size() + std::size_t(r.max_new_tokens);
  stats.step_ms.reserve(most_steps), stats.step_sequences.reserve(most_steps), stats.step_tokens.reserve(most_steps);
  int next_arrival = 0, finished = 0;
  const Stopwatch clock;

  for (int step = 0; finished < count; ++step) {
    const double step_start = clock.milliseconds();
    while (next_arrival < count && requests[arrival_order[next_arrival]].arrival_step <= step) {
      results[arrival_order[next_arrival]].arrival_ms = step_start;
      waiting.push_back(arrival_order[next_arrival++]);
    }
    if (running.empty() && waiting.empty()) {  // an idle server: the clock jumps to the next arrival
      step = requests[arrival_order[next_arrival]].arrival_step - 1;
      continue;
    }

    // 2. the running sequences' tokens, preempting from the most recently admitted while blocks are short.
    int budget = options.token_budget, free_blocks = caches.available_blocks();
    auto preempt_last = [&] {
      Running& victim = running.back();
      lost[victim.request] = victim.fed;  // recomputed when it is admitted again, unless found cached then
      ++stats.preemptions, ++results[victim.request].preemptions;
      resume[victim.request] = std::move(victim.tokens);
      waiting.push_front(victim.request);
      const int before = caches.available_blocks();
      running.pop_back();  // the cache gives its blocks back as it goes (a shared block stays held by the others)
      free_blocks += caches.available_blocks() - before;
    };
    for (std::size_t i = 0; i < running.size(); ++i) {
      Running& s = running[i];
      s.take = std::min(s.pending(), budget);
      const int needed = s.cache->blocks_to_grow(s.take);
      while (needed > free_blocks && i + 1 < running.size()) preempt_last();
      if (needed > free_blocks) {  // it is the last one admitted: it waits itself
        preempt_last();
        break;
      }
      free_blocks -= needed, budget -= s.take;
    }
    // 3. admissions
    // Static batching forms its whole batch now, up to the batch limit, whatever this step's token budget (limited
    // by it, as continuous batching's admissions are, a batch of the book's requests held 5 where --max-batch said
    // 16, and the comparison measured that cap). The sequences past the budget prefill in the next steps, in
    // admission order, each with its whole prompt's blocks counted here (it holds none of them yet), so the batch's
    // prompts fit when it is admitted. Later steps count the blocks actually free: a member that decodes into a new
    // block can take one a later member's prompt was counted on, which is then preempted, as in any full pool.
    const bool static_batch = options.batching == Batching::kStatic;
    const bool may_admit = !static_batch || running.empty();
    while (may_admit && !waiting.empty() && static_cast<int>(running.size()) < options.batch_limit() &&
           (budget > 0 || static_batch)) {
      const int r = waiting.front();
      std::vector<int> tokens = std::exchange(resume[r], {});  // a preempted request's, with its room to grow
      if (tokens.empty()) {
        tokens.reserve(requests[r].prompt.size() + requests[r].max_new_tokens);  // the outputs it will append
        tokens.assign(requests[r].prompt.begin(), requests[r].prompt.end());
      }
      const int before = caches.available_blocks();
      std::unique_ptr<PagedSequence> cache = caches.start(tokens);  // may hold cached blocks already (chapter 09)
      const int held = before - caches.available_blocks();  // cached blocks no one held before it took them
      const int keep_free = running.empty() ? 0 : options.watermark_blocks;
      if (cache->blocks_to_grow(static_cast<int>(tokens.size()) - cache->length()) > free_blocks - held - keep_free) {
        cache.reset();                  // (its cached blocks go back to the free queue, as recently used)
        resume[r] = std::move(tokens);  // (a preempted request keeps its place and its tokens)
        break;
      }
      waiting.pop_front();
      free_blocks -= held;
      const int cached = cache->length();
      if (results[r].output.empty() && results[r].preemptions == 0) results[r].cached_prompt_tokens = cached;
      stats.cached_prompt_tokens += cached;
      stats.recomputed_tokens += std::max(0, lost[r] - cached);
      lost[r] = 0;
      const int prefill_end = results[r].output.empty() ? static_cast<int>(requests[r].prompt.size())
                                                        : static_cast<int>(tokens.size()) - 1;
      Running s{r, std::move(cache), std::move(tokens), cached, 0, prefill_end};
      s.take = std::min(s.pending(), budget);
      free_blocks -= s.cache->blocks_to_grow(static_batch ? s.pending() : s.take), budget -= s.take;
      running.push_back(std::move(s));
    }
    stats.idle_slot_steps += std::min<long>(options.batch_limit() - long(running.size()), long(waiting.size()));
    stats.slot_steps += options.batch_limit();

    // The audit, after the step's preemptions and admissions and before anything reads or writes a block: a block
    // given back twice at the end of the last step or by a preemption in this one is caught before two sequences
    // write it. (At the step's start, a preemption's came through: two sequences shared the block for a step.)
    if (options.audit_blocks) {
      audited.clear();
      for (const Running& s : running) audited.push_back(s.cache.get());
      caches.audit(audited);
    }

    // 4. one forward pass over every sequence with tokens this step, then sampling.
    batch.clear();
    for (Running& s : running)
      if (s.take > 0) batch.push_back(SequenceStep{std::span<const int>(s.tokens).subspan(s.fed, s.take), s.fed, s.cache.get()});
    if (batch.empty()) throw std::logic_error("serve: a step with nothing to run");
    const std::span<const float> logits = model.forward(batch);
    const int vocab = model.config().vocab_size;
    int row = 0;
    for (Running& s : running) {
      if (s.take == 0) continue;
      stats.prefill_tokens += std::clamp(s.prefill_end - s.fed, 0, s.take);
      s.fed += s.take;
      caches.filled(*s.cache, std::span<const int>(s.tokens).first(s.fed));
      const std::span<const float> own = logits.subspan(std::size_t(row++) * vocab, vocab);
      if (s.pending() > 0) continue;  // the rest of its prompt comes in later steps
      const int token = argmax(own);
      s.tokens.push_back(token);
      RequestResult& result = results[s.request];
      if (result.output.empty()) result.first_token_ms = clock.milliseconds(), result.output.reserve(requests[s.request].max_new_tokens);
      result.output.push_back(token);
      ++stats.generated_tokens;
    }
    stats.step_sequences.push_back(static_cast<int>(batch.size()));
    int tokens = 0;
    for (const SequenceStep& s : batch) tokens += static_cast<int>(s.tokens.size());
    stats.step_tokens.push_back(tokens);
    stats.peak_running = std::max(stats.peak_running, static_cast<int>(batch.size()));
    stats.peak_used_blocks = std::max(stats.peak_used_blocks, caches.held_blocks());
    long live = 0;
    for (const Running& s : running) live += s.cache->length();
    stats.live_position_steps += double(live);
    stats.reserved_position_steps += double(caches.held_blocks()) * pool.block_size();
    // retire the finished ones
    const double now = clock.milliseconds();
    for (std::size_t i = 0; i < running.size();) {
      RequestResult& result = results[running[i].request];
      if (static_cast<int>(result.output.size()) < requests[running[i].request].max_new_tokens) {
        ++i;
        continue;
      }
      result.finish_ms = now;
      ++finished;
      running.erase(running.begin() + static_cast<long>(i));  // its cache gives the blocks back
    }
    stats.step_ms.push_back(now - step_start);
    ++stats.steps;
    stats.wall_ms = now;
    if (on_step) on_step(stats, finished, count);
  }
  return stats;
}

}  // namespace kvs::ch08
