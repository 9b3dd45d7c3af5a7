#include "experiments.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "03_preallocated_cache/breakdown.h"
#include "progress.h"
#include "timing.h"
#include "tokenizer.h"

namespace kvs::ch08 {
namespace {

// A scheduler run's progress (common/progress.h): requests finished.
OnStep report_to(Progress& progress) {
  return [&progress](const RunStats&, int finished, int requests) { progress.update(finished, requests); };
}

std::vector<double> collect(const std::vector<RequestResult>& results, double (RequestResult::*metric)() const) {
  std::vector<double> values;
  for (const RequestResult& r : results) values.push_back((r.*metric)());
  return values;
}
double mean(const std::vector<double>& v) { return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / v.size(); }

// Decode steps only: every sequence of the step brought one token.
std::vector<double> decode_step_ms(const RunStats& stats, int sequences) {
  std::vector<double> ms;
  for (int i = 0; i < stats.steps; ++i)
    if (stats.step_sequences[i] == sequences && stats.step_tokens[i] == sequences) ms.push_back(stats.step_ms[i]);
  return ms;
}

double waste_share(const RunStats& stats) {
  return stats.reserved_position_steps > 0 ? 1.0 - stats.live_position_steps / stats.reserved_position_steps : 0.0;
}

// How many requests' outputs equal `expected`; prints the first `show` that differ (a coded pool's check prints
// each parting itself, with its logit gap: unexplained_partings).
int count_identical(const std::vector<RequestResult>& results, const std::vector<std::vector<int>>& expected, int show = 5) {
  int same = 0, shown = 0;
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (results[i].output == expected[i]) {
      ++same;
      continue;
    }
    if (shown++ < show) std::fprintf(stderr, "  request %zu differs from output token %zu on\n", i, first_difference(results[i].output, expected[i]));
  }
  return same;
}

// A coded pool (chapter 10) rounds what it stores, and a batched product may round its floats differently from one
// row's (~1e-6: on the CPU a step of more than 64 tokens, e.g. a prompt chunk beside the decode tokens; on a GPU
// any batch), so a number on a rounding boundary is stored one code apart batched and alone; that moves a logit
// by ~1e-3 (chapter 10's tests measure up to 1.3e-3 over a call). An output may then part from the request alone
// only where the alone run's two best tokens nearly tie: within kNearTie, 50 times that. Counts the outputs that
// part elsewhere (a bug, not rounding), printing each parting.
constexpr float kNearTie = 0.05f;
int unexplained_partings(Setup& s, const std::vector<RequestResult>& results, const std::vector<std::vector<int>>& expected) {
  int unexplained = 0;
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (results[i].output == expected[i]) continue;
    const std::size_t at = first_difference(results[i].output, expected[i]);
    float gap = INFINITY;  // the alone run's two best logits at the token where the outputs part
    serve_alone(s.rt.model, s.requests[i], s.format, s.block_size, [&](int step, std::span<const float> logits) {
      if (step != static_cast<int>(at)) return;
      std::vector<float> top(logits.begin(), logits.end());
      std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<>());
      gap = top[0] - top[1];
    });
    const bool near_tie = gap <= kNearTie;
    std::fprintf(stderr, "  request %zu parts at token %zu, where its two best logits alone are %.4f apart: %s\n", i, at,
                 gap, near_tie ? "a near-tie" : "NOT a near-tie");
    unexplained += !near_tie;
  }
  return unexplained;
}

std::vector<std::vector<int>> outputs_of(const std::vector<RequestResult>& results) {
  std::vector<std::vector<int>> outputs;
  for (const RequestResult& r : results) outputs.push_back(r.output);
  return outputs;
}


}  // namespace

namespace {
// The step the last request arrives at (a trace need not be in order).
int last_arrival(const std::vector<Request>& requests) {
  return std::ranges::max(requests, {}, &Request::arrival_step).arrival_step;
}

// The blocks of `block_size` positions `bytes` hold (UsageError when not even one).
int pool_blocks(const Setup& s, int block_size, std::int64_t bytes) {
  const std::int64_t per_block = BlockPool::block_bytes(s.rt.model.config(), block_size, s.format);
  if (bytes < per_block)
    throw UsageError("--kv-memory " + format_bytes(double(bytes)) + " holds no block of " + std::to_string(block_size) +
                     " positions (" + format_bytes(double(per_block)) + "); give it more memory or use smaller blocks");
  if (bytes / per_block > BlockPool::max_blocks(block_size))
    throw UsageError("--kv-memory " + format_bytes(double(bytes)) + " makes " + std::to_string(bytes / per_block) +
                     " blocks of " + std::to_string(block_size) + " positions, past the pool's " +
                     std::to_string(BlockPool::max_blocks(block_size)) + " (rows are ints); give less memory");
  return static_cast<int>(bytes / per_block);
}
}  // namespace

BlockPool make_pool(Setup& s, int block_size, std::int64_t bytes, int max_sequences) {
  const ModelConfig& c = s.rt.model.config();
  return BlockPool(s.rt.backend, c, pool_blocks(s, block_size, bytes), block_size, max_sequences, c.seq_len, s.format);
}

namespace {
// The throughput experiment's requests for a batch of `batch`, all arriving at once: prompts of prompt_min tokens
// (distinct: slices of the trace's text, or of one prompt repeated), output_max new tokens each.
std::vector<Request> throughput_requests(const Setup& s, int batch) {
  std::vector<Request> requests;
  for (int i = 0; i < batch; ++i) {
    const std::vector<int>& text = s.requests[i % s.requests.size()].prompt;
    requests.push_back(Request{std::vector<int>(text.begin(), text.begin() + std::min<std::size_t>(s.shape.prompt_min, text.size())),
                               s.shape.output_max, 0});
  }
  return requests;
}
SchedulerOptions throughput_options(const Setup& s, int batch) {
  return {.batching = Batching::kContinuous, .max_batch = batch, .token_budget = s.options.token_budget};
}

// The scheduler's options for the memory experiment: memory, not the batch limit, decides how many run at once.
SchedulerOptions memory_options(const Setup& s) {
  SchedulerOptions options = s.options;
  options.max_batch = options.token_budget;
  return options;
}
}  // namespace

void check_pools(const Setup& s, const std::string& experiment) {
  const ModelConfig& c = s.rt.model.config();
  std::vector<int> block_sizes = {s.block_size};
  const SchedulerOptions options = experiment == "memory" ? memory_options(s) : s.options;
  if (experiment == "memory") {
    block_sizes = s.block_sizes;
    block_sizes.push_back(c.seq_len);  // memory_waste's max-length reservation
  }
  for (int block_size : block_sizes) {
    // As make_pool's pool would hold: its block tables are sized for the model's context.
    const int blocks = pool_blocks(s, block_size, s.kv_memory);
    // A watermark of the whole pool admits nobody beside a running sequence: batching off, without a word.
    if (options.watermark_blocks >= blocks)
      throw UsageError("--watermark " + std::to_string(options.watermark_blocks) + " keeps free at least all " +
                       std::to_string(blocks) + " blocks of " + std::to_string(block_size) +
                       " positions the pool holds, so no sequence joins a running one; give fewer");
    const int positions = pool_positions(blocks_needed(c.seq_len, block_size), blocks, block_size);
    if (experiment != "throughput") check_requests(s.rt.model, positions, s.requests, options);
    else  // requests of its own, per batch size
      for (int batch : s.batch_sizes)
        check_requests(s.rt.model, positions, throughput_requests(s, batch), throughput_options(s, batch));
  }
}

int serve_trace(Setup& s) {
  BlockPool pool = make_pool(s, s.block_size, s.kv_memory, s.options.batch_limit());
  std::fprintf(stderr, "%zu requests, %s batching of up to %d sequences and %d tokens a step; a pool of %d blocks of %d "
                       "positions (%s)\n", s.requests.size(), to_string(s.options.batching), s.options.max_batch,
               s.options.token_budget, pool.blocks(), pool.block_size(), format_bytes(double(pool.allocated_bytes())).c_str());
  std::vector<RequestResult> results;
  Progress progress("serving", "requests finished");
  const RunStats stats = serve(s.rt.model, pool, s.requests, s.options, results, report_to(progress));
  for (std::size_t i = 0; i < std::min<std::size_t>(2, results.size()); ++i)
    std::printf("[request %zu] %s|%s\n", i, decode_on_one_line(s.requests[i].prompt).c_str(), decode_on_one_line(results[i].output).c_str());
  std::fflush(stdout);  // before the report on stderr, also where stdout is a pipe (fully buffered): a terminal's order

  const auto ttft = collect(results, &RequestResult::time_to_first_token_ms);
  const auto tpot = collect(results, &RequestResult::time_per_output_token_ms);  // per request, for the CSV
  std::vector<double> tpot_after_first;  // the p50's: a 1-token request has no time per token after its first
  for (const RequestResult& r : results)
    if (r.output.size() > 1) tpot_after_first.push_back(r.time_per_output_token_ms());
  const auto latency = collect(results, &RequestResult::latency_ms);
  std::fprintf(stderr, "\n%d steps in %.0f ms: %ld tokens generated, %.0f tokens/s; %ld prompt tokens prefilled; up to %d "
                       "sequences in a step; %d preemptions (%ld tokens recomputed)\n", stats.steps, stats.wall_ms,
               stats.generated_tokens, stats.tokens_per_s(), stats.prefill_tokens, stats.peak_running, stats.preemptions,
               stats.recomputed_tokens);
  std::fprintf(stderr, "per request: time to first token p50 %.1f ms, p99 %.1f ms; time per output token p50 %.2f ms; "
                       "latency p50 %.1f ms, p99 %.1f ms\n", percentile(ttft, 50), percentile(ttft, 99),
               percentile(tpot_after_first, 50), percentile(latency, 50), percentile(latency, 99));
  std::fprintf(stderr, "KV cache: %.1f%% of the positions handed out held no K/V (the tails of last blocks), on average over "
                       "the steps; at most %d of %d blocks in use\n", 100 * waste_share(stats), stats.peak_used_blocks, pool.blocks());

  std::fprintf(stderr, "\nchecking every output against the request served alone (%s)...\n",
               s.format.format == KvFormat::kFp32 ? "chapter 03's cache" : "a pool of its own, same format");
  std::vector<std::vector<int>> expected;
  for (const Request& r : s.requests) expected.push_back(serve_alone(s.rt.model, r, s.format, s.block_size));
  const bool coded = s.format.format != KvFormat::kFp32;
  const int same = count_identical(results, expected, coded ? 0 : 5);
  // fp32: every output must be the request's alone. A coded pool: each parting must be at a near-tie.
  const int unexplained = coded ? unexplained_partings(s, results, expected) : static_cast<int>(results.size()) - same;
  std::fprintf(stderr, "%d of %zu outputs identical to the request alone", same, results.size());
  if (coded)
    std::fprintf(stderr, "; %d part where two tokens nearly tie (%s rounds what the pool stores: batched and alone, a "
                         "number on a rounding boundary lands one code apart), %d elsewhere", static_cast<int>(results.size()) - same - unexplained,
                 to_string(s.format.format), unexplained);
  std::fprintf(stderr, "\n");

  CsvWriter csv({"--csv", s.csv}, "request,prompt_tokens,new_tokens,arrival_step,ttft_ms,tpot_ms,latency_ms,preemptions,identical_alone",
                s.rt.inputs());
  for (std::size_t i = 0; i < results.size(); ++i)
    csv.row(i, s.requests[i].prompt.size(), results[i].output.size(), s.requests[i].arrival_step, ttft[i], tpot[i], latency[i],
            results[i].preemptions, results[i].output == expected[i] ? 1 : 0);
  csv.commit();
  if (csv.enabled()) std::fprintf(stderr, "wrote %s\n", csv.path().c_str());
  return unexplained == 0 ? 0 : 1;
}

namespace {
// What the throughput experiment's average step reads: the weights, and one sequence's K/V at the midpoint of its
// new tokens (a coded pool reads less).
ch03::StepBytes throughput_step_bytes(const Setup& s) {
  const ModelConfig& c = s.rt.model.config();
  ch03::StepBytes step = ch03::decode_step_bytes(c, s.shape.prompt_min + s.shape.output_max / 2);
  step.kv = step.kv * BlockPool::block_bytes(c, 1, s.format) / BlockPool::block_bytes(c, 1);
  return step;
}
}  // namespace

std::int64_t throughput_probe_bytes(const Setup& s) {
  const ch03::StepBytes step = throughput_step_bytes(s);
  const int largest = *std::max_element(s.batch_sizes.begin(), s.batch_sizes.end());
  const std::int64_t probe = step.weights + largest * step.kv;
  return ch03::roofline_probe_bytes(s.rt.backend, probe);  // the host's too: a synthetic model's are gigabytes
}

int throughput(Setup& s) {
  const ModelConfig& c = s.rt.model.config();
  const int prompt = s.shape.prompt_min, new_tokens = s.shape.output_max;
  const int threads = std::max(1, s.rt.cpu_threads());
  const bool host = s.rt.backend.host_memory();
  const ch03::StepBytes step = throughput_step_bytes(s);
  const double matmul_gflops = ch03::measure_matmul_gflops(s.rt.backend);
  std::fprintf(stderr, "batches of requests with %d-token prompts and %d new tokens each; decode steps only (every "
                       "sequence one token); %d rounds over the batch sizes\n", prompt, new_tokens, s.rounds);
  std::fprintf(stderr, "roofline: a step reads the weights once (%s) and each sequence's K/V (%s at %d positions); the "
                       "matrix products run at up to %.1f GFLOP/s here\n",
               format_bytes(double(step.weights)).c_str(), format_bytes(double(step.kv)).c_str(), prompt + new_tokens / 2,
               matmul_gflops);
  // Every batch size is measured in each of s.rounds rounds, the sizes taken in turn within a round (1, 2, ...,
  // 64, then 1, 2, ... again): a slow minute of a shared machine then slows one round of every size instead of
  // every round of one size, and the median of the rounds' p50s leaves it out. The range of those p50s is
  // printed beside it: how far one run could have been off.
  struct Measured {
    std::vector<double> round_p50, steps;  // each round's p50; every round's decode steps (ms)
  };
  std::vector<Measured> measured(s.batch_sizes.size());
  Progress progress("throughput", "batch runs");
  for (int round = 0; round < s.rounds; ++round) {
    for (std::size_t b = 0; b < s.batch_sizes.size(); ++b) {
      const int batch = s.batch_sizes[b];
      const std::vector<Request> requests = throughput_requests(s, batch);
      const SchedulerOptions options = throughput_options(s, batch);
      BlockPool pool = make_pool(s, s.block_size, s.kv_memory, options.batch_limit());
      std::vector<RequestResult> results;
      serve(s.rt.model, pool, requests, options, results);  // warm-up
      const std::vector<double> ms = decode_step_ms(serve(s.rt.model, pool, requests, options, results), batch);
      if (ms.empty())  // the last prompts' prefill ran past the first sequences' last tokens
        throw UsageError("--experiment throughput: no step of batch " + std::to_string(batch) + " had all " +
                         std::to_string(batch) + " sequences decoding; give them more new tokens (--output-lengths) "
                         "or prefill them faster (a larger --token-budget)");
      measured[b].round_p50.push_back(percentile(ms, 50));
      measured[b].steps.insert(measured[b].steps.end(), ms.begin(), ms.end());
      progress.update(std::int64_t(round) * s.batch_sizes.size() + b + 1, std::int64_t(s.rounds) * s.batch_sizes.size());
    }
  }

  std::fprintf(stderr, "%6s %10s %15s %10s %12s %9s %12s %12s\n", "batch", "step p50", "rounds' p50s", "step p99", "tokens/s",
               "vs B=1", "memory floor", "compute floor");
  CsvWriter csv({"--csv", s.csv}, "threads,batch,step_ms_p50,step_ms_p99,tokens_per_s,speedup_vs_batch1,memory_floor_ms,"
                                  "compute_floor_ms,rounds,round_p50_min_ms,round_p50_max_ms", s.rt.inputs());
  double batch1 = 0;
  for (std::size_t b = 0; b < s.batch_sizes.size(); ++b) {
    const int batch = s.batch_sizes[b];
    const std::vector<double>& rounds = measured[b].round_p50;
    const double p50 = percentile(rounds, 50), p99 = percentile(measured[b].steps, 99);
    const double fastest = *std::min_element(rounds.begin(), rounds.end()), slowest = *std::max_element(rounds.begin(), rounds.end());
    const double tokens_per_s = p50 > 0 ? 1000.0 * batch / p50 : 0;
    if (batch1 == 0) batch1 = tokens_per_s;
    // A GPU's memory is not the host's: its floor is the device's copy bandwidth, as chapter 03's breakdown takes
    // it (the host's read bandwidth put the synthetic model's floor at 227 ms against a 1.6 ms step on an H100).
    const std::int64_t step_bytes = step.weights + batch * step.kv;
    const double limit_gbs = host ? ch03::measure_read_gbs(step_bytes, threads) : ch03::measure_copy_gbs(s.rt.backend, step_bytes);
    const double memory_floor = step_bytes / (limit_gbs * 1e9) * 1000;
    const double compute_floor = 2.0 * double(parameter_count(c)) * batch / (matmul_gflops * 1e9) * 1000;
    char range[32];
    std::snprintf(range, sizeof range, "%.3f-%.3f", fastest, slowest);
    std::fprintf(stderr, "%6d %8.3f ms %15s %7.3f ms %12.0f %8.2fx %9.3f ms %10.3f ms\n", batch, p50, range, p99, tokens_per_s,
                 tokens_per_s / batch1, memory_floor, compute_floor);
    csv.row(threads, batch, p50, p99, tokens_per_s, tokens_per_s / batch1, memory_floor, compute_floor, s.rounds, fastest,
            slowest);
  }
  std::fprintf(stderr, "step p50: the median of the rounds' p50s (their range beside it, ms); p99: of every round's "
                       "steps; memory floor: the step's bytes at %s for a working set that size "
                       "(measured); compute floor: 2 x parameters x batch FLOPs at the matrix-product rate above\n",
               host ? "this machine's read bandwidth" : "the device's copy bandwidth (read + write)");
  csv.commit();
  if (csv.enabled()) std::fprintf(stderr, "wrote %s\n", csv.path().c_str());
  return 0;
}

int memory_waste(Setup& s) {
  const ModelConfig& c = s.rt.model.config();
  std::vector<int> sizes = s.block_sizes;
  sizes.push_back(c.seq_len);  // one block of the whole context a sequence: a max-length reservation
  const SchedulerOptions options = memory_options(s);
  const int latest = last_arrival(s.requests);
  std::fprintf(stderr, "%zu requests, %s, in a pool of %s; the last row reserves the model's whole context "
                       "(%d positions) per sequence, as a preallocated cache per sequence must\n", s.requests.size(),
               latest == 0 ? "all at step 0" : ("arriving over " + std::to_string(latest) + " steps").c_str(),
               format_bytes(double(s.kv_memory)).c_str(), c.seq_len);
  std::fprintf(stderr, "%10s %8s %14s %14s %8s %14s %8s %10s\n", "block", "blocks", "reserved (avg)", "live (avg)", "waste",
               "largest batch", "preempt", "tokens/s");
  CsvWriter csv({"--csv", s.csv}, "block_size,blocks,reserved_bytes_mean,live_bytes_mean,waste_share,largest_batch,preemptions,tokens_per_s,steps",
                s.rt.inputs());
  for (int block_size : sizes) {
    BlockPool pool = make_pool(s, block_size, s.kv_memory, options.batch_limit());
    std::vector<RequestResult> results;
    Progress progress("block size " + std::to_string(block_size), "requests finished");
    const RunStats stats = serve(s.rt.model, pool, s.requests, options, results, report_to(progress));
    const double bytes = double(pool.bytes_per_position());
    const double reserved = stats.reserved_position_steps / stats.steps * bytes, live = stats.live_position_steps / stats.steps * bytes;
    std::fprintf(stderr, "%10s %8d %14s %14s %7.1f%% %14d %8d %10.0f\n",
                 block_size == c.seq_len ? "max-length" : std::to_string(block_size).c_str(), pool.blocks(),
                 format_bytes(reserved).c_str(), format_bytes(live).c_str(), 100 * waste_share(stats), stats.peak_running,
                 stats.preemptions, stats.tokens_per_s());
    csv.row(block_size, pool.blocks(), reserved, live, waste_share(stats), stats.peak_running, stats.preemptions,
            stats.tokens_per_s(), stats.steps);
  }
  csv.commit();
  if (csv.enabled()) std::fprintf(stderr, "wrote %s\n", csv.path().c_str());
  return 0;
}

int batching(Setup& s) {
  std::fprintf(stderr, "%zu requests arriving over %d steps, up to %d sequences a step, blocks of %d in %s\n",
               s.requests.size(),
               last_arrival(s.requests),
               s.options.max_batch, s.block_size,
               format_bytes(double(s.kv_memory)).c_str());
  CsvWriter csv({"--csv", s.csv},
                "batching,steps,total_ms,tokens_per_s,latency_ms_mean,latency_ms_p99,ttft_ms_mean,idle_slot_share,"
                "preemptions,recomputed_tokens",
                s.rt.inputs());
  // One run of each kind untimed, then s.rounds timed runs of each, the kinds in turn: a run of this trace takes
  // under half a second, and measured once each, continuous first, the first run paid what a process's first run
  // pays (pages first written, caches cold) and two runs of one kind differed by up to 25%. The table shows each
  // kind's run of median wall time; steps, idle slots and preemptions are the same in every run. The recomputed
  // tokens are printed (the CSV has the preemptions too) because they are work: a kind that preempts more
  // recomputes more prompt tokens for the same output.
  struct Run {
    RunStats stats;
    double latency_mean, latency_p99, ttft_mean;
  };
  const Batching kinds[] = {Batching::kContinuous, Batching::kStatic};
  std::vector<Run> runs[2];
  {
    Progress progress("batching", "runs");
    const int total_runs = 2 * (s.rounds + 1);
    for (int round = -1, done = 0; round < s.rounds; ++round)
      for (int k = 0; k < 2; ++k) {
        SchedulerOptions options = s.options;
        options.batching = kinds[k];
        BlockPool pool = make_pool(s, s.block_size, s.kv_memory, options.batch_limit());
        std::vector<RequestResult> results;
        RunStats stats = serve(s.rt.model, pool, s.requests, options, results);
        progress.update(++done, total_runs);
        if (round < 0) continue;  // the warm-up
        const auto latency = collect(results, &RequestResult::latency_ms);
        runs[k].push_back(Run{std::move(stats), mean(latency), percentile(latency, 99),
                              mean(collect(results, &RequestResult::time_to_first_token_ms))});
      }
  }
  std::fprintf(stderr, "%d runs of each, the median's:\n", s.rounds);
  std::fprintf(stderr, "%11s %7s %10s %10s %12s %12s %10s %10s %11s\n", "batching", "steps", "total", "tokens/s",
               "latency mean", "latency p99", "TTFT mean", "idle slots", "recomputed");
  for (int k = 0; k < 2; ++k) {
    std::vector<Run>& kind = runs[k];
    std::sort(kind.begin(), kind.end(), [](const Run& a, const Run& b) { return a.stats.wall_ms < b.stats.wall_ms; });
    const Run& run = kind[(kind.size() - 1) / 2];  // the lower of two middle runs, as throughput's percentile(50)
    const double idle = double(run.stats.idle_slot_steps) / double(run.stats.slot_steps);
    std::fprintf(stderr, "%11s %7d %7.0f ms %10.0f %9.0f ms %9.0f ms %7.0f ms %9.1f%% %11ld\n", to_string(kinds[k]),
                 run.stats.steps, run.stats.wall_ms, run.stats.tokens_per_s(), run.latency_mean, run.latency_p99,
                 run.ttft_mean, 100 * idle, long(run.stats.recomputed_tokens));
    csv.row(to_string(kinds[k]), run.stats.steps, run.stats.wall_ms, run.stats.tokens_per_s(), run.latency_mean,
            run.latency_p99, run.ttft_mean, idle, run.stats.preemptions, run.stats.recomputed_tokens);
  }
  std::fprintf(stderr, "idle slots: sequence slots of a step left empty while an arrived request waited; recomputed: "
                       "prompt and generated tokens prefilled again after a preemption (more work for the same output)\n");
  csv.commit();
  if (csv.enabled()) std::fprintf(stderr, "wrote %s\n", csv.path().c_str());
  return 0;
}

int preemption(Setup& s) {
  const ModelConfig& c = s.rt.model.config();
  std::int64_t everyone = 0;  // a pool that holds every request whole at once: nothing is ever preempted
  for (const Request& r : s.requests)
    everyone += blocks_needed(int(r.prompt.size()) + r.max_new_tokens, s.block_size) * BlockPool::block_bytes(c, s.block_size, s.format);
  s.rt.plan_kv_cache(std::max(everyone, s.kv_memory));  // the larger pool, one at a time (--memory-limit)
  std::fprintf(stderr, "%zu requests; a pool of %s (every request at once) against one of %s\n", s.requests.size(),
               format_bytes(double(everyone)).c_str(), format_bytes(double(s.kv_memory)).c_str());
  CsvWriter csv({"--csv", s.csv},
                "pool_bytes,blocks,watermark_blocks,steps,total_ms,tokens_per_s,preemptions,recomputed_tokens,identical_outputs",
                s.rt.inputs());
  std::vector<std::vector<int>> unconstrained;
  // The small pool again with a watermark of 1, 2, 4 and 8 blocks (SchedulerOptions::watermark_blocks): fewer
  // preemptions, paid for with fewer sequences a step.
  struct Run {
    std::int64_t bytes;
    int watermark;
  };
  for (const Run run : {Run{everyone, 0}, Run{s.kv_memory, 0}, Run{s.kv_memory, 1}, Run{s.kv_memory, 2},
                        Run{s.kv_memory, 4}, Run{s.kv_memory, 8}}) {
    BlockPool pool = make_pool(s, s.block_size, run.bytes, s.options.batch_limit());
    std::vector<RequestResult> results;
    Progress progress(format_bytes(double(run.bytes)) + " pool", "requests finished");
    SchedulerOptions options = s.options;
    options.watermark_blocks = run.watermark;
    const RunStats stats = serve(s.rt.model, pool, s.requests, options, results, report_to(progress));
    if (unconstrained.empty()) unconstrained = outputs_of(results);
    const bool coded = s.format.format != KvFormat::kFp32;
    const int same = count_identical(results, unconstrained, coded ? 0 : 5);
    std::fprintf(stderr, "%10s, %5d blocks, watermark %d: %5d steps, %7.0f ms, %6.0f tokens/s, %4d preemptions, %6ld tokens "
                         "recomputed, up to %2d sequences a step; %d of %zu outputs identical to the unconstrained run\n",
                 format_bytes(double(run.bytes)).c_str(), pool.blocks(), run.watermark, stats.steps, stats.wall_ms,
                 stats.tokens_per_s(), stats.preemptions, stats.recomputed_tokens, stats.peak_running, same, results.size());
    csv.row(run.bytes, pool.blocks(), run.watermark, stats.steps, stats.wall_ms, stats.tokens_per_s(), stats.preemptions,
            stats.recomputed_tokens, same);
    // A coded pool: batching differently (here, other sequences at each step) may part an output at a near-tie.
    if (same != static_cast<int>(results.size()) && (!coded || unexplained_partings(s, results, unconstrained) > 0))
      return 1;
  }
  csv.commit();
  if (csv.enabled()) std::fprintf(stderr, "wrote %s\n", csv.path().c_str());
  return 0;
}

int break_double_free(Setup& s) {
  if (s.requests.size() < 2) throw UsageError("--experiment break needs at least two requests: one to finish, one to suffer");
  std::vector<RequestResult> expected_results;
  {
    BlockPool pool = make_pool(s, s.block_size, s.kv_memory, s.options.batch_limit());
    serve(s.rt.model, pool, s.requests, s.options, expected_results);
  }
  const std::vector<std::vector<int>> expected = outputs_of(expected_results);
  // The same run, with the pool's double free armed once the first request has finished: the next block given
  // back goes on the free list twice, and two later sequences that need a block are both handed it.
  auto broken_run = [&](bool audit, int& armed_at, std::vector<RequestResult>& results) {
    BlockPool pool = make_pool(s, s.block_size, s.kv_memory, s.options.batch_limit());
    SchedulerOptions options = s.options;
    options.audit_blocks = audit;
    armed_at = -1;
    const RunStats stats = serve(s.rt.model, pool, s.requests, options, results, [&](const RunStats& stats, int finished, int count) {
      if (finished > 0 && finished < count && armed_at < 0) pool.break_double_free(), armed_at = stats.steps;
    });
    if (audit) check_block_ownership(pool, {});  // the double free may have come with the last request
    return stats;
  };
  int armed_at = -1;
  std::vector<RequestResult> results;
  broken_run(false, armed_at, results);
  if (armed_at < 0)  // every request finished in the same step: nothing ran after a request had finished
    throw UsageError("--experiment break: no request finished while another still ran, so the double free was never "
                     "armed; give requests of different lengths (a wider --output-lengths) or more --requests");
  std::fprintf(stderr, "the next block given back after step %d (the first request had finished) freed twice; blocks of %d "
                       "positions, no audit:\n",
               armed_at, s.block_size);
  int victims = 0;
  CsvWriter csv({"--csv", s.csv}, "request,first_different_token,output_tokens,arrival_step", s.rt.inputs());
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (results[i].output == expected[i]) continue;
    const std::size_t at = first_difference(results[i].output, expected[i]);
    std::fprintf(stderr, "  request %zu: its output changes at token %zu of %zu\n", i, at, expected[i].size());
    csv.row(i, at, expected[i].size(), s.requests[i].arrival_step);
    if (victims++ == 0) {
      std::printf("request %zu, prompt: %s\n  served correctly: %s\n  with the double free: %s\n", i,
                  decode_on_one_line(s.requests[i].prompt).c_str(), decode_on_one_line(expected[i]).c_str(), decode_on_one_line(results[i].output).c_str());
      std::fflush(stdout);  // between the stderr lines around it, also through a pipe
    }
  }
  std::fprintf(stderr, "%d of %zu requests got different text; checked against each request alone, as serve does, every one "
                       "of them is caught\n", victims, results.size());
  try {
    broken_run(true, armed_at, results);
    std::fprintf(stderr, "with the shipped audit on: the run finished without noticing (unexpected)\n");
    return 1;
  } catch (const std::logic_error& e) {
    std::fprintf(stderr, "with the shipped audit on (check_block_ownership before every forward pass), the run stops before "
                         "anyone reads the block: %s\n", e.what());
  }
  csv.commit();
  if (csv.enabled()) std::fprintf(stderr, "wrote %s\n", csv.path().c_str());
  return 0;
}

}  // namespace kvs::ch08
