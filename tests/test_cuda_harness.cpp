// The CUDA harness itself: kernels written as CUDA (compiled here by g++ through the harness) get CUDA's
// semantics for barriers, shuffles, votes and shared memory, and the usual mistakes are reported: a
// missing barrier (under some thread order), a wrong shuffle mask, a barrier some threads skip, and -
// under AddressSanitizer - an out-of-bounds read, with its line.
#define KVS_CUDA_HARNESS 1
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "address_sanitizer.h"
#include "cuda/cuda_support.h"

namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// Sum of `in` (blockDim.x floats) by the textbook shared-memory tree. `with_barriers` = false drops the
// barriers between the levels: each level then reads values the level before may not have written yet.
// Dynamic shared memory, which the harness fills with NaN for every block: a static __shared__ array would
// keep the previous launch's values, which can hide the missing barrier.
__global__ void tree_sum(float* out, const float* in, bool with_barriers) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  KVS_DYNAMIC_SHARED(float, partial);
  const unsigned t = threadIdx.x;
  partial[t] = in[t];
  if (with_barriers) __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) partial[t] += partial[t + stride];
    if (with_barriers) __syncthreads();
  }
  if (t == 0) *out = partial[0];
}

// Sum over the warp with xor shuffles, `mask` naming the lanes that take part.
__global__ void warp_sum(float* out, const float* in, unsigned mask) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  float v = in[threadIdx.x];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(mask, v, offset);
  out[threadIdx.x] = v;
}

// Only the first half of the warp calls the shuffle, with a mask that names all 32 lanes.
__global__ void divergent_shuffle(float* out) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  float v = 1.0f;
  if (threadIdx.x < 16) v = __shfl_down_sync(kFullMask, v, 1);
  out[threadIdx.x] = v;
}

// Kernels that break cuda_support.h's rule (KVS_WAIT_FOR_PREVIOUS_KERNEL() first): one never waits, one meets
// its block at a barrier before it waits.
__global__ void never_waits(float* out) { out[threadIdx.x] = 1.0f; }
__global__ void barrier_before_waiting(float* out) {
  __syncthreads();
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  out[threadIdx.x] = 1.0f;
}

// A barrier inside a branch that half of the block skips.
__global__ void barrier_in_branch(float* out) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  if (threadIdx.x < 64) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

__global__ void shuffles(int* down, int* up, int* xor16, int* xor_later, int* broadcast, unsigned* ballot, int* any_all) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const int lane = static_cast<int>(threadIdx.x);
  down[lane] = __shfl_down_sync(kFullMask, lane, 3);
  up[lane] = __shfl_up_sync(kFullMask, lane, 2, 16);
  xor16[lane] = __shfl_xor_sync(kFullMask, lane, 8, 16);
  xor_later[lane] = __shfl_xor_sync(kFullMask, lane, 16, 16);  // a later segment: own value; an earlier one: read
  broadcast[lane] = __shfl_sync(kFullMask, lane * 10, 5);
  ballot[lane] = __ballot_sync(kFullMask, lane % 3 == 0);
  // One bit per vote: any of one lane, any of none, all of every lane, all but one lane.
  any_all[lane] = __any_sync(kFullMask, lane == 7) * 8 + __any_sync(kFullMask, 0) * 4 +
                  __all_sync(kFullMask, lane < 32) * 2 + __all_sync(kFullMask, lane != 7);
}

// Each block adds its blockIdx.x + 1 into one counter; dynamic shared memory is read before it is written.
__global__ void blocks_and_shared(float* counter, float* first_shared_value) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  KVS_DYNAMIC_SHARED(float, scratch);
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) *first_shared_value = scratch[0];
    atomicAdd(counter, static_cast<float>(blockIdx.x + 1));
  }
}


template <class T>
struct DeviceArray {
  explicit DeviceArray(std::size_t n) : n(n) { KVS_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T))); }
  ~DeviceArray() { cudaFree(p); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    KVS_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  T* p = nullptr;
  std::size_t n;
};

float run_tree_sum(bool with_barriers) {
  std::vector<float> in(256);
  std::iota(in.begin(), in.end(), 1.0f);
  DeviceArray<float> d_in(256), d_out(1);
  KVS_CUDA_CHECK(cudaMemcpy(d_in.p, in.data(), 256 * sizeof(float), cudaMemcpyHostToDevice));
  KVS_LAUNCH(tree_sum, dim3(1), dim3(256), 256 * sizeof(float), nullptr, d_out.p, d_in.p, with_barriers);
  return d_out.host()[0];
}

// Restores the order KVS_CUDA_HARNESS_ORDER asks for (CTest runs some tests again in a random order).
struct OrderGuard {
  ~OrderGuard() {
    const char* order = std::getenv("KVS_CUDA_HARNESS_ORDER");
    kvs::cuda_harness::set_thread_order(order ? order : "sequential");
  }
};

}  // namespace

TEST_CASE("cuda harness: a shared-memory reduction with its barriers is right under every thread order") {
  OrderGuard guard;
  for (const std::string order : {"sequential", "reverse", "random:1", "random:2"}) {
    CAPTURE(order);
    kvs::cuda_harness::set_thread_order(order);
    CHECK(run_tree_sum(true) == 256.0f * 257.0f / 2.0f);
  }
}

TEST_CASE("cuda harness: the same reduction without its barriers gives a wrong sum under some thread order") {
  OrderGuard guard;
  int wrong = 0;
  for (const char* order : {"sequential", "reverse", "random:1", "random:2"}) {
    kvs::cuda_harness::set_thread_order(order);
    const float sum = run_tree_sum(false);
    MESSAGE(std::string(order) << ": " << sum);
    wrong += sum != 256.0f * 257.0f / 2.0f;
  }
  CHECK(wrong > 0);
}

TEST_CASE("cuda harness: warp shuffles and votes return what CUDA defines") {
  DeviceArray<int> down(32), up(32), xor16(32), xor_later(32), broadcast(32), any_all(32);
  DeviceArray<unsigned> ballot(32);
  KVS_LAUNCH(shuffles, dim3(1), dim3(32), 0, nullptr, down.p, up.p, xor16.p, xor_later.p, broadcast.p, ballot.p,
             any_all.p);
  const auto d = down.host(), u = up.host(), x = xor16.host(), xl = xor_later.host(), b = broadcast.host(),
             a = any_all.host();
  const auto v = ballot.host();
  unsigned expected_ballot = 0;
  for (int lane = 0; lane < 32; lane += 3) expected_ballot |= 1u << lane;
  for (int lane = 0; lane < 32; ++lane) {
    CAPTURE(lane);
    CHECK(d[lane] == (lane + 3 < 32 ? lane + 3 : lane));        // past the warp's end: own value
    CHECK(u[lane] == (lane % 16 >= 2 ? lane - 2 : lane));       // segments of 16 lanes
    CHECK(x[lane] == (lane ^ 8));
    CHECK(xl[lane] == (lane < 16 ? lane : lane - 16));
    CHECK(b[lane] == 50);
    CHECK(v[lane] == expected_ballot);
    CHECK(a[lane] == 8 + 2);
  }
}

TEST_CASE("cuda harness: a warp reduction with the full mask sums 32 lanes") {
  std::vector<float> in(32);
  std::iota(in.begin(), in.end(), 0.0f);
  DeviceArray<float> d_in(32), d_out(32);
  KVS_CUDA_CHECK(cudaMemcpy(d_in.p, in.data(), sizeof(float) * 32, cudaMemcpyHostToDevice));
  KVS_LAUNCH(warp_sum, dim3(1), dim3(32), 0, nullptr, d_out.p, d_in.p, kFullMask);
  for (float s : d_out.host()) CHECK(s == 496.0f);
}

// A kernel's error after its wait for the kernel before surfaces when it finishes, at the next call that
// synchronises (the last launch stays pending, harness/cuda_runtime_harness.h), as a GPU reports it then.
TEST_CASE("cuda harness: a shuffle whose mask leaves out calling lanes is reported, naming the kernel") {
  DeviceArray<float> d_in(32), d_out(32);
  KVS_CUDA_CHECK(cudaMemset(d_in.p, 0, sizeof(float) * 32));
  CHECK_THROWS_WITH_AS((KVS_LAUNCH(warp_sum, dim3(1), dim3(32), 0, nullptr, d_out.p, d_in.p, 0x0000ffffu), cudaDeviceSynchronize()),
                       doctest::Contains("kernel warp_sum: thread (16,0,0) of block (0,0,0) calls a shuffle with mask "
                                         "0x0000ffff, which leaves out its own lane 16"),
                       std::runtime_error);
}

TEST_CASE("cuda harness: a shuffle that some lanes of its mask never reach is reported, not a hang") {
  DeviceArray<float> d_out(32);
  CHECK_THROWS_WITH_AS((KVS_LAUNCH(divergent_shuffle, dim3(1), dim3(32), 0, nullptr, d_out.p), cudaDeviceSynchronize()),
                       doctest::Contains("for lane 16, which is exited"), std::runtime_error);
}

TEST_CASE("cuda harness: a barrier some threads skip is reported, not a hang") {
  DeviceArray<float> d_out(128);
  CHECK_THROWS_WITH_AS((KVS_LAUNCH(barrier_in_branch, dim3(1), dim3(128), 0, nullptr, d_out.p), cudaDeviceSynchronize()),
                       doctest::Contains("kernel barrier_in_branch: __syncthreads() is never reached by thread (64,0,0)"),
                       std::runtime_error);
  // The harness is usable again after the error.
  CHECK(run_tree_sum(true) == 256.0f * 257.0f / 2.0f);
}

// On a GPU a kernel launched programmatically may start before the one ahead of it has finished (cuda_support.h):
// a thread that synchronises or ends before KVS_WAIT_FOR_PREVIOUS_KERNEL() is reported, whatever the kernel
// computed.
TEST_CASE("cuda harness: a kernel that does not wait for the kernel before it first is reported") {
  DeviceArray<float> d_out(64);
  CHECK_THROWS_WITH_AS(KVS_LAUNCH(never_waits, dim3(1), dim3(64), 0, nullptr, d_out.p),
                       doctest::Contains("kernel never_waits: thread (0,0,0) of block (0,0,0) ends without "
                                         "KVS_WAIT_FOR_PREVIOUS_KERNEL()"),
                       std::runtime_error);
  CHECK_THROWS_WITH_AS(KVS_LAUNCH(barrier_before_waiting, dim3(1), dim3(64), 0, nullptr, d_out.p),
                       doctest::Contains("kernel barrier_before_waiting: thread (0,0,0) of block (0,0,0) reaches "
                                         "__syncthreads() without KVS_WAIT_FOR_PREVIOUS_KERNEL()"),
                       std::runtime_error);
  CHECK(run_tree_sum(true) == 256.0f * 257.0f / 2.0f);  // usable again after the error
}

TEST_CASE("cuda harness: every block runs, and dynamic shared memory starts as NaN") {
  DeviceArray<float> counter(1), first(1);
  KVS_CUDA_CHECK(cudaMemset(counter.p, 0, sizeof(float)));
  KVS_LAUNCH(blocks_and_shared, dim3(10), dim3(64), 64 * sizeof(float), nullptr, counter.p, first.p);
  CHECK(counter.host()[0] == 55.0f);
  CHECK(std::isnan(first.host()[0]));
  CHECK_THROWS_WITH_AS(KVS_LAUNCH(blocks_and_shared, dim3(1), dim3(2048), 0, nullptr, counter.p, first.p),
                       doctest::Contains("a block of 2048 threads"), std::runtime_error);
  // A GPU refuses a grid past 65,535 blocks in y or z (refused before any block runs here).
  CHECK_THROWS_WITH_AS(KVS_LAUNCH(blocks_and_shared, dim3(1, 65536), dim3(64), 0, nullptr, counter.p, first.p),
                       doctest::Contains("a grid of (1,65536,1) blocks"), std::runtime_error);
  CHECK_THROWS_WITH_AS(KVS_LAUNCH(blocks_and_shared, dim3(1, 1, 65536), dim3(64), 0, nullptr, counter.p, first.p),
                       doctest::Contains("a grid of (1,1,65536) blocks"), std::runtime_error);
  CHECK(counter.host()[0] == 55.0f);  // no block of a refused launch ran
}

// A GPU refuses a launch asking for more than 48 KB of dynamic shared memory unless cudaFuncSetAttribute raised that
// kernel's limit first (the tiled prefill attention's heads over 32 need it: CudaBackend's constructor).
TEST_CASE("cuda harness: dynamic shared memory over 48 KB only up to what cudaFuncSetAttribute allowed the kernel") {
  DeviceArray<float> counter(1), first(1);
  KVS_CUDA_CHECK(cudaMemset(counter.p, 0, sizeof(float)));
  KVS_LAUNCH(blocks_and_shared, dim3(1), dim3(64), 48 * 1024, nullptr, counter.p, first.p);  // no attribute needed
  CHECK_THROWS_WITH_AS(KVS_LAUNCH(blocks_and_shared, dim3(1), dim3(64), 64 * 1024, nullptr, counter.p, first.p),
                       doctest::Contains("65536 bytes of dynamic shared memory, over the 49152 a kernel gets unless "
                                         "cudaFuncSetAttribute"),
                       std::runtime_error);
  CHECK(counter.host()[0] == 1.0f);  // the refused launch ran no block
  KVS_CUDA_CHECK(cudaFuncSetAttribute(blocks_and_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
  KVS_LAUNCH(blocks_and_shared, dim3(2), dim3(64), 64 * 1024, nullptr, counter.p, first.p);
  CHECK(counter.host()[0] == 1.0f + 1.0f + 2.0f);  // the first launch's block, then this one's two
  CHECK_THROWS_WITH_AS(KVS_LAUNCH(blocks_and_shared, dim3(1), dim3(64), 96 * 1024, nullptr, counter.p, first.p),
                       doctest::Contains("(it allows 65536)"), std::runtime_error);
  CHECK(counter.host()[0] == 4.0f);
  CHECK(cudaFuncSetAttribute(blocks_and_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024) ==
        cudaErrorInvalidValue);  // past the device's 227 KB
}

namespace {
// x[i] += *amount for every i < n: the amount is read from memory when the kernel runs.
__global__ void add_from_memory(float* x, const float* amount, int n) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += *amount;
}
}  // namespace

TEST_CASE("cuda harness: a stream capture records launches and copies, and each graph launch runs them again") {
  cudaStream_t stream = nullptr;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceArray<float> x(40), amount(1);
  KVS_CUDA_CHECK(cudaMemset(x.p, 0, 40 * sizeof(float)));
  float host_amount = 1.0f;
  const float two = 2.0f;
  cudaGraph_t graph = nullptr;
  // What CUDA refuses inside a capture, the harness refuses too, each call on its own capture: a refused call
  // invalidates the capture, whose end then fails and returns no graph.
  const std::vector<std::pair<const char*, std::function<cudaError_t()>>> refused = {
      {"cudaMemcpy", [&] { return cudaMemcpy(&host_amount, amount.p, sizeof(float), cudaMemcpyDeviceToHost); }},
      {"cudaStreamSynchronize", [&] { return cudaStreamSynchronize(stream); }},
      {"cudaMalloc", [&] {
         void* allocated = &host_amount;
         const cudaError_t status = cudaMalloc(&allocated, 64);
         CHECK(allocated == nullptr);
         return status;
       }},
      {"cudaFree", [&] { return cudaFree(x.p); }},  // and x stays allocated: it is read below
      {"cudaMemset", [&] { return cudaMemset(x.p, 0, sizeof(float)); }},
  };
  for (const auto& refusal : refused) {
    const char* call = refusal.first;  // not a structured binding: Clang before 16 cannot capture one (CAPTURE)
    const std::function<cudaError_t()>& make = refusal.second;
    CAPTURE(call);
    KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    KVS_LAUNCH(add_from_memory, dim3(2), dim3(32), 0, stream, x.p, amount.p, 40);  // recorded, not run
    CHECK(make() == cudaErrorStreamCaptureUnsupported);
    graph = reinterpret_cast<cudaGraph_t>(&host_amount);
    CHECK(cudaStreamEndCapture(stream, &graph) == cudaErrorStreamCaptureInvalidated);
    CHECK(graph == nullptr);
  }
  KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));  // the capture has ended
  KVS_CUDA_CHECK(cudaMemcpyAsync(amount.p, &two, sizeof(float), cudaMemcpyHostToDevice, stream));
  KVS_LAUNCH(add_from_memory, dim3(2), dim3(32), 0, stream, x.p, amount.p, 40);  // recorded, not run
  KVS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(x.host()[39] == 0.0f);  // nothing ran while capturing
  cudaGraphExec_t exec = nullptr;
  KVS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  KVS_CUDA_CHECK(cudaGraphDestroy(graph));
  KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CHECK(x.host()[0] == 4.0f);  // twice: copy 2, then add it
  CHECK(x.host()[39] == 4.0f);
  // Destroying a graph is refused inside a capture too (an H100 refused it, 2026-11-27), and the graph stays.
  KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  CHECK(cudaGraphExecDestroy(exec) == cudaErrorStreamCaptureUnsupported);
  CHECK(cudaStreamEndCapture(stream, &graph) == cudaErrorStreamCaptureInvalidated);
  KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CHECK(x.host()[0] == 6.0f);
  KVS_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KVS_CUDA_CHECK(cudaStreamDestroy(stream));
}

namespace {
// out (32) = value: the kernel ahead.
__global__ void fill(float* out, float value) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  out[threadIdx.x] = value;
}
// out (32) = 2 · in, in read before the wait for the kernel before (breaking cuda_support.h's rule) or after it.
__global__ void twice(float* out, const float* in, bool read_before_waiting) {
  const float early = read_before_waiting ? in[threadIdx.x] : 0.0f;
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  out[threadIdx.x] = 2.0f * (read_before_waiting ? early : in[threadIdx.x]);
}
// x (32) = value, written before the wait for the kernel before (breaking the rule) or after it.
__global__ void overwrite(float* x, float value, bool write_before_waiting) {
  if (write_before_waiting) x[threadIdx.x] = value;
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  if (!write_before_waiting) x[threadIdx.x] = value;
}
}  // namespace

// Launched programmatically, a kernel may start before the kernel ahead of it has finished: the harness runs its
// first block up to its wait first, so what it reads there is what memory held before that kernel ran, and what
// it writes there the kernel ahead may still read.
TEST_CASE("cuda harness: what a programmatic launch reads or writes before its wait comes before the kernel ahead of it") {
  DeviceArray<float> in(32), out(32);
  for (const bool programmatic : {false, true}) {
    for (const bool read_before_waiting : {false, true}) {
      CAPTURE(programmatic);
      CAPTURE(read_before_waiting);
      const kvs::cuda::LaunchQueue queue{nullptr, programmatic};
      KVS_CUDA_CHECK(cudaMemset(in.p, 0, 32 * sizeof(float)));
      KVS_LAUNCH(fill, dim3(1), dim3(32), 0, queue, in.p, 1.0f);
      KVS_LAUNCH(twice, dim3(1), dim3(32), 0, queue, out.p, in.p, read_before_waiting);
      // The rule kept, or a plain launch (which starts once the kernel ahead has finished): 2. Broken: the 0 that
      // `in` held before fill ran.
      const float expected = programmatic && read_before_waiting ? 0.0f : 2.0f;
      for (float v : out.host()) CHECK(v == expected);

      // The other way round: the kernel ahead reads `in` (twice: out = 2 · in), the next one overwrites it.
      KVS_CUDA_CHECK(cudaMemset(in.p, 0, 32 * sizeof(float)));
      KVS_LAUNCH(twice, dim3(1), dim3(32), 0, queue, out.p, in.p, false);
      KVS_LAUNCH(overwrite, dim3(1), dim3(32), 0, queue, in.p, 7.0f, read_before_waiting);
      const float doubled = programmatic && read_before_waiting ? 14.0f : 0.0f;  // twice read the 7 written early
      for (float v : out.host()) CHECK(v == doubled);
    }
  }
}

// The kernel ahead runs to its end before any copy, synchronisation or graph; a recorded graph's kernels
// overlap as the stream's do.
TEST_CASE("cuda harness: a pending kernel finishes before a copy, a synchronisation or a graph sees memory") {
  DeviceArray<float> in(32), out(32);
  const kvs::cuda::LaunchQueue queue{nullptr, true};
  KVS_CUDA_CHECK(cudaMemset(in.p, 0, 32 * sizeof(float)));
  KVS_LAUNCH(fill, dim3(1), dim3(32), 0, queue, in.p, 3.0f);
  CHECK(in.host()[31] == 3.0f);  // cudaMemcpy finished it
  KVS_LAUNCH(fill, dim3(1), dim3(32), 0, queue, in.p, 4.0f);
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  float host[32];
  std::memcpy(host, in.p, sizeof host);  // the harness's device memory is the host's
  CHECK(host[0] == 4.0f);

  cudaStream_t stream = nullptr;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvs::cuda::LaunchQueue captured{stream, true};
  KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  KVS_LAUNCH(fill, dim3(1), dim3(32), 0, captured, in.p, 5.0f);
  KVS_LAUNCH(twice, dim3(1), dim3(32), 0, captured, out.p, in.p, true);
  cudaGraph_t graph = nullptr;
  KVS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  KVS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  KVS_CUDA_CHECK(cudaGraphDestroy(graph));
  KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CHECK(out.host()[0] == 8.0f);   // twice read `in` before fill's 5: the 4 it held
  CHECK(in.host()[0] == 5.0f);    // and fill finished before the graph ended
  KVS_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KVS_CUDA_CHECK(cudaStreamDestroy(stream));
}

#if KVS_ADDRESS_SANITIZER
namespace {
constexpr int kOutOfBoundsLine = __LINE__ + 3;  // the read below
__global__ void read_one_past(float* out, const float* in, int n) {
  KVS_WAIT_FOR_PREVIOUS_KERNEL();
  out[threadIdx.x] = in[threadIdx.x + n];  // thread 0 reads in[n]: one past the end
}
}  // namespace

TEST_CASE("cuda harness: under AddressSanitizer an out-of-bounds read in a kernel is caught with its line") {
  int err[2];
  REQUIRE(pipe(err) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The child only reports through ASan: doctest's crash handlers and output stay out of it.
    std::signal(SIGABRT, SIG_DFL);
    std::signal(SIGSEGV, SIG_DFL);
    if (std::freopen("/dev/null", "w", stdout) == nullptr) _exit(3);
    dup2(err[1], 2);
    close(err[0]);
    float *in = nullptr, *out = nullptr;
    cudaMalloc(&in, 32 * sizeof(float));
    cudaMalloc(&out, 32 * sizeof(float));
    cudaMemset(in, 0, 32 * sizeof(float));
    KVS_LAUNCH(read_one_past, dim3(1), dim3(32), 0, nullptr, out, in, 32);
    cudaDeviceSynchronize();  // the read comes after the kernel's wait: it runs when the pending kernel finishes
    _exit(0);
  }
  close(err[1]);
  std::string report;
  char buf[4096];
  for (ssize_t got; (got = read(err[0], buf, sizeof buf)) > 0;) report.append(buf, static_cast<std::size_t>(got));
  close(err[0]);
  int status = 0;
  waitpid(child, &status, 0);
  CHECK_FALSE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK(report.find("heap-buffer-overflow") != std::string::npos);
  CHECK(report.find("test_cuda_harness.cpp:" + std::to_string(kOutOfBoundsLine)) != std::string::npos);
}
#endif
