// The attention step over any view a cache can build - row positions, a first position other than 0, a
// window, sinks, empty rows holding NaN - against the plain-loop reference; and the ring arithmetic a
// sliding-window cache stores positions with, across its wrap points.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cpu_backend.h"
#include "equivalence.h"
#include "kv_cache.h"
#include "reference_attention.h"
#include "ring.h"
#include "test_util.h"

using namespace kvs;

namespace {

// Position held by each slot after writing 0 .. length-1 in order, by brute force.
std::vector<int> simulate_ring(const Ring& ring, int length) {
  std::vector<int> held(ring.slots, -1);
  for (int p = 0; p < length; ++p) held[ring.write_slot(p)] = p;
  return held;
}

struct ViewData {
  std::vector<float> keys, values;
  std::vector<int> positions;
  KvView view;
};

// `positions` rows (negative: empty, filled with NaN), random keys and values, rows `stride` floats apart.
ViewData make_view(const std::vector<int>& positions, int kv_dim, int stride, std::mt19937& gen,
                   bool explicit_positions, int first_position, Window window) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int rows = static_cast<int>(positions.size());
  ViewData d{std::vector<float>(std::size_t(rows) * stride), std::vector<float>(std::size_t(rows) * stride), positions, {}};
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < stride; ++j) {
      const bool empty = positions[r] < 0;
      d.keys[std::size_t(r) * stride + j] = empty ? std::numeric_limits<float>::quiet_NaN() : normal(gen);
      d.values[std::size_t(r) * stride + j] = empty ? std::numeric_limits<float>::quiet_NaN() : normal(gen);
    }
  d.view = KvView{.keys = d.keys.data(), .values = d.values.data(), .rows = rows, .row_stride = stride,
                  .row_positions = explicit_positions ? d.positions.data() : nullptr,
                  .first_position = first_position, .window = window};
  (void)kv_dim;
  return d;
}

// Largest |backend - reference| over every output, for queries at pos .. pos+n-1.
float compare_with_reference(CpuBackend& backend, const AttentionShape& shape, const KvView& view, int pos, int n,
                             std::mt19937& gen) {
  const int dim = shape.n_heads * shape.head_dim;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(std::size_t(n) * dim), out(q.size()), expected(q.size());
  for (float& x : q) x = normal(gen);
  std::vector<float> scratch(backend.attention_scratch_floats(shape, view.rows, 1));
  // The weights as an observer sees them, compared too (poisoned first: every entry must be written).
  std::vector<float> weights(std::size_t(n) * shape.n_heads * view.rows, NAN), expected_weights(weights.size());
  const IntBuffer positions = consecutive_positions(backend, pos, n);
  backend.attention(out.data(), q.data(), positions.data(), n, view, shape, scratch, weights.data());
  reference_attention(expected.data(), q.data(), pos, n, view, shape, expected_weights.data());
  // NaN on either side (a weight left unwritten, a reference gone wrong) fails every tolerance.
  const float worst = worst_difference(max_abs_difference(out, expected), max_abs_difference(weights, expected_weights));
  // Without weights requested, the output is the same.
  std::vector<float> plain(out.size());
  backend.attention(plain.data(), q.data(), positions.data(), n, view, shape, scratch, nullptr);
  if (plain != out) return INFINITY;
  return worst;
}

// Scores are float dot products over head_dim = 8 of N(0, 1) values and softmaxes over at most ~100 rows;
// the reference sums in double. Their difference is a few float roundings: ~1e-6. A wrong mask, a wrong
// KV head or a row at the wrong position moves outputs by ~0.1 or more.
constexpr float kTolerance = 1e-5f;

}  // namespace

TEST_CASE("ring: every slot holds the position brute force says, across the wrap points, sinks never evicted") {
  for (int slots : {1, 2, 3, 8, 64})
    for (int sinks : {0, 1, 4}) {
      if (sinks >= slots) continue;
      const Ring ring{slots, sinks};
      CAPTURE(slots);
      CAPTURE(sinks);
      for (int length = 0; length <= 3 * slots + 1; ++length) {
        CAPTURE(length);
        const std::vector<int> held = simulate_ring(ring, length);
        for (int slot = 0; slot < slots; ++slot) CHECK(ring.position_in(slot, length) == held[slot]);
        for (int s = 0; s < std::min(sinks, length); ++s) CHECK(held[s] == s);
      }
    }
}

TEST_CASE("ring: W + n - 1 slots show every query of an n-position call its whole window, W slots do not") {
  bool short_ring_misses = false;
  for (const Window window : {Window{1, 0}, Window{3, 0}, Window{8, 0}, Window{8, 4}, Window{5, 1}})
    for (int n : {1, 3, 7}) {
      CAPTURE(window.size);
      CAPTURE(window.sinks);
      CAPTURE(n);
      for (int pos = 0; pos < 40; pos += 3) {
        for (const int slots : {window.size + n - 1, window.size}) {
          const Ring ring{slots, window.sinks};
          bool complete = true;
          for (int query = pos; query < pos + n; ++query)
            for (int key = 0; key <= query; ++key)
              if (key_visible(query, key, window)) complete &= ring.position_in(ring.write_slot(key), pos + n) == key;
          if (slots == window.size + n - 1) CHECK(complete);
          else short_ring_misses |= !complete;
        }
      }
    }
  CHECK(short_ring_misses);
}

TEST_CASE("attention: the backend equals the plain-loop reference on every kind of view") {
  const AttentionShape shape{.n_heads = 4, .n_kv_heads = 2, .head_dim = 8};  // 2 query heads per KV head
  const int kv_dim = shape.n_kv_heads * shape.head_dim, stride = kv_dim + 3;  // padded rows
  std::mt19937 gen(11);
  for (int threads : {1, 2}) {
    CpuBackend backend(threads);
    CAPTURE(threads);
    SUBCASE("contiguous from position 0, a prefill across the 64-query block") {
      std::vector<int> positions(70);
      for (int r = 0; r < 70; ++r) positions[r] = r;
      const ViewData d = make_view(positions, kv_dim, stride, gen, false, 0, {});
      CHECK(compare_with_reference(backend, shape, d.view, 0, 70, gen) <= kTolerance);
      CHECK(compare_with_reference(backend, shape, d.view, 69, 1, gen) <= kTolerance);  // decode
    }
    SUBCASE("contiguous from position 5, with a window, with and without sinks") {
      std::vector<int> positions(80);
      for (int r = 0; r < 80; ++r) positions[r] = 5 + r;
      // (The sinks, positions 0 .. sinks - 1, are not in this view: the next subcase has them.)
      for (const Window window : {Window{6, 0}, Window{6, 2}, Window{30, 3}}) {
        CAPTURE(window.size);
        const ViewData d = make_view(positions, kv_dim, stride, gen, false, 5, window);
        CHECK(compare_with_reference(backend, shape, d.view, 15, 70, gen) <= kTolerance);
        CHECK(compare_with_reference(backend, shape, d.view, 84, 1, gen) <= kTolerance);
      }
    }
    SUBCASE("contiguous from position 0, a window with sinks: the sinks stay visible far past the window") {
      std::vector<int> positions(80);
      for (int r = 0; r < 80; ++r) positions[r] = r;
      for (const Window window : {Window{6, 2}, Window{20, 3}}) {
        CAPTURE(window.size);
        const ViewData d = make_view(positions, kv_dim, stride, gen, false, 0, window);
        CHECK(compare_with_reference(backend, shape, d.view, 10, 70, gen) <= kTolerance);
        CHECK(compare_with_reference(backend, shape, d.view, 79, 1, gen) <= kTolerance);
      }
    }
    SUBCASE("a ring after wrapping: rows out of order, never-written slots holding NaN; keys rotated or not") {
      // rotate_at_read: queries and keys unrotated, rotated by their positions within the window.
      for (const bool rotate_at_read : {false, true})
        for (const Window window : {Window{8, 0}, Window{8, 4}, Window{5, 1}})
          for (int n : {1, 3}) {
            const Ring ring{window.size + n - 1, window.sinks};
            const std::vector<float> table = test::rope_table(window.size, shape.head_dim);
            for (int length : {2, window.size, 3 * window.size + 2}) {
              CAPTURE(rotate_at_read);
              CAPTURE(window.size);
              CAPTURE(window.sinks);
              CAPTURE(length);
              const int pos = std::max(0, length - n);
              std::vector<int> positions(ring.slots);
              for (int slot = 0; slot < ring.slots; ++slot) positions[slot] = ring.position_in(slot, length);
              ViewData d = make_view(positions, kv_dim, stride, gen, true, 0, window);
              if (rotate_at_read) d.view.read_rope = table.data();
              CHECK(compare_with_reference(backend, shape, d.view, pos, length - pos, gen) <= kTolerance);
            }
          }
    }
    SUBCASE("an empty row holding NaN between written rows") {
      const ViewData d = make_view({0, -1, 1}, kv_dim, stride, gen, true, 0, {});
      CHECK(compare_with_reference(backend, shape, d.view, 1, 1, gen) <= kTolerance);
    }
  }
}

TEST_CASE("attention: the run-of-rows fast path equals the reference at lengths across every SIMD width and unroll") {
  // head_dim 32 and rows 1 ... 257: scores, softmax and the weighted sum cross 8- and 16-float registers
  // and Eigen's 2- and 4-register unrolls, with odd tails; decode (1 query) and prefill (up to 129 queries,
  // across the 64-query block), without and with a window; on 2 threads heads go to the second thread
  // once the work pays for it (cpu_backend.cpp, from 512 rows with this shape: 511-513 cross it).
  const AttentionShape shape{.n_heads = 4, .n_kv_heads = 2, .head_dim = 32};
  const int kv_dim = shape.n_kv_heads * shape.head_dim;
  std::mt19937 gen(12);
  // As kTolerance, with dot products over 32 dimensions and up to 700 rows: ~4x the rounding (measured
  // worst 8.9e-7).
  constexpr float kWideTolerance = 4 * kTolerance;
  float worst = 0;
  for (int threads : {1, 2}) {
    CpuBackend backend(threads);
    for (int rows : {1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 127, 129, 257, 511, 512, 513, 700})
      for (const Window window : {Window{0, 0}, Window{5, 0}, Window{64, 0}}) {
        CAPTURE(threads);
        CAPTURE(rows);
        CAPTURE(window.size);
        std::vector<int> positions(rows);
        for (int r = 0; r < rows; ++r) positions[r] = r;
        const ViewData d = make_view(positions, kv_dim, kv_dim, gen, false, 0, window);
        const float decode = compare_with_reference(backend, shape, d.view, rows - 1, 1, gen);
        const float prefill = rows <= 129 ? compare_with_reference(backend, shape, d.view, 0, rows, gen) : 0.0f;
        CHECK(decode <= kWideTolerance);
        CHECK(prefill <= kWideTolerance);
        worst = std::max({worst, decode, prefill});
      }
  }
  MESSAGE("largest difference from the reference: " << worst);
}
