#include "worker_pool.h"

#include <chrono>
#include <utility>

#include "interrupts.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVS_CPU_RELAX() _mm_pause()
#else
#define KVS_CPU_RELAX() ((void)0)
#endif

namespace kvs {
namespace {

constexpr std::uint64_t kTaskMask = 0xffffffffu;
constexpr std::uint64_t kClosed = 0x7fffffff;  // a closed job's next task: past any task count (an int)
std::uint64_t job_number(std::uint64_t job) { return job >> 32; }

// How long an idle worker keeps polling for the next job before it sleeps. A decode step runs ~40 parallel
// operations a few microseconds apart, and waking a sleeping thread costs tens of microseconds; 200 us
// covers the gaps inside a step and between steps, and a worker that is not needed stops burning a core
// soon after.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);

}  // namespace

WorkerPool::WorkerPool(int threads) {
  // Started with interrupts held, which they keep (interrupts.h): a Ctrl-C goes to the thread that runs the program.
  const InterruptsHeld held;
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

WorkerPool::~WorkerPool() {
  stop_.store(true);
  job_.fetch_add(std::uint64_t(1) << 32);  // a new job number wakes every worker; it sees stop_
  job_.notify_all();
  for (std::thread& t : workers_) t.join();
}

bool WorkerPool::claim_and_run(std::uint64_t job) {
  std::uint64_t seen = job_.load(std::memory_order_acquire);
  for (;;) {
    if (job_number(seen) != job_number(job)) return false;  // that job is over
    const int next = static_cast<int>(seen & kTaskMask);
    // Acquire, with run_erased's release: a worker that reads a new job's count sees the old job closed, so its
    // exchange below fails (the count of the job it holds, or it gets nothing).
    if (next >= tasks_.load(std::memory_order_acquire)) return false;
    if (job_.compare_exchange_weak(seen, seen + 1, std::memory_order_acq_rel)) {
      // The job cannot end before this task finishes, so its call and context stay valid.
      try {
        call_.load(std::memory_order_relaxed)(context_.load(std::memory_order_relaxed), next);
      } catch (...) {  // for the caller to rethrow; the count below publishes error_ to it
        if (!failed_.exchange(true, std::memory_order_relaxed)) error_ = std::current_exception();
      }
      finished_.fetch_add(1, std::memory_order_release);
      return true;
    }
  }
}

void WorkerPool::run_erased(int tasks, Call call, void* context) {
  // First the previous job is closed: a new number whose next task is past any count. Every task of it has
  // finished (run() returns only then), but a worker may still be in claim_and_run for it, between reading job_
  // (all its tasks claimed) and its exchange: had tasks_ grown before job_ changed, it took the new count for the
  // old job's and claimed a task past the old job's end, run with either job's function and counted into the new
  // job's finished tasks, so that run() could return while it ran (a test saw it in 9 runs of 40). Closed, its
  // exchange fails. Then the fields: a worker that reads the new count also sees the close (release, acquire),
  // and call and context are read only by a worker that has claimed a task of the job that opens below.
  const std::uint64_t closed = (((job_.load() >> 32) + 1) << 32) | kClosed;
  job_.store(closed, std::memory_order_relaxed);   // ordered before the count by the count's release store
  tasks_.store(tasks, std::memory_order_release);  // after the close, for whoever reads it (claim_and_run)
  call_.store(call, std::memory_order_relaxed);
  context_.store(context, std::memory_order_relaxed);
  finished_.store(0, std::memory_order_relaxed);
  const std::uint64_t job = ((closed >> 32) + 1) << 32;  // the next job number, task 0
  job_.store(job);  // seq_cst: ordered against the load of sleeping_ below (and its increment in work())
  if (sleeping_.load() > 0) job_.notify_all();
  while (claim_and_run(job)) {
  }
  // Every task is claimed; wait for those a worker is still running. Yielding lets a worker that shares
  // this core (a busy machine) finish its task.
  for (int spins = 0; finished_.load(std::memory_order_acquire) < tasks; ++spins) {
    if (spins < 4096) KVS_CPU_RELAX();
    else std::this_thread::yield();
  }
  if (failed_.load(std::memory_order_relaxed)) {  // every task has finished: nothing writes these now
    std::exception_ptr error = std::exchange(error_, nullptr);
    failed_.store(false, std::memory_order_relaxed);
    std::rethrow_exception(error);
  }
}

void WorkerPool::work() {
  std::uint64_t last = 0;  // job 0 is no job: the first run() announces job 1, even before this thread starts
  for (;;) {
    // Poll for a new job for a while, then sleep until one is announced.
    const auto deadline = std::chrono::steady_clock::now() + kSpinBeforeSleep;
    std::uint64_t job = job_.load(std::memory_order_acquire);
    for (int spins = 0; job_number(job) == job_number(last); ++spins) {
      KVS_CPU_RELAX();
      if (spins % 64 == 63 && std::chrono::steady_clock::now() > deadline) {
        sleeping_.fetch_add(1);
        job_.wait(job);  // returns at once if job_ changed since it was read
        sleeping_.fetch_sub(1);
      }
      job = job_.load(std::memory_order_acquire);
    }
    if (stop_.load()) return;
    last = job;
    while (claim_and_run(job)) {
    }
  }
}

}  // namespace kvs
