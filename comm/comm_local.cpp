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
// Point to point: a send copies its buffer into the receiver's mailbox and returns (nothing to wait for, so
// exchanges in both directions cannot deadlock); a recv waits, bounded by the timeout, for the message with its
// sequence number from that peer, which keeps the order of sends whatever order the requests are waited in.
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
  // Point to point: messages from rank `from` to rank `to` by the sender's sequence number.
  struct Message {
    std::vector<char> bytes;
    int64_t n = 0;
    CommType type = CommType::F32;
    std::string label;
  };
  struct Mailbox {
    int64_t sent = 0;  // messages put in so far
    std::map<int64_t, Message> messages;
  };
  std::map<std::pair<int, int>, Mailbox> mailboxes;  // (from, to)

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
    LocalGroup::Message m;
    m.bytes.assign(static_cast<const char*>(buf), static_cast<const char*>(buf) + n * comm_type_bytes(type));
    m.n = n, m.type = type, m.label = str("send '", what, "'");
    {
      std::lock_guard<std::mutex> lock(group_->mutex);
      LocalGroup::Mailbox& box = group_->mailboxes[{rank(), peer}];
      box.messages.emplace(box.sent++, std::move(m));
    }
    group_->changed.notify_all();
    return 0;  // complete: the message is copied
  }

  CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) override {
    check_peer(peer, n, "recv", what);
    Recv& r = recvs_[++next_request_];
    r.buf = buf, r.n = n, r.type = type, r.peer = peer, r.sequence = received_[peer]++;
    r.label = str("recv '", what, "' (", n, " elements from rank ", peer, ")");
    return next_request_;
  }

  void wait(CommRequest request) override {
    auto it = recvs_.find(request);
    if (it == recvs_.end()) return;  // a collective's or a send's: complete when started
    const Recv r = std::move(it->second);
    recvs_.erase(it);
    LocalGroup& g = *group_;
    std::unique_lock<std::mutex> lock(g.mutex);
    LocalGroup::Mailbox& box = g.mailboxes[{r.peer, rank()}];
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(g.timeout_s);
    while (!box.messages.count(r.sequence)) {
      if (g.timeout_s <= 0) {
        g.changed.wait(lock);
      } else if (g.changed.wait_until(lock, deadline) == std::cv_status::timeout && !box.messages.count(r.sequence)) {
        fail("rank ", rank(), " of ", size(), " (threads): ", r.label, " did not complete within ", g.timeout_s,
             " s (--comm_timeout): rank ", r.peer, " did not send it (died, hung, or waits elsewhere)");
      }
    }
    auto m = box.messages.find(r.sequence);
    LocalGroup::Message message = std::move(m->second);
    box.messages.erase(m);
    lock.unlock();
    if (message.n != r.n || message.type != r.type)
      fail("rank ", rank(), " of ", size(), " (threads): ", r.label, ": rank ", r.peer, " sent ", message.n,
           " elements of ", comm_type_bytes(message.type), " bytes (", message.label, "), this recv expects ", r.n,
           " of ", comm_type_bytes(r.type));
    if (!message.bytes.empty()) std::memcpy(r.buf, message.bytes.data(), message.bytes.size());
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

  struct Recv {
    void* buf = nullptr;
    int64_t n = 0;
    CommType type = CommType::F32;
    int peer = 0;
    int64_t sequence = 0;  // of the peer's sends to this rank
    std::string label;
  };

  std::shared_ptr<LocalGroup> group_;
  std::map<CommRequest, Recv> recvs_;    // started, not yet waited
  std::map<int, int64_t> received_;      // recvs started per peer
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
