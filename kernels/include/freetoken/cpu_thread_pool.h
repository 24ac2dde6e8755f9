// A small persistent thread pool for the CPU kernels (one per kernel library).
//
// The calling thread works too, so `n` threads means n-1 workers. Tasks are claimed through one
// atomic word holding (generation << 32 | next index): a worker that wakes late for a finished
// run sees a stale generation and claims nothing, so the caller never waits for a sleeping
// worker. Idle workers spin briefly (decode issues a kernel every few microseconds), then yield,
// then sleep on a condition variable.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace freetoken {

class ThreadPool {
 public:
  using TaskFn = void (*)(void* ctx, int64_t index);

  /*! \brief The pool of this kernel library, started on first use with one thread per CPU. */
  static ThreadPool& instance() {
    static ThreadPool pool;
    return pool;
  }

  ~ThreadPool() { stop_workers(); }

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  /*! \brief Use n threads (caller included); n <= 0 means one per CPU this process may use. */
  void set_num_threads(int n) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    stop_workers();
    start_workers(n > 0 ? n : default_threads());
  }

  /*! \brief Run fn(ctx, i) for i in [0, n_tasks); returns when all have finished. */
  void run(int64_t n_tasks, TaskFn fn, void* ctx) {
    if (n_tasks <= 0) return;
    std::unique_lock<std::mutex> run_lock(run_mutex_, std::try_to_lock);
    // Busy (another caller thread, or a nested call) or nothing to share: run inline.
    if (!run_lock.owns_lock() || workers_.empty() || n_tasks == 1) {
      for (int64_t i = 0; i < n_tasks; ++i) fn(ctx, i);
      return;
    }
    if (getpid() != owner_pid_) {  // forked child: the workers did not survive the fork
      abandon_workers();
      start_workers(default_threads());
    }
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    n_tasks_.store(n_tasks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & 0xffffffffu;
    claim_.store(generation_ << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    int64_t mine = work(generation_);
    int64_t total = done_.fetch_add(mine, std::memory_order_acq_rel) + mine;
    for (int spins = 0; total < n_tasks; ++spins) {
      pause(spins);
      total = done_.load(std::memory_order_acquire);
    }
  }

 private:
  ThreadPool() { start_workers(default_threads()); }

  static int default_threads() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    unsigned n = std::thread::hardware_concurrency();
    return n > 0 ? static_cast<int>(n) : 1;
  }

  static void pause(int spins) {
    if (spins < 4096) {
      __builtin_ia32_pause();
    } else {
      sched_yield();
    }
  }

  // Claims and runs tasks of generation `gen` until none is left; returns how many it ran.
  int64_t work(uint64_t gen) {
    int64_t ran = 0;
    uint64_t c = claim_.load(std::memory_order_acquire);
    while ((c >> 32) == gen) {
      int64_t index = static_cast<int64_t>(c & 0xffffffffu);
      if (index >= n_tasks_.load(std::memory_order_relaxed)) break;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
      fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), index);
      ++ran;
      c = claim_.load(std::memory_order_acquire);
    }
    return ran;
  }

  void worker_loop() {
    uint64_t seen = claim_.load(std::memory_order_acquire) >> 32;
    while (true) {
      uint64_t gen = wait_for_new_generation(seen);
      if (stop_.load(std::memory_order_acquire)) return;
      seen = gen;
      int64_t ran = work(gen);
      if (ran > 0) done_.fetch_add(ran, std::memory_order_acq_rel);
    }
  }

  uint64_t wait_for_new_generation(uint64_t seen) {
    using clock = std::chrono::steady_clock;
    const auto spin_until = clock::now() + std::chrono::microseconds(kSpinMicros);
    const auto yield_until = spin_until + std::chrono::microseconds(kYieldMicros);
    for (int i = 0;; ++i) {
      uint64_t gen = claim_.load(std::memory_order_acquire) >> 32;
      if (gen != seen || stop_.load(std::memory_order_relaxed)) return gen;
      if ((i & 63) != 63) {
        __builtin_ia32_pause();
        continue;
      }
      auto now = clock::now();
      if (now < spin_until) continue;
      if (now < yield_until) {
        sched_yield();  // let another runnable thread (e.g. another library's worker) have the core
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] {
        return (claim_.load(std::memory_order_seq_cst) >> 32) != seen ||
               stop_.load(std::memory_order_seq_cst);
      });
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      i = 0;
    }
  }

  void start_workers(int n_threads) {
    stop_.store(false);
    owner_pid_ = getpid();
    for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stop_.store(true, std::memory_order_seq_cst);
      wake_.notify_all();
    }
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

  // After fork the thread handles name threads of the parent: drop them without joining.
  void abandon_workers() {
    auto* orphans = new std::vector<std::thread>(std::move(workers_));  // NOTE: leaked on purpose
    (void)orphans;
    workers_.clear();
  }

  static constexpr int kSpinMicros = 100;
  static constexpr int kYieldMicros = 2000;

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> n_tasks_{0};
  std::atomic<TaskFn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  uint64_t generation_ = 0;
  pid_t owner_pid_ = 0;
};

/*!
 * \brief Split [0, n) into chunks of `grain` and run body(begin, end) on the pool.
 * `body` must not throw: validate inputs on the calling thread first.
 */
template <typename Body>
inline void parallel_for(int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t chunks = (n + grain - 1) / grain;
  struct Ctx {
    const Body* body;
    int64_t n, grain;
  } ctx{&body, n, grain};
  auto task = [](void* p, int64_t i) {
    auto* c = static_cast<Ctx*>(p);
    int64_t begin = i * c->grain;
    (*c->body)(begin, std::min(c->n, begin + c->grain));
  };
  ThreadPool::instance().run(chunks, task, &ctx);
}

}  // namespace freetoken
