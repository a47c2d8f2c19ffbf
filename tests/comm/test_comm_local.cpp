// comm/comm_local.cpp: ranks as threads of one process. The checks every comm passes (tests/comm/comm_checks.h) at
// 1 to 4 threads, the mesh's splits, a send that waits for its recv as NCCL's does, and a rank that never arrives:
// the others stop within the timeout with an error naming the collective and the missing rank.
#include <gtest/gtest.h>

#include <chrono>
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

TEST(CommLocal, PointToPointAtTwoToFourRanks) {
  for (int size = 2; size <= 4; size++) {
    SCOPED_TRACE(testing::Message() << size << " threads");
    on_threads(size, [](Comm& c) {
      comm_checks::p2p_ring(c);
      comm_checks::p2p_pairs_exchange_both_ways(c);
      comm_checks::p2p_many_messages_arrive_in_order(c);
      comm_checks::p2p_count_mismatch_and_bad_peer(c);
    });
  }
}

// Point to point within a split group: peers are ranks of the group (the pipeline's stage groups).
TEST(CommLocal, PointToPointInASplitGroup) {
  on_threads(4, [](Comm& w) {
    std::unique_ptr<Comm> g = w.split(w.rank() % 2, w.rank());  // {0, 2} and {1, 3}
    float x = static_cast<float>(w.rank());
    if (g->rank() == 0) g->send(&x, 1, CommType::F32, 1, "test split");
    else g->recv(&x, 1, CommType::F32, 0, "test split");
    EXPECT_EQ(x, static_cast<float>(w.rank() % 2));
  });
}

TEST(CommLocal, OneRankHasNoPeer) {
  for (auto& c : {make_single_comm(), std::move(make_local_comms(1, 1)[0])}) {
    float x = 0;
    try {
      c->send(&x, 1, CommType::F32, 1, "activations");
      ADD_FAILURE() << "sent to a peer that does not exist";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("send 'activations': peer 1 is not another rank of this group (rank 0 of 1)"),
                std::string::npos)
          << e.what();
    }
  }
}

// A stage that never sends: its receiver stops within the timeout, naming the recv, itself and the peer.
TEST(CommLocal, ARecvFromAPeerThatNeverSendsTimesOut) {
  std::vector<std::unique_ptr<Comm>> comms = make_local_comms(2, /*timeout_s=*/0.5);
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  std::thread receiver([&] {
    std::vector<float> x(64);
    try {
      comms[0]->recv(x.data(), 64, CommType::F32, 1, "activations of micro-batch 3");
    } catch (const Error& e) {
      error = e.what();
    }
  });
  receiver.join();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(waited, 0.5);
  EXPECT_LT(waited, 5.0);
  EXPECT_NE(error.find("rank 0 of 2 (threads): recv 'activations of micro-batch 3' (64 elements from rank 1) did not "
                       "complete within 0.5 s (--comm_timeout): rank 1 did not send it"),
            std::string::npos)
      << error;
}

// A send completes only once its recv is posted, as NCCL's does (a rendezvous): an order of sends and receives that
// would deadlock on NCCL fails here too instead of passing on a buffered send. Rank 1 posts its recv 0.2 s late;
// rank 0's wait for the send returns only after that. A send nobody receives times out, naming it and the peer.
TEST(CommLocal, ASendCompletesOnlyOnceItsRecvIsPosted) {
  std::vector<std::unique_ptr<Comm>> comms = make_local_comms(2, /*timeout_s=*/5);
  std::vector<float> out(100, 3.0f), in(100, 0.0f);
  std::chrono::steady_clock::time_point sent, posted;
  std::thread receiver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    posted = std::chrono::steady_clock::now();
    comms[1]->recv(in.data(), 100, CommType::F32, 0, "activations");
  });
  comms[0]->send(out.data(), 100, CommType::F32, 1, "activations");
  sent = std::chrono::steady_clock::now();
  receiver.join();
  EXPECT_GE(sent, posted);
  EXPECT_EQ(in, out);

  std::vector<std::unique_ptr<Comm>> quick = make_local_comms(2, /*timeout_s=*/0.5);
  try {
    quick[0]->send(out.data(), 100, CommType::F32, 1, "activations of micro-batch 2");
    ADD_FAILURE() << "a send completed without a recv";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2 (threads): send 'activations of micro-batch 2' (100 elements to "
                                         "rank 1) did not complete within 0.5 s (--comm_timeout): rank 1 did not post "
                                         "the matching recv"),
              std::string::npos)
        << e.what();
  }
}

TEST(CommLocal, MeshGroups) {
  for (int size : {2, 4}) on_threads(size, comm_checks::mesh_groups_are_contiguous_in_tp);
  for (int size : {4, 8}) on_threads(size, comm_checks::mesh_places_stages_between_tp_and_dp);
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
