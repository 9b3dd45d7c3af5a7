#include "perplexity.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <stdexcept>
#include <string>

namespace kvs {

double next_token_nats(const float* logits, int vocab, int target) {
  const float max_logit = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(double(logits[v]) - max_logit);
  return std::log(sum) + max_logit - logits[target];
}

Perplexity evaluate_perplexity(Model& model, std::span<const int> tokens, int context,
                               const std::function<void(int, int)>& on_chunk, KvCache* cache) {
  if (tokens.size() > std::size_t(INT32_MAX)) throw std::invalid_argument("the text is larger than 2 GiB");
  const int n = static_cast<int>(tokens.size());
  if (n < 2) throw std::invalid_argument("the text must hold at least 2 bytes to evaluate");
  for (int token : tokens)  // targets are read straight from the logits, so check them all first
    if (token < 0 || token >= model.config().vocab_size)
      throw std::invalid_argument("token " + std::to_string(token) + " is outside the model's vocabulary of " +
                                  std::to_string(model.config().vocab_size));
  if (context < 1 || context > model.max_tokens_per_call())
    throw std::invalid_argument("context " + std::to_string(context) + " is outside 1.." +
                                std::to_string(model.max_tokens_per_call()) + " (the model's context)");
  const int vocab = model.config().vocab_size;
  const int total_chunks = (n - 1 + context - 1) / context;
  double nats = 0;
  Perplexity result;
  for (int start = 0; start < n - 1; start += context) {
    const int len = std::min(context, n - 1 - start);  // inputs; targets are the next `len` tokens
    const auto logits = model.forward(tokens.subspan(start, len), 0, cache, Logits::kAllPositions);
    for (int i = 0; i < len; ++i)
      nats += next_token_nats(logits.data() + std::size_t(i) * vocab, vocab, tokens[start + i + 1]);
    result.predicted += len;
    ++result.chunks;
    if (on_chunk) on_chunk(result.chunks, total_chunks);
  }
  result.bits_per_byte = nats / result.predicted / std::log(2.0);
  result.perplexity = std::exp2(result.bits_per_byte);
  return result;
}

}  // namespace kvs
