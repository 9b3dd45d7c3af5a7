// The CUDA backend's operations, one by one, against the CPU backend (and attention against the plain-loop
// reference), on sizes that cross the kernels' warp (32), block (128, 256) and per-lane (head_dim 32 · k)
// boundaries, odd sizes included. They run on every backend other than the CPU that this build and
// machine have: the CUDA kernels through the CUDA harness (everywhere the harness is built, CI included)
// and on a GPU where one is present.
//
// Tolerance: |backend - reference| <= atol + rtol · |reference|, rtol = 1.2e-7 (one float rounding) and atol
// per op: 0 where both sides copy bits (embed); 1e-6 where one side uses the GPU's own maths functions on
// values of order 1 (RoPE tables and rotations, RMSNorm, SwiGLU); 1e-4 for sums of hundreds of products
// summed in another order (matrix products, attention's scores and weighted values). A wrong index (a
// head, a row, a pair, a position) moves outputs by ~0.1 or more.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu_backend.h"
#include "kv_cache.h"
#include "reference_attention.h"
#include "test_backends.h"
#include "test_util.h"

using namespace kvs;

namespace {

constexpr float kRtol = 1.2e-7f;

std::vector<float> random_vector(std::size_t n, std::mt19937& gen, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(gen);
  return v;
}

// Largest violation of |got - want| <= atol + rtol·|want| (<= 0: all within), NaN/Inf counted as violations.
float worst_excess(const std::vector<float>& got, const std::vector<float>& want, float atol) {
  REQUIRE(got.size() == want.size());
  float worst = -INFINITY;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    worst = std::max(worst, std::abs(got[i] - want[i]) - (atol + kRtol * std::abs(want[i])));
  }
  return worst;
}

// Runs a fused operation: where `fused`, recorded and replayed once (its results land as a plain call's would),
// and checked to be one launch; otherwise (its definition: cuBLAS, which is not captured here) called plainly.
template <class Run>
void run_fused(Backend& b, bool fused, Run run) {
  if (!fused) return run();
  const int recording = b.begin_recording();
  run();
  b.end_recording();
  b.replay(recording);
  CHECK(b.recorded_launches() == 1);
}

// Each of `values` set in the environment variable `variable` refuses the backend `name` with a message holding
// `reason`; the variable is unset after.
void check_refused(const std::string& name, const char* variable, std::initializer_list<const char*> values,
                   const char* reason) {
  for (const char* value : values) {
    CAPTURE(value);
    setenv(variable, value, 1);
    CHECK_THROWS_WITH_AS(test::make_test_backend(name), doctest::Contains(reason), std::invalid_argument);
  }
  unsetenv(variable);
}

std::vector<std::string> kernel_backends() {
  std::vector<std::string> names = test::test_backend_names();
  names.erase(names.begin());  // the CPU is the reference
  if (names.empty()) MESSAGE("no CUDA backend in this build (neither the harness nor a GPU): nothing to compare");
  return names;
}

}  // namespace

TEST_CASE("cuda kernels: embedding, RMSNorm, SwiGLU and add equal the CPU backend across block boundaries") {
  CpuBackend cpu(1);
  std::mt19937 gen(7);
  test::for_each_backend(kernel_backends(), [&](Backend& b) {
    for (int dim : {1, 31, 32, 33, 255, 256, 257, 1000}) {
      CAPTURE(dim);
      const int vocab = 11, n = 3;
      const std::vector<float> table = random_vector(std::size_t(vocab) * dim, gen);
      const std::vector<int> tokens = {10, 0, 4};
      std::vector<float> want(std::size_t(n) * dim);
      cpu.embed(want.data(), table.data(), tokens.data(), n, dim);
      Buffer d_table = test::to_backend(b, table), d_x(b, want.size());
      IntBuffer d_tokens(b, tokens.size());
      b.from_host(d_tokens.data(), tokens.data(), tokens.size());
      b.embed(d_x.data(), d_table.data(), d_tokens.data(), n, dim);
      CHECK(worst_excess(test::from_backend(b, d_x), want, 0.0f) <= 0);

      const std::vector<float> x = random_vector(std::size_t(n) * dim, gen, 3.0f), weight = random_vector(dim, gen);
      cpu.rmsnorm(want.data(), x.data(), weight.data(), n, dim);
      Buffer d_in = test::to_backend(b, x), d_weight = test::to_backend(b, weight), d_out(b, want.size());
      b.rmsnorm(d_out.data(), d_in.data(), d_weight.data(), n, dim);
      CHECK(worst_excess(test::from_backend(b, d_out), want, 1e-6f) <= 0);
    }
    for (std::size_t count : {std::size_t{1}, std::size_t{255}, std::size_t{256}, std::size_t{257}, std::size_t{100003}}) {
      CAPTURE(count);
      const std::vector<float> gate = random_vector(count, gen, 4.0f), up = random_vector(count, gen);
      std::vector<float> want = gate;
      cpu.swiglu(want.data(), up.data(), count);
      Buffer d_gate = test::to_backend(b, gate), d_up = test::to_backend(b, up);
      b.swiglu(d_gate.data(), d_up.data(), count);
      CHECK(worst_excess(test::from_backend(b, d_gate), want, 1e-6f) <= 0);

      std::vector<float> sum = gate;
      cpu.add(sum.data(), up.data(), count);
      Buffer d_sum = test::to_backend(b, gate);
      b.add(d_sum.data(), d_up.data(), count);
      CHECK(worst_excess(test::from_backend(b, d_sum), sum, 0.0f) <= 0);
    }
  });
}

TEST_CASE("cuda kernels: matrix products through the BLAS interface equal the CPU backend") {
  CpuBackend cpu(1);
  std::mt19937 gen(8);
  test::for_each_backend(kernel_backends(), [&](Backend& b) {
    struct Shape {
      int n, d_in, d_out;
    };
    // One position (a decode step) and more, odd sizes included.
    for (const Shape s : {Shape{1, 1, 1}, Shape{1, 127, 7}, Shape{1, 128, 8}, Shape{1, 129, 9}, Shape{1, 257, 31},
                          Shape{5, 33, 260}, Shape{64, 128, 384}, Shape{70, 384, 128}}) {
      CAPTURE(s.n); CAPTURE(s.d_in); CAPTURE(s.d_out);
      const std::vector<float> x = random_vector(std::size_t(s.n) * s.d_in, gen), w = random_vector(std::size_t(s.d_out) * s.d_in, gen);
      std::vector<float> want(std::size_t(s.n) * s.d_out);
      cpu.matmul(want.data(), x.data(), cpu.upload_matrix(w.data(), s.d_out, s.d_in), s.n, s.d_in, s.d_out);
      Buffer d_x = test::to_backend(b, x), d_out(b, want.size());
      b.matmul(d_out.data(), d_x.data(), b.upload_matrix(w.data(), s.d_out, s.d_in), s.n, s.d_in, s.d_out);
      CHECK(worst_excess(test::from_backend(b, d_out), want, 1e-4f) <= 0);
    }
  });
}

// The fused operations (backend.h): the CPU runs their definitions (norm, products, RoPE, SwiGLU, add as
// separate operations); the CUDA backend runs one gemv_kernel per call of up to fused_tokens() = 64 tokens. Shapes
// cross what that kernel splits on: the token counts it is compiled for (1, 2, 4, 8), tiles of 8 tokens past 8
// (9: a second tile of one token; 17, 64: three and eight tiles) and 65 (the definition again), d_in a multiple
// of 4 (16-byte loads) or not (one float at a time), d_in past one sweep of a block's lanes (512 floats),
// products whose rows are not a multiple of the 4 a block computes (so a block holds rows of two products), a
// RoPE product starting at an odd row (the launch must fall back to the definition). A call that should be fused
// is recorded and its launches counted (run_fused): one, so a call that fell back to the definition fails.
namespace {
void check_fused_products(Backend& b, std::mt19937& gen) {
  CpuBackend cpu(1);
  struct Out {
    int d_out;
    bool rope;
  };
  struct Case {
    int n, d_in, head_dim;
    std::vector<Out> outs;
    bool fused = true;  // up to 64 tokens, RoPE on pairs of a block's rows
  };
  const std::vector<Case> cases = {
      {1, 128, 32, {{128, true}, {64, true}, {64, false}}},  // the shipped model's q, k, v
      {3, 60, 6, {{12, true}, {6, true}, {6, false}}},
      {8, 516, 4, {{8, true}, {4, true}, {4, false}}},
      {5, 33, 6, {{6, true}, {6, true}, {6, false}}},
      {2, 64, 10, {{30, true}, {10, true}, {10, false}}},  // product 1 starts inside a block
      {9, 64, 4, {{8, true}, {4, true}, {4, false}}},
      {17, 36, 6, {{18, true}, {6, true}, {6, false}}},  // product 1 starts inside a block, a tile of one token
      {64, 128, 32, {{128, true}, {64, true}, {64, false}}},  // 64 sequences of the shipped model
      {65, 64, 4, {{8, true}, {4, true}, {4, false}}, false},
      {1, 64, 2, {{6, false}, {5, false}, {4, true}}, false},  // RoPE from row 11: not a pair of one block
      {1, 128, 32, {{256, false}}},                        // the classifier
  };
  for (const Case& k : cases) {
    CAPTURE(k.n); CAPTURE(k.d_in); CAPTURE(k.head_dim); CAPTURE(k.outs.size());
    const std::vector<float> x = random_vector(std::size_t(k.n) * k.d_in, gen, 2.0f), g = random_vector(k.d_in, gen);
    std::vector<float> table(std::size_t(k.n) * k.head_dim);
    cpu.rope_table(table.data(), consecutive_positions(cpu, 1000, k.n).data(), k.n, k.head_dim);
    Buffer d_x = test::to_backend(b, x), d_g = test::to_backend(b, g), d_table = test::to_backend(b, table);
    Buffer d_normed(b, x.size());
    std::vector<std::vector<float>> want;
    std::vector<Buffer> got;
    std::vector<Backend::Product> cpu_products, products;
    for (const Out& o : k.outs) {
      const std::vector<float> w = random_vector(std::size_t(o.d_out) * k.d_in, gen);
      want.emplace_back(std::size_t(k.n) * o.d_out);
      got.emplace_back(b, want.back().size());
      cpu_products.push_back({want.back().data(), cpu.upload_matrix(w.data(), o.d_out, k.d_in), o.d_out,
                              o.rope ? table.data() : nullptr});
      products.push_back({got.back().data(), b.upload_matrix(w.data(), o.d_out, k.d_in), o.d_out,
                          o.rope ? d_table.data() : nullptr});
    }
    // Attention's k and v (products 1 and 2 of three) also store their rows in a cache, as KvCache::rows_write
    // asks: a ring that wraps within the call (positions from 1000; two sinks; one slot more than the call's
    // rows, so no two share a slot), rows 3 floats longer than a product's; untouched rows stay -7.
    const Ring ring{k.n + 3, 2};
    const IntBuffer cpu_positions = consecutive_positions(cpu, 1000, k.n), positions = consecutive_positions(b, 1000, k.n);
    std::vector<std::vector<float>> want_cache;
    std::vector<Buffer> cache;
    for (std::size_t i = 1; k.outs.size() == 3 && i < 3; ++i) {
      const int stride = k.outs[i].d_out + 3;
      want_cache.emplace_back(std::size_t(ring.slots) * stride, -7.0f);
      cache.push_back(test::to_backend(b, want_cache.back()));
      cpu_products[i].cache_rows = want_cache.back().data(), products[i].cache_rows = cache.back().data();
      cpu_products[i].cache_row_stride = products[i].cache_row_stride = stride;
      cpu_products[i].cache_ring = products[i].cache_ring = ring;
      cpu_products[i].positions = cpu_positions.data(), products[i].positions = positions.data();
    }
    std::vector<float> normed(x.size());
    cpu.norm_products(normed.data(), x.data(), g.data(), k.n, k.d_in, k.head_dim, cpu_products);
    run_fused(b, k.fused, [&] { b.norm_products(d_normed.data(), d_x.data(), d_g.data(), k.n, k.d_in, k.head_dim, products); });
    for (std::size_t i = 0; i < k.outs.size(); ++i) {
      CAPTURE(i);
      CHECK(worst_excess(test::from_backend(b, got[i]), want[i], 1e-4f) <= 0);
    }
    for (std::size_t i = 0; i < cache.size(); ++i) {
      CAPTURE(i);
      CHECK(worst_excess(test::from_backend(b, cache[i]), want_cache[i], 1e-4f) <= 0);
    }
  }

  struct Shape {
    int n, d_in, d_out;
  };
  for (const Shape s : {Shape{1, 128, 384}, Shape{4, 60, 13}, Shape{8, 516, 7}, Shape{3, 33, 10}, Shape{9, 64, 16},
                        Shape{20, 36, 10}, Shape{65, 64, 16}}) {
    CAPTURE(s.n); CAPTURE(s.d_in); CAPTURE(s.d_out);
    const std::vector<float> x = random_vector(std::size_t(s.n) * s.d_in, gen, 2.0f), g = random_vector(s.d_in, gen);
    // Weights of a trained layer's scale (1/sqrt(d_in)): gate and up of order 1, so their product's rounding
    // stays within the products' tolerance (at scale 1 both are ~sqrt(d_in) and so is its relative error).
    const float scale = 1.0f / std::sqrt(float(s.d_in));
    const std::vector<float> w1 = random_vector(std::size_t(s.d_out) * s.d_in, gen, scale),
                             w3 = random_vector(std::size_t(s.d_out) * s.d_in, gen, scale);
    std::vector<float> gate(std::size_t(s.n) * s.d_out), up(gate.size()), normed(x.size());
    cpu.norm_swiglu(gate.data(), up.data(), normed.data(), x.data(), g.data(), cpu.upload_matrix(w1.data(), s.d_out, s.d_in),
                    cpu.upload_matrix(w3.data(), s.d_out, s.d_in), s.n, s.d_in, s.d_out);
    Buffer d_x = test::to_backend(b, x), d_g = test::to_backend(b, g), d_gate(b, gate.size()), d_up(b, gate.size()),
           d_normed(b, x.size());
    const float *d_w1 = b.upload_matrix(w1.data(), s.d_out, s.d_in), *d_w3 = b.upload_matrix(w3.data(), s.d_out, s.d_in);
    run_fused(b, s.n <= 64, [&] {
      b.norm_swiglu(d_gate.data(), d_up.data(), d_normed.data(), d_x.data(), d_g.data(), d_w1, d_w3, s.n, s.d_in, s.d_out);
    });
    CHECK(worst_excess(test::from_backend(b, d_gate), gate, 1e-4f) <= 0);
  }
  for (const Shape s : {Shape{1, 384, 128}, Shape{1, 1028, 12}, Shape{2, 33, 9}, Shape{8, 516, 130}, Shape{9, 64, 8},
                        Shape{64, 384, 128}, Shape{65, 64, 8}}) {
    CAPTURE(s.n); CAPTURE(s.d_in); CAPTURE(s.d_out);
    const std::vector<float> in = random_vector(std::size_t(s.n) * s.d_in, gen), w = random_vector(std::size_t(s.d_out) * s.d_in, gen);
    std::vector<float> x = random_vector(std::size_t(s.n) * s.d_out, gen), product(x.size());
    Buffer d_in = test::to_backend(b, in), d_x = test::to_backend(b, x), d_product(b, x.size());
    cpu.matmul_add(x.data(), product.data(), in.data(), cpu.upload_matrix(w.data(), s.d_out, s.d_in), s.n, s.d_in, s.d_out);
    const float* d_w = b.upload_matrix(w.data(), s.d_out, s.d_in);
    run_fused(b, s.n <= 64, [&] { b.matmul_add(d_x.data(), d_product.data(), d_in.data(), d_w, s.n, s.d_in, s.d_out); });
    CHECK(worst_excess(test::from_backend(b, d_x), x, 1e-4f) <= 0);
  }
}
}  // namespace

TEST_CASE("cuda kernels: the fused norm-products (a cache write in them), SwiGLU and residual add equal their definitions") {
  std::mt19937 gen(10);
  test::for_each_backend(kernel_backends(), [&](Backend& b) { check_fused_products(b, gen); });
}

// KVS_GEMV_MAX_TOKENS (tests/gpu_session.sh's A/B of the fused products against cuBLAS for 9 to 64 tokens):
// lowers the limit, so a call of more tokens takes the definition; anything but 1 to 64 refuses the backend with
// the reason.
TEST_CASE("cuda kernels: KVS_GEMV_MAX_TOKENS lowers the fused products' limit and refuses what is not 1 to 64") {
  const test::UnsetAtExit unset{"KVS_GEMV_MAX_TOKENS"};
  for (const std::string& name : kernel_backends()) {
    CAPTURE(name);
    setenv("KVS_GEMV_MAX_TOKENS", "8", 1);
    const std::unique_ptr<Backend> b = test::make_test_backend(name);
    CHECK(b->fused_tokens() == 8);
    unsetenv("KVS_GEMV_MAX_TOKENS");
    CHECK(test::make_test_backend(name)->fused_tokens() == 64);
    check_refused(name, "KVS_GEMV_MAX_TOKENS", {"0", "65", "8x", "", "-1"}, "expected a whole number from 1 to 64");
  }
}

// KVS_GEMV_WARPS (tests/gpu_session.sh's chunks step: blocks of fewer warps, more of them at once): the fused
// products above equal their definitions with blocks of 1, 2 and 3 warps, where a block sweeps d_in in more
// sweeps (d_in 1,028 in one warp: nine sweeps, the last of 4 columns, in three groups of four, the last of one);
// the setting reaches the launch (a product of 1,028 columns is summed in another order, so some of its outputs'
// bits differ from 4 warps', the default, whose products the test above checks); anything but 1 to 4 refuses
// the backend with the reason.
TEST_CASE("cuda kernels: products in blocks of fewer warps (KVS_GEMV_WARPS) equal their definitions, and bad values are refused") {
  const test::UnsetAtExit unset{"KVS_GEMV_WARPS"};
  std::mt19937 gen(12);
  const int d_in = 1028, d_out = 64;
  const std::vector<float> in = random_vector(d_in, gen), w = random_vector(std::size_t(d_out) * d_in, gen);
  for (const std::string& name : kernel_backends()) {
    CAPTURE(name);
    std::vector<std::vector<float>> sums;  // the product of 1,028 columns, with each setting
    for (const std::string warps : {"1", "2", "3", ""}) {
      CAPTURE(warps);
      if (warps.empty()) unsetenv("KVS_GEMV_WARPS");
      else setenv("KVS_GEMV_WARPS", warps.c_str(), 1);
      const std::unique_ptr<Backend> b = test::make_test_backend(name);
      if (!warps.empty()) check_fused_products(*b, gen);
      Buffer d_input = test::to_backend(*b, in), d_x = test::to_backend(*b, std::vector<float>(d_out, 0.0f)), d_product(*b, d_out);
      const float* d_w = b->upload_matrix(w.data(), d_out, d_in);
      run_fused(*b, true, [&] { b->matmul_add(d_x.data(), d_product.data(), d_input.data(), d_w, 1, d_in, d_out); });
      sums.push_back(test::from_backend(*b, d_x));
    }
    CHECK(sums[0] != sums[3]);  // 1 warp against 4 (unset)
    check_refused(name, "KVS_GEMV_WARPS", {"0", "5", "2x", "", "-1", " 2", "+2"}, "expected a whole number from 1 to 4");
  }
}

// cuda_support.h's rule, read off the source: the first statement of every kernel is KVS_WAIT_FOR_PREVIOUS_KERNEL(),
// but in gemv_kernel, which loads weight rows first (no kernel writes them; its comment says why). The harness
// reports a thread that synchronises or ends before the wait, and runs a kernel's first block up to the wait before
// the kernel ahead finishes, so a read of that kernel's output there shows as a wrong result; but only where the
// memory held something else before that kernel ran. This reads every kernel's body instead, so that a new kernel
// doing work before its wait is a decision made here, by name.
TEST_CASE("cuda kernels: every kernel's first statement is KVS_WAIT_FOR_PREVIOUS_KERNEL(), but gemv_kernel's") {
  std::ifstream file(KVS_CUDA_BACKEND_SOURCE);
  REQUIRE(file);
  const std::string source{std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
  const std::string kernel = "\n__global__", wait = "KVS_WAIT_FOR_PREVIOUS_KERNEL();";
  int kernels = 0, early = 0;
  for (std::size_t at = source.find(kernel); at != std::string::npos; at = source.find(kernel, at + 1), ++kernels) {
    const std::size_t body = source.find('{', at);  // no kernel's parameter list holds a brace
    REQUIRE(body != std::string::npos);
    const std::string head = source.substr(at + 1, body - at);
    CAPTURE(head);
    const std::size_t first = source.find_first_not_of(" \n", body + 1);
    if (head.find(" gemv_kernel(") == std::string::npos) {
      CHECK(source.compare(first, wait.size(), wait) == 0);
      continue;
    }
    // gemv_kernel: before its wait, no activation, norm weight or output is named.
    ++early;
    const std::size_t waits = source.find(wait, body);
    REQUIRE(waits != std::string::npos);
    const std::string before = source.substr(body, waits - body);
    for (const std::string name : {"a.x", "a.norm_weight", ".out", "x_tile", "accumulate", "__syncthreads"}) {
      CAPTURE(name);
      CHECK(before.find(name) == std::string::npos);
    }
  }
  CHECK(kernels >= 15);  // the kernels of today, so that a search that finds none fails
  CHECK(early == 1);
  // Every __global__ in the file starts a line, so none escaped the search above ("static __global__", a template's
  // head on the kernel's line): write a new kernel's __global__ at the start of its line.
  int anywhere = 0;
  for (std::size_t at = source.find("__global__"); at != std::string::npos; at = source.find("__global__", at + 1))
    ++anywhere;
  CHECK(anywhere == kernels);
}

// KVS_PROGRAMMATIC_LAUNCH (tests/gpu_session.sh's A/B of programmatic dependent launch): 0 or 1; anything else
// refuses the backend with the reason, on a GPU and through the harness alike.
TEST_CASE("cuda kernels: KVS_PROGRAMMATIC_LAUNCH takes 0 or 1 and refuses anything else") {
  const test::UnsetAtExit unset{"KVS_PROGRAMMATIC_LAUNCH"};
  for (const std::string& name : kernel_backends()) {
    CAPTURE(name);
    for (const char* value : {"0", "1"}) {
      setenv("KVS_PROGRAMMATIC_LAUNCH", value, 1);
      CHECK_NOTHROW(test::make_test_backend(name));
    }
    for (const std::string value : {"2", "on", "", "01"}) {
      CAPTURE(value);
      setenv("KVS_PROGRAMMATIC_LAUNCH", value.c_str(), 1);
      const std::string reason = std::string("KVS_PROGRAMMATIC_LAUNCH=") + value + ": expected 0 (";
      CHECK_THROWS_WITH_AS(test::make_test_backend(name), doctest::Contains(reason.c_str()), std::invalid_argument);
    }
    unsetenv("KVS_PROGRAMMATIC_LAUNCH");
  }
}

TEST_CASE("cuda kernels: RoPE tables and rotations equal the CPU backend and the definition, positions past 2^16 included") {
  CpuBackend cpu(1);
  std::mt19937 gen(9);
  // Every backend calls rope_cos_sin, so comparing them cannot see an error in it: the CPU's table is checked
  // against the definition in long double, which an angle computed in float (off by ~6e-3 rad at 100,000) fails.
  for (int head_dim : {2, 32, 96})
    for (int pos : {0, 2047, 100000}) {
      CAPTURE(head_dim); CAPTURE(pos);
      const int n = 70;
      std::vector<float> table(std::size_t(n) * head_dim);
      cpu.rope_table(table.data(), consecutive_positions(cpu, pos, n).data(), n, head_dim);
      for (int t = 0; t < n; ++t)
        for (int pair = 0; pair < head_dim / 2; ++pair) {
          const long double angle = (long double)(pos + t) * std::pow(10000.0L, -2.0L * pair / head_dim);
          CHECK(std::abs(table[std::size_t(t) * head_dim + 2 * pair] - std::cos(angle)) <= 1e-6L);
          CHECK(std::abs(table[std::size_t(t) * head_dim + 2 * pair + 1] - std::sin(angle)) <= 1e-6L);
        }
    }
  const std::vector<float> long_table = test::rope_table(16385, 128);  // the reference for the long table below
  test::for_each_backend(kernel_backends(), [&](Backend& b) {
    for (int head_dim : {2, 32, 96})
      for (int n : {1, 70})
        for (int pos : {0, 2047, 100000}) {
          CAPTURE(head_dim); CAPTURE(n); CAPTURE(pos);
          const int heads = 3;
          std::vector<float> table(std::size_t(n) * head_dim);
          cpu.rope_table(table.data(), consecutive_positions(cpu, pos, n).data(), n, head_dim);
          Buffer d_table(b, table.size());
          b.rope_table(d_table.data(), consecutive_positions(b, pos, n).data(), n, head_dim);
          CHECK(worst_excess(test::from_backend(b, d_table), table, 1e-6f) <= 0);

          std::vector<float> x = random_vector(std::size_t(n) * heads * head_dim, gen);
          Buffer d_x = test::to_backend(b, x), d_cpu_table = test::to_backend(b, table);
          cpu.rope(x.data(), table.data(), n, heads, head_dim);
          b.rope(d_x.data(), d_cpu_table.data(), n, heads, head_dim);
          CHECK(worst_excess(test::from_backend(b, d_x), x, 1e-6f) <= 0);
        }
    // A table of more (position, pair) threads than 4,096 blocks of 256 hold: a prefill of 16,385 positions with
    // heads of 128 once left the rows past 16,383 unwritten (its grid was capped, as a grid-stride kernel's is).
    const int n = 16385, head_dim = 128;
    Buffer d_table(b, long_table.size());
    b.rope_table(d_table.data(), consecutive_positions(b, 0, n).data(), n, head_dim);
    CHECK(worst_excess(test::from_backend(b, d_table), long_table, 1e-6f) <= 0);
  });
}

// Runs the backend's attention over `positions` rows (negative: an empty row holding NaN) for queries
// at pos .. pos + n - 1 and compares with the reference.
// rotate_at_read: keys and queries unrotated, attention rotates them (chapter 04's within-window RoPE).
// Rows are kv_dim + stride_pad floats apart: 3 by default, so that the stride is honoured and a head starts off 16
// bytes (a kernel cannot load it 16 bytes at a time); a multiple of 4 (0: the model's caches) puts every head on
// 16 bytes, as the decoding kernel's 16-byte loads need (version 9, book 07).
static void check_attention(Backend& b, std::mt19937& gen, const AttentionShape& shape,
                            const std::vector<int>& positions, bool explicit_positions, int first_position,
                            Window window, int pos, int n, bool rotate_at_read = false, int stride_pad = 3) {
  CAPTURE(shape.n_heads); CAPTURE(shape.n_kv_heads); CAPTURE(shape.head_dim);
  CAPTURE(positions.size()); CAPTURE(pos); CAPTURE(n); CAPTURE(window.size); CAPTURE(window.sinks);
  CAPTURE(rotate_at_read); CAPTURE(stride_pad);
  const int rows = static_cast<int>(positions.size()), kv_dim = shape.n_kv_heads * shape.head_dim;
  const int stride = kv_dim + stride_pad;
  const int dim = shape.n_heads * shape.head_dim;
  std::vector<float> keys = random_vector(std::size_t(rows) * stride, gen), values = random_vector(keys.size(), gen);
  // A row that no query of the call may see holds NaN - an empty row, or one hidden by the window from every
  // query: it must never be read, or must count for nothing (0 · NaN is NaN, so even a weight of 0 shows).
  for (int r = 0; r < rows; ++r) {
    const int key_pos = explicit_positions ? positions[r] : first_position + r;
    bool seen = false;
    for (int i = 0; i < n; ++i) seen = seen || key_visible(pos + i, key_pos, window);
    if (!seen)
      for (int j = 0; j < stride; ++j)
        keys[std::size_t(r) * stride + j] = values[std::size_t(r) * stride + j] = std::numeric_limits<float>::quiet_NaN();
  }
  const std::vector<float> q = random_vector(std::size_t(n) * dim, gen);
  const std::vector<float> table = rotate_at_read ? test::rope_table(window.size, shape.head_dim) : std::vector<float>{};
  const KvView host_view{.keys = keys.data(), .values = values.data(), .rows = rows, .row_stride = stride,
                         .row_positions = explicit_positions ? positions.data() : nullptr,
                         .first_position = first_position, .window = window,
                         .read_rope = rotate_at_read ? table.data() : nullptr};
  std::vector<float> want(q.size()), want_weights(std::size_t(n) * shape.n_heads * rows);
  reference_attention(want.data(), q.data(), pos, n, host_view, shape, want_weights.data());

  Buffer d_keys = test::to_backend(b, keys), d_values = test::to_backend(b, values), d_q = test::to_backend(b, q);
  // Scratch of NaN: the split kernel's merge must read only the partials this launch wrote.
  Buffer d_out(b, q.size()), scratch = test::nan_buffer(b, b.attention_scratch_floats(shape, rows, 1));
  Buffer d_table = test::to_backend(b, table);
  IntBuffer d_positions(b, positions.size());  // a view's row positions live in backend memory too
  b.from_host(d_positions.data(), positions.data(), positions.size());
  KvView view = host_view;
  view.keys = d_keys.data(), view.values = d_values.data();
  if (explicit_positions) view.row_positions = d_positions.data();
  if (rotate_at_read) view.read_rope = d_table.data();
  const IntBuffer query_positions = consecutive_positions(b, pos, n);
  b.attention(d_out.data(), d_q.data(), query_positions.data(), n, view, shape, {scratch.data(), scratch.size()}, nullptr);
  CHECK(worst_excess(test::from_backend(b, d_out), want, 1e-4f) <= 0);
  // Observed: the same output, and the weights (poisoned first, so every entry must be written).
  Buffer d_weights = test::to_backend(b, std::vector<float>(want_weights.size(), NAN));
  b.attention(d_out.data(), d_q.data(), query_positions.data(), n, view, shape, {scratch.data(), scratch.size()},
              d_weights.data());
  CHECK(worst_excess(test::from_backend(b, d_out), want, 1e-4f) <= 0);
  CHECK(worst_excess(test::from_backend(b, d_weights), want_weights, 1e-5f) <= 0);
}

// The slots' positions of a ring of 600 (4 sinks, then 596 slots in turn) after position 1,000, four slots empty.
static std::vector<int> ring_of_600() {
  std::vector<int> ring(600);
  const int query = 1000;
  for (int slot = 0; slot < 600; ++slot) ring[slot] = slot < 4 ? slot : -1;
  for (int position = query - 595; position <= query; ++position) ring[4 + (position - 4) % 596] = position;
  for (int slot : {10, 11, 300, 599}) ring[slot] = -1;
  return ring;
}

static std::vector<int> consecutive(int rows, int first) {
  std::vector<int> p(rows);
  for (int r = 0; r < rows; ++r) p[r] = first + r;
  return p;
}

TEST_CASE("cuda kernels: attention equals the plain-loop reference on every kind of view") {
  std::mt19937 gen(10);
  test::for_each_backend(kernel_backends(), [&](Backend& b) {
    const AttentionShape mha{4, 4, 32}, gqa{6, 2, 96}, mqa{4, 1, 256};
    // Decode: one query over every cached row (the chapters' cache), lengths around warp and block sizes.
    for (int rows : {1, 31, 33, 97, 255, 257, 1023, 2048})
      check_attention(b, gen, mha, consecutive(rows, 0), false, 0, {}, rows - 1, 1);
    for (const AttentionShape& shape : {gqa, mqa})
      check_attention(b, gen, shape, consecutive(97, 0), false, 0, {}, 96, 1);
    // Decoding blocks serve up to 4 query heads of one KV head (the largest divisor of the group): groups of 8
    // (two blocks per KV head) and 5 (one head per block); head_dim 40 and 64 (two elements per lane); rows
    // around a chunk (16 rows by default; 64, the former default) and the rows a warp loads at once (4).
    const AttentionShape group8{8, 1, 64}, group5{10, 2, 40};
    for (int rows : {15, 16, 17, 63, 64, 65, 67, 130}) {
      check_attention(b, gen, group8, consecutive(rows, 0), false, 0, {}, rows - 1, 1);
      check_attention(b, gen, group5, consecutive(rows, 0), false, 0, {}, rows - 1, 1);
    }
    // Past 64 chunks of 16 rows (1,024) the chunks grow: 1,025 rows are 61 chunks of 17 rows, the last of 5
    // (chunks of 16 would be 65, more than the default's 64 chunks); 4,200 rows are 64 chunks of 66, the last of 42.
    check_attention(b, gen, group8, consecutive(1025, 0), false, 0, {}, 1024, 1);
    check_attention(b, gen, group8, consecutive(4200, 0), false, 0, {}, 4199, 1);
    // Prefill: causal over the whole prompt, and a chunk after a cached prefix.
    check_attention(b, gen, gqa, consecutive(70, 0), false, 0, {}, 0, 70);
    check_attention(b, gen, mha, consecutive(257, 0), false, 0, {}, 193, 64);
    // Prefill in tiles of 64 queries and 64 keys (attention_tiled_kernel): 130 queries (three tiles, the last
    // of 2), head_dim 40 and 64 (padded to the kernel's 64); a whole buffer whose rows past the last query are
    // unwritten (NaN) from inside a tile on; a window without sinks that hides whole tiles of keys from the
    // first tiles of queries; a ring with a window and sinks, its empty slots NaN, several queries.
    check_attention(b, gen, group5, consecutive(130, 0), false, 0, {}, 0, 130);
    std::vector<int> prefilled = consecutive(300, 0);
    std::fill(prefilled.begin() + 200, prefilled.end(), -1);
    check_attention(b, gen, group8, prefilled, false, 0, {}, 100, 100);
    check_attention(b, gen, mha, consecutive(400, 0), false, 0, Window{.size = 70, .sinks = 0}, 200, 130);
    check_attention(b, gen, gqa, {0, 1, 2, 3, 140, 141, 142, 143, 144, 129, 130, 131, -1, -1, 132, 133}, true, 0,
          Window{.size = 20, .sinks = 4}, 140, 5);
    // A view that starts past position 0, and a window with sinks over a contiguous view.
    check_attention(b, gen, mha, consecutive(40, 100), false, 100, {}, 120, 20);
    check_attention(b, gen, gqa, consecutive(257, 0), false, 0, Window{.size = 64, .sinks = 4}, 250, 7);
    // A ring: per-row positions out of order, empty slots holding NaN, a window with sinks.
    std::vector<int> ring = {0, 1, 2, 3, 140, 141, 142, 143, 144, 129, 130, 131, -1, -1, 132, 133};
    check_attention(b, gen, gqa, ring, true, 0, Window{.size = 12, .sinks = 4}, 144, 1);
    check_attention(b, gen, mqa, ring, true, 0, Window{.size = 20, .sinks = 4}, 140, 5);
    // Read-time rotation over the same ring, past the window (sinks moved up to it) and before it fills.
    check_attention(b, gen, gqa, ring, true, 0, Window{.size = 12, .sinks = 4}, 144, 1, true);
    check_attention(b, gen, mqa, ring, true, 0, Window{.size = 20, .sinks = 4}, 140, 5, true);
    check_attention(b, gen, mha, consecutive(33, 0), false, 0, Window{.size = 40, .sinks = 0}, 20, 13, true);
    // Nothing visible at all (a deliberately broken cache): the output is 0, not NaN.
    check_attention(b, gen, mha, {-1, -1, 500}, true, 0, {}, 10, 1);
    // Decoding over a long view runs split into chunks of rows (16 rows or more each) and merged: a whole
    // preallocated buffer whose rows past the query are unwritten (NaN), whole chunks past the query's row;
    // a window with sinks that hides whole chunks (a chunk with nothing visible must add nothing); a ring
    // of 600 slots, out of order, with empty slots, stored rotated and rotated at read time.
    std::vector<int> buffer = consecutive(1100, 0);
    std::fill(buffer.begin() + 701, buffer.end(), -1);
    check_attention(b, gen, gqa, buffer, false, 0, {}, 700, 1);
    check_attention(b, gen, mha, consecutive(1100, 0), false, 0, Window{.size = 300, .sinks = 4}, 1099, 1);
    check_attention(b, gen, mqa, ring_of_600(), true, 0, Window{.size = 600, .sinks = 4}, 1000, 1);
    check_attention(b, gen, gqa, ring_of_600(), true, 0, Window{.size = 600, .sinks = 4}, 1000, 1, true);
    // Heads on 16 bytes (rows kv_dim or kv_dim + 4 floats apart), where the decoding kernel's lanes may load their
    // numbers side by side, 16 bytes at a time (8 for two numbers), each load all inside the head or not made -
    // head_dim 36 (two numbers a lane, the last lane's the head's last two), 96 (four, lanes 24-31 idle), 128 (the
    // synthetic model's), 132 (eight: lane 16's second load past the head) and 256; a ring with empty NaN slots, a
    // window with sinks, a buffer unwritten (NaN) past the query, rounds of rows past a chunk's end (17, 130 rows).
    const AttentionShape head36{4, 2, 36}, head128{16, 4, 128}, head132{4, 2, 132};
    for (const AttentionShape& shape : {mha, group8, head36, gqa, head128, head132, mqa})
      for (int pad : {0, 4}) {
        check_attention(b, gen, shape, consecutive(17, 0), false, 0, {}, 16, 1, false, pad);
        check_attention(b, gen, shape, consecutive(130, 0), false, 0, {}, 129, 1, false, pad);
      }
    // 4,200 rows: 64 chunks of 66 rows, 4 or 5 rounds a warp, each one's loads issued during the round before.
    check_attention(b, gen, head128, consecutive(4200, 0), false, 0, {}, 4199, 1, false, 0);
    for (const AttentionShape& shape : {head36, head128, head132}) {
      check_attention(b, gen, shape, buffer, false, 0, {}, 700, 1, false, 0);
      check_attention(b, gen, shape, consecutive(1100, 0), false, 0, Window{.size = 300, .sinks = 4}, 1099, 1, false, 0);
      check_attention(b, gen, shape, ring_of_600(), true, 0, Window{.size = 600, .sinks = 4}, 1000, 1, false, 0);
    }
  });
}

// KVS_DECODE_CHUNKS (tests/gpu_session.sh's chunks step: more, shorter chunks keep more of a GPU busy; the merge
// reads every chunk's partial): other cuts of the views above give the reference's output. 256,1 cuts a buffer of
// 1,100 rows into 220 chunks (of 5) but the 701 rows its query visits into 234 (of 3), more than the buffer's cut:
// the grid must hold the most chunks of any query; 256 rows into 256 chunks of one row, the most the merge takes;
// 7,5 cuts into chunks no round of a block's warps fills; 1,1 into one chunk, never merged. Anything but SPLITS,ROWS
// in range refuses the backend with the reason, on a GPU and through the harness alike.
TEST_CASE("cuda kernels: decoding cut into other chunks (KVS_DECODE_CHUNKS) equals the reference, and bad values are refused") {
  const test::UnsetAtExit unset{"KVS_DECODE_CHUNKS"};
  std::mt19937 gen(11);
  const AttentionShape mha{4, 4, 32}, gqa{6, 2, 96}, group8{8, 1, 64}, head36{4, 2, 36}, head128{16, 4, 128};
  std::vector<int> buffer = consecutive(1100, 0);
  std::fill(buffer.begin() + 701, buffer.end(), -1);
  for (const std::string chunks : {"256,1", "128,16", "7,5", "1,1"}) {
    CAPTURE(chunks);
    setenv("KVS_DECODE_CHUNKS", chunks.c_str(), 1);
    test::for_each_backend(kernel_backends(), [&](Backend& b) {
      check_attention(b, gen, gqa, buffer, false, 0, {}, 700, 1);
      check_attention(b, gen, group8, consecutive(256, 0), false, 0, {}, 255, 1);
      check_attention(b, gen, mha, consecutive(1100, 0), false, 0, Window{.size = 300, .sinks = 4}, 1099, 1);
      check_attention(b, gen, gqa, ring_of_600(), true, 0, Window{.size = 600, .sinks = 4}, 1000, 1, true);
      // Heads on 16 bytes (16-byte loads), cut into chunks of many rounds a warp (1,1: one chunk of 701 rows).
      check_attention(b, gen, head128, buffer, false, 0, {}, 700, 1, false, 0);
      check_attention(b, gen, head36, consecutive(1100, 0), false, 0, Window{.size = 300, .sinks = 4}, 1099, 1, false, 0);
    });
  }
  for (const std::string& name : kernel_backends()) {
    CAPTURE(name);
    check_refused(name, "KVS_DECODE_CHUNKS", {"0,16", "257,16", "64", "64,0", "64,65537", "64,16x", ",16", "64,", "", "x", "64, 16", "64,+16"},
                  "expected SPLITS,ROWS");
  }
}

// The split decoding kernel counts each (KV head, tile, sequence)'s finished chunks in counters the backend holds
// (kArrivalCounters, 16,384): a launch with more is refused before it writes past them. 257 query heads, each
// its own KV head (a tile of 1), in 64 sequences of 65 rows (split: five chunks each) are 16,448.
TEST_CASE("cuda kernels: a split decoding launch with more blocks per chunk than the arrival counters is refused") {
  test::for_each_backend(kernel_backends(), [&](Backend& b) {
    const AttentionShape shape{257, 257, 32};
    const int rows = 65, sequences = 64, dim = shape.n_heads * shape.head_dim;
    const Buffer keys = test::to_backend(b, std::vector<float>(std::size_t(rows) * dim, 0.5f));
    const Buffer q = test::to_backend(b, std::vector<float>(std::size_t(sequences) * dim, 0.5f));
    std::vector<int> host_positions(sequences, rows - 1);
    IntBuffer query_positions(b, host_positions.size());
    b.from_host(query_positions.data(), host_positions.data(), host_positions.size());
    const KvView view{.keys = keys.data(), .values = keys.data(), .rows = rows, .row_stride = dim};
    std::vector<Backend::AttentionPart> parts;
    for (int i = 0; i < sequences; ++i) parts.push_back({i, 1, view});
    Buffer out(b, std::size_t(sequences) * dim), scratch(b, b.attention_scratch_floats(shape, rows, sequences));
    CHECK_THROWS_WITH_AS(b.attention_batch(out.data(), q.data(), query_positions.data(), parts, shape,
                                           {scratch.data(), scratch.size()}),
                         doctest::Contains("decode fewer sequences at once"), std::invalid_argument);
  });
}

// A NaN in a key that a query sees (a corrupted cache; a coded group with a NaN scale, kv_format.h) turns that query's
// heads of its KV head NaN, as the reference's softmax does; the other KV head's heads stay the reference's. The
// CUDA kernels' online softmax took its running maximum with fmaxf, which drops a NaN operand, and divided by the
// sum only where it was > 0, which a NaN sum is not: the output came out finite (0 or the other rows' average)
// wherever the NaN row was. Decode in one chunk (16 rows, one round of the block's warps) and in many (the NaN in a
// later chunk and in the first), prefill in tiles of queries, and the observed path (attention_kernel).
TEST_CASE("attention: a NaN in a visible key turns its heads' output NaN on every backend and kernel") {
  std::mt19937 gen(13);
  const AttentionShape shape{4, 2, 32};  // query heads 0 and 1 read KV head 0, whose key in bad_row holds the NaN
  const int kv_dim = shape.n_kv_heads * shape.head_dim, dim = shape.n_heads * shape.head_dim;
  struct Case {
    int rows, bad_row, pos, n;
  };
  for (const Case k : {Case{16, 9, 15, 1}, Case{64, 0, 63, 1}, Case{97, 50, 96, 1}, Case{1, 0, 0, 1},
                       Case{1100, 700, 1099, 1}, Case{1100, 0, 1099, 1}, Case{130, 0, 0, 130}, Case{130, 100, 0, 130}}) {
    CAPTURE(k.rows); CAPTURE(k.bad_row); CAPTURE(k.n);
    std::vector<float> keys = random_vector(std::size_t(k.rows) * kv_dim, gen), values = random_vector(keys.size(), gen);
    keys[std::size_t(k.bad_row) * kv_dim + 5] = std::numeric_limits<float>::quiet_NaN();
    const std::vector<float> q = random_vector(std::size_t(k.n) * dim, gen);
    const KvView host_view{.keys = keys.data(), .values = values.data(), .rows = k.rows, .row_stride = kv_dim};
    std::vector<float> want(q.size());
    reference_attention(want.data(), q.data(), k.pos, k.n, host_view, shape, nullptr);
    // The reference's own answer, the rule this test holds every backend to: NaN exactly where a query sees the row.
    for (int i = 0; i < k.n; ++i)
      for (int h = 0; h < shape.n_heads; ++h)
        REQUIRE(std::isnan(want[std::size_t(i) * dim + h * shape.head_dim]) == (h < 2 && k.pos + i >= k.bad_row));
    for (const std::string& name : test::test_backend_names()) {
      CAPTURE(name);
      const std::unique_ptr<Backend> owner = test::make_test_backend(name);
      Backend& b = *owner;
      Buffer d_keys = test::to_backend(b, keys), d_values = test::to_backend(b, values), d_q = test::to_backend(b, q);
      Buffer d_out(b, q.size()), scratch(b, b.attention_scratch_floats(shape, k.rows, 1));
      Buffer d_weights(b, std::size_t(k.n) * shape.n_heads * k.rows);
      KvView view = host_view;
      view.keys = d_keys.data(), view.values = d_values.data();
      const IntBuffer positions = consecutive_positions(b, k.pos, k.n);
      for (float* weights : {static_cast<float*>(nullptr), d_weights.data()}) {
        CAPTURE(weights != nullptr);
        b.attention(d_out.data(), d_q.data(), positions.data(), k.n, view, shape, {scratch.data(), scratch.size()},
                    weights);
        const std::vector<float> got = test::from_backend(b, d_out);
        int wrong = 0;
        for (std::size_t i = 0; i < got.size(); ++i)
          wrong += std::isnan(want[i]) ? !std::isnan(got[i])
                                       : !(std::abs(got[i] - want[i]) <= 1e-4f + kRtol * std::abs(want[i]));
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("backends: a copy between overlapping ranges is refused on every backend") {
  for (const std::string& name : test::test_backend_names()) {
    CAPTURE(name);
    auto backend = test::make_test_backend(name);
    Buffer buffer(*backend, 100);
    CHECK_THROWS_WITH_AS(backend->copy(buffer.data() + 10, buffer.data(), 20), "copy: the source and destination ranges overlap",
                         std::invalid_argument);
    CHECK_NOTHROW(backend->copy(buffer.data() + 20, buffer.data(), 20));
  }
}

// The CPU backend does nothing for a call of no tokens; a CUDA launch with a grid of no blocks is an error (on a GPU
// and in the harness), so every CUDA operation must check for it. The model never asks, but a batch may hold an empty
// part (attention_batch calls attention per part).
TEST_CASE("backends: an operation on no tokens does nothing on every backend") {
  const AttentionShape shape{4, 2, 32};
  const int dim = shape.n_heads * shape.head_dim, kv_dim = shape.n_kv_heads * shape.head_dim, hidden = 96, rows = 8;
  for (const std::string& name : test::test_backend_names()) {
    CAPTURE(name);
    const std::unique_ptr<Backend> owner = test::make_test_backend(name);
    Backend& b = *owner;
    // Every output holds -7, and must still hold it after the calls.
    const std::vector<float> sevens(std::size_t(rows) * hidden, -7.0f);
    Buffer out = test::to_backend(b, sevens), gate = test::to_backend(b, sevens), up = test::to_backend(b, sevens),
           normed = test::to_backend(b, sevens), keys = test::to_backend(b, sevens), values = test::to_backend(b, sevens);
    const Buffer x = test::to_backend(b, std::vector<float>(std::size_t(rows) * hidden, 0.5f));
    const std::vector<float> w(std::size_t(dim) * dim, 0.01f);  // large enough for each matrix below
    const float* w_dim = b.upload_matrix(w.data(), dim, dim);
    const float* w_hidden = b.upload_matrix(w.data(), hidden, dim);
    const float* w_down = b.upload_matrix(w.data(), dim, hidden);
    // No token ids or positions: a call of no tokens has none to read.
    const int* const tokens = nullptr;
    const int* const positions = nullptr;
    Buffer scratch(b, b.attention_scratch_floats(shape, rows, 2));
    const KvView view{.keys = x.data(), .values = x.data(), .rows = rows, .row_stride = kv_dim};

    b.embed(out.data(), x.data(), tokens, 0, dim);
    b.matmul(out.data(), x.data(), w_dim, 0, dim, dim);
    b.rmsnorm(out.data(), x.data(), x.data(), 0, dim);
    b.rope_table(out.data(), positions, 0, shape.head_dim);
    b.rope(out.data(), x.data(), 0, shape.n_heads, shape.head_dim);
    b.attention(out.data(), x.data(), positions, 0, view, shape, {scratch.data(), scratch.size()}, nullptr);
    b.attention(out.data(), x.data(), positions, 0, view, shape, {scratch.data(), scratch.size()}, out.data());
    const std::vector<Backend::AttentionPart> parts{{0, 0, view}, {0, 0, view}};
    b.attention_batch(out.data(), x.data(), positions, parts, shape, {scratch.data(), scratch.size()});
    b.write_rows(keys.data(), kv_dim, positions, Ring::unbounded(), x.data(), 0, kv_dim);
    b.write_key_value_rows(keys.data(), values.data(), kv_dim, positions, Ring::unbounded(), x.data(), x.data(),
                           0, kv_dim);
    b.swiglu(gate.data(), x.data(), 0);
    b.add(out.data(), x.data(), 0);
    const std::vector<Backend::Product> products{{out.data(), w_dim, dim}};
    b.norm_products(normed.data(), x.data(), x.data(), 0, dim, shape.head_dim, products);
    b.norm_swiglu(gate.data(), up.data(), normed.data(), x.data(), x.data(), w_hidden, w_hidden, 0, dim, hidden);
    b.matmul_add(out.data(), gate.data(), x.data(), w_down, 0, hidden, dim);
    for (const Buffer* buffer : {&out, &gate, &up, &normed, &keys, &values}) CHECK(test::from_backend(b, *buffer) == sevens);
  }
}
