#pragma once
// Chapter 04's measurements. Each prints a table to stderr (with progress while it runs) and adds rows to
// its CSV; main.cpp picks one with --experiment.
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "csv.h"
#include "kv_cache.h"
#include "model.h"
#include "runtime.h"
#include "sliding_window_kv_cache.h"

namespace kvs::ch04 {

// What every experiment shares.
struct Lab {
  Runtime& rt;
  int chunk;                // positions per forward call (prefill and teacher-forced evaluation)
  KeyPositions positions;   // how the ring rotates its keys
  std::string held_out;     // data/kjv/valid.txt: the text the model never trained on
};

// A window of `size` keys (0: no window - the chapter 03 cache of `max_positions`), with `sinks`.
std::unique_ptr<KvCache> make_cache(const Lab& lab, Window window, int max_positions);
std::string window_name(int size);  // "full" or the number
// A window of `size` keys with `sinks` of them kept from the start, or none where the window is too small
// to hold them beside a recent key (and none for size 0, a full cache).
Window window_with_sinks(int size, int sinks);

// 1. Bits per byte of the held-out text vs window, with and without sinks.
void perplexity_vs_window(const Lab& lab, const std::vector<int>& windows, int sinks, int context, int max_bytes,
                          CsvWriter& csv);
// 2. Exact recall vs window and distance; topic consistency and local fluency vs window.
void recall_vs_window(const Lab& lab, const std::vector<int>& windows, int sinks, const std::vector<int>& distances,
                      CsvWriter& csv);
// The mechanism behind recall: per layer and head, the attention from a repeated passage's bytes onto the
// byte after their earlier occurrence (an induction head), and a text heat map of the strongest such head.
void induction_heads(const Lab& lab, int distance, CsvWriter& csv);
// The longest distance recall and induction can set between a passage and its repeat: the filler between them is
// cut from the held-out text, each passage's from its own place in the second half, and must not run past its end
// (a shorter filler would put the repeat nearer than the distance says).
int longest_recall_distance(const std::string& held_out);
void topic_and_fluency(const Lab& lab, const std::vector<int>& windows, int sinks, int new_tokens, CsvWriter& csv);
// 3. Past the trained context: bits per byte over a long stream, window without and with sinks, and the
// attention the first positions receive, per layer.
void stream_past_context(const Lab& lab, Window window, int stream_bytes, CsvWriter& csv);
// 4. Time and memory per token vs generated length, full cache vs window.
void memory_vs_length(const Lab& lab, Window window, int new_tokens, CsvWriter& csv);
// 5. One prompt, several windows, the texts one after the other.
void samples(const Lab& lab, const std::vector<int>& windows, int sinks, int new_tokens);

}  // namespace kvs::ch04
