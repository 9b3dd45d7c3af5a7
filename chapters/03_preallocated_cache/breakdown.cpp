#include "breakdown.h"

#include <Eigen/Core>

#include <algorithm>
#include <cstdio>

#include "generate.h"
#include "preallocated_kv_cache.h"
#include "profiling_backend.h"
#include "timing.h"
#include "worker_pool.h"

namespace kvs::ch03 {

StepBytes decode_step_bytes(const ModelConfig& c, int positions) {
  // Every weight the model holds (Model::weight_bytes: the classifier apart from the embedding) but the
  // embedding table, of which a step reads one row.
  const std::int64_t embedding_table = std::int64_t(c.vocab_size) * c.dim, embedding_row = c.dim;
  const std::int64_t weights = Model::weight_bytes(c) - (embedding_table - embedding_row) * 4;
  return {weights, 2 * std::int64_t(c.n_layers) * c.kv_dim() * positions * 4};
}

double prefill_flops(const ModelConfig& c, int positions) {
  const double n = positions, dim = c.dim, kv = c.kv_dim(), hidden = c.hidden_dim;
  const double products = n * (2 * dim * dim + 2 * kv * dim + 3 * hidden * dim);    // per layer
  const double attention = 2 * c.n_heads * c.head_dim() * n * (n + 1);  // scores and weighted sum, causal
  return 2 * c.n_layers * products + c.n_layers * attention + 2.0 * c.vocab_size * dim;  // + the last row's logits
}

double measure_matmul_gflops(Backend& backend) {
  constexpr int kSize = kPeakSize;
  const std::size_t floats = std::size_t(kSize) * kSize;
  Buffer x(backend, floats), out(backend, floats);
  const std::vector<float> ones(floats, 1.0f / kSize);
  backend.from_host(x.data(), ones.data(), floats);
  const float* w = backend.upload_matrix(ones.data(), kSize, kSize);  // held until the backend goes
  double best = 0;
  for (int trial = 0; trial < 6; ++trial) {  // the first is the warm-up
    backend.synchronize();
    const Stopwatch timer;
    backend.matmul(out.data(), x.data(), w, kSize, kSize, kSize);
    backend.synchronize();
    if (trial > 0) best = std::max(best, 2.0 * kSize * kSize * kSize / (timer.milliseconds() / 1000) / 1e9);
  }
  return best;
}

double measure_read_gbs(std::int64_t bytes, int threads) {
  const std::int64_t n = std::max<std::int64_t>(bytes / 4, 1024);
  std::vector<float> data(n, 1.0f);
  threads = std::max(1, threads);
  // Enough passes to read about 2 MB per timing (a larger buffer: one pass), well above the clock's resolution; the
  // best of six timings is kept.
  const int passes = static_cast<int>(std::clamp<std::int64_t>(std::int64_t(500'000'000) / (n * 4) / 250, 1, 100000));
  double best = 0;
  volatile double sink = 0;  // the sums are stored, so the reads cannot be optimised away
  WorkerPool pool(threads);  // the kind of team the CPU backend runs on
  std::vector<double> sums(threads);
  for (int trial = 0; trial < 7; ++trial) {  // the first is the warm-up (pages touched, caches filled)
    const Stopwatch timer;
    for (int p = 0; p < passes; ++p) {
      pool.run(threads, [&](int t) {
        const std::int64_t begin = n * t / threads, end = n * (t + 1) / threads;
        sums[t] = Eigen::Map<const Eigen::ArrayXf>(data.data() + begin, end - begin).sum();  // vectorised read
      });
      double sum = 0;
      for (double part : sums) sum += part;
      sink = sink + sum;
    }
    const double seconds = timer.milliseconds() / 1000;
    if (trial > 0) best = std::max(best, double(n) * 4 * passes / seconds / 1e9);
  }
  return best;
}

double measure_copy_gbs(Backend& backend, std::int64_t bytes) {
  const std::size_t n = std::size_t(std::max<std::int64_t>(bytes / 4, 1024));
  Buffer from(backend, n), to(backend, n);
  backend.from_host(from.data(), std::vector<float>(n, 1.0f).data(), n);
  const int copies = static_cast<int>(std::clamp<std::int64_t>(std::int64_t(2'000'000'000) / (std::int64_t(n) * 4), 10, 100000));
  double best = 0;
  for (int trial = 0; trial < 7; ++trial) {  // the first is the warm-up
    backend.synchronize();
    const Stopwatch timer;
    for (int i = 0; i < copies; ++i) backend.copy(to.data(), from.data(), n);
    backend.synchronize();
    const double seconds = timer.milliseconds() / 1000;
    if (trial > 0) best = std::max(best, 2.0 * double(n) * 4 * copies / seconds / 1e9);  // read + write
  }
  return best;
}

namespace {
int longest_run_positions(const std::vector<int>& lengths, int new_tokens) {
  return *std::max_element(lengths.begin(), lengths.end()) + new_tokens;
}
}  // namespace

std::int64_t breakdown_cache_bytes(const ModelConfig& c, const std::vector<int>& lengths, int new_tokens) {
  return 2 * kv_cache_bytes(c, longest_run_positions(lengths, new_tokens));
}

std::int64_t breakdown_other_bytes(const ModelConfig& c, const Backend& backend, const std::vector<int>& lengths,
                                   int new_tokens) {
  const int longest = *std::max_element(lengths.begin(), lengths.end());
  const std::int64_t profiled_model =
      Model::weight_bytes(c) + Model::working_bytes(c, backend, std::max(1, longest), longest + new_tokens);
  // The probe's buffer: the bytes of the step with the most positions (decode_breakdown: + steps / 2).
  const std::int64_t probe = std::max<std::int64_t>(decode_step_bytes(c, longest + (new_tokens - 1) / 2).total(), 4096);
  return profiled_model + roofline_probe_bytes(backend, probe);
}

std::int64_t roofline_probe_bytes(const Backend& backend, std::int64_t step_bytes) {
  constexpr std::int64_t kMatrix = std::int64_t{kPeakSize} * kPeakSize * 4;
  const std::int64_t peak_rate = 4 * kMatrix;  // x, out and the uploaded matrix in the backend; the host's ones
  return peak_rate + (backend.host_memory() ? step_bytes : 3 * step_bytes);
}

void decode_breakdown(Runtime& rt, std::span<const int> tokens, const std::vector<int>& lengths, int new_tokens,
                      CsvWriter& csv) {
  ProfilingBackend profiled(rt.backend);
  Model model(rt.checkpoint, profiled, std::max(1, *std::max_element(lengths.begin(), lengths.end())),
              *std::max_element(lengths.begin(), lengths.end()) + new_tokens);
  const ModelConfig& c = model.config();
  const int threads = std::max(1, rt.cpu_threads());
  const bool host = rt.backend.host_memory(), graph = rt.backend.can_record();
  std::fprintf(stderr, "decode step breakdown, %s: per step over %d steps, the mean, p50 and p99 of a plain run;\n"
                       "the split by operation and the operations per step from a second run that waits for each one;\n"
                       "the bytes a step reads (weights + the K/V rows it attends to), the rate that makes, and\n%s\n",
               rt.backend.describe().c_str(), new_tokens - 1,
               host ? "this machine's read bandwidth for a working set of that size (measured now)"
                    : "the device's copy bandwidth (read + write) for a working set of that size (measured now)");
  if (graph)
    std::fprintf(stderr, "graph p50: the step replayed as one recorded launch (RecordedDecode), its bytes read against the\n"
                         "same limit, the launches (kernels and copies) it holds and its time per launch\n");
  std::fprintf(stderr, "\n  %7s %8s %8s %8s %8s %9s %8s %5s %10s %9s %9s %8s%s\n", "context", "step", "p50", "p99", "matmul",
               "attention", "other", "ops", "MB read", "GB/s", "limit", "of limit",
               graph ? "  graph p50  of limit  launches  us/launch" : "");
  // One cache per backend serves every run (each starts again at position 0), its pages written once by the
  // warm-up below: a fresh cache per run made the operating system back a new page of every layer's keys and
  // values every 4 KiB of rows (chapter 03: pages are backed when first written), and those steps, one in
  // sixteen, lifted the mean step (at 512 positions, one thread: 0.075 -> 0.088 ms) and the p99 (0.15 -> 0.20
  // ms), measured back to back. A server reuses its cache's memory; that cost is chapter 03's lesson, not a
  // decode step's.
  const int longest_run = longest_run_positions(lengths, new_tokens);
  PreallocatedKvCache plain_cache(rt.backend, c, longest_run), profiled_cache(profiled, c, longest_run);
  auto run = [&](Model& m, PreallocatedKvCache& cache, int prompt_len, DecodeSteps steps, const OnLogits& on_logits = {}) {
    Sampler greedy(c.vocab_size, {});
    cache.clear();
    return generate_cached(m, cache, greedy, tokens.first(prompt_len), new_tokens, 0, {}, on_logits, {}, steps);
  };
  struct Prefill {
    int positions;
    double ms, gflop;
  };
  std::vector<Prefill> prefills;
  // Prefill is the other regime: every weight is read once for many positions, so arithmetic limits it and
  // its yardstick is a large matrix product on the same backend, not bandwidth.
  const double peak = measure_matmul_gflops(rt.backend);
  // Warm-up, untimed, at the longest length: cold processor caches, and every page of both KV caches written.
  run(rt.model, plain_cache, longest_run - new_tokens, DecodeSteps::kForward);
  run(model, profiled_cache, longest_run - new_tokens, DecodeSteps::kForward);
  for (int prompt_len : lengths) {
    // On a GPU, this length once more untimed first: a product of a shape not run before may load its kernel
    // then (cuBLAS loads kernels lazily), and the shipped model's prefill at 512 positions measured 15.1 ms in
    // one run, against 0.86 in the benchmark beside it, which warms up every length (H100, 2026-11-26). On the
    // CPU the warm-up at the longest length above leaves nothing to load.
    if (!host) run(rt.model, plain_cache, prompt_len, DecodeSteps::kForward);
    const Generation g = run(rt.model, plain_cache, prompt_len, DecodeSteps::kForward);
    // The prefill is not a decode step: start counting after it.
    run(model, profiled_cache, prompt_len, DecodeSteps::kForward, [&](int step, std::span<const float>) {
      if (step == 0) profiled.reset();
    });
    prefills.push_back({prompt_len, g.ttft_ms(), prefill_flops(c, prompt_len) / 1e9});
    const int steps = new_tokens - 1;
    const double matmul = profiled.milliseconds(OpKind::kMatmul) / steps,
                 attention = profiled.milliseconds(OpKind::kAttention) / steps,
                 other = profiled.milliseconds(OpKind::kOther) / steps;
    std::int64_t operations = 0;
    for (OpKind kind : {OpKind::kMatmul, OpKind::kAttention, OpKind::kOther}) operations += profiled.operations(kind);
    double mean = 0;
    for (std::size_t s = 1; s < g.step_ms.size(); ++s) mean += g.step_ms[s] / steps;
    // The average step attends to prompt_len + steps/2 positions.
    const StepBytes bytes = decode_step_bytes(c, prompt_len + steps / 2);
    const double achieved = bytes.total() / (mean / 1000) / 1e9;
    const double limit = host ? measure_read_gbs(bytes.total(), threads) : measure_copy_gbs(rt.backend, bytes.total());
    const double graph_p50 = graph ? run(rt.model, plain_cache, prompt_len, DecodeSteps::kRecorded).decode_percentile_ms(50) : 0;
    const int launches = graph ? rt.backend.recorded_launches() : 0;
    // The graph's step at its median, against the same limit (its bytes: this length's, +steps/2 as above).
    const double graph_share = graph ? 100 * bytes.total() / (graph_p50 / 1000) / 1e9 / limit : 0;
    std::fprintf(stderr, "  %7d %8.4f %8.4f %8.4f %8.4f %9.4f %8.4f %5lld %10.2f %9.1f %9.1f %7.0f%%", prompt_len, mean,
                 g.decode_percentile_ms(50), g.decode_percentile_ms(99), matmul, attention, other,
                 static_cast<long long>(operations / steps), bytes.total() / 1e6, achieved, limit, 100 * achieved / limit);
    if (graph)
      std::fprintf(stderr, "  %9.4f %8.0f%% %9d %10.2f", graph_p50, graph_share, launches, 1000 * graph_p50 / launches);
    std::fprintf(stderr, "\n");
    csv.row(prompt_len, mean, g.decode_percentile_ms(50), g.decode_percentile_ms(99), matmul, attention, other,
            bytes.weights, bytes.kv, achieved, limit, rt.cpu_threads(), operations / steps, graph_p50, g.ttft_ms(),
            prefill_flops(c, prompt_len) / 1e9 / (g.ttft_ms() / 1000), peak, launches);
    csv.commit();
  }
  std::fprintf(stderr, "\nprefill (time to first token, from the same runs): its floating-point work against this\n"
                       "backend's rate on a 1024 x 1024 x 1024 matrix product, measured now: %.1f GFLOP/s\n\n", peak);
  std::fprintf(stderr, "  %7s %11s %9s %9s %8s\n", "context", "prefill ms", "GFLOP", "GFLOP/s", "of peak");
  for (const Prefill& p : prefills)
    std::fprintf(stderr, "  %7d %11.3f %9.4f %9.1f %7.0f%%\n", p.positions, p.ms, p.gflop, p.gflop / (p.ms / 1000),
                 100 * p.gflop / (p.ms / 1000) / peak);
}

}  // namespace kvs::ch03
