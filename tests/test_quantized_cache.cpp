// Chapter 10's coded cache: quantize on write on every backend (CodedRows::encode_group through
// Backend::write_coded_rows), attention over a coded view against the plain reference over the rows decoded
// one by one on the host, and the shipped model through QuantizedKvCache against fp32.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <functional>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "08_paged_batching/paged_kv_cache.h"
#include "08_paged_batching/scheduler.h"
#include "10_quantized_cache/quantized_kv_cache.h"
#include "equivalence.h"
#include "generate.h"
#include "kv_format.h"
#include "model.h"
#include "reference_attention.h"
#include "test_backends.h"
#include "test_util.h"
#include "tokenizer.h"

using namespace kvs;
using namespace kvs::test;

namespace {

constexpr KvFormat kCoded[] = {KvFormat::kFp16, KvFormat::kBf16, KvFormat::kInt8, KvFormat::kInt4};

// The largest error a format's round trip may make on a group whose numbers span [lowest, highest]
// (kv_format.h's stated bounds).
float stated_bound(KvFormat f, float lowest, float highest) {
  const float largest = std::max(std::fabs(lowest), std::fabs(highest));
  switch (f) {
    case KvFormat::kFp32: return 0.0f;
    case KvFormat::kFp16: return largest * 0x1p-11f + 0x1p-25f;  // or half the smallest subnormal
    case KvFormat::kBf16: return largest * 0x1p-8f;
    case KvFormat::kInt8: return largest / 254.0f * 1.0001f;
    case KvFormat::kInt4: return (highest - lowest) / 30.0f * 1.0001f;
  }
  return 0.0f;
}

// The backend's attention for the queries q (n, dim) at positions pos .. pos + n - 1 over `view`, on the host.
std::vector<float> backend_attention(Backend& b, const std::vector<float>& q, int pos, int n, const KvView& view,
                                     const AttentionShape& shape) {
  const Buffer d_q = to_backend(b, q);
  Buffer d_out(b, q.size());
  Buffer scratch(b, b.attention_scratch_floats(shape, view.rows, 1));
  const IntBuffer d_positions = consecutive_positions(b, pos, n);
  b.attention(d_out.data(), d_q.data(), d_positions.data(), n, view, shape, {scratch.data(), scratch.size()}, nullptr);
  return from_backend(b, d_out);
}

// The largest difference between two outputs; infinite where `out` is not finite.
float worst_difference(const std::vector<float>& out, const std::vector<float>& expected) {
  float worst = 0.0f;
  for (std::size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::isfinite(out[i]) ? std::fabs(out[i] - expected[i]) : INFINITY);
  return worst;
}

// How a test view's rows are laid out in the backend.
enum class Layout { kContiguous, kPaged, kRingWithSinks, kRotateAtRead };
const char* to_string(Layout l) {
  switch (l) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kPaged: return "paged";
    case Layout::kRingWithSinks: return "ring with sinks";
    case Layout::kRotateAtRead: return "rotated at read";
  }
  return "?";
}

// Backend attention over a coded view of `rows` rows (positions 0 .. rows-1; a ring's slots shuffled, its first
// slot left empty) against reference_attention over the same rows decoded on the host, for queries at
// pos .. pos + n - 1. Also checks that every stored number is within its format's bound of what was written.
void check_coded_attention(Backend& b, KvFormat format, Layout layout, const AttentionShape& shape, int int4_group,
                           int rows, int pos, int n) {
  CAPTURE(to_string(format));
  CAPTURE(to_string(layout));
  CAPTURE(shape.head_dim);
  CAPTURE(n);
  const int kv_dim = shape.n_kv_heads * shape.head_dim, dim = shape.n_heads * shape.head_dim;
  std::mt19937 gen(rows * 31 + n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Keys with an outlier channel (what this model's keys have, chapter 10 measures), values without.
  std::vector<float> keys(std::size_t(rows) * kv_dim), values(keys.size()), q(std::size_t(n) * dim);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = normal(gen) * (i % kv_dim == 5 ? 12.0f : 1.0f);
    values[i] = normal(gen);
  }
  for (float& x : q) x = normal(gen);

  // Where each position's row goes: itself, a shuffled block table (blocks of 5), or a ring slot.
  const int block_size = 5, blocks = blocks_needed(rows, block_size);
  std::vector<int> table(blocks);
  for (int i = 0; i < blocks; ++i) table[i] = (i * 3 + 1) % blocks;  // a permutation of the 14 blocks of 70 rows
  const int slots = layout == Layout::kRingWithSinks ? rows + 1 : rows;  // slot 0 of the ring stays empty
  std::vector<int> slot_positions(slots, -1), physical(rows);
  for (int p = 0; p < rows; ++p) {
    physical[p] = layout == Layout::kPaged ? table[p / block_size] * block_size + p % block_size
                  : layout == Layout::kRingWithSinks ? (p * 3) % rows + 1 : p;  // 3: coprime with the test's 70 rows
    if (layout == Layout::kRingWithSinks) slot_positions[physical[p]] = p;
  }
  const int stored_rows = layout == Layout::kPaged ? blocks * block_size : slots;

  CodedRows side = coded_rows_layout(format, shape.n_kv_heads, shape.head_dim, int4_group);
  auto allocate = [&](CodedRows rows_of, Buffer& memory) {
    const std::size_t code_floats = (std::size_t(stored_rows) * rows_of.code_bytes() + 3) / 4;
    memory = Buffer(b, code_floats + std::size_t(stored_rows) * rows_of.scales_per_row());
    rows_of.codes = reinterpret_cast<std::uint8_t*>(memory.data());
    rows_of.scales = memory.data() + code_floats;
    return rows_of;
  };
  Buffer key_memory, value_memory;
  const CodedRows key_codes = allocate(side, key_memory), value_codes = allocate(side, value_memory);
  // Unwritten rows hold NaN codes and scales: attention must never read a row nobody wrote.
  for (Buffer* memory : {&key_memory, &value_memory}) {
    const std::vector<float> poison(memory->size(), std::numeric_limits<float>::quiet_NaN());
    b.from_host(memory->data(), poison.data(), poison.size());
  }
  const Buffer d_keys = to_backend(b, keys), d_values = to_backend(b, values);
  IntBuffer d_table(b, table.size()), d_slot_positions(b, slot_positions.size()), d_write(b, rows);
  b.from_host(d_table.data(), table.data(), table.size());
  b.from_host(d_slot_positions.data(), slot_positions.data(), slot_positions.size());
  // Written in two calls (a prefill, then the rest) to cross a call boundary, as a cache does.
  const int first_call = rows / 2;
  for (auto [from, count] : {std::pair{0, first_call}, std::pair{first_call, rows - first_call}}) {
    std::vector<int> targets(count);
    for (int i = 0; i < count; ++i) targets[i] = layout == Layout::kPaged ? from + i : physical[from + i];
    b.from_host(d_write.data(), targets.data(), targets.size());
    for (auto [codes, src] : {std::pair{key_codes, d_keys.data()}, std::pair{value_codes, d_values.data()}}) {
      if (layout == Layout::kPaged)
        b.write_paged_coded_rows(codes, d_write.data(), BlockTable{d_table.data(), block_size}, src + std::size_t(from) * kv_dim, count);
      else
        b.write_coded_rows(codes, d_write.data(), Ring::unbounded(), src + std::size_t(from) * kv_dim, count);
    }
  }
  const Window window = layout == Layout::kRingWithSinks ? Window{rows / 2, 3}
                        : layout == Layout::kRotateAtRead ? Window{rows + 8, 0} : Window{};
  const std::vector<float> rope = layout == Layout::kRotateAtRead ? rope_table(window.size, shape.head_dim) : std::vector<float>{};
  const Buffer d_rope = to_backend(b, rope);
  KvView view{.rows = layout == Layout::kPaged ? rows : stored_rows, .row_stride = kv_dim, .window = window};
  if (layout == Layout::kPaged) view.paged = BlockTable{d_table.data(), block_size};
  if (layout == Layout::kRingWithSinks) view.row_positions = d_slot_positions.data();
  if (layout == Layout::kRotateAtRead) view.read_rope = d_rope.data();
  view.key_codes = key_codes, view.value_codes = value_codes;

  const std::vector<float> out = backend_attention(b, q, pos, n, view, shape);

  // The oracle: the stored rows copied to the host, decoded number by number, as fp32 rows at the same places.
  std::vector<float> host_keys(std::size_t(stored_rows) * kv_dim, NAN), host_values(host_keys.size(), NAN);
  for (auto [memory, codes, decoded, written] : {std::tuple{&key_memory, key_codes, &host_keys, &keys},
                                                 std::tuple{&value_memory, value_codes, &host_values, &values}}) {
    std::vector<float> copy(memory->size());
    b.to_host(copy.data(), memory->data(), copy.size());
    CodedRows host = codes;
    host.codes = reinterpret_cast<std::uint8_t*>(copy.data());
    host.scales = copy.data() + (reinterpret_cast<float*>(codes.scales) - memory->data());
    for (int p = 0; p < rows; ++p)
      for (int g = 0; g < host.groups(); ++g) {
        const float* x = written->data() + std::size_t(p) * kv_dim + g * host.group;
        const auto [lowest, highest] = std::minmax_element(x, x + host.group);
        for (int i = 0; i < host.group; ++i) {
          const int channel = g * host.group + i;
          const float back = host.decode(physical[p], channel);
          (*decoded)[std::size_t(physical[p]) * kv_dim + channel] = back;
          if (!(std::fabs(back - x[i]) <= stated_bound(format, *lowest, *highest))) {
            CAPTURE(p);
            CAPTURE(channel);
            FAIL("a stored number is outside its format's bound: ", x[i], " read back as ", back);
          }
        }
      }
  }
  KvView host_view = view;
  host_view.key_codes = host_view.value_codes = CodedRows{};
  host_view.keys = host_keys.data(), host_view.values = host_values.data();
  if (layout == Layout::kPaged) host_view.paged.blocks = table.data();
  if (layout == Layout::kRingWithSinks) host_view.row_positions = slot_positions.data();
  if (layout == Layout::kRotateAtRead) host_view.read_rope = rope.data();
  std::vector<float> expected(out.size());
  reference_attention(expected.data(), q.data(), pos, n, host_view, shape);
  // Both sum the same decoded numbers in fp32 (the reference in double): 1e-5 covers the order of the sums
  // over at most a hundred rows of weights <= 1 times values of size ~3; a wrong row, head or scale moves the
  // output by ~0.1.
  CHECK(worst_difference(out, expected) <= 1e-5f);
}

// KIVI's per-channel keys (token_group > 0): groups [0, coded_rows / token_group) coded by the backend's
// encode_channel_groups, rows from coded_rows on read as floats from open_rows; values int4 per token (groups of 8).
// Backend attention against reference_attention over the rows decoded on the host, each stored key checked against
// its channel's bound over its token group first.
void check_channel_keys_attention(Backend& b, const AttentionShape& shape, int token_group, int coded_rows, int rows,
                                  int pos, int n) {
  CAPTURE(shape.head_dim);
  CAPTURE(token_group);
  CAPTURE(coded_rows);
  CAPTURE(n);
  const int kv_dim = shape.n_kv_heads * shape.head_dim, dim = shape.n_heads * shape.head_dim;
  std::mt19937 gen(rows * 17 + n + token_group);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> keys(std::size_t(rows) * kv_dim), values(keys.size()), q(std::size_t(n) * dim);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = normal(gen) * (i % kv_dim == 5 ? 12.0f : 1.0f) + (i % kv_dim == 7 ? -20.0f : 0.0f);  // an outlier, a shifted channel
    values[i] = normal(gen);
  }
  for (float& x : q) x = normal(gen);
  CodedRows key_side = coded_rows_layout(KvFormat::kInt4, shape.n_kv_heads, shape.head_dim, 8),
            value_side = key_side;
  key_side.token_group = token_group;
  Buffer key_memory(b, std::size_t(rows) * key_side.code_bytes() / 4 + key_side.scale_floats(rows)),
      value_memory(b, std::size_t(rows) * value_side.code_bytes() / 4 + value_side.scale_floats(rows));
  for (Buffer* memory : {&key_memory, &value_memory}) {  // unwritten codes and scales are NaN: never read
    const std::vector<float> poison(memory->size(), std::numeric_limits<float>::quiet_NaN());
    b.from_host(memory->data(), poison.data(), poison.size());
  }
  key_side.codes = reinterpret_cast<std::uint8_t*>(key_memory.data());
  key_side.scales = key_memory.data() + std::size_t(rows) * key_side.code_bytes() / 4;
  value_side.codes = reinterpret_cast<std::uint8_t*>(value_memory.data());
  value_side.scales = value_memory.data() + std::size_t(rows) * value_side.code_bytes() / 4;
  const Buffer d_keys = to_backend(b, keys), d_values = to_backend(b, values);
  b.encode_channel_groups(key_side, 0, coded_rows / token_group, d_keys.data());
  const Buffer d_open = to_backend(b, std::vector<float>(keys.begin() + std::ptrdiff_t(coded_rows) * kv_dim, keys.end()));
  key_side.coded_rows = coded_rows, key_side.open_rows = d_open.data();
  const IntBuffer all_rows = consecutive_positions(b, 0, rows);
  b.write_coded_rows(value_side, all_rows.data(), Ring::unbounded(), d_values.data(), rows);
  const KvView view{.rows = rows, .row_stride = kv_dim, .key_codes = key_side, .value_codes = value_side};

  const std::vector<float> out = backend_attention(b, q, pos, n, view, shape);

  // The oracle: the stored keys and values on the host, decoded number by number.
  std::vector<float> key_copy(key_memory.size()), value_copy(value_memory.size());
  b.to_host(key_copy.data(), key_memory.data(), key_copy.size());
  b.to_host(value_copy.data(), value_memory.data(), value_copy.size());
  CodedRows host_keys = key_side, host_values = value_side;
  host_keys.codes = reinterpret_cast<std::uint8_t*>(key_copy.data()), host_keys.scales = key_copy.data() + (key_side.scales - key_memory.data());
  host_keys.open_rows = keys.data() + std::size_t(coded_rows) * kv_dim;
  host_values.codes = reinterpret_cast<std::uint8_t*>(value_copy.data()), host_values.scales = value_copy.data() + (value_side.scales - value_memory.data());
  std::vector<float> decoded_keys(keys.size()), decoded_values(values.size()), run(kv_dim), odd_run(kv_dim);
  for (int r = 0; r < rows; ++r) {
    host_keys.decode_run(r, 0, kv_dim, run.data());
    host_keys.decode_run(r, 1, kv_dim - 1, odd_run.data() + 1);  // from an odd channel: the high nibble first
    for (int ch = 0; ch < kv_dim; ++ch) {
      const float x = keys[std::size_t(r) * kv_dim + ch], back = host_keys.decode(r, ch);
      REQUIRE(run[ch] == back);  // decode_run reads what decode reads
      if (ch > 0) REQUIRE(odd_run[ch] == back);
      float lowest = x, highest = x;  // the channel over its token group
      for (int i = r / token_group * token_group; i < (r / token_group + 1) * token_group && i < rows; ++i)
        lowest = std::min(lowest, keys[std::size_t(i) * kv_dim + ch]), highest = std::max(highest, keys[std::size_t(i) * kv_dim + ch]);
      const float bound = r < coded_rows ? (highest - lowest) / 30.0f * 1.0001f : 0.0f;  // open rows: exact
      if (!(std::fabs(back - x) <= bound)) {
        CAPTURE(r);
        CAPTURE(ch);
        FAIL("a stored key is outside its channel's bound: ", x, " read back as ", back);
      }
      decoded_keys[std::size_t(r) * kv_dim + ch] = back;
      decoded_values[std::size_t(r) * kv_dim + ch] = host_values.decode(r, ch);
    }
  }
  const KvView host_view{.keys = decoded_keys.data(), .values = decoded_values.data(), .rows = rows, .row_stride = kv_dim};
  std::vector<float> expected(out.size());
  reference_attention(expected.data(), q.data(), pos, n, host_view, shape);
  CHECK(worst_difference(out, expected) <= 1e-5f);  // 1e-5: as check_coded_attention
}

}  // namespace

// Named "cuda kernels ..." so that CTest's random-thread-order run of the harness repeats it (tests/CMakeLists.txt).
TEST_CASE("cuda kernels and the CPU: attention over a coded view equals the reference over the decoded rows") {
  for_each_backend(test_backend_names(), [](Backend& b) {
    for (KvFormat format : kCoded)
      for (Layout layout : {Layout::kContiguous, Layout::kPaged, Layout::kRingWithSinks, Layout::kRotateAtRead})
        // head_dim 32: the CPU's packet sweeps for a decode step; 24: its general path; int4 groups of 8 cross
        // each head 3 or 4 times. 70 rows: past two of the CPU's 32-row decoded tiles and its 8-row unroll.
        for (int head_dim : {32, 24}) {
          const AttentionShape shape{4, 2, head_dim};
          check_coded_attention(b, format, layout, shape, 8, 70, 69, 1);    // a decode step
          check_coded_attention(b, format, layout, shape, 8, 70, 30, 40);   // prefill: the GPU's keys in 2 tiles of 64
          if (layout == Layout::kContiguous) check_coded_attention(b, format, layout, shape, head_dim, 70, 69, 1);  // int4 group = head
        }
    // KIVI's per-channel keys: groups of 16 (three coded, 22 open rows) and of 8 (eight coded, 6 open).
    for (int head_dim : {32, 24})
      for (auto [token_group, coded_rows] : {std::pair{16, 48}, std::pair{8, 64}}) {
        const AttentionShape shape{4, 2, head_dim};
        check_channel_keys_attention(b, shape, token_group, coded_rows, 70, 69, 1);
        check_channel_keys_attention(b, shape, token_group, coded_rows, 70, 30, 40);
      }
  });
}

TEST_CASE("chapter 10: QuantizedKvCache allocates exactly the formula's bytes, scales included, and refuses what it cannot store") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const ModelConfig& c = checkpoint.config();
  CpuBackend cpu(1);
  for (KvFormat format : {KvFormat::kFp32, KvFormat::kFp16, KvFormat::kBf16, KvFormat::kInt8, KvFormat::kInt4})
    for (int group : {8, 32}) {
      CAPTURE(to_string(format));
      CAPTURE(group);
      ch10::QuantizedKvCache cache(cpu, c, 100, format, group);
      CHECK(cache.allocated_bytes() == kv_bytes_per_position(format, c.n_kv_heads, c.head_dim(), group) * c.n_layers * 100);
      CHECK(cache.allocated_bytes() == ch10::QuantizedKvCache::bytes(c, 100, format, group));
    }
  // The shipped model's 2 KV heads of 32: int4 with groups of 32 is 32 code bytes and 2 groups' scale and minimum
  // (16 bytes) per row of 64 numbers, twice (K and V), 5 layers.
  CHECK(ch10::QuantizedKvCache(cpu, c, 1, KvFormat::kInt4, 32).allocated_bytes() == 5 * 2 * (32 + 16));
  CHECK_THROWS_AS(ch10::QuantizedKvCache(cpu, c, 10, KvFormat::kInt4, 12), std::invalid_argument);
  ch10::QuantizedKvCache coded(cpu, c, 10, KvFormat::kInt8, 32);
  coded.prepare(0, 4);
  CHECK_THROWS_AS(coded.row(0, 2), std::out_of_range);  // its rows are codes, not floats to overwrite
}

// What the chapter claims: a 16-bit cache leaves this model's greedy text unchanged, int8 nearly; int4 does not.
TEST_CASE("chapter 10: fp16 and bf16 caches keep fp32's greedy tokens on three prompts, int8 all but at a near-tie, int4's divergence reported") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  CpuBackend cpu(test_threads());
  const int new_tokens = sanitizer_run() ? 40 : 120;  // under the sanitizers the same checks over a shorter text
  for (const char* text : {"And God said, Let there be light: and there was light. And God saw the light, ",
                           "In the beginning was the Word, and the Word was with God, ",
                           "Blessed are the poor in spirit: for theirs is the kingdom of heaven. "}) {
    const std::string prompt_text = text;  // (a captured char* prints as its address)
    CAPTURE(prompt_text);
    const std::vector<int> prompt = encode_bytes(text);
    const int positions = static_cast<int>(prompt.size()) + new_tokens;
    Model model(checkpoint, cpu, positions, positions);
    auto run = [&](KvFormat format) {
      return record([&](const OnLogits& on_logits) {
        ch10::QuantizedKvCache cache(cpu, checkpoint.config(), positions, format, 32);
        Sampler greedy(256, {});
        return generate_cached(model, cache, greedy, prompt, new_tokens, 0, {}, on_logits);
      });
    };
    const RecordedRun fp32 = run(KvFormat::kFp32);
    // Compared over every step, not up to the first near-tie as check_equivalence does: the claim is that the
    // text stays the same. First step whose token differs (-1: none), and the largest logit difference before it.
    auto compare = [&](const RecordedRun& other) {
      int first_mismatch = -1;
      float worst = 0.0f;
      for (int step = 0; step < new_tokens && first_mismatch < 0; ++step) {
        worst = worst_difference(worst, max_abs_difference(fp32.logits[step], other.logits[step]));
        if (other.tokens[prompt.size() + step] != fp32.tokens[prompt.size() + step]) first_mismatch = step;
      }
      return std::pair{first_mismatch, worst};
    };
    // The logit tolerance per format: the worst measured on these prompts (0.008 fp16, 0.047 bf16, 0.13 int8 on
    // logits of magnitude ~10: the formats' relative errors, 2^-11, 2^-8 and ~1/254 of a head's largest number,
    // carried through 5 layers) times three; int4's rounding moves them by 0.6-1.3, and so would a wrong scale.
    const std::pair<KvFormat, float> kept[] = {{KvFormat::kFp16, 0.025f}, {KvFormat::kBf16, 0.15f}, {KvFormat::kInt8, 0.4f}};
    for (auto [format, tolerance] : kept) {
      const std::string format_name = to_string(format);
      CAPTURE(format_name);
      const auto [first_mismatch, worst] = compare(run(format));
      MESSAGE(format_name << ": first token that differs: " << first_mismatch << " (-1: none in " << new_tokens
                                             << "), worst logit difference up to it " << worst);
      CHECK(worst <= tolerance);
      if (first_mismatch < 0) continue;
      // fp16 and bf16 keep every token. int8 may pick the other of two tokens whose fp32 logits are closer than
      // twice the largest difference it made (each of the two moved by at most that): a near-tie, measured at the
      // third prompt's step 8 (gap 0.014, against differences up to 0.13). A wider gap is a real change.
      std::vector<float> top = fp32.logits[first_mismatch];
      std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<>());
      MESSAGE("fp32's two best logits at that step differ by " << top[0] - top[1]);
      CHECK(format == KvFormat::kInt8);
      CHECK(top[0] - top[1] <= 2 * worst);
    }
    const auto [int4_mismatch, int4_worst] = compare(run(KvFormat::kInt4));
    MESSAGE("int4, groups of 32: first token that differs from fp32's: "
            << (int4_mismatch < 0 ? std::string("none") : "step " + std::to_string(int4_mismatch))
            << ", worst logit difference up to it " << int4_worst);
    // int4 does move the logits, well past what the 16-bit formats may (bf16's tolerance, 0.15): an int4 path that
    // stored floats (fp32, fp16 or bf16) would stay below it.
    CHECK(int4_worst > 0.15f);
  }
}

// Chapter 08's pool storing chapter 10's formats: each row is coded on its own, so a paged sequence stores the
// very numbers QuantizedKvCache stores, given the same k and v. Its logits differ only by float summation order
// (the CPU sums a paged view a block at a time): ~1e-5 in fp32, but a later layer's k or v that lands on the other
// side of a rounding boundary is stored one code apart, which moves the logits by up to 1.3e-3 (measured: fp16
// 6e-4, int8 1.3e-3, int4 1.3e-5; the CUDA kernels sum alike, 0). Tolerance 1e-2: eight times that, and far
// below what a wrong block or row does (O(1)).
TEST_CASE("chapter 10 in chapter 08's pool: a coded paged sequence gives QuantizedKvCache's logits, the scheduler its tokens alone") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const ModelConfig& c = checkpoint.config();
  const std::string text = validation_text();
  const std::vector<int> tokens = encode_bytes(text.substr(300, 45)), other = encode_bytes(text.substr(4000, 30));
  for_each_backend(test_backend_names(), [&](Backend& backend) {
    Model model(checkpoint, backend, 64, 128);
    for (KvFormat format : {KvFormat::kFp32, KvFormat::kFp16, KvFormat::kInt8, KvFormat::kInt4}) {
      CAPTURE(std::string(to_string(format)));
      ch08::BlockPool pool(backend, c, 14, 5, 2, 100, ch08::PoolFormat{format, 16});
      CHECK(pool.allocated_bytes() == kv_bytes_per_position(format, c.n_kv_heads, c.head_dim(), 16) * c.n_layers * 14 * 5);
      CHECK(pool.bytes_per_position() == kv_bytes_per_position(format, c.n_kv_heads, c.head_dim(), 16) * c.n_layers);
      ch08::PagedSequence paged(pool), neighbour(pool);
      ch10::QuantizedKvCache contiguous(backend, c, 100, format, 16);
      float worst = 0;
      auto compare = [&](std::span<const float> a, std::span<const float> b) {
        worst = worst_difference(worst, max_abs_difference(a, b));
      };
      auto logits = [&](KvCache& cache, int first, int n) {
        const std::span<const float> got = model.forward(std::span(tokens).subspan(first, n), first, &cache, Logits::kAllPositions);
        return std::vector<float>(got.begin(), got.end());
      };
      // Prefill in two calls with the neighbour's blocks taken in between, so the sequence's blocks are not in
      // order; then decode steps.
      compare(logits(paged, 0, 12), logits(contiguous, 0, 12));
      // The first layer's k and v do not depend on attention yet: the pool stores exactly the contiguous cache's numbers.
      if (readable_in_place(backend))
        for (int p = 0; p < 12; ++p)
          for (int ch = 0; ch < c.kv_dim(); ++ch) {
            CHECK(paged.view(0).key(p, ch) == contiguous.view(0).key(p, ch));
            CHECK(paged.view(0).value(p, ch) == contiguous.view(0).value(p, ch));
          }
      model.forward(std::span(other).first(15), 0, &neighbour);
      compare(logits(paged, 12, 30), logits(contiguous, 12, 30));
      for (int pos = 42; pos < 45; ++pos) compare(logits(paged, pos, 1), logits(contiguous, pos, 1));
      MESSAGE(to_string(format) << ": largest logit difference, paged pool vs contiguous cache: " << worst);
      CHECK(worst < 1e-2f);
      CHECK(paged.blocks() == std::vector<int>{0, 1, 2, 6, 7, 8, 9, 10, 11});  // the neighbour holds 3, 4 and 5
      if (format != KvFormat::kFp32) CHECK_THROWS_WITH(paged.row(0, 3), doctest::Contains("codes, not floats"));
      // copy_block (chapter 09's copy-on-write) copies the codes and the scales: the copy reads back the same rows.
      if (readable_in_place(backend)) {
        const int from = paged.blocks()[1], to = pool.take_block();
        pool.copy_block(to, from);
        for (int layer : {0, c.n_layers - 1})
          for (int kv : {0, 1}) {
            const CodedRows side = pool.side(layer, kv);
            for (int r = 0; r < 5; ++r)
              for (int ch = 0; ch < c.kv_dim(); ++ch)
                CHECK(side.decode(std::size_t(to) * 5 + r, ch) == side.decode(std::size_t(from) * 5 + r, ch));
          }
        pool.give_back_block(to);
      }
    }
  });
  // The scheduler over an int4 pool just big enough to preempt: every request's tokens equal it alone in a pool of
  // its own of the same format. Exactly, for these requests (measured): a batched product may round a number onto
  // the other side of an int4 boundary and part an output at a near-tie (08_paged_batching's serve allows that and
  // checks the tie); none of these requests does, so a parting here is a change to look at.
  CpuBackend cpu(test_threads());
  Model model(checkpoint, cpu, 64, c.seq_len);
  std::vector<ch08::Request> requests;
  for (int i = 0; i < 9; ++i)  // chapter 08's scheduler test's requests, in blocks of 4
    requests.push_back(ch08::Request{encode_bytes(text.substr(1000 + 977 * i, 4 * (2 + i % 3) + i % 3)), 6 + 5 * (i % 4), 3 * i});
  const ch08::PoolFormat int4{KvFormat::kInt4, 32};
  int longest = 0;
  for (const ch08::Request& r : requests) longest = std::max(longest, int(r.prompt.size()) + r.max_new_tokens);
  ch08::BlockPool pool(cpu, c, blocks_needed(longest, 4) + 2, 4, 9, c.seq_len, int4);
  std::vector<ch08::RequestResult> results;
  const ch08::RunStats stats = ch08::serve(model, pool, requests, ch08::SchedulerOptions{.max_batch = 9, .token_budget = 32}, results);
  CHECK(stats.preemptions > 0);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    CAPTURE(i);
    CHECK(results[i].output == ch08::serve_alone(model, requests[i], int4, 4));
  }
  CHECK(pool.free_blocks() == pool.blocks());
  CHECK_THROWS_WITH(ch08::BlockPool(cpu, c, 4, 4, 1, 16, ch08::PoolFormat{KvFormat::kInt4, 12}), doctest::Contains("must be even and divide"));
}

// KIVI's per-channel keys in QuantizedKvCache, on the shipped model, and its control (per-token int4 keys with the
// same fp32 open group): the first layer's keys do not depend on attention, so a cache in fp32 beside it holds the
// very floats the model handed the int4 cache. Every group coded must be exactly those floats coded on the host
// (CodedRows::encode_channel_pair, or encode_group row by row), the open group's keys exactly the floats; the
// values per token as int4's. A prefill that completes groups, decode steps that complete more, a step into a new
// group, rewinds inside the open group and to a group's start, a second prefill starting inside the open group.
TEST_CASE("chapter 10: KIVI's per-channel keys and its per-token control - each group coded from the model's keys once complete, the open group read as floats") {
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const ModelConfig& c = checkpoint.config();
  const std::vector<int> tokens = encode_bytes(validation_text().substr(700, 70));
  for_each_backend(test_backend_names(), [&](Backend& backend) {
    if (!readable_in_place(backend)) return;  // the check reads the cache's memory in place: not on a GPU
    Model model(checkpoint, backend, 64, 128);
    constexpr int kGroup = 16;
    constexpr int kPositions = 7 * kGroup;  // whole groups: a partial last group's scales would round the bytes up
    for (ch10::Keys keys : {ch10::Keys::kPerChannel, ch10::Keys::kPerTokenOpen}) {
      const std::string keys_name = keys == ch10::Keys::kPerChannel ? "per channel" : "per token, open group";
      CAPTURE(keys_name);  // a std::string: doctest prints a const char* as its address
      ch10::QuantizedKvCache open(backend, c, kPositions, KvFormat::kInt4, kGroup, keys),
          fp32(backend, c, kPositions, KvFormat::kFp32, kGroup);
      CHECK_FALSE(open.replayable());
      // Codes and scales as int4's, the open group's floats for a decode step, and the control's positions (an int
      // each). A call of more keys than the group (a prefill) holds them in a buffer of its own until the next call
      // that fits the group: `holding` rows of floats a layer.
      const std::int64_t between_calls = ch10::QuantizedKvCache::bytes(c, kPositions, KvFormat::kInt4, kGroup, keys);
      CHECK(open.allocated_bytes() == between_calls);
      CHECK(between_calls == kv_bytes_per_position(KvFormat::kInt4, c.n_kv_heads, c.head_dim(), kGroup) * c.n_layers * kPositions +
                                 std::int64_t{4} * kGroup * c.kv_dim() * c.n_layers +
                                 (keys == ch10::Keys::kPerTokenOpen ? std::int64_t{4} * kPositions : 0));
      auto check_held = [&](int holding) {
        CAPTURE(holding);
        CHECK(open.allocated_bytes() == between_calls + std::int64_t{4} * holding * c.kv_dim() * c.n_layers);
      };
      auto step = [&](int pos, int n) {
        model.forward(std::span(tokens).subspan(pos, n), pos, &open);
        model.forward(std::span(tokens).subspan(pos, n), pos, &fp32);
      };
      // After a call over [call_pos, length): attention read the groups before call_pos's as codes, the rest as
      // floats; every group complete by `length` is stored coded.
      auto check_layer0 = [&](int call_pos, int length) {
        const KvView got = open.view(0), floats = fp32.view(0);
        const int coded = got.key_codes.coded_rows;
        CAPTURE(length);
        CHECK(coded == call_pos / kGroup * kGroup);
        // The expected codes: the fp32 cache's keys of each complete group, coded on the host.
        CodedRows expected = got.key_codes, stored = got.key_codes;
        std::vector<std::uint8_t> codes(std::size_t(kPositions) * expected.code_bytes());
        std::vector<float> scales(std::size_t(expected.scale_floats(kPositions)));
        expected.codes = codes.data(), expected.scales = scales.data();
        expected.open_rows = stored.open_rows = nullptr;  // read every row as stored codes
        const int complete = length / kGroup * kGroup;
        for (int t = 0; t < complete / kGroup && keys == ch10::Keys::kPerChannel; ++t)
          for (int ch = 0; ch < c.kv_dim(); ch += 2) expected.encode_channel_pair(t, ch, floats.keys + std::size_t(t) * kGroup * c.kv_dim());
        for (int r = 0; r < complete && keys == ch10::Keys::kPerTokenOpen; ++r)
          for (int g = 0; g < expected.groups(); ++g) expected.encode_group(r, g, floats.keys + std::size_t(r) * c.kv_dim() + g * expected.group);
        for (int r = 0; r < complete; ++r)
          for (int ch = 0; ch < c.kv_dim(); ++ch) REQUIRE(stored.decode(r, ch) == expected.decode(r, ch));
        int wrong = 0;
        CodedRows per_token = got.value_codes;
        std::vector<std::uint8_t> value_codes(per_token.code_bytes());
        std::vector<float> value_scales(per_token.scales_per_row());
        per_token.codes = value_codes.data(), per_token.scales = value_scales.data();
        for (int r = 0; r < length; ++r) {
          for (int g = 0; g < per_token.groups(); ++g) per_token.encode_group(0, g, floats.values + std::size_t(r) * c.kv_dim() + g * per_token.group);
          for (int ch = 0; ch < c.kv_dim(); ++ch) {
            wrong += got.key(r, ch) != (r < coded ? expected.decode(r, ch) : floats.key(r, ch));
            wrong += got.value(r, ch) != per_token.decode(0, ch);
          }
        }
        CHECK(wrong == 0);
      };
      // Rows [first, first + rows) of every layer's open keys, in the buffer they are in now. Layer 0 starts both
      // buffers, so only the other layers show a move between them with a wrong layer stride.
      auto open_rows = [&](int first, int rows) {
        std::vector<float> all;
        for (int layer = 0; layer < c.n_layers; ++layer) {
          const float* rows_of_layer = open.view(layer).key_codes.open_rows;
          all.insert(all.end(), rows_of_layer + std::size_t(first) * c.kv_dim(), rows_of_layer + std::size_t(first + rows) * c.kv_dim());
        }
        return all;
      };
      step(0, 37);  // a prefill: read as floats; groups 0 and 1 stored coded, 32..36 open
      check_layer0(0, 37);
      check_held(37);
      const std::vector<float> prefill_open = open_rows(32, 5);
      step(37, 1);  // the prefill's open rows move to the open group's buffer: positions 32..36 now its rows 0..4
      CHECK(open_rows(0, 5) == prefill_open);
      for (int pos = 38; pos < 64; ++pos) step(pos, 1);  // decode steps: group 2 completes at 47, group 3 at 63
      check_layer0(63, 64);
      check_held(0);  // the prefill's buffer given back at the first step
      step(64, 1);  // the first step of a new group: group 3 now read coded
      check_layer0(64, 65);
      step(64, 1);  // again: a rewind inside the open group (the speed experiment's repeated step)
      check_layer0(64, 65);
      step(48, 1);  // a rewind to a coded group's start: from there on floats again
      check_layer0(48, 49);
      // Rewinding into a coded group is refused (its floats are gone).
      CHECK_THROWS_WITH(open.prepare(40, 1), doctest::Contains("already coded"));
      open.clear(), fp32.clear();
      step(0, 20);
      check_held(20);
      const std::vector<float> first_call_open = open_rows(16, 4);
      step(20, 30);  // a second prefill call that starts inside the open group and completes two more
      check_layer0(20, 50);
      check_held(4 + 30);  // a larger buffer: the open group's 4 keys so far, and the call's
      CHECK(open_rows(0, 4) == first_call_open);  // positions 16..19, moved with it
      step(50, 1);
      check_layer0(50, 51);
      check_held(0);
      step(51, 8);  // a call that fits the open group (48..58 of 48..63) uses its buffer
      check_layer0(51, 59);
      check_held(0);
    }
  });
  CpuBackend cpu(1);
  CHECK_THROWS_WITH(ch10::QuantizedKvCache(cpu, c, 10, KvFormat::kInt8, 32, ch10::Keys::kPerChannel), doctest::Contains("int4's options"));
  CHECK_THROWS_WITH(ch10::QuantizedKvCache(cpu, c, 10, KvFormat::kInt4, 512, ch10::Keys::kPerTokenOpen), doctest::Contains("must be even"));
}
