// Comm pieces shared by every backend: the split rule, the single-rank comm, launcher detection, the mesh.
#include "comm/comm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace tuna {

Range shard_range(int64_t n, int rank, int size) {
  TUNA_CHECK(size > 0 && rank >= 0 && rank < size && n >= 0, "n ", n, " rank ", rank, " size ", size);
  const int64_t chunk = (n + size - 1) / size;
  const int64_t begin = std::min(n, chunk * rank);
  return {begin, std::min(n, begin + chunk)};
}

int64_t comm_type_bytes(CommType type) {
  switch (type) {
    case CommType::F32: return 4;
    case CommType::F64: return 8;
    case CommType::I64: return 8;
    case CommType::BF16: return 2;
  }
  return 0;
}

void Comm::check_reduce_scatter_type(CommType type, const char* what) {
  if (type != CommType::F32 && type != CommType::BF16)
    fail("reduce_scatter '", what, "': sums fp32 or bf16 elements, not ", comm_type_bytes(type), "-byte ",
         type == CommType::F64 ? "f64" : "i64", " ones");
}

void Comm::check_peer(int peer, int64_t n, const char* call, const char* what) const {
  if (peer < 0 || peer >= size() || peer == rank())
    fail(call, " '", what, "': peer ", peer, " is not another rank of this group (rank ", rank(), " of ", size(), ")");
  TUNA_CHECK(n >= 0, call, " '", what, "': ", n, " elements");
}

void Comm::wait_on_stream(CommRequest, void*) {
  fail("wait_on_stream on the ", backend(), " comm: only device comms (nccl, staged, loopback) order a stream after a request");
}

namespace {

class SingleComm final : public Comm {
 public:
  SingleComm() : Comm(0, 1) {}
  std::string backend() const override { return "single"; }
  void all_reduce(void*, int64_t, CommType, ReduceOp, const char*) override {}
  void reduce_scatter(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    check_reduce_scatter_type(type, what);
    if (send != recv) std::memmove(recv, send, n * comm_type_bytes(type));
  }
  void all_gather(const void* send, void* recv, int64_t n, CommType type, const char*) override {
    if (send != recv) std::memmove(recv, send, n * comm_type_bytes(type));
  }
  CommRequest all_gather_start(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    all_gather(send, recv, n, type, what);
    return 0;
  }
  void wait(CommRequest) override {}
  void broadcast(void*, int64_t, int root, const char*) override { TUNA_CHECK(root == 0, "root ", root); }
  void barrier(const char*) override {}
  // One rank has no peer to send to or receive from.
  CommRequest send_start(const void*, int64_t n, CommType, int peer, const char* what) override {
    check_peer(peer, n, "send", what);
    return 0;
  }
  CommRequest recv_start(void*, int64_t n, CommType, int peer, const char* what) override {
    check_peer(peer, n, "recv", what);
    return 0;
  }
  std::unique_ptr<Comm> split(int, int) override { return std::make_unique<SingleComm>(); }
};

// The integer value of an environment variable, or -1 when unset.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : -1;
}

}  // namespace

std::unique_ptr<Comm> make_single_comm() { return std::make_unique<SingleComm>(); }

LaunchInfo detect_launch() {
  LaunchInfo info;
  // Open MPI's mpirun first: under `srun --mpi=pmix` or inside an allocation both may be set, and the
  // launcher that started this process is the innermost one.
  const struct {
    const char *rank, *size, *local, *local_size, *name;
  } sources[] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun"},
      {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "pmi"},
      {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "slurm"}};
  for (const auto& s : sources) {
    const int rank = env_int(s.rank), size = env_int(s.size);
    if (rank < 0 || size < 1) continue;
    info.rank = rank, info.size = size, info.launcher = s.name;
    info.local_rank = std::max(0, env_int(s.local));
    info.local_size = std::max(1, env_int(s.local_size));
    break;
  }
  return info;
}

Mesh make_mesh(Comm& world, int64_t tp, int64_t pp) {
  if (tp < 1 || world.size() % tp != 0)
    fail("option 'tp': ", tp, " does not divide the world size ", world.size(),
         " (world = dp x pp x tp; launch a multiple of tp x pp ranks)");
  if (pp < 1 || world.size() % (tp * pp) != 0)
    fail("option 'pp': ", pp, " x tp ", tp, " does not divide the world size ", world.size(),
         " (world = dp x pp x tp; launch a multiple of tp x pp ranks)");
  Mesh m;
  m.tp_size = static_cast<int>(tp);
  m.pp_size = static_cast<int>(pp);
  m.dp_size = world.size() / (m.tp_size * m.pp_size);
  m.tp_rank = world.rank() % m.tp_size;
  m.pp_rank = (world.rank() / m.tp_size) % m.pp_size;
  m.dp_rank = world.rank() / (m.tp_size * m.pp_size);
  // The splits are collective over the world: every rank makes all three, in the same order.
  m.tp = world.split(/*color=*/m.dp_rank * m.pp_size + m.pp_rank, /*key=*/m.tp_rank);
  m.dp = world.split(/*color=*/m.pp_rank * m.tp_size + m.tp_rank, /*key=*/m.dp_rank);
  m.pp = world.split(/*color=*/m.dp_rank * m.tp_size + m.tp_rank, /*key=*/m.pp_rank);
  return m;
}

}  // namespace tuna
