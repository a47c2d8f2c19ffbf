// The loopback device comm (comm/comm.h make_loopback_device_comm): ranks as threads of one process sharing one GPU,
// with point to point on the device, ordered by events as NCCL's is, where the staged comm (comm_staged.cpp) carries
// each message through the host. What lets one GPU, or the emulator with concurrent streams, run the pipeline's
// overlap (dist/pipeline.h with engine/engine_gpu.cpp's GpuStage: sends and receives on a stream of their own, the
// compute ordered against them by events) as a multi-GPU job runs it: NCCL refuses two ranks on one device.
//
// A message. Each side posts on its comm's stream, which the caller has ordered after the compute that wrote a
// send's buffer or last read a recv's, and records an event there. A host rendezvous pairs the n-th send from one
// rank to another with the n-th recv posted there; it only pairs: whichever side posts second queues, on its own comm
// stream, a wait for the other side's event, the device-to-device copy, and an event after it (`copied`). Neither
// start blocks. wait_on_stream(request, stream) makes `stream` wait for `copied`, the device-side completion that
// NCCL gives; wait() waits on the host for it. Both first wait on the host until the other side has posted (a
// request cannot be completed before its pair exists), bounded by --comm_timeout as every wait is: a peer that never
// posts fails this rank naming the call and the peer. The host waits only where the caller waits, and on a request
// posted before, so an order of calls that completes here completes on NCCL's in-order comm stream too.
//
// Collectives go through host staging (a staged device comm over a duplicate of the host group): they are not what
// this comm is for, and the staged comm already checks them.
//
// CUDA builds only; the emulated build compiles it against the emulator's runtime, where it runs the same way.
#if TUNA_CUDA

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "comm/comm.h"

namespace tuna {

namespace {

// One message: its two sides as posted, and the copy.
struct Transfer {
  ~Transfer() {
    for (cudaEvent_t e : {send_posted, recv_posted, copied})
      if (e) cudaEventDestroy(e);
  }
  const void* send_buf = nullptr;
  void* recv_buf = nullptr;
  int64_t send_n = 0, recv_n = 0;
  CommType send_type = CommType::F32, recv_type = CommType::F32;
  std::string send_label;
  cudaEvent_t send_posted = nullptr, recv_posted = nullptr;  // each side's comm stream at its post
  cudaEvent_t copied = nullptr;                               // after the copy, on the second side's stream
  bool paired = false;                                        // both posted, the copy queued
};

// The ranks' rendezvous, shared by the comms of one group.
struct LoopbackGroup {
  std::mutex mutex;
  std::condition_variable changed;
  struct Channel {
    int64_t sends = 0, recvs = 0;
    std::map<int64_t, std::shared_ptr<Transfer>> open;  // posted on one side only, by sequence number
  };
  std::map<std::pair<int, int>, Channel> channels;  // (from, to)
};

cudaEvent_t record_event(cudaStream_t stream) {
  cudaEvent_t e = nullptr;
  TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  TUNA_CUDA_CHECK(cudaEventRecord(e, stream));
  return e;
}

class LoopbackDeviceComm final : public Comm {
 public:
  LoopbackDeviceComm(std::unique_ptr<Comm> host, cudaStream_t stream, double timeout_s)
      : Comm(host->rank(), host->size()), host_(std::move(host)), stream_(stream), timeout_s_(timeout_s) {
    if (host_->backend() != "threads")
      fail("the loopback device comm is for ranks as threads of one process (a threads host comm), not over a ",
           host_->backend(), " comm: across processes use NCCL or the staged device comm");
    // Rank 0 makes the rendezvous; the others take a reference through its address (one address space).
    std::shared_ptr<LoopbackGroup>* shared = rank() == 0 ? new std::shared_ptr<LoopbackGroup>(new LoopbackGroup) : nullptr;
    host_->broadcast(&shared, sizeof shared, 0, "loopback rendezvous");
    group_ = *shared;
    host_->barrier("loopback rendezvous taken");
    if (rank() == 0) delete shared;
    staged_ = make_staged_device_comm(host_->split(0, rank()), stream_);
  }
  std::string backend() const override { return "loopback"; }

  void all_reduce(void* buf, int64_t n, CommType type, ReduceOp op, const char* what) override {
    staged_->all_reduce(buf, n, type, op, what);
  }
  void reduce_scatter(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    staged_->reduce_scatter(send, recv, n, type, what);
  }
  void all_gather(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    staged_->all_gather(send, recv, n, type, what);
  }
  CommRequest all_gather_start(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    staged_->all_gather(send, recv, n, type, what);  // complete on return, as the staged comm's
    return 0;
  }
  void broadcast(void* buf, int64_t bytes, int root, const char* what) override {
    staged_->broadcast(buf, bytes, root, what);
  }
  void barrier(const char* what) override { staged_->barrier(what); }
  std::unique_ptr<Comm> split(int color, int key) override {
    return std::make_unique<LoopbackDeviceComm>(host_->split(color, key), stream_, timeout_s_);
  }

  CommRequest send_start(const void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "send", what);
    P2p& p = p2p_[++next_request_];
    p.peer = peer, p.is_recv = false, p.label = str("send '", what, "' (", n, " elements to rank ", peer, ")");
    cudaEvent_t posted = record_event(stream_);
    std::lock_guard<std::mutex> lock(group_->mutex);
    LoopbackGroup::Channel& channel = group_->channels[{rank(), peer}];
    const int64_t sequence = channel.sends++;
    p.transfer = open_transfer(channel, sequence);
    Transfer& t = *p.transfer;
    t.send_buf = buf, t.send_n = n, t.send_type = type, t.send_label = str("send '", what, "'"), t.send_posted = posted;
    if (t.recv_posted) pair(channel, sequence, t, /*waits_for=*/t.recv_posted);
    return next_request_;
  }

  CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "recv", what);
    P2p& p = p2p_[++next_request_];
    p.peer = peer, p.is_recv = true, p.label = str("recv '", what, "' (", n, " elements from rank ", peer, ")");
    cudaEvent_t posted = record_event(stream_);
    std::lock_guard<std::mutex> lock(group_->mutex);
    LoopbackGroup::Channel& channel = group_->channels[{peer, rank()}];
    const int64_t sequence = channel.recvs++;
    p.transfer = open_transfer(channel, sequence);
    Transfer& t = *p.transfer;
    t.recv_buf = buf, t.recv_n = n, t.recv_type = type, t.recv_posted = posted;
    if (t.send_posted) pair(channel, sequence, t, /*waits_for=*/t.send_posted);
    return next_request_;
  }

  // The copy is queued once both sides posted; `stream`'s later work waits for it on the device.
  void wait_on_stream(CommRequest request, void* stream) override {
    auto it = p2p_.find(request);
    TUNA_CHECK(it != p2p_.end(), "unknown or already completed request ", request);
    wait_paired(it->second);
    TUNA_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), it->second.transfer->copied, 0));
  }

  void wait(CommRequest request) override {
    auto it = p2p_.find(request);
    if (it == p2p_.end()) return;  // a collective's: complete when started
    const P2p p = std::move(it->second);
    p2p_.erase(it);
    const auto start = std::chrono::steady_clock::now();
    wait_paired(p);
    const Transfer& t = *p.transfer;
    if (p.is_recv && (t.send_n != t.recv_n || t.send_type != t.recv_type))
      fail("rank ", rank(), " of ", size(), " (loopback): ", p.label, ": rank ", p.peer, " sent ", t.send_n,
           " elements of ", comm_type_bytes(t.send_type), " bytes (", t.send_label, "), this recv expects ", t.recv_n,
           " of ", comm_type_bytes(t.recv_type));
    for (;;) {  // the copy, on the device: bounded as the pairing was
      const cudaError_t rc = cudaEventQuery(t.copied);
      if (rc == cudaSuccess) return;
      if (rc != cudaErrorNotReady) TUNA_CUDA_CHECK(rc);
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (timeout_s_ > 0 && waited > timeout_s_)
        fail("rank ", rank(), " of ", size(), " (loopback): ", p.label, " did not complete within ", timeout_s_,
             " s (--comm_timeout): its copy on the device did not finish (a stream it waits for is stuck)");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  struct P2p {
    std::shared_ptr<Transfer> transfer;
    int peer = 0;
    bool is_recv = false;
    std::string label;
  };

  // The transfer with `sequence` on `channel`, made by whichever side posts first. The caller holds the mutex.
  static std::shared_ptr<Transfer> open_transfer(LoopbackGroup::Channel& channel, int64_t sequence) {
    std::shared_ptr<Transfer>& t = channel.open[sequence];
    if (!t) t = std::make_shared<Transfer>();
    return t;
  }

  // This side posted second: on this comm's stream, after the other side's post, the copy (when the counts agree;
  // the recv reports them otherwise) and the event that completes both requests. The caller holds the mutex.
  void pair(LoopbackGroup::Channel& channel, int64_t sequence, Transfer& t, cudaEvent_t waits_for) {
    TUNA_CUDA_CHECK(cudaStreamWaitEvent(stream_, waits_for, 0));
    if (t.send_n == t.recv_n && t.send_type == t.recv_type && t.send_n > 0)
      TUNA_CUDA_CHECK(cudaMemcpyAsync(t.recv_buf, t.send_buf, t.send_n * comm_type_bytes(t.send_type),
                                      cudaMemcpyDeviceToDevice, stream_));
    t.copied = record_event(stream_);
    t.paired = true;
    channel.open.erase(sequence);
    group_->changed.notify_all();
  }

  // Blocks until the request's other side is posted, at most --comm_timeout.
  void wait_paired(const P2p& p) {
    std::unique_lock<std::mutex> lock(group_->mutex);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    while (!p.transfer->paired) {
      if (timeout_s_ <= 0) {
        group_->changed.wait(lock);
      } else if (group_->changed.wait_until(lock, deadline) == std::cv_status::timeout && !p.transfer->paired) {
        fail("rank ", rank(), " of ", size(), " (loopback): ", p.label, " did not complete within ", timeout_s_,
             " s (--comm_timeout): rank ", p.peer, p.is_recv ? " did not send it" : " did not post the matching recv",
             " (died, hung, or waits elsewhere)");
      }
    }
  }

  std::unique_ptr<Comm> host_;
  cudaStream_t stream_;
  double timeout_s_;
  std::shared_ptr<LoopbackGroup> group_;
  std::unique_ptr<Comm> staged_;  // the collectives
  std::map<CommRequest, P2p> p2p_;  // started, not yet waited
  CommRequest next_request_ = 0;
};

}  // namespace

std::unique_ptr<Comm> make_loopback_device_comm(std::unique_ptr<Comm> host, void* stream, double timeout_s) {
  return std::make_unique<LoopbackDeviceComm>(std::move(host), static_cast<cudaStream_t>(stream), timeout_s);
}

}  // namespace tuna

#endif  // TUNA_CUDA
