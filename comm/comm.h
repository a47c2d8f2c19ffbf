// Comm: the collectives tuna needs, over one group of ranks, behind one small interface.
//
// Implementations: SingleComm (one rank; collectives are copies), MpiComm (host buffers, Open MPI or any MPI-3
// library), LocalComm (ranks as threads of one process, host buffers: comm/comm_local.cpp), NcclComm (device
// buffers, on the comm's CUDA stream; built with CUDA only), the staged device comm (device buffers through
// any host comm: comm/comm_staged.cpp, for ranks that share one GPU, where NCCL refuses to run) and the loopback
// device comm (ranks as threads on one GPU, send/recv as device copies ordered by events: comm/comm_loopback.cpp).
// model/ and dist/zero use only this interface, so every parallel mode runs and is tested on CPU under
// `mpirun -np 2/4` against the single-rank run.
//
// Splits. A collective that splits n elements over the group gives rank r the piece shard_range(n, r, size):
// ceil(n / size) elements each, the last ranks shorter or empty. Implementations pad internally where
// their library needs equal pieces (NCCL); no "n must divide by the world size" rule reaches the caller.
//
// Point to point. send/recv (and their non-blocking starts) move n elements to or from one peer of the group:
// the activations and their gradients between pipeline stages. Messages between a pair of ranks arrive in the
// order they were sent; a send of n elements must meet a recv of n (a backend that can see a mismatch fails
// naming both counts; NCCL cannot see it).
//
// Failure. Every blocking wait of MpiComm, LocalComm and NcclComm, for a collective or a send/recv, is bounded by a
// timeout (--comm_timeout): a rank that died or hangs makes the others stop with an error naming the call (the
// `what` label every call carries, and the peer of a send/recv), this rank, and the ranks that did not answer,
// then abort the whole job (LocalComm throws the error instead: its ranks are threads of one process). See
// comm_mpi.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tuna {

// BF16: 2-byte bfloat16 elements (gathers move them as they are; sums of bf16 round the fp32 sum once).
enum class CommType { F32, F64, I64, BF16 };
int64_t comm_type_bytes(CommType type);
enum class ReduceOp { Sum, Max };

// The MPI backend issues all-reduce and reduce-scatter in chunks of this many bytes: in one call, Open MPI
// allocates a scratch buffer as large as the message (comm/comm_mpi.cpp), which chunks bound.
inline constexpr int64_t kMpiChunkBytes = int64_t(4) << 20;

// [begin, end) of one rank's piece of n elements split over `size` ranks.
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
Range shard_range(int64_t n, int rank, int size);

// A collective or send/recv started asynchronously (all_gather_start, send_start, recv_start); wait() completes it.
using CommRequest = int64_t;

class Comm {
 public:
  virtual ~Comm() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend() const = 0;  // "single", "mpi", "threads", "nccl", "staged ...", "loopback"

  // In place over n elements of `type`.
  virtual void all_reduce(void* buf, int64_t n, CommType type, ReduceOp op, const char* what) = 0;
  // send: n elements of `type` (F32 or BF16) from every rank; recv: the sum over ranks of this rank's piece
  // (shard_range(n)). BF16 sums follow all_reduce's (the fp32 sum rounded once); MpiComm refuses BF16.
  virtual void reduce_scatter(const void* send, void* recv, int64_t n, CommType type, const char* what) = 0;
  // send: this rank's piece of n elements of `type`; recv: all n, pieces in rank order. send may point into recv.
  virtual void all_gather(const void* send, void* recv, int64_t n, CommType type, const char* what) = 0;
  // The same, returning before completion (prefetch); buffers must stay alive until wait().
  virtual CommRequest all_gather_start(const void* send, void* recv, int64_t n, CommType type, const char* what) = 0;
  virtual void wait(CommRequest request) = 0;
  virtual void broadcast(void* buf, int64_t bytes, int root, const char* what) = 0;

  // Point to point with `peer`, a rank of this group other than this one. The starts return at once (the buffer
  // must stay alive, and a send's unchanged, until wait()), so two ranks may exchange in both directions by
  // starting both sides before waiting. Each side's requests complete in any order of wait() calls; the n-th
  // recv from a peer receives that peer's n-th send to this rank. Device comms: the buffers are device memory,
  // and NCCL runs the starts issued before a wait (or any other call) as one group.
  virtual CommRequest send_start(const void* buf, int64_t n, CommType type, int peer, const char* what) = 0;
  virtual CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) = 0;
  // Device comms on a stream of their own (the pipeline's): makes `stream` (a cudaStream_t) wait, on the device, for
  // a send or recv to complete, so that compute queued there after this call may rewrite a send's buffer or read a
  // recv's without holding the host. The caller still calls wait(request) once, before the host waits on `stream`
  // (that bounded wait keeps --comm_timeout). The staged comm completes the request here, on the host (its wait()
  // then returns at once); comms without device buffers refuse it.
  virtual void wait_on_stream(CommRequest request, void* stream);
  // Enqueues the starts issued so far: NCCL runs them as one group, now, instead of at the next call. Comms that
  // start each call at once do nothing.
  virtual void flush() {}
  // Device comms whose collectives run on the device (NCCL): a bounded host wait for `cuda_event` (a cudaEvent_t
  // recorded on the stream this comm enqueues on, after its collectives): at most --comm_timeout, then an error
  // naming `what`, this comm's last collective and its group, so that a peer that hangs inside a collective stops
  // this rank instead of leaving it in cudaEventSynchronize. Returns false when the comm has no device work that a
  // peer could hold up (host comms; the staged and loopback comms, whose collectives complete on the host): the
  // caller then waits for the event itself.
  virtual bool wait_event(void* cuda_event, const char* what) { return false; }
  // A comm that pads collectives in a scratch buffer of its own (NCCL) allocates it now, `bytes` large (the memory
  // plan's row for it, sized from the largest padded collective), instead of growing it in the middle of a pass (a
  // cudaFree: a device-wide synchronization). Others ignore it.
  virtual void reserve_scratch(int64_t bytes) {}
  // Blocking: returns when the message has left `buf` (send) or arrived in it (recv).
  void send(const void* buf, int64_t n, CommType type, int peer, const char* what) {
    wait(send_start(buf, n, type, peer, what));
  }
  void recv(void* buf, int64_t n, CommType type, int peer, const char* what) { wait(recv_start(buf, n, type, peer, what)); }

  virtual void barrier(const char* what) = 0;
  // Sub-groups: ranks passing the same color form one, ordered by key. Collective over this group.
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;

  void all_reduce_sum(float* buf, int64_t n, const char* what) { all_reduce(buf, n, CommType::F32, ReduceOp::Sum, what); }
  void all_reduce_sum(double* buf, int64_t n, const char* what) { all_reduce(buf, n, CommType::F64, ReduceOp::Sum, what); }
  void all_reduce_sum(int64_t* buf, int64_t n, const char* what) { all_reduce(buf, n, CommType::I64, ReduceOp::Sum, what); }
  void all_reduce_max(float* buf, int64_t n, const char* what) { all_reduce(buf, n, CommType::F32, ReduceOp::Max, what); }
  void all_gather(const float* send, float* recv, int64_t n, const char* what) {
    all_gather(send, recv, n, CommType::F32, what);
  }
  void reduce_scatter(const float* send, float* recv, int64_t n, const char* what) {
    reduce_scatter(send, recv, n, CommType::F32, what);
  }
  CommRequest all_gather_start(const float* send, float* recv, int64_t n, const char* what) {
    return all_gather_start(send, recv, n, CommType::F32, what);
  }

 protected:
  Comm(int rank, int size) : rank_(rank), size_(size) {}
  // Fails unless reduce_scatter sums `type` (F32 or BF16).
  static void check_reduce_scatter_type(CommType type, const char* what);
  // Fails unless peer is another rank of this group; `call` is "send" or "recv".
  void check_peer(int peer, int64_t n, const char* call, const char* what) const;

 private:
  int rank_, size_;
};

// One rank: reductions are identities, gathers and scatters copies.
std::unique_ptr<Comm> make_single_comm();

// Where this process sits, from the launcher's environment: mpirun (OMPI_COMM_WORLD_*), MPICH/Intel
// (PMI_*), Slurm's srun (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID). Size 1 when launched directly.
struct LaunchInfo {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;  // local: ranks on this node
  std::string launcher = "none";  // "mpirun", "pmi", "slurm", "none"
};
LaunchInfo detect_launch();

// The world group: a SingleComm when the launcher says one rank (MPI is then never initialized), an MpiComm
// over MPI_COMM_WORLD otherwise (MPI_Init here, MPI_Finalize when the last MPI comm goes away).
// timeout_s bounds every wait (0: wait forever).
std::unique_ptr<Comm> make_world_comm(double timeout_s);
// The same on an already initialized MPI (tests' main calls MPI_Init itself).
std::unique_ptr<Comm> make_mpi_world_comm(double timeout_s);

// Ranks as threads of one process (comm/comm_local.cpp): `size` comms of one group, comm r for the thread that is
// rank r. Collectives on host buffers; every wait bounded by timeout_s (0: forever), failing with an error that
// names the collective and the ranks that did not arrive.
std::vector<std::unique_ptr<Comm>> make_local_comms(int size, double timeout_s);

// A device comm through host staging (comm/comm_staged.cpp, CUDA builds): each collective copies its device
// buffers to pinned host memory on `stream` (a cudaStream_t), runs on `host` (any comm over the same ranks:
// LocalComm, MpiComm), copies the result back and waits for the copies. What several ranks sharing one GPU use
// instead of NCCL (which refuses two ranks on one device), and what the emulated tests use under mpirun.
// Synchronous: nothing overlaps; for verification, not speed.
std::unique_ptr<Comm> make_staged_device_comm(std::unique_ptr<Comm> host, void* stream);

// A device comm for ranks as threads of one process on one GPU (comm/comm_loopback.cpp, CUDA builds): send/recv as
// device-to-device copies on `stream` (a cudaStream_t), ordered by events as NCCL's are, a host rendezvous that only
// pairs sends with receives, and wait_on_stream on the device; collectives staged through `host` (a threads comm,
// make_local_comms). What runs the pipeline's stream order on one GPU or the emulator as NCCL runs it across GPUs.
// Every host wait bounded by timeout_s (0: forever).
std::unique_ptr<Comm> make_loopback_device_comm(std::unique_ptr<Comm> host, void* stream, double timeout_s);

// NCCL on device buffers, enqueued on `stream` (a cudaStream_t); builds with TUNA_NCCL only. `host` (an
// MpiComm over the same ranks) carries the NCCL unique id from rank 0 and builds split() groups. The
// caller has already selected its GPU (cudaSetDevice(local_rank): one GPU per rank).
struct NcclOptions {
  // The most CTAs (channels) its kernels take; 0: NCCL's choice. The pipeline's comm moves one activation or
  // gradient at a time, and a receive posted ahead spins on its SMs through the forward it overlaps (dist/
  // pipeline.h receives_gradient_ahead), SMs the forward's GEMMs and attention need: a few channels carry it.
  int max_ctas = 0;
};
std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host, void* stream, double timeout_s,
                                     const NcclOptions& options = {});

// Ends the process with exit_code; under MPI with several ranks, the whole job (MPI_Abort), so that an
// error on one rank does not leave the others waiting in their next collective.
[[noreturn]] void abort_job(int exit_code);

// For signal handlers (async-signal-safe): writes "rank R: signal S while waiting in <collective>" to
// stderr when this process is inside a collective. When mpirun takes a job down because a rank died, the
// survivors get SIGTERM inside the collective the dead rank never joined; this names it.
void note_signal_in_collective(int signal);

// The rank mesh: world = dp x pp x tp, tensor-parallel ranks contiguous, then pipeline stages
// (world rank = (dp_rank * pp + pp_rank) * tp + tp_rank), so that a tp group sits inside one node when ranks are
// placed by node (mpirun's default, srun's block) and the stages of one pipeline span nodes before dp does.
struct Mesh {
  int dp_rank = 0, dp_size = 1, tp_rank = 0, tp_size = 1, pp_rank = 0, pp_size = 1;
  std::unique_ptr<Comm> dp, tp, pp;  // the groups this rank belongs to (pp: this pipeline's stages, by stage)
};
// Fails with a message when tp x pp does not divide the world size.
Mesh make_mesh(Comm& world, int64_t tp, int64_t pp = 1);

}  // namespace tuna
