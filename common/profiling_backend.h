#pragma once
// Where a forward pass spends its time: a backend that forwards every operation to another one and adds up
// the wall time of each, by kind - the weight matrix products, attention over the cache, everything else.
// The model does not change; a benchmark builds a Model on this backend instead of the real one.
//
// On a GPU an operation returns before it finishes, so each one is followed by inner.synchronize(): the
// split is then right, but the total includes one synchronisation per operation (on the CPU, operations
// are synchronous, synchronize() does nothing, and the wrapper costs two clock reads per operation).
#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include "backend.h"

namespace kvs {

enum class OpKind { kMatmul, kAttention, kOther };
inline constexpr int kOpKinds = 3;
inline const char* to_string(OpKind kind) {
  return kind == OpKind::kMatmul ? "matmul" : kind == OpKind::kAttention ? "attention" : "other";
}

class ProfilingBackend final : public Backend {
 public:
  explicit ProfilingBackend(Backend& inner) : inner_(inner) {}

  // Milliseconds and operations of each kind since the last reset.
  double milliseconds(OpKind kind) const { return ns_[int(kind)] / 1e6; }
  std::int64_t operations(OpKind kind) const { return count_[int(kind)]; }
  void reset() { ns_ = {}, count_ = {}; }

  const char* name() const override { return inner_.name(); }
  std::string describe() const override { return inner_.describe(); }
  bool host_memory() const override { return inner_.host_memory(); }
  std::int64_t free_memory_bytes() const override { return inner_.free_memory_bytes(); }
  float* allocate(std::size_t floats) override { return inner_.allocate(floats); }
  void release(float* p) override { inner_.release(p); }
  int* allocate_ints(std::size_t count) override { return inner_.allocate_ints(count); }
  void release(int* p) override { inner_.release(p); }
  void from_host(int* dst, const int* host, std::size_t count) override {
    timed(OpKind::kOther, [&] { inner_.from_host(dst, host, count); });
  }
  void to_host(int* host, const int* src, std::size_t count) override {
    timed(OpKind::kOther, [&] { inner_.to_host(host, src, count); });
  }
  const float* upload_weights(const float* host, std::size_t floats) override { return inner_.upload_weights(host, floats); }
  const float* upload_matrix(const float* host, int rows, int cols) override { return inner_.upload_matrix(host, rows, cols); }
  void copy(float* dst, const float* src, std::size_t floats) override {
    timed(OpKind::kOther, [&] { inner_.copy(dst, src, floats); });
  }
  void to_host(float* host, const float* src, std::size_t floats) override {
    timed(OpKind::kOther, [&] { inner_.to_host(host, src, floats); });
  }
  void from_host(float* dst, const float* host, std::size_t floats) override {
    timed(OpKind::kOther, [&] { inner_.from_host(dst, host, floats); });
  }
  void synchronize() override { inner_.synchronize(); }
  std::size_t attention_scratch_floats(const AttentionShape& shape, int max_rows, int max_sequences) const override {
    return inner_.attention_scratch_floats(shape, max_rows, max_sequences);
  }
  void embed(float* x, const float* table, const int* tokens, int n, int dim) override {
    timed(OpKind::kOther, [&] { inner_.embed(x, table, tokens, n, dim); });
  }
  void matmul(float* out, const float* x, const float* w, int n, int d_in, int d_out) override {
    timed(OpKind::kMatmul, [&] { inner_.matmul(out, x, w, n, d_in, d_out); });
  }
  void rmsnorm(float* out, const float* x, const float* weight, int n, int dim) override {
    timed(OpKind::kOther, [&] { inner_.rmsnorm(out, x, weight, n, dim); });
  }
  void rope_table(float* table, const int* positions, int n, int head_dim) override {
    timed(OpKind::kOther, [&] { inner_.rope_table(table, positions, n, head_dim); });
  }
  void rope(float* x, const float* table, int n, int heads, int head_dim) override {
    timed(OpKind::kOther, [&] { inner_.rope(x, table, n, heads, head_dim); });
  }
  void attention(float* out, const float* q, const int* positions, int n, const KvView& kv,
                 const AttentionShape& shape, std::span<float> scratch, float* weights) override {
    timed(OpKind::kAttention, [&] { inner_.attention(out, q, positions, n, kv, shape, scratch, weights); });
  }
  void attention_batch(float* out, const float* q, const int* positions, std::span<const AttentionPart> parts,
                       const AttentionShape& shape, std::span<float> scratch) override {
    timed(OpKind::kAttention, [&] { inner_.attention_batch(out, q, positions, parts, shape, scratch); });
  }
  void write_rows(float* rows, int row_stride, const int* positions, Ring ring, const float* src, int n,
                  int width) override {
    timed(OpKind::kOther, [&] { inner_.write_rows(rows, row_stride, positions, ring, src, n, width); });
  }
  // One operation where the inner backend fuses at all (a GPU's one launch), else its definition: two write_rows.
  void write_key_value_rows(float* keys, float* values, int row_stride, const int* positions, Ring ring, const float* k,
                            const float* v, int n, int width) override {
    if (inner_.fused_tokens() == 0)
      return Backend::write_key_value_rows(keys, values, row_stride, positions, ring, k, v, n, width);
    timed(OpKind::kOther, [&] { inner_.write_key_value_rows(keys, values, row_stride, positions, ring, k, v, n, width); });
  }
  void write_positions(int* slot_positions, const int* positions, Ring ring, int n) override {
    timed(OpKind::kOther, [&] { inner_.write_positions(slot_positions, positions, ring, n); });
  }
  void write_paged_rows(float* rows, int row_stride, const int* positions, BlockTable table, const float* src, int n,
                        int width) override {
    timed(OpKind::kOther, [&] { inner_.write_paged_rows(rows, row_stride, positions, table, src, n, width); });
  }
  void write_paged_batch(const CodedRows& keys, const CodedRows& values, const int* positions,
                         std::span<const PagedPart> parts, const float* k, const float* v) override {
    timed(OpKind::kOther, [&] { inner_.write_paged_batch(keys, values, positions, parts, k, v); });
  }
  void encode_channel_groups(const CodedRows& rows, int first_group, int groups, const float* src) override {
    timed(OpKind::kOther, [&] { inner_.encode_channel_groups(rows, first_group, groups, src); });
  }
  void write_coded_rows(const CodedRows& rows, const int* positions, Ring ring, const float* src, int n) override {
    timed(OpKind::kOther, [&] { inner_.write_coded_rows(rows, positions, ring, src, n); });
  }
  void write_paged_coded_rows(const CodedRows& rows, const int* positions, BlockTable table, const float* src,
                              int n) override {
    timed(OpKind::kOther, [&] { inner_.write_paged_coded_rows(rows, positions, table, src, n); });
  }

  void swiglu(float* gate, const float* up, std::size_t count) override {
    timed(OpKind::kOther, [&] { inner_.swiglu(gate, up, count); });
  }
  void add(float* x, const float* y, std::size_t count) override {
    timed(OpKind::kOther, [&] { inner_.add(x, y, count); });
  }
  // A fused operation is one operation, a weight product, where the inner backend fuses it (a norm or an add
  // rides along with the product it feeds); elsewhere its definition runs here, each part timed as its kind.
  int fused_tokens() const override { return inner_.fused_tokens(); }
  void norm_products(float* normed, const float* x, const float* norm_weight, int n, int d_in, int head_dim,
                     std::span<const Product> products) override {
    if (n > inner_.fused_tokens()) return Backend::norm_products(normed, x, norm_weight, n, d_in, head_dim, products);
    timed(OpKind::kMatmul, [&] { inner_.norm_products(normed, x, norm_weight, n, d_in, head_dim, products); });
  }
  void norm_swiglu(float* gate, float* up, float* normed, const float* x, const float* norm_weight, const float* w1,
                   const float* w3, int n, int d_in, int hidden) override {
    if (n > inner_.fused_tokens()) return Backend::norm_swiglu(gate, up, normed, x, norm_weight, w1, w3, n, d_in, hidden);
    timed(OpKind::kMatmul, [&] { inner_.norm_swiglu(gate, up, normed, x, norm_weight, w1, w3, n, d_in, hidden); });
  }
  void matmul_add(float* x, float* product, const float* in, const float* w, int n, int d_in, int d_out) override {
    if (n > inner_.fused_tokens()) return Backend::matmul_add(x, product, in, w, n, d_in, d_out);
    timed(OpKind::kMatmul, [&] { inner_.matmul_add(x, product, in, w, n, d_in, d_out); });
  }

 private:
  template <typename Op>
  void timed(OpKind kind, Op&& op) {
    const auto start = std::chrono::steady_clock::now();
    op();
    inner_.synchronize();  // a GPU's operation has only been queued (the CPU's has finished: a no-op)
    ns_[int(kind)] += std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    ++count_[int(kind)];
  }

  Backend& inner_;
  std::array<double, kOpKinds> ns_{};
  std::array<std::int64_t, kOpKinds> count_{};
};

}  // namespace kvs
