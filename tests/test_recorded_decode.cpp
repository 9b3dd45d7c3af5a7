// A decode step recorded once and replayed (a CUDA graph on a GPU): the replayed steps must give exactly
// what forward() gives, which holds only if nothing that changes from step to step (the token, its position,
// the row the cache writes) was baked into the recording. Runs on every backend that can record: the CUDA
// kernels through the harness (which records launches as CUDA stream capture does) and a GPU where present.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "02_dynamic_cache/growing_kv_cache.h"
#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "04_sliding_window/sliding_window_kv_cache.h"
#include "cli.h"
#include "cpu_backend.h"
#include "equivalence.h"
#include "generate.h"
#include "10_quantized_cache/quantized_kv_cache.h"
#include "test_backends.h"
#include "test_util.h"
#include "tokenizer.h"

using namespace kvs;

namespace {
// Runs check(backend, name) on a fresh backend of each name this build and machine have that can record;
// says so when none can (the CUDA harness not built, no GPU).
template <typename Check>
void for_each_recording_backend(Check&& check) {
  bool any = false;
  for (const std::string& name : test::test_backend_names()) {
    auto backend = test::make_test_backend(name);
    if (!backend->can_record()) continue;
    any = true;
    CAPTURE(name);
    check(*backend, name);
  }
#if defined(KVS_HAVE_CUDA_HARNESS)
  REQUIRE(any);  // the harness records: a build that has it and recorded nothing checked nothing
#else
  if (!any) MESSAGE("no backend in this build can record (the CUDA harness is not built): nothing to record");
#endif
}

// Replays decode steps through each of `kinds` of cache and compares them with forward()'s, on every backend that
// can record.
void check_replayed_steps(std::initializer_list<const char*> kinds) {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::vector<int> prompt = encode_bytes("And God said, Let there be");
  for_each_recording_backend([&](Backend& backend, const std::string& name) {
    // Through the harness every CUDA thread is a fiber: a few dozen steps; on a GPU, 200.
    const int new_tokens = name == "cuda" ? 200 : 24;
    const int positions = static_cast<int>(prompt.size()) + new_tokens;
    Model model(checkpoint, backend, positions, positions);
    // Chapter 03's cache, and chapter 04's ring in both position variants: a window of 16 with 4 sinks,
    // which the text wraps many times (prefill in chunks of 8: the ring holds 16 + 8 - 1 slots).
    const Window window{16, 4};
    for (const std::string kind : kinds) {
      CAPTURE(kind);
      auto make_cache = [&]() -> std::unique_ptr<KvCache> {
        const std::string k = kind;
        if (k == "preallocated") return std::make_unique<ch03::PreallocatedKvCache>(backend, checkpoint.config(), positions);
        if (k == "int8 (chapter 10)" || k == "int4 (chapter 10)")
          return std::make_unique<ch10::QuantizedKvCache>(backend, checkpoint.config(), positions,
                                                          k[3] == '8' ? KvFormat::kInt8 : KvFormat::kInt4, 16);
        return std::make_unique<ch04::SlidingWindowKvCache>(
            backend, checkpoint.config(), window, 8,
            k == "ring, absolute positions" ? ch04::KeyPositions::kAbsolute : ch04::KeyPositions::kWithinWindow);
      };
      auto run = [&](DecodeSteps steps) {
        return record([&](const OnLogits& on_logits) {
          const std::unique_ptr<KvCache> cache = make_cache();
          Sampler greedy(256, {});
          return generate_cached(model, *cache, greedy, prompt, new_tokens, 8, {}, on_logits, {}, steps);
        });
      };
      const RecordedRun forward = run(DecodeSteps::kForward), replayed = run(DecodeSteps::kRecorded);
      const Equivalence e = check_equivalence(forward, replayed, static_cast<int>(prompt.size()));
      MESSAGE(name << ", " << std::string(kind) << ": " << e.steps << " steps, worst logit difference " << e.worst_logit_difference);
      // Every step compared; on a GPU's 200 steps the comparison may stop at a near-tie of the forward run's two
      // best tokens, past which either token is right (the int4 cache's text reaches one at step 136 on an H100),
      // but not within the first 100.
      CHECK((e.steps == new_tokens || (name == "cuda" && e.near_tie >= 100)));
      CHECK(e.first_token_mismatch == -1);
      // The same kernels on the same memory: exactly the same logits in the harness. A GPU's matrix products
      // may pick another reduction order inside a graph, so there the equivalence tolerance applies.
      if (name == "cuda") CHECK(e.worst_logit_difference <= kLogitTolerance);
      else CHECK(e.worst_logit_difference == 0.0f);
    }
  });
}
}  // namespace

TEST_CASE("recorded decoding: replayed steps give forward's tokens and logits on every backend that can record") {
  check_replayed_steps({"preallocated", "ring, absolute positions", "ring, within-window positions",
                        "int8 (chapter 10)", "int4 (chapter 10)"});
}

// The shipped model's decode steps visit 27 to 49 rows (a view of 50): 2 to 4 chunks of the CUDA kernel's
// default cut (16 rows or more), so the test above replays split launches whose chunks change every 16 steps.
// Cut into chunks of one row (KVS_DECODE_CHUNKS=256,1), every replayed step's query makes one chunk more than the
// last: the same recorded launch, its grid sized for the view, must leave the blocks past them out of the merge
// and its arrival counters at 0 for the next layer and step. The float rows' kernel and the general one
// (read-time rotation).
TEST_CASE("recorded decoding: replayed split decoding, its chunks changing at every step (KVS_DECODE_CHUNKS=256,1)") {
  const test::UnsetAtExit unset{"KVS_DECODE_CHUNKS"};
  setenv("KVS_DECODE_CHUNKS", "256,1", 1);
  check_replayed_steps({"preallocated", "ring, within-window positions"});
}

// What a recorded step holds, counted: the fused operations (backend.h) are one kernel each for a decode step
// on the CUDA backend, so a layer is its q/k/v products (norm and RoPE fused in, and chapter 03's cache write:
// KvCache::rows_write), attention (a view of more than 16 rows is split in chunks, as these 100 rows are, and
// the last block of each head merges them: no second kernel), the output product with its residual add, the
// gate and up products with SwiGLU, and the down product with its add: 5 launches; and the step adds the
// embedding, the RoPE table and the classifier. A fused operation that fell back to its definition (a norm,
// products, RoPE, SwiGLU or an add apart; the cache write apart; a merge kernel after attention) adds launches
// and fails this.
TEST_CASE("recorded decoding: a decode step of the shipped model is 5 launches per layer and 3 more") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  for_each_recording_backend([&](Backend& backend, const std::string&) {
    const int positions = 100;
    Model model(checkpoint, backend, positions, positions);
    ch03::PreallocatedKvCache cache(backend, checkpoint.config(), positions);
    const std::vector<int> prompt = encode_bytes("In the beginning");
    model.forward(prompt, 0, &cache);
    RecordedDecode steps(model, cache);
    steps.step(prompt.back(), static_cast<int>(prompt.size()));
    CHECK(backend.recorded_launches() == 5 * checkpoint.config().n_layers + 3);
  });
}

TEST_CASE("recorded decoding: refused, with the reason, where it cannot work") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::vector<int> prompt = encode_bytes("In the beginning");
  CpuBackend cpu(1);
  Model model(checkpoint, cpu, 64, 64);
  ch03::PreallocatedKvCache preallocated(cpu, checkpoint.config(), 64);
  Sampler greedy(256, {});
  CHECK_THROWS_WITH_AS(generate_cached(model, preallocated, greedy, prompt, 4, 0, {}, {}, {}, DecodeSteps::kRecorded),
                       doctest::Contains("cannot record operations"), std::invalid_argument);
  CHECK(preallocated.length() == 0);  // refused before the prefill
  for (const std::string& name : test::test_backend_names()) {
    auto backend = test::make_test_backend(name);
    if (!backend->can_record()) continue;
    CAPTURE(name);
    Model recording_model(checkpoint, *backend, 64, 64);
    // A growing cache reallocates and shows a view of its length: a recording would read stale memory.
    ch02::GrowingKvCache growing(*backend, checkpoint.config(), ch02::Growth::kConcatenate);
    CHECK_THROWS_WITH_AS(RecordedDecode(recording_model, growing), doctest::Contains("not replayable"),
                         std::invalid_argument);
  }
}

TEST_CASE("attention: rows past a query's position are never read, whatever they hold, on every backend") {
  // The preallocated cache shows its whole buffer; the rows not yet written may hold anything (a fresh
  // cudaMalloc, NaN). Output over the whole buffer must equal the output over the written prefix.
  std::mt19937 gen(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const AttentionShape shape{4, 2, 32};
  const int kv_dim = shape.n_kv_heads * shape.head_dim, dim = shape.n_heads * shape.head_dim;
  // A buffer of 100 rows; and one of 4,500, past the 1,024 rows where the CUDA decoding kernel's chunks grow past
  // 16 rows (and the 4,096 where they grew past 64 before): a query at 300 or 4,200 there must be cut into the
  // chunks of its prefix (a cut by the buffer's size differs in the last bits).
  test::for_each_backend(test::test_backend_names(), [&](Backend& b) {
    for (const auto& [capacity, query_positions] :
         {std::pair{100, std::vector<int>{0, 1, 31, 63, 64, 99}}, std::pair{4500, std::vector<int>{300, 4200}}}) {
      for (int pos : query_positions) {
        for (int n : {1, 3}) {
          if (capacity > 100 && n > 1) continue;  // decoding: one query
          if (pos + n > capacity) continue;
          CAPTURE_BINDING(capacity); CAPTURE(pos); CAPTURE(n);
          std::vector<float> keys(std::size_t(capacity) * kv_dim, std::numeric_limits<float>::quiet_NaN());
          std::vector<float> values = keys, q(std::size_t(n) * dim);
          for (std::size_t i = 0; i < std::size_t(pos + n) * kv_dim; ++i) keys[i] = normal(gen), values[i] = normal(gen);
          for (float& x : q) x = normal(gen);
          Buffer d_keys = test::to_backend(b, keys), d_values = test::to_backend(b, values), d_q = test::to_backend(b, q);
          Buffer whole(b, q.size()), prefix(b, q.size()), scratch(b, b.attention_scratch_floats(shape, capacity, 1));
          const IntBuffer positions = consecutive_positions(b, pos, n);
          KvView view{.keys = d_keys.data(), .values = d_values.data(), .rows = capacity, .row_stride = kv_dim};
          b.attention(whole.data(), d_q.data(), positions.data(), n, view, shape, {scratch.data(), scratch.size()}, nullptr);
          view.rows = pos + n;
          b.attention(prefix.data(), d_q.data(), positions.data(), n, view, shape, {scratch.data(), scratch.size()}, nullptr);
          const std::vector<float> got = test::from_backend(b, whole), want = test::from_backend(b, prefix);
          bool finite = true;
          for (float x : got) finite = finite && std::isfinite(x);
          CHECK(finite);
          CHECK(got == want);
        }
      }
    }
  });
}

TEST_CASE("write_rows, write_key_value_rows and write_positions: each row lands in its position's slot, on every backend") {
  test::for_each_backend(test::test_backend_names(), [&](Backend& b) {
    // Row p = position p (Ring::unbounded), and a ring of 9 slots, 2 of them sinks: positions 2 .. 8 take
    // slots 2 .. 8, then 9 wraps to slot 2, 15 to 8, 16 to 2 (ring.h's write_slot, computed by the backend).
    const std::vector<int> positions = {5, 0, 8, 3, 1, 9, 15, 16};
    const int slots_in_buffer = 9;
    for (const Ring ring : {Ring::unbounded(), Ring{slots_in_buffer, 2}})
      for (int width : {1, 33, 257, 600}) {  // across the kernel's 256-thread block
        CAPTURE(ring.slots);
        CAPTURE(width);
        const bool wraps = ring.slots == slots_in_buffer;
        const std::vector<int> written = wraps ? positions : std::vector<int>(positions.begin(), positions.begin() + 4);
        const int stride = width + 5, n = static_cast<int>(written.size());
        std::vector<float> keys(written.size() * width), values(keys.size());  // a value is its key negated
        for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = float(i + 1), values[i] = -float(i + 1);
        std::vector<float> want_keys(std::size_t(slots_in_buffer) * stride, 0.0f), want_values = want_keys;
        std::vector<int> want_positions(slots_in_buffer, -1);
        for (std::size_t i = 0; i < written.size(); ++i) {  // in order: a later position overwrites its slot
          const int slot = wraps ? (written[i] < 2 ? written[i] : 2 + (written[i] - 2) % 7) : written[i];
          want_positions[slot] = written[i];
          for (int d = 0; d < width; ++d) {
            want_keys[std::size_t(slot) * stride + d] = keys[i * width + d];
            want_values[std::size_t(slot) * stride + d] = values[i * width + d];
          }
        }
        Buffer d_keys = test::to_backend(b, keys), d_values = test::to_backend(b, values);
        IntBuffer d_positions(b, written.size()), slot_positions(b, slots_in_buffer);
        b.from_host(d_positions.data(), written.data(), written.size());
        b.from_host(slot_positions.data(), std::vector<int>(slots_in_buffer, -1).data(), slots_in_buffer);
        // One call per position, as successive decode steps write them (within one call slots are distinct):
        // keys and values through write_rows each, and the two through write_key_value_rows.
        const std::vector<float> empty(want_keys.size(), 0.0f);
        Buffer apart_keys = test::to_backend(b, empty), apart_values = test::to_backend(b, empty);
        Buffer together_keys = test::to_backend(b, empty), together_values = test::to_backend(b, empty);
        for (int i = 0; i < n; ++i) {
          const int* at = d_positions.data() + i;
          const std::size_t row = std::size_t(i) * width;
          b.write_rows(apart_keys.data(), stride, at, ring, d_keys.data() + row, 1, width);
          b.write_rows(apart_values.data(), stride, at, ring, d_values.data() + row, 1, width);
          b.write_key_value_rows(together_keys.data(), together_values.data(), stride, at, ring, d_keys.data() + row,
                                 d_values.data() + row, 1, width);
          b.write_positions(slot_positions.data(), at, ring, 1);
        }
        CHECK(test::from_backend(b, apart_keys) == want_keys);
        CHECK(test::from_backend(b, apart_values) == want_values);
        CHECK(test::from_backend(b, together_keys) == want_keys);
        CHECK(test::from_backend(b, together_values) == want_values);
        std::vector<int> got_positions(slots_in_buffer);
        b.to_host(got_positions.data(), slot_positions.data(), slots_in_buffer);
        CHECK(got_positions == want_positions);
      }
  });
}

// The point of write_key_value_rows: a layer's keys and values in one launch where a backend launches kernels
// (recorded, its launches counted), every position of a call in that one launch: a decode step's row, a batch's
// 64, a prefill's 300. Positions out of order, so a row written at its index fails.
TEST_CASE("write_key_value_rows: one launch for a layer's keys and values, however many rows") {
  for_each_recording_backend([&](Backend& b, const std::string&) {
    for (const int n : {1, 64, 300}) {
      CAPTURE(n);
      const int width = 5, rows = n + 2;
      std::vector<int> written(n);
      for (int i = 0; i < n; ++i) written[i] = rows - 1 - i;  // n + 1 down to 2
      std::vector<float> keys(std::size_t(n) * width), values(keys.size());
      for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = float(i + 1), values[i] = -float(i + 1);
      Buffer d_keys = test::to_backend(b, keys), d_values = test::to_backend(b, values);
      const std::vector<float> empty(std::size_t(rows) * width, 0.0f);
      Buffer key_rows = test::to_backend(b, empty), value_rows = test::to_backend(b, empty);
      IntBuffer d_positions(b, n);
      b.from_host(d_positions.data(), written.data(), n);
      const int recording = b.begin_recording();
      b.write_key_value_rows(key_rows.data(), value_rows.data(), width, d_positions.data(), Ring::unbounded(),
                             d_keys.data(), d_values.data(), n, width);
      b.end_recording();
      CHECK(b.recorded_launches() == 1);
      b.replay(recording);
      const std::vector<float> got_keys = test::from_backend(b, key_rows), got_values = test::from_backend(b, value_rows);
      for (int i = 0; i < n; ++i)
        for (int d = 0; d < width; ++d) {
          CHECK(got_keys[std::size_t(written[i]) * width + d] == keys[std::size_t(i) * width + d]);
          CHECK(got_values[std::size_t(written[i]) * width + d] == values[std::size_t(i) * width + d]);
        }
    }
  });
}
