// comm/comm_local.cpp: ranks as threads of one process. The checks every comm passes (tests/comm/comm_checks.h) at
// 1 to 4 threads, the mesh's splits, and a rank that never arrives: the others stop within the timeout with an
// error naming the collective and the missing rank.
#include <gtest/gtest.h>

#include <functional>
#include <thread>
#include <vector>

#include "core/error.h"
#include "comm/comm.h"
#include "tests/comm/comm_checks.h"

namespace tuna {
namespace {

// Runs body(comm) on `size` threads, one per rank of a fresh group; rethrows nothing (gtest records failures).
void on_threads(int size, const std::function<void(Comm&)>& body, double timeout_s = 60) {
  std::vector<std::unique_ptr<Comm>> comms = make_local_comms(size, timeout_s);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; r++)
    threads.emplace_back([&, r] {
      try {
        body(*comms[r]);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  for (std::thread& t : threads) t.join();
}

TEST(CommLocal, EveryCollectiveAtOneToFourRanks) {
  for (int size = 1; size <= 4; size++) {
    SCOPED_TRACE(testing::Message() << size << " threads");
    on_threads(size, [](Comm& c) {
      EXPECT_EQ(c.backend(), "threads");
      comm_checks::all_reduce_sum_and_max_every_type(c);
      comm_checks::reduce_scatter_and_all_gather_on_uneven_sizes(c);
      comm_checks::broadcast_and_barrier(c);
    });
  }
}

TEST(CommLocal, MeshGroups) {
  for (int size : {2, 4}) on_threads(size, comm_checks::mesh_groups_are_contiguous_in_tp);
}

TEST(CommLocal, AMissingRankStopsTheOthersNamingTheCollective) {
  std::vector<std::string> errors(3);
  std::vector<std::unique_ptr<Comm>> comms = make_local_comms(3, /*timeout_s=*/0.5);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; r++)  // rank 2 never calls
    threads.emplace_back([&, r] {
      float x = 1;
      try {
        comms[r]->all_reduce_sum(&x, 1, "gradients of a unit");
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; r++) {
    EXPECT_NE(errors[r].find("all_reduce 'gradients of a unit'"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank(s) 2 did not arrive"), std::string::npos) << errors[r];
  }
}

}  // namespace
}  // namespace tuna
