// The cache policies of chapters 02 and 03 on their own: growth arithmetic, contents kept across growth,
// exact memory, refusal of what does not fit, and the masking rule at its boundaries.
#include <doctest/doctest.h>

#include <vector>

#include "02_dynamic_cache/growing_kv_cache.h"
#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "cpu_backend.h"
#include "resident_memory.h"
#include "test_backends.h"

using namespace kvs;
using kvs::ch02::Growth;
using kvs::ch02::grown_capacity;

namespace {

const ModelConfig kConfig{.dim = 64, .hidden_dim = 96, .n_layers = 3, .n_heads = 4, .n_kv_heads = 2,
                          .vocab_size = 256, .seq_len = 4096};

// Writes positions [pos, pos + n) of every layer with values that encode (layer, position, column, K/V).
void write_positions(Backend& backend, KvCache& cache, int pos, int n) {
  const int kv_dim = kConfig.kv_dim();
  std::vector<float> k(std::size_t(n) * kv_dim), v(k.size());
  const IntBuffer positions = consecutive_positions(backend, pos, n);
  cache.prepare(pos, n);
  for (int layer = 0; layer < kConfig.n_layers; ++layer) {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < kv_dim; ++j) {
        k[std::size_t(i) * kv_dim + j] = float(layer * 1000000 + (pos + i) * 100 + j);
        v[std::size_t(i) * kv_dim + j] = -float(layer * 1000000 + (pos + i) * 100 + j);
      }
    const Buffer device_k = test::to_backend(backend, k), device_v = test::to_backend(backend, v);
    cache.write(layer, pos, n, positions.data(), device_k.data(), device_v.data());
  }
}

// Every row of every layer holds what write_positions wrote for its position (the rows copied to the host).
bool holds_positions(Backend& backend, const KvCache& cache, int length) {
  for (int layer = 0; layer < kConfig.n_layers; ++layer) {
    const KvView view = cache.view(layer);
    if (view.rows != length) return false;
    std::vector<float> keys(std::size_t(length) * view.row_stride), values(keys.size());
    backend.to_host(keys.data(), view.keys, keys.size());
    backend.to_host(values.data(), view.values, values.size());
    for (int r = 0; r < length; ++r)
      for (int j = 0; j < kConfig.kv_dim(); ++j) {
        const float expected = float(layer * 1000000 + view.position_of(r) * 100 + j);
        if (keys[std::size_t(r) * view.row_stride + j] != expected) return false;
        if (values[std::size_t(r) * view.row_stride + j] != -expected) return false;
      }
  }
  return true;
}

}  // namespace

TEST_CASE("growth policy: concatenate grows to exactly what is needed, chunked to need + 1024 rounded to 1024, geometric doubles") {
  CHECK(grown_capacity(Growth::kConcatenate, 0, 14) == 14);
  CHECK(grown_capacity(Growth::kConcatenate, 14, 15) == 15);
  CHECK(grown_capacity(Growth::kConcatenate, 15, 15) == 15);
  CHECK(grown_capacity(Growth::kChunked, 0, 1) == 2048);
  CHECK(grown_capacity(Growth::kChunked, 0, 1023) == 2048);
  CHECK(grown_capacity(Growth::kChunked, 0, 1024) == 2048);
  CHECK(grown_capacity(Growth::kChunked, 2048, 2048) == 2048);  // fits: no growth
  CHECK(grown_capacity(Growth::kChunked, 2048, 2049) == 4096);
  CHECK(grown_capacity(Growth::kChunked, 4096, 3073) == 4096);
  CHECK(grown_capacity(Growth::kGeometric, 0, 14) == 14);
  CHECK(grown_capacity(Growth::kGeometric, 14, 15) == 28);
  CHECK(grown_capacity(Growth::kGeometric, 28, 28) == 28);
  CHECK(grown_capacity(Growth::kGeometric, 28, 100) == 100);  // a prefill larger than double
}

TEST_CASE("growing cache: cached rows survive every reallocation (nanochat PR #186), on every backend") {
  test::for_each_backend(test::test_backend_names(), [](Backend& backend) {
    for (Growth growth : {Growth::kConcatenate, Growth::kChunked, Growth::kGeometric}) {
      CAPTURE(ch02::growth_name(growth));
      ch02::GrowingKvCache cache(backend, kConfig, growth);
      write_positions(backend, cache, 0, 1000);  // a prefill
      CHECK(holds_positions(backend, cache, 1000));
      // decode steps: concatenate reallocates at each, geometric doubles at the first, chunked (2,048 rows) at none
      for (int pos = 1000; pos < 1100; ++pos) write_positions(backend, cache, pos, 1);
      CHECK(holds_positions(backend, cache, 1100));
      const std::int64_t row_bytes = 2 * kConfig.n_layers * kConfig.kv_dim() * sizeof(float);
      if (growth == Growth::kConcatenate) {
        CHECK(cache.allocations() == 101 * 2 * kConfig.n_layers);  // every forward pass reallocates K and V
        // step t copies the t rows already cached: 1000 + 1001 + ... + 1099
        CHECK(cache.bytes_copied() == (1000 + 1099) * 100 / 2 * row_bytes);
        CHECK(cache.capacity_bytes() == 1100 * row_bytes);
      } else if (growth == Growth::kGeometric) {
        // 1000 from the prefill, doubled to 2000 at position 1000: one copy of the 1000 rows
        CHECK(cache.allocations() == 2 * 2 * kConfig.n_layers);
        CHECK(cache.bytes_copied() == 1000 * row_bytes);
        CHECK(cache.capacity_bytes() == 2000 * row_bytes);
      } else {
        CHECK(cache.allocations() == 1 * 2 * kConfig.n_layers);  // 2048 positions from the first prefill
        CHECK(cache.bytes_copied() == 0);
        CHECK(cache.capacity_bytes() == 2048 * row_bytes);
        write_positions(backend, cache, 1100, 1000);  // 2100 > 2048: one growth to 4096, copying the 1100 rows
        CHECK(cache.capacity() == 4096);
        CHECK(cache.bytes_copied() == 1100 * row_bytes);
        CHECK(holds_positions(backend, cache, 2100));
      }
      CHECK_THROWS_WITH(write_positions(backend, cache, cache.length() + 1, 1), doctest::Contains("leaves a gap"));
    }
  });
}

TEST_CASE("preallocated cache: exactly the formula's bytes, written in place, refuses what does not fit, on every backend") {
  test::for_each_backend(test::test_backend_names(), [](Backend& backend) {
    ch03::PreallocatedKvCache cache(backend, kConfig, 300);
    CHECK(cache.allocated_bytes() == kv_cache_bytes(kConfig, 300));
    // Resident pages are counted in host memory only (-1 elsewhere).
    if (!backend.host_memory()) CHECK(cache.resident_bytes() == -1);
    if (backend.host_memory()) CHECK(cache.resident_bytes() <= cache.allocated_bytes() + 2 * 4096);  // whole pages at both ends
    CHECK(cache.allocated_bytes() == 2 * 3 * 1 * 2 * 16 * 300 * 4);
    write_positions(backend, cache, 0, 37);
    for (int pos = 37; pos < 300; ++pos) write_positions(backend, cache, pos, 1);
    CHECK(holds_positions(backend, cache, 300));
    if (backend.host_memory()) CHECK(cache.resident_bytes() >= cache.allocated_bytes());  // every page written
    CHECK_THROWS_WITH(write_positions(backend, cache, 300, 1), doctest::Contains("allocated for 300"));
    CHECK_THROWS_WITH(write_positions(backend, cache, 301, 1), doctest::Contains("leaves a gap"));
    // clear(): an empty cache again in the same memory (03_benchmark --breakdown reuses one for every run).
    const KvView before = cache.view(0);
    cache.clear();
    CHECK(cache.length() == 0);
    CHECK_THROWS_WITH(write_positions(backend, cache, 1, 1), doctest::Contains("leaves a gap after the 0"));
    write_positions(backend, cache, 0, 5);
    CHECK(cache.length() == 5);
    CHECK_THROWS_WITH(cache.row(0, 5), doctest::Contains("positions 0..4"));
    CHECK(cache.view(0).keys == before.keys);
    CHECK(holds_positions(backend, cache, 300));  // rows 0-4 rewritten with the same values, the rest kept
    CHECK(cache.allocated_bytes() == kv_cache_bytes(kConfig, 300));
  });
}

TEST_CASE("masking rule: causal, with a window of W keys including the query's own, and sinks") {
  CHECK(key_visible(5, 5, {}));
  CHECK(key_visible(5, 0, {}));
  CHECK_FALSE(key_visible(5, 6, {}));   // the future
  CHECK_FALSE(key_visible(5, -1, {}));  // an empty row
  // window 3 at query 10: keys 8, 9, 10 (three of them)
  CHECK_FALSE(key_visible(10, 7, {3, 0}));
  CHECK(key_visible(10, 8, {3, 0}));
  CHECK(key_visible(10, 10, {3, 0}));
  CHECK_FALSE(key_visible(10, 11, {3, 0}));
  CHECK(key_visible(0, 0, {1, 0}));
  CHECK_FALSE(key_visible(1, 0, {1, 0}));
  // window 8 with 4 sinks at query 100: keys 0..3 forever, then the 4 most recent, 97..100
  CHECK(key_visible(100, 0, {8, 4}));  // a sink stays visible long after it left the recent part
  CHECK(key_visible(100, 3, {8, 4}));
  CHECK_FALSE(key_visible(100, 4, {8, 4}));
  CHECK_FALSE(key_visible(100, 96, {8, 4}));
  CHECK(key_visible(100, 97, {8, 4}));
  CHECK_FALSE(key_visible(2, 3, {8, 4}));  // a sink is still never the future
  // every query sees exactly min(W, query + 1) keys
  for (const Window w : {Window{1, 0}, Window{5, 0}, Window{5, 1}, Window{8, 4}, Window{7, 6}})
    for (int q = 0; q < 40; ++q) {
      int seen = 0;
      for (int k = -1; k <= q + 1; ++k) seen += key_visible(q, k, w);
      CHECK(seen == std::min(w.size, q + 1));
    }
}

// Chapter 04's read-time rotation, checked against its definition rather than against a second caller of the
// same functions (every model-level test of the within-window variant uses them on both sides).
TEST_CASE("within-window positions: sinks at 0..s-1, the recent keys after them in order, the query last") {
  CHECK(rotary_query_position(100, {}) == 100);  // no window: absolute positions
  CHECK(rotary_key_position(100, 37, {}) == 37);
  // window 8 with 2 sinks at query 20: keys 0, 1 (sinks) and 15..20 (the 6 most recent) rotate to 0..7
  CHECK(rotary_query_position(20, {8, 2}) == 7);
  CHECK(rotary_key_position(20, 0, {8, 2}) == 0);
  CHECK(rotary_key_position(20, 1, {8, 2}) == 1);
  CHECK(rotary_key_position(20, 15, {8, 2}) == 2);
  CHECK(rotary_key_position(20, 20, {8, 2}) == 7);
  // Every query, before and after the first eviction: its visible keys, in order of position, take the
  // rotary positions 0, 1, 2, ... with the query's own key last and equal to the query's; a recent key's
  // distance to the query is the true one.
  for (const Window w : {Window{1, 0}, Window{5, 0}, Window{5, 1}, Window{8, 2}, Window{8, 4}, Window{7, 6}})
    for (int q = 0; q < 40; ++q) {
      CAPTURE(w.size);
      CAPTURE(w.sinks);
      CAPTURE(q);
      CHECK(rotary_query_position(q, w) == std::min(q, w.size - 1));
      int expected = 0;
      for (int k = 0; k <= q; ++k) {
        if (!key_visible(q, k, w)) continue;
        CHECK(rotary_key_position(q, k, w) == expected++);
        if (k >= w.sinks) CHECK(rotary_query_position(q, w) - rotary_key_position(q, k, w) == q - k);
      }
      CHECK(expected - 1 == rotary_query_position(q, w));
    }
}

TEST_CASE("resident memory: pages are resident once written, not when allocated") {
  // A fresh anonymous mapping, as malloc gives for large blocks: nothing resident until written.
  CpuBackend backend(1);
  const std::size_t floats = std::size_t(64) << 20 >> 2;  // 64 MiB
  Buffer buffer(backend, floats);
  const std::int64_t before = resident_bytes(buffer.data(), floats * sizeof(float));
  for (std::size_t i = 0; i < floats / 2; ++i) buffer.data()[i] = 1.0f;  // write the first half
  const std::int64_t half = resident_bytes(buffer.data(), floats * sizeof(float));
  MESSAGE("resident before writing: " << before << " bytes, after writing half: " << half);
  CHECK(before < (1 << 20));
  CHECK(half >= std::int64_t(32) << 20);
  CHECK(half < std::int64_t(34) << 20);
}
