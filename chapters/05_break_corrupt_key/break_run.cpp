#include "break_run.h"

#include <algorithm>
#include <string>

#include "cli.h"
#include "generate.h"
#include "sampler.h"

namespace kvs::ch05 {

AttentionOnPosition::AttentionOnPosition(const ModelConfig& config, int layer, int kv_head, int position)
    : layer_(layer), kv_head_(kv_head), position_(position), n_heads_(config.n_heads), group_(config.group()),
      last_(config.group(), 0.0f) {}

void AttentionOnPosition::on_attention(int layer, int, int n, const KvView& view, std::span<const float> weights) {
  if (layer != layer_) return;
  std::fill(last_.begin(), last_.end(), 0.0f);
  for (int r = 0; r < view.rows; ++r) {
    if (view.position_of(r) != position_) continue;
    for (int g = 0; g < group_; ++g) {  // query heads kv_head * group .. + group - 1 read this KV head
      const int head = kv_head_ * group_ + g;
      last_[g] = weights[(std::size_t(n - 1) * n_heads_ + head) * view.rows + r];
    }
  }
}

namespace {
void check_range(const std::string& flag, int value, int end, const std::string& what) {
  if (value < 0 || value >= end)
    throw UsageError(flag + " " + std::to_string(value) + " is out of range: " + what + " 0.." + std::to_string(end - 1));
}
}  // namespace

void check_kv_head(const Corruption& c, const ModelConfig& config) {
  check_range("--kv-head", c.kv_head, config.n_kv_heads, "the model has KV heads");
}

void check_corruption(const Corruption& c, const ModelConfig& config, int prompt_len, int new_tokens) {
  check_range("--layer", c.layer, config.n_layers, "the model has layers");
  check_kv_head(c, config);
  check_range("--at-step", c.at_step, std::max(1, new_tokens - 1),
        "a corruption must happen before the last of the " + std::to_string(new_tokens) + " new tokens, at steps");
  const int cached = prompt_len + c.at_step;  // positions in the cache right after token at_step is produced
  check_range("--position", c.position, cached,
        "at step " + std::to_string(c.at_step) + " the cache holds positions");
}

int default_position(int prompt_len, int at_step) {
  const int cached = prompt_len + at_step;
  if (cached < kDefaultMinCached)
    throw UsageError("the prompt's " + std::to_string(prompt_len) + " bytes and --at-step " + std::to_string(at_step) +
                     " leave " + std::to_string(cached) + " positions in the cache at the corruption; the default --position needs " +
                     std::to_string(kDefaultMinCached) + ": give a prompt of at least " +
                     std::to_string(kDefaultMinCached - at_step) + " bytes, a later --at-step, or --position");
  return cached - 1 - kDefaultDistance;
}

BreakRun run_greedy(Model& model, std::span<const int> prompt, int new_tokens, const BreakOptions& options) {
  const ModelConfig& config = model.config();
  Backend& backend = model.backend();
  BreakRun run;
  run.cache = std::make_unique<ch03::PreallocatedKvCache>(backend, config, static_cast<int>(prompt.size()) + new_tokens);
  run.recorded.logits.reserve(new_tokens);
  if (options.attention) run.attention.reserve(new_tokens);
  std::vector<float> original;  // the corrupted vector's bytes, for Restore::kVector
  auto between_steps = [&](int step, std::span<const float> logits) {
    run.recorded.logits.emplace_back(logits.begin(), logits.end());
    if (options.attention) run.attention.emplace_back(options.attention->last().begin(), options.attention->last().end());
    const Corruption* c = options.corruption;
    if (c && step == c->at_step) original = corrupt(backend, *run.cache, config, *c);
    if (c && step == options.restore_at_step) {
      if (options.restore == Restore::kVector) restore(backend, *run.cache, config, *c, original);
      if (options.restore == Restore::kAllRows)
        for (int layer = 0; layer < config.n_layers; ++layer)
          for (int p = 0; p < run.cache->length(); ++p) {
            const KvRow from = options.clean_cache->row(layer, p), to = run.cache->row(layer, p);
            backend.copy(to.key, from.key, config.kv_dim());
            backend.copy(to.value, from.value, config.kv_dim());
          }
    }
  };
  // Every run observed, its weights kept or not: asked for the weights, a backend may take another attention path
  // (CUDA: a block per query and head, not the split decoding kernel), whose sums end in other last bits, and this
  // chapter compares runs bit for bit - teacher-forced with every row restored must give KL 0, not 1e-14.
  struct Unkept final : AttentionObserver {  // observes, and keeps nothing
    void on_attention(int, int, int, const KvView&, std::span<const float>) override {}
  } unkept;
  struct Detach {  // on every way out, a throw included: the model must not keep a pointer to `unkept`
    Model& model;
    ~Detach() { model.observe_attention(nullptr); }
  } detach{model};
  if (options.attention) model.observe_attention(options.attention);
  else model.observe_attention(&unkept);
  Sampler greedy(config.vocab_size, {});
  const Generation g =
      generate_cached(model, *run.cache, greedy, prompt, new_tokens, 0, {}, between_steps, options.forced);
  run.recorded.tokens = g.tokens;
  return run;
}

CacheDifference compare_caches(Backend& backend, const ModelConfig& config, KvCache& a, KvCache& b) {
  const int positions = std::min(a.length(), b.length()), kv_dim = config.kv_dim();
  CacheDifference d{std::vector<std::vector<float>>(config.n_layers, std::vector<float>(positions)),
                    std::vector<std::vector<float>>(config.n_layers, std::vector<float>(positions))};
  std::vector<float> x(kv_dim), y(kv_dim);
  auto max_difference = [&](const float* p, const float* q) {
    backend.to_host(x.data(), p, kv_dim);
    backend.to_host(y.data(), q, kv_dim);
    return max_abs_difference(x, y);  // NaN where a row went NaN: it shows as changed
  };
  for (int layer = 0; layer < config.n_layers; ++layer)
    for (int p = 0; p < positions; ++p) {
      const KvRow ra = a.row(layer, p), rb = b.row(layer, p);
      d.keys[layer][p] = max_difference(ra.key, rb.key);
      d.values[layer][p] = max_difference(ra.value, rb.value);
    }
  return d;
}

}  // namespace kvs::ch05
