#include "channels.h"

#include <cmath>
#include <cstdint>

#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "kv_format.h"

namespace kvs::ch10 {

CachedRows cache_rows(Model& model, const std::vector<int>& tokens) {
  const ModelConfig& c = model.config();
  const int n = static_cast<int>(tokens.size());
  ch03::PreallocatedKvCache cache(model.backend(), c, n);
  for (int pos = 0; pos < n; pos += model.max_tokens_per_call())
    model.forward(std::span<const int>(tokens).subspan(pos, std::min(n - pos, model.max_tokens_per_call())), pos, &cache);
  CachedRows rows{c.n_layers, n, c.kv_dim(), {}, {}};
  rows.keys.resize(std::size_t(c.n_layers) * n * c.kv_dim());
  rows.values.resize(rows.keys.size());
  for (int layer = 0; layer < c.n_layers; ++layer)
    for (int p = 0; p < n; ++p) {
      const KvRow row = cache.row(layer, p);
      const std::size_t at = (std::size_t(layer) * n + p) * c.kv_dim();
      model.backend().to_host(rows.keys.data() + at, row.key, c.kv_dim());
      model.backend().to_host(rows.values.data() + at, row.value, c.kv_dim());
    }
  return rows;
}

const char* to_string(Grouping g) {
  switch (g) {
    case Grouping::kFp16: return "fp16";
    case Grouping::kBf16: return "bf16";
    case Grouping::kInt8PerTokenHead: return "int8 per token and head";
    case Grouping::kInt4PerToken: return "int4 per token";
    case Grouping::kInt4PerChannel: return "int4 per channel";
  }
  return "?";
}

double relative_error(const CachedRows& rows, const std::vector<float>& which, int layer, int head_dim, Grouping g, int group) {
  const int n = rows.positions, width = rows.kv_dim;
  // stored (positions, kv_dim): the layer's rows as a cache in that format would read them back
  std::vector<float> stored(std::size_t(n) * width), run(std::max(group, head_dim));
  std::vector<std::int8_t> q8(head_dim);
  std::vector<std::uint8_t> q4(std::max(group, head_dim) / 2 + 1);
  auto at = [&](int p, int ch) -> float { return rows.row(which, layer, p)[ch]; };
  if (g == Grouping::kInt4PerChannel) {
    // One channel over `group` consecutive tokens at a time (a last, shorter group if n is not a multiple;
    // an odd last group is padded with its own last number, which reads back unchanged in value).
    for (int ch = 0; ch < width; ++ch)
      for (int p0 = 0; p0 < n; p0 += group) {
        const int count = std::min(group, n - p0), even = count + count % 2;
        for (int i = 0; i < even; ++i) run[i] = at(p0 + std::min(i, count - 1), ch);
        const Int4Group qg = quantize_int4(run.data(), even, q4.data());
        for (int i = 0; i < count; ++i) stored[std::size_t(p0 + i) * width + ch] = dequantize_int4(q4.data(), i, qg);
      }
  } else {
    for (int p = 0; p < n; ++p) {
      const float* x = rows.row(which, layer, p);
      float* out = stored.data() + std::size_t(p) * width;
      if (g == Grouping::kFp16 || g == Grouping::kBf16) {
        for (int ch = 0; ch < width; ++ch) out[ch] = g == Grouping::kFp16 ? from_fp16(to_fp16(x[ch])) : from_bf16(to_bf16(x[ch]));
      } else if (g == Grouping::kInt8PerTokenHead) {
        for (int h = 0; h < width; h += head_dim) {
          const float scale = quantize_int8(x + h, head_dim, q8.data());
          for (int i = 0; i < head_dim; ++i) out[h + i] = dequantize_int8(q8[i], scale);
        }
      } else {  // int4 per token: groups of `group` channels
        for (int start = 0; start < width; start += group) {
          const Int4Group qg = quantize_int4(x + start, group, q4.data());
          for (int i = 0; i < group; ++i) out[start + i] = dequantize_int4(q4.data(), i, qg);
        }
      }
    }
  }
  double error = 0, norm = 0;
  for (int p = 0; p < n; ++p)
    for (int ch = 0; ch < width; ++ch) {
      const double x = at(p, ch), d = x - stored[std::size_t(p) * width + ch];
      error += d * d, norm += x * x;
    }
  return norm > 0 ? std::sqrt(error / norm) : 0.0;
}

}  // namespace kvs::ch10
