// The 1F1B schedule of a pipeline stage, the transfer order of the overlap, and the driver's order against it.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dist/pipeline.h"

namespace tuna {
namespace {

// Every micro-batch's forward and backward once each, the forward first; the warm-up's pp - stage - 1 forwards, then
// alternation; never more than pp - stage micro-batches in flight, and i mod (pp - stage) free for micro-batch i.
TEST(Pipeline, OneForwardOneBackwardSchedule) {
  for (int64_t pp = 1; pp <= 5; pp++)
    for (int64_t stage = 0; stage < pp; stage++)
      for (int64_t m = 0; m <= 9; m++) {
        const std::vector<PipelineOp> ops = pipeline_schedule(pp, stage, m);
        ASSERT_EQ(static_cast<int64_t>(ops.size()), 2 * m);
        int64_t next_forward = 0, next_backward = 0;
        std::vector<int64_t> in_flight;
        const int64_t slots = pp - stage;
        for (size_t k = 0; k < ops.size(); k++) {
          const PipelineOp& op = ops[k];
          if (op.forward) {
            EXPECT_EQ(op.micro_batch, next_forward++);
            for (int64_t other : in_flight) EXPECT_NE(other % slots, op.micro_batch % slots);
            in_flight.push_back(op.micro_batch);
            EXPECT_LE(static_cast<int64_t>(in_flight.size()), slots);
          } else {
            EXPECT_EQ(op.micro_batch, next_backward++);
            ASSERT_FALSE(in_flight.empty());
            EXPECT_EQ(in_flight.front(), op.micro_batch);
            in_flight.erase(in_flight.begin());
          }
          // Warm-up: forwards only, as many as the stages after this one need to fill.
          if (static_cast<int64_t>(k) < std::min(pp - stage - 1, m)) {
            EXPECT_TRUE(op.forward);
          }
        }
        EXPECT_TRUE(in_flight.empty());
      }
  // Stage 0 of 4 over 6 micro-batches: F0 F1 F2 | F3 B0 F4 B1 F5 B2 | B3 B4 B5.
  std::string order;
  for (const PipelineOp& op : pipeline_schedule(4, 0, 6)) order += (op.forward ? "F" : "B") + std::to_string(op.micro_batch) + " ";
  EXPECT_EQ(order, "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
}

// The pipeline driver's transfer order with the CUDA engine's overlap (dist/pipeline.h) under NCCL's worst case: each send or receive
// runs alone, in the order started, on the stage's comm stream, and completes only together with its peer's matching
// one; each waits for the compute queued before it, and a pass for the transfers it reads or whose buffer it
// rewrites. A stage receives a forward's input at the forward, posts the next backward's gradient ahead of the
// forward where pipeline_gradient_ahead allows, else at the backward, and sends after each pass. Every stage must
// finish; posting ahead regardless must not (the model can see a deadlock).
namespace overlap {
struct Transfer {
  bool send;
  int peer;
  bool gradient;
  int64_t micro_batch;
  size_t passes_before;  // compute queued on the stage before this transfer starts
};
struct Stage {
  std::vector<Transfer> transfers;
  std::vector<std::vector<size_t>> pass_waits;  // per pass: the transfers it waits for
};

Stage stage_order(int64_t pp, int64_t s, int64_t m, bool ahead) {
  Stage st;
  const std::vector<PipelineOp> ops = pipeline_schedule(pp, s, m);
  const auto start = [&](bool send, int64_t peer, bool gradient, int64_t mb) {
    st.transfers.push_back({send, static_cast<int>(peer), gradient, mb, st.pass_waits.size()});
    return st.transfers.size() - 1;
  };
  std::vector<size_t> waits;
  int64_t activations_sent = -1, gradient_sent = -1, posted = -1;
  for (size_t i = 0; i < ops.size(); i++) {
    const PipelineOp& op = ops[i];
    if (op.forward) {
      if (s > 0) waits.push_back(start(false, s - 1, false, op.micro_batch));
      if (activations_sent >= 0) waits.push_back(activations_sent), activations_sent = -1;
      if (ahead && i + 1 < ops.size() && !ops[i + 1].forward)
        posted = static_cast<int64_t>(start(false, s + 1, true, ops[i + 1].micro_batch));
      st.pass_waits.push_back(waits), waits.clear();
      if (s < pp - 1) activations_sent = start(true, s + 1, false, op.micro_batch);
    } else {
      if (gradient_sent >= 0) waits.push_back(gradient_sent), gradient_sent = -1;
      if (s < pp - 1) waits.push_back(posted >= 0 ? posted : start(false, s + 1, true, op.micro_batch)), posted = -1;
      st.pass_waits.push_back(waits), waits.clear();
      if (s > 0) gradient_sent = start(true, s - 1, true, op.micro_batch);
    }
  }
  return st;
}

// Whether every stage runs to the end.
bool finishes(int64_t pp, int64_t m, bool force_ahead) {
  std::vector<Stage> stages;
  for (int64_t s = 0; s < pp; s++)
    stages.push_back(stage_order(pp, s, m, (force_ahead && s < pp - 1) || pipeline_gradient_ahead(pp, s, m)));
  std::vector<size_t> passes(pp, 0), transfers(pp, 0);  // how many of each are done
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < pp; s++) {
      const Stage& st = stages[s];
      while (passes[s] < st.pass_waits.size() &&
             std::all_of(st.pass_waits[passes[s]].begin(), st.pass_waits[passes[s]].end(),
                         [&](size_t t) { return t < transfers[s]; }))
        passes[s]++, progress = true;
    }
    for (int64_t s = 0; s < pp; s++) {
      if (transfers[s] == stages[s].transfers.size()) continue;
      const Transfer& a = stages[s].transfers[transfers[s]];
      if (passes[s] < a.passes_before || transfers[a.peer] == stages[a.peer].transfers.size()) continue;
      const Transfer& b = stages[a.peer].transfers[transfers[a.peer]];
      if (b.peer != s || b.send == a.send || b.gradient != a.gradient || b.micro_batch != a.micro_batch ||
          passes[a.peer] < b.passes_before)
        continue;
      transfers[s]++, transfers[a.peer]++, progress = true;
    }
  }
  for (int64_t s = 0; s < pp; s++)
    if (passes[s] < stages[s].pass_waits.size() || transfers[s] < stages[s].transfers.size()) return false;
  return true;
}
}  // namespace overlap

TEST(Pipeline, TransferOrderOfTheOverlapCannotDeadlock) {
  for (int64_t pp = 2; pp <= 8; pp++)
    for (int64_t m = 0; m <= 19; m++) EXPECT_TRUE(overlap::finishes(pp, m, false)) << "pp " << pp << ", " << m;
  // Posting ahead in a warm-up followed at once by the cool-down: the next stage needs the forward's output first.
  EXPECT_FALSE(overlap::finishes(2, 1, true));
  EXPECT_FALSE(overlap::finishes(4, 3, true));
  EXPECT_TRUE(pipeline_gradient_ahead(4, 0, 4));
  EXPECT_FALSE(pipeline_gradient_ahead(4, 0, 3));
  EXPECT_FALSE(pipeline_gradient_ahead(4, 3, 9));  // the last stage receives no gradient
}

// The driver itself starts its transfers in the order the model above checks: a stage that computes on a queue of its
// own (it posts the gradient ahead, and its compute waits for requests instead of the host), run through
// PipelineDriver::step over a comm that records each send and receive, gives the model's transfers and, per pass, the
// transfers that pass waits for.
namespace recording {
// Micro-batch i is announced by its element count: 1000 + i.
constexpr int64_t kCountBase = 1000;

class RecordingComm final : public Comm {
 public:
  RecordingComm(int rank, int size, overlap::Stage& record, const size_t& passes)
      : Comm(rank, size), record_(record), passes_(passes) {}
  std::string backend() const override { return "recording"; }
  void all_reduce(void*, int64_t, CommType, ReduceOp, const char*) override { unused(); }
  void reduce_scatter(const void*, void*, int64_t, CommType, const char*) override { unused(); }
  void all_gather(const void*, void*, int64_t, CommType, const char*) override { unused(); }
  CommRequest all_gather_start(const void*, void*, int64_t, CommType, const char*) override { return unused(), 0; }
  void wait(CommRequest request) override {
    EXPECT_TRUE(request > 0 && request <= static_cast<CommRequest>(record_.transfers.size())) << request;
    EXPECT_TRUE(waited_.insert(request).second) << "request " << request << " waited for twice";
  }
  void broadcast(void*, int64_t, int, const char*) override { unused(); }
  CommRequest send_start(const void*, int64_t n, CommType, int peer, const char* what) override {
    return start(true, n, peer, what);
  }
  CommRequest recv_start(void*, int64_t n, CommType, int peer, const char* what) override {
    return start(false, n, peer, what);
  }
  void barrier(const char*) override { unused(); }
  std::unique_ptr<Comm> split(int, int) override { return unused(), nullptr; }
  size_t waited() const { return waited_.size(); }

 private:
  static void unused() { ADD_FAILURE() << "the pipeline driver moves activations point to point only"; }
  CommRequest start(bool send, int64_t n, int peer, const char* what) {
    const bool gradient = std::string(what).find("gradient") != std::string::npos;
    record_.transfers.push_back({send, peer, gradient, n - kCountBase, passes_});
    return static_cast<CommRequest>(record_.transfers.size());
  }
  overlap::Stage& record_;
  const size_t& passes_;
  std::set<CommRequest> waited_;
};

class RecordingStage final : public PipelineStageModel {
 public:
  RecordingStage(int64_t in_flight, overlap::Stage& record, size_t& passes)
      : in_flight_(in_flight), record_(record), passes_(passes) {}
  int64_t in_flight() const override { return in_flight_; }
  int64_t boundary_elements(const MicroBatch& b) const override { return kCountBase + b.batch; }
  void* input(int64_t) override { return buffer_; }
  const void* output() const override { return buffer_; }
  void* output_grad() override { return buffer_; }
  const void* input_grad() const override { return buffer_; }
  LossSum forward(int64_t, const MicroBatch&, bool) override { return pass(), LossSum{}; }
  void backward(int64_t, const MicroBatch&) override { pass(); }
  float* gradients() override { return nullptr; }
  float* tied_peer_gradient() override { return nullptr; }
  void add_tied_peer_gradient(float*, const float*, int64_t) override { ADD_FAILURE() << "no tied table here"; }
  CommType wire_type() const override { return CommType::BF16; }
  CommRequest compute_waits_for(Comm&, CommRequest request) override {
    waits_.push_back(static_cast<size_t>(request - 1));
    return request;
  }
  bool receives_gradient_ahead() const override { return true; }

 private:
  void pass() {
    record_.pass_waits.push_back(waits_), waits_.clear();
    passes_++;
  }
  int64_t in_flight_;
  overlap::Stage& record_;
  size_t& passes_;
  std::vector<size_t> waits_;
  float buffer_[1] = {};
};
}  // namespace recording

TEST(Pipeline, DriverStartsTransfersInTheOrderTheModelChecks) {
  for (int64_t pp = 2; pp <= 5; pp++)
    for (int64_t s = 0; s < pp; s++)
      for (int64_t m = 0; m <= 9; m++) {
        overlap::Stage recorded;
        size_t passes = 0;
        recording::RecordingComm comm(static_cast<int>(s), static_cast<int>(pp), recorded, passes);
        recording::RecordingStage stage(pp - s, recorded, passes);
        PipelineDriver driver(comm, stage, PipelineLinks{"a<", "a>", "gradient<", "gradient>", "tied", nullptr, -1});
        std::vector<MicroBatch> micro_batches(m);
        for (int64_t i = 0; i < m; i++) micro_batches[i].batch = i, micro_batches[i].seq = 1;
        driver.step(micro_batches);
        const overlap::Stage expected = overlap::stage_order(pp, s, m, pipeline_gradient_ahead(pp, s, m));
        const std::string where = "pp " + std::to_string(pp) + ", stage " + std::to_string(s) + ", " + std::to_string(m);
        ASSERT_EQ(recorded.transfers.size(), expected.transfers.size()) << where;
        for (size_t t = 0; t < expected.transfers.size(); t++) {
          const overlap::Transfer &a = recorded.transfers[t], &b = expected.transfers[t];
          EXPECT_TRUE(a.send == b.send && a.peer == b.peer && a.gradient == b.gradient &&
                      a.micro_batch == b.micro_batch && a.passes_before == b.passes_before)
              << where << ", transfer " << t;
        }
        EXPECT_EQ(recorded.pass_waits, expected.pass_waits) << where;
        EXPECT_EQ(comm.waited(), recorded.transfers.size()) << where << ": every request waited for once";
      }
}

}  // namespace
}  // namespace tuna
