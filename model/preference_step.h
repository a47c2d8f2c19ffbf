// A preference objective's pass over one micro-batch of packed pairs: the reference's log-probs (precomputed, or with
// adapters the frozen base alone: one forward without the adapter branches), the policy's forward and per-token
// log-probs, the loss and metrics (model/objective.h), and the backward with per-token weights. The flow is the same
// on both models, so it is written once (pair_step over a model's PairPasses); the CPU model's passes are Llama's
// (model/llama.h), the CUDA model's LlamaGpu's (engine/engine_gpu.cpp). The engines call it per micro-batch after
// summing the step's normalizers (PreferenceStep) over their micro-batches and ranks; tests call it on whole batches.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "data/loader.h"
#include "model/llama.h"
#include "model/objective.h"

namespace tuna {

// One micro-batch as DataLoader::next_pairs gives it ([batch, seq] each), and with a precomputed reference each pair's
// summed reference log-probs (null otherwise).
struct PairBatch {
  const int32_t* inputs = nullptr;
  const int32_t* targets = nullptr;
  const int32_t* positions = nullptr;
  PairRows rows;  // rows.rows = batch x seq
  int64_t batch = 0, seq = 0;
  const double* ref_chosen = nullptr;
  const double* ref_rejected = nullptr;
};

// The two passes of a model over one micro-batch (model/llama.h forward_logps and backward_weighted, on its batch).
struct PairPasses {
  // logps[i] = log p(targets[i]) over the batch's [batch x seq] tokens, 0 where the target is ignored; the
  // activations kept for a backward when backward_follows; adapters_off: the frozen base alone (never with a backward).
  std::function<void(float* logps, bool backward_follows, bool adapters_off)> forward_logps;
  // After forward_logps(backward_follows): the backward of sum_i -weights[i] * logps[i], accumulated into the
  // gradients as an SFT micro-batch's are.
  std::function<void(const float* weights)> backward_weighted;
};

// The CPU model's passes over `batch` (both hold references: batch and model outlive them).
PairPasses llama_passes(Llama& model, const PairBatch& batch);

// The micro-batch's share of the step (llama_pair_step below) through any model's passes.
PreferenceSums pair_step(const PairPasses& passes, const ObjectiveConfig& config, const PairBatch& batch,
                         const PreferenceStep& step, bool want_grad);
// Each pair's summed completion log-probs (llama_pair_logps below) through any model's passes.
void pair_logp_sums(const PairPasses& passes, const PairBatch& batch, bool adapters_off, double* chosen,
                    double* rejected);

// The micro-batch's share of the step: its pairs' sums (loss as model/objective.h normalizes it). want_grad: the
// weighted backward accumulates into the model's gradients. The reference: config.reference Adapters runs the base
// alone; otherwise batch.ref_chosen / ref_rejected must be given for DPO.
PreferenceSums llama_pair_step(Llama& model, const ObjectiveConfig& config, const PairBatch& batch,
                               const PreferenceStep& step, bool want_grad);

// The two halves of llama_pair_step around the model's passes, for an engine that runs the passes elsewhere (a
// pipeline's last stage, which holds the head): each pair's summed completion log-probs from per-token log-probs
// ([batch, seq]), and the micro-batch's loss and metrics from the policy's per-token log-probs and the reference's sums
// (null: none, or batch.ref_chosen / ref_rejected when given), with, when weights is not null, the per-token weights
// of the backward (Llama::backward_weighted).
void sum_pair_logps(const PairBatch& batch, const float* logps, double* chosen, double* rejected);
PreferenceSums pair_loss(const ObjectiveConfig& config, const PairBatch& batch, const PreferenceStep& step,
                         const float* logps, const double* ref_chosen, const double* ref_rejected, float* weights);

// Each pair's summed completion log-probs under the model (adapters_off: the base alone), into chosen and rejected
// (one per pair): the reference's precompute pass.
void llama_pair_logps(Llama& model, const PairBatch& batch, bool adapters_off, double* chosen, double* rejected);

// DPO's reference precompute pass (data/reference_logps.h): every pair window of `loader` (an eval loader: each once,
// this rank's share under dp) through the model, each pair's summed completion log-probs written at its pair id into
// chosen and rejected (sized to loader.total_pairs(); what other ranks compute stays 0, for the caller's sum).
void precompute_reference_logps(Llama& model, DataLoader& loader, std::vector<double>& chosen,
                                std::vector<double>& rejected);

}  // namespace tuna
