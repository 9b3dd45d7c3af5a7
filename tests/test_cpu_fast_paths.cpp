// The CPU backend's fast paths against the plain definitions they replace: its team of threads (every
// task exactly once; work really handed to another thread), attention's run of visible rows against
// key_visible row by row, matrix products split into tasks against a plain loop, and results that do not
// depend on the thread count, bit for bit; and the weights the backend copies are the bytes the plan counts.
#include <doctest/doctest.h>

#include <Eigen/Core>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu_backend.h"
#include "equivalence.h"
#include "generate.h"
#include "kv_cache.h"
#include "model.h"
#include "03_preallocated_cache/preallocated_kv_cache.h"
#include "cli.h"
#include "sampler.h"
#include "test_util.h"
#include "tokenizer.h"
#include "worker_pool.h"

using namespace kvs;

TEST_CASE("worker pool: every task runs exactly once, for 0 to 70 tasks, on 1, 2 and 3 threads, job after job") {
  for (int threads : {1, 2, 3}) {
    CAPTURE(threads);
    WorkerPool pool(threads);
    CHECK(pool.threads() == threads);
    std::vector<std::atomic<int>> runs(70);
    for (int round = 0; round < 3; ++round)
      for (int tasks = 0; tasks <= 70; ++tasks) {
        for (auto& r : runs) r = 0;
        pool.run(tasks, [&](int i) { runs[i].fetch_add(1); });
        int wrong = 0;
        for (int i = 0; i < 70; ++i) wrong += runs[i].load() != (i < tasks ? 1 : 0);
        CHECK(wrong == 0);
      }
  }
}

// An exception leaving a worker's thread ends the process (std::terminate): an out-of-memory in a product's task
// used to abort the run instead of giving its one line. The pool hands it to the caller, after every other task.
TEST_CASE("worker pool: a task that throws has its exception rethrown on the caller, every other task still run once") {
  for (int threads : {1, 2, 3}) {
    CAPTURE(threads);
    WorkerPool pool(threads);
    std::vector<std::atomic<int>> runs(70);
    for (int round = 0; round < 3; ++round) {
      for (auto& r : runs) r = 0;
      // Tasks 13 and 41 throw (either may be the one rethrown); the others count themselves.
      CHECK_THROWS_WITH_AS(pool.run(70, [&](int i) {
                             if (i == 13 || i == 41) throw std::runtime_error("task " + std::to_string(i));
                             runs[i].fetch_add(1);
                           }),
                           doctest::Contains("task "), std::runtime_error);
      // One thread: the tasks run in order on the caller, as a loop would, and stop at task 13.
      auto ran = [&](int i) { return threads == 1 ? i < 13 : i != 13 && i != 41; };
      int wrong = 0;
      for (int i = 0; i < 70; ++i) wrong += runs[i].load() != (ran(i) ? 1 : 0);
      CHECK(wrong == 0);
      // The pool is whole again: the next job runs every task, and nothing is rethrown.
      for (auto& r : runs) r = 0;
      pool.run(70, [&](int i) { runs[i].fetch_add(1); });
      wrong = 0;
      for (int i = 0; i < 70; ++i) wrong += runs[i].load() != 1;
      CHECK(wrong == 0);
    }
  }
}

// Jobs of few tasks and of many, back to back: a worker that found the last job's tasks all claimed could, in
// the moment the caller was setting up the next job (its task count written, its number not yet), take that
// count for the last job's and claim a task past its end - run with either job's function, or once more in the
// new job - and count it into the new job's finished tasks. More threads than this machine's 2 cores, so that
// a thread is preempted anywhere.
TEST_CASE("worker pool: back-to-back jobs of different sizes never run a task twice, nor one past a job's end") {
  WorkerPool pool(3);
  std::vector<std::atomic<int>> runs(64);
  std::atomic<int> past_end{0};
  int wrong = 0;
  for (int job = 0; job < (test::sanitizer_run() ? 20000 : 200000); ++job) {
    const int tasks = job % 2 == 0 ? 2 : 64;
    pool.run(tasks, [&, tasks](int i) {
      if (i >= tasks) past_end.fetch_add(1);
      else runs[i].fetch_add(1);
    });
    for (int i = 0; i < 64; ++i) wrong += runs[i].exchange(0) != (i < tasks ? 1 : 0);
  }
  CHECK(wrong == 0);
  CHECK(past_end.load() == 0);
}

TEST_CASE("worker pool: a worker takes the tasks the caller has not claimed, also after sleeping") {
  // Two tasks that each wait until the other has started: they can only meet if two threads run them at
  // once. Either thread may claim either task (a spinning worker can see the job before the caller claims
  // task 0: this test once assumed the caller always ran task 0, and failed under the sanitizer). A pool
  // whose workers never run anything runs them one after the other: task 0 waits 10 s, gives up, and fails.
  WorkerPool pool(2);
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the worker goes to sleep
    std::atomic<int> started{0};
    std::thread::id ran_on[2];
    bool met[2] = {false, false};
    pool.run(2, [&](int i) {
      ran_on[i] = std::this_thread::get_id();
      started.fetch_add(1);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (started.load() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      met[i] = started.load() == 2;
    });
    CAPTURE(attempt);
    CHECK(met[0]);
    CHECK(met[1]);
    CHECK(ran_on[0] != ran_on[1]);
  }
}

TEST_CASE("visible rows: the run of rows visible_rows gives is exactly the rows key_visible shows, at every boundary") {
  for (int first_position : {0, 5})
    for (const Window window : {Window{0, 0}, Window{1, 0}, Window{6, 0}, Window{40, 0}})
      for (int rows : {0, 1, 7, 33}) {
        const KvView view{.rows = rows, .first_position = first_position, .window = window};
        for (int query = first_position - 3; query <= first_position + rows + 8; ++query) {
          CAPTURE(first_position);
          CAPTURE(window.size);
          CAPTURE(rows);
          CAPTURE(query);
          int begin = -1, end = -1;
          REQUIRE(view.visible_rows(query, begin, end));
          REQUIRE(0 <= begin);
          REQUIRE(begin <= end);
          REQUIRE(end <= rows);
          int disagree = 0;
          for (int r = 0; r < rows; ++r)
            disagree += key_visible(query, view.position_of(r), window) != (begin <= r && r < end);
          CHECK(disagree == 0);
        }
      }
  // Where the visible rows need not be one run, it says so (attention then asks key_visible row by row).
  const int positions[3] = {0, -1, 1};
  int begin = 0, end = 0;
  CHECK_FALSE((KvView{.rows = 3, .row_positions = positions}.visible_rows(1, begin, end)));
  CHECK_FALSE((KvView{.rows = 3, .window = Window{4, 1}}.visible_rows(1, begin, end)));
}

namespace {

// out (n, d_out) = x (n, d_in) · wᵀ, w (d_out, d_in), in double: what the backend's matmul computes.
std::vector<float> plain_matmul(const std::vector<float>& x, const std::vector<float>& w, int n, int d_in, int d_out) {
  std::vector<float> out(std::size_t(n) * d_out);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d_out; ++j) {
      double sum = 0;
      for (int k = 0; k < d_in; ++k) sum += double(x[std::size_t(i) * d_in + k]) * w[std::size_t(j) * d_in + k];
      out[std::size_t(i) * d_out + j] = static_cast<float>(sum);
    }
  return out;
}

}  // namespace

TEST_CASE("matmul: split into tasks of output columns, it equals a plain loop, and 1 and 2 threads give the same bits") {
  // Shapes whose products are split into several tasks (>= 2^17 multiply-adds each), with a last task
  // shorter than the others, and the shipped model's shapes, which run as one task.
  struct Shape {
    int n, d_in, d_out;
  };
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Shape s : {Shape{1, 300, 1000}, Shape{5, 257, 777}, Shape{64, 128, 384}, Shape{80, 130, 200}, Shape{1, 128, 384},
                        Shape{1, 384, 128}}) {
    CAPTURE(s.n);
    CAPTURE(s.d_in);
    CAPTURE(s.d_out);
    std::vector<float> x(std::size_t(s.n) * s.d_in), w(std::size_t(s.d_out) * s.d_in);
    for (float& v : x) v = normal(gen);
    for (float& v : w) v = normal(gen);
    const std::vector<float> expected = plain_matmul(x, w, s.n, s.d_in, s.d_out);
    std::vector<float> one(expected.size()), two(expected.size());
    CpuBackend cpu1(1), cpu2(2);
    cpu1.matmul(one.data(), x.data(), cpu1.upload_matrix(w.data(), s.d_out, s.d_in), s.n, s.d_in, s.d_out);
    cpu2.matmul(two.data(), x.data(), cpu2.upload_matrix(w.data(), s.d_out, s.d_in), s.n, s.d_in, s.d_out);
    // Sums of up to 384 products of N(0, 1) values: |sum| ~ 20, float rounding ~1e-5 of that.
    CHECK(max_abs_difference(one, expected) <= 1e-3f);
    CHECK(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("matmul: a token in a product of up to 64 tokens gets the bits it gets alone, in every tile, chunk and task") {
  // cpu_backend.cpp's few-token product: tiles of 1 to 8 tokens (AVX-512; else 1 to 4), more tokens in more tiles
  // that take the inputs a chunk at a time (d_in 1100 with 16-column tasks: chunks of 512 inputs, the last 76), d_in
  // past a block of 16 by a remainder (257, and 76), outputs in whole tiles, narrower ones and a last partial packet
  // (777, 5, 40), and products split into several tasks (d_in 300 x 1000 outputs, 1100 x 40). Each row of an
  // n-token product must be the very bits of that row alone (chapter 08's batched decode relies on it), and near
  // the plain loop.
  struct Shape {
    int d_in, d_out;
  };
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Shape s : {Shape{128, 384}, Shape{384, 128}, Shape{257, 777}, Shape{40, 5}, Shape{300, 1000}, Shape{1100, 40}}) {
    CAPTURE(s.d_in);
    CAPTURE(s.d_out);
    constexpr int kMost = 64;
    std::vector<float> x(std::size_t(kMost) * s.d_in), w(std::size_t(s.d_out) * s.d_in);
    for (float& v : x) v = normal(gen);
    for (float& v : w) v = normal(gen);
    CpuBackend cpu(2);
    const float* weights = cpu.upload_matrix(w.data(), s.d_out, s.d_in);
    std::vector<float> alone(std::size_t(kMost) * s.d_out);
    for (int i = 0; i < kMost; ++i)
      cpu.matmul(alone.data() + std::size_t(i) * s.d_out, x.data() + std::size_t(i) * s.d_in, weights, 1, s.d_in, s.d_out);
    const std::vector<float> expected = plain_matmul(x, w, kMost, s.d_in, s.d_out);
    // Sums of up to 1100 products of N(0, 1) values: |sum| ~ 33, float rounding ~1e-5 of that.
    CHECK(max_abs_difference(alone, expected) <= 1e-3f);
    for (int n = 2; n <= kMost; ++n) {
      CAPTURE(n);
      std::vector<float> batch(std::size_t(n) * s.d_out);
      cpu.matmul(batch.data(), x.data(), weights, n, s.d_in, s.d_out);
      CHECK(std::memcmp(batch.data(), alone.data(), batch.size() * sizeof(float)) == 0);
    }
  }
}

// CpuBackend::set_few_token_limit, which chapter 08's products experiment uses to time both paths: up to the limit
// a product takes the few-token product (each token the bits it gets alone), past it Eigen's GEMM (near the plain
// loop, not those bits); 0 sends every product to Eigen, and a negative limit is refused.
TEST_CASE("matmul: the few-token limit picks the path, the default keeps a batch's bits, 0 sends every product to Eigen") {
  std::mt19937 gen(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int n = 8, d_in = 128, d_out = 384;  // the shipped model's w1, a decode step of 8 sequences
  std::vector<float> x(std::size_t(n) * d_in), w(std::size_t(d_out) * d_in);
  for (float& v : x) v = normal(gen);
  for (float& v : w) v = normal(gen);
  const std::vector<float> expected = plain_matmul(x, w, n, d_in, d_out);
  CpuBackend cpu(1);
  CHECK(cpu.few_token_limit() == 64);
  const float* weights = cpu.upload_matrix(w.data(), d_out, d_in);
  std::vector<float> alone(std::size_t(n) * d_out), few(alone.size()), eigen(alone.size());
  for (int i = 0; i < n; ++i)
    cpu.matmul(alone.data() + std::size_t(i) * d_out, x.data() + std::size_t(i) * d_in, weights, 1, d_in, d_out);
  cpu.matmul(few.data(), x.data(), weights, n, d_in, d_out);
  cpu.set_few_token_limit(0);
  cpu.matmul(eigen.data(), x.data(), weights, n, d_in, d_out);
  cpu.set_few_token_limit(n - 1);  // one token fewer than the product: Eigen too
  std::vector<float> below(alone.size());
  cpu.matmul(below.data(), x.data(), weights, n, d_in, d_out);
  CHECK(std::memcmp(few.data(), alone.data(), few.size() * sizeof(float)) == 0);
  // Sums of 128 products of N(0, 1) values: |sum| ~ 11, float rounding ~1e-5 of that.
  CHECK(max_abs_difference(eigen, expected) <= 1e-3f);
  CHECK(std::memcmp(eigen.data(), below.data(), eigen.size() * sizeof(float)) == 0);
  // Eigen's GEMM sums in another order: the path did change (with the limit ignored, these are equal).
  CHECK(std::memcmp(eigen.data(), few.data(), eigen.size() * sizeof(float)) != 0);
  CHECK_THROWS_WITH_AS(cpu.set_few_token_limit(-1), doctest::Contains("give 0 or more"), std::invalid_argument);
  CHECK(cpu.few_token_limit() == n - 1);  // a refused limit leaves the one before
}

TEST_CASE("matmul: one token gets the very bits of Eigen's matrix-vector product, which the book's single-sequence runs used") {
  // cpu_backend.cpp's few-token product sums in the order of Eigen 3.4's GEMV for d_in >= 128 (blocks of 16
  // inputs), so chapters 00-07's logits and texts did not move when it replaced GEMV. The shipped model's four
  // shapes (q/o, k/v, w1/w3, w2; the classifier) and one of chapter 07's synthetic shapes.
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::mt19937 gen(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Shape {
    int d_in, d_out;
  };
  for (const Shape s : {Shape{128, 128}, Shape{128, 64}, Shape{128, 384}, Shape{384, 128}, Shape{128, 256}, Shape{2048, 5632}}) {
    const int d_in = s.d_in, d_out = s.d_out;
    CAPTURE(d_in);
    CAPTURE(d_out);
    std::vector<float> x(d_in), w(std::size_t(d_out) * d_in), ours(d_out), eigen(d_out);
    for (float& v : x) v = normal(gen);
    for (float& v : w) v = normal(gen);
    CpuBackend cpu(1);
    const float* transposed = cpu.upload_matrix(w.data(), d_out, d_in);  // (d_in, d_out), host memory
    cpu.matmul(ours.data(), x.data(), transposed, 1, d_in, d_out);
    Eigen::Map<RowMajor>(eigen.data(), 1, d_out).noalias() =
        Eigen::Map<const RowMajor>(x.data(), 1, d_in) * Eigen::Map<const RowMajor>(transposed, d_in, d_out);
    CHECK(std::memcmp(ours.data(), eigen.data(), ours.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("weights: the CPU backend holds exactly Model::weight_bytes, with a shared and with a separate classifier") {
  // The memory plan's weights (runtime.cpp) are Model::weight_bytes; what the backend really copies must be that.
  for (const bool shared : {true, false}) {
    CAPTURE(shared);
    const ModelConfig config{.dim = 48, .hidden_dim = 72, .n_layers = 3, .n_heads = 6, .n_kv_heads = 2,
                             .vocab_size = 40, .seq_len = 16, .shared_classifier = shared};
    const Checkpoint checkpoint = Checkpoint::synthetic(config);
    CpuBackend backend(1);
    const Model model(checkpoint, backend, 4, 16);
    CHECK(backend.weight_bytes() == Model::weight_bytes(config));
  }
}

TEST_CASE("threads: 1 and 2 threads give bit-identical logits and the same greedy and sampled tokens") {
  // A 700-position prompt: the prefill's products are split into many tasks and every decode step's
  // attention is handed to the second thread (2 x 700 x 4 x 32 multiply-adds, over cpu_backend.cpp's
  // 2^17), so both split paths run.
  const Checkpoint checkpoint(find_data_file("kjv-gpt.bin"));
  const std::vector<int> prompt = encode_bytes(test::validation_text().substr(0, 700));
  for (const float temperature : {0.0f, 0.8f}) {
    CAPTURE(temperature);
    std::vector<std::vector<float>> logits[2];
    std::vector<int> tokens[2];
    for (int threads : {1, 2}) {
      CpuBackend backend(threads);
      Model model(checkpoint, backend);
      ch03::PreallocatedKvCache cache(backend, checkpoint.config(), 760);
      Sampler sampler(checkpoint.config().vocab_size, {.temperature = temperature, .top_k = 20, .seed = 7});
      auto& seen = logits[threads - 1];
      tokens[threads - 1] = generate_cached(model, cache, sampler, prompt, 50, 0, {}, [&](int, std::span<const float> l) {
                              seen.emplace_back(l.begin(), l.end());
                            }).tokens;
    }
    CHECK(tokens[0] == tokens[1]);
    REQUIRE(logits[0].size() == logits[1].size());
    int different_steps = 0;
    for (std::size_t s = 0; s < logits[0].size(); ++s)
      different_steps += std::memcmp(logits[0][s].data(), logits[1][s].data(), logits[0][s].size() * sizeof(float)) != 0;
    CHECK(different_steps == 0);
  }
}
