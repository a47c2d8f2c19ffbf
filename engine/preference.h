// The training objective as one component of the trainer (as engine/adapters.h is for what trains): SFT, or a
// preference loss over packed pairs (model/objective.h: DPO, SimPO, ORPO as TRL defines them). train.cu asks it once
// per step and per validation; the math is model/'s, the passes the engine's (Engine::forward_pairs).
//
//   options     --objective sft|dpo|simpo|orpo, --beta, --loss_type sigmoid|ipo|hinge, --simpo_gamma, --rpo_alpha,
//               --reference auto|adapters|precompute (also TOML keys). A live frozen copy is refused, naming the two
//               ways that need none.
//   data        a preference objective reads pair shards (prepare --preference), SFT any other; each is refused on
//               the other kind, naming the option.
//   reference   DPO with adapters: the base with the adapters off, one extra forward per micro-batch (the engine's).
//               A full fine-tune: --reference precompute, one pass over the pairs with the starting weights before
//               the first step, kept beside the shards (data/reference_logps.h) keyed by the data, the model and the
//               options, reused by a resume and by a second run, refused when any of them changed.
//   a step      its micro-batches' pairs and NLL tokens counted first (summed over dp: the loss's normalizers), then
//               each micro-batch's forward, loss and weighted backward (Engine::forward_pairs_step: over pipeline
//               stages in the 1F1B order); the step's loss is the mean pair loss (plus the NLL term), which
//               finish_step takes as LossSum{loss sum, pairs} from the ranks that count it (a pipeline's last stage).
//   metrics     TRL's rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
//               logps/rejected (and nll_loss where the objective has one), per step and on the held-out pairs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/options.h"
#include "data/loader.h"
#include "data/reference_logps.h"
#include "engine/engine.h"
#include "model/objective.h"

namespace tuna {

struct PreferenceOptions {
  std::string objective = "sft";
  double beta = 0.1;
  std::string loss_type = "sigmoid";
  double simpo_gamma = 0.5;
  double rpo_alpha = 0;
  std::string reference = "auto";
};
void declare_preference_options(Options& o, PreferenceOptions& p);

// What a precomputed reference is keyed by besides the shards: the starting weights' files (empty: a model drawn from
// scratch, keyed by `model_text` alone) and the options that change the log-probs.
struct ReferenceInputs {
  std::vector<std::string> weight_files;
  std::string model_text;
  std::string options_text;
};

class Preference {
 public:
  Preference() = default;  // SFT
  Preference(const PreferenceOptions& options, bool adapters);

  bool enabled() const { return config_.preference(); }
  const ObjectiveConfig& config() const { return config_; }
  // For the banner: "objective dpo (sigmoid, beta 0.1; reference: precomputed)".
  std::string describe() const;
  // The shards against the objective: pair shards for a preference objective, plain or SFT shards for sft.
  void check_data(const DataLoader& loader, const std::string& option) const;

  // DPO's precomputed reference of one set of pairs (train: the training loader's; else the validation loader's):
  // the file beside `shards` when its key matches; else, when can_compute (a fresh run: the engine holds the starting
  // weights), one pass of `eval_loader` through the engine, summed over dp, written by rank 0. A resume without the
  // file fails naming it: the starting weights are gone. Nothing without a precomputed reference.
  void prepare_reference(Engine& engine, const std::vector<std::string>& shards, DataLoader& eval_loader,
                         const ReferenceInputs& source, bool can_compute, bool train, Comm& world, Comm* dp);

  // One optimizer step's micro-batches from `loader`, through the engine: the loss sum and this rank's pairs, for
  // finish_step. metrics() then holds the step's TRL metrics over every dp rank.
  LossSum step(Engine& engine, DataLoader& loader, int64_t grad_accum, Comm* dp);
  const nlohmann::json& metrics() const { return metrics_; }

  // The held-out pairs (every rank, an eval loader; max_batches 0: all): the mean loss and TRL's metrics.
  struct Validation {
    double loss = 0;
    int64_t pairs = 0;
    nlohmann::json metrics;
  };
  Validation validate(Engine& engine, DataLoader& loader, int64_t max_batches, Comm* dp);

 private:
  // One micro-batch's buffers, as DataLoader::next_pairs fills them.
  struct Micro {
    std::vector<int32_t> inputs, targets, positions, sequence;
    std::vector<uint8_t> completion;
    std::vector<uint64_t> ids;
    std::vector<double> ref_chosen, ref_rejected;
  };
  bool read(DataLoader& loader, Micro& m, const ReferenceLogps* reference) const;
  PairBatch batch(const DataLoader& loader, const Micro& m) const;
  int64_t nll_tokens(const DataLoader& loader, const Micro& m) const;

  ObjectiveConfig config_;
  ReferenceLogps train_reference_, val_reference_;  // --reference precompute: each set's pairs, by pair id
  std::vector<Micro> micro_;
  nlohmann::json metrics_ = nlohmann::json::object();
};

}  // namespace tuna
