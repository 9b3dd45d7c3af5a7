// The CUDA harness's scheduler: every thread of a block is a Boost.Context fiber; a thread runs until it
// reaches a synchronisation point (__syncthreads, a warp operation) or ends, and the scheduler releases a
// synchronisation point once every thread it needs has arrived - or reports why it never can.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <boost/context/fiber.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "address_sanitizer.h"
#include "cuda_runtime_harness.h"
#include "number_text.h"

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

#if KVS_ADDRESS_SANITIZER
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
constexpr unsigned kMaxGridX = 2147483647u, kMaxGridYZ = 65535u;
constexpr std::size_t kMaxDynamicShared = kHarnessMaxDynamicShared;  // an H100's per-block limit
constexpr std::size_t kDefaultDynamicShared = 48 * 1024;  // what a kernel gets without cudaFuncSetAttribute
#if KVS_ADDRESS_SANITIZER
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

enum class State { kReady, kAtWait, kAtBarrier, kAtWarpOp, kDone };

// Thrown inside a suspended thread to end it when its launch has failed.
struct Abandon {};

const char* state_name(State s) {
  switch (s) {
    case State::kReady: return "running";
    case State::kAtWait: return "waiting for the kernel before";
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
#if KVS_ADDRESS_SANITIZER
  void* fake_stack = nullptr;
  const void* stack_bottom = nullptr;
  std::size_t stack_size = 0;
#endif
};

enum class Order { kSequential, kReverse, kRandom };

// One launch: its grid, the kernel call, the order its blocks run in, and the block that runs now - its
// threads and its dynamic shared memory.
struct Launch {
  const char* kernel = "";
  dim3 grid, block;
  std::size_t dynamic_shared = 0;
  std::function<void()> body;
  std::vector<unsigned> block_order;  // x fastest, in the order the blocks run
  uint3 block_index;                  // of the block running now
  std::vector<Thread> threads;        // its threads
  std::unique_ptr<unsigned char[]> shared;
  std::exception_ptr error;
  bool abandoning = false;
  // Its first block runs ahead of the kernel before it (programmatic launch): a thread stops at
  // KVS_WAIT_FOR_PREVIOUS_KERNEL() until that kernel has finished.
  bool early = false;
};

Launch* volatile left_at_exit = nullptr;  // see ~Scheduler (volatile: the store is kept)

// Runs the launches. A launch on a programmatic queue (cuda_support.h) is run as a GPU may run it: its first
// block up to KVS_WAIT_FOR_PREVIOUS_KERNEL() *before* the kernel ahead of it finishes. So every kernel launch
// is left pending with its first block stopped at that wait, and finishes when the next launch's first block
// has reached its own wait (a programmatic next launch) or before anything else on the stream runs (a plain
// launch, a copy, a synchronisation, a free). What a kernel reads before its wait is then what memory held
// before the kernel ahead of it ran: a read of that kernel's output there gives a wrong result here, as it
// may on a GPU, instead of passing unseen.
class Scheduler {
 public:
  Scheduler() {
    const char* order = std::getenv("KVS_CUDA_HARNESS_ORDER");
    set_order(order ? order : "sequential");
  }
  ~Scheduler() {
    // A kernel still pending at exit (no synchronisation after it): its suspended threads are left as they are -
    // the stack pool they would unwind into may already be gone - and reachable, for the leak checker.
    left_at_exit = pending_.release();
  }
  void set_order(const std::string& s) {
    if (s == "sequential") {
      order_ = Order::kSequential;
    } else if (s == "reverse") {
      order_ = Order::kReverse;
    } else if (const auto seed = s.rfind("random:", 0) == 0 ? whole_number<std::uint64_t>(s.substr(7)) : std::nullopt) {
      order_ = Order::kRandom;
      random_.seed(static_cast<std::mt19937::result_type>(*seed));
    } else {
      throw std::runtime_error("KVS_CUDA_HARNESS_ORDER='" + s +
                               "': use sequential, reverse or random:SEED (SEED a whole number below 2^64)");
    }
  }

  void set_max_dynamic_shared(const void* kernel_address, std::size_t bytes) { max_dynamic_shared_[kernel_address] = bytes; }

  void launch(const char* kernel, const void* kernel_address, dim3 grid, dim3 block, std::size_t dynamic_shared,
              bool programmatic, const std::function<void()>& body) {
    const long threads = long(block.x) * block.y * block.z;
    if (threads < 1 || threads > kMaxThreadsPerBlock)
      fail(kernel, "a block of " + std::to_string(threads) + " threads (1 to " + std::to_string(kMaxThreadsPerBlock) + " allowed)");
    // CUDA's grid limits (compute capability 3.0 on): a launch past them fails with "invalid configuration".
    // (Checked first: the product below then fits a long.)
    if (grid.x > kMaxGridX || grid.y > kMaxGridYZ || grid.z > kMaxGridYZ)
      fail(kernel, "a grid of (" + std::to_string(grid.x) + "," + std::to_string(grid.y) + "," + std::to_string(grid.z) +
                       ") blocks (at most " + std::to_string(kMaxGridX) + " in x, " + std::to_string(kMaxGridYZ) +
                       " in y and z)");
    if (long(grid.x) * grid.y * grid.z < 1) fail(kernel, "an empty grid");  // as CUDA (KVS_LAUNCH never asks)
    if (dynamic_shared > kMaxDynamicShared)
      fail(kernel, std::to_string(dynamic_shared) + " bytes of dynamic shared memory (at most " +
                       std::to_string(kMaxDynamicShared) + ")");
    if (dynamic_shared > kDefaultDynamicShared) {
      const auto allowed = max_dynamic_shared_.find(kernel_address);
      if (allowed == max_dynamic_shared_.end() || allowed->second < dynamic_shared)
        fail(kernel, std::to_string(dynamic_shared) + " bytes of dynamic shared memory, over the " +
                         std::to_string(kDefaultDynamicShared) + " a kernel gets unless cudaFuncSetAttribute(kernel, "
                         "cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) allows more (" +
                         (allowed == max_dynamic_shared_.end() ? std::string("never called")
                                                               : "it allows " + std::to_string(allowed->second)) + ")");
    }
    if (!programmatic) finish_pending();  // a plain launch starts once the kernel before has finished
    std::unique_ptr<Launch> next;  // a finished launch's storage where there is one: no allocation per launch
    if (spares_.empty()) {
      next = std::make_unique<Launch>();
    } else {
      next = std::move(spares_.back());
      spares_.pop_back();
    }
    Launch& l = *next;
    l.kernel = kernel, l.grid = grid, l.block = block, l.dynamic_shared = dynamic_shared, l.body = body;
    l.error = nullptr, l.abandoning = false, l.early = true;
    // The blocks in the threads' order too: a GPU runs them in any order, and a kernel whose blocks meet (the
    // last to finish doing more, attention_decode_kernel's merge) must work whichever comes last.
    l.block_order.resize(std::size_t(grid.x) * grid.y * grid.z);
    std::iota(l.block_order.begin(), l.block_order.end(), 0u);
    if (order_ == Order::kReverse) std::reverse(l.block_order.begin(), l.block_order.end());
    if (order_ == Order::kRandom) std::shuffle(l.block_order.begin(), l.block_order.end(), random_);
    run_block(l, 0);  // the first block, up to its wait
    try {
      finish_pending();  // the kernel before finishes now, after what this one did before its wait
    } catch (...) {
      abandon_suspended(l);
      throw;
    }
    pending_ = std::move(next);
  }

  // The pending kernel runs to its end: before anything else on the stream, or the host, sees memory.
  void finish_pending() {
    if (!pending_) return;
    std::unique_ptr<Launch> done = std::move(pending_);
    Launch& l = *done;
    l.early = false;
    for (Thread& t : l.threads)
      if (t.state == State::kAtWait) t.state = State::kReady;
    run_scheduled(l);
    for (std::size_t b = 1; b < l.block_order.size(); ++b) run_block(l, b);
    l.shared.reset();
    l.body = nullptr;  // the kernel's arguments
    spares_.push_back(std::move(done));
  }

  void* dynamic_shared() { return running_->shared.get(); }
  int lane() const { return current_ % kWarpSize; }
  bool inside_kernel() const { return running_ && current_ >= 0; }

  // Called by a running thread at KVS_WAIT_FOR_PREVIOUS_KERNEL(): in a first block run ahead of the kernel
  // before, the thread stops here until that kernel has finished.
  void wait_for_previous_kernel() {
    current().waited_for_previous_kernel = true;
    if (running_->early) suspend(State::kAtWait);
  }
  // Called by a running thread: stop at a synchronisation point until the scheduler releases it.
  void wait(State state) {
    Thread& t = current();
    if (!t.waited_for_previous_kernel)
      fail(running_->kernel,
           where(current_) + " reaches " + (state == State::kAtBarrier ? "__syncthreads()" : op_name(t.op)) + kNoWait);
    suspend(state);
  }
  Thread& current() { return running_->threads[current_]; }

 private:
  [[noreturn]] static void fail(const char* kernel, const std::string& what) {
    throw std::runtime_error(std::string("CUDA harness: kernel ") + kernel + ": " + what);
  }
  std::string where(int t) const {
    const uint3& i = running_->threads[t].index;
    const uint3& b = running_->block_index;
    return "thread (" + std::to_string(i.x) + "," + std::to_string(i.y) + "," + std::to_string(i.z) + ") of block (" +
           std::to_string(b.x) + "," + std::to_string(b.y) + "," + std::to_string(b.z) + ")";
  }

  void suspend(State state) {
    Launch& l = *running_;
    Thread& t = l.threads[current_];
    t.state = state;
#if KVS_ADDRESS_SANITIZER
    __sanitizer_start_switch_fiber(&t.fake_stack, main_bottom_, main_size_);
#endif
    t.scheduler = std::move(t.scheduler).resume();
#if KVS_ADDRESS_SANITIZER
    __sanitizer_finish_switch_fiber(t.fake_stack, &main_bottom_, &main_size_);
#endif
    if (l.abandoning) throw Abandon{};
  }

  // Block block_order[b] of l: its threads as fibers, run until they end (or, in a block run early, until
  // every one waits for the kernel before).
  void run_block(Launch& l, std::size_t b) {
    const unsigned index = l.block_order[b];
    l.block_index = uint3{index % l.grid.x, index / l.grid.x % l.grid.y, index / (l.grid.x * l.grid.y)};
    // Fresh bytes per block, NaN when read as floats: shared memory starts undefined on a GPU.
    l.shared.reset(l.dynamic_shared ? new unsigned char[l.dynamic_shared] : nullptr);
    if (l.dynamic_shared) std::memset(l.shared.get(), 0xff, l.dynamic_shared);
    const int n = static_cast<int>(l.block.x * l.block.y * l.block.z);
    l.threads.clear();
    l.threads.resize(n);
    l.error = nullptr;
    for (int t = 0; t < n; ++t) {
      l.threads[t].index = uint3{t % l.block.x, (t / l.block.x) % l.block.y, t / (l.block.x * l.block.y)};
      ctx::stack_context stack = stack_pool().allocate();
#if KVS_ADDRESS_SANITIZER
      l.threads[t].stack_bottom = static_cast<char*>(stack.sp) - stack.size;
      l.threads[t].stack_size = stack.size;
#endif
      const ctx::preallocated on_stack(stack.sp, stack.size, stack);
      l.threads[t].fiber = ctx::fiber(std::allocator_arg, on_stack, PooledStack{}, [this, &l, t](ctx::fiber&& scheduler) {
#if KVS_ADDRESS_SANITIZER
        __sanitizer_finish_switch_fiber(nullptr, &main_bottom_, &main_size_);
#endif
        l.threads[t].scheduler = std::move(scheduler);
        try {
          if (!l.abandoning) {  // a thread first entered while abandoning never runs the kernel
            l.body();
            if (!l.threads[t].waited_for_previous_kernel) fail(l.kernel, where(t) + " ends" + kNoWait);
          }
        } catch (const Abandon&) {
          // the launch failed elsewhere: this thread's stack is unwound, it ends here
        } catch (...) {
          if (!l.error) l.error = std::current_exception();
        }
        l.threads[t].state = State::kDone;
#if KVS_ADDRESS_SANITIZER
        __sanitizer_start_switch_fiber(nullptr, main_bottom_, main_size_);
#endif
        return std::move(l.threads[t].scheduler);
      });
    }
    run_scheduled(l);
    if (!l.early) l.threads.clear();
  }

  // Runs the block's threads until all have ended, or all wait for the kernel before (a block run early).
  void run_scheduled(Launch& l) {
    try {
      schedule(l);
    } catch (...) {
      abandon_suspended(l);
      throw;
    }
  }

  // After an error: resumes every suspended thread once with `abandoning` set, so that its wait throws
  // Abandon and its stack unwinds through the same (sanitizer-annotated) switches as any resume.
  void abandon_suspended(Launch& l) {
    l.abandoning = true;
    for (int t = 0; t < static_cast<int>(l.threads.size()); ++t)
      if (l.threads[t].state != State::kDone && l.threads[t].fiber) resume(l, t);
    l.abandoning = false;
    l.threads.clear();
  }

  void schedule(Launch& l) {
    const int n = static_cast<int>(l.threads.size());
    order_of_threads_.resize(n);
    std::iota(order_of_threads_.begin(), order_of_threads_.end(), 0);
    if (order_ == Order::kReverse) std::reverse(order_of_threads_.begin(), order_of_threads_.end());
    for (;;) {
      if (order_ == Order::kRandom) std::shuffle(order_of_threads_.begin(), order_of_threads_.end(), random_);
      for (int t : order_of_threads_)
        if (l.threads[t].state == State::kReady) resume(l, t);
      if (l.error) std::rethrow_exception(l.error);
      if (std::all_of(l.threads.begin(), l.threads.end(), [](const Thread& t) { return t.state == State::kDone; })) return;
      if (l.early &&
          std::all_of(l.threads.begin(), l.threads.end(), [](const Thread& t) { return t.state == State::kAtWait; }))
        return;
      if (!release_warp_ops(l) && !release_barrier(l)) {
        running_ = &l;
        fail(l.kernel, "deadlock in " + where(0));
      }
    }
  }

  void resume(Launch& l, int t) {
    running_ = &l;
    current_ = t;
    threadIdx = l.threads[t].index;
    blockIdx = l.block_index;
    blockDim = l.block;
    gridDim = l.grid;
#if KVS_ADDRESS_SANITIZER
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(&fake_stack, l.threads[t].stack_bottom, l.threads[t].stack_size);
#endif
    l.threads[t].fiber = std::move(l.threads[t].fiber).resume();
#if KVS_ADDRESS_SANITIZER
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
    current_ = -1;
  }

  // Releases every warp operation whose lanes have all arrived; throws when one never can be.
  bool release_warp_ops(Launch& l) {
    running_ = &l;  // for where()
    std::vector<Thread>& threads = l.threads;
    bool released = false;
    const int n = static_cast<int>(threads.size());
    for (int t = 0; t < n; ++t) {
      const Thread& me = threads[t];
      if (me.state == State::kAtWarpOp && !(me.mask >> (t % kWarpSize) & 1u))
        fail(l.kernel, where(t) + " calls " + op_name(me.op) + " with mask 0x" + hex(me.mask) +
                           ", which leaves out its own lane " + std::to_string(t % kWarpSize));
    }
    for (int t = 0; t < n; ++t) {
      Thread& me = threads[t];
      if (me.state != State::kAtWarpOp) continue;
      const int warp_base = t - t % kWarpSize;
      unsigned ballot = 0;
      for (int lane = 0; lane < kWarpSize; ++lane) {
        if (!(me.mask >> lane & 1u)) continue;
        if (warp_base + lane >= n)
          fail(l.kernel, where(t) + ": " + op_name(me.op) + " with mask 0x" + hex(me.mask) + " names lane " +
                             std::to_string(lane) + ", which this block does not have");
        const Thread& other = threads[warp_base + lane];
        if (other.state != State::kAtWarpOp)
          fail(l.kernel, where(t) + " waits in " + op_name(me.op) + " with mask 0x" + hex(me.mask) + " for lane " +
                             std::to_string(lane) + ", which is " + state_name(other.state) +
                             " (a wrong mask or a divergent call)");
        if (other.mask != me.mask || other.op != me.op)
          fail(l.kernel, where(t) + " calls " + op_name(me.op) + " with mask 0x" + hex(me.mask) + " while lane " +
                             std::to_string(lane) + " calls " + op_name(other.op) + " with mask 0x" + hex(other.mask));
        if (other.value) ballot |= 1u << lane;
      }
      for (int lane = 0; lane < kWarpSize; ++lane) {
        if (!(me.mask >> lane & 1u)) continue;
        Thread& member = threads[warp_base + lane];
        if (member.op == WarpOp::kShuffle) {
          const int source = member.source_lane;
          if (source != lane && !(me.mask >> source & 1u))
            fail(l.kernel, where(warp_base + lane) + " shuffles from lane " + std::to_string(source) +
                               ", outside its mask 0x" + hex(me.mask));
          member.result = threads[warp_base + source].value;
        } else {
          member.result = ballot;
        }
      }
      // Results first, then release: a member's value is read above before any member runs on.
      for (int lane = 0; lane < kWarpSize; ++lane)
        if (me.mask >> lane & 1u) threads[warp_base + lane].state = State::kReady;
      released = true;
    }
    return released;
  }

  bool release_barrier(Launch& l) {
    running_ = &l;  // for where()
    int waiting = -1;
    for (int t = 0; t < static_cast<int>(l.threads.size()); ++t)
      if (l.threads[t].state == State::kAtBarrier) waiting = t;
    if (waiting < 0) return false;
    for (int t = 0; t < static_cast<int>(l.threads.size()); ++t)
      if (l.threads[t].state != State::kAtBarrier)
        fail(l.kernel, "__syncthreads() is never reached by " + where(t) + ", which is " +
                           state_name(l.threads[t].state) + ", while " + where(waiting) +
                           " waits there (a barrier inside a branch some threads skip)");
    for (Thread& t : l.threads) t.state = State::kReady;
    return true;
  }

  static std::string hex(unsigned v) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%08x", v);
    return buf;
  }

  Order order_ = Order::kSequential;
  std::mt19937 random_;
  std::vector<int> order_of_threads_;  // kept between blocks: no allocation per block
  std::unique_ptr<Launch> pending_;    // the last kernel launched, its first block stopped at its wait
  std::vector<std::unique_ptr<Launch>> spares_;  // finished launches' storage, for the next ones
  std::unordered_map<const void*, std::size_t> max_dynamic_shared_;  // kernel -> cudaFuncSetAttribute's bytes
  Launch* running_ = nullptr;          // the launch whose thread runs (or was checked) last
  int current_ = -1;
#if KVS_ADDRESS_SANITIZER
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
// Whether the capture in progress made a call CUDA refuses inside one: CUDA then invalidates the capture, and
// its end reports that (cudaErrorStreamCaptureInvalidated) and returns no graph.
bool capture_invalidated = false;

void run_or_record(const std::function<void()>& work) {
  // Stream work other than a kernel starts once the kernel before it has finished.
  auto after_pending = [work] {
    scheduler().finish_pending();
    work();
  };
  if (capture) capture->push_back(after_pending);
  else after_pending();
}
bool capturing() { return capture != nullptr; }
// What a call CUDA refuses inside a capture returns, the capture invalidated.
cudaError_t refused_in_capture() {
  capture_invalidated = true;
  return cudaErrorStreamCaptureUnsupported;
}

void launch(const char* kernel, const void* kernel_address, dim3 grid, dim3 block, std::size_t dynamic_shared_bytes,
            bool programmatic, const std::function<void()>& body) {
  auto run = [=] {
    scheduler().launch(kernel, kernel_address, grid, block, dynamic_shared_bytes, programmatic, body);
  };
  if (capture) capture->push_back(run);
  else run();
}

void set_max_dynamic_shared(const void* kernel_address, std::size_t bytes) {
  scheduler().set_max_dynamic_shared(kernel_address, bytes);
}

void finish_pending_kernel() { scheduler().finish_pending(); }

void* dynamic_shared_memory() { return scheduler().dynamic_shared(); }

void set_thread_order(const std::string& order) { scheduler().set_order(order); }
void check_order_setting() { scheduler(); }

void wait_for_previous_kernel() {
  calling_thread("KVS_WAIT_FOR_PREVIOUS_KERNEL");
  scheduler().wait_for_previous_kernel();
}

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
// cudaMalloc, cudaFree, cudaMemset and cudaMemcpy (not the Async ones), synchronising and destroying an executable
// graph are refused inside a capture, as CUDA refuses such "potentially unsafe" calls from the capturing thread in
// the backend's capture mode (thread-local), and the capture is invalidated (its end fails): an allocation is not
// recorded in the graph, and a free, a plain copy or memset synchronises. A cache whose write allocated would fail
// a GPU's recording, not the harness's, without this; an end_recording that destroyed the older graph before it
// ended the capture did, on an H100 (2026-11-27). (The harness's capture is one for the whole process, stricter
// than thread-local.)
cudaError_t cudaMalloc(void** pointer, std::size_t bytes) {
  *pointer = nullptr;
  if (kvs::cuda_harness::capturing()) return kvs::cuda_harness::refused_in_capture();
  // 256-byte aligned like cudaMalloc, but exactly `bytes` long: AddressSanitizer reports a read even one
  // element past the end (a GPU would not notice it).
  if (bytes && posix_memalign(pointer, 256, bytes) != 0) return cudaErrorMemoryAllocation;
  return cudaSuccess;
}
// What a pending kernel (harness.cpp's Scheduler) left undone runs before the host or other work sees memory:
// in every call below that synchronises, copies or frees. Where the call may not throw (it runs in destructors,
// whose callers ignore what it returns), an error of that kernel ends the process with its message: a test
// whose last kernel fails must not pass for want of a synchronisation after it.
namespace {
cudaError_t finish_pending_quietly() {
  try {
    kvs::cuda_harness::finish_pending_kernel();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s (found when memory was freed, after the kernel's last synchronisation)\n", e.what());
    std::abort();
  }
  return cudaSuccess;
}
}  // namespace

cudaError_t cudaFree(void* pointer) {
  if (kvs::cuda_harness::capturing()) return kvs::cuda_harness::refused_in_capture();  // the memory stays allocated
  const cudaError_t pending = finish_pending_quietly();  // the kernel may still use the memory
  std::free(pointer);
  if (pending != cudaSuccess) return pending;
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind) {
  if (kvs::cuda_harness::capturing()) return kvs::cuda_harness::refused_in_capture();  // as CUDA: it would synchronise
  kvs::cuda_harness::finish_pending_kernel();
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
  if (kvs::cuda_harness::capturing()) return kvs::cuda_harness::refused_in_capture();
  kvs::cuda_harness::finish_pending_kernel();
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
  if (kvs::cuda_harness::capturing()) return kvs::cuda_harness::refused_in_capture();
  kvs::cuda_harness::finish_pending_kernel();
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaDeviceSynchronize(); }

// Streams: everything runs in order at the call, so a stream is only a distinct non-null handle.
struct CUstream_st {};
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  *stream = new CUstream_st;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  const cudaError_t pending = finish_pending_quietly();
  delete stream;
  return pending;
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
  kvs::cuda_harness::capture_invalidated = false;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t* graph) {
  if (!kvs::cuda_harness::capture) return cudaErrorIllegalState;
  const bool invalidated = kvs::cuda_harness::capture_invalidated;
  *graph = invalidated ? nullptr : new CUgraph_st{std::move(*kvs::cuda_harness::capture)};
  delete kvs::cuda_harness::capture;
  kvs::cuda_harness::capture = nullptr;
  kvs::cuda_harness::capture_invalidated = false;
  return invalidated ? cudaErrorStreamCaptureInvalidated : cudaSuccess;  // the capture has ended either way
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  *exec = new CUgraphExec_st{graph->work};
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t) {
  // CUDA would record a graph launched inside a capture as a node of the new graph; nothing here does that, and
  // the harness, which cannot, refuses it rather than run it at once.
  if (kvs::cuda_harness::capturing()) return kvs::cuda_harness::refused_in_capture();
  // A graph's first kernel waits for what the stream ran before; the work after the graph, for its last kernel.
  kvs::cuda_harness::finish_pending_kernel();
  for (const auto& work : exec->work) work();
  kvs::cuda_harness::finish_pending_kernel();
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
  if (kvs::cuda_harness::capturing()) return kvs::cuda_harness::refused_in_capture();  // the graph stays
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
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}
