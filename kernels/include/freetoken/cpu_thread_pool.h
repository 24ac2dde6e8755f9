// One persistent thread pool per process, shared by every CPU kernel library.
//
// Two pools would each keep a worker spinning between calls and fight over the cores, so the
// first library that needs one creates it and publishes a small C table of entry points as a
// tvm-ffi global; later libraries look that up. The workers hold a thread_local with a
// destructor, which makes glibc keep the creating library mapped while they live, so unloading
// that library cannot pull the code out from under them.
//
// The calling thread works too, so n threads means n-1 workers. Tasks are claimed through one
// atomic word (generation << 32 | next index): a worker that wakes late for a finished run sees
// a stale generation and claims nothing, so the caller never waits for a sleeping worker. Idle
// workers spin briefly (decode issues a kernel every few microseconds), then yield, then sleep.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <tvm/ffi/function.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace freetoken {

using PoolTask = void (*)(void* ctx, int64_t index);

/*! \brief The cross-library contract: bump the name's version when this struct changes. */
struct PoolApi {
  void (*run)(int64_t n_tasks, PoolTask fn, void* ctx);
  int (*num_threads)();
  void (*set_num_threads)(int n);
};
constexpr const char* kPoolGlobalName = "freetoken.cpu_thread_pool.v1";

namespace pool_detail {

inline int default_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

struct LibraryPin {
  // A thread_local with a real destructor: glibc keeps its library loaded while it is pending.
  ~LibraryPin() { alive = 0; }
  volatile int alive = 1;
};

class ThreadPool {
 public:
  explicit ThreadPool(int n) { start_workers(n); }

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  void set_num_threads(int n) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    stop_workers();
    start_workers(n > 0 ? n : default_threads());
  }

  void run(int64_t n_tasks, PoolTask fn, void* ctx) {
    std::unique_lock<std::mutex> run_lock(run_mutex_, std::try_to_lock);
    // Busy (another caller thread, or a nested call) or nothing to share: run inline.
    if (!run_lock.owns_lock() || workers_.empty() || n_tasks == 1) {
      for (int64_t i = 0; i < n_tasks; ++i) fn(ctx, i);
      return;
    }
    if (getpid() != owner_pid_) restart_after_fork();
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
      if (spins < 4096) {
        __builtin_ia32_pause();
      } else {
        sched_yield();
      }
      total = done_.load(std::memory_order_acquire);
    }
  }

 private:
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
    thread_local LibraryPin pin;
    (void)&pin;
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
        sched_yield();  // leave the core to any other runnable thread
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

  // A forked child has none of the workers, and a worker may have held sleep_mutex_ at the fork.
  void restart_after_fork() {
    new std::vector<std::thread>(std::move(workers_));  // NOTE: leaked on purpose, never joined
    workers_.clear();
    new (&sleep_mutex_) std::mutex();
    new (&wake_) std::condition_variable();
    sleepers_.store(0);
    start_workers(default_threads());
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

  static constexpr int kSpinMicros = 100;
  static constexpr int kYieldMicros = 2000;

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> n_tasks_{0};
  std::atomic<PoolTask> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  uint64_t generation_ = 0;
  pid_t owner_pid_ = 0;
};

// Entry points of the pool created by this library (when it is the one that creates it).
inline ThreadPool& own_pool() {
  static ThreadPool* pool = new ThreadPool(default_threads());  // NOTE: leaked; workers outlive exit
  return *pool;
}
inline void own_run(int64_t n, PoolTask fn, void* ctx) {
  thread_local LibraryPin pin;  // callers pin this library too (a 1-thread pool has no workers)
  (void)&pin;
  own_pool().run(n, fn, ctx);
}
inline int own_num_threads() { return own_pool().num_threads(); }
inline void own_set_num_threads(int n) { own_pool().set_num_threads(n); }

inline const PoolApi* lookup_or_publish() {
  static const PoolApi mine{own_run, own_num_threads, own_set_num_threads};
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (auto found = tvm::ffi::Function::GetGlobal(kPoolGlobalName)) {
      return reinterpret_cast<const PoolApi*>((*found)().cast<int64_t>());
    }
    try {
      tvm::ffi::Function::SetGlobal(kPoolGlobalName, tvm::ffi::Function::FromTyped([] {
        return reinterpret_cast<int64_t>(&mine);
      }));
      return &mine;
    } catch (const std::exception&) {
      // another library published its pool first: loop and use that one
    }
  }
  return &mine;
}

}  // namespace pool_detail

/*! \brief The process-wide pool's entry points (looked up once per library). */
inline const PoolApi& thread_pool() {
  static const PoolApi* api = pool_detail::lookup_or_publish();
  return *api;
}

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
  thread_pool().run(chunks, task, &ctx);
}

}  // namespace freetoken
