// When a CPU op spreads its work over the OpenMP threads.
#pragma once

#include <cstdint>

namespace tuna::cpu {

// Below this many elements of work a forward op runs on the calling thread (`omp parallel if`): a parallel
// region costs a fork and a join of every thread, microseconds on idle cores and far more when the cores are
// shared (a waiting thread spins or sleeps), more than such an op takes. Generation meets it on every layer of
// every token (one position: a few thousand elements per op). The results do not change: every element is
// computed the same way by whichever thread.
constexpr int64_t kMinParallelWork = int64_t(1) << 15;

}  // namespace tuna::cpu
