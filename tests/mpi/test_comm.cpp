// dist/comm under mpirun: the checks of tests/dist/comm_checks.h on MPI_COMM_WORLD (bf16 sums excepted: MPI has
// no bf16 arithmetic, and device comms widen them before they reach MPI).
#include <gtest/gtest.h>

#include "tests/dist/comm_checks.h"
#include "tests/mpi/mpi_test_util.h"

namespace tuna {
namespace {

TEST(Comm, AllReduceSumAndMaxEveryType) { comm_checks::all_reduce_sum_and_max_every_type(test::world()); }

TEST(Comm, ReduceScatterAndAllGatherOnUnevenSizes) {
  comm_checks::reduce_scatter_and_all_gather_on_uneven_sizes(test::world());
}

TEST(Comm, BroadcastAndBarrier) { comm_checks::broadcast_and_barrier(test::world()); }

TEST(Comm, MeshGroupsAreContiguousInTp) {
  if (test::world().size() % 2) GTEST_SKIP() << "needs an even world";
  comm_checks::mesh_groups_are_contiguous_in_tp(test::world());
}

}  // namespace
}  // namespace tuna
