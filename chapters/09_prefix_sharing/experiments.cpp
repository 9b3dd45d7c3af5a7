#include "experiments.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "08_paged_batching/scheduler.h"
#include "parallel_sampling.h"
#include "prefix_cache.h"
#include "progress.h"
#include "random.h"
#include "timing.h"
#include "tokenizer.h"

namespace kvs::ch09 {
namespace {


std::int64_t block_bytes(const Setup& s) { return kv_cache_bytes(s.rt.model.config(), s.block_size); }

// Where the prefix experiment's request i takes its question from the held-out text.
std::size_t question_offset(std::size_t i) { return 100000 + 1499 * i; }

// A pool of `blocks` blocks for up to `sequences` sequences at once, each up to the model's context.
ch08::BlockPool make_pool(Setup& s, int blocks, int sequences) {
  return ch08::BlockPool(s.rt.backend, s.rt.model.config(), blocks, s.block_size, sequences, s.rt.model.config().seq_len);
}

// What a serve run says about its requests' first tokens and the cache.
struct Served {
  ch08::RunStats stats;
  std::vector<ch08::RequestResult> results;
  int running_at_peak = 0;  // sequences in the step that first held stats.peak_used_blocks
  // Of the prompt tokens sequences needed in their caches when admitted (again, after a preemption), the share
  // found there.
  double hit_rate() const {
    const double needed = double(stats.cached_prompt_tokens + stats.prefill_tokens);
    return needed > 0 ? double(stats.cached_prompt_tokens) / needed : 0.0;
  }
};

// Serves `requests` with chapter 08's caches (share false) or a prefix cache over an equal pool.
Served serve_with(Setup& s, const std::vector<ch08::Request>& requests, int blocks, bool share,
                  const ch08::SchedulerOptions& options, PrefixCacheStats* cache_stats, const std::string& what) {
  ch08::BlockPool pool = make_pool(s, blocks, options.batch_limit());
  Served run;
  int peak = 0;
  Progress progress(what, "requests finished");
  const ch08::OnStep report = [&](const ch08::RunStats& stats, int finished, int count) {
    progress.update(finished, count);
    if (stats.peak_used_blocks > peak)  // a new peak: how many sequences hold it
      peak = stats.peak_used_blocks, run.running_at_peak = stats.step_sequences.back();
  };
  if (share) {
    PrefixCache cache(pool);
    run.stats = ch08::serve(s.rt.model, cache, requests, options, run.results, report);
    if (cache_stats) *cache_stats = cache.stats();
  } else {
    run.stats = ch08::serve(s.rt.model, pool, requests, options, run.results, report);
  }
  return run;
}

std::vector<double> ttft_ms(const Served& run, std::size_t from) {
  std::vector<double> ms;
  for (std::size_t i = from; i < run.results.size(); ++i) ms.push_back(run.results[i].time_to_first_token_ms());
  return ms;
}

int identical_outputs(const Served& a, const Served& b) {
  int same = 0;
  for (std::size_t i = 0; i < a.results.size(); ++i) same += a.results[i].output == b.results[i].output ? 1 : 0;
  return same;
}

void finish(CsvWriter& csv) {
  csv.commit();
  if (csv.enabled()) std::fprintf(stderr, "wrote %s\n", csv.path().c_str());
}

// N samples of the prompt, shared (one prefill, forked) or as N separate requests, in a pool just large enough
// for N unshared samples.
SamplingRun sample_prompt(Setup& s, int n, bool share, PrefixCacheOptions cache_options = {}) {
  const int per_sample = blocks_needed(static_cast<int>(s.rt.prompt.size()) + s.new_tokens, s.block_size);
  ch08::BlockPool pool = make_pool(s, n * per_sample, n);
  PrefixCache cache(pool, cache_options);
  return sample_in_parallel(s.rt.model, cache, s.rt.prompt, n, s.new_tokens, s.rt.sampling, share);
}

// The prompt's last block, for the sampling experiments' header.
std::string last_block(const Setup& s, int length) {
  const int in_last = length % s.block_size;
  if (in_last == 0) return "it ends exactly at a block's end: the samples share only full blocks and copy nothing";
  return "its last block holds " + std::to_string(in_last) + " of " + std::to_string(s.block_size) +
         " positions, shared by every sample until each writes its first token there";
}

}  // namespace

int samples(Setup& s) {
  const std::vector<int>& prompt = s.rt.prompt;
  const int n = s.samples, length = static_cast<int>(prompt.size());
  std::fprintf(stderr, "%d samples of %d tokens after a %d-token prompt, temperature %g, sample i seeded %llu + i; blocks "
                       "of %d positions: %s\n", n, s.new_tokens, length, s.rt.sampling.temperature,
               static_cast<unsigned long long>(s.rt.sampling.seed), s.block_size, last_block(s, length).c_str());
  const SamplingRun runs[2] = {sample_prompt(s, n, false), sample_prompt(s, n, true)};
  std::printf("%s\n", decode_on_one_line(prompt).c_str());
  for (int i = 0; i < n; ++i) std::printf("  [sample %d] ...%s\n", i, decode_on_one_line(runs[1].outputs[i]).c_str());
  std::fflush(stdout);  // before the report on stderr, also where stdout is a pipe (fully buffered): a terminal's order
  const double bytes = double(block_bytes(s));
  std::fprintf(stderr, "KV cache held at the peak: %s shared (%d blocks), %s as %d separate requests (%d blocks): %.2fx; "
                       "%ld prompt tokens prefilled instead of %ld; %ld blocks copied on write\n",
               format_bytes(runs[1].peak_held_blocks * bytes).c_str(), runs[1].peak_held_blocks,
               format_bytes(runs[0].peak_held_blocks * bytes).c_str(), n, runs[0].peak_held_blocks,
               double(runs[0].peak_held_blocks) / runs[1].peak_held_blocks, runs[1].prefill_tokens, runs[0].prefill_tokens,
               runs[1].cow_copies);
  int same_separate = 0, same_alone = 0;
  CsvWriter csv({"--csv", s.csv}, "sample,tokens,identical_separate,identical_alone,text", s.rt.inputs());
  for (int i = 0; i < n; ++i) {
    const bool separate = runs[1].outputs[i] == runs[0].outputs[i];
    const bool alone = runs[1].outputs[i] == sample_alone(s.rt.model, prompt, s.new_tokens, s.rt.sampling, i);
    same_separate += separate ? 1 : 0, same_alone += alone ? 1 : 0;
    csv.row(i, runs[1].outputs[i].size(), separate ? 1 : 0, alone ? 1 : 0, decode_on_one_line(runs[1].outputs[i]));
  }
  std::fprintf(stderr, "same seeds: %d of %d samples identical to the separate requests, %d of %d to each sample alone "
                       "(chapter 03's cache)\n", same_separate, n, same_alone, n);
  finish(csv);
  return same_separate == n && same_alone == n ? 0 : 1;
}

int shared_prefix(Setup& s) {
  const std::string document = s.text.substr(10000, s.prefix_length);
  const int prompt_length = s.prefix_length + s.question_length;
  const int warm = (prompt_length + s.token_budget - 1) / s.token_budget;  // steps the first request's prompt takes
  std::fprintf(stderr, "N requests: one %d-byte document (held-out text) + a different %d-byte question each, %d new tokens; "
                       "the first arrives at step 0, the others at step %d, once its prompt is cached; blocks of %d, %d "
                       "tokens a step; greedy\n", s.prefix_length, s.question_length, s.new_tokens, warm, s.block_size,
               s.token_budget);
  std::fprintf(stderr, "%4s | %21s %21s | %9s %9s | %11s %11s | %6s | %9s\n", "N", "KV held: not shared", "shared",
               "prefill", "shared", "TTFT p50", "shared", "hits", "identical");
  CsvWriter csv({"--csv", s.csv}, "requests,kv_bytes_unshared,running_unshared,kv_bytes_shared,running_shared,prefill_tokens_unshared,prefill_tokens_shared,"
                "ttft_ms_p50_unshared,ttft_ms_p50_shared,ttft_ms_first_shared,hit_rate,wall_ms_unshared,wall_ms_shared,identical",
                s.rt.inputs());
  // Warm-up (the first run pays for page faults and caches): one request, not measured.
  serve_with(s, {ch08::Request{encode_bytes(document), 1, 0}}, blocks_needed(prompt_length + 1, s.block_size), false,
             ch08::SchedulerOptions{.max_batch = 1, .token_budget = s.token_budget}, nullptr, "warm-up");
  int all_identical = 1;
  for (int n : s.counts) {
    std::vector<ch08::Request> requests;
    for (int i = 0; i < n; ++i)
      requests.push_back(ch08::Request{encode_bytes(document + s.text.substr(question_offset(std::size_t(i)), s.question_length)),
                                       s.new_tokens, i == 0 ? 0 : warm});
    const int blocks = n * blocks_needed(prompt_length + s.new_tokens, s.block_size);  // everyone, unshared
    const ch08::SchedulerOptions options{.max_batch = n, .token_budget = s.token_budget};
    const Served alone = serve_with(s, requests, blocks, false, options, nullptr, "N = " + std::to_string(n) + ", not shared");
    const Served shared = serve_with(s, requests, blocks, true, options, nullptr, "N = " + std::to_string(n) + ", shared");
    const std::size_t later = n > 1 ? 1 : 0;  // TTFT of the requests that could find the document cached
    const double bytes = double(block_bytes(s));
    const int same = identical_outputs(alone, shared);
    all_identical &= same == n ? 1 : 0;
    auto held = [&](const Served& run) {  // "12.5 MiB by 13" : the peak, and the requests running then
      char cell[64];
      std::snprintf(cell, sizeof cell, "%s by %d", format_bytes(run.stats.peak_used_blocks * bytes).c_str(), run.running_at_peak);
      return std::string(cell);
    };
    std::fprintf(stderr, "%4d | %21s %21s | %9ld %9ld | %8.1f ms %8.1f ms | %5.1f%% | %4d of %d\n", n, held(alone).c_str(),
                 held(shared).c_str(), alone.stats.prefill_tokens, shared.stats.prefill_tokens,
                 percentile(ttft_ms(alone, later), 50), percentile(ttft_ms(shared, later), 50), 100 * shared.hit_rate(), same, n);
    csv.row(n, alone.stats.peak_used_blocks * bytes, alone.running_at_peak, shared.stats.peak_used_blocks * bytes, shared.running_at_peak,
            alone.stats.prefill_tokens, shared.stats.prefill_tokens, percentile(ttft_ms(alone, later), 50),
            percentile(ttft_ms(shared, later), 50), shared.results[0].time_to_first_token_ms(), shared.hit_rate(),
            alone.stats.wall_ms, shared.stats.wall_ms, same);
  }
  std::fprintf(stderr, "KV held: the most K/V blocks held at once, by the requests in that step (the token budget admits "
                       "unshared prompts only as fast as it can prefill them); prefill: prompt tokens put through the "
                       "model; TTFT p50 over requests 2..N (request 1 for N = 1); hits: prompt tokens found cached; "
                       "identical: greedy outputs, shared vs not\n");
  finish(csv);
  return all_identical ? 0 : 1;
}

int sampling_memory(Setup& s) {
  const std::vector<int>& prompt = s.rt.prompt;
  const int length = static_cast<int>(prompt.size());
  std::fprintf(stderr, "N samples of %d tokens after a %d-token prompt (temperature %g, sample i seeded %llu + i); blocks of "
                       "%d: %s\n", s.new_tokens, length, s.rt.sampling.temperature,
               static_cast<unsigned long long>(s.rt.sampling.seed), s.block_size, last_block(s, length).c_str());
  std::fprintf(stderr, "%4s | %10s %10s %6s | %8s %10s | %9s %9s | %9s\n", "N", "KV alone", "KV shared", "saved", "CoW",
               "copied", "ms alone", "shared", "identical");
  CsvWriter csv({"--csv", s.csv}, "samples,kv_bytes_unshared,kv_bytes_shared,cow_blocks,cow_bytes,prefill_tokens_unshared,"
                "prefill_tokens_shared,wall_ms_unshared,wall_ms_shared,identical", s.rt.inputs());
  int all_identical = 1;
  const double bytes = double(block_bytes(s));
  sample_prompt(s, 1, false);  // warm-up, not measured
  for (int n : s.counts) {
    const SamplingRun runs[2] = {sample_prompt(s, n, false), sample_prompt(s, n, true)};
    int same = 0;
    for (int i = 0; i < n; ++i) same += runs[0].outputs[i] == runs[1].outputs[i] ? 1 : 0;
    all_identical &= same == n ? 1 : 0;
    const double kv_alone = runs[0].peak_held_blocks * bytes, kv_shared = runs[1].peak_held_blocks * bytes;
    std::fprintf(stderr, "%4d | %10s %10s %5.2fx | %8ld %10s | %6.0f ms %6.0f ms | %4d of %d\n", n, format_bytes(kv_alone).c_str(),
                 format_bytes(kv_shared).c_str(), kv_alone / kv_shared, runs[1].cow_copies,
                 format_bytes(runs[1].cow_copies * bytes).c_str(), runs[0].wall_ms, runs[1].wall_ms, same, n);
    csv.row(n, kv_alone, kv_shared, runs[1].cow_copies, runs[1].cow_copies * bytes, runs[0].prefill_tokens,
            runs[1].prefill_tokens, runs[0].wall_ms, runs[1].wall_ms, same);
  }
  std::fprintf(stderr, "KV: blocks held at the peak; CoW: blocks copied on write (and their bytes); identical: the samples' "
                       "tokens, shared vs separate requests, same seeds\n");
  finish(csv);
  return all_identical ? 0 : 1;
}

std::int64_t largest_pool_bytes(const Setup& s, const std::string& experiment) {
  int largest = s.samples;
  for (int n : s.counts) largest = std::max(largest, n);
  if (experiment == "mixed") return s.kv_memory;
  if (experiment == "prefix")  // every request, unshared
    return std::int64_t(largest) * blocks_needed(s.prefix_length + s.question_length + s.new_tokens, s.block_size) *
           block_bytes(s);
  const int per_sample = blocks_needed(static_cast<int>(s.rt.prompt.size()) + s.new_tokens, s.block_size);
  return std::int64_t(experiment == "sampling" ? largest : s.samples) * per_sample * block_bytes(s);
}

void check_prefix(const Setup& s) {
  // Request i's question: question_length bytes from byte 100,000 + 1,499 i of the held-out text.
  const std::size_t largest = std::size_t(std::ranges::max(s.counts));
  if (question_offset(largest - 1) + s.question_length > s.text.size())
    throw UsageError("--counts up to " + std::to_string(largest) + " with --question-length " +
                     std::to_string(s.question_length) + ": request i's question starts at byte 100,000 + 1,499 i of the "
                     "held-out text, which has " + std::to_string(s.text.size()) + " bytes; give fewer requests or "
                     "shorter questions");
}

void check_mixed(const Setup& s) {
  const int longest = 576 + 64 + 64;  // a request of its own: the longest prompt and output
  if (longest > s.rt.model.config().seq_len)
    throw UsageError("--experiment mixed: its longest request takes " + std::to_string(longest) +
                     " positions, past the model's context of " + std::to_string(s.rt.model.config().seq_len));
  if (s.kv_memory < blocks_needed(longest, s.block_size) * block_bytes(s))
    throw UsageError("--kv-memory " + format_bytes(double(s.kv_memory)) + " is too small for the mixed trace's longest "
                     "request (" + std::to_string(longest) + " positions): give it at least " +
                     format_bytes(double(blocks_needed(longest, s.block_size) * block_bytes(s))));
  if (s.kv_memory / block_bytes(s) > ch08::BlockPool::max_blocks(s.block_size))
    throw UsageError("--kv-memory " + format_bytes(double(s.kv_memory)) + " makes more blocks of " +
                     std::to_string(s.block_size) + " positions than a pool's " +
                     std::to_string(ch08::BlockPool::max_blocks(s.block_size)) + " (rows are ints); give less memory");
}

int mixed_trace(Setup& s) {
  // Half the requests ask about one of four documents (a shared prefix), the others bring a prompt of their own.
  // The draws one a statement, in a fixed order (a function's arguments are evaluated in an order the compiler
  // chooses), from common/random.h: the same trace with every compiler and library.
  Random random(s.trace_seed);
  std::vector<std::string> documents;
  for (int d = 0; d < 4; ++d) documents.push_back(s.text.substr(20000 + 20000 * std::size_t(d), 512));
  const std::int64_t last_offset = std::int64_t(s.text.size()) - 1000;
  std::vector<ch08::Request> requests;
  double arrival = 0;
  int shared_requests = 0;
  for (int i = 0; i < s.requests; ++i) {
    const bool shares = random.uniform_int(0, 1) == 1;
    std::string prompt;
    if (shares) {
      const int length = static_cast<int>(random.uniform_int(16, 64));  // the question's bytes
      const std::size_t offset = static_cast<std::size_t>(random.uniform_int(100000, last_offset));
      prompt = documents[random.uniform_int(0, 3)] + s.text.substr(offset, length);
    } else {
      const int length = static_cast<int>(random.uniform_int(64, 576));
      prompt = s.text.substr(static_cast<std::size_t>(random.uniform_int(100000, last_offset)), length);
    }
    shared_requests += shares ? 1 : 0;
    const int output = static_cast<int>(random.uniform_int(16, 64));
    requests.push_back(ch08::Request{encode_bytes(prompt), output, static_cast<int>(arrival)});
    arrival += random.exponential(1.0);
  }
  check_mixed(s);
  const int blocks = static_cast<int>(s.kv_memory / block_bytes(s));
  std::fprintf(stderr, "%d requests arriving about one a step (seed %llu): %d ask about one of 4 documents of 512 bytes (+ a "
                       "16-64-byte question), the others bring 64-576 bytes of their own; 16-64 new tokens; a pool of %d "
                       "blocks of %d (%s)\n", s.requests, static_cast<unsigned long long>(s.trace_seed), shared_requests,
               blocks, s.block_size, format_bytes(double(blocks) * block_bytes(s)).c_str());
  std::fprintf(stderr, "%22s %6s %9s %9s %9s %11s %9s %10s %10s\n", "cache", "steps", "prefill", "hits", "evicted",
               "preemptions", "tokens/s", "TTFT mean", "identical");
  CsvWriter csv({"--csv", s.csv}, "cache,steps,wall_ms,prefill_tokens,hit_rate,evicted_blocks,preemptions,tokens_per_s,"
                "ttft_ms_mean,identical_alone", s.rt.inputs());
  std::vector<std::vector<int>> expected;
  for (const ch08::Request& r : requests) expected.push_back(ch08::serve_alone(s.rt.model, r));
  // Up to 64 sequences a step, as chapter 08's default (fewer where the budget has fewer tokens: batch_limit).
  const ch08::SchedulerOptions options{.max_batch = 64, .token_budget = s.token_budget};
  int all_identical = 1;
  for (bool share : {false, true}) {
    PrefixCacheStats cache_stats;
    const char* name = share ? "prefix cache (ch. 09)" : "no sharing (ch. 08)";
    const Served run = serve_with(s, requests, blocks, share, options, &cache_stats, name);
    int same = 0;
    for (std::size_t i = 0; i < requests.size(); ++i) same += run.results[i].output == expected[i] ? 1 : 0;
    all_identical &= same == s.requests ? 1 : 0;
    const std::vector<double> ttft = ttft_ms(run, 0);
    const double ttft_mean = std::accumulate(ttft.begin(), ttft.end(), 0.0) / double(ttft.size());
    std::fprintf(stderr, "%22s %6d %9ld %8.1f%% %9ld %11d %9.0f %7.1f ms %4d of %d\n", name, run.stats.steps,
                 run.stats.prefill_tokens, 100 * run.hit_rate(), cache_stats.evictions, run.stats.preemptions,
                 run.stats.tokens_per_s(), ttft_mean, same, s.requests);
    csv.row(share ? "prefix_cache" : "none", run.stats.steps, run.stats.wall_ms, run.stats.prefill_tokens, run.hit_rate(),
            cache_stats.evictions, run.stats.preemptions, run.stats.tokens_per_s(), ttft_mean, same);
  }
  std::fprintf(stderr, "prefill: prompt tokens put through the model (recomputed ones included); hits: prompt tokens found "
                       "cached at admission; evicted: cached blocks reused for others; identical: greedy outputs equal to "
                       "each request alone\n");
  finish(csv);
  return all_identical ? 0 : 1;
}

int break_copy_on_write(Setup& s) {
  const std::vector<int>& prompt = s.rt.prompt;
  const int n = s.samples, length = static_cast<int>(prompt.size());
  std::fprintf(stderr, "%d samples after a %d-token prompt, temperature %g, sample i seeded %llu + i; blocks of %d: %s\n", n,
               length, s.rt.sampling.temperature, static_cast<unsigned long long>(s.rt.sampling.seed), s.block_size,
               last_block(s, length).c_str());
  const SamplingRun right = sample_prompt(s, n, true);
  const SamplingRun broken = sample_prompt(s, n, true, PrefixCacheOptions{.copy_on_write = false});
  std::fprintf(stderr, "copy-on-write off: each sample's first tokens go into the one block they all hold; the sample that "
                       "writes a position last overwrites what its siblings wrote there\n");
  CsvWriter csv({"--csv", s.csv}, "sample,first_different_token,tokens,identical_alone", s.rt.inputs());
  int damaged = 0, caught = 0, missed = 0;  // changed; differing from alone; changed yet equal to alone
  for (int i = 0; i < n; ++i) {
    const bool alone = broken.outputs[i] == sample_alone(s.rt.model, prompt, s.new_tokens, s.rt.sampling, i);
    caught += alone ? 0 : 1;
    missed += alone && broken.outputs[i] != right.outputs[i] ? 1 : 0;
    if (broken.outputs[i] == right.outputs[i]) {
      std::fprintf(stderr, "  sample %d: unchanged\n", i);
      csv.row(i, -1, right.outputs[i].size(), alone ? 1 : 0);
      continue;
    }
    const std::size_t at = ch08::first_difference(broken.outputs[i], right.outputs[i]);
    std::fprintf(stderr, "  sample %d: its text changes at token %zu of %zu\n", i, at, right.outputs[i].size());
    csv.row(i, at, right.outputs[i].size(), alone ? 1 : 0);
    if (damaged++ == 0) {
      const std::span<const int> good(right.outputs[i]), bad(broken.outputs[i]);
      std::printf("sample %d, prompt: %s\n  with copy-on-write:    %s|%s\n  without copy-on-write: %s|%s\n", i,
                  decode_on_one_line(prompt).c_str(), decode_on_one_line(good.first(at)).c_str(), decode_on_one_line(good.subspan(at)).c_str(),
                  decode_on_one_line(bad.first(at)).c_str(), decode_on_one_line(bad.subspan(at)).c_str());
      std::fflush(stdout);  // between the stderr lines around it, also through a pipe
    }
  }
  std::fprintf(stderr, "%d of %d samples changed (| marks where); checked against each sample alone (chapter 03's cache, same "
                       "seed), %d of %d differ: the check catches %s\n", damaged, n, caught, n,
               damaged == 0 ? "nothing to catch" : missed == 0 ? "every changed one" : "only some");
  if (damaged == 0)
    std::fprintf(stderr, "no sample changed: the siblings wrote the same tokens into the shared block, or the prompt ends at "
                         "a block's end (nothing shared is written); try another --seed or prompt length\n");
  finish(csv);
  return 0;
}

}  // namespace kvs::ch09
