#pragma once
// Chapter 10's measurements, one per --experiment (main.cpp). Each prints a table to stderr, with progress
// while it runs, and writes its rows to --csv. Every format is chapter 10's QuantizedKvCache, fp32 included:
// the baseline is the same cache with the last factor of the formula at 4 bytes.
#include <cstdint>
#include <string>
#include <vector>

#include "csv.h"
#include "kv_format.h"
#include "quantized_kv_cache.h"
#include "runtime.h"

namespace kvs::ch10 {

// A format of this chapter's tables: one KvFormat for keys and values alike, or KIVI's ("kivi": int4, the keys per
// channel over groups of positions, the values per token).
struct CacheFormat {
  KvFormat format = KvFormat::kFp32;
  Keys keys = Keys::kPerToken;
  bool operator==(const CacheFormat&) const = default;
};

struct Lab {
  Runtime& rt;
  std::vector<CacheFormat> formats;  // fp32 first: what every other format is compared with
  int group;                      // int4: channels per scale
  std::string held_out;           // data/kjv/valid.txt, never trained on
};

// The default: the prompt continued greedily with each format's cache, the text shown; and teacher-forced along
// fp32's tokens, each step's KL(fp32 || format) and whether its most likely token is still fp32's.
void compare(const Lab& lab, int new_tokens, CsvWriter& csv);
// 1. Bytes per cached position (from the allocator) and the context one budget holds, per format; the same
//    formula for a larger model's shape (not allocated).
void memory(const Lab& lab, std::int64_t budget, CsvWriter& csv);
// 2. Bits per byte of the held-out text through each format's cache, at each context (KIVI's by decoding one
//    position per call: a prefill call would attend over its own keys in fp32).
void quality(const Lab& lab, const std::vector<int>& contexts, int text_bytes, CsvWriter& csv);
// 2. Exact recall of a passage seen `d` bytes earlier, per format (on chapter 04's copying model it copies).
void recall(const Lab& lab, const std::vector<int>& distances, CsvWriter& csv);
// 4. Decode step time (and attention's share of it) at each context, per format: p50 and p99 of `steps` steps.
void speed(const Lab& lab, const std::vector<int>& contexts, int steps, CsvWriter& csv);

}  // namespace kvs::ch10
