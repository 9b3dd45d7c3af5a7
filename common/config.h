#pragma once
// The shape of the small GPT: the seven header fields of a llama2.c "version 0" checkpoint.
#include <cstdint>

namespace kvs {

struct ModelConfig {
  int dim = 0;          // width of the residual stream
  int hidden_dim = 0;   // width of the SwiGLU MLP
  int n_layers = 0;
  int n_heads = 0;      // query heads
  int n_kv_heads = 0;   // key/value heads; n_heads % n_kv_heads == 0 (MHA, GQA or MQA)
  int vocab_size = 0;
  int seq_len = 0;      // the longest context the model was built for
  bool shared_classifier = true;  // classifier == token embedding (header vocab_size > 0)

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return head_dim() * n_kv_heads; }
  // Query heads per KV head: query head h reads KV head h / group().
  int group() const { return n_heads / n_kv_heads; }
};

// Bytes of K and V for `positions` positions of a batch of `batch` sequences:
// 2 (K and V) · layers · batch · kv_heads · head_dim · positions · bytes_per_element.
inline std::int64_t kv_cache_bytes(const ModelConfig& c, std::int64_t positions, std::int64_t batch = 1,
                                   std::int64_t bytes_per_element = sizeof(float)) {
  return 2 * std::int64_t{c.n_layers} * batch * c.n_kv_heads * c.head_dim() * positions * bytes_per_element;
}

}  // namespace kvs
