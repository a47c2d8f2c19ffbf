// LocalComm: ranks as threads of one process, collectives on host memory. What lets several ranks of the CUDA
// engine share one GPU in a test (NCCL refuses two ranks on one device, and the GPU machine has no MPI): each
// thread is a rank, with a LocalComm world (and its dp / tp splits) as host comm and a staged device comm over
// it (comm/comm_staged.cpp).
//
// Every collective is two rendezvous of the group: at the first every rank has posted its buffers; between the
// two each rank reads the others' buffers and writes only its own output (or a private temporary, for in-place
// reductions); after the second every read is done, so buffers may change again. Sums run over ranks in rank
// order, so every rank gets the same bits. Each wait is bounded by the timeout: a rank that died or hangs
// makes the others fail with an error naming the collective and the ranks that did not arrive.
//
// Point to point, as NCCL's: the n-th send from one rank to another pairs with the n-th recv posted there, whatever
// order the requests are waited in, and neither completes before both are posted: a send completes only once its
// recv is posted (a rendezvous, as NCCL's send and MPI's above its eager limit), so an order of sends and receives
// that would deadlock on NCCL deadlocks here too (and fails at the timeout, naming the send) instead of passing on
// buffered sends. The starts never block: whichever side posts second copies the bytes from the send's buffer into
// the recv's (the sender keeps its buffer unchanged until wait(), as the interface asks), so exchanges in both
// directions, both started before either is waited, cannot deadlock. Each wait is bounded by the timeout.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "comm/comm.h"

namespace tuna {

namespace {

struct LocalGroup {
  explicit LocalGroup(int n, double timeout) : size(n), timeout_s(timeout), send(n), recv(n), labels(n), split_keys(n), children(n) {}
  const int size;
  const double timeout_s;
  std::mutex mutex;
  std::condition_variable changed;
  int64_t generation = 0;  // rendezvous completed so far
  int arrived = 0;
  std::vector<bool> present = std::vector<bool>(size, false);  // arrived at the current rendezvous
  // Posted by each rank before the first rendezvous of a collective.
  std::vector<const void*> send;
  std::vector<void*> recv;
  std::vector<std::string> labels;
  std::vector<std::pair<int, int>> split_keys;  // (color, key)
  struct Child {
    std::shared_ptr<LocalGroup> group;
    int rank = 0;
  };
  std::vector<Child> children;
  // Point to point: one message, its two sides posted by the sender and the receiver.
  struct Transfer {
    const void* send_buf = nullptr;
    void* recv_buf = nullptr;
    int64_t send_n = 0, recv_n = 0;
    CommType send_type = CommType::F32, recv_type = CommType::F32;
    std::string send_label;
    bool sent = false, received = false;  // posted
    bool done = false;                    // both posted, and the bytes copied (unless the counts differ)
  };
  // Between a rank `from` and a rank `to`: sends and recvs posted so far, and the transfers not yet paired.
  struct Channel {
    int64_t sends = 0, recvs = 0;
    std::map<int64_t, std::shared_ptr<Transfer>> open;  // by sequence number
  };
  std::map<std::pair<int, int>, Channel> channels;  // (from, to)

  // The transfer with sequence number `sequence` on (from, to); the caller holds the mutex.
  std::shared_ptr<Transfer> transfer(int from, int to, int64_t sequence) {
    std::shared_ptr<Transfer>& t = channels[{from, to}].open[sequence];
    if (!t) t = std::make_shared<Transfer>();
    return t;
  }
  // Both sides are posted: copies the message (when the counts agree; the recv reports them otherwise) and wakes
  // the waiters. The caller holds the mutex.
  void pair(int from, int to, int64_t sequence, Transfer& t) {
    if (t.send_n == t.recv_n && t.send_type == t.recv_type && t.send_n > 0)
      std::memcpy(t.recv_buf, t.send_buf, t.send_n * comm_type_bytes(t.send_type));
    t.done = true;
    channels[{from, to}].open.erase(sequence);
    changed.notify_all();
  }

  // Blocks until every rank arrived; `what` names the collective in a timeout's error.
  void rendezvous(int rank, const std::string& what) {
    std::unique_lock<std::mutex> lock(mutex);
    const int64_t mine = generation;
    present[rank] = true;
    if (++arrived == size) {
      arrived = 0;
      std::fill(present.begin(), present.end(), false);
      generation++;
      changed.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (generation == mine) {
      if (timeout_s <= 0) {
        changed.wait(lock);
      } else if (changed.wait_until(lock, deadline) == std::cv_status::timeout && generation == mine) {
        std::string missing;
        for (int r = 0; r < size; r++)
          if (!present[r]) missing += str(missing.empty() ? "" : ", ", r);
        fail("rank ", rank, " of ", size, " (threads): ", what, " did not complete within ", timeout_s,
             " s (--comm_timeout): rank(s) ", missing, " did not arrive (died, hung, or called another collective)");
      }
    }
  }
};

template <typename T>
void sum_into(T* acc, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) acc[i] += x[i];
}

template <typename T>
void max_into(T* acc, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) acc[i] = std::max(acc[i], x[i]);
}

class LocalComm final : public Comm {
 public:
  LocalComm(std::shared_ptr<LocalGroup> group, int rank) : Comm(rank, group->size), group_(std::move(group)) {}
  std::string backend() const override { return "threads"; }

  void all_reduce(void* buf, int64_t n, CommType type, ReduceOp op, const char* what) override {
    const std::string label = str("all_reduce '", what, "' (", n, " elements)");
    post(buf, buf, label);
    // Into a private temporary in rank order, so every rank computes the same bits; written back after the
    // second rendezvous, when no rank reads buf any more.
    std::vector<char> result;
    switch (type) {
      case CommType::F32: result = reduce<float>(n, op); break;
      case CommType::F64: result = reduce<double>(n, op); break;
      case CommType::I64: result = reduce<int64_t>(n, op); break;
      case CommType::BF16: {  // in fp32, rounded once
        std::vector<float> acc(n), x(n);
        convert_to_f32(group_->send[0], DType::BF16, acc.data(), n);
        for (int r = 1; r < size(); r++) {
          convert_to_f32(group_->send[r], DType::BF16, x.data(), n);
          op == ReduceOp::Sum ? sum_into(acc.data(), x.data(), n) : max_into(acc.data(), x.data(), n);
        }
        result.resize(n * 2);
        convert_from_f32(acc.data(), DType::BF16, result.data(), n);
        break;
      }
    }
    group_->rendezvous(rank(), label);
    std::memcpy(buf, result.data(), result.size());
  }

  void reduce_scatter(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    check_reduce_scatter_type(type, what);
    const std::string label = str("reduce_scatter '", what, "' (", n, " elements)");
    post(send, recv, label);
    const Range mine = shard_range(n, rank(), size());
    // This rank's piece summed in fp32 in rank order (bf16 widened, rounded once below), so every rank's bits
    // are those of any other comm's sum in the same order.
    const auto piece_of = [&](int r, float* out) {
      const char* from = static_cast<const char*>(group_->send[r]) + mine.begin * comm_type_bytes(type);
      if (type == CommType::BF16) convert_to_f32(from, DType::BF16, out, mine.size());
      else std::memcpy(out, from, mine.size() * sizeof(float));
    };
    std::vector<float> acc(mine.size()), x(mine.size());
    piece_of(0, acc.data());
    for (int r = 1; r < size(); r++) piece_of(r, x.data()), sum_into(acc.data(), x.data(), mine.size());
    group_->rendezvous(rank(), label);  // recv may alias this rank's send, which others read until here
    if (type == CommType::BF16) convert_from_f32(acc.data(), DType::BF16, recv, mine.size());
    else std::memcpy(recv, acc.data(), mine.size() * sizeof(float));
  }

  void all_gather(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    const std::string label = str("all_gather '", what, "' (", n, " elements)");
    post(send, recv, label);
    const int64_t bytes = comm_type_bytes(type);
    for (int r = 0; r < size(); r++) {
      const Range piece = shard_range(n, r, size());
      char* dst = static_cast<char*>(recv) + piece.begin * bytes;
      if (group_->send[r] != dst) std::memcpy(dst, group_->send[r], piece.size() * bytes);
    }
    group_->rendezvous(rank(), label);
  }

  CommRequest all_gather_start(const void* send, void* recv, int64_t n, CommType type, const char* what) override {
    all_gather(send, recv, n, type, what);  // completes here: nothing to overlap on host threads
    return 0;
  }

  void broadcast(void* buf, int64_t bytes, int root, const char* what) override {
    const std::string label = str("broadcast '", what, "' (", bytes, " bytes from rank ", root, ")");
    post(buf, buf, label);
    if (rank() != root) std::memcpy(buf, group_->send[root], bytes);
    group_->rendezvous(rank(), label);
  }

  void barrier(const char* what) override { group_->rendezvous(rank(), str("barrier '", what, "'")); }

  CommRequest send_start(const void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "send", what);
    P2p& p = p2p_[++next_request_];
    p.peer = peer, p.is_recv = false, p.label = str("send '", what, "' (", n, " elements to rank ", peer, ")");
    LocalGroup& g = *group_;
    std::lock_guard<std::mutex> lock(g.mutex);
    const int64_t sequence = g.channels[{rank(), peer}].sends++;
    p.transfer = g.transfer(rank(), peer, sequence);
    LocalGroup::Transfer& t = *p.transfer;
    t.send_buf = buf, t.send_n = n, t.send_type = type, t.send_label = str("send '", what, "'"), t.sent = true;
    if (t.received) g.pair(rank(), peer, sequence, t);
    return next_request_;
  }

  CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "recv", what);
    P2p& p = p2p_[++next_request_];
    p.peer = peer, p.is_recv = true, p.label = str("recv '", what, "' (", n, " elements from rank ", peer, ")");
    LocalGroup& g = *group_;
    std::lock_guard<std::mutex> lock(g.mutex);
    const int64_t sequence = g.channels[{peer, rank()}].recvs++;
    p.transfer = g.transfer(peer, rank(), sequence);
    LocalGroup::Transfer& t = *p.transfer;
    t.recv_buf = buf, t.recv_n = n, t.recv_type = type, t.received = true;
    if (t.sent) g.pair(peer, rank(), sequence, t);
    return next_request_;
  }

  void wait(CommRequest request) override {
    auto it = p2p_.find(request);
    if (it == p2p_.end()) return;  // a collective's: complete when started
    const P2p p = std::move(it->second);
    p2p_.erase(it);
    LocalGroup& g = *group_;
    const LocalGroup::Transfer& t = *p.transfer;
    std::unique_lock<std::mutex> lock(g.mutex);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(g.timeout_s);
    while (!t.done) {
      if (g.timeout_s <= 0) {
        g.changed.wait(lock);
      } else if (g.changed.wait_until(lock, deadline) == std::cv_status::timeout && !t.done) {
        fail("rank ", rank(), " of ", size(), " (threads): ", p.label, " did not complete within ", g.timeout_s,
             " s (--comm_timeout): rank ", p.peer,
             p.is_recv ? " did not send it" : " did not post the matching recv", " (died, hung, or waits elsewhere)");
      }
    }
    if (p.is_recv && (t.send_n != t.recv_n || t.send_type != t.recv_type))
      fail("rank ", rank(), " of ", size(), " (threads): ", p.label, ": rank ", p.peer, " sent ", t.send_n,
           " elements of ", comm_type_bytes(t.send_type), " bytes (", t.send_label, "), this recv expects ", t.recv_n,
           " of ", comm_type_bytes(t.recv_type));
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    const std::string label = str("split (color ", color, ", key ", key, ")");
    {
      std::lock_guard<std::mutex> lock(group_->mutex);
      group_->split_keys[rank()] = {color, key};
    }
    group_->rendezvous(rank(), label);
    if (rank() == 0) {  // rank 0 forms every sub-group; the others read their slot after the next rendezvous
      std::map<int, std::vector<std::pair<int, int>>> members;  // color -> (key, parent rank)
      for (int r = 0; r < size(); r++) members[group_->split_keys[r].first].push_back({group_->split_keys[r].second, r});
      for (auto& [c, list] : members) {
        std::sort(list.begin(), list.end());
        auto child = std::make_shared<LocalGroup>(static_cast<int>(list.size()), group_->timeout_s);
        for (size_t i = 0; i < list.size(); i++) group_->children[list[i].second] = {child, static_cast<int>(i)};
      }
    }
    group_->rendezvous(rank(), label);
    LocalGroup::Child mine = group_->children[rank()];
    group_->rendezvous(rank(), label);  // every rank has its slot: rank 0 may overwrite them at the next split
    return std::make_unique<LocalComm>(mine.group, mine.rank);
  }

 private:
  void post(const void* send, void* recv, const std::string& label) {
    {
      std::lock_guard<std::mutex> lock(group_->mutex);
      group_->send[rank()] = send;
      group_->recv[rank()] = recv;
      group_->labels[rank()] = label;
    }
    group_->rendezvous(rank(), label);
  }

  template <typename T>
  std::vector<char> reduce(int64_t n, ReduceOp op) {
    std::vector<T> acc(static_cast<const T*>(group_->send[0]), static_cast<const T*>(group_->send[0]) + n);
    for (int r = 1; r < size(); r++) {
      const T* x = static_cast<const T*>(group_->send[r]);
      op == ReduceOp::Sum ? sum_into(acc.data(), x, n) : max_into(acc.data(), x, n);
    }
    std::vector<char> out(n * sizeof(T));
    std::memcpy(out.data(), acc.data(), out.size());
    return out;
  }

  struct P2p {
    std::shared_ptr<LocalGroup::Transfer> transfer;
    int peer = 0;
    bool is_recv = false;
    std::string label;
  };

  std::shared_ptr<LocalGroup> group_;
  std::map<CommRequest, P2p> p2p_;  // started, not yet waited
  CommRequest next_request_ = 0;
};

}  // namespace

std::vector<std::unique_ptr<Comm>> make_local_comms(int size, double timeout_s) {
  TUNA_CHECK(size >= 1, "a group of ", size, " ranks");
  auto group = std::make_shared<LocalGroup>(size, timeout_s);
  std::vector<std::unique_ptr<Comm>> comms;
  for (int r = 0; r < size; r++) comms.push_back(std::make_unique<LocalComm>(group, r));
  return comms;
}

}  // namespace tuna
