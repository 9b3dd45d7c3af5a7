// CPU decode attention's cost per cached row against where the rows live (L1, L2, L3, DRAM): one query of the
// shipped model's shape (4 query heads, 2 KV heads of 32) over R rows of one layer, R from 32 to 262,144, the
// same call repeated until ~2e8 rows were read, 5 rounds. Throwaway measurement behind a sentence of book 03½
// (README.md beside it says how it was built and run); not part of the build.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu_backend.h"
#include "kv_cache.h"

using namespace kvs;

int main() {
  const AttentionShape shape{4, 2, 32};
  const int kv_dim = 64, dim = 128;
  CpuBackend backend(1);
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::printf("rows,kv_bytes,round,ns_per_row\n");
  for (int rows : {32, 64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536, 262144}) {
    std::vector<float> keys(std::size_t(rows) * kv_dim), values(keys.size()), q(dim), out(dim);
    for (float& x : keys) x = normal(gen);
    for (float& x : values) x = normal(gen);
    for (float& x : q) x = normal(gen);
    std::vector<float> scratch(backend.attention_scratch_floats(shape, rows, 1));
    const KvView view{.keys = keys.data(), .values = values.data(), .rows = rows, .row_stride = kv_dim};
    const IntBuffer position = consecutive_positions(backend, rows - 1, 1);  // the query sees every row
    const int reps = std::max(3, 200'000'000 / rows);
    for (int round = 1; round <= 5; ++round) {
      const auto start = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) backend.attention(out.data(), q.data(), position.data(), 1, view, shape, scratch, nullptr);
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
      std::printf("%d,%lld,%d,%.3f\n", rows, 2LL * kv_dim * 4 * rows, round, ns / (double(reps) * rows));
      std::fflush(stdout);
    }
    if (out[0] != out[0]) return 1;  // keeps the result alive; never NaN here
  }
}
