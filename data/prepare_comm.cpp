// PrepareComm over dist/'s Comm (which owns MPI): variable-length byte gathers built from a length
// all-reduce and one broadcast per rank.
#include "data/prepare_comm.h"

#include <algorithm>

#include "comm/comm.h"  // Comm, make_world_comm, detect_launch, abort_job

namespace tuna {

namespace {

// Broadcasts move at most this many bytes at once (MPI counts are int).
constexpr int64_t kPieceBytes = int64_t{1} << 30;

class WorldPrepareComm : public PrepareComm {
 public:
  explicit WorldPrepareComm(std::unique_ptr<Comm> comm) : comm_(std::move(comm)) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }

  std::vector<char> all_gather(const void* data, size_t bytes, std::vector<uint64_t>* lengths) override {
    const size_t n = static_cast<size_t>(size());
    std::vector<int64_t> len(n, 0);
    len[static_cast<size_t>(rank())] = static_cast<int64_t>(bytes);
    comm_->all_reduce_sum(len.data(), static_cast<int64_t>(n), "prepare: gather lengths");
    std::vector<int64_t> offset(n + 1, 0);
    for (size_t r = 0; r < n; ++r) offset[r + 1] = offset[r] + len[r];
    std::vector<char> out(static_cast<size_t>(offset.back()));
    if (bytes) std::copy_n(static_cast<const char*>(data), bytes, out.data() + offset[static_cast<size_t>(rank())]);
    for (size_t r = 0; r < n; ++r)
      for (int64_t done = 0; done < len[r]; done += kPieceBytes)
        comm_->broadcast(out.data() + offset[r] + done, std::min(kPieceBytes, len[r] - done), static_cast<int>(r),
                         "prepare: gather");
    if (lengths) lengths->assign(len.begin(), len.end());
    return out;
  }

  void abort(int code) override { abort_job(code); }

 private:
  std::unique_ptr<Comm> comm_;
};

}  // namespace

std::unique_ptr<PrepareComm> world_prepare_comm_if_launched() {
  if (detect_launch().size <= 1) return nullptr;
  // No timeout: ranks legitimately wait for the slowest one at the dedup join (shares differ in content).
  return std::make_unique<WorldPrepareComm>(make_world_comm(/*timeout_s=*/0));
}

}  // namespace tuna
