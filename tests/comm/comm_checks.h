// The semantics of every Comm, checked the same way whatever carries it: MpiComm under mpirun
// (tests/mpi/test_comm.cpp) and LocalComm's threads (tests/comm/test_comm_local.cpp). Each function is one rank's
// side of a check; every rank of the group calls it. Uneven sizes (n not a multiple of the ranks, n < ranks, 0),
// every type, the world and the dp x tp mesh's groups.
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

}  // namespace tuna::comm_checks
