// comm/comm under mpirun: the checks of tests/comm/comm_checks.h on MPI_COMM_WORLD (bf16 sums excepted: MPI has
// no bf16 arithmetic, and device comms widen them before they reach MPI).
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "tests/comm/comm_checks.h"
#include "tests/mpi/mpi_test_util.h"

namespace tuna {
namespace {

TEST(Comm, AllReduceSumAndMaxEveryType) { comm_checks::all_reduce_sum_and_max_every_type(test::world()); }

TEST(Comm, ReduceScatterAndAllGatherOnUnevenSizes) {
  comm_checks::reduce_scatter_and_all_gather_on_uneven_sizes(test::world());
}

// Peak resident memory of this process (VmHWM), in bytes.
int64_t peak_resident_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

// A gradient all-reduce in place and a unit's reduce-scatter need no scratch as large as the message (Open MPI
// allocates one per call: a transient 4 bytes per parameter); the MPI backend chunks them (comm/comm_mpi.cpp).
TEST(Comm, LargeCollectivesNeedNoScratchAsLargeAsTheMessage) {
  Comm& w = test::world();
  const int64_t n = int64_t(16) << 20;  // 64 MB of floats
  std::vector<float> grads(n, 1.0f), piece(shard_range(n, w.rank(), w.size()).size(), 0.0f);
  w.all_reduce_sum(piece.data(), 1 << 20, "warm-up");  // the library's own setup, at the chunk size
  const int64_t before = peak_resident_bytes();
  w.all_reduce_sum(grads.data(), n, "test large all-reduce");
  w.reduce_scatter(grads.data(), piece.data(), n, "test large reduce-scatter");
  const int64_t grew = peak_resident_bytes() - before;
  EXPECT_LT(grew, int64_t(16) << 20) << "peak resident memory grew by " << grew / 1e6 << " MB for a 64 MB message";
  EXPECT_EQ(grads[n - 1], float(w.size()));
  EXPECT_EQ(piece.back(), float(w.size() * w.size()));  // the all-reduced gradient, summed again
}

TEST(Comm, BroadcastAndBarrier) { comm_checks::broadcast_and_barrier(test::world()); }

TEST(Comm, MeshGroupsAreContiguousInTp) {
  if (test::world().size() % 2) GTEST_SKIP() << "needs an even world";
  comm_checks::mesh_groups_are_contiguous_in_tp(test::world());
}

}  // namespace
}  // namespace tuna
