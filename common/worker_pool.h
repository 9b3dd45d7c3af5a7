#pragma once
// The CPU backend's threads: a team that lives as long as the backend and runs one operation's tasks at a
// time (rows of a matrix product, heads of attention).
//
// Why not OpenMP's `parallel for`: its static schedule makes every region wait for its slowest thread. On a
// machine whose cores are busy with other processes, a worker the kernel has descheduled stalls each of
// the ~40 regions of a decode step for a time slice: chapter 03 took 14-34 s with two threads against
// 0.43 s with one. Here the calling thread claims tasks too, and waits only for tasks a worker has already
// started: work no worker has picked up is done by the caller.
//
// Determinism: an operation's split into tasks must not depend on the number of threads (the CPU backend
// splits by fixed sizes), so every task computes the same bits whichever thread runs it, and the results
// are identical on 1 and 2 threads.
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <type_traits>
#include <vector>

namespace kvs {

class WorkerPool {
 public:
  // `threads` - 1 workers are started; the thread that calls run() is the last one.
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs task(i) for every i in [0, tasks), each exactly once, and returns when all have finished.
  // With one thread, or one task, they run in order on the caller. Allocates nothing. Check inputs before
  // run(); a task that throws anyway (std::bad_alloc from Eigen's packing buffers, out of memory) has its
  // exception rethrown here, on the caller - handed over by the thread that ran it, once every other task has
  // finished or thrown (with several, the first caught), where an exception leaving a worker's thread would end
  // the process (std::terminate) instead of giving the run's one line (run_main). In order on the caller, the
  // first throw ends the loop, as a plain loop's would. Handing tasks to another core costs a round trip between cores
  // (~0.5 us on the 2-core VM this was measured on; ~1.2 us per run() in all): not worth it for a task of
  // a few microseconds - the caller decides, see CpuBackend.
  template <typename Task>
  void run(int tasks, Task&& task) {
    if (workers_.empty() || tasks <= 1) {
      for (int i = 0; i < tasks; ++i) task(i);
      return;
    }
    using Callable = std::remove_reference_t<Task>;
    run_erased(tasks, [](void* context, int i) { (*static_cast<Callable*>(context))(i); }, const_cast<void*>(static_cast<const void*>(&task)));
  }

 private:
  using Call = void (*)(void* context, int task);
  void run_erased(int tasks, Call call, void* context);
  void work();                              // a worker's loop
  bool claim_and_run(std::uint64_t job);    // claims and runs one task of `job`; false when none is left

  // job_ packs the job's number (high 32 bits) and the next unclaimed task (low 32 bits), so that claiming a
  // task of an old job can never take one of the next job's.
  // Two cache lines: what the caller announces and workers read (job_ and the job's fields), and what
  // workers write back (finished_), so that waiting for one does not keep pulling the other across cores.
  alignas(64) std::atomic<std::uint64_t> job_{0};
  std::atomic<int> tasks_{0};              // the current job's task count, call and context: written before
  std::atomic<Call> call_{nullptr};        // job_ announces the job, read after a worker sees it
  std::atomic<void*> context_{nullptr};
  std::atomic<int> sleeping_{0};           // workers blocked in job_.wait(): the caller must notify
  alignas(64) std::atomic<int> finished_{0};  // tasks of the current job that have returned or thrown
  std::atomic<bool> failed_{false};           // a task of the current job threw: error_ holds its exception
  std::exception_ptr error_;                  // written by the task that set failed_, before it counts finished_
  alignas(64) std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

}  // namespace kvs
