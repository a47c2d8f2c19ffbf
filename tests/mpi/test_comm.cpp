// dist/comm under mpirun: every collective on uneven sizes (n not a multiple of the ranks, n < ranks, 0),
// in every type, on the world and on the dp x tp mesh's groups.
#include <gtest/gtest.h>

#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "tests/mpi/mpi_test_util.h"

namespace tuna {
namespace {

// Peak resident memory of this process (VmHWM), in bytes.
int64_t peak_resident_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

// Element i of rank r's input: distinct per rank and index, exact in fp32.
float value(int r, int64_t i) { return static_cast<float>(r * 1000 + i % 997); }

TEST(Comm, AllReduceSumAndMaxEveryType) {
  Comm& w = test::world();
  const int P = w.size();
  // 2^20 + 1001: past the MPI backend's 4 MiB chunk (two f32 chunks, three f64 ones).
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(1001), (int64_t(1) << 20) + 1001}) {
    std::vector<float> f(n);
    std::vector<double> d(n);
    std::vector<int64_t> k(n);
    for (int64_t i = 0; i < n; i++) f[i] = value(w.rank(), i), d[i] = 0.5 * value(w.rank(), i), k[i] = w.rank() + i;
    std::vector<float> fm = f;
    w.all_reduce_sum(f.data(), n, "test f32");
    w.all_reduce_sum(d.data(), n, "test f64");
    w.all_reduce_sum(k.data(), n, "test i64");
    w.all_reduce_max(fm.data(), n, "test max");
    for (int64_t i = 0; i < n; i++) {
      double sum = 0;
      for (int r = 0; r < P; r++) sum += value(r, i);
      EXPECT_EQ(f[i], static_cast<float>(sum)) << i;
      EXPECT_EQ(d[i], 0.5 * sum) << i;
      EXPECT_EQ(k[i], int64_t(P) * (P - 1) / 2 + P * i) << i;
      EXPECT_EQ(fm[i], value(P - 1, i)) << i;
    }
  }
}

// A gradient all-reduce in place and a unit's reduce-scatter need no scratch as large as the message (Open MPI
// allocates one per call: a transient 4 bytes per parameter); the MPI backend chunks them (dist/comm_mpi.cpp).
TEST(Comm, LargeCollectivesNeedNoScratchAsLargeAsTheMessage) {
  Comm& w = test::world();
  if (w.backend() != "mpi") GTEST_SKIP() << "the MPI backend's property";
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

TEST(Comm, ReduceScatterAndAllGatherOnUnevenSizes) {
  Comm& w = test::world();
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

    // Gather rank-specific pieces, out of place and in place.
    for (int64_t i = 0; i < mine.size(); i++) piece[i] = value(w.rank(), mine.begin + i);
    std::vector<float> gathered(n, 0.0f);
    w.all_gather(piece.data(), gathered.data(), n, "test ag");
    std::vector<float> in_place(n, 0.0f);
    std::copy(piece.begin(), piece.begin() + mine.size(), in_place.begin() + mine.begin);
    CommRequest req = w.all_gather_start(in_place.data() + mine.begin, in_place.data(), n, "test ag async");
    w.wait(req);
    for (int r = 0; r < P; r++) {
      const Range theirs = shard_range(n, r, P);
      for (int64_t i = theirs.begin; i < theirs.end; i++) {
        EXPECT_EQ(gathered[i], value(r, i));
        EXPECT_EQ(in_place[i], value(r, i));
      }
    }
  }
}

TEST(Comm, BroadcastAndBarrier) {
  Comm& w = test::world();
  for (int root = 0; root < w.size(); root++) {
    std::vector<char> bytes(13, static_cast<char>(w.rank()));
    w.broadcast(bytes.data(), bytes.size(), root, "test bcast");
    for (char c : bytes) EXPECT_EQ(c, root);
  }
  w.barrier("test");
}

TEST(Comm, MeshGroupsAreContiguousInTp) {
  Comm& w = test::world();
  if (w.size() % 2) GTEST_SKIP() << "needs an even world";
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

}  // namespace
}  // namespace tuna
