// Bus bandwidth of the collectives of comm/comm.h, as nccl-tests reports it: the MPI backend on host
// buffers, or with --nccl (CUDA builds with NCCL) the NCCL backend on device buffers, one GPU per rank.
// Run under a launcher; started directly it relaunches itself under `mpirun -np 2`:
//
//   mpirun -np 8 build/bench_comm [--nccl]      (one node)      build/bench_comm   (2 local ranks)
//
// For a collective over n ranks on a buffer of S bytes taking t seconds (the slowest rank's time):
//   algbw = S / t
//   busbw = algbw * factor, the factor (from nccl-tests' PERFORMANCE.md) making busbw comparable with the
//   link bandwidth whatever n:
//     all_reduce       2 (n - 1) / n     (S: the buffer every rank reduces)
//     reduce_scatter   (n - 1) / n       (S: the whole input of one rank, n pieces)
//     all_gather       (n - 1) / n       (S: the whole output, n pieces)
// float32 elements; sizes 4 KB to 64 MB.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "comm/comm.h"

#if TUNA_NCCL
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace {

using namespace tuna;
using Clock = std::chrono::steady_clock;

// Seconds per call of fn (slowest rank), after warmup, with enough calls to last ~0.2 s.
// host: the MPI world (timing and the time reduction); c: the comm measured (the same, or NCCL);
// sync: waits for c's queued work (NCCL is asynchronous).
template <typename Fn, typename Sync>
double time_collective(Comm& host, Fn fn, Sync sync, int64_t bytes) {
  for (int i = 0; i < 3; i++) fn();
  sync();
  const int iters = static_cast<int>(std::clamp<int64_t>((int64_t(1) << 28) / std::max<int64_t>(bytes, 1), 5, 200));
  host.barrier("bench start");
  const auto start = Clock::now();
  for (int i = 0; i < iters; i++) fn();
  sync();
  double seconds = std::chrono::duration<double>(Clock::now() - start).count() / iters;
  host.all_reduce(&seconds, 1, CommType::F64, ReduceOp::Max, "bench time");
  return seconds;
}

int run(bool nccl) {
  std::unique_ptr<Comm> host = make_world_comm(/*timeout_s=*/120);
  std::unique_ptr<Comm> device_comm;
  std::function<void()> sync = [] {};
  // Buffers of up to 64 MB: host vectors, or device memory for NCCL.
  const int64_t max_count = (int64_t(64) << 20) / 4;
  std::vector<float> host_buf(nccl ? 0 : max_count, 1.0f), host_piece(nccl ? 0 : max_count, 1.0f);
  float* buf_ptr = host_buf.data();
  float* piece_ptr = host_piece.data();
  if (nccl) {
#if TUNA_NCCL
    TUNA_CUDA_CHECK(cudaSetDevice(detect_launch().local_rank));
    cudaStream_t stream;
    TUNA_CUDA_CHECK(cudaStreamCreate(&stream));
    TUNA_CUDA_CHECK(cudaMalloc(&buf_ptr, max_count * sizeof(float)));
    TUNA_CUDA_CHECK(cudaMalloc(&piece_ptr, max_count * sizeof(float)));
    TUNA_CUDA_CHECK(cudaMemset(buf_ptr, 0, max_count * sizeof(float)));
    device_comm = make_nccl_comm(host->split(0, host->rank()), stream, /*timeout_s=*/120);
    sync = [stream] { TUNA_CUDA_CHECK(cudaStreamSynchronize(stream)); };
#else
    fail("--nccl: this build has no NCCL (build with CUDA and NCCL)");
#endif
  }
  Comm* world = device_comm ? device_comm.get() : host.get();
  const int n = world->size();
  if (host->rank() == 0) {
    std::printf("bench_comm: %d ranks, backend %s; busbw = algbw x factor (all_reduce 2(n-1)/n = %.3f, "
                "reduce_scatter and all_gather (n-1)/n = %.3f)\n",
                n, world->backend().c_str(), 2.0 * (n - 1) / n, double(n - 1) / n);
    std::printf("%-15s %12s %12s %12s %12s\n", "collective", "bytes", "time (us)", "algbw GB/s", "busbw GB/s");
  }
  for (int64_t bytes = 4 << 10; bytes <= (int64_t(64) << 20); bytes *= 4) {
    const int64_t count = bytes / 4;
    float* buf = buf_ptr;
    float* piece = piece_ptr;
    const Range mine = shard_range(count, world->rank(), n);
    struct Row {
      const char* name;
      double factor;
      double seconds;
    } rows[] = {
        {"all_reduce", 2.0 * (n - 1) / n,
         time_collective(*host, [&] { world->all_reduce_sum(buf, count, "bench"); }, sync, bytes)},
        {"reduce_scatter", double(n - 1) / n,
         time_collective(*host, [&] { world->reduce_scatter(buf, piece, count, "bench"); }, sync, bytes)},
        {"all_gather", double(n - 1) / n,
         time_collective(*host, [&] { world->all_gather(buf + mine.begin, buf, count, "bench"); }, sync, bytes)},
    };
    if (host->rank() != 0) continue;
    for (const Row& r : rows)
      std::printf("%-15s %12lld %12.1f %12.3f %12.3f\n", r.name, (long long)bytes, r.seconds * 1e6,
                  bytes / r.seconds / 1e9, bytes / r.seconds / 1e9 * r.factor);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool nccl = argc > 1 && std::string(argv[1]) == "--nccl";
  if (argc > 2 || (argc == 2 && !nccl)) {
    std::fprintf(stderr, "usage: [mpirun -np N] %s [--nccl]\n", argv[0]);
    return 1;
  }
  if (detect_launch().launcher == "none" && !std::getenv("TUNA_BENCH_COMM_SINGLE")) {
    // Not under a launcher: relaunch under mpirun with 2 ranks (as root and on few cores too).
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0);
    execlp("mpirun", "mpirun", "--bind-to", "none", "-np", "2", argv[0], nccl ? "--nccl" : static_cast<char*>(nullptr),
           static_cast<char*>(nullptr));
    std::fprintf(stderr, "bench_comm: cannot run mpirun; set TUNA_BENCH_COMM_SINGLE=1 to time one rank\n");
    return 1;
  }
  try {
    return run(nccl);
  } catch (const tuna::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    abort_job(1);
  }
}
