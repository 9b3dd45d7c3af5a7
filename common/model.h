#pragma once
// The small GPT: a Llama-style decoder, computing exactly what llama2.c's run.c computes.
#include <cstdint>
#include <span>
#include <vector>

#include "backend.h"
#include "checkpoint.h"
#include "kv_cache.h"

namespace kvs {

enum class Logits { kLastPosition, kAllPositions };

// One sequence's part of a batched forward pass (chapter 08): its new tokens, the position of the first, and
// the cache that holds its earlier positions and keeps these.
struct SequenceStep {
  std::span<const int> tokens;
  int pos = 0;
  KvCache* cache = nullptr;
};

// Sees every layer's attention weights as the forward pass computes them (chapters 04-05 measure where
// attention goes; nothing is recomputed). Called after each layer's attention.
class AttentionObserver {
 public:
  virtual ~AttentionObserver() = default;
  // weights (n, n_heads, view.rows), host memory valid during the call: the softmax weight each query
  // position pos .. pos+n-1 and head puts on each row of `view` (0 on rows it may not see). view is what
  // the cache showed this layer, its row positions copied to host memory (its keys and values stay in the
  // backend's): view.position_of(r) says which position row r holds.
  virtual void on_attention(int layer, int pos, int n, const KvView& view, std::span<const float> weights) = 0;
};

class Model {
 public:
  // The model uploads its weights to `backend` (Backend::upload_weights, upload_matrix): the checkpoint
  // is not read after the constructor. All working buffers are allocated here, once, for calls of up to
  // max_tokens_per_call positions and attention views of up to max_kv_rows rows (0 = the model's seq_len).
  Model(const Checkpoint& checkpoint, Backend& backend, int max_tokens_per_call = 0, int max_kv_rows = 0);

  // A run sizes them for the longest call it will make, not for the trained context: seq_len may be far
  // larger than any call (see working_bytes).

  // Runs the model on `tokens` at positions pos .. pos + n - 1 and returns their logits on the host:
  // (1, vocab) for the last position or (n, vocab) for all of them. Keys and values go through `cache`;
  // with no cache, attention sees only this call's tokens (so pos = 0 with the whole sequence is the
  // naive full recompute). Allocates nothing itself (its buffers are sized at construction); on the CPU a call
  // of more than 64 tokens goes through Eigen's matrix product, which takes its packing buffers from the heap
  // once they pass 128 KiB (a long prefill; chapter 01's recompute). Throws std::invalid_argument for a call that
  // does not fit.
  std::span<const float> forward(std::span<const int> tokens, int pos, KvCache* cache = nullptr,
                                 Logits which = Logits::kLastPosition);

  // One forward pass over the tokens of several sequences at once (a ragged batch: a decode token for some, a
  // prefill chunk for others), each at its own positions through its own cache (distinct caches, every one
  // rotating keys where the model does: !rotates_at_read()). The weight products run once over all the call's
  // tokens - at batch 1 a decode step reads every weight to make one token; at batch B, B tokens - and
  // each sequence attends over its own view only, all of them in one Backend::attention_batch call per layer
  // (which gives each the bits of its attention alone). Returns (sequences, vocab) logits, each sequence's
  // last position in batch order, or (all tokens, vocab) in batch order. A batch of one is forward() itself,
  // the same operations. What a sequence gets inside a batch equals what it gets alone up to the summation
  // order of the products, which may depend on how many rows a product has (CPU: its few-token product up
  // to 64 rows, which sums each row as it would alone, so a decode step of up to 64 sequences is bit for
  // bit each sequence alone; Eigen's blocked matrix product above; CUDA: gemv_kernel up to fused_tokens() = 64,
  // which also sums each token as it would alone, cuBLAS above): the same greedy tokens, logits within a few
  // 1e-5 (tests/test_batched.cpp measures both).
  // When it throws: a call refused by its checks (tokens, positions, caches) touches no cache; one that
  // throws later - a cache's prepare() (a pool out of blocks) or a view larger than the model was set up for
  // - may leave earlier sequences of the batch prepared for positions never written: discard those caches
  // (a scheduler checks free blocks first, and would preempt and recompute them).
  std::span<const float> forward(std::span<const SequenceStep> batch, Logits which = Logits::kLastPosition);

  // Attach an observer (null detaches). The first attach allocates (max_tokens_per_call, n_heads,
  // max_kv_rows) floats on the backend and on the host, so observed decoding still allocates nothing.
  void observe_attention(AttentionObserver* observer);

  // Bytes of backend memory the weights take once uploaded (the classifier counted apart from the
  // embedding even when the file shares them), before the model is built.
  static std::int64_t weight_bytes(const ModelConfig& config);
  // Bytes of working buffers a model set up this way allocates (device and host), before it is built.
  static std::int64_t working_bytes(const ModelConfig& config, const Backend& backend, int max_tokens_per_call,
                                    int max_kv_rows);

  // One layer's weights in backend memory: the norms' (dim) vectors, and the matrices as upload_matrix stored them
  // (wq, wo: dim x dim; wk, wv: kv_dim x dim; w1, w3: hidden x dim; w2: dim x hidden, each (d_out, d_in) uploaded),
  // what Backend::matmul takes. For an experiment that times the products alone (chapter 08's products).
  struct LayerWeights {
    const float *rms_att, *wq, *wk, *wv, *wo, *rms_ffn, *w1, *w2, *w3;
  };
  const LayerWeights& layer_weights(int layer) const { return layers_.at(layer); }

  const ModelConfig& config() const { return config_; }
  Backend& backend() { return backend_; }
  int max_tokens_per_call() const { return max_tokens_; }
  int max_kv_rows() const { return max_kv_rows_; }

 private:
  friend class RecordedDecode;
  // forward() in three parts: check the call and hand its tokens and positions to the backend; the
  // operations themselves (what a recording captures); the logits back to the host.
  // The call's sequences as load_step found them: tokens [offset, offset + n) of the call, at pos, pos + 1, ...
  struct Part {
    int offset, n, pos;
    KvCache* cache;
  };
  int load_step(std::span<const SequenceStep> batch);  // returns the call's tokens, n
  void compute(int n, Logits which);
  // One layer's new keys and values (n, kv_dim) of every sequence into its cache.
  void write_caches(int layer, const int* positions, const float* k, const float* v);
  bool write_in_products(int layer, const int* positions, Backend::Product& k, Backend::Product& v);
  // Hands one layer's attention weights (backend memory) to the observer.
  void observe(int layer, int pos, int n, const KvView& visible, float* weights);
  std::span<const float> read_logits(int rows);  // (rows, vocab) to the host

  ModelConfig config_;
  Backend& backend_;
  int max_tokens_, max_kv_rows_;
  const float* token_embedding_;  // (vocab, dim)
  std::vector<LayerWeights> layers_;
  const float* rms_final_;   // (dim)
  const float* classifier_;  // (vocab, dim), uploaded as a matrix

  // Working buffers; N = max_tokens_per_call.
  Buffer x_;         // (N, dim)        the residual stream
  Buffer xb_;        // (N, dim)        normalised input of a sub-layer, then its output
  Buffer q_;         // (N, dim)        queries, n_heads heads of head_dim
  Buffer k_;         // (N, kv_dim)     keys of the new positions, n_kv_heads heads of head_dim
  Buffer v_;         // (N, kv_dim)     values of the new positions
  Buffer att_;       // (N, dim)        attention output, heads side by side
  Buffer hb_;        // (N, hidden)     w1·x, then silu(w1·x) ⊙ w3·x
  Buffer hb2_;       // (N, hidden)     w3·x
  Buffer rope_;      // (N, head_dim/2, 2)  [cos, sin] per position and pair
  Buffer logits_;    // (N, vocab)
  Buffer scratch_;   // attention scores, sized by the backend
  IntBuffer step_;   // (2, n)          this call's token ids, then their positions (n = the call's positions)
  std::vector<int> host_step_;      // (2, N)
  std::vector<float> host_logits_;  // (N, vocab)
  std::vector<Part> parts_;         // (sequences of this call), capacity N: refilled without allocating
  std::vector<Backend::AttentionPart> attention_parts_;  // (sequences of this call), capacity N: a layer's views
  std::vector<Backend::PagedPart> paged_parts_;  // (sequences of this call), capacity N: a layer's writes into a pool
  std::vector<const KvCache*> caches_;  // (sequences of this call) sorted, to refuse a cache given twice
  CallLocalKv call_local_;
  AttentionObserver* observer_ = nullptr;
  Buffer observed_weights_;         // (N, n_heads, max_kv_rows) once an observer is attached
  std::vector<float> host_weights_; // (N, n_heads, max_kv_rows)
  std::vector<int> host_row_positions_;  // (max_kv_rows) an observed view's row positions, copied to the host
};

// Decoding with one launch per token (a CUDA graph on the GPU). The first step() records the forward pass
// of one new token through `cache`; every later step() writes its token and position into backend memory
// and replays the recording, so the host issues one launch instead of one per operation. The same
// operations on the same memory: the logits are forward()'s, to the bit. Needs a backend that can record
// and a replayable cache (chapter 03's: KvCache::replayable); no attention observer.
class RecordedDecode {
 public:
  // Throws std::invalid_argument naming what is missing.
  RecordedDecode(Model& model, KvCache& cache);
  // forward({token}, pos, &cache): the logits (1, vocab) of the token at `pos`.
  std::span<const float> step(int token, int pos);

 private:
  Model& model_;
  KvCache& cache_;
  int recording_ = -1;  // the backend's number for this recording; -1 until the first step
};

}  // namespace kvs
