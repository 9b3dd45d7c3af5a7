// The CUDA harness's scheduler: every thread of a block is a Boost.Context fiber; a thread runs until it
// reaches a synchronisation point (__syncthreads, a warp operation) or ends, and the scheduler releases a
// synchronisation point once every thread it needs has arrived - or reports why it never can.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <boost/context/fiber.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_runtime_harness.h"

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

#if defined(__SANITIZE_ADDRESS__)
// AddressSanitizer must be told when the stack changes under it (declared by hand: g++ ships no sanitizer
// headers).
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, std::size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, std::size_t* size_old);
#endif

namespace kvs::cuda_harness {
namespace ctx = boost::context;
namespace {

constexpr int kWarpSize = 32;
// Why a thread must wait first (cuda_support.h): on a GPU a kernel launched programmatically may start before
// the kernel ahead of it on the stream has finished.
constexpr const char* kNoWait =
    " without KVS_WAIT_FOR_PREVIOUS_KERNEL() (a kernel's first statement: launched programmatically it may start "
    "before the kernel ahead of it has finished)";
constexpr int kMaxThreadsPerBlock = 1024;
constexpr std::size_t kMaxDynamicShared = 227 * 1024;  // an H100's per-block limit
#if defined(__SANITIZE_ADDRESS__)
constexpr std::size_t kStackBytes = 512 * 1024;  // ASan's redzones make frames larger
#else
constexpr std::size_t kStackBytes = 128 * 1024;
#endif

// Fiber stacks, mapped once and reused by every launch; the lowest page of each is a guard page, so a
// kernel that overflows its stack faults instead of corrupting a neighbour.
class StackPool {
 public:
  ~StackPool() {
    for (void* base : free_) munmap(base, kStackBytes);
  }
  ctx::stack_context allocate() {
    void* base;
    if (!free_.empty()) {
      base = free_.back();
      free_.pop_back();
    } else {
      base = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (base == MAP_FAILED) throw std::runtime_error("CUDA harness: cannot map a thread stack");
      mprotect(base, static_cast<std::size_t>(sysconf(_SC_PAGESIZE)), PROT_NONE);
    }
    ctx::stack_context stack;
    stack.size = kStackBytes;
    stack.sp = static_cast<char*>(base) + kStackBytes;
    return stack;
  }
  void deallocate(ctx::stack_context& stack) { free_.push_back(static_cast<char*>(stack.sp) - kStackBytes); }

 private:
  std::vector<void*> free_;
};

StackPool& stack_pool() {
  static StackPool pool;
  return pool;
}

struct PooledStack {
  ctx::stack_context allocate() { return stack_pool().allocate(); }
  void deallocate(ctx::stack_context& stack) { stack_pool().deallocate(stack); }
};

enum class State { kReady, kAtBarrier, kAtWarpOp, kDone };

// Thrown inside a suspended thread to end it when its launch has failed.
struct Abandon {};

const char* state_name(State s) {
  switch (s) {
    case State::kReady: return "running";
    case State::kAtBarrier: return "waiting at __syncthreads()";
    case State::kAtWarpOp: return "waiting at a warp operation";
    case State::kDone: return "exited";
  }
  return "?";
}
const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kShuffle: return "a shuffle";
    case WarpOp::kVote: return "a vote";
    case WarpOp::kSync: return "__syncwarp";
  }
  return "?";
}

struct Thread {
  ctx::fiber fiber;      // the thread, while it is suspended
  ctx::fiber scheduler;  // where the thread returns to, while it runs
  uint3 index;
  State state = State::kReady;
  bool waited_for_previous_kernel = false;  // KVS_WAIT_FOR_PREVIOUS_KERNEL() called
  // The warp operation it waits at.
  WarpOp op = WarpOp::kSync;
  unsigned mask = 0;
  std::uint64_t value = 0;
  int source_lane = 0;
  std::uint64_t result = 0;
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  const void* stack_bottom = nullptr;
  std::size_t stack_size = 0;
#endif
};

enum class Order { kSequential, kReverse, kRandom };

class Scheduler {
 public:
  Scheduler() {
    const char* order = std::getenv("KVS_CUDA_HARNESS_ORDER");
    set_order(order ? order : "sequential");
  }
  void set_order(const std::string& s) {
    if (s == "sequential") {
      order_ = Order::kSequential;
    } else if (s == "reverse") {
      order_ = Order::kReverse;
    } else if (s.rfind("random:", 0) == 0) {
      order_ = Order::kRandom;
      random_.seed(std::strtoul(s.c_str() + 7, nullptr, 10));
    } else {
      throw std::runtime_error("KVS_CUDA_HARNESS_ORDER='" + s + "': use sequential, reverse or random:SEED");
    }
  }

  void launch(const char* kernel, dim3 grid, dim3 block, std::size_t dynamic_shared,
              const std::function<void()>& body) {
    kernel_ = kernel;
    const long threads = long(block.x) * block.y * block.z;
    if (threads < 1 || threads > kMaxThreadsPerBlock)
      fail("a block of " + std::to_string(threads) + " threads (1 to " + std::to_string(kMaxThreadsPerBlock) + " allowed)");
    if (long(grid.x) * grid.y * grid.z < 1) fail("an empty grid");
    if (dynamic_shared > kMaxDynamicShared)
      fail(std::to_string(dynamic_shared) + " bytes of dynamic shared memory (at most " +
           std::to_string(kMaxDynamicShared) + ")");
    gridDim = grid;
    blockDim = block;
    // The blocks in the threads' order too: a GPU runs them in any order, and a kernel whose blocks meet (the
    // last to finish doing more, attention_decode_kernel's merge) must work whichever comes last.
    block_order_.resize(std::size_t(grid.x) * grid.y * grid.z);  // kept between launches: no allocation per launch
    std::iota(block_order_.begin(), block_order_.end(), 0u);
    if (order_ == Order::kReverse) std::reverse(block_order_.begin(), block_order_.end());
    if (order_ == Order::kRandom) std::shuffle(block_order_.begin(), block_order_.end(), random_);
    for (const unsigned b : block_order_) {
      blockIdx = uint3{b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y)};
      // Fresh bytes per block, NaN when read as floats: shared memory starts undefined on a GPU.
      shared_.reset(dynamic_shared ? new unsigned char[dynamic_shared] : nullptr);
      if (dynamic_shared) std::memset(shared_.get(), 0xff, dynamic_shared);
      run_block(static_cast<int>(threads), body);
    }
    shared_.reset();
  }

  void* dynamic_shared() { return shared_.get(); }
  int lane() const { return current_ % kWarpSize; }
  bool inside_kernel() const { return current_ >= 0; }

  // Called by a running thread: stop at a synchronisation point until the scheduler releases it.
  void wait(State state) {
    Thread& t = threads_[current_];
    if (!t.waited_for_previous_kernel)
      fail(where(current_) + " reaches " + (state == State::kAtBarrier ? "__syncthreads()" : op_name(t.op)) + kNoWait);
    t.state = state;
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(&t.fake_stack, main_bottom_, main_size_);
#endif
    t.scheduler = std::move(t.scheduler).resume();
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(t.fake_stack, &main_bottom_, &main_size_);
#endif
    if (abandoning_) throw Abandon{};
  }
  Thread& current() { return threads_[current_]; }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(std::string("CUDA harness: kernel ") + kernel_ + ": " + what);
  }
  std::string where(int t) const {
    const uint3& i = threads_[t].index;
    return "thread (" + std::to_string(i.x) + "," + std::to_string(i.y) + "," + std::to_string(i.z) + ") of block (" +
           std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) + ")";
  }

  void run_block(int n, const std::function<void()>& body) {
    threads_.clear();
    threads_.resize(n);
    error_ = nullptr;
    for (int t = 0; t < n; ++t) {
      threads_[t].index = uint3{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
      ctx::stack_context stack = stack_pool().allocate();
#if defined(__SANITIZE_ADDRESS__)
      threads_[t].stack_bottom = static_cast<char*>(stack.sp) - stack.size;
      threads_[t].stack_size = stack.size;
#endif
      const ctx::preallocated on_stack(stack.sp, stack.size, stack);
      threads_[t].fiber = ctx::fiber(std::allocator_arg, on_stack, PooledStack{}, [this, t, &body](ctx::fiber&& scheduler) {
#if defined(__SANITIZE_ADDRESS__)
        __sanitizer_finish_switch_fiber(nullptr, &main_bottom_, &main_size_);
#endif
        threads_[t].scheduler = std::move(scheduler);
        try {
          if (!abandoning_) {  // a thread first entered while abandoning never runs the kernel
            body();
            if (!threads_[t].waited_for_previous_kernel) fail(where(t) + " ends" + kNoWait);
          }
        } catch (const Abandon&) {
          // the launch failed elsewhere: this thread's stack is unwound, it ends here
        } catch (...) {
          if (!error_) error_ = std::current_exception();
        }
        threads_[t].state = State::kDone;
#if defined(__SANITIZE_ADDRESS__)
        __sanitizer_start_switch_fiber(nullptr, main_bottom_, main_size_);
#endif
        return std::move(threads_[t].scheduler);
      });
    }
    try {
      schedule(n);
    } catch (...) {
      abandon_suspended();
      throw;
    }
    threads_.clear();
  }

  // After an error: resumes every suspended thread once with `abandoning_` set, so that its wait() throws
  // Abandon and its stack unwinds through the same (sanitizer-annotated) switches as any resume.
  void abandon_suspended() {
    abandoning_ = true;
    for (int t = 0; t < static_cast<int>(threads_.size()); ++t)
      if (threads_[t].state != State::kDone && threads_[t].fiber) resume(t);
    abandoning_ = false;
    threads_.clear();
  }

  void schedule(int n) {
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    if (order_ == Order::kReverse) std::reverse(order.begin(), order.end());
    for (;;) {
      if (order_ == Order::kRandom) std::shuffle(order.begin(), order.end(), random_);
      for (int t : order)
        if (threads_[t].state == State::kReady) resume(t);
      if (error_) std::rethrow_exception(error_);
      if (std::all_of(threads_.begin(), threads_.end(), [](const Thread& t) { return t.state == State::kDone; })) return;
      if (!release_warp_ops() && !release_barrier()) fail("deadlock in " + where(0));
    }
  }

  void resume(int t) {
    current_ = t;
    threadIdx = threads_[t].index;
#if defined(__SANITIZE_ADDRESS__)
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(&fake_stack, threads_[t].stack_bottom, threads_[t].stack_size);
#endif
    threads_[t].fiber = std::move(threads_[t].fiber).resume();
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
    current_ = -1;
  }

  // Releases every warp operation whose lanes have all arrived; throws when one never can be.
  bool release_warp_ops() {
    bool released = false;
    const int n = static_cast<int>(threads_.size());
    for (int t = 0; t < n; ++t) {
      const Thread& me = threads_[t];
      if (me.state == State::kAtWarpOp && !(me.mask >> (t % kWarpSize) & 1u))
        fail(where(t) + " calls " + op_name(me.op) + " with mask 0x" + hex(me.mask) + ", which leaves out its own lane " +
             std::to_string(t % kWarpSize));
    }
    for (int t = 0; t < n; ++t) {
      Thread& me = threads_[t];
      if (me.state != State::kAtWarpOp) continue;
      const int warp_base = t - t % kWarpSize;
      unsigned ballot = 0;
      for (int l = 0; l < kWarpSize; ++l) {
        if (!(me.mask >> l & 1u)) continue;
        if (warp_base + l >= n)
          fail(where(t) + ": " + op_name(me.op) + " with mask 0x" + hex(me.mask) + " names lane " + std::to_string(l) +
               ", which this block does not have");
        const Thread& other = threads_[warp_base + l];
        if (other.state != State::kAtWarpOp)
          fail(where(t) + " waits in " + op_name(me.op) + " with mask 0x" + hex(me.mask) + " for lane " + std::to_string(l) +
               ", which is " + state_name(other.state) + " (a wrong mask or a divergent call)");
        if (other.mask != me.mask || other.op != me.op)
          fail(where(t) + " calls " + op_name(me.op) + " with mask 0x" + hex(me.mask) + " while lane " + std::to_string(l) +
               " calls " + op_name(other.op) + " with mask 0x" + hex(other.mask));
        if (other.value) ballot |= 1u << l;
      }
      for (int l = 0; l < kWarpSize; ++l) {
        if (!(me.mask >> l & 1u)) continue;
        Thread& member = threads_[warp_base + l];
        if (member.op == WarpOp::kShuffle) {
          const int source = member.source_lane;
          if (source != l && !(me.mask >> source & 1u))
            fail(where(warp_base + l) + " shuffles from lane " + std::to_string(source) + ", outside its mask 0x" +
                 hex(me.mask));
          member.result = threads_[warp_base + source].value;
        } else {
          member.result = ballot;
        }
      }
      // Results first, then release: a member's value is read above before any member runs on.
      for (int l = 0; l < kWarpSize; ++l)
        if (me.mask >> l & 1u) threads_[warp_base + l].state = State::kReady;
      released = true;
    }
    return released;
  }

  bool release_barrier() {
    int waiting = -1;
    for (int t = 0; t < static_cast<int>(threads_.size()); ++t)
      if (threads_[t].state == State::kAtBarrier) waiting = t;
    if (waiting < 0) return false;
    for (int t = 0; t < static_cast<int>(threads_.size()); ++t)
      if (threads_[t].state != State::kAtBarrier)
        fail("__syncthreads() is never reached by " + where(t) + ", which is " + state_name(threads_[t].state) +
             ", while " + where(waiting) + " waits there (a barrier inside a branch some threads skip)");
    for (Thread& t : threads_) t.state = State::kReady;
    return true;
  }

  static std::string hex(unsigned v) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%08x", v);
    return buf;
  }

  const char* kernel_ = "";
  Order order_ = Order::kSequential;
  std::vector<unsigned> block_order_;  // the launch's blocks, x fastest, in the order they run
  std::mt19937 random_;
  std::vector<Thread> threads_;
  int current_ = -1;
  std::exception_ptr error_;
  bool abandoning_ = false;
  std::unique_ptr<unsigned char[]> shared_;
#if defined(__SANITIZE_ADDRESS__)
  const void* main_bottom_ = nullptr;
  std::size_t main_size_ = 0;
#endif
};

Scheduler& scheduler() {
  static Scheduler s;
  return s;
}

Thread& calling_thread(const char* what) {
  Scheduler& s = scheduler();
  if (!s.inside_kernel()) throw std::logic_error(std::string("CUDA harness: ") + what + " called outside a kernel");
  return s.current();
}

}  // namespace

// The work recorded by the stream capture in progress (null: none in progress).
std::vector<std::function<void()>>* capture = nullptr;

void run_or_record(const std::function<void()>& work) {
  if (capture) capture->push_back(work);
  else work();
}
bool capturing() { return capture != nullptr; }

void launch(const char* kernel, dim3 grid, dim3 block, std::size_t dynamic_shared_bytes,
            const std::function<void()>& body) {
  run_or_record([=] { scheduler().launch(kernel, grid, block, dynamic_shared_bytes, body); });
}

void* dynamic_shared_memory() { return scheduler().dynamic_shared(); }

void set_thread_order(const std::string& order) { scheduler().set_order(order); }

void wait_for_previous_kernel() { calling_thread("KVS_WAIT_FOR_PREVIOUS_KERNEL").waited_for_previous_kernel = true; }

void syncthreads() {
  calling_thread("__syncthreads");
  scheduler().wait(State::kAtBarrier);
}

int lane_id() {
  calling_thread("a warp operation");
  return scheduler().lane();
}

std::uint64_t warp_shuffle(unsigned mask, std::uint64_t value, int source_lane) {
  Thread& t = calling_thread("a shuffle");
  t.op = WarpOp::kShuffle, t.mask = mask, t.value = value, t.source_lane = source_lane;
  scheduler().wait(State::kAtWarpOp);
  return t.result;
}

unsigned warp_ballot(unsigned mask, bool predicate) {
  Thread& t = calling_thread("a vote");
  t.op = WarpOp::kVote, t.mask = mask, t.value = predicate ? 1 : 0;
  scheduler().wait(State::kAtWarpOp);
  return static_cast<unsigned>(t.result);
}

void warp_sync(unsigned mask) {
  Thread& t = calling_thread("__syncwarp");
  t.op = WarpOp::kSync, t.mask = mask, t.value = 0;
  scheduler().wait(State::kAtWarpOp);
}

}  // namespace kvs::cuda_harness

// ---- the runtime API on host memory ----
cudaError_t cudaMalloc(void** pointer, std::size_t bytes) {
  // 256-byte aligned like cudaMalloc, but exactly `bytes` long: AddressSanitizer reports a read even one
  // element past the end (a GPU would not notice it).
  *pointer = nullptr;
  if (bytes && posix_memalign(pointer, 256, bytes) != 0) return cudaErrorMemoryAllocation;
  return cudaSuccess;
}
cudaError_t cudaFree(void* pointer) {
  std::free(pointer);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind) {
  if (kvs::cuda_harness::capturing()) return cudaErrorStreamCaptureUnsupported;  // as CUDA: it would synchronise
  if (bytes) std::memcpy(dst, src, bytes);  // memcpy, not memmove: ASan reports overlapping ranges
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind, cudaStream_t) {
  kvs::cuda_harness::run_or_record([=] {
    if (bytes) std::memcpy(dst, src, bytes);
  });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* dst, int value, std::size_t bytes) {
  if (bytes) std::memset(dst, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t) {
  kvs::cuda_harness::run_or_record([=] {
    if (bytes) std::memset(dst, value, bytes);
  });
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  return kvs::cuda_harness::capturing() ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return kvs::cuda_harness::capturing() ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

// Streams: everything runs in order at the call, so a stream is only a distinct non-null handle.
struct CUstream_st {};
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  *stream = new CUstream_st;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}

// A graph is the list of work recorded by a capture; its executable form is a copy.
struct CUgraph_st {
  std::vector<std::function<void()>> work;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> work;
};
cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) {
  if (kvs::cuda_harness::capture) return cudaErrorIllegalState;  // one capture at a time
  kvs::cuda_harness::capture = new std::vector<std::function<void()>>;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t* graph) {
  if (!kvs::cuda_harness::capture) return cudaErrorIllegalState;
  *graph = new CUgraph_st{std::move(*kvs::cuda_harness::capture)};
  delete kvs::cuda_harness::capture;
  kvs::cuda_harness::capture = nullptr;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  *exec = new CUgraphExec_st{graph->work};
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t) {
  if (kvs::cuda_harness::capturing()) return cudaErrorStreamCaptureUnsupported;
  for (const auto& work : exec->work) work();
  return cudaSuccess;
}
// Nodes: one per recorded launch, copy or matrix product (cuBLAS's products may be several kernels on a GPU).
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes, std::size_t* count) {
  if (nodes) return cudaErrorInvalidValue;  // the harness's graphs have no node objects to hand out
  *count = graph->work.size();
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
  }
  return "unknown error";
}
