#pragma once
// The CPU backend: Eigen's GEMM for many positions and its own few-token product for up to 64 (a decode
// step of one sequence or of a batch, a short prompt), over weight matrices it stores transposed; a team of threads of
// its own (worker_pool.h) splits products by output columns and attention by head (a decode step: by KV head).
#include <cstdint>
#include <memory>
#include <vector>

#include "backend.h"

namespace kvs {

class WorkerPool;

class CpuBackend final : public Backend {
 public:
  // threads: cores for Eigen's matrix products and attention heads (0 = all cores).
  explicit CpuBackend(int threads = 0);
  ~CpuBackend() override;
  const char* name() const override { return "cpu (Eigen)"; }
  std::string describe() const override;
  bool host_memory() const override { return true; }
  int threads() const;  // the size of the team it started (every core when asked for 0)

  float* allocate(std::size_t floats) override;
  void release(float* p) override;
  int* allocate_ints(std::size_t count) override;
  void release(int* p) override;
  void from_host(int* dst, const int* host, std::size_t count) override;
  void to_host(int* host, const int* src, std::size_t count) override;
  const float* upload_weights(const float* host, std::size_t floats) override;
  const float* upload_matrix(const float* host, int rows, int cols) override;
  // Bytes of the weights uploaded so far (what Model::weight_bytes predicts).
  std::int64_t weight_bytes() const { return weight_bytes_; }
  void copy(float* dst, const float* src, std::size_t floats) override;
  void to_host(float* host, const float* src, std::size_t floats) override { copy(host, src, floats); }
  void from_host(float* dst, const float* host, std::size_t floats) override { copy(dst, host, floats); }
  void synchronize() override {}  // every operation has finished when it returns
  std::size_t attention_scratch_floats(const AttentionShape& shape, int max_rows, int max_sequences) const override;

  void embed(float* x, const float* table, const int* tokens, int n, int dim) override;
  void matmul(float* out, const float* x, const float* w, int n, int d_in, int d_out) override;
  void rmsnorm(float* out, const float* x, const float* weight, int n, int dim) override;
  void rope_table(float* table, const int* positions, int n, int head_dim) override;
  void rope(float* x, const float* table, int n, int heads, int head_dim) override;
  void attention(float* out, const float* q, const int* positions, int n, const KvView& kv,
                 const AttentionShape& shape, std::span<float> scratch, float* weights) override;
  void attention_batch(float* out, const float* q, const int* positions, std::span<const AttentionPart> parts,
                       const AttentionShape& shape, std::span<float> scratch) override;
  void write_rows(float* rows, int row_stride, const int* positions, Ring ring, const float* src, int n,
                  int width) override;
  void write_positions(int* slot_positions, const int* positions, Ring ring, int n) override;
  void write_paged_rows(float* rows, int row_stride, const int* positions, BlockTable table, const float* src, int n,
                        int width) override;
  void write_coded_rows(const CodedRows& rows, const int* positions, Ring ring, const float* src, int n) override;
  void encode_channel_groups(const CodedRows& rows, int first_group, int groups, const float* src) override;
  void write_paged_coded_rows(const CodedRows& rows, const int* positions, BlockTable table, const float* src,
                              int n) override;
  void swiglu(float* gate, const float* up, std::size_t count) override;
  void add(float* x, const float* y, std::size_t count) override;

  // The most tokens a product takes through the backend's few-token product (cpu_backend.cpp); more go through
  // Eigen's GEMM. kFewTokens (64) unless set: 0 sends every product to Eigen, a large value every product to the
  // few-token product. Chapter 08's products experiment sets it to time the two side by side; everything else
  // keeps the default, which is what gives a batch's token the bits it gets alone. Throws std::invalid_argument
  // for a negative count.
  void set_few_token_limit(int tokens);
  int few_token_limit() const { return few_token_limit_; }

  // Queries per attention block: scores are computed for this many queries at a time, so the scratch
  // is (n_heads, kQueryBlock, max_rows) whatever the prompt length - and whatever the batch: a batched decode
  // step (attention_batch) gives each of up to kQueryBlock tasks one of those rows of scores per head.
  static constexpr int kQueryBlock = 64;
  // The longest head a coded view (chapter 10) may have: attention decodes a few rows of one head at a time
  // into a buffer of this many floats per row, on the stack.
  static constexpr int kMaxCodedHeadDim = 256;

 private:
  float* allocate_weights(std::size_t floats);  // kept in weights_
  template <typename Where>
  void scatter_rows(float* rows, int row_stride, const int* positions, Where where, const float* src, int n, int width);
  template <typename Where>
  void encode_rows(const CodedRows& rows, const int* positions, Where where, const float* src, int n);
  std::unique_ptr<WorkerPool> pool_;
  std::vector<float*> weights_;  // uploaded weights, released with the backend
  std::int64_t weight_bytes_ = 0;
  int few_token_limit_;  // see set_few_token_limit
};

}  // namespace kvs
