// The cache formats of chapter 10 (common/kv_format.h): each round trip within its stated bound, on rows with an
// outlier, zeros, negative numbers only, and NaN or infinity handled as documented; the bytes a position costs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "10_quantized_cache/channels.h"
#include "kv_format.h"
#include "test_util.h"

using namespace kvs;

namespace {

// Rows a cache meets, and the ones it must survive.
std::vector<std::vector<float>> test_rows(int n) {
  std::mt19937 gen(20261123);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> rows;
  std::vector<float> row(n);
  for (float& x : row) x = normal(gen);
  rows.push_back(row);                                   // typical
  row[n / 3] = 80.0f;
  rows.push_back(row);                                   // one outlier channel
  rows.push_back(std::vector<float>(n, 0.0f));           // zeros
  for (float& x : row) x = -std::fabs(normal(gen)) - 0.5f;
  rows.push_back(row);                                   // negative numbers only
  rows.push_back(std::vector<float>(n, 3.25f));          // one value repeated
  for (int i = 0; i < n; ++i) row[i] = std::ldexp(1.0f + i / float(n), i % 20 - 10);
  rows.push_back(row);                                   // magnitudes from 2^-10 to 2^10
  return rows;
}

}  // namespace

TEST_CASE("kv formats: fp16 rounds to nearest even within 2^-11, keeps infinities and NaN, flushes what is too small") {
  for (const auto& row : test_rows(64))
    for (float x : row) {
      CAPTURE(x);
      const float back = from_fp16(to_fp16(x));
      CHECK(std::fabs(back - x) <= std::fabs(x) * 0x1p-11f + 0x1p-25f);  // relative, or half the smallest subnormal
    }
  CHECK(from_fp16(to_fp16(65504.0f)) == 65504.0f);  // the largest finite fp16
  CHECK(std::isinf(from_fp16(to_fp16(65520.0f))));   // rounds up past it
  CHECK(std::isinf(from_fp16(to_fp16(1e9f))));
  CHECK(from_fp16(to_fp16(-std::numeric_limits<float>::infinity())) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(from_fp16(to_fp16(std::nanf("")))));
  CHECK(from_fp16(to_fp16(0x1p-24f)) == 0x1p-24f);   // the smallest subnormal, exact
  CHECK(from_fp16(to_fp16(0x1p-25f)) == 0.0f);       // half of it: a tie, to even (0)
  CHECK(from_fp16(to_fp16(0x1.8p-25f)) == 0x1p-24f); // above half: up
  CHECK(from_fp16(to_fp16(1.0f + 0x1p-11f)) == 1.0f);                // a tie between 1 and 1 + 2^-10: to even
  CHECK(from_fp16(to_fp16(1.0f + 0x3p-11f)) == 1.0f + 0x1p-9f);      // a tie the other way: to even
  CHECK(std::signbit(from_fp16(to_fp16(-0.0f))));
  for (std::uint32_t h = 0; h < 0x7c00u; ++h)  // every finite fp16 reads back and converts to itself
    CHECK_MESSAGE(to_fp16(from_fp16(std::uint16_t(h))) == h, "fp16 bits ", h);
}

TEST_CASE("kv formats: bf16 rounds to nearest even within 2^-8, keeps float's range, infinities and NaN") {
  for (const auto& row : test_rows(64))
    for (float x : row) CHECK(std::fabs(from_bf16(to_bf16(x)) - x) <= std::fabs(x) * 0x1p-8f);
  CHECK(from_bf16(to_bf16(1e30f)) == doctest::Approx(1e30f).epsilon(0x1p-8));
  CHECK(from_bf16(to_bf16(1.0f + 0x1p-8f)) == 1.0f);            // a tie: to even
  CHECK(from_bf16(to_bf16(1.0f + 0x3p-8f)) == 1.0f + 0x1p-6f);  // a tie: to even, upward
  CHECK(std::isinf(from_bf16(to_bf16(std::numeric_limits<float>::infinity()))));
  CHECK(std::isnan(from_bf16(to_bf16(std::nanf("")))));
}

TEST_CASE("kv formats: int8 with a scale a head, within max|x| / 254, zeros exact, NaN or infinity read back as NaN") {
  for (int n : {1, 31, 32, 64}) {
    for (const auto& row : test_rows(n)) {
      std::vector<std::int8_t> q(n);
      const float scale = quantize_int8(row.data(), n, q.data());
      float largest = 0;
      for (float x : row) largest = std::max(largest, std::fabs(x));
      CHECK(scale == doctest::Approx(largest / 127.0f));
      for (int i = 0; i < n; ++i) {
        CAPTURE(i);
        CHECK(std::fabs(dequantize_int8(q[i], scale) - row[i]) <= largest / 254.0f * (1 + 1e-6f));
        CHECK(std::abs(int(q[i])) <= 127);
      }
      if (largest == 0) CHECK(scale == 0.0f);
    }
  }
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    std::vector<float> row(32, 1.0f);
    row[7] = bad;
    std::vector<std::int8_t> q(32);
    const float scale = quantize_int8(row.data(), 32, q.data());
    for (int i = 0; i < 32; ++i) CHECK(std::isnan(dequantize_int8(q[i], scale)));
  }
}

TEST_CASE("kv formats: int4 with a scale and a minimum a group, within (max - min) / 30, an outlier costs only its group") {
  for (int group : {2, 8, 16, 32}) {
    CAPTURE(group);
    for (const auto& row : test_rows(64)) {
      std::vector<std::uint8_t> packed(32);
      for (int start = 0; start < 64; start += group) {  // the groups of a row, one after another
        const Int4Group g = quantize_int4(row.data() + start, group, packed.data() + start / 2);
        float lowest = row[start], highest = row[start];
        for (int i = start; i < start + group; ++i) lowest = std::min(lowest, row[i]), highest = std::max(highest, row[i]);
        for (int i = 0; i < group; ++i) {
          CAPTURE(start + i);
          const float back = dequantize_int4(packed.data() + start / 2, i, g);
          CHECK(std::fabs(back - row[start + i]) <= (highest - lowest) / 30.0f * (1 + 1e-5f) + 1e-6f);
        }
      }
    }
  }
  // The point of groups: an outlier in one group leaves the others' error where it was - through a row's
  // layout (codes and scales, encode_group and decode), where a scale read from the wrong group would show.
  std::vector<float> row = test_rows(64)[0], spiked = row;
  spiked[3] = 80.0f;
  const auto decoded = [](const std::vector<float>& x) {
    std::vector<std::uint8_t> codes(32);
    std::vector<float> scales(16), back(64);
    const CodedRows rows{.format = KvFormat::kInt4, .codes = codes.data(), .scales = scales.data(), .width = 64, .group = 8};
    for (int g = 0; g < rows.groups(); ++g) rows.encode_group(0, g, x.data() + g * 8);
    for (int i = 0; i < 64; ++i) back[i] = rows.decode(0, i);
    return back;
  };
  const std::vector<float> plain = decoded(row), outlier = decoded(spiked);
  for (int i = 8; i < 64; ++i) CHECK(outlier[i] == plain[i]);  // the other 7 groups: the same numbers back
  float plain_error = 0, outlier_error = 0;                      // the outlier's own group: coarser
  for (int i = 0; i < 8; ++i)
    if (i != 3)
      plain_error = std::max(plain_error, std::fabs(plain[i] - row[i])),
      outlier_error = std::max(outlier_error, std::fabs(outlier[i] - row[i]));
  CHECK(outlier_error > 4 * plain_error);
  for (float bad : {std::nanf(""), -std::numeric_limits<float>::infinity()}) {
    std::vector<float> bad_row(8, 1.0f);
    bad_row[5] = bad;
    std::vector<std::uint8_t> packed(4);
    const Int4Group g = quantize_int4(bad_row.data(), 8, packed.data());
    for (int i = 0; i < 8; ++i) CHECK(std::isnan(dequantize_int4(packed.data(), i, g)));
  }
  // Finite numbers whose range is past float's largest: no finite scale, and min + q · s overflows on the way
  // back unless the compiler fuses it into one multiply-add (it does with -march=native, not without): NaN on every
  // build, as for a NaN or an infinity. (An infinite scale had read them back as NaN with the fused multiply-add
  // too, but by accident; dividing before subtracting gave finite numbers only where fused.)
  const std::vector<float> wide{-3e38f, 0.0f, 1.0f, 3e38f};
  std::vector<std::uint8_t> wide_packed(2);
  const Int4Group wide_group = quantize_int4(wide.data(), 4, wide_packed.data());
  CHECK(std::isnan(wide_group.scale));
  for (int i = 0; i < 4; ++i) CHECK(std::isnan(dequantize_int4(wide_packed.data(), i, wide_group)));
  const std::vector<float> high{1e38f, 3e38f};  // a range within float's: coded as usual
  const Int4Group high_group = quantize_int4(high.data(), 2, wide_packed.data());
  CHECK(dequantize_int4(wide_packed.data(), 0, high_group) == 1e38f);
  CHECK(std::isfinite(dequantize_int4(wide_packed.data(), 1, high_group)));
}

TEST_CASE("kv formats: the bytes a position costs, scales included, and shapes int4 cannot hold") {
  // The shipped model's shape: 2 KV heads of 32, per layer.
  CHECK(kv_bytes_per_position(KvFormat::kFp32, 2, 32, 32) == 512);
  CHECK(kv_bytes_per_position(KvFormat::kFp16, 2, 32, 32) == 256);
  CHECK(kv_bytes_per_position(KvFormat::kBf16, 2, 32, 32) == 256);
  CHECK(kv_bytes_per_position(KvFormat::kInt8, 2, 32, 32) == 2 * (64 + 8));
  CHECK(kv_bytes_per_position(KvFormat::kInt4, 2, 32, 32) == 2 * (32 + 2 * 8));
  CHECK(kv_bytes_per_position(KvFormat::kInt4, 2, 32, 8) == 2 * (32 + 8 * 8));
  CHECK(kv_format_shape_error(KvFormat::kInt4, 32, 8).empty());
  CHECK(!kv_format_shape_error(KvFormat::kInt4, 32, 12).empty());  // does not divide head_dim
  CHECK(!kv_format_shape_error(KvFormat::kInt4, 30, 15).empty());  // odd: two groups would share a byte
  CHECK(kv_format_shape_error(KvFormat::kInt8, 30, 15).empty());
}

TEST_CASE("kv formats on cached rows: per-channel int4 groups beat per-token ones when one channel is large, fp16 stays within 2^-11") {
  // Two heads of 8 over 64 positions; channel 3 of every key is 40x the others, as some of a model's are, and the
  // values of head 0 are 100x those of head 1. Layer 1 holds other rows: whole numbers from -8 to 7, both ends in
  // every group of 8 channels, which int4 per token stores exactly (scale (7 - -8) / 15 = 1, minimum -8).
  kvs::ch10::CachedRows rows{2, 64, 16, {}, {}};
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int p = 0; p < 64; ++p)
    for (int ch = 0; ch < 16; ++ch) {
      rows.keys.push_back(normal(gen) + (ch == 3 ? 40.0f : 0.0f));
      rows.values.push_back(normal(gen) * (ch < 8 ? 100.0f : 1.0f));
    }
  constexpr float kWhole[8] = {-8, -5, -3, 0, 1, 4, 6, 7};
  for (int i = 0; i < 64 * 16; ++i) {
    rows.keys.push_back(kWhole[(i + i / 8) % 8]);  // each group of 8 a rotation of kWhole
    rows.values.push_back(0.0f);
  }
  using kvs::ch10::Grouping;
  const double per_token = kvs::ch10::relative_error(rows, rows.keys, 0, 8, Grouping::kInt4PerToken, 8);
  const double per_channel = kvs::ch10::relative_error(rows, rows.keys, 0, 8, Grouping::kInt4PerChannel, 8);
  CHECK(per_channel < per_token / 3);  // the large channel no longer sets the step of its token's other channels
  CHECK(kvs::ch10::relative_error(rows, rows.keys, 0, 8, Grouping::kFp16, 8) <= 0x1p-11);
  // int8, a scale per token and head: the error of each head coded alone, summed here head by head. A scale per
  // token (both heads) would code head 1's numbers, 100x smaller, in head 0's steps (0.0055 against 0.0037).
  double error = 0, norm = 0;
  for (int p = 0; p < 64; ++p)
    for (int head = 0; head < 2; ++head) {
      const float* x = rows.row(rows.values, 0, p) + head * 8;
      std::int8_t q[8];
      const float scale = quantize_int8(x, 8, q);
      for (int i = 0; i < 8; ++i)
        error += std::pow(x[i] - dequantize_int8(q[i], scale), 2.0), norm += double(x[i]) * x[i];
    }
  const double int8 = kvs::ch10::relative_error(rows, rows.values, 0, 8, Grouping::kInt8PerTokenHead, 8);
  CHECK(int8 > 0);
  CHECK(int8 == doctest::Approx(std::sqrt(error / norm)).epsilon(1e-9));
  // Each layer's own rows: layer 1's whole numbers come back exactly.
  CHECK(kvs::ch10::relative_error(rows, rows.keys, 1, 8, Grouping::kInt4PerToken, 8) == 0.0);
  // A last group of tokens shorter than the rest (and odd) is stored too.
  kvs::ch10::CachedRows odd{1, 5, 16, {}, {}};
  for (int i = 0; i < 5 * 16; ++i) odd.keys.push_back(float(i % 7) - 3.0f);
  // Stored, each number errs by at most half a step (its group's range / 30, up to 0.2 for numbers of up to 3):
  // under 0.1 relative. The last position's group left unstored (read back as 0) would give about 0.45.
  CHECK(kvs::ch10::relative_error(odd, odd.keys, 0, 8, Grouping::kInt4PerChannel, 4) < 0.1);
}

TEST_CASE("chapter 10: the channels experiment prints both tables, writes its CSVs, refuses a bad group") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/10_quantized_cache";
  kvs::test::TempDir dir;
  const auto r = kvs::test::run_command(bin + " --experiment channels --text-bytes 300 --csv " + dir.file("channels.csv") + " --errors-csv " +
                                        dir.file("errors.csv"));
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("300 positions of held-out text cached") != std::string::npos);
  CHECK(r.err.find("int4 per channel") != std::string::npos);
  std::ifstream channels(dir.file("channels.csv")), errors(dir.file("errors.csv"));
  int channel_lines = 0, error_lines = 0;
  for (std::string line; std::getline(channels, line);) ++channel_lines;
  for (std::string line; std::getline(errors, line);) ++error_lines;
  CHECK(channel_lines == 1 + 5 * 2 * 64);  // header, then layers x (key, value) x kv_dim
  CHECK(error_lines == 1 + 5 * 2 * 5);     // header, then layers x (key, value) x formats
  for (const std::string flags : {"--group 12", "--group 3", "--experiment channels --text-bytes 4096", "--experiment bogus",
                                  "--formats int3", "--experiment recall --distances 2000", "--experiment speed --contexts 2048"}) {
    CAPTURE(flags);
    const auto bad = kvs::test::run_command(bin + " " + flags);
    CHECK(bad.exit_code == 2);
    CHECK(std::count(bad.err.begin(), bad.err.end(), '\n') == 1);
  }
}

TEST_CASE("chapter 08 with chapter 10's formats: --kv-format serves from a coded pool, refuses a bad format or group") {
  const std::string bin = std::string(KVS_BIN_DIR) + "/08_paged_batching";
  const auto r = kvs::test::run_command(bin + " --kv-format int8 --requests 4 --prompt-lengths 8,16 --output-lengths 4,8 --kv-memory 64KiB");
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("a pool of 5 blocks of 16 positions") != std::string::npos);  // 64 KiB / (16 · 720 B): fp32 would hold 1
  CHECK(r.err.find("(a pool of its own, same format)") != std::string::npos);
  CHECK(r.err.find("4 of 4 outputs identical") != std::string::npos);
  for (const std::string flags : {"--kv-format int3", "--kv-format int4 --group 12", "--kv-format int4 --group 0"}) {
    CAPTURE(flags);
    const auto bad = kvs::test::run_command(bin + " " + flags);
    CHECK(bad.exit_code == 2);
    CHECK(std::count(bad.err.begin(), bad.err.end(), '\n') == 1);
  }
  // --group 12 is read (an unknown flag would be refused too): the refusal names the group and why
  CHECK(kvs::test::run_command(bin + " --kv-format int4 --group 12").err.find("--group 12: ") != std::string::npos);
}
