// Chapter 08: the block-table arithmetic, the paged view against the reference attention, position-tagged K/V
// through reused blocks, the batched forward pass against each sequence alone, and the scheduler's outputs
// (continuous batching, joins and leaves, preemption) against each request served alone.
#include <doctest/doctest.h>

#include <Eigen/Core>  // EIGEN_VECTORIZE_*: which sums the CPU backend folds how

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "08_paged_batching/paged_kv_cache.h"
#include "08_paged_batching/scheduler.h"
#include "08_paged_batching/trace.h"
#include "block_table.h"
#include "cpu_backend.h"
#include "equivalence.h"
#include "generate.h"
#include "profiling_backend.h"
#include "reference_attention.h"
#include "sampler.h"
#include "test_backends.h"
#include "test_util.h"
#include "tokenizer.h"

using namespace kvs;
using namespace kvs::ch08;

namespace {

// A host block table whose blocks are out of order, for `rows` rows.
std::vector<int> shuffled_blocks(int rows, int block_size, std::mt19937& gen) {
  std::vector<int> blocks(blocks_needed(rows, block_size) + 2);  // two more in the pool than the table uses
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), gen);
  blocks.resize(blocks_needed(rows, block_size));
  return blocks;
}

// The token accounting of a serve run: every prompt position fed once, every recomputed position once more, and
// every generated token but the last (it is never fed) once as a decode token - the prefill count exactly the
// first two, a preempted sequence's next token not among them.
void check_token_accounting(const std::vector<Request>& requests, const RunStats& stats) {
  long prompts = 0, decodes = 0, fed = 0;
  for (const Request& r : requests) prompts += long(r.prompt.size()), decodes += r.max_new_tokens - 1;
  for (int t : stats.step_tokens) fed += t;
  CHECK(stats.prefill_tokens == prompts + stats.recomputed_tokens);
  CHECK(fed == prompts + stats.recomputed_tokens + decodes);
}

}  // namespace

TEST_CASE("block table: each position's physical row and each run's end, by brute force, across block boundaries") {
  std::mt19937 gen(3);
  for (int block_size : {1, 3, 16}) {
    CAPTURE(block_size);
    const int rows = 5 * block_size + 1;  // ends one past a boundary
    const std::vector<int> blocks = shuffled_blocks(rows, block_size, gen);
    const BlockTable table{blocks.data(), block_size};
    CHECK(blocks_needed(rows, block_size) == 6);
    CHECK(blocks_needed(5 * block_size, block_size) == 5);
    std::vector<int> owner;  // physical row -> position, by walking the blocks one row at a time
    for (int p = 0; p < rows; ++p) {
      CAPTURE(p);
      const int block = blocks[p / block_size];
      CHECK(table.physical_row(p) == block * block_size + p % block_size);
      // A run never crosses a block, and reaches its block's end (or the end asked for).
      const int end = table.run_end(p, rows);
      CHECK(end > p);
      CHECK(end <= rows);
      CHECK((end == rows || end % block_size == 0));
      CHECK((end - 1) / block_size == p / block_size);
      owner.push_back(table.physical_row(p));
    }
    std::sort(owner.begin(), owner.end());
    CHECK(std::adjacent_find(owner.begin(), owner.end()) == owner.end());  // no two positions share a row
  }
}

// Paged views of `rows` positions, blocks shuffled, NaN in every row no position holds (the tail of the last
// block, the two spare blocks); attention over them against the reference, decode and prefill, every backend.
TEST_CASE("paged attention: equals the reference attention over the same view, NaN in unused rows, every backend") {
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    std::mt19937 gen(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // head_dim 8, and 128: a paged view whose heads are on 16 bytes, read 16 bytes a lane by the CUDA decoding kernel
    for (const AttentionShape shape : {AttentionShape{4, 2, 8}, AttentionShape{4, 2, 128}}) {
      for (int block_size : {1, 3, 16})
        for (int rows : {block_size * 4, block_size * 4 + 1, 37}) {
          CAPTURE(shape.head_dim);
          CAPTURE(block_size);
          CAPTURE(rows);
          const int kv_dim = shape.n_kv_heads * shape.head_dim;
          const std::vector<int> blocks = shuffled_blocks(rows, block_size, gen);
          const int pool_rows = (blocks_needed(rows, block_size) + 2) * block_size;
          std::vector<float> keys(std::size_t(pool_rows) * kv_dim, NAN), values(keys.size(), NAN);
          const BlockTable host_table{blocks.data(), block_size};
          for (int p = 0; p < rows; ++p)
            for (int j = 0; j < kv_dim; ++j) {
              keys[std::size_t(host_table.physical_row(p)) * kv_dim + j] = normal(gen);
              values[std::size_t(host_table.physical_row(p)) * kv_dim + j] = normal(gen);
            }
          const Buffer d_keys = test::to_backend(backend, keys), d_values = test::to_backend(backend, values);
          IntBuffer d_blocks(backend, blocks.size());
          backend.from_host(d_blocks.data(), blocks.data(), blocks.size());
          const KvView view{.keys = d_keys.data(), .values = d_values.data(), .rows = rows, .row_stride = kv_dim,
                            .paged = BlockTable{d_blocks.data(), block_size}};
          const KvView host_view{.keys = keys.data(), .values = values.data(), .rows = rows, .row_stride = kv_dim,
                                 .paged = host_table};
          for (int n : {1, std::min(5, rows)}) {  // a decode step at the last position; a prefill chunk ending there
            CAPTURE(n);
            const int pos = rows - n;  // (5 queries over 4 rows put one at position -1: nothing to see, 0 == 0 checked)
            std::vector<float> q(std::size_t(n) * shape.n_heads * shape.head_dim);
            for (float& x : q) x = normal(gen);
            std::vector<float> expected(q.size());
            reference_attention(expected.data(), q.data(), pos, n, host_view, shape);
            const Buffer d_q = test::to_backend(backend, q);
            Buffer d_out(backend, q.size()), scratch(backend, backend.attention_scratch_floats(shape, rows, 1));
            const IntBuffer positions = consecutive_positions(backend, pos, n);
            backend.attention(d_out.data(), d_q.data(), positions.data(), n, view, shape, {scratch.data(), scratch.size()}, nullptr);
            const std::vector<float> out = test::from_backend(backend, d_out);
            float worst = 0;
            for (std::size_t i = 0; i < out.size(); ++i) worst = std::isfinite(out[i]) ? std::max(worst, std::abs(out[i] - expected[i])) : INFINITY;
            CHECK(worst < 1e-5f);  // float sums against the reference's doubles over <= 65 rows of head_dim <= 128
          }
        }
    }
  });
}

// Whether one row's sum across a register (Eigen's predux) folds the lanes as the CPU's 8-row sums do: on SSE and
// AVX-512, yes; on AVX/AVX2 (hadd), no (cpu_backend.cpp, store_sums).
#if defined(EIGEN_VECTORIZE_AVX) && !defined(EIGEN_VECTORIZE_AVX512)
constexpr bool kPredux8Order = false;
#else
constexpr bool kPredux8Order = true;
#endif

// What book 08 says of a paged view against chapter 03's contiguous buffer: the same rows, the same code, and for a
// decode query with blocks of a multiple of kRows (8) rows - the default 16 - the very same bits (the CPU's one-query
// path sweeps a run 8 rows at a time and adds the weighted values row after row across runs). Blocks of 1 or 3 rows
// score their rows one at a time, whose sum across a register (Eigen's predux) folds the lanes in another order than
// the 8-row sums on AVX/AVX2 (the same order on SSE and AVX-512): within rounding there, not bit for bit. A prompt
// chunk's attention, one matrix product per run, adds a paged view's blocks one at a time where the contiguous
// buffer is one run: its outputs differ in the last bits, within a float sum's rounding. Views of up to 1,000 rows,
// blocks of 1 to 32 rows, out of order; through the CUDA kernels every case is the same bits (rows are not cut by
// block there).
TEST_CASE("paged attention: a decode query gets the very bits of the same rows in one buffer, a prompt chunk within 1e-6, every backend") {
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    std::mt19937 gen(12);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const AttentionShape shape{4, 2, 32};
    const int kv_dim = shape.n_kv_heads * shape.head_dim;
    for (int block_size : {1, 3, 16, 32})
      for (int rows : {37, 1000}) {
        CAPTURE(block_size);
        CAPTURE(rows);
        std::vector<float> keys(std::size_t(rows) * kv_dim), values(keys.size());
        for (float& x : keys) x = normal(gen);
        for (float& x : values) x = normal(gen);
        const std::vector<int> blocks = shuffled_blocks(rows, block_size, gen);
        const BlockTable host_table{blocks.data(), block_size};
        const int pool_rows = (blocks_needed(rows, block_size) + 2) * block_size;
        std::vector<float> pool_keys(std::size_t(pool_rows) * kv_dim, NAN), pool_values(pool_keys.size(), NAN);
        for (int p = 0; p < rows; ++p) {
          std::copy_n(&keys[std::size_t(p) * kv_dim], kv_dim, &pool_keys[std::size_t(host_table.physical_row(p)) * kv_dim]);
          std::copy_n(&values[std::size_t(p) * kv_dim], kv_dim, &pool_values[std::size_t(host_table.physical_row(p)) * kv_dim]);
        }
        const Buffer d_keys = test::to_backend(backend, keys), d_values = test::to_backend(backend, values);
        const Buffer d_pool_keys = test::to_backend(backend, pool_keys), d_pool_values = test::to_backend(backend, pool_values);
        IntBuffer d_blocks(backend, blocks.size());
        backend.from_host(d_blocks.data(), blocks.data(), blocks.size());
        const KvView contiguous{.keys = d_keys.data(), .values = d_values.data(), .rows = rows, .row_stride = kv_dim};
        const KvView paged{.keys = d_pool_keys.data(), .values = d_pool_values.data(), .rows = rows, .row_stride = kv_dim,
                           .paged = BlockTable{d_blocks.data(), block_size}};
        for (int n : {1, 5}) {  // a decode query at the last position; a prompt chunk ending there
          CAPTURE(n);
          std::vector<float> q(std::size_t(n) * shape.n_heads * shape.head_dim);
          for (float& x : q) x = normal(gen);
          const Buffer d_q = test::to_backend(backend, q);
          const IntBuffer positions = consecutive_positions(backend, rows - n, n);
          Buffer scratch(backend, backend.attention_scratch_floats(shape, rows, 1));
          auto attend = [&](const KvView& view) {
            Buffer d_out(backend, q.size());
            backend.attention(d_out.data(), d_q.data(), positions.data(), n, view, shape, {scratch.data(), scratch.size()}, nullptr);
            return test::from_backend(backend, d_out);
          };
          const std::vector<float> from_buffer = attend(contiguous), from_pool = attend(paged);
          const bool cpu = dynamic_cast<CpuBackend*>(&backend) != nullptr;
          if (n == 1 && (block_size % 8 == 0 || kPredux8Order || !cpu)) {
            CHECK(std::memcmp(from_buffer.data(), from_pool.data(), from_buffer.size() * sizeof(float)) == 0);
          } else {
            const float worst = max_abs_difference(from_buffer, from_pool);  // NaN where either is (a wrong row's NaN)
            MESSAGE("blocks of " << block_size << ", " << rows << " rows, " << n << " queries: largest difference " << worst);
            CHECK(worst < 1e-6f);  // outputs of magnitude <= ~3 (weighted means of N(0,1) values), float sums of <= 1,000 terms grouped two ways
          }
        }
      }
  });
}

// Backend::attention_batch against attention() alone, sequence by sequence, and against the reference: paged
// views of 1 to 4,500 rows (the CUDA decoding kernel's rows fall in 1 to 64 chunks: sequences of one launch split
// differently), every third windowed, NaN in every row no position holds; 3 sequences, and 70 (two CUDA launches
// of up to 64 views; more sequences than the CPU's 64 tasks, so a task takes two); then a batch with a prefill
// chunk in it, and one with attention sinks: in each the CPU's fast path cannot take one part, which takes
// attention() alone, while its neighbours still take the fast path (the view of 4,500 rows makes it a pool run;
// on CUDA each neighbour is a launch of one view); a chunk beside one decode query, where both backends take both
// through attention(); and three decode queries then a chunk, one CUDA launch of three views and the chunk alone.
TEST_CASE("batched attention: each sequence gets the bits of its attention alone, every backend") {
  const AttentionShape shape{4, 2, 32};  // head_dim 32: the CPU's one-query sweep with 16, 8 and 4-float packets
  const int kv_dim = shape.n_kv_heads * shape.head_dim, dim = shape.n_heads * shape.head_dim;
  const int row_counts[] = {1, 65, 300, 5, 64, 130};  // the windowed ones (i % 3 == 2) longer than their window
  // Twice: with the CUDA kernel's default chunks, and in up to 256 chunks of one row (KVS_DECODE_CHUNKS), where the
  // view of 4,500 rows makes a grid of 256 chunks and each query fills the chunks its rows make, 1 to 250 (the CPU
  // backends repeat themselves).
  const test::UnsetAtExit unset{"KVS_DECODE_CHUNKS"};
  for (const std::string chunks : {"", "256,1"}) {
    CAPTURE(chunks);
    if (!chunks.empty()) setenv("KVS_DECODE_CHUNKS", chunks.c_str(), 1);
    test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
      std::mt19937 gen(5);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      enum class Kind { kDecode, kPrefillChunk, kChunkLast, kSinks };
      for (const auto& [sequences, kind] : {std::pair{3, Kind::kDecode}, std::pair{70, Kind::kDecode},
                                            std::pair{3, Kind::kPrefillChunk}, std::pair{3, Kind::kSinks},
                                            std::pair{2, Kind::kPrefillChunk}, std::pair{4, Kind::kChunkLast}}) {
        CAPTURE_BINDING(sequences);
        const int kind_id = int(kind);  // not the binding: see CAPTURE_BINDING
        CAPTURE(kind_id);
        struct Sequence {
          std::vector<int> blocks;
          std::vector<float> keys, values;  // host copies of the pool, for the reference
          Buffer d_keys, d_values;
          IntBuffer d_blocks;
        };
        std::vector<Sequence> held(sequences);
        std::vector<Backend::AttentionPart> parts, host_parts;
        std::vector<int> positions;  // each query's position: the last n of its view
        int max_rows = 0;
        for (int i = 0; i < sequences; ++i) {
          Sequence& s = held[i];
          // A first view of 4,500 rows in the batches of 3: over 1,024, the CUDA kernel's chunks grow past 16 rows
          // (DecodeChunks::rows_per_split), so its neighbours in the launch are cut into chunks of another size.
          const int rows = sequences == 3 && i == 0 ? 4500 : row_counts[i % 6], block_size = i % 2 ? 16 : 3;
          const int chunk_at = kind == Kind::kPrefillChunk ? 1 : kind == Kind::kChunkLast ? sequences - 1 : -1;
          const int n = i == chunk_at ? 4 : 1;
          s.blocks = shuffled_blocks(rows, block_size, gen);
          const BlockTable host_table{s.blocks.data(), block_size};
          const std::size_t pool_floats = std::size_t(blocks_needed(rows, block_size) + 2) * block_size * kv_dim;
          s.keys.assign(pool_floats, NAN), s.values.assign(pool_floats, NAN);
          for (int p = 0; p < rows; ++p)
            for (int j = 0; j < kv_dim; ++j) {
              s.keys[std::size_t(host_table.physical_row(p)) * kv_dim + j] = normal(gen);
              s.values[std::size_t(host_table.physical_row(p)) * kv_dim + j] = normal(gen);
            }
          s.d_keys = test::to_backend(backend, s.keys), s.d_values = test::to_backend(backend, s.values);
          s.d_blocks = IntBuffer(backend, s.blocks.size());
          backend.from_host(s.d_blocks.data(), s.blocks.data(), s.blocks.size());
          const Window window = kind == Kind::kSinks && i == 2 ? Window{16, 2} : i % 3 == 2 ? Window{16, 0} : Window{};
          const KvView view{.keys = s.d_keys.data(), .values = s.d_values.data(), .rows = rows, .row_stride = kv_dim,
                            .window = window, .paged = BlockTable{s.d_blocks.data(), block_size}};
          KvView host_view = view;
          host_view.keys = s.keys.data(), host_view.values = s.values.data(), host_view.paged = host_table;
          parts.push_back({static_cast<int>(positions.size()), n, view});
          host_parts.push_back({static_cast<int>(positions.size()), n, host_view});
          for (int j = 0; j < n; ++j) positions.push_back(rows - n + j);
          max_rows = std::max(max_rows, rows);
        }
        const int tokens = static_cast<int>(positions.size());
        std::vector<float> q(std::size_t(tokens) * dim);
        for (float& x : q) x = normal(gen);
        const Buffer d_q = test::to_backend(backend, q);
        IntBuffer d_positions(backend, positions.size());
        backend.from_host(d_positions.data(), positions.data(), positions.size());
        // Scratch of NaN: the split kernel's merge must read only the partials this launch wrote.
        Buffer d_out(backend, q.size());
        Buffer scratch = test::nan_buffer(backend, backend.attention_scratch_floats(shape, max_rows, sequences));
        backend.attention_batch(d_out.data(), d_q.data(), d_positions.data(), parts, shape,
                                {scratch.data(), scratch.size()});
        const std::vector<float> batched = test::from_backend(backend, d_out);

        int identical = 0;
        float worst = 0;
        for (int i = 0; i < sequences; ++i) {
          const Backend::AttentionPart& p = parts[i];
          const std::size_t at = std::size_t(p.offset) * dim, count = std::size_t(p.n) * dim;
          Buffer alone(backend, count);
          Buffer alone_scratch = test::nan_buffer(backend, backend.attention_scratch_floats(shape, p.kv.rows, 1));
          backend.attention(alone.data(), d_q.data() + at, d_positions.data() + p.offset, p.n, p.kv, shape,
                            {alone_scratch.data(), alone_scratch.size()}, nullptr);
          const std::vector<float> got = test::from_backend(backend, alone);
          identical += std::memcmp(got.data(), batched.data() + at, count * sizeof(float)) == 0;
          std::vector<float> expected(count);
          reference_attention(expected.data(), q.data() + at, positions[p.offset], p.n, host_parts[i].kv, shape);
          for (std::size_t j = 0; j < count; ++j)
            worst = std::isfinite(batched[at + j]) ? std::max(worst, std::abs(batched[at + j] - expected[j]))
                                                   : INFINITY;
        }
        CHECK(identical == sequences);
        CHECK(worst < 1e-5f);  // float sums against the reference's doubles over <= 4,500 rows of head_dim 32
      }
    });
  }
}

// The CUDA decoding kernel reads a launch's rows on one of two paths: 16 bytes at a time where every head starts on
// 16 bytes, else a number at a time in another lane layout, whose sums run in another order where a lane holds
// several numbers of a row (head_dim > 32). Views of both kinds in one batch (rows kv_dim and kv_dim + 3 floats
// apart): each sequence still gets the bits of its attention alone (when one launch took both kinds, the aligned
// views took the other path, and other bits, than alone). The CPU backends repeat the first test's promise.
TEST_CASE("batched attention: views of the decoding kernel's two paths in one batch each get their bits alone") {
  const AttentionShape shape{4, 2, 64};
  const int kv_dim = shape.n_kv_heads * shape.head_dim, dim = shape.n_heads * shape.head_dim, rows = 40;
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    std::mt19937 gen(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int sequences = 5;
    std::vector<Buffer> keys, values;
    keys.reserve(sequences), values.reserve(sequences);
    std::vector<Backend::AttentionPart> parts;
    std::vector<int> positions;
    for (int i = 0; i < sequences; ++i) {
      const int stride = i % 2 ? kv_dim + 3 : kv_dim;  // (rows, stride): the odd ones off 16 bytes, the other path
      std::vector<float> k(std::size_t(rows) * stride), v(k.size());
      for (float& x : k) x = normal(gen);
      for (float& x : v) x = normal(gen);
      keys.push_back(test::to_backend(backend, k)), values.push_back(test::to_backend(backend, v));
      parts.push_back({i, 1, KvView{.keys = keys.back().data(), .values = values.back().data(), .rows = rows,
                                    .row_stride = stride}});
      positions.push_back(rows - 1);
    }
    std::vector<float> q(std::size_t(sequences) * dim);  // (sequences, dim)
    for (float& x : q) x = normal(gen);
    const Buffer d_q = test::to_backend(backend, q);
    IntBuffer d_positions(backend, positions.size());
    backend.from_host(d_positions.data(), positions.data(), positions.size());
    Buffer d_out(backend, q.size());  // (sequences, dim)
    Buffer scratch = test::nan_buffer(backend, backend.attention_scratch_floats(shape, rows, sequences));
    backend.attention_batch(d_out.data(), d_q.data(), d_positions.data(), parts, shape, {scratch.data(), scratch.size()});
    const std::vector<float> batched = test::from_backend(backend, d_out);
    for (int i = 0; i < sequences; ++i) {
      CAPTURE(i);
      Buffer alone(backend, dim);
      Buffer alone_scratch = test::nan_buffer(backend, backend.attention_scratch_floats(shape, rows, 1));
      backend.attention(alone.data(), d_q.data() + std::size_t(i) * dim, d_positions.data() + i, 1, parts[i].kv, shape,
                        {alone_scratch.data(), alone_scratch.size()}, nullptr);
      const std::vector<float> got = test::from_backend(backend, alone);
      CHECK(std::memcmp(got.data(), batched.data() + std::size_t(i) * dim, dim * sizeof(float)) == 0);
    }
  });
}

// Backend::write_paged_batch against its definition (write_paged_rows / write_paged_coded_rows part by part, as
// Backend's default runs them) and, for float rows, against the rows expected: 70 sequences of one pool (two CUDA
// launches of up to 64 parts), blocks of 3 rows shuffled, one sequence writing a prefill chunk of 5 positions across
// a block boundary, one writing nothing (n = 0), rows no part covers, every format of chapter 10. Rows nobody
// writes keep their bytes. The CPU runs the definition itself (it has no batched write of its own): there only
// the rows expected, coded by the test, can fail.
TEST_CASE("batched cache write: a batch's rows in one pool as each sequence's write alone, every format and backend") {
  const ModelConfig c{.dim = 128, .hidden_dim = 32, .n_layers = 1, .n_heads = 4, .n_kv_heads = 2, .vocab_size = 256,
                      .seq_len = 64};
  const int kv_dim = c.kv_dim(), block_size = 3, sequences = 70;
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    for (KvFormat format : {KvFormat::kFp32, KvFormat::kFp16, KvFormat::kBf16, KvFormat::kInt8, KvFormat::kInt4}) {
      CAPTURE(to_string(format));
      std::mt19937 gen(9);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      // Each sequence holds positions 0 .. first + n - 1 and writes [first, first + n); its blocks anywhere in the pool.
      std::vector<int> firsts, counts, all_blocks(std::size_t(sequences) * 8);
      std::iota(all_blocks.begin(), all_blocks.end(), 0);
      std::shuffle(all_blocks.begin(), all_blocks.end(), gen);
      const ch08::PoolFormat pool_format{format, 32};
      ch08::BlockPool batched(backend, c, static_cast<int>(all_blocks.size()), block_size, sequences, c.seq_len, pool_format),
          alone(backend, c, static_cast<int>(all_blocks.size()), block_size, sequences, c.seq_len, pool_format);
      std::vector<Backend::PagedPart> parts;
      std::vector<int> positions;
      for (int i = 0; i < sequences; ++i) {
        const int first = (i * 5) % 19, n = i == 3 ? 5 : i == 10 ? 0 : 1;  // sequence 3: positions 15-19, blocks 5-6
        const std::vector<int> blocks(all_blocks.begin() + i * 8, all_blocks.begin() + i * 8 + blocks_needed(first + n, block_size));
        for (ch08::BlockPool* pool : {&batched, &alone}) backend.from_host(pool->table(i), blocks.data(), blocks.size());
        // Before sequence 20, two rows of k, v and positions that no part covers: never written (position 0
        // would land in a row of sequence 20's that it does not write).
        if (i == 20) positions.insert(positions.end(), {0, 0});
        parts.push_back({static_cast<int>(positions.size()), n, BlockTable{batched.table(i), block_size}});
        for (int p = first; p < first + n; ++p) positions.push_back(p);
        firsts.push_back(first), counts.push_back(n);
      }
      const int tokens = static_cast<int>(positions.size());
      std::vector<float> k(std::size_t(tokens) * kv_dim), v(k.size());
      for (float& x : k) x = normal(gen);
      for (float& x : v) x = normal(gen);
      const Buffer d_k = test::to_backend(backend, k), d_v = test::to_backend(backend, v);
      IntBuffer d_positions(backend, positions.size());
      backend.from_host(d_positions.data(), positions.data(), positions.size());
      // Both pools start as the same bytes (not all zero: a row left alone must be seen to be left alone).
      const std::size_t side_floats = std::size_t(all_blocks.size()) * block_size * batched.side(0, 0).row_bytes() / sizeof(float);
      std::vector<float> start(side_floats);
      for (float& x : start) x = normal(gen);
      for (ch08::BlockPool* pool : {&batched, &alone})
        for (int kv = 0; kv < 2; ++kv) backend.from_host(reinterpret_cast<float*>(pool->side(0, kv).codes), start.data(), side_floats);

      backend.write_paged_batch(batched.side(0, 0), batched.side(0, 1), d_positions.data(), parts, d_k.data(), d_v.data());
      std::vector<Backend::PagedPart> alone_parts = parts;
      for (int i = 0; i < sequences; ++i) alone_parts[i].table.blocks = alone.table(i);
      backend.Backend::write_paged_batch(alone.side(0, 0), alone.side(0, 1), d_positions.data(), alone_parts, d_k.data(), d_v.data());

      for (int kv = 0; kv < 2; ++kv) {
        CAPTURE(kv);
        std::vector<float> got(side_floats), expected(side_floats);
        backend.to_host(got.data(), reinterpret_cast<float*>(batched.side(0, kv).codes), side_floats);
        backend.to_host(expected.data(), reinterpret_cast<float*>(alone.side(0, kv).codes), side_floats);
        CHECK(std::memcmp(got.data(), expected.data(), side_floats * sizeof(float)) == 0);
        // Each written row is its source row, coded here on the host (CodedRows::encode_group, the one coding,
        // tested in test_kv_format.cpp) at the row this test finds for it, and nothing else changed. Independent of
        // the definition's row arithmetic, so on the CPU, where the batched write is the definition, it can fail.
        const std::vector<float>& src = kv == 0 ? k : v;
        std::vector<float> want = start;
        const CodedRows device_side = batched.side(0, kv);
        CodedRows host_side = device_side;  // the same layout over `want`: codes, then scales
        host_side.codes = reinterpret_cast<std::uint8_t*>(want.data());
        host_side.scales = want.data() + (device_side.scales - reinterpret_cast<float*>(device_side.codes));
        for (int i = 0; i < sequences; ++i) {
          std::vector<int> blocks(blocks_needed(firsts[i] + counts[i], block_size));
          backend.to_host(blocks.data(), batched.table(i), blocks.size());
          for (int p = firsts[i], token = parts[i].offset; p < firsts[i] + counts[i]; ++p, ++token)
            for (int g = 0; g < host_side.groups(); ++g)
              host_side.encode_group(std::size_t(BlockTable{blocks.data(), block_size}.physical_row(p)), g,
                                     src.data() + std::size_t(token) * kv_dim + std::size_t(g) * host_side.group);
        }
        CHECK(std::memcmp(got.data(), want.data(), side_floats * sizeof(float)) == 0);
      }
    }
  });
}

// Keys all zero, so every visible row weighs the same and the output is the mean of the visible values; value
// row = its request's tag · 1000 + its position. A query of request B at position p must get exactly
// B·1000 + p/2: any row of another request, or a stale row of a block's previous owner, moves it.
TEST_CASE("paged sequences: blocks freed and reused by another request, each query sees only its own positions") {
  const ModelConfig c{.dim = 16, .hidden_dim = 32, .n_layers = 2, .n_heads = 2, .n_kv_heads = 1, .vocab_size = 256,
                      .seq_len = 64};
  const AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim()};
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    for (int block_size : {1, 3, 16}) {
      CAPTURE(block_size);
      BlockPool pool(backend, c, blocks_needed(40, block_size), block_size, 3, c.seq_len);  // room for one long sequence
      auto fill = [&](PagedSequence& s, int tag, int length) {
        for (int p = s.length(); p < length; ++p) {
          s.prepare(p, 1);
          const std::vector<float> key(c.kv_dim(), 0.0f), value(c.kv_dim(), float(tag * 1000 + p));
          const Buffer d_key = test::to_backend(backend, key), d_value = test::to_backend(backend, value);
          const IntBuffer position = consecutive_positions(backend, p, 1);
          for (int layer = 0; layer < c.n_layers; ++layer) s.write(layer, p, 1, position.data(), d_key.data(), d_value.data());
        }
      };
      // What attention over s's layer-1 view gives a query at `pos`: the mean of the values it sees.
      auto mean_seen = [&](PagedSequence& s, int pos) {
        const std::vector<float> q(c.dim, 1.0f);
        const Buffer d_q = test::to_backend(backend, q);
        Buffer d_out(backend, c.dim), scratch(backend, backend.attention_scratch_floats(shape, c.seq_len, 1));
        const IntBuffer position = consecutive_positions(backend, pos, 1);
        backend.attention(d_out.data(), d_q.data(), position.data(), 1, s.view(1), shape, {scratch.data(), scratch.size()}, nullptr);
        return test::from_backend(backend, d_out)[0];
      };
      // Means of up to 20 values near 1,000-4,000 in float: rounding within 1e-6 relative (~4e-3); a wrong, stale
      // or another sequence's row moves a mean by at least 1/20, and another sequence's by ~50 or more.
      {
        PagedSequence a(pool), b(pool);
        fill(a, 1, 20), fill(b, 2, 7);  // interleaved growth would mix their blocks; this takes a's first
        CHECK(mean_seen(a, 19) == doctest::Approx(1000 + 9.5).epsilon(1e-6));
        CHECK(mean_seen(b, 6) == doctest::Approx(2000 + 3).epsilon(1e-6));
      }  // both finish: every block back in the pool
      CHECK(pool.free_blocks() == pool.blocks());
      PagedSequence c1(pool), c2(pool);  // new owners of the same blocks, in another order
      for (int length = 1; length <= 16; ++length) {
        fill(c1, 3, length), fill(c2, 4, length + 2);
        CAPTURE(length);
        CHECK(mean_seen(c1, length - 1) == doctest::Approx(3000 + (length - 1) / 2.0).epsilon(1e-6));
        CHECK(mean_seen(c2, length + 1) == doctest::Approx(4000 + (length + 1) / 2.0).epsilon(1e-6));
        for (int p = 0; p < length; ++p) {  // and row() agrees, position by position
          float v = 0;
          backend.to_host(&v, c1.row(0, p).value, 1);
          CHECK(v == float(3000 + p));
        }
      }
      check_block_ownership(pool, {&c1, &c2});
    }
  });
}

TEST_CASE("block pool: more rows than an int or exhaustion is refused, a double free and a shared block are caught, every block comes back") {
  CpuBackend cpu(1);
  const ModelConfig c{.dim = 16, .hidden_dim = 32, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .vocab_size = 256,
                      .seq_len = 64};
  // Rows are ints: 2^31 - 1 of them at most, refused before anything is allocated.
  CHECK(BlockPool::max_blocks(4) == 536870911);
  CHECK_THROWS_WITH(BlockPool(cpu, c, 536870912, 4, 2, 64), doctest::Contains("more rows than an int numbers"));
  CHECK_THROWS_WITH(BlockPool(cpu, c, 0, 4, 2, 64), doctest::Contains("blocks must be at least 1"));
  BlockPool pool(cpu, c, 4, 3, 2, 64);
  {
    PagedSequence a(pool);
    CHECK(a.blocks_to_grow(7) == 3);
    a.prepare(0, 7);
    CHECK(pool.free_blocks() == 1);
    CHECK(a.blocks_to_grow(2) == 0);  // 7 + 2 = 9 = three blocks of 3
    CHECK(a.blocks_to_grow(3) == 1);
    a.prepare(7, 5);  // the last block
    CHECK_THROWS_WITH(a.prepare(12, 1), doctest::Contains("no free block"));
    CHECK_THROWS_WITH(PagedSequence(pool).prepare(1, 1), doctest::Contains("appends"));
    PagedSequence b(pool);
    CHECK_THROWS_WITH(PagedSequence{pool}, doctest::Contains("every sequence slot"));
    check_block_ownership(pool, {&a, &b});
    CHECK_THROWS_WITH(check_block_ownership(pool, {&a, &a}), doctest::Contains("handed out twice"));
    // A sequence the audit is not shown holds its blocks as a leak would: neither free nor held.
    CHECK_THROWS_WITH(check_block_ownership(pool, {&b}), doctest::Contains("block 0 is neither free nor held"));
  }
  CHECK(pool.free_blocks() == 4);
  pool.break_double_free();
  {
    PagedSequence a(pool);
    a.prepare(0, 1);
  }  // its one block goes back twice
  CHECK_THROWS_WITH(check_block_ownership(pool, {}), doctest::Contains("handed out twice (the free list)"));
}

// Every sequence's logits in one batched call (a decode token for some, a prefill chunk for others) against
// the same sequence alone. Not bit for bit: this call's 74 tokens are more than the CPU's few-token products
// take (64, the test below), and Eigen's GEMM sums in another order than one token's product; the shipped
// model's logits are O(10), their float rounding ~1e-5 apart.
TEST_CASE("batched forward: each sequence's logits equal its logits alone within 1e-4, every backend") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const ModelConfig& c = checkpoint.config();
  const std::string text = test::validation_text();
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    Model model(checkpoint, backend, 128, 256);
    const std::vector<int> a = encode_bytes(text.substr(100, 40)), b = encode_bytes(text.substr(900, 3)),
                           d = encode_bytes(text.substr(2000, 70));
    using Cache = ch03::PreallocatedKvCache;
    Cache ca(backend, c, 100), cb(backend, c, 100), cd(backend, c, 100), ra(backend, c, 100), rb(backend, c, 100), rd(backend, c, 100);
    model.forward(std::span(a).first(39), 0, &ca);  // a and its reference decode their 40th token in the batch
    model.forward(std::span(a).first(39), 0, &ra);
    const SequenceStep batch[] = {{std::span(a).last(1), 39, &ca}, {b, 0, &cb}, {d, 0, &cd}};
    const std::span<const float> got = model.forward(batch);
    const std::vector<float> batched(got.begin(), got.end());
    REQUIRE(batched.size() == 3u * c.vocab_size);
    float worst = 0;
    auto compare = [&](int row, std::span<const float> alone_logits) {
      worst = worst_difference(worst, max_abs_difference(std::span(batched).subspan(std::size_t(row) * c.vocab_size, c.vocab_size),
                                                         alone_logits));
    };
    compare(0, model.forward(std::span(a).last(1), 39, &ra));
    compare(1, model.forward(b, 0, &rb));
    compare(2, model.forward(d, 0, &rd));
    CHECK(worst < 1e-4f);
    MESSAGE("largest logit difference, batched vs alone: " << worst);
    // Every position's logits of a batch too (kAllPositions): the rows of a sequence in batch order.
    Cache ea(backend, c, 100), eb(backend, c, 100);
    const SequenceStep two[] = {{b, 0, &ea}, {std::span(d).first(5), 0, &eb}};
    CHECK(model.forward(two, Logits::kAllPositions).size() == 8u * c.vocab_size);
    CHECK_THROWS_WITH(model.forward(std::span<const SequenceStep>(), Logits::kLastPosition), doctest::Contains("no sequences"));
    const SequenceStep shared[] = {{b, 0, &cb}, {b, 3, &cb}};
    CHECK_THROWS_WITH(model.forward(shared), doctest::Contains("share one cache"));
  });
}

// A decode step of a few sequences is exact: each sequence gets the bits of its step alone. On the CPU up to 64
// sequences: cpu_backend.cpp's few-token products sum every token's outputs in the order one token alone gets
// (three steps of 2, 9, 16 and 64 sequences: tiles of 8 tokens with AVX-512, else 4 - one tile, two, several
// taking the inputs in chunks). On the CUDA kernels up to fused_tokens() = 64: gemv_kernel sums each token's products in
// the same order whichever of its 1, 2, 4, 8-token forms runs and whichever tile of 8 tokens holds it (each token's
// sums its own, the warp's reduce-scatter adds the same pairs of lanes as a plain warp sum, and addition is
// commutative), so 2, 3, 9 (a second tile of one token) and 20 (a third of four; 64 itself is the kernel test's,
// against the definition, and the next test's operation count: 64 sequences through the harness take a minute).
// Everything else (norms, RoPE, attention over each sequence's own cache) is per token already.
TEST_CASE("batched decode: a few sequences each get the very bits of their step alone, every backend") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const ModelConfig& c = checkpoint.config();
  const std::string text = test::validation_text();
  test::for_each_backend(test::test_backend_names(), [&](Backend& backend) {
    Model model(checkpoint, backend, 128, 256);
    using Cache = ch03::PreallocatedKvCache;
    const bool cpu = backend.fused_tokens() == 0;
    // The CUDA kernels' products take 8 tokens a tile: 2 and 3 fill part of one, 9 ends in a tile of 1, 20 in one
    // of 4. Under the sanitizer (test_util.h) 3 and 9 alone: 20 sequences through the harness took 63 s there, and
    // made this the suite's longest test (134 s in CI with all four).
    // Prompts of different lengths, 5 to 110 bytes (a query visiting more than 16 rows is split in chunks on the
    // kernels, past 64 before: 7 of the 16 lengths cross that); under the sanitizer 5 to 21 (the harness's prefills
    // of up to 61 bytes were most of the 51 s that 9 sequences took there), which still cross 16.
    const int length_step = test::sanitizer_run() ? 2 : 7;
    const std::vector<int> kernel_batches = test::sanitizer_run() ? std::vector<int>{3, 9} : std::vector<int>{2, 3, 9, 20};
    for (const int sequences : cpu ? std::vector<int>{2, 9, 16, 64} : kernel_batches) {
      CAPTURE(sequences);
      std::vector<std::vector<int>> prompts;
      std::vector<Cache> batched_caches, alone_caches;
      std::vector<int> next(sequences);
      for (int i = 0; i < sequences; ++i) {
        prompts.push_back(encode_bytes(text.substr(std::size_t(i) * 150, std::size_t(5 + length_step * (i % 16)))));
        batched_caches.emplace_back(backend, c, 128);
        alone_caches.emplace_back(backend, c, 128);
        model.forward(prompts[i], 0, &batched_caches[i]);
        const std::span<const float> logits = model.forward(prompts[i], 0, &alone_caches[i]);
        next[i] = argmax(logits);
      }
      for (int step = 0; step < 3; ++step) {
        CAPTURE(step);
        std::vector<SequenceStep> batch;
        for (int i = 0; i < sequences; ++i)
          batch.push_back({std::span(next).subspan(std::size_t(i), 1), int(prompts[i].size()) + step, &batched_caches[i]});
        const std::span<const float> got = model.forward(batch);
        const std::vector<float> batched(got.begin(), got.end());
        int identical = 0;
        for (int i = 0; i < sequences; ++i) {
          const std::span<const float> alone = model.forward(std::span(next).subspan(std::size_t(i), 1), batch[i].pos, &alone_caches[i]);
          identical += std::memcmp(alone.data(), batched.data() + std::size_t(i) * c.vocab_size, c.vocab_size * sizeof(float)) == 0;
          next[i] = argmax(alone);
        }
        CHECK(identical == sequences);
      }
    }
  });
}

// The model writes the sequences of a batch that share a pool with one Backend::write_paged_batch a layer
// (KvCache::paged_write), any other cache with its write(): sequences of an fp32 pool, of an int8 pool (not the
// first pool of the batch: written one by one) and a preallocated cache, interleaved, each get the bits of their
// decode step alone, three steps, crossing block boundaries (8 sequences: the CUDA kernels' fused products are
// exact up to fused_tokens() = 64). And a decode step's backend operations, counted by ProfilingBackend, are as
// many for 8 and 64 sequences of one pool as for 2: a write() per sequence would add one a sequence and layer, and
// products past the CUDA kernels' fused_tokens() their definitions' operations.
TEST_CASE("batched decode through pools: one cache write a layer for a pool's sequences, each sequence's bits as alone, every backend") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const ModelConfig& c = checkpoint.config();
  const std::string text = test::validation_text();
  test::for_each_backend(test::test_backend_names(), [&](Backend& inner) {
    ProfilingBackend backend(inner);
    Model model(checkpoint, backend, 128, 256);
    const int sequences = 8, block_size = 8;
    const ch08::PoolFormat int8{KvFormat::kInt8};
    // The batch's caches, and each sequence's twin that decodes alone.
    ch08::BlockPool fp32_pool(backend, c, 64, block_size, sequences, 128), fp32_twins(backend, c, 64, block_size, sequences, 128),
        int8_pool(backend, c, 64, block_size, sequences, 128, int8), int8_twins(backend, c, 64, block_size, sequences, 128, int8);
    std::vector<std::unique_ptr<KvCache>> batched, alone;
    std::vector<int> lengths, next;
    // Prompts of 5 + 7i bytes, or under the sanitizer 5 + i (the harness's prefills were most of its time there):
    // either way every offset in a block of 8, since 7 and 1 are both prime to 8.
    const int length_step = test::sanitizer_run() ? 1 : 7;
    for (int i = 0; i < sequences; ++i) {
      if (i == 3) {
        batched.push_back(std::make_unique<ch03::PreallocatedKvCache>(backend, c, 128));
        alone.push_back(std::make_unique<ch03::PreallocatedKvCache>(backend, c, 128));
      } else {
        const bool coded = i % 4 == 1;
        batched.push_back(std::make_unique<ch08::PagedSequence>(coded ? int8_pool : fp32_pool));
        alone.push_back(std::make_unique<ch08::PagedSequence>(coded ? int8_twins : fp32_twins));
      }
      const std::vector<int> prompt = encode_bytes(text.substr(std::size_t(i) * 150, std::size_t(5 + length_step * i)));
      model.forward(prompt, 0, batched[i].get());
      next.push_back(argmax(model.forward(prompt, 0, alone[i].get())));
      lengths.push_back(static_cast<int>(prompt.size()));  // 5, 12, ... 54: steps from each offset in a block of 8
    }
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      std::vector<SequenceStep> batch;
      for (int i = 0; i < sequences; ++i) batch.push_back({std::span(next).subspan(std::size_t(i), 1), lengths[i] + step, batched[i].get()});
      const std::span<const float> got = model.forward(batch);
      const std::vector<float> logits(got.begin(), got.end());
      int identical = 0;
      for (int i = 0; i < sequences; ++i) {
        const std::span<const float> own = model.forward(std::span(next).subspan(std::size_t(i), 1), lengths[i] + step, alone[i].get());
        identical += std::memcmp(own.data(), logits.data() + std::size_t(i) * c.vocab_size, c.vocab_size * sizeof(float)) == 0;
        next[i] = argmax(own);
      }
      CHECK(identical == sequences);
    }

    // Operations of the second decode step of `count` sequences of one pool, blocks large enough that it takes none
    // (a block taken uploads a table entry: a transfer, counted).
    auto step_operations = [&](int count) {
      ch08::BlockPool pool(backend, c, count, 256, count, 256);
      std::vector<std::unique_ptr<ch08::PagedSequence>> caches;
      std::vector<SequenceStep> batch;
      const std::vector<int> tokens = encode_bytes(text.substr(0, std::size_t(count)));
      for (int i = 0; i < count; ++i) {
        caches.push_back(std::make_unique<ch08::PagedSequence>(pool));
        batch.push_back({std::span(tokens).subspan(std::size_t(i), 1), 0, caches[i].get()});
      }
      model.forward(batch);  // position 0: each sequence takes its block
      for (SequenceStep& s : batch) s.pos = 1;
      backend.reset();
      model.forward(batch);
      std::int64_t operations = 0;
      for (OpKind kind : {OpKind::kMatmul, OpKind::kAttention, OpKind::kOther}) operations += backend.operations(kind);
      return operations;
    };
    const std::int64_t two = step_operations(2), eight = step_operations(8), many = step_operations(64);
    MESSAGE("backend operations of a decode step: " << two << " for 2 sequences, " << eight << " for 8, " << many << " for 64");
    CHECK(two >= 3 * c.n_layers);  // the profiler counted the step: a product, attention and more a layer (0 == 0 passed)
    CHECK(eight == two);
    CHECK(many == two);  // 64: the batched write's and attention's launch limit, the CUDA products' fused limit
  });
}

// The scheduler against each request alone: greedy tokens identical, for block sizes 1, 3 and 16, prompts
// ending on and one past a block boundary, requests arriving mid-run, and a pool small enough to preempt.
TEST_CASE("scheduler: every request's greedy tokens equal the request served alone, with joins, leaves and preemption") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::string text = test::validation_text();
  // Under the sanitizers 5 requests a block size: all three prompt shapes, and the tight pool still preempts
  // (checked below).
  const bool short_run = test::sanitizer_run();
  CpuBackend cpu(test::test_threads());
  Model model(checkpoint, cpu, 128, checkpoint.config().seq_len);
  for (int block_size : {1, 3, 16}) {
    CAPTURE(block_size);
    std::vector<Request> requests;
    const int count = short_run ? 5 : 9;
    for (int i = 0; i < count; ++i) {
      // prompts of 2, 3 and 4 blocks plus 0, 1 and 2 positions: on a boundary, one past, inside (with blocks of
      // one position, a block's end every time)
      const int length = std::max(1, block_size * (2 + i % 3) + i % 3);
      requests.push_back(Request{encode_bytes(text.substr(1000 + 977 * i, length)), 6 + 5 * (i % 4), 3 * i});
    }
    std::vector<std::vector<int>> expected;
    for (const Request& r : requests) expected.push_back(serve_alone(model, r));
    for (bool tight : {false, true}) {
      CAPTURE(tight);
      // tight: a pool of just over what the longest request needs, so sequences wait and are preempted.
      int longest = 0;
      for (const Request& r : requests) longest = std::max(longest, int(r.prompt.size()) + r.max_new_tokens);
      const int blocks = tight ? blocks_needed(longest, block_size) + 2 : 1000;
      BlockPool pool(cpu, model.config(), blocks, block_size, 9, model.config().seq_len);
      std::vector<RequestResult> results;
      const RunStats stats = serve(model, pool, requests, SchedulerOptions{.max_batch = 9, .token_budget = 32}, results);
      for (std::size_t i = 0; i < requests.size(); ++i) {
        CAPTURE(i);
        CHECK(results[i].output == expected[i]);
      }
      CHECK(pool.free_blocks() == pool.blocks());  // every block back when every request has finished
      check_token_accounting(requests, stats);
      if (tight) CHECK(stats.preemptions > 0);
      else CHECK(stats.preemptions == 0);
      CHECK(stats.peak_running > 1);
    }
  }
  // Static batching gives the same tokens. Its batch is as large as --max-batch and the free blocks allow, whatever
  // one step's token budget: prompts of 10, 17, 24 and 31 tokens (82) in steps of 16 tokens are one batch of 4,
  // prefilled over 6 steps, all 4 in the forward pass of the fourth (it once admitted only what the first step's
  // budget reached, 2 sequences). In 6 blocks of 16 positions the first batch is the 3 whose prompts' blocks fit
  // together (1 + 2 + 2), and these lengths grow to 1 + 2 + 3 blocks: no preemption. (Admitted against the blocks
  // of their first chunks alone, all 4 joined and one was preempted when the prompts outgrew the pool.)
  std::vector<Request> requests;
  for (int i = 0; i < 4; ++i) requests.push_back(Request{encode_bytes(text.substr(5000 + 300 * i, 10 + 7 * i)), 5 + 3 * i, 0});
  struct StaticRun {
    int max_batch, token_budget, blocks, expected_batch;
  };
  for (const StaticRun run : {StaticRun{2, 32, 200, 2}, StaticRun{4, 16, 200, 4}, StaticRun{4, 16, 6, 3}}) {
    CAPTURE(run.max_batch);
    CAPTURE(run.token_budget);
    CAPTURE(run.blocks);
    BlockPool pool(cpu, model.config(), run.blocks, 16, 4, model.config().seq_len);
    std::vector<RequestResult> results;
    const RunStats stats = serve(model, pool, requests,
                                 SchedulerOptions{.batching = Batching::kStatic, .max_batch = run.max_batch,
                                                  .token_budget = run.token_budget},
                                 results);
    for (std::size_t i = 0; i < requests.size(); ++i) CHECK(results[i].output == serve_alone(model, requests[i]));
    CHECK(stats.peak_running == run.expected_batch);
    CHECK(stats.preemptions == 0);
    check_token_accounting(requests, stats);
  }
}

// The token accounting through repeated preemptions: 8 requests of 30 to 44 new tokens in a pool of 8 or 16 blocks
// of 4 more than the longest needs, arriving together or 2 steps apart, budgets of 8 and 16 tokens a step. A
// preempted sequence's recompute takes several steps, and some are preempted again before it ends. Whatever
// happens, every prompt position is fed once, every recomputed position once more, every generated token but the
// last once: prefill_tokens is exactly the first two. (Counting as prefill, at each admission, only what the last
// preemption had found cached missed the tokens a twice-preempted sequence recomputes again: 5 of these 8 runs
// failed, among 11 of 1,296 such runs tried.)
TEST_CASE("scheduler: the prefill count is the prompts plus the recomputed tokens, through repeated preemptions") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::string text = test::validation_text();
  CpuBackend cpu(1);
  Model model(checkpoint, cpu, 64, checkpoint.config().seq_len);
  int most_preemptions = 0;
  for (int gap : {0, 2}) {
    std::vector<Request> requests;
    for (int i = 0; i < 8; ++i)
      requests.push_back(Request{encode_bytes(text.substr(3000 + 500 * i, 6 + 3 * (i % 4))), 30 + 7 * (i % 3), gap * i});
    int longest = 0;
    for (const Request& r : requests) longest = std::max(longest, int(r.prompt.size()) + r.max_new_tokens);
    for (int budget : {8, 16})
      for (int spare : {8, 16}) {
        CAPTURE(gap);
        CAPTURE(budget);
        CAPTURE(spare);
        BlockPool pool(cpu, model.config(), blocks_needed(longest, 4) + spare, 4, 8, model.config().seq_len);
        std::vector<RequestResult> results;
        const RunStats stats = serve(model, pool, requests, SchedulerOptions{.max_batch = 8, .token_budget = budget}, results);
        check_token_accounting(requests, stats);
        for (const RequestResult& r : results) most_preemptions = std::max(most_preemptions, r.preemptions);
      }
  }
  MESSAGE("the most preemptions of one request: " << most_preemptions);
  CHECK(most_preemptions >= 2);
}

// The admission watermark (SchedulerOptions::watermark_blocks): two requests of one 16-position prompt block each,
// a pool of 4 blocks. The first is admitted into an empty pool (3 free after it); the second only if its block
// leaves at least the watermark free: 2 admits it (1 left), 3 holds it back until the first has finished. A
// watermark larger than the pool must not starve anyone: with nothing running it does not apply. Outputs equal
// each request alone every time.
TEST_CASE("scheduler: a watermark keeps blocks free at admission while sequences run, and never starves a request") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::string text = test::validation_text();
  CpuBackend cpu(test::test_threads());
  Model model(checkpoint, cpu, 64, checkpoint.config().seq_len);
  const std::vector<Request> requests{Request{encode_bytes(text.substr(300, 16)), 8, 0},
                                      Request{encode_bytes(text.substr(4000, 16)), 8, 0}};
  std::vector<std::vector<int>> expected;
  for (const Request& r : requests) expected.push_back(serve_alone(model, r));
  for (const auto& [watermark, together] : {std::pair{0, 2}, std::pair{2, 2}, std::pair{3, 1}, std::pair{100, 1}}) {
    CAPTURE_BINDING(watermark);
    BlockPool pool(cpu, model.config(), 4, 16, 2, model.config().seq_len);
    std::vector<RequestResult> results;
    const RunStats stats = serve(model, pool, requests, SchedulerOptions{.max_batch = 2, .token_budget = 32,
                                                                         .watermark_blocks = watermark}, results);
    CHECK(stats.peak_running == together);
    CHECK(stats.preemptions == 0);
    for (std::size_t i = 0; i < requests.size(); ++i) CHECK(results[i].output == expected[i]);
    CHECK(pool.free_blocks() == pool.blocks());
  }
}

// More sequences allowed than a step has tokens: every sequence of a step brings at least one token, so no more than
// token_budget ever run at once, and the scheduler counts that many slots a step (SchedulerOptions::batch_limit), not
// max_batch's 64 (which had called 61 slots a step idle while requests waited); a pool with block tables for the
// limit's 3 sequences serves it. (The scheduler used to refuse max_batch above the model's call size, so each
// caller clamped it.) Outputs equal each request alone.
TEST_CASE("scheduler: max_batch above the token budget runs and counts at most the budget's sequences") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::string text = test::validation_text();
  CpuBackend cpu(1);
  Model model(checkpoint, cpu, 3, checkpoint.config().seq_len);
  std::vector<Request> requests;
  for (int i = 0; i < 6; ++i) requests.push_back(Request{encode_bytes(text.substr(2000 + 400 * i, 5 + i % 2)), 4 + i % 3, 0});
  const SchedulerOptions options{.max_batch = 64, .token_budget = 3};
  REQUIRE(options.batch_limit() == 3);
  BlockPool pool(cpu, model.config(), 100, 4, options.batch_limit(), model.config().seq_len);
  std::vector<RequestResult> results;
  const RunStats stats = serve(model, pool, requests, options, results);
  for (std::size_t i = 0; i < requests.size(); ++i) CHECK(results[i].output == serve_alone(model, requests[i]));
  CHECK(stats.peak_running == 3);
  CHECK(stats.slot_steps == 3L * stats.steps);
  CHECK(stats.idle_slot_steps > 0);  // requests did wait for a slot...
  CHECK(stats.idle_slot_steps < stats.slot_steps);  // ...not in every slot of every step
  check_token_accounting(requests, stats);
}

// The binary's preemption experiment: the small pool at watermarks 0, 1, 2, 4 and 8 (counts deterministic for
// these requests: 3 preemptions without a watermark, none with 8), every output the unconstrained run's; and
// --watermark refused there with one line, since the experiment sets it itself.
TEST_CASE("08_paged_batching --experiment preemption: watermarks 0 to 8 preempt less, outputs unchanged") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/08_paged_batching";
  const std::string run = bin + " --experiment preemption --requests 8 --prompt-lengths 16,32 --output-lengths 8,16 --kv-memory 200KiB";
  const auto r = test::run_command(run);
  CHECK(r.exit_code == 0);
  for (const char* row : {"watermark 0:", "watermark 1:", "watermark 2:", "watermark 4:", "watermark 8:"}) CHECK(r.err.find(row) != std::string::npos);
  CHECK(r.err.find("5 blocks, watermark 0:    55 steps") != std::string::npos);
  CHECK(r.err.find("3 preemptions,     88 tokens recomputed") != std::string::npos);
  CHECK(r.err.find("5 blocks, watermark 8:   100 steps") != std::string::npos);
  std::size_t identical = 0;
  for (std::size_t at = r.err.find("8 of 8 outputs identical"); at != std::string::npos; at = r.err.find("8 of 8 outputs identical", at + 1)) ++identical;
  CHECK(identical == 6);
  const auto refused = test::run_command(run + " --watermark 2");
  CHECK(refused.exit_code == 2);
  CHECK(std::count(refused.err.begin(), refused.err.end(), '\n') == 1);
  CHECK(refused.err.find("drop --watermark") != std::string::npos);
}

// The batching experiment: an untimed run of each kind, then --rounds runs of each, the median's row; the counts
// (steps, idle slots) are the same in every run. (That a static batch fills its slots: the scheduler's test.)
TEST_CASE("08_paged_batching --experiment batching: --rounds runs of each kind, the median's row") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/08_paged_batching";
  const std::string run = bin + " --experiment batching --requests 4 --mean-gap 0 --prompt-lengths 40,48 --output-lengths 4,6 "
                                "--max-batch 4 --token-budget 32 --threads 1";
  test::TempDir dir;
  const auto r = test::run_command(run + " --rounds 2 --csv " + dir.file("two.csv"));
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("2 runs of each, the median's:") != std::string::npos);
  CHECK(r.err.find(" recomputed\n") != std::string::npos);  // the preemptions' work, beside the times it explains
  // A row per kind, its counts those of a run of one round (the schedule does not depend on the clock), its
  // times measured.
  REQUIRE(test::run_command(run + " --rounds 1 --csv " + dir.file("one.csv")).exit_code == 0);
  const auto two = test::read_csv(dir.file("two.csv")), one = test::read_csv(dir.file("one.csv"));
  REQUIRE(two.size() == 3);
  REQUIRE(one.size() == 3);
  const std::vector<std::string>& header = two[0];
  auto cell = [&](const std::vector<std::string>& row, const std::string& name) {
    const auto at = std::find(header.begin(), header.end(), name);
    REQUIRE(at != header.end());
    return row[std::size_t(at - header.begin())];
  };
  for (std::size_t i = 1; i < 3; ++i) {
    CAPTURE(i);
    CHECK(cell(two[i], "batching") == (i == 1 ? "continuous" : "static"));
    for (const char* count : {"batching", "steps", "idle_slot_share", "preemptions", "recomputed_tokens"})
      CHECK(cell(two[i], count) == cell(one[i], count));
    CHECK(std::stod(cell(two[i], "steps")) >= 6);  // 4 requests of at least 4 new tokens and a prompt chunk or two
    CHECK(std::stod(cell(two[i], "total_ms")) > 0);
    CHECK(std::stod(cell(two[i], "tokens_per_s")) > 0);
  }
  const auto refused = test::run_command(bin + " --experiment memory --rounds 2");
  CHECK(refused.exit_code == 2);
  CHECK(refused.err.find("--rounds") != std::string::npos);
}

// The products experiment: layer 0's products (the model's own weights) through the few-token product and
// Eigen's GEMM, a row per token count, its path named (the backend's own up to 64 tokens); the CPU backend only; --tokens for it alone.
TEST_CASE("08_paged_batching --experiment products: both paths per token count, the CPU backend only") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/08_paged_batching";
  test::TempDir dir;
  const auto r = test::run_command(bin + " --experiment products --tokens 1,64,65 --rounds 1 --threads 1 --csv " +
                                   dir.file("products.csv"));
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("layer 0's seven products (q, k, v, o: 128 x 128, 128 x 64") != std::string::npos);
  CHECK(r.err.find("few-token p50 / p99") != std::string::npos);
  CHECK(r.err.find("x  few-token\n") != std::string::npos);  // 1 and 64 tokens
  CHECK(r.err.find("x  Eigen\n") != std::string::npos);      // 65
  const auto rows = test::read_csv(dir.file("products.csv"));
  REQUIRE(rows.size() == 1 + 3);
  CHECK(rows[3].back() == "Eigen");  // 65 tokens: the path the backend takes
  // One layer will do: the experiment times layer 0.
  const auto synthetic =
      test::run_command(bin + " --experiment products --synthetic 64,1,4,2 --tokens 2 --rounds 1 --threads 1");
  CHECK(synthetic.exit_code == 0);
  CHECK(synthetic.err.find("(q, k, v, o: 64 x 64, 64 x 32") != std::string::npos);
  const auto harness = test::run_command(bin + " --experiment products --backend cuda-harness");
  CHECK(harness.exit_code == 2);
#if defined(KVS_HAVE_CUDA_HARNESS_MODULE)
  CHECK(harness.err.find("times the CPU backend's two product paths") != std::string::npos);
#else
  CHECK(harness.err.find("this build has no CUDA harness") != std::string::npos);  // said first, whatever the experiment
#endif
  const auto pool_flag = test::run_command(bin + " --experiment products --kv-memory 8MiB");
  CHECK(pool_flag.exit_code == 2);
  CHECK(pool_flag.err.find("--kv-memory is not read by --experiment products") != std::string::npos);
  const auto elsewhere = test::run_command(bin + " --experiment memory --tokens 4");
  CHECK(elsewhere.exit_code == 2);
  CHECK(elsewhere.err.find("--tokens") != std::string::npos);
}

// Settings that would have run otherwise than asked, refused before anything runs: a watermark of the whole pool
// (batching silently off), a budget past the context (it failed after the setup lines), more blocks than int rows
// (the pool was silently cut to 2^24 blocks).
TEST_CASE("08_paged_batching: a watermark of the whole pool, a step past the context, a pool past int rows: one line") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/08_paged_batching --model " + test::golden_path("mha.bin") +
                          " --threads 1 --requests 2 --prompt-lengths 4,8 --output-lengths 2,2 --max-batch 4";
  const auto fine = test::run_command(bin + " --kv-memory 64KiB --watermark 1");
  CAPTURE(fine.err);
  REQUIRE(fine.exit_code == 0);
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {" --kv-memory 64KiB --watermark 100000", "--watermark 100000 keeps free at least all "},
           {" --token-budget 200", "--token-budget 200 exceeds the model's context of 96 positions; give at most 96"},
           {" --block-size 1 --kv-memory 100TiB --memory-limit 200TiB", " (rows are ints); give less memory"},
       }) {
    CAPTURE_BINDING(flags);
    const auto bad = test::run_command(bin + flags);
    CAPTURE(bad.err);
    CHECK(bad.exit_code == 2);
    CHECK(std::count(bad.err.begin(), bad.err.end(), '\n') == 1);
    CHECK(bad.err.find(message) != std::string::npos);
  }
}

// --synthetic for the throughput experiment: random weights of a chosen shape (a model too large for the caches, where
// batching pays: book 08), a row per batch size; attention's scratch sized for the run's sequences (12 positions),
// not the synthetic context of 65,536 (which would take 64 MiB of scores at this shape); refused with one line by
// every other experiment and beside --model.
TEST_CASE("08_paged_batching --experiment throughput --synthetic: a chosen shape, a row per batch, refused elsewhere") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/08_paged_batching";
  const auto r = test::run_command(bin + " --experiment throughput --synthetic 64,2,4,2 --threads 1 --prompt-lengths 8,8 "
                                         "--output-lengths 4,4 --batch-sizes 1,3");
  CAPTURE(r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("model synthetic: dim 64, 2 layers, 4 query heads / 2 KV heads of 16") != std::string::npos);
  CHECK(r.err.find("\n     1 ") != std::string::npos);
  CHECK(r.err.find("\n     3 ") != std::string::npos);
  CHECK(r.err.find("memory floor: the step's bytes at this machine's read bandwidth") != std::string::npos);
  // The probes planned on the host too: 16 MiB of matrices and a buffer of the largest step's bytes (545.5 KiB of
  // weights, 3 sequences' K/V of 5 KiB). Without them a limit of 45 MiB let the run allocate 55 MiB.
  CHECK(r.err.find(" + roofline probes 16.5 MiB = 55.0 MiB") != std::string::npos);
  const auto limited = test::run_command(bin + " --experiment throughput --synthetic 64,2,4,2 --threads 1 --prompt-lengths "
                                               "8,8 --output-lengths 4,4 --batch-sizes 1,3 --memory-limit 45MiB");
  CAPTURE(limited.err);
  CHECK(limited.exit_code == 2);
  CHECK(limited.err.find("this run needs 55.0 MiB") != std::string::npos);
#if defined(KVS_HAVE_CUDA_HARNESS)
  {  // Through the CUDA kernels the floor is the device's copy bandwidth: the host's memory is not the device's.
    const auto device = test::run_command(bin + " --backend cuda-harness --experiment throughput --synthetic 64,2,4,2 "
                                                "--prompt-lengths 4,4 --output-lengths 3,3 --batch-sizes 1");
    CAPTURE(device.err);
    CHECK(device.exit_code == 0);
    CHECK(device.err.find("memory floor: the step's bytes at the device's copy bandwidth") != std::string::npos);
    CHECK(device.err.find(" + roofline probes ") != std::string::npos);  // the copy probe's buffers, planned
    CHECK(device.err.find("its timings are neither GPU nor CPU numbers") != std::string::npos);
  }
#endif
  const std::size_t buffers = r.err.find("working buffers ");
  REQUIRE(buffers != std::string::npos);
  const std::string size = r.err.substr(buffers + 16, r.err.find(" for ", buffers) - buffers - 16);  // e.g. "1.3 MiB"
  CAPTURE(size);
  CHECK((size.find("KiB") != std::string::npos || (size.find("MiB") != std::string::npos && std::stod(size) < 4)));
  for (const std::string other : {"", " --experiment serve", " --experiment memory", " --experiment break"}) {
    CAPTURE(other);
    const auto refused = test::run_command(bin + " --synthetic 64,2,4,2" + other);
    CHECK(refused.exit_code == 2);
    CHECK(std::count(refused.err.begin(), refused.err.end(), '\n') == 1);
    CHECK(refused.err.find("only --experiment throughput") != std::string::npos);
  }
  CHECK(test::run_command(bin + " --experiment throughput --synthetic 64,2,4,2 --model x.bin").exit_code == 2);
}

// A budget under the default --max-batch of 64, which the throughput experiment does not read, used to be refused
// ("--batch-sizes up to 64 exceed --token-budget 32"); a list not starting at 1 printed its first size as "B=1"; a
// batch with no step of every sequence decoding printed a row of zeros (NaN after it).
TEST_CASE("08_paged_batching --experiment throughput: its own batch sizes against the budget, B=1 first, a step to time") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/08_paged_batching --model " + test::golden_path("mha.bin") +
                          " --threads 1 --experiment throughput --token-budget 32";
  const auto r = test::run_command(bin + " --batch-sizes 1,4 --prompt-lengths 8,8 --output-lengths 6,6 --rounds 1");
  CAPTURE(r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("\n     4 ") != std::string::npos);
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {" --batch-sizes 4,1", "start the list with 1"},
           {" --batch-sizes 1,64", "--batch-sizes up to 64 exceed --token-budget 32"},
           {" --batch-sizes 1,4 --prompt-lengths 64,64 --output-lengths 2,2", "no step of batch 4 had all 4 sequences decoding"},
       }) {
    CAPTURE_BINDING(flags);
    const auto bad = test::run_command(bin + flags);
    CAPTURE(bad.err);
    CHECK(bad.exit_code == 2);
    CHECK(bad.err.find(message) != std::string::npos);
    CHECK(bad.err.find("nan") == std::string::npos);
  }
}

// --rounds: every batch size measured in each round, the sizes in turn; the table's p50 is the median of the rounds'
// p50s, their range printed and written beside it (so the median lies within it); refused by the other experiments.
TEST_CASE("08_paged_batching --experiment throughput --rounds: the median of the rounds, their range beside it") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/08_paged_batching";
  test::TempDir dir;
  const auto r = test::run_command(bin + " --experiment throughput --threads 1 --prompt-lengths 8,8 --output-lengths 6,6 "
                                         "--batch-sizes 1,3 --rounds 4 --csv " + dir.file("t.csv"));
  CAPTURE(r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("; 4 rounds over the batch sizes") != std::string::npos);
  const auto rows = test::read_csv(dir.file("t.csv"));
  REQUIRE(rows.size() == 3);
  const std::vector<std::string>& header = rows[0];
  auto column = [&](const std::vector<std::string>& row, const std::string& name) {
    const auto at = std::find(header.begin(), header.end(), name);
    REQUIRE(at != header.end());
    return std::stod(row[std::size_t(at - header.begin())]);
  };
  for (std::size_t i = 1; i < rows.size(); ++i) {
    CAPTURE(i);
    CHECK(column(rows[i], "batch") == (i == 1 ? 1 : 3));
    CHECK(column(rows[i], "rounds") == 4);
    CHECK(column(rows[i], "round_p50_min_ms") <= column(rows[i], "step_ms_p50"));
    CHECK(column(rows[i], "step_ms_p50") <= column(rows[i], "round_p50_max_ms"));
    CHECK(column(rows[i], "step_ms_p50") <= column(rows[i], "step_ms_p99"));
  }
  for (const std::string other : {" --experiment serve --rounds 2", " --experiment memory --rounds 2", " --experiment throughput --rounds 0"}) {
    CAPTURE(other);
    const auto refused = test::run_command(bin + other);
    CHECK(refused.exit_code == 2);
    CHECK(std::count(refused.err.begin(), refused.err.end(), '\n') == 1);
    CHECK(refused.err.find("--rounds") != std::string::npos);
  }
}

TEST_CASE("scheduler: a request that can never fit is refused before anything runs, naming it") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  CpuBackend cpu(1);
  Model model(checkpoint, cpu, 16, 0);
  BlockPool pool(cpu, model.config(), 4, 4, 2, model.config().seq_len);
  std::vector<RequestResult> results;
  const std::vector<Request> fits{Request{encode_bytes("And God"), 4, 0}};
  const std::vector<Request> too_long{Request{encode_bytes("And God"), 4, 0}, Request{encode_bytes("In the beginning"), 4, 0}};
  serve(model, pool, fits, SchedulerOptions{.max_batch = 2, .token_budget = 16}, results);
  CHECK_THROWS_WITH(serve(model, pool, too_long, SchedulerOptions{.max_batch = 2, .token_budget = 16}, results),
                    doctest::Contains("request 1 (16-token prompt, 4 new tokens) needs 20 positions of cache; the pool holds at most 16"));
  CHECK_THROWS_WITH(serve(model, pool, fits, SchedulerOptions{.max_batch = 2, .token_budget = 64}, results),
                    doctest::Contains("calls of 16 tokens"));
  // A pool with fewer block tables than a step may run sequences: refused before the first step, not when a step
  // admits one sequence too many ("every sequence slot of the pool is in use").
  BlockPool one_table(cpu, model.config(), 8, 4, 1, model.config().seq_len);
  const std::vector<Request> two{Request{encode_bytes("And God"), 4, 0}, Request{encode_bytes("And the"), 4, 0}};
  CHECK_THROWS_WITH(serve(model, one_table, two, SchedulerOptions{.max_batch = 2, .token_budget = 16}, results),
                    doctest::Contains("a step may run 2 sequences, and the pool has block tables for 1 at once"));
  CHECK_NOTHROW(serve(model, one_table, two, SchedulerOptions{.max_batch = 1, .token_budget = 16}, results));
}

// A pool an experiment makes later (the memory experiment's max-length row, after five block sizes ran) or a
// request no pool of the run can hold used to stop the experiment midway, after its setup and first rows.
TEST_CASE("08_paged_batching: every pool of the experiment is checked before anything prints, in one line") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/08_paged_batching --model " + test::golden_path("mha.bin") +
                          " --threads 1 --token-budget 32";  // mha.bin: 96 positions, 1 KiB each
  struct Case {
    std::string flags, error;
  };
  for (const Case& c : {Case{" --experiment memory --requests 4 --prompt-lengths 4,8 --output-lengths 2,3 --block-sizes 1,4,16 "
                             "--kv-memory 40KiB",
                             "holds no block of 96 positions"},  // the max-length row, after 1, 4 and 16
                        Case{" --experiment preemption --max-batch 4 --requests 4 --prompt-lengths 40,40 "
                             "--output-lengths 30,30 --block-size 4 --kv-memory 64KiB",
                             "needs 70 positions of cache; the pool holds at most 64"},
                        Case{" --max-batch 4 --requests 4 --prompt-lengths 90,90 --output-lengths 10,10",
                             "past the 96 this model serves"},
                        // its own requests, 16 + 128 positions by default (it printed its probes and headers first)
                        Case{" --experiment throughput --batch-sizes 1,2", "needs 144 positions, past the 96"}}) {
    CAPTURE(c.flags);
    const auto r = test::run_command(bin + c.flags);
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(r.err.find(c.error) != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
}

// The audit runs after a step's preemptions, before its forward pass. Two requests of 44 positions in a pool of 13
// blocks of 4: neither finishes before the pool runs out, so the first block given back is the preempted sequence's,
// with the double free armed after step 0. The audit must throw in the step that preempts, before anything reads or
// writes the block: no step that completed had a preemption. (At the step's start, as before, the preempting step
// ran its forward pass with the block on the free list twice, for two sequences to take, and completed.)
TEST_CASE("scheduler: a block freed twice by a preemption is caught before that step's forward pass") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  CpuBackend cpu(1);
  Model model(checkpoint, cpu, 16, checkpoint.config().seq_len);
  const std::vector<Request> requests{Request{encode_bytes("And God"), 37, 0}, Request{encode_bytes("In the "), 37, 0}};
  BlockPool pool(cpu, model.config(), 13, 4, 2, model.config().seq_len);
  {  // unarmed: it preempts
    std::vector<RequestResult> results;
    CHECK(serve(model, pool, requests, SchedulerOptions{.max_batch = 2, .token_budget = 16}, results).preemptions > 0);
  }
  int completed_steps = 0, completed_preemptions = 0;
  std::vector<RequestResult> results;
  CHECK_THROWS_WITH_AS(serve(model, pool, requests, SchedulerOptions{.max_batch = 2, .token_budget = 16}, results,
                             [&](const RunStats& stats, int, int) {
                               if (stats.steps == 1) pool.break_double_free();
                               completed_steps = stats.steps, completed_preemptions = stats.preemptions;
                             }),
                       doctest::Contains("handed out twice (the free list)"), std::logic_error);
  CHECK(completed_steps > 10);  // it ran until the pool was short (18 steps)
  CHECK(completed_preemptions == 0);
}

// Two requests that finish in the same step leave no step in which to arm the double free: the experiment used to
// print "after step -1", "every one of them is caught" of 0 changed outputs, then "(unexpected)", exit 1.
TEST_CASE("08_paged_batching --experiment break: requests that all finish together are refused, not reported") {
  const auto r = test::run_command(std::string(KVS_BIN_DIR) + "/08_paged_batching --model " + test::golden_path("mha.bin") +
                                   " --threads 1 --token-budget 32 --max-batch 4 --experiment break --requests 2 --prompt-lengths 4,4 "
                                   "--output-lengths 2,2");
  CAPTURE(r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.out.empty());
  CHECK(r.err.find("the double free was never armed") != std::string::npos);
  CHECK(r.err.find("caught") == std::string::npos);
}

TEST_CASE("trace files: requests parsed, a malformed line named with its number") {
  const std::vector<Request> r = parse_trace("# comment\n\n0 5 And God said\n3 2 a\\nb \\\\ c\n", "t.txt");
  REQUIRE(r.size() == 2);
  CHECK(r[0].arrival_step == 0);
  CHECK(r[0].max_new_tokens == 5);
  CHECK(decode_bytes(r[0].prompt) == "And God said");
  CHECK(decode_bytes(r[1].prompt) == "a\nb \\ c");
  CHECK_THROWS_WITH(parse_trace("0 5 ok\nx 5 bad\n", "t.txt"), doctest::Contains("t.txt:2: ARRIVAL_STEP \"x\""));
  CHECK_THROWS_WITH(parse_trace("0 0 zero\n", "t.txt"), doctest::Contains("at least 1"));
  CHECK_THROWS_WITH(parse_trace("0 5\n", "t.txt"), doctest::Contains("the prompt is empty"));
  CHECK_THROWS_WITH(parse_trace("0 5 a\\x\n", "t.txt"), doctest::Contains("backslash"));
  CHECK_THROWS_WITH(parse_trace("# nothing\n", "t.txt"), doctest::Contains("holds no request"));
  try {  // the format it quotes is one line too: an error is one line (the format once carried --help's line breaks)
    parse_trace("# nothing\n", "t.txt");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()).find('\n') == std::string::npos);
  }
  // A file written on Windows: each line's \r is its end, not a byte of the prompt (a blank line stays blank).
  const std::vector<Request> crlf = parse_trace("0 3 And God\r\n\r\n1 2 In the\r\n", "t.txt");
  REQUIRE(crlf.size() == 2);
  CHECK(decode_bytes(crlf[0].prompt) == "And God");
  CHECK(decode_bytes(crlf[1].prompt) == "In the");
  // Drawn arrivals past a trace file's bound, 2^24 steps, are refused (past 2^31 they were undefined: a negative step).
  const std::string text(4096, 'a');
  CHECK_THROWS_WITH(generate_trace(text, TraceShape{.count = 3000, .prompt_min = 4, .prompt_max = 8, .output_min = 1,
                                                    .output_max = 2, .mean_gap = 1e6, .seed = 1}),
                    doctest::Contains("arrivals pass step 16777216"));
}
