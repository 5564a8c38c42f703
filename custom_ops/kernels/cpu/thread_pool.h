// A small persistent thread pool for the CPU kernels.
//
// Why not OpenMP: libpaddle already loads both libgomp and libiomp5; a third user of
// either runtime in the same process makes thread counts unpredictable. This pool
// owns its threads, schedules work items dynamically (the caller orders them longest
// first), and never changes the result with the thread count: every work item is
// computed by exactly one thread with a fixed order of operations.
#pragma once
#include <cstdint>
#include <functional>

namespace paddle_unpad {

// Number of threads the kernels use: RuntimeSettings::num_threads (the NUM_THREADS
// setting), else OMP_NUM_THREADS, else the hardware concurrency. Read once, at first use.
int cpu_num_threads();

// Runs fn(item, thread_index) for item in [0, n). thread_index < cpu_num_threads()
// selects per-thread scratch. Blocks until all items are done; rethrows the first
// exception raised by fn.
void parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn);

}  // namespace paddle_unpad
