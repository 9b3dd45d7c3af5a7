#pragma once
// Chapter 08's experiments (08_paged_batching --experiment NAME): each prints a table on stderr and, with
// --csv, writes its rows.
#include <cstdint>
#include <string>
#include <vector>

#include "runtime.h"
#include "scheduler.h"
#include "trace.h"

namespace kvs::ch08 {

struct Setup {
  Runtime& rt;
  std::vector<Request> requests;  // the trace (--trace or generated)
  TraceShape shape;               // how a generated trace was drawn (throughput takes its lengths)
  int block_size = 16;
  std::int64_t kv_memory = 0;     // bytes of the block pool
  PoolFormat format;              // how the pool stores its rows (--kv-format, chapter 10)
  SchedulerOptions options;
  std::vector<int> batch_sizes, block_sizes;
  std::vector<int> token_counts;  // products: tokens a product takes (--tokens)
  int rounds = 3;                 // throughput, batching: measurements of every batch size or kind, interleaved
  std::string csv;
};

// A pool of as many blocks of `block_size` positions as `bytes` holds (UsageError when not even one).
BlockPool make_pool(Setup& s, int block_size, std::int64_t bytes, int max_sequences);
// Every pool of --kv-memory that `experiment` will make, checked before it prints or runs anything: one that holds
// no block, or that a request of the trace could never fit, would otherwise stop it after its first rows.
// Throws UsageError or std::invalid_argument (a request, named).
void check_pools(const Setup& s, const std::string& experiment);

int serve_trace(Setup& s);        // serve the trace once; every output checked against the request alone
int throughput(Setup& s);         // decode step time and tokens/s per batch size, against the roofline
// What throughput's roofline probes allocate beside the pool, for the run's memory plan (ch03::roofline_probe_bytes
// for the largest batch's step: on the host a buffer of its bytes to read, on a GPU two to copy between).
std::int64_t throughput_probe_bytes(const Setup& s);
int memory_waste(Setup& s);       // reserved vs live K/V per block size, and a max-length reservation
int batching(Setup& s);           // continuous vs static batching on one trace
int preemption(Setup& s);         // a pool too small: preempt and recompute, outputs unchanged
int break_double_free(Setup& s);  // a block freed twice: one request's keys in another's context
int products(Setup& s);           // the CPU's few-token product against Eigen's GEMM, per token count (products.cpp)
std::int64_t products_bytes(const Setup& s);  // its inputs and outputs, for the run's memory plan

}  // namespace kvs::ch08
