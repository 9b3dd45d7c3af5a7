// Chapter 08's products experiment: the CPU backend's two ways to multiply a few tokens by a weight matrix, timed
// side by side on one layer. Up to 64 tokens the backend takes its own few-token product (each packet of
// weights loaded once for a tile of tokens, every token's sums in the order one token alone gets: a batch's token
// gets the bits it gets alone); past 64 Eigen's GEMM, which first copies ("packs") the weights it reads. Which is
// faster at n tokens depends on the model's shapes and on the machine (its registers, its caches): this prints it,
// on the model's own first layer (its weights as the backend holds them; a synthetic model's are random).
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "cpu_backend.h"
#include "csv.h"
#include "experiments.h"
#include "progress.h"
#include "timing.h"

namespace kvs::ch08 {
namespace {

struct Product {
  const float* w;  // a (d_out, d_in) matrix as uploaded (upload_matrix: stored as the backend's matmul reads it)
  int d_in, d_out;
};

// Layer 0's products (model.cpp: q, k, v from the normed input, o, then the MLP's w1 and w3, and w2).
std::vector<Product> layer_products(const Model& model) {
  const ModelConfig& c = model.config();
  const Model::LayerWeights& w = model.layer_weights(0);
  return {{w.wq, c.dim, c.dim},         {w.wk, c.dim, c.kv_dim()},      {w.wv, c.dim, c.kv_dim()}, {w.wo, c.dim, c.dim},
          {w.w1, c.dim, c.hidden_dim},  {w.w3, c.dim, c.hidden_dim},    {w.w2, c.hidden_dim, c.dim}};
}

}  // namespace

std::int64_t products_bytes(const Setup& s) {
  const ModelConfig& c = s.rt.model.config();
  const int most = *std::max_element(s.token_counts.begin(), s.token_counts.end());
  const int widest = std::max(c.dim, c.hidden_dim);
  return 2 * std::int64_t(most) * widest * std::int64_t(sizeof(float));  // the inputs and the outputs
}

int products(Setup& s) {
  auto* cpu = dynamic_cast<CpuBackend*>(&s.rt.backend);
  if (!cpu) throw UsageError("--experiment products times the CPU backend's two product paths: drop --backend");
  const ModelConfig& c = s.rt.model.config();
  const std::vector<Product> products = layer_products(s.rt.model);
  const int most = *std::max_element(s.token_counts.begin(), s.token_counts.end());
  const int widest = std::max(c.dim, c.hidden_dim);

  // Random inputs for the most tokens asked (the timing depends on the shapes, not the numbers).
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Buffer x(*cpu, std::size_t(most) * widest), out(*cpu, std::size_t(most) * widest);
  std::vector<float> host_x(std::size_t(most) * widest);
  for (float& v : host_x) v = normal(gen);
  cpu->from_host(x.data(), host_x.data(), host_x.size());

  // A layer's seven products for n tokens, through the path `limit` picks, timed as one pass (ms).
  auto layer_pass = [&](int n, int limit) {
    cpu->set_few_token_limit(limit);
    Stopwatch watch;
    for (const Product& p : products) cpu->matmul(out.data(), x.data(), p.w, n, p.d_in, p.d_out);
    return watch.milliseconds();
  };
  // The backend's limit, given back however the function ends (a product that throws included).
  struct RestoreLimit {
    CpuBackend* cpu;
    int limit;
    ~RestoreLimit() { cpu->set_few_token_limit(limit); }
  } restore{cpu, cpu->few_token_limit()};
  const int few_tokens = restore.limit;
  enum Path { kFewToken, kEigen };
  const int limit_of[2] = {1 << 30, 0};
  // Every token count and path in each round, the paths in turn within a count and the counts in turn within a
  // round, as the throughput experiment takes its batch sizes: a slow minute of the machine slows one round of
  // every cell rather than every round of one. A cell's passes run for about 10 ms after one untimed pass.
  std::vector<std::vector<double>> passes(2 * s.token_counts.size());
  Progress progress("products", "cells");
  const std::int64_t cells = std::int64_t(s.rounds) * s.token_counts.size() * 2;
  std::int64_t done = 0;
  for (int round = 0; round < s.rounds; ++round)
    for (std::size_t t = 0; t < s.token_counts.size(); ++t)
      for (int path : {kFewToken, kEigen}) {
        const int n = s.token_counts[t];
        layer_pass(n, limit_of[path]);  // warm-up: the weights into the caches they fit
        std::vector<double>& cell = passes[2 * t + path];
        for (double spent = 0; spent < 10.0 || cell.size() < 3;) {
          cell.push_back(layer_pass(n, limit_of[path]));
          spent += cell.back();
        }
        progress.update(++done, cells);
      }

  std::fprintf(stderr, "layer 0's seven products (q, k, v, o: %d x %d, %d x %d, %d x %d, %d x %d; w1, w3: %d x %d; w2: "
                       "%d x %d), %d thread%s, %d round%s; microseconds per token, p50 and p99 of the passes\n",
               c.dim, c.dim, c.dim, c.kv_dim(), c.dim, c.kv_dim(), c.dim, c.dim, c.dim, c.hidden_dim, c.hidden_dim, c.dim,
               cpu->threads(), cpu->threads() == 1 ? "" : "s", s.rounds, s.rounds == 1 ? "" : "s");
  std::fprintf(stderr, "%7s %22s %22s %12s  %s\n", "tokens", "few-token p50 / p99", "Eigen p50 / p99", "few / Eigen",
               "the backend takes");
  CsvWriter csv({"--csv", s.csv},
                "threads,tokens,few_token_us_per_token_p50,few_token_us_per_token_p99,eigen_us_per_token_p50,"
                "eigen_us_per_token_p99,few_over_eigen,backend_path",
                s.rt.inputs());
  for (std::size_t t = 0; t < s.token_counts.size(); ++t) {
    const int n = s.token_counts[t];
    const double us = 1000.0 / n;  // ms per pass -> us per token
    const double few50 = percentile(passes[2 * t], 50) * us, few99 = percentile(passes[2 * t], 99) * us;
    const double eig50 = percentile(passes[2 * t + 1], 50) * us, eig99 = percentile(passes[2 * t + 1], 99) * us;
    const char* path = n <= few_tokens ? "few-token" : "Eigen";
    char few[32], eigen[32];
    std::snprintf(few, sizeof few, "%.2f / %.2f", few50, few99);
    std::snprintf(eigen, sizeof eigen, "%.2f / %.2f", eig50, eig99);
    std::fprintf(stderr, "%7d %22s %22s %11.2fx  %s\n", n, few, eigen, few50 / eig50, path);
    csv.row(cpu->threads(), n, few50, few99, eig50, eig99, few50 / eig50, path);
  }
  std::fprintf(stderr, "few / Eigen below 1: the few-token product is faster at that count; the backend takes it up to %d "
                       "tokens, whatever this machine says, so that a batch's token gets the bits it gets alone; p99: of "
                       "3 or more passes a cell and round, about their slowest\n",
               few_tokens);
  csv.commit();
  if (csv.enabled()) std::fprintf(stderr, "wrote %s\n", csv.path().c_str());
  return 0;
}

}  // namespace kvs::ch08
