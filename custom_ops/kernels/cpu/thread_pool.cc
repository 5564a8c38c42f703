#include "kernels/cpu/thread_pool.h"

#include "kernels/common/runtime_settings.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace paddle_unpad {
namespace {

int read_thread_count() {
  if (const int n = runtime_settings().num_threads; n > 0) return std::min(n, 1024);
  const char* v = std::getenv("OMP_NUM_THREADS");  // what Paddle's own CPU kernels use
  if (v && *v) {
    const int n = std::atoi(v);
    if (n > 0) return std::min(n, 1024);
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

class Pool {
 public:
  explicit Pool(int n) : n_threads_(n) {
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return n_threads_; }

  void run(int64_t n, const std::function<void(int64_t, int)>& fn) {
    std::lock_guard<std::mutex> serial(run_mu_);  // one parallel region at a time
    if (n_threads_ == 1 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) fn(i, 0);
      return;
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      fn_ = &fn;
      n_items_ = n;
      next_.store(0);
      error_ = nullptr;
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    drain(0);
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void drain(int tid) {
    for (;;) {
      int64_t i = next_.fetch_add(1);
      if (i >= n_items_) break;
      try {
        (*fn_)(i, tid);
      } catch (...) {
        std::lock_guard<std::mutex> g(mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_items_);  // stop handing out work
      }
    }
  }

  void worker(int tid) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain(tid);
      {
        std::lock_guard<std::mutex> g(mu_);
        if (--active_ == 0) done_cv_.notify_one();
      }
    }
  }

  const int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_items_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

Pool* g_pool = nullptr;
std::mutex g_pool_mu;

// A forked child (DataLoader workers) inherits the pool object but not its threads:
// forget it there and build a fresh one on first use. The old object is leaked on
// purpose; its mutexes may be in any state in the child.
void forget_pool_in_child() { g_pool = nullptr; }

Pool& pool() {
  std::lock_guard<std::mutex> g(g_pool_mu);
  if (!g_pool) {
    static bool registered = [] {
      pthread_atfork(nullptr, nullptr, forget_pool_in_child);
      return true;
    }();
    (void)registered;
    g_pool = new Pool(read_thread_count());  // lives for the process; never joined at exit
  }
  return *g_pool;
}

}  // namespace

int cpu_num_threads() { return pool().size(); }

void parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn) { pool().run(n, fn); }

}  // namespace paddle_unpad
