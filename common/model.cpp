#include "model.h"

#include <stdexcept>
#include <string>

namespace kvs {
namespace {

// Floats of each working buffer for calls of up to `n` positions (the shapes in model.h).
struct WorkingSizes {
  std::size_t x, q, kv, hidden, rope, logits, step, scratch;
  WorkingSizes(const ModelConfig& c, const Backend& backend, std::size_t n, int max_kv_rows)
      : x(n * c.dim), q(n * c.dim), kv(n * c.kv_dim()), hidden(n * c.hidden_dim), rope(n * c.head_dim()),
        logits(n * c.vocab_size), step(2 * n),
        scratch(backend.attention_scratch_floats({c.n_heads, c.n_kv_heads, c.head_dim()}, max_kv_rows)) {}
  // The step's integers (token ids, positions) are counted as floats: both are 4 bytes.
  std::size_t device_floats() const { return 3 * x + q + 2 * kv + 2 * hidden + rope + logits + step + scratch; }
  std::size_t host_floats() const { return logits + step; }
};

}  // namespace

std::int64_t Model::weight_bytes(const ModelConfig& c) {
  const std::int64_t second_classifier = c.shared_classifier ? std::int64_t(c.vocab_size) * c.dim : 0;  // see the constructor
  return (parameter_count(c) + second_classifier) * std::int64_t{sizeof(float)};
}

std::int64_t Model::working_bytes(const ModelConfig& config, const Backend& backend, int max_tokens_per_call,
                                  int max_kv_rows) {
  const WorkingSizes s(config, backend, max_tokens_per_call, max_kv_rows);
  return std::int64_t(s.device_floats() + s.host_floats()) * std::int64_t{sizeof(float)};
}

Model::Model(const Checkpoint& checkpoint, Backend& backend, int max_tokens_per_call, int max_kv_rows)
    : config_(checkpoint.config()),
      backend_(backend),
      max_tokens_(max_tokens_per_call > 0 ? max_tokens_per_call : config_.seq_len),
      max_kv_rows_(max_kv_rows > 0 ? max_kv_rows : config_.seq_len),
      call_local_(config_.kv_dim()) {
  const ModelConfig& c = config_;
  checkpoint.require_finite_weights();
  const TensorPointers& t = checkpoint.tensors();
  const std::size_t dim = c.dim, kv_dim = c.kv_dim(), hidden = c.hidden_dim, vocab = c.vocab_size;
  auto upload = [&](const float* host, std::size_t floats) { return backend.upload_weights(host, floats); };
  // A matrix (rows, cols) in the layout the backend's matmul reads.
  auto matrix = [&](const float* host, std::size_t rows, std::size_t cols) {
    return backend.upload_matrix(host, static_cast<int>(rows), static_cast<int>(cols));
  };

  token_embedding_ = upload(t.token_embedding, vocab * dim);
  for (int l = 0; l < c.n_layers; ++l) {
    layers_.push_back(LayerWeights{
        .rms_att = upload(t.rms_att + l * dim, dim),
        .wq = matrix(t.wq + l * dim * dim, dim, dim),
        .wk = matrix(t.wk + l * kv_dim * dim, kv_dim, dim),
        .wv = matrix(t.wv + l * kv_dim * dim, kv_dim, dim),
        .wo = matrix(t.wo + l * dim * dim, dim, dim),
        .rms_ffn = upload(t.rms_ffn + l * dim, dim),
        .w1 = matrix(t.w1 + l * hidden * dim, hidden, dim),
        .w2 = matrix(t.w2 + l * dim * hidden, dim, hidden),
        .w3 = matrix(t.w3 + l * hidden * dim, hidden, dim),
    });
  }
  rms_final_ = upload(t.rms_final, dim);
  // Shared with the embedding in the file (t.classifier == t.token_embedding), but a table and a matrix
  // need not have one layout: uploaded twice.
  classifier_ = matrix(t.classifier, vocab, dim);

  const WorkingSizes size(c, backend, max_tokens_, max_kv_rows_);
  x_ = Buffer(backend, size.x);
  xb_ = Buffer(backend, size.x);
  q_ = Buffer(backend, size.q);
  k_ = Buffer(backend, size.kv);
  v_ = Buffer(backend, size.kv);
  att_ = Buffer(backend, size.x);
  hb_ = Buffer(backend, size.hidden);
  hb2_ = Buffer(backend, size.hidden);
  rope_ = Buffer(backend, size.rope);
  logits_ = Buffer(backend, size.logits);
  scratch_ = Buffer(backend, size.scratch);
  step_ = IntBuffer(backend, size.step);
  host_step_.resize(size.step);
  host_logits_.resize(size.logits);
}

void Model::observe_attention(AttentionObserver* observer) {
  if (observer && observed_weights_.size() == 0) {
    const std::size_t floats = std::size_t(max_tokens_) * config_.n_heads * max_kv_rows_;
    observed_weights_ = Buffer(backend_, floats);
    host_weights_.resize(floats);
    host_row_positions_.resize(max_kv_rows_);
  }
  observer_ = observer;
}

std::span<const float> Model::forward(std::span<const int> tokens, int pos, KvCache* cache, Logits which) {
  KvCache& kv = load_step(tokens, pos, cache);
  compute(static_cast<int>(tokens.size()), pos, kv, which);
  return read_logits(static_cast<int>(tokens.size()), which);
}

KvCache& Model::load_step(std::span<const int> tokens, int pos, KvCache* cache) {
  const int n = static_cast<int>(tokens.size());
  if (n < 1 || n > max_tokens_)
    throw std::invalid_argument("forward: " + std::to_string(n) + " tokens in one call; this model was set up for 1 to " +
                                std::to_string(max_tokens_));
  if (pos < 0) throw std::invalid_argument("forward: negative position " + std::to_string(pos));
  for (int token : tokens)
    if (token < 0 || token >= config_.vocab_size)
      throw std::invalid_argument("forward: token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                                  std::to_string(config_.vocab_size) + ")");
  KvCache& kv = cache ? *cache : call_local_;
  kv.prepare(pos, n);
  // step (2, n): the token ids, then their positions - read by the operations from backend memory.
  for (int i = 0; i < n; ++i) host_step_[i] = tokens[i], host_step_[n + i] = pos + i;
  backend_.from_host(step_.data(), host_step_.data(), 2 * std::size_t(n));
  return kv;
}

void Model::compute(int n, int pos, KvCache& kv, Logits which) {
  const ModelConfig& c = config_;
  const AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim()};
  const int dim = c.dim, kv_dim = c.kv_dim(), hidden = c.hidden_dim;
  Backend& b = backend_;
  float *x = x_.data(), *xb = xb_.data(), *q = q_.data(), *k = k_.data(), *v = v_.data();
  float *att = att_.data(), *hb = hb_.data(), *hb2 = hb2_.data(), *rope = rope_.data();
  const int* tokens = step_.data();         // (n) token ids
  const int* positions = step_.data() + n;  // (n) positions pos .. pos + n - 1

  // RoPE at the absolute positions, here; or, for a cache that rotates at read time, by attention.
  const bool rotate_here = !kv.rotates_at_read();
  b.embed(x, token_embedding_, tokens, n, dim);        // x (n, dim) = embedding rows of the tokens
  if (rotate_here) b.rope_table(rope, positions, n, c.head_dim());  // rope (n, head_dim/2, 2)

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = layers_[l];
    // attention: x += Wo · attention(RoPE(Wq · norm(x)), RoPE(Wk · norm(x)), Wv · norm(x))
    const float* qk_rope = rotate_here ? rope : nullptr;
    const Backend::Product qkv[] = {{q, w.wq, dim, qk_rope},       // q (n, n_heads · head_dim)
                                    {k, w.wk, kv_dim, qk_rope},    // k (n, n_kv_heads · head_dim)
                                    {v, w.wv, kv_dim}};            // v (n, n_kv_heads · head_dim)
    b.norm_products(xb, x, w.rms_att, n, dim, c.head_dim(), qkv);  // xb (n, dim) = norm(x) (backend.h)
    kv.write(l, pos, n, positions, k, v);             // the cache keeps what later positions will read
    const KvView visible = kv.view(l);                // (rows, kv_dim) keys and values
    if (visible.rows > max_kv_rows_)
      throw std::invalid_argument("forward: the cache shows " + std::to_string(visible.rows) +
                                  " rows; this model was set up for at most " + std::to_string(max_kv_rows_));
    float* weights = observer_ ? observed_weights_.data() : nullptr;  // (n, n_heads, rows) when observed
    b.attention(att, q, positions, n, visible, shape, {scratch_.data(), scratch_.size()}, weights);  // att (n, dim)
    if (observer_) {
      const std::size_t count = std::size_t(n) * c.n_heads * visible.rows;
      b.to_host(host_weights_.data(), weights, count);
      KvView observed = visible;  // row positions live in backend memory (a ring's): the observer reads a copy
      if (visible.row_positions) {
        b.to_host(host_row_positions_.data(), visible.row_positions, visible.rows);
        observed.row_positions = host_row_positions_.data();
      }
      observer_->on_attention(l, pos, n, observed, {host_weights_.data(), count});
    }
    b.matmul_add(x, xb, att, w.wo, n, dim, dim);      // x (n, dim) += xb (n, dim) = Wo · att

    // MLP: x += W2 · (silu(W1 · norm(x)) ⊙ W3 · norm(x))
    b.norm_swiglu(hb, hb2, xb, x, w.rms_ffn, w.w1, w.w3, n, dim, hidden);  // hb (n, hidden); hb2 = W3 · xb
    b.matmul_add(x, xb, hb, w.w2, n, hidden, dim);    // x (n, dim) += xb (n, dim) = W2 · hb
  }

  // logits = classifier · norm(x), for the last position or for all of them
  const int first = which == Logits::kLastPosition ? n - 1 : 0;
  const int rows = n - first;
  const Backend::Product classify[] = {{logits_.data(), classifier_, c.vocab_size}};  // logits (rows, vocab)
  b.norm_products(xb, x + std::size_t(first) * dim, rms_final_, rows, dim, c.head_dim(), classify);  // xb (rows, dim)
}

std::span<const float> Model::read_logits(int n, Logits which) {
  const std::size_t count = std::size_t(which == Logits::kLastPosition ? 1 : n) * config_.vocab_size;
  backend_.to_host(host_logits_.data(), logits_.data(), count);
  return {host_logits_.data(), count};
}

RecordedDecode::RecordedDecode(Model& model, KvCache& cache) : model_(model), cache_(cache) {
  if (!model.backend().can_record())
    throw std::invalid_argument(std::string("recorded decoding: the ") + model.backend().name() +
                                " backend cannot record operations; decode with forward() instead");
  if (!cache.replayable())
    throw std::invalid_argument("recorded decoding needs a cache whose views and writes do not depend on the "
                                "position (chapter 03's preallocated cache, chapter 04's ring); this one is not replayable");
}

std::span<const float> RecordedDecode::step(int token, int pos) {
  if (model_.observer_)
    throw std::invalid_argument("recorded decoding: detach the attention observer (it reads weights on the host)");
  const int tokens[1] = {token};
  model_.load_step(tokens, pos, &cache_);  // the cache's bookkeeping, then the token and position: not recorded
  Backend& b = model_.backend();
  if (recording_ < 0) {
    recording_ = b.begin_recording();
    try {
      model_.compute(1, pos, cache_, Logits::kLastPosition);
    } catch (...) {
      b.end_recording();
      recording_ = -1;
      throw;
    }
    b.end_recording();
  }
  b.replay(recording_);
  return model_.read_logits(1, Logits::kLastPosition);
}

}  // namespace kvs
