// Preference objectives over pipeline stages: see dist/pipeline_pairs.h.
#include "dist/pipeline_pairs.h"

#include <cmath>
#include <utility>

#include "core/error.h"

namespace tuna {

// The engine's stage with the last stage's passes swapped for the pairs' while a step's pairs are set; everything else
// (slots, boundary buffers, gradients, the device's hooks) is the engine's stage's.
class PipelinePairs::PairStage final : public PipelineStageModel {
 public:
  // A step of pairs on the last stage: its micro-batches (the driver's, in order), the objective and its normalizers,
  // each micro-batch's reference sums where the base gave them (empty otherwise), and what the passes leave: each
  // micro-batch's sums, and the log-probs and weights of the one in flight (the last stage holds one at a time).
  struct Step {
    const std::vector<PairBatch>* batches = nullptr;
    const ObjectiveConfig* objective = nullptr;
    const PreferenceStep* step = nullptr;
    const std::vector<std::vector<double>>* ref_chosen = nullptr;
    const std::vector<std::vector<double>>* ref_rejected = nullptr;
    std::vector<PreferenceSums> sums;
    std::vector<float> logps, weights;
  };

  PairStage(PipelineStageModel& inner, const PassesOf& passes, bool last)
      : inner_(inner), passes_(passes), last_(last) {}
  void set_step(Step* step) { step_ = step; }

  int64_t in_flight() const override { return inner_.in_flight(); }
  int64_t boundary_elements(const MicroBatch& b) const override { return inner_.boundary_elements(b); }
  void* input(int64_t slot) override { return inner_.input(slot); }
  const void* output() const override { return inner_.output(); }
  void* output_grad() override { return inner_.output_grad(); }
  const void* input_grad() const override { return inner_.input_grad(); }
  void begin_pass(int64_t micro_batch) override {
    micro_batch_ = micro_batch;
    inner_.begin_pass(micro_batch);
  }
  LossSum forward(int64_t slot, const MicroBatch& b, bool backward_follows) override {
    if (!last_ || !step_) return inner_.forward(slot, b, backward_follows);
    TUNA_CHECK(slot == 0 && backward_follows, "the last stage's pair forward in slot ", slot);
    Step& p = *step_;
    const PairBatch& pb = (*p.batches)[micro_batch_];
    const int64_t n = pb.batch * pb.seq;
    p.logps.resize(n), p.weights.resize(n);
    passes_(pb).forward_logps(p.logps.data(), /*backward_follows=*/true, /*adapters_off=*/false);
    const bool base = !p.ref_chosen->empty();
    p.sums[micro_batch_] = pair_loss(*p.objective, pb, *p.step, p.logps.data(),
                                     base ? (*p.ref_chosen)[micro_batch_].data() : nullptr,
                                     base ? (*p.ref_rejected)[micro_batch_].data() : nullptr, p.weights.data());
    return {};  // the pairs' loss is counted by PipelinePairs::step
  }
  void backward(int64_t slot, const MicroBatch& b) override {
    if (!last_ || !step_) return inner_.backward(slot, b);
    passes_((*step_->batches)[micro_batch_]).backward_weighted(step_->weights.data());
  }
  float* gradients() override { return inner_.gradients(); }
  float* tied_peer_gradient() override { return inner_.tied_peer_gradient(); }
  void add_tied_peer_gradient(float* mine, const float* theirs, int64_t n) override {
    inner_.add_tied_peer_gradient(mine, theirs, n);
  }
  CommType wire_type() const override { return inner_.wire_type(); }
  void before_transfer() override { inner_.before_transfer(); }
  CommRequest compute_waits_for(Comm& comm, CommRequest request) override {
    return inner_.compute_waits_for(comm, request);
  }
  bool receives_gradient_ahead() const override { return inner_.receives_gradient_ahead(); }

 private:
  PipelineStageModel& inner_;
  const PassesOf& passes_;
  bool last_;
  Step* step_ = nullptr;
  int64_t micro_batch_ = 0;  // of the pass under way (begin_pass)
};

PipelinePairs::PipelinePairs(Comm& stages, PipelineStageModel& stage, const PipelineLinks& links, Comm& host,
                             PassesOf passes)
    : host_(host), passes_(std::move(passes)) {
  TUNA_CHECK(stages.rank() == host.rank() && stages.size() == host.size(), "the stages' comms disagree: rank ",
             stages.rank(), " of ", stages.size(), " and ", host.rank(), " of ", host.size());
  stage_ = std::make_unique<PairStage>(stage, passes_, stages.rank() == stages.size() - 1);
  driver_ = std::make_unique<PipelineDriver>(stages, *stage_, links);
}

PipelinePairs::~PipelinePairs() = default;

bool PipelinePairs::last_stage() const { return host_.rank() == host_.size() - 1; }

PipelinePairSums PipelinePairs::step(const std::vector<PairBatch>& micro_batches, const ObjectiveConfig& objective,
                                     const PreferenceStep& step) {
  const size_t m = micro_batches.size();
  // The base's log-probs first: a forward that keeps nothing, before the step's slots hold activations.
  std::vector<std::vector<double>> ref_c, ref_r;
  if (objective.needs_reference() && objective.reference == ReferenceSource::Adapters) {
    ref_c.resize(m), ref_r.resize(m);
    for (size_t i = 0; i < m; i++) {
      ref_c[i].resize(micro_batches[i].rows.pairs), ref_r[i].resize(micro_batches[i].rows.pairs);
      stages_pair_logps(micro_batches[i], /*adapters_off=*/true, ref_c[i].data(), ref_r[i].data());
    }
  }
  PairStage::Step passes;
  passes.batches = &micro_batches, passes.objective = &objective, passes.step = &step;
  passes.ref_chosen = &ref_c, passes.ref_rejected = &ref_r;
  passes.sums.resize(m);
  std::vector<MicroBatch> driven;
  for (const PairBatch& b : micro_batches)
    driven.push_back(MicroBatch{b.inputs, b.targets, b.positions, b.batch, b.seq});
  stage_->set_step(&passes);
  try {
    driver_->step(driven);
  } catch (...) {
    stage_->set_step(nullptr);
    throw;
  }
  stage_->set_step(nullptr);
  PipelinePairSums out;
  for (const PreferenceSums& s : passes.sums) out.sums.add(s);  // in the micro-batches' order, as at pp 1
  out.sums = broadcast(out.sums);
  if (last_stage()) out.counted = LossSum{out.sums.loss, out.sums.pairs};
  return out;
}

PreferenceSums PipelinePairs::forward(const PairBatch& batch, const ObjectiveConfig& objective,
                                      const PreferenceStep& step) {
  std::vector<double> ref_c, ref_r;
  if (objective.needs_reference() && objective.reference == ReferenceSource::Adapters) {
    ref_c.resize(batch.rows.pairs), ref_r.resize(batch.rows.pairs);
    stages_pair_logps(batch, /*adapters_off=*/true, ref_c.data(), ref_r.data());
  }
  std::vector<float> logps(batch.batch * batch.seq);
  driver_->forward_pass(MicroBatch{batch.inputs, batch.targets, batch.positions, batch.batch, batch.seq}, [&] {
    passes_(batch).forward_logps(logps.data(), /*backward_follows=*/false, /*adapters_off=*/false);
  });
  PreferenceSums sums;
  if (last_stage())
    sums = pair_loss(objective, batch, step, logps.data(), ref_c.empty() ? nullptr : ref_c.data(),
                     ref_r.empty() ? nullptr : ref_r.data(), /*weights=*/nullptr);
  return broadcast(sums);
}

void PipelinePairs::pair_logps(const PairBatch& batch, double* chosen, double* rejected) {
  stages_pair_logps(batch, /*adapters_off=*/false, chosen, rejected);
  // Every stage gets them: the precompute pass's file is written by rank 0, a first stage.
  const int64_t bytes = batch.rows.pairs * static_cast<int64_t>(sizeof(double));
  host_.broadcast(chosen, bytes, host_.size() - 1, "reference log-probs (chosen)");
  host_.broadcast(rejected, bytes, host_.size() - 1, "reference log-probs (rejected)");
}

void PipelinePairs::stages_pair_logps(const PairBatch& b, bool adapters_off, double* chosen, double* rejected) {
  std::vector<float> logps(b.batch * b.seq);
  driver_->forward_pass(MicroBatch{b.inputs, b.targets, b.positions, b.batch, b.seq},
                        [&] { passes_(b).forward_logps(logps.data(), /*backward_follows=*/false, adapters_off); });
  if (last_stage()) sum_pair_logps(b, logps.data(), chosen, rejected);
}

PreferenceSums PipelinePairs::broadcast(const PreferenceSums& s) {
  double v[9] = {s.loss, s.rewards_chosen, s.rewards_rejected, s.rewards_accuracies, s.logps_chosen,
                 s.logps_rejected, s.nll, double(s.pairs), double(s.nll_tokens)};
  host_.broadcast(v, sizeof(v), host_.size() - 1, "preference metrics");
  PreferenceSums out;
  out.loss = v[0], out.rewards_chosen = v[1], out.rewards_rejected = v[2], out.rewards_accuracies = v[3];
  out.logps_chosen = v[4], out.logps_rejected = v[5], out.nll = v[6];
  out.pairs = std::llround(v[7]), out.nll_tokens = std::llround(v[8]);
  return out;
}

}  // namespace tuna
