#pragma once
// Chapter 09's experiments (09_prefix_sharing --experiment NAME): each prints a table on stderr and, with --csv,
// writes its rows.
#include <cstdint>
#include <string>
#include <vector>

#include "runtime.h"

namespace kvs::ch09 {

struct Setup {
  Runtime& rt;
  std::string text;          // the held-out text documents, questions and prompts are cut from
  int samples = 4;           // --samples
  int new_tokens = 32;       // --max-new-tokens: per sample, per request
  int block_size = 16;
  int prefix_length = 1024;  // the shared document, bytes
  int question_length = 32;
  int token_budget = 256;    // tokens in one scheduler step (chapter 08)
  std::vector<int> counts;   // N of the prefix and sampling sweeps
  int requests = 64;         // the mixed trace
  std::int64_t kv_memory = 0;  // the mixed trace's pool
  std::uint64_t trace_seed = 1;
  std::string csv;
};

int samples(Setup& s);         // --samples N continuations of one prompt, shared; texts and memory; checked
int shared_prefix(Setup& s);   // N requests with one long prefix: KV held, prefill, TTFT, hit rate, with and without
int sampling_memory(Setup& s); // parallel sampling for N = 1 ... 64: memory shared vs not, copy-on-write copies
int mixed_trace(Setup& s);     // shared and unshared prompts under a small pool, against chapter 08
int break_copy_on_write(Setup& s);  // copy-on-write off: siblings write into the block they share

// Before anything runs: UsageError when the held-out text has no room for the largest N's questions.
void check_prefix(const Setup& s);
// Before anything runs: UsageError when the model's context or --kv-memory cannot hold the mixed trace's longest
// request.
void check_mixed(const Setup& s);
// The most K/V memory `experiment` will hold at once (its largest pool), for the memory plan.
std::int64_t largest_pool_bytes(const Setup& s, const std::string& experiment);

}  // namespace kvs::ch09
