#pragma once
// Chapter 10's first measurement (issue #27, experiment 3): why keys need per-channel scales. The model's
// cached keys and values of a held-out text, channel by channel, and what each format's rounding does to
// them - the formats of common/kv_format.h applied to the rows as a cache would store them.
#include <string>
#include <vector>

#include "model.h"

namespace kvs::ch10 {

// Every layer's cached keys and values after prefilling `tokens` (chapter 03's cache): (layers, positions, kv_dim).
struct CachedRows {
  int layers = 0, positions = 0, kv_dim = 0;
  std::vector<float> keys, values;
  const float* row(const std::vector<float>& rows, int layer, int position) const {
    return rows.data() + (std::size_t(layer) * positions + position) * kv_dim;
  }
};
CachedRows cache_rows(Model& model, const std::vector<int>& tokens);

// How one way of storing a layer's rows distorts them: ||x - stored(x)|| / ||x||, over the layer's keys or values.
enum class Grouping { kFp16, kBf16, kInt8PerTokenHead, kInt4PerToken, kInt4PerChannel };
const char* to_string(Grouping g);
// `group`: int4's group, channels of one token (kInt4PerToken) or tokens of one channel (kInt4PerChannel).
double relative_error(const CachedRows& rows, const std::vector<float>& which, int layer, int head_dim, Grouping g, int group);

}  // namespace kvs::ch10
