// The semantics of every Comm, checked the same way whatever carries it: MpiComm under mpirun
// (tests/mpi/test_comm.cpp) and LocalComm's threads (tests/comm/test_comm_local.cpp). Each function is one rank's
// side of a check; every rank of the group calls it. Uneven sizes (n not a multiple of the ranks, n < ranks, 0),
// every type, the world and the dp x tp mesh's groups; point to point: rings, exchanges, order, large messages.
#pragma once

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "comm/comm.h"

namespace tuna::comm_checks {

// Element i of rank r's input: distinct per rank and index, exact in fp32 (and in bf16 below 256).
inline float value(int r, int64_t i) { return static_cast<float>(r * 1000 + i % 997); }

inline void all_reduce_sum_and_max_every_type(Comm& w) {
  const int P = w.size();
  // 2^20 + 1001: past the MPI backend's chunk (kMpiChunkBytes: two f32 chunks, three f64 ones).
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(1001), (int64_t(1) << 20) + 1001}) {
    std::vector<float> f(n);
    std::vector<double> d(n);
    std::vector<int64_t> k(n);
    std::vector<uint16_t> b(n);
    for (int64_t i = 0; i < n; i++) {
      f[i] = value(w.rank(), i), d[i] = 0.5 * value(w.rank(), i), k[i] = w.rank() + i;
      b[i] = f32_to_bf16(static_cast<float>(w.rank() + i % 7));
    }
    std::vector<float> fm = f;
    w.all_reduce_sum(f.data(), n, "test f32");
    w.all_reduce_sum(d.data(), n, "test f64");
    w.all_reduce_sum(k.data(), n, "test i64");
    w.all_reduce_max(fm.data(), n, "test max");
    if (w.backend() != "mpi") w.all_reduce(b.data(), n, CommType::BF16, ReduceOp::Sum, "test bf16");
    for (int64_t i = 0; i < n; i++) {
      double sum = 0;
      for (int r = 0; r < P; r++) sum += value(r, i);
      EXPECT_EQ(f[i], static_cast<float>(sum)) << i;
      EXPECT_EQ(d[i], 0.5 * sum) << i;
      EXPECT_EQ(k[i], int64_t(P) * (P - 1) / 2 + P * i) << i;
      EXPECT_EQ(fm[i], value(P - 1, i)) << i;
      if (w.backend() != "mpi") {
        EXPECT_EQ(bf16_to_f32(b[i]), float(P * (P - 1) / 2 + P * (i % 7))) << i;
      }
    }
  }
}

// Element i of rank r's bf16 input: rank 0's are 256 + even, the others' small integers, so that rounding each
// partial sum to bf16 (8 significant bits: steps of 2 above 256) loses what the fp32 sum rounded once keeps.
inline float bf16_value(int r, int64_t i) { return static_cast<float>(r == 0 ? 256 + 2 * (i % 5) : (r + i) % 3); }

// bf16 pieces of n elements summed in fp32 and rounded once (all_reduce's contract); MpiComm refuses bf16 sums
// (the staged device comm widens them before they reach it).
inline void reduce_scatter_bf16(Comm& w, int64_t n) {
  const int P = w.size();
  std::vector<uint16_t> full(n);
  for (int64_t i = 0; i < n; i++) full[i] = f32_to_bf16(bf16_value(w.rank(), i));
  const Range mine = shard_range(n, w.rank(), P);
  const uint16_t guard = f32_to_bf16(-1.0f);
  std::vector<uint16_t> piece(mine.size() + 1, guard);
  if (w.backend() == "mpi") {
    EXPECT_THROW(w.reduce_scatter(full.data(), piece.data(), n, CommType::BF16, "test rs bf16"), Error);
    return;
  }
  w.reduce_scatter(full.data(), piece.data(), n, CommType::BF16, "test rs bf16");
  for (int64_t i = 0; i < mine.size(); i++) {
    double sum = 0;
    for (int r = 0; r < P; r++) sum += bf16_value(r, mine.begin + i);
    ASSERT_EQ(piece[i], f32_to_bf16(static_cast<float>(sum))) << "n " << n << " i " << i << ": " << bf16_to_f32(piece[i]);
  }
  EXPECT_EQ(piece[mine.size()], guard) << "wrote past its piece";
  // Only fp32 and bf16 are summed.
  std::vector<double> d(n);
  EXPECT_THROW(w.reduce_scatter(d.data(), d.data(), n, CommType::F64, "test rs f64"), Error);
}

inline void reduce_scatter_and_all_gather_on_uneven_sizes(Comm& w) {
  const int P = w.size();
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(P - 1), int64_t(P + 1), int64_t(1003), (int64_t(1) << 20) + 1003}) {
    std::vector<float> full(n);
    for (int64_t i = 0; i < n; i++) full[i] = value(w.rank(), i);
    const Range mine = shard_range(n, w.rank(), P);
    std::vector<float> piece(mine.size() + 1, -1.0f);  // one guard element past the piece
    w.reduce_scatter(full.data(), piece.data(), n, "test rs");
    for (int64_t i = 0; i < mine.size(); i++) {
      double sum = 0;
      for (int r = 0; r < P; r++) sum += value(r, mine.begin + i);
      EXPECT_EQ(piece[i], static_cast<float>(sum)) << "n " << n << " i " << i;
    }
    EXPECT_EQ(piece[mine.size()], -1.0f) << "wrote past its piece";
    reduce_scatter_bf16(w, n);

    // Gather rank-specific pieces, out of place and in place, in fp32 and as bf16 bits.
    for (int64_t i = 0; i < mine.size(); i++) piece[i] = value(w.rank(), mine.begin + i);
    std::vector<float> gathered(n, 0.0f);
    w.all_gather(piece.data(), gathered.data(), n, "test ag");
    std::vector<float> in_place(n, 0.0f);
    std::copy(piece.begin(), piece.begin() + mine.size(), in_place.begin() + mine.begin);
    CommRequest req = w.all_gather_start(in_place.data() + mine.begin, in_place.data(), n, "test ag async");
    w.wait(req);
    std::vector<uint16_t> bits(n, 0);
    for (int64_t i = mine.begin; i < mine.end; i++) bits[i] = static_cast<uint16_t>(w.rank() * 1000 + i);
    w.all_gather(bits.data() + mine.begin, bits.data(), n, CommType::BF16, "test ag bf16");
    for (int r = 0; r < P; r++) {
      const Range theirs = shard_range(n, r, P);
      for (int64_t i = theirs.begin; i < theirs.end; i++) {
        EXPECT_EQ(gathered[i], value(r, i));
        EXPECT_EQ(in_place[i], value(r, i));
        EXPECT_EQ(bits[i], static_cast<uint16_t>(r * 1000 + i));
      }
    }
  }
}

inline void broadcast_and_barrier(Comm& w) {
  for (int root = 0; root < w.size(); root++) {
    std::vector<char> bytes(13, static_cast<char>(w.rank()));
    w.broadcast(bytes.data(), bytes.size(), root, "test bcast");
    for (char c : bytes) EXPECT_EQ(c, root);
  }
  w.barrier("test");
}

inline void mesh_groups_are_contiguous_in_tp(Comm& w) {
  Mesh m = make_mesh(w, 2);
  EXPECT_EQ(m.tp_size, 2);
  EXPECT_EQ(m.dp_size, w.size() / 2);
  EXPECT_EQ(m.tp_rank, w.rank() % 2);
  EXPECT_EQ(m.tp->rank(), m.tp_rank);
  EXPECT_EQ(m.dp->rank(), m.dp_rank);
  // Summing world ranks over each group shows who is in it.
  int64_t x = w.rank();
  m.tp->all_reduce_sum(&x, 1, "test tp");
  EXPECT_EQ(x, 2 * (w.rank() / 2) * 2 + 1);  // ranks 2d and 2d+1
  int64_t y = w.rank();
  m.dp->all_reduce_sum(&y, 1, "test dp");
  int64_t expect = 0;
  for (int d = 0; d < m.dp_size; d++) expect += 2 * d + m.tp_rank;
  EXPECT_EQ(y, expect);
  // tp must divide the world.
  EXPECT_THROW(make_mesh(w, w.size() + 1), Error);
}

// world = dp x pp x tp with tp innermost, then the stages: rank (d * pp + s) * tp + t. Needs a world of 4 or more
// (2 x 2, and dp 2 at 8).
inline void mesh_places_stages_between_tp_and_dp(Comm& w) {
  if (w.size() % 4 != 0) return;
  Mesh m = make_mesh(w, 2, 2);
  EXPECT_EQ(m.tp_size, 2);
  EXPECT_EQ(m.pp_size, 2);
  EXPECT_EQ(m.dp_size, w.size() / 4);
  EXPECT_EQ(m.tp_rank, w.rank() % 2);
  EXPECT_EQ(m.pp_rank, (w.rank() / 2) % 2);
  EXPECT_EQ(m.dp_rank, w.rank() / 4);
  EXPECT_EQ(m.pp->size(), 2);
  EXPECT_EQ(m.pp->rank(), m.pp_rank);
  // The members of each group, by the sum of their world ranks.
  const auto rank_of = [&](int d, int s, int t) { return (d * 2 + s) * 2 + t; };
  int64_t x = w.rank();
  m.pp->all_reduce_sum(&x, 1, "test pp");
  EXPECT_EQ(x, rank_of(m.dp_rank, 0, m.tp_rank) + rank_of(m.dp_rank, 1, m.tp_rank));
  int64_t y = w.rank();
  m.tp->all_reduce_sum(&y, 1, "test tp");
  EXPECT_EQ(y, rank_of(m.dp_rank, m.pp_rank, 0) + rank_of(m.dp_rank, m.pp_rank, 1));
  int64_t z = w.rank(), expect = 0;
  m.dp->all_reduce_sum(&z, 1, "test dp");
  for (int d = 0; d < m.dp_size; d++) expect += rank_of(d, m.pp_rank, m.tp_rank);
  EXPECT_EQ(z, expect);
  // tp x pp must divide the world.
  EXPECT_THROW(make_mesh(w, 2, w.size()), Error);
}

// Element i of the m-th message from rank `from` to rank `to`: distinct per message, exact in fp32.
inline float message_value(int from, int to, int64_t m, int64_t i) {
  return static_cast<float>((from * 16 + to) * 100000 + m * 1000 + i % 997);
}

// Every rank sends to the next and receives from the previous (a pipeline's activations, wrapped around), with
// starts posted before waits, in every type and at sizes from empty to 64 MB (past MPI's eager limit, so the
// send waits for the matching recv).
inline void p2p_ring(Comm& w) {
  const int P = w.size(), next = (w.rank() + 1) % P, prev = (w.rank() + P - 1) % P;
  if (P < 2) return;
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1001), (int64_t(16) << 20) + 3}) {
    std::vector<float> out(n), in(n, -1.0f);
    for (int64_t i = 0; i < n; i++) out[i] = message_value(w.rank(), next, 0, i);
    CommRequest r = w.recv_start(in.data(), n, CommType::F32, prev, "test ring");
    CommRequest s = w.send_start(out.data(), n, CommType::F32, next, "test ring");
    w.wait(s);
    w.wait(r);
    for (int64_t i = 0; i < n; i++)
      if (in[i] != message_value(prev, w.rank(), 0, i)) {
        ADD_FAILURE() << "n " << n << " element " << i << ": " << in[i];
        break;
      }
  }
  // Other types, blocking: even ranks send first, odd ranks receive first, and in an odd ring rank 0 receives
  // first too (its sender, the last rank, is even), so each blocking send meets a recv and nothing deadlocks.
  std::vector<double> d_out(7, 0.5 * w.rank()), d_in(7);
  std::vector<int64_t> k_out(5, w.rank() + 100), k_in(5);
  std::vector<uint16_t> b_out(3, static_cast<uint16_t>(w.rank() + 7)), b_in(3);
  auto sends = [&] {
    w.send(d_out.data(), 7, CommType::F64, next, "test f64");
    w.send(k_out.data(), 5, CommType::I64, next, "test i64");
    w.send(b_out.data(), 3, CommType::BF16, next, "test bf16");
  };
  auto recvs = [&] {
    w.recv(d_in.data(), 7, CommType::F64, prev, "test f64");
    w.recv(k_in.data(), 5, CommType::I64, prev, "test i64");
    w.recv(b_in.data(), 3, CommType::BF16, prev, "test bf16");
  };
  const bool send_first = P % 2 == 0 ? w.rank() % 2 == 0 : (w.rank() % 2 == 0 && w.rank() != 0);
  if (send_first) sends(), recvs();
  else recvs(), sends();
  for (double x : d_in) EXPECT_EQ(x, 0.5 * prev);
  for (int64_t x : k_in) EXPECT_EQ(x, prev + 100);
  for (uint16_t x : b_in) EXPECT_EQ(x, prev + 7);
}

// Pairs (0, 1), (2, 3), ... exchange 32 MB in both directions, each side starting its send before its recv and
// waiting for the send first: the case that deadlocks when a send waits for its recv before the recv is posted.
inline void p2p_pairs_exchange_both_ways(Comm& w) {
  const int peer = w.rank() ^ 1;
  if (peer >= w.size()) return;  // an odd world's last rank has no partner
  const int64_t n = int64_t(8) << 20;
  std::vector<float> out(n), in(n, -1.0f);
  for (int64_t i = 0; i < n; i++) out[i] = message_value(w.rank(), peer, 0, i);
  CommRequest s = w.send_start(out.data(), n, CommType::F32, peer, "test exchange");
  CommRequest r = w.recv_start(in.data(), n, CommType::F32, peer, "test exchange");
  w.wait(s);
  w.wait(r);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; i++) wrong += in[i] != message_value(peer, w.rank(), 0, i);
  EXPECT_EQ(wrong, 0);
}

// Rank 0 sends rank 1 200 messages of varying sizes, half blocking and half started; rank 1 starts every recv
// first and waits for them last to first: the k-th recv still gets the k-th send.
inline void p2p_many_messages_arrive_in_order(Comm& w) {
  if (w.size() < 2 || w.rank() > 1) return;
  const int kMessages = 200;
  auto size_of = [](int m) { return int64_t(1 + (m * 37) % 5000); };
  std::vector<std::vector<float>> buffers(kMessages);
  if (w.rank() == 0) {
    std::vector<CommRequest> pending;
    for (int m = 0; m < kMessages; m++) {
      buffers[m].resize(size_of(m));
      for (int64_t i = 0; i < size_of(m); i++) buffers[m][i] = message_value(0, 1, m, i);
      if (m % 2) w.send(buffers[m].data(), size_of(m), CommType::F32, 1, "test order");
      else pending.push_back(w.send_start(buffers[m].data(), size_of(m), CommType::F32, 1, "test order"));
    }
    for (CommRequest r : pending) w.wait(r);
  } else {
    std::vector<CommRequest> requests;
    for (int m = 0; m < kMessages; m++) {
      buffers[m].assign(size_of(m), -1.0f);
      requests.push_back(w.recv_start(buffers[m].data(), size_of(m), CommType::F32, 0, "test order"));
    }
    for (int m = kMessages - 1; m >= 0; m--) w.wait(requests[m]);
    for (int m = 0; m < kMessages; m++)
      for (int64_t i = 0; i < size_of(m); i++)
        if (buffers[m][i] != message_value(0, 1, m, i)) {
          ADD_FAILURE() << "message " << m << " element " << i << ": " << buffers[m][i];
          break;
        }
  }
}

// A recv of a different count from the send fails on the receiver, naming the recv and both counts; a peer
// that is not another rank of the group fails at once.
inline void p2p_count_mismatch_and_bad_peer(Comm& w) {
  EXPECT_THROW(w.send_start(nullptr, 1, CommType::F32, w.rank(), "test self"), Error);
  EXPECT_THROW(w.recv_start(nullptr, 1, CommType::F32, w.size(), "test outside"), Error);
  if (w.size() < 2 || w.rank() > 1) return;
  std::vector<float> buf(7, 1.0f);
  if (w.rank() == 0) {
    w.send(buf.data(), 5, CommType::F32, 1, "test short");
  } else {
    try {
      w.recv(buf.data(), 7, CommType::F32, 0, "test short");
      ADD_FAILURE() << "a recv of 7 elements accepted a send of 5";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("recv 'test short' (7 elements from rank 0)"), std::string::npos) << m;
      EXPECT_NE(m.find("sent 5 elements"), std::string::npos) << m;
      EXPECT_NE(m.find("expects 7"), std::string::npos) << m;
    }
  }
}

}  // namespace tuna::comm_checks
