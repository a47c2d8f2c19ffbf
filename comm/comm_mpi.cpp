// MpiComm: the collectives on host buffers over MPI, each bounded by a timeout.
//
// Every collective is issued non-blocking (MPI_Iallreduce, MPI_Ireduce_scatter, MPI_Iallgatherv, ...) and
// completed by one wait loop that polls MPI_Test. Blocking MPI calls cannot be interrupted, so a peer that
// hangs (a stuck kernel, a stopped process, a dead node whose TCP connection never resets) would hold the
// job forever; polling lets us give up after --comm_timeout. The loop calls MPI_Test back to back (yielding
// the core in between, for oversubscribed test runs) for the first second, because the library advances a
// collective only inside MPI calls; after that it naps between polls: a peer that is a second late is
// computing, not communicating, and a busy wait would steal its core.
//
// When the timeout expires, the rank asks every other rank over a private duplicate of MPI_COMM_WORLD
// ("census") what it is doing. Ranks answer from inside their own wait loops, so a rank waiting in a
// collective answers with its label and sequence number, and a rank that died, hangs or computes
// outside any collective stays silent. The error then names this rank, the collective, and the silent
// ranks, and MPI_Abort takes the whole job down (mpirun exits non-zero).
//
// Memory. Open MPI's all-reduce in place and its reduce-scatter allocate a scratch buffer as large as the
// message for the time of the call (measured: +256 MB of peak resident memory for an in-place all-reduce of
// 256 MB at 2 ranks): for a ZeRO-0/1 gradient all-reduce, a transient 4 bytes per parameter. Both are
// therefore issued in chunks of kMpiChunkBytes, which bounds that scratch (and our own staging for a chunked
// reduce-scatter) to a few MB. Not slower: build/bench_comm at 2 ranks on the 2-core dev machine (loaded, two
// alternating runs each) took 160-190 ms for a 64 MB all-reduce in chunks against 350-435 ms in one call.
//
// Point to point. send_start/recv_start are MPI_Isend/MPI_Irecv on a private duplicate of the group's
// communicator (so no message can match a collective's), completed by the same bounded wait: a peer that never
// sends makes the receiver name the recv, its peer and the silent ranks, and abort the job. Not chunked: Open MPI
// allocates no scratch for a send, and counts past int fail with an error. The duplicate returns errors instead of
// aborting, so that a message longer than its recv is reported with the recv's label; one shorter is caught from
// the received count.
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <thread>
#include <vector>

#include "core/error.h"
#include "comm/comm.h"
#include "comm/fault_injection.h"

namespace tuna {

namespace {

using Clock = std::chrono::steady_clock;

// What this process waits on, for note_signal_in_collective (a signal handler may only read it).
char g_waiting[320];
volatile sig_atomic_t g_is_waiting = 0;

constexpr int kAskTag = 7001, kAnswerTag = 7002;
constexpr int kAnswerBytes = 256;

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail("MPI call ", call, " failed: ", std::string(text, len));
}
#define TUNA_MPI(call) mpi_check((call), #call)

MPI_Datatype mpi_type(CommType t) {
  switch (t) {
    case CommType::F32: return MPI_FLOAT;
    case CommType::F64: return MPI_DOUBLE;
    case CommType::I64: return MPI_INT64_T;
    case CommType::BF16: return MPI_UINT16_T;  // moved as bits: gathers only (see all_reduce)
  }
  return MPI_DATATYPE_NULL;
}


int as_count(int64_t n) {
  TUNA_CHECK(n >= 0 && n <= INT32_MAX, "MPI counts are int: ", n, " elements in one piece");
  return static_cast<int>(n);
}

// State of the process shared by the world comm and every comm split from it.
struct MpiProcess {
  MPI_Comm census = MPI_COMM_NULL;
  int world_rank = 0, world_size = 1;
  double timeout_s = 0;
  bool owns_init = false;
  int64_t sequence = 0;    // collectives waited on so far, on any comm of this process
  std::string current;     // label of the collective being waited on, for census answers

  ~MpiProcess() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (census != MPI_COMM_NULL) MPI_Comm_free(&census);
    if (owns_init) MPI_Finalize();
  }

  // Answers pending census questions: what this rank waits on.
  void serve() {
    for (;;) {
      int flag = 0;
      MPI_Status st;
      MPI_Iprobe(MPI_ANY_SOURCE, kAskTag, census, &flag, &st);
      if (!flag) return;
      int64_t asker_seq = 0;
      MPI_Recv(&asker_seq, 1, MPI_INT64_T, st.MPI_SOURCE, kAskTag, census, MPI_STATUS_IGNORE);
      char answer[kAnswerBytes] = {};
      std::snprintf(answer, sizeof answer, "%s (collective #%lld)", current.c_str(), (long long)sequence);
      MPI_Send(answer, kAnswerBytes, MPI_CHAR, st.MPI_SOURCE, kAnswerTag, census);  // small: sent eagerly
    }
  }

  [[noreturn]] void timed_out(const std::string& label, double waited_s) {
    for (int r = 0; r < world_size; r++)
      if (r != world_rank) MPI_Send(&sequence, 1, MPI_INT64_T, r, kAskTag, census);
    std::map<int, std::string> answers;
    const auto deadline = Clock::now() + std::chrono::duration<double>(std::min(5.0, std::max(1.0, timeout_s / 2)));
    while (Clock::now() < deadline && static_cast<int>(answers.size()) < world_size - 1) {
      serve();
      int flag = 0;
      MPI_Status st;
      MPI_Iprobe(MPI_ANY_SOURCE, kAnswerTag, census, &flag, &st);
      if (!flag) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      char answer[kAnswerBytes];
      MPI_Recv(answer, kAnswerBytes, MPI_CHAR, st.MPI_SOURCE, kAnswerTag, census, MPI_STATUS_IGNORE);
      answer[kAnswerBytes - 1] = 0;
      answers[st.MPI_SOURCE] = answer;
    }
    std::string silent, waiting;
    for (int r = 0; r < world_size; r++) {
      if (r == world_rank) continue;
      auto it = answers.find(r);
      if (it == answers.end()) silent += str(silent.empty() ? "" : ", ", r);
      else waiting += str("; rank ", r, " waits in ", it->second);
    }
    std::fprintf(stderr,
                 "error: rank %d: %s (collective #%lld) did not complete within %.0f s (--comm_timeout): %s%s. "
                 "Aborting the job.\n",
                 world_rank, label.c_str(), (long long)sequence, waited_s,
                 silent.empty() ? "every rank answered, so a collective was called in a different order"
                                : str("rank(s) ", silent, " did not answer (died, hung, or stuck outside any collective)").c_str(),
                 waiting.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }

  // status: where a recv's status goes (nullptr: ignored).
  void wait(MPI_Request* req, const std::string& label, MPI_Status* status = nullptr) {
    sequence++;
    current = label;
    std::snprintf(g_waiting, sizeof g_waiting, "rank %d: signal while waiting in %s (collective #%lld)\n", world_rank,
                  label.c_str(), (long long)sequence);
    g_is_waiting = 1;
    const auto start = Clock::now();
    auto nap = std::chrono::microseconds(20);
    int64_t polls = 0;
    for (;;) {
      int done = 0;
      const int rc = MPI_Test(req, &done, status ? status : MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        g_is_waiting = 0;
        current = "compute";
        char text[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, text, &len);
        fail("rank ", world_rank, ": ", label, " failed: ", std::string(text, len));
      }
      if (done) break;
      if (++polls % 1024 == 0) serve();  // census questions are rare: do not probe for them every poll
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (timeout_s > 0 && waited > timeout_s) timed_out(label, waited);
      // Open MPI progresses a non-blocking collective only inside MPI calls, one round per call: keep
      // calling for the first second (a large all-reduce is many rounds), then nap between polls.
      if (waited < 1.0) {
        if (polls % 64 == 0) sched_yield();
      } else {
        serve();
        std::this_thread::sleep_for(nap);
        nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::microseconds(1000));
      }
    }
    g_is_waiting = 0;
    current = "compute";
  }
};

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, bool owns_comm, std::shared_ptr<MpiProcess> process)
      : Comm(comm_rank(comm), comm_size(comm)), comm_(comm), owns_comm_(owns_comm), process_(std::move(process)) {
    TUNA_MPI(MPI_Comm_dup(comm_, &p2p_));  // collective over the group, as construction is (world, split)
    MPI_Comm_set_errhandler(p2p_, MPI_ERRORS_RETURN);
    // World ranks of this group's ranks, for the labels of send/recv.
    MPI_Group group, world;
    MPI_Comm_group(comm_, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> ranks(size());
    for (int r = 0; r < size(); r++) ranks[r] = r;
    world_ranks_.resize(size());
    MPI_Group_translate_ranks(group, size(), ranks.data(), world, world_ranks_.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world);
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Comm_free(&p2p_);
    if (owns_comm_) MPI_Comm_free(&comm_);
  }
  std::string backend() const override { return "mpi"; }

  void all_reduce(void* buf, int64_t n, CommType type, ReduceOp op, const char* what) override {
    // MPI has no bfloat16 arithmetic; device comms that stage through MPI widen bf16 to fp32 first.
    TUNA_CHECK(type != CommType::BF16, "MpiComm does not reduce bf16 ('", what, "'): reduce fp32");
    const std::string label = str("all_reduce '", what, "' (", n, " elements)");
    const int64_t bytes = comm_type_bytes(type);
    const int64_t chunk = kMpiChunkBytes / bytes;  // elements reduce independently: chunks are exact
    for (int64_t at = 0; at < n; at += chunk) {
      MPI_Request req;
      TUNA_MPI(MPI_Iallreduce(MPI_IN_PLACE, static_cast<char*>(buf) + at * bytes, as_count(std::min(chunk, n - at)),
                              mpi_type(type), op == ReduceOp::Sum ? MPI_SUM : MPI_MAX, comm_, &req));
      process_->wait(&req, label);
    }
  }

  void reduce_scatter(const void* send_bytes, void* recv_bytes, int64_t n, CommType type, const char* what) override {
    check_reduce_scatter_type(type, what);
    // As all_reduce: no bfloat16 arithmetic in MPI; the staged device comm widens bf16 to fp32 before it gets here.
    TUNA_CHECK(type != CommType::BF16, "MpiComm does not reduce bf16 ('", what, "'): reduce-scatter fp32");
    const float* send = static_cast<const float*>(send_bytes);
    float* recv = static_cast<float*>(recv_bytes);
    // MPI takes per-rank counts, so uneven pieces need no padding here.
    const std::string label = str("reduce_scatter '", what, "' (", n, " floats)");
    std::vector<Range> pieces(size());
    std::vector<int> counts(size());
    for (int r = 0; r < size(); r++) pieces[r] = shard_range(n, r, size()), counts[r] = as_count(pieces[r].size());
    const int64_t per_rank = std::max<int64_t>(1, kMpiChunkBytes / int64_t(sizeof(float)) / size());
    int64_t largest = 0;
    for (const Range& p : pieces) largest = std::max(largest, p.size());
    if (largest <= per_rank) {  // small enough for one call
      MPI_Request req;
      TUNA_MPI(MPI_Ireduce_scatter(send, recv, counts.data(), MPI_FLOAT, MPI_SUM, comm_, &req));
      process_->wait(&req, label);
      return;
    }
    // Chunk j: elements [j * per_rank, (j + 1) * per_rank) of every rank's piece, staged contiguously.
    std::vector<float> staging(per_rank * size());  // freed on return: a transient of the memory plan
    for (int64_t at = 0; at < largest; at += per_rank) {
      int64_t staged = 0;
      for (int r = 0; r < size(); r++) {
        const int64_t m = std::clamp<int64_t>(pieces[r].size() - at, 0, per_rank);
        std::copy_n(send + pieces[r].begin + at, m, staging.data() + staged);
        counts[r] = as_count(m);
        staged += m;
      }
      MPI_Request req;
      TUNA_MPI(MPI_Ireduce_scatter(staging.data(), recv + at, counts.data(), MPI_FLOAT, MPI_SUM, comm_, &req));
      process_->wait(&req, label);
    }
  }

  void all_gather(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    wait(all_gather_start(send, recv, n, type, what));
  }

  CommRequest all_gather_start(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    Pending& p = pending_[++next_request_];
    p.label = str("all_gather '", what, "' (", n, " elements)");
    p.counts.resize(size());
    p.displs.resize(size());
    for (int r = 0; r < size(); r++) {
      const Range piece = shard_range(n, r, size());
      p.counts[r] = as_count(piece.size());
      p.displs[r] = as_count(piece.begin);
    }
    const bool in_place = send == static_cast<const char*>(recv) + p.displs[rank()] * comm_type_bytes(type);
    TUNA_MPI(MPI_Iallgatherv(in_place ? MPI_IN_PLACE : send, p.counts[rank()], mpi_type(type), recv, p.counts.data(),
                             p.displs.data(), mpi_type(type), comm_, &p.request));
    return next_request_;
  }

  void wait(CommRequest request) override {
    auto it = pending_.find(request);
    TUNA_CHECK(it != pending_.end(), "unknown or already completed request ", request);
    Pending& p = it->second;
    MPI_Status status;
    process_->wait(&p.request, p.label, p.is_recv ? &status : nullptr);
    if (p.is_recv) {
      int count = 0;
      MPI_Get_count(&status, mpi_type(p.type), &count);
      if (count != p.n)
        fail("rank ", process_->world_rank, ": ", p.label, ": the peer sent ", count, " elements, this recv expects ",
             p.n);
    }
    pending_.erase(it);
  }

  CommRequest send_start(const void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "send", what);
    inject_p2p_fault_for_tests(process_->world_rank);
    Pending& p = pending_[++next_request_];
    p.label = str("send '", what, "' (", n, " elements to ", peer_name(peer), ")");
    // An error (a dead peer's connection) returns here instead of aborting: report it with the label.
    const int rc = MPI_Isend(buf, as_count(n), mpi_type(type), peer, 0, p2p_, &p.request);
    if (rc != MPI_SUCCESS) fail("rank ", process_->world_rank, ": ", p.label, ": MPI_Isend failed (code ", rc, ")");
    return next_request_;
  }

  CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "recv", what);
    inject_p2p_fault_for_tests(process_->world_rank);
    Pending& p = pending_[++next_request_];
    p.label = str("recv '", what, "' (", n, " elements from ", peer_name(peer), ")");
    p.is_recv = true, p.n = n, p.type = type;
    const int rc = MPI_Irecv(buf, as_count(n), mpi_type(type), peer, 0, p2p_, &p.request);
    if (rc != MPI_SUCCESS) fail("rank ", process_->world_rank, ": ", p.label, ": MPI_Irecv failed (code ", rc, ")");
    return next_request_;
  }

  void broadcast(void* buf, int64_t bytes, int root, const char* what) override {
    MPI_Request req;
    TUNA_MPI(MPI_Ibcast(buf, as_count(bytes), MPI_BYTE, root, comm_, &req));
    process_->wait(&req, str("broadcast '", what, "' (", bytes, " bytes from rank ", root, ")"));
  }

  void barrier(const char* what) override {
    MPI_Request req;
    TUNA_MPI(MPI_Ibarrier(comm_, &req));
    process_->wait(&req, str("barrier '", what, "'"));
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    MPI_Comm sub;
    TUNA_MPI(MPI_Comm_split(comm_, color, key, &sub));
    return std::make_unique<MpiComm>(sub, /*owns_comm=*/true, process_);
  }

 private:
  static int comm_rank(MPI_Comm c) {
    int r = 0;
    MPI_Comm_rank(c, &r);
    return r;
  }
  static int comm_size(MPI_Comm c) {
    int s = 0;
    MPI_Comm_size(c, &s);
    return s;
  }
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<int> counts, displs;  // must outlive the non-blocking call
    std::string label;
    bool is_recv = false;  // a recv checks the count it received
    int64_t n = 0;
    CommType type = CommType::F32;
  };

  // "rank P" of this group, with its world rank where they differ.
  std::string peer_name(int peer) const {
    return world_ranks_[peer] == peer ? str("rank ", peer) : str("rank ", peer, " (world rank ", world_ranks_[peer], ")");
  }

  MPI_Comm comm_;
  MPI_Comm p2p_ = MPI_COMM_NULL;
  std::vector<int> world_ranks_;
  bool owns_comm_;
  std::shared_ptr<MpiProcess> process_;
  std::map<CommRequest, Pending> pending_;
  CommRequest next_request_ = 0;
};

std::unique_ptr<Comm> world_comm(double timeout_s, bool owns_init) {
  auto process = std::make_shared<MpiProcess>();
  process->timeout_s = timeout_s;
  process->owns_init = owns_init;
  MPI_Comm_rank(MPI_COMM_WORLD, &process->world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &process->world_size);
  TUNA_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &process->census));
  // Census messages to a dead peer must fail locally, not abort the job before the error is printed.
  MPI_Comm_set_errhandler(process->census, MPI_ERRORS_RETURN);
  return std::make_unique<MpiComm>(MPI_COMM_WORLD, /*owns_comm=*/false, std::move(process));
}

}  // namespace

std::unique_ptr<Comm> make_mpi_world_comm(double timeout_s) { return world_comm(timeout_s, /*owns_init=*/false); }

std::unique_ptr<Comm> make_world_comm(double timeout_s) {
  const LaunchInfo launch = detect_launch();
  if (launch.size == 1) return make_single_comm();
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) TUNA_MPI(MPI_Init(nullptr, nullptr));
  std::unique_ptr<Comm> world = world_comm(timeout_s, /*owns_init=*/!initialized);
  if (world->size() != launch.size)
    fail("the launcher (", launch.launcher, ") says ", launch.size, " ranks but MPI sees ", world->size(),
         ": was build/train started by a different MPI's mpirun, or srun without --mpi=pmix?");
  return world;
}

void note_signal_in_collective(int) {
  if (!g_is_waiting) return;
  const ssize_t ignored = ::write(2, g_waiting, std::strlen(g_waiting));
  (void)ignored;
}

void abort_job(int exit_code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  int size = 1;
  if (initialized && !finalized) MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::exit(exit_code);
}

}  // namespace tuna
