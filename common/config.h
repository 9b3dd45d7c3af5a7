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

// Floats of the model's tensors: the token embedding, each layer's two norms and seven matrices, the final
// norm, and the classifier when it is not the embedding (the parameters; a checkpoint file holds more).
inline std::int64_t parameter_count(const ModelConfig& c) {
  const std::int64_t dim = c.dim, kv_dim = c.kv_dim(), hidden = c.hidden_dim, vocab = c.vocab_size;
  const std::int64_t per_layer = 2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim;  // norms, wq wo, wk wv, w1 w2 w3
  return vocab * dim + c.n_layers * per_layer + dim + (c.shared_classifier ? 0 : vocab * dim);
}

// Bytes of K and V for `positions` positions of a batch of `batch` sequences:
// 2 (K and V) · layers · batch · kv_heads · head_dim · positions · bytes_per_element.
inline std::int64_t kv_cache_bytes(const ModelConfig& c, std::int64_t positions, std::int64_t batch = 1,
                                   std::int64_t bytes_per_element = sizeof(float)) {
  return 2 * std::int64_t{c.n_layers} * batch * c.n_kv_heads * c.head_dim() * positions * bytes_per_element;
}

}  // namespace kvs
