#pragma once
// Teacher-forced evaluation: how well the model predicts a text it is shown byte by byte.
//
// The text is cut into consecutive chunks of `context` tokens. Chunk c feeds tokens
// [c·context, (c+1)·context) at positions 0 .. context-1 and scores each against the token that follows
// it, so every token after the first is predicted exactly once. bits per byte = mean(-log2 p(next byte));
// perplexity = 2^(bits per byte). data/reference/evaluate.py computes exactly the same in PyTorch.
#include <cstdint>
#include <functional>
#include <span>

#include "model.h"

namespace kvs {

struct Perplexity {
  double bits_per_byte = 0;
  double perplexity = 0;        // per byte
  std::int64_t predicted = 0;   // tokens scored
  int chunks = 0;
};

// -log p(target) in nats under the softmax of one row of logits (vocab): what every evaluation sums.
double next_token_nats(const float* logits, int vocab, int target);

// on_chunk(done, total) is called after every chunk (for progress). Throws std::invalid_argument when the
// text has fewer than 2 tokens or the context exceeds what the model was set up for. `cache`: where each chunk's
// keys and values go before attention reads them (null: nowhere, the call's own - exact); it is rewound to
// position 0 for every chunk, so it must hold `context` positions and allow that (chapter 03's and 10's caches).
// With a cache that stores its rows approximately (chapter 10), this is what a teacher-forced decode through it
// scores: each position reads every earlier one, and its own, from the cache.
Perplexity evaluate_perplexity(Model& model, std::span<const int> tokens, int context,
                               const std::function<void(int done, int total)>& on_chunk = {}, KvCache* cache = nullptr);

}  // namespace kvs
