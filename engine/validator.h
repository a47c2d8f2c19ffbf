// Validator: when a run measures its held-out loss, and the measurement. It owns the validation data and the
// --val_every / --val_batches policy, so the trainer's loop only asks and calls. With --eval_tasks it also scores the
// multiple-choice tasks (engine/mc_eval.h) at every validation, with or without validation data.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/loader.h"
#include "engine/engine.h"
#include "engine/mc_eval.h"
#include "engine/preference.h"

namespace tuna {

class Validator {
 public:
  // data: null for a run without validation. every: each `every` steps (0: at the start and the end only);
  // max_batches: micro-batches per validation (0: the whole split).
  Validator(std::unique_ptr<DataLoader> data, int64_t every, int64_t max_batches);
  // A preference objective validates on held-out pairs: its loss and TRL's metrics (the loader must hold pairs).
  // dp: the data-parallel group the metrics are summed over. The preference object outlives the validator.
  void set_objective(Preference* preference, Comm* dp) { preference_ = preference, dp_ = dp; }
  DataLoader* data() { return data_.get(); }
  void set_tasks(std::unique_ptr<McEvaluator> tasks) { tasks_ = std::move(tasks); }

  bool enabled() const { return data_ != nullptr || tasks_ != nullptr; }
  // At the start of a fresh run (the loss before training), every `every` steps, and at the end of a run
  // that finished (not one stopped early).
  bool due_at_start(int64_t step) const { return enabled() && step == 0; }
  bool due(int64_t step, int64_t total_steps) const {
    return enabled() && every_ > 0 && step % every_ == 0 && step != total_steps;
  }
  bool due_at_end(int64_t step, int64_t total_steps, bool stopped) const {
    return enabled() && step == total_steps && !stopped;
  }
  // For the ETA: micro-batches per validation, and validations still to come after `step`.
  int64_t batches() const;
  int64_t left(int64_t step, int64_t total_steps) const;

  struct Result {
    int64_t step = 0, tokens = 0;
    double loss = 0, seconds = 0;
    int64_t pairs = -1;                       // a preference objective's held-out pairs; -1: a token loss
    nlohmann::json metrics = nlohmann::json::object();  // and its metrics (engine/preference.h)
    std::vector<McMetrics> tasks;  // --eval_tasks: each task's accuracy, then "all" (empty: none)
    bool has_loss = true;          // false: tasks without validation data
    nlohmann::json record() const;  // the metrics.jsonl row
    std::string line() const;       // the printed line
    std::string loss_line() const;
  };
  // The loss over the validation split, and the tasks' metrics, on every rank (all ranks call it).
  Result run(Engine& engine, int64_t step);

 private:
  Result loss(Engine& engine, int64_t step);
  std::unique_ptr<DataLoader> data_;
  int64_t every_, max_batches_;
  Preference* preference_ = nullptr;
  Comm* dp_ = nullptr;
  std::unique_ptr<McEvaluator> tasks_;
  std::vector<int32_t> inputs_, targets_, positions_;  // positions: the document boundaries (the engine's masks)
};

}  // namespace tuna
