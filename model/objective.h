// Training objectives over the same packed windows: next-token (pretraining and SFT) and the preference losses
// over pairs (DPO with its sigmoid, ipo and hinge losses, SimPO, ORPO), as TRL 0.12.2 defines them (DPOTrainer,
// CPOTrainer with loss_type "simpo", ORPOTrainer; tools/reference/make_preference_fixtures.py holds them to it).
//
// A preference loss is a function of a few numbers per sequence: the policy's completion log-probs (summed, or
// averaged over the completion's tokens where TRL averages: ipo, SimPO, ORPO), the reference's (DPO), and for the
// SFT term a negative log-likelihood over the chosen sequence's tokens. So the objective never sees logits: the
// model gives per-token target log-probs, preference_loss turns the per-sequence sums into the loss, TRL's
// metrics and d loss / d logp of each sequence, and preference_token_weights turns those into one weight per
// token, with which the model's backward runs (d logits = w * (softmax - onehot), w = -d loss / d logp).
//
// Normalization (the trainer's one division per step, llama.h LossSum): a step's loss is
//   mean over the step's pairs of the pair loss  +  alpha * (chosen NLL summed over the step's NLL tokens) / tokens
// TRL's mean over the batch and its token-mean cross-entropy. (One TRL quirk is not copied: DPO's rpo NLL passes
// ignore_index=0, so TRL also skips completion tokens of id 0; here every completion token counts.) The objective returns sums: the pair losses plus
// alpha * pairs / tokens * NLL, with pairs and tokens the whole step's (all micro-batches and ranks), so that the
// trainer's division by the step's pairs gives exactly that.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>

namespace tuna {

enum class Objective { Sft, Dpo, Simpo, Orpo };
enum class PreferenceLossType { Sigmoid, Ipo, Hinge };  // DPO's --loss_type
// Where DPO's reference log-probs come from. Adapters: the frozen base with the adapters off (one extra forward
// without the adapter branches). Precompute: one pass with the starting weights before training, cached beside
// the shards. A live frozen copy of the model is never made.
enum class ReferenceSource { None, Adapters, Precompute };

const char* objective_name(Objective o);                  // "sft" | "dpo" | "simpo" | "orpo"
const char* loss_type_name(PreferenceLossType t);         // "sigmoid" | "ipo" | "hinge"
const char* reference_name(ReferenceSource r);            // "none" | "adapters" | "precompute"

struct ObjectiveConfig {
  Objective objective = Objective::Sft;
  double beta = 0.1;  // TRL's default for DPO, CPO/SimPO and ORPO
  PreferenceLossType loss_type = PreferenceLossType::Sigmoid;
  double simpo_gamma = 0.5;  // SimPO's target margin (TRL's CPOConfig default)
  // The SFT term on the chosen completion: DPO's rpo_alpha, and for SimPO CPO's cpo_alpha (0 is pure SimPO). 0: off.
  double rpo_alpha = 0;
  ReferenceSource reference = ReferenceSource::None;

  bool preference() const { return objective != Objective::Sft; }
  bool needs_reference() const { return objective == Objective::Dpo; }
  // The completion log-probs the loss takes are averaged over the completion's tokens (TRL: ipo, SimPO, ORPO).
  bool averaged() const {
    return objective == Objective::Simpo || objective == Objective::Orpo ||
           (objective == Objective::Dpo && loss_type == PreferenceLossType::Ipo);
  }
  // The weight of the NLL term (rpo_alpha, or 1 for ORPO's), and whether it covers the chosen prompt too (ORPO:
  // TRL's ORPOTrainer takes the cross-entropy over prompt and response).
  double nll_weight() const { return objective == Objective::Orpo ? 1.0 : rpo_alpha; }
  bool nll_covers_prompt() const { return objective == Objective::Orpo; }
};

// From the options' text (train.cu): objective sft|dpo|simpo|orpo, loss_type sigmoid|ipo|hinge, reference
// auto|adapters|precompute (auto: adapters with LoRA, else precompute). Every refusal names the option: a
// loss_type other than sigmoid or an rpo_alpha for an objective that has none, a reference for SimPO/ORPO, and a
// reference of "model" (a live frozen copy), refused naming the two ways that need no second copy.
ObjectiveConfig make_objective_config(const std::string& objective, double beta, const std::string& loss_type,
                                      double simpo_gamma, double rpo_alpha, const std::string& reference,
                                      bool adapters);

// One pair's figures from the forward passes. Token counts are the completion's (the log-probs' denominators).
struct PairLogps {
  double chosen = 0, rejected = 0;          // the policy's completion log-probs, summed over the completion
  int64_t chosen_tokens = 0, rejected_tokens = 0;
  double ref_chosen = 0, ref_rejected = 0;  // the reference's, summed (DPO)
};

// d (loss sum) / d (a sequence's summed completion log-prob).
struct PairGrad {
  double chosen = 0, rejected = 0;
};

// A step's (or a validation's) sums over pairs; TRL's metrics are these over `pairs` (metrics_json).
struct PreferenceSums {
  double loss = 0;  // sum of pair losses, plus the NLL term scaled to the step (see the header comment)
  double rewards_chosen = 0, rewards_rejected = 0, rewards_accuracies = 0;
  double logps_chosen = 0, logps_rejected = 0;  // as the loss takes them: sums, or averages where TRL averages
  double nll = 0;              // the chosen NLL summed over its tokens (ORPO's, or the rpo_alpha term's)
  int64_t pairs = 0, nll_tokens = 0;
  void add(const PreferenceSums& other);
};
// {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"}
// (means over the pairs), and "nll_loss" (the mean over NLL tokens) where the objective has one. Empty: no pairs.
nlohmann::json metrics_json(const PreferenceSums& sums, const ObjectiveConfig& config);

// The step's normalizers, summed over its micro-batches and ranks: its pairs and its NLL tokens.
struct PreferenceStep {
  int64_t pairs = 0, nll_tokens = 0;
};

// The losses of `pairs` (TRL's definitions, above), their metrics and, into grads (one per pair, may be empty when
// no gradient is wanted), d loss_sum / d each sequence's summed completion log-prob. nll: these pairs' chosen NLL
// summed over nll_tokens tokens. Returns the sums; *nll_token_weight (may be null) gets d loss_sum / d (an NLL
// token's log-prob) = -nll_weight * step.pairs / step.nll_tokens. Doubles throughout.
PreferenceSums preference_loss(const ObjectiveConfig& config, std::span<const PairLogps> pairs, double nll,
                               int64_t nll_tokens, const PreferenceStep& step, std::span<PairGrad> grads,
                               double* nll_token_weight);

// A packed micro-batch's sequences, as the loader describes them ([rows] each, rows = batch x seq):
//   sequence[i]   the sequence whose document holds input token i and whose target is token i's next one: 2p for
//                 pair p's chosen, 2p + 1 for its rejected (p counts the micro-batch's pairs), -1 for none
//   completion[i] 1 when target i is a completion token (counted in the log-probs), else 0
// Targets of the document's last token and of padding are kIgnoreIndex.
struct PairRows {
  const int32_t* sequence = nullptr;
  const uint8_t* completion = nullptr;
  int64_t rows = 0, pairs = 0;
};

// Sums per-token target log-probs (logps[i], 0 where the target is ignored) into each pair's PairLogps (the
// reference's from ref_logps when given, else left 0), and the chosen NLL the objective needs into *nll and
// *nll_tokens (completion tokens, or with ORPO every trained token of the chosen sequence).
void gather_pair_logps(const ObjectiveConfig& config, const PairRows& rows, const int32_t* targets,
                       const float* logps, const float* ref_logps, std::span<PairLogps> pairs, double* nll,
                       int64_t* nll_tokens);
// The NLL tokens of these rows (what gather_pair_logps counts), for the step's normalizer before any forward.
int64_t count_nll_tokens(const ObjectiveConfig& config, const PairRows& rows, const int32_t* targets);

// One weight per token for the weighted backward: w[i] = -d loss_sum / d logp[i], from each pair's gradient (already
// per summed log-prob: preference_loss divides by the completion's tokens where the loss averages) and the NLL token
// weight; 0 where the target is ignored or outside every term.
void preference_token_weights(const ObjectiveConfig& config, const PairRows& rows, const int32_t* targets,
                              std::span<const PairLogps> pairs, std::span<const PairGrad> grads,
                              double nll_token_weight, float* weights);

}  // namespace tuna
