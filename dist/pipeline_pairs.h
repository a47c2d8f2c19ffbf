// Preference objectives over pipeline stages (--pp), for both engines (model/preference_step.h holds the math). The
// last stage holds the head, so it computes the per-token log-probs, the pairs' sums, the loss and its per-token
// weights (pair_loss), and the sums are broadcast from it to every stage (rank 0, a first stage, prints the metrics;
// each stage's dp group sums them).
//
// A training step (step): first each micro-batch's reference forward down the stages where the reference is the base
// with the adapters off (it keeps no activation, so it runs before the step's slots fill), then the driver's 1F1B step
// over the engine's stage with the last stage's two passes made the pairs' (the model's PairPasses): its forward gives
// the loss and the weights, its backward is the weighted one, whose input gradient flows back through the stages as
// the next-token loss's does. The stages before the last run their passes unchanged. Only the last stage counts the
// loss that finish_step sums over the stages. Evaluation (forward) and the precompute pass (pair_logps) run each
// micro-batch down the stages without a backward.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "dist/pipeline.h"
#include "model/objective.h"
#include "model/preference_step.h"

namespace tuna {

// A step's sums, the same on every stage, and what finish_step takes from this stage: LossSum{loss, pairs} on the
// last stage, nothing before it.
struct PipelinePairSums {
  PreferenceSums sums;
  LossSum counted;
};

class PipelinePairs {
 public:
  // The model's two passes over a micro-batch on this stage (its layers; on the last stage the head's log-probs and,
  // after a forward with backward_follows, the weighted backward), in activation slot 0.
  using PassesOf = std::function<PairPasses(const PairBatch&)>;
  // stages, stage, links: the engine's pipeline (the comm its driver runs over, the stage, the driver's links);
  // host: the stages' comm on host memory (the sums' broadcasts).
  PipelinePairs(Comm& stages, PipelineStageModel& stage, const PipelineLinks& links, Comm& host, PassesOf passes);
  ~PipelinePairs();
  PipelinePairs(const PipelinePairs&) = delete;  // its stage holds passes_ by reference
  PipelinePairs& operator=(const PipelinePairs&) = delete;

  // A step's micro-batches of pairs, in the 1F1B order (the top of this file).
  PipelinePairSums step(const std::vector<PairBatch>& micro_batches, const ObjectiveConfig& objective,
                        const PreferenceStep& step);
  // One micro-batch without a backward (validation): its sums on every stage.
  PreferenceSums forward(const PairBatch& batch, const ObjectiveConfig& objective, const PreferenceStep& step);
  // Each pair's summed completion log-probs under the current weights (the precompute pass), on every stage.
  void pair_logps(const PairBatch& batch, double* chosen, double* rejected);

 private:
  class PairStage;
  bool last_stage() const;
  // One micro-batch down the stages without a backward: on the last stage each pair's sums of the completion
  // log-probs (adapters_off: the base's, the reference).
  void stages_pair_logps(const PairBatch& batch, bool adapters_off, double* chosen, double* rejected);
  PreferenceSums broadcast(const PreferenceSums& sums);

  Comm& host_;
  PassesOf passes_;
  std::unique_ptr<PairStage> stage_;
  std::unique_ptr<PipelineDriver> driver_;
};

}  // namespace tuna
