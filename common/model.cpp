#include "model.h"

#include <algorithm>
#include <limits>
#include <optional>
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
        scratch(backend.attention_scratch_floats({c.n_heads, c.n_kv_heads, c.head_dim()}, max_kv_rows,
                                                 static_cast<int>(n))) {}  // a sequence brings at least a token
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
  parts_.reserve(max_tokens_);  // a sequence brings at least one token
  attention_parts_.reserve(max_tokens_);
  paged_parts_.reserve(max_tokens_);
  caches_.reserve(max_tokens_);
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
  const SequenceStep one[] = {{tokens, pos, cache ? cache : &call_local_}};
  return forward(one, which);
}

std::span<const float> Model::forward(std::span<const SequenceStep> batch, Logits which) {
  const int n = load_step(batch);
  compute(n, which);
  return read_logits(which == Logits::kLastPosition ? static_cast<int>(parts_.size()) : n);
}

int Model::load_step(std::span<const SequenceStep> batch) {
  if (batch.empty()) throw std::invalid_argument("forward: a batch of no sequences");
  if (observer_ && batch.size() > 1)
    throw std::invalid_argument("forward: an attention observer sees one sequence; detach it to run a batch");
  std::size_t total = 0;
  for (const SequenceStep& s : batch) total += s.tokens.size();
  if (total < 1 || total > std::size_t(max_tokens_))
    throw std::invalid_argument("forward: " + std::to_string(total) + " tokens in one call; this model was set up for 1 to " +
                                std::to_string(max_tokens_));
  const int n = static_cast<int>(total);
  for (const SequenceStep& s : batch) {
    if (s.tokens.empty()) throw std::invalid_argument("forward: a sequence with no tokens in the batch");
    if (s.pos < 0) throw std::invalid_argument("forward: negative position " + std::to_string(s.pos));
    if (s.pos > std::numeric_limits<int>::max() - int(s.tokens.size()))  // the call's end, pos + n, must be an int
      throw std::invalid_argument("forward: position " + std::to_string(s.pos) + " plus " + std::to_string(s.tokens.size()) +
                                  " tokens passes the largest int");
    if (!s.cache) throw std::invalid_argument("forward: a sequence of a batch without a cache");
    if (s.cache->rotates_at_read() != batch[0].cache->rotates_at_read())
      throw std::invalid_argument("forward: a batch mixes caches that rotate keys at read time with caches that do not");
    for (int token : s.tokens)
      if (token < 0 || token >= config_.vocab_size)
        throw std::invalid_argument("forward: token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                                    std::to_string(config_.vocab_size) + ")");
  }
  caches_.clear();  // each sequence writes its own cache: two sharing one would overwrite each other's rows
  for (const SequenceStep& s : batch) caches_.push_back(s.cache);
  std::sort(caches_.begin(), caches_.end());
  if (std::adjacent_find(caches_.begin(), caches_.end()) != caches_.end())
    throw std::invalid_argument("forward: two sequences of a batch share one cache");
  // step (2, n): every sequence's token ids, then their positions - read by the operations from backend memory.
  parts_.clear();
  for (const SequenceStep& s : batch) {
    const int offset = parts_.empty() ? 0 : parts_.back().offset + parts_.back().n;
    const int count = static_cast<int>(s.tokens.size());
    s.cache->prepare(s.pos, count);
    for (int i = 0; i < count; ++i) host_step_[offset + i] = s.tokens[i], host_step_[n + offset + i] = s.pos + i;
    parts_.push_back(Part{offset, count, s.pos, s.cache});
  }
  backend_.from_host(step_.data(), host_step_.data(), 2 * std::size_t(n));
  return n;
}

void Model::compute(int n, Logits which) {
  const ModelConfig& c = config_;
  const AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim()};
  const int dim = c.dim, kv_dim = c.kv_dim(), hidden = c.hidden_dim;
  Backend& b = backend_;
  float *x = x_.data(), *xb = xb_.data(), *q = q_.data(), *k = k_.data(), *v = v_.data();
  float *att = att_.data(), *hb = hb_.data(), *hb2 = hb2_.data(), *rope = rope_.data();
  const int* tokens = step_.data();         // (n) token ids, the sequences one after another
  const int* positions = step_.data() + n;  // (n) each token's position in its sequence

  // RoPE at the absolute positions, here; or, for caches that rotate at read time, by attention.
  const bool rotate_here = !parts_[0].cache->rotates_at_read();  // the same for every sequence (load_step)
  b.embed(x, token_embedding_, tokens, n, dim);        // x (n, dim) = embedding rows of the tokens
  if (rotate_here) b.rope_table(rope, positions, n, c.head_dim());  // rope (n, head_dim/2, 2)

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = layers_[l];
    // attention: x += Wo · attention(RoPE(Wq · norm(x)), RoPE(Wk · norm(x)), Wv · norm(x))
    const float* qk_rope = rotate_here ? rope : nullptr;
    Backend::Product qkv[] = {{q, w.wq, dim, qk_rope},       // q (n, n_heads · head_dim)
                              {k, w.wk, kv_dim, qk_rope},    // k (n, n_kv_heads · head_dim)
                              {v, w.wv, kv_dim}};            // v (n, n_kv_heads · head_dim)
    const bool written = write_in_products(l, positions, qkv[1], qkv[2]);  // the cache write, where it can ride
    b.norm_products(xb, x, w.rms_att, n, dim, c.head_dim(), qkv);          // xb (n, dim) = norm(x) (backend.h)
    if (!written) write_caches(l, positions, k, v);  // what later positions read
    attention_parts_.clear();
    for (const Part& s : parts_) {  // each sequence's tokens attend over its own cache only
      const KvView visible = s.cache->view(l);        // (rows, kv_dim) keys and values
      if (visible.rows > max_kv_rows_)
        throw std::invalid_argument("forward: the cache shows " + std::to_string(visible.rows) +
                                    " rows; this model was set up for at most " + std::to_string(max_kv_rows_));
      attention_parts_.push_back({s.offset, s.n, visible});
    }
    const std::span<float> scratch{scratch_.data(), scratch_.size()};
    if (observer_) {  // one sequence (load_step): att (n, dim), its weights to the observer
      const Backend::AttentionPart& s = attention_parts_[0];
      b.attention(att, q, positions, n, s.kv, shape, scratch, observed_weights_.data());  // weights (n, n_heads, rows)
      observe(l, parts_[0].pos, n, s.kv, observed_weights_.data());
    } else {
      b.attention_batch(att, q, positions, attention_parts_, shape, scratch);  // att (n, dim), every sequence's tokens
    }
    b.matmul_add(x, xb, att, w.wo, n, dim, dim);      // x (n, dim) += xb (n, dim) = Wo · att

    // MLP: x += W2 · (silu(W1 · norm(x)) ⊙ W3 · norm(x))
    b.norm_swiglu(hb, hb2, xb, x, w.rms_ffn, w.w1, w.w3, n, dim, hidden);  // hb (n, hidden); hb2 = W3 · xb
    b.matmul_add(x, xb, hb, w.w2, n, hidden, dim);    // x (n, dim) += xb (n, dim) = W2 · hb
  }

  // logits = classifier · norm(x), for each sequence's last position or for every position
  const float* last = x;  // (rows, dim) the positions to classify
  int rows = n;
  if (which == Logits::kLastPosition) {
    rows = static_cast<int>(parts_.size());
    if (rows == 1) {
      last = x + std::size_t(n - 1) * dim;
    } else if (rows < n) {  // a sequence brought several tokens: its last row to att (rows, dim), free by now
      for (int s = 0; s < rows; ++s)
        b.copy(att + std::size_t(s) * dim, x + std::size_t(parts_[s].offset + parts_[s].n - 1) * dim, dim);
      last = att;
    }  // else every sequence brought one token: x is those rows already
  }
  const Backend::Product classify[] = {{logits_.data(), classifier_, c.vocab_size}};  // logits (rows, vocab)
  b.norm_products(xb, last, rms_final_, rows, dim, c.head_dim(), classify);  // xb (rows, dim)
}

// Each sequence's write(), except that the sequences whose caches lie in one pool (KvCache::paged_write: the
// first such pool of the batch) are written together - on a GPU one launch instead of two per sequence.
void Model::write_caches(int layer, const int* positions, const float* k, const float* v) {
  const std::size_t kv_dim = config_.kv_dim();
  std::optional<PagedWrite> pool;
  paged_parts_.clear();
  for (const Part& s : parts_) {
    const std::optional<PagedWrite> where = s.cache->paged_write(layer, s.pos, s.n);
    if (where && (!pool || (where->keys.codes == pool->keys.codes && where->values.codes == pool->values.codes))) {
      pool = where;
      paged_parts_.push_back({s.offset, s.n, where->table});
    } else {
      s.cache->write(layer, s.pos, s.n, positions + s.offset, k + s.offset * kv_dim, v + s.offset * kv_dim);
    }
  }
  if (pool) backend_.write_paged_batch(pool->keys, pool->values, positions, paged_parts_, k, v);
}

// One sequence whose cache's write is plain float rows (KvCache::rows_write), in a call the backend runs fused
// (up to fused_tokens() tokens: a GPU's decode step, a short prefill): the k and v products store their rows
// there as well (Backend::Product::cache_rows), and the layer's write is no launch of its own. Elsewhere
// write_caches: several sequences write several caches, a long prefill's write is one launch either way, and the
// CPU's costs no launch at all.
bool Model::write_in_products(int layer, const int* positions, Backend::Product& k, Backend::Product& v) {
  if (parts_.size() != 1 || parts_[0].n > backend_.fused_tokens()) return false;
  const Part& s = parts_[0];
  const std::optional<RowsWrite> rows = s.cache->rows_write(layer, s.pos, s.n);
  if (!rows) return false;
  k.cache_rows = rows->keys, v.cache_rows = rows->values;
  k.cache_row_stride = v.cache_row_stride = rows->row_stride;
  k.cache_ring = v.cache_ring = rows->ring;
  k.positions = v.positions = positions;
  return true;
}

void Model::observe(int layer, int pos, int n, const KvView& visible, float* weights) {
  const std::size_t count = std::size_t(n) * config_.n_heads * visible.rows;
  backend_.to_host(host_weights_.data(), weights, count);
  KvView observed = visible;  // row positions live in backend memory (a ring's): the observer reads a copy
  if (visible.row_positions) {
    backend_.to_host(host_row_positions_.data(), visible.row_positions, visible.rows);
    observed.row_positions = host_row_positions_.data();
  }
  observer_->on_attention(layer, pos, n, observed, {host_weights_.data(), count});
}

std::span<const float> Model::read_logits(int rows) {
  const std::size_t count = std::size_t(rows) * config_.vocab_size;
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
  const SequenceStep one[] = {{tokens, pos, &cache_}};
  model_.load_step(one);  // the cache's bookkeeping, then the token and position: not recorded
  Backend& b = model_.backend();
  if (recording_ < 0) {
    recording_ = b.begin_recording();
    try {
      model_.compute(1, Logits::kLastPosition);
    } catch (...) {
      b.end_recording();
      recording_ = -1;
      throw;
    }
    b.end_recording();
  }
  b.replay(recording_);
  return model_.read_logits(1);
}

}  // namespace kvs
