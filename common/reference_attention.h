#pragma once
// Attention written as plainly as it can be, one query and one head at a time over any KvView: the readable
// definition of what Backend::attention computes, and the oracle every fast path is tested against (the CPU's
// sweeps and Eigen blocks, the CUDA kernels, paged and ring views: tests/test_attention.cpp,
// test_cuda_backend.cpp, test_batched.cpp). Never called by a chapter: double sums and a query at a time make
// it slow on purpose, so that nothing in it is clever. It reads the view's rows only through position_of,
// key_visible and KvView::key / value (row_offset; for a coded view, chapter 10, the one decode), and a row a query may not see is never touched, so empty rows may hold
// anything. With read_rope it rotates the query and each key by their rotary positions (kv_cache.h) before
// the dot product.
#include <cmath>
#include <vector>

#include "backend.h"
#include "kv_cache.h"
#include "rope.h"

namespace kvs {

// out (n, n_heads·head_dim) for queries q (n, n_heads·head_dim) at positions pos .. pos+n-1; the softmax
// weights too, (n, n_heads, rows), if `weights` is not null.
inline void reference_attention(float* out, const float* q, int pos, int n, const KvView& kv,
                                const AttentionShape& shape, float* weights = nullptr) {
  const int head_dim = shape.head_dim, dim = shape.n_heads * head_dim;
  const int group = shape.n_heads / shape.n_kv_heads;
  std::vector<double> weight(kv.rows);
  std::vector<float> query(head_dim), key(head_dim);
  // x rotated by the table's row for rotary position `at` (read-time rotation only).
  auto rotate = [&](std::vector<float>& x, int at) {
    for (int p = 0; p < head_dim / 2; ++p) rope_rotate(&x[2 * p], kv.read_rope + (std::size_t(at) * (head_dim / 2) + p) * 2);
  };
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < shape.n_heads; ++h) {
      query.assign(q + std::size_t(i) * dim + h * head_dim, q + std::size_t(i) * dim + (h + 1) * head_dim);
      if (kv.read_rope) rotate(query, rotary_query_position(pos + i, kv.window));
      const int kv_head = h / group;
      double max_score = -INFINITY;
      for (int r = 0; r < kv.rows; ++r) {
        weight[r] = -INFINITY;
        if (!key_visible(pos + i, kv.position_of(r), kv.window)) continue;
        for (int d = 0; d < head_dim; ++d) key[d] = kv.key(r, kv_head * head_dim + d);  // stored or decoded
        if (kv.read_rope) rotate(key, rotary_key_position(pos + i, kv.position_of(r), kv.window));
        double dot = 0;
        for (int d = 0; d < head_dim; ++d) dot += double(query[d]) * key[d];
        weight[r] = dot / std::sqrt(double(head_dim));
        max_score = std::max(max_score, weight[r]);
      }
      double sum = 0;
      for (int r = 0; r < kv.rows; ++r)
        if (weight[r] != -INFINITY) sum += (weight[r] = std::exp(weight[r] - max_score));
      float* o = out + std::size_t(i) * dim + h * head_dim;
      for (int d = 0; d < head_dim; ++d) {
        double acc = 0;
        for (int r = 0; r < kv.rows; ++r)
          if (weight[r] != -INFINITY)
            acc += weight[r] / sum * kv.value(r, kv_head * head_dim + d);
        o[d] = static_cast<float>(acc);  // 0 when nothing is visible, as the backends give
      }
      if (weights)
        for (int r = 0; r < kv.rows; ++r)
          weights[(std::size_t(i) * shape.n_heads + h) * kv.rows + r] =
              weight[r] == -INFINITY ? 0.0f : static_cast<float>(weight[r] / sum);
    }
}

}  // namespace kvs
