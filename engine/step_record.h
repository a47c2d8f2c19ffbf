// One training step as the run reports it: the same record is the metrics.jsonl row (json) and the log line
// (line), so the two never disagree.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/engine.h"  // EngineStatus
#include "model/optimizer.h"  // OptimizerStats

namespace tuna {

struct StepRecord {
  int64_t step = 0, total_steps = 0;
  double loss = 0, lr = 0;
  OptimizerStats stats;
  int64_t tokens = 0;          // trained tokens of the step, all ranks
  int64_t window_tokens = 0;   // tokens the step's windows hold, all ranks (SFT trains only the answers')
  int64_t skipped_steps = 0;   // so far; reported on a skipped step
  double tokens_per_s = 0, seconds = 0, elapsed_s = 0, eta_s = 0;
  double mfu = NAN;            // NaN: no device peak (cpu)
  double cost = NAN;           // NaN: no --gpu_hour_cost
  EngineStatus status;
  // A preference objective's TRL metrics (engine/preference.h: rewards/*, logps/*, nll_loss); empty for SFT.
  nlohmann::json preference = nlohmann::json::object();

  nlohmann::json json() const;
  std::string line() const;
};

// The window length whose causal attention costs what these tokens' does under document masks, for MFU's model
// FLOPs (model_flops_per_token's seq): a token at place p of its document attends p + 1 keys, so a document of L
// tokens costs L^2 / 2 key blocks of work, as a causal window of L; the mean of 2p + 1 over the tokens is the
// length that gives every token the same share (a whole window: seq_len; documents of 3 and 5: 34 / 8).
// positions[i]: the token's place in its document (Loader). Rounded; 0 for no tokens.
int64_t attention_span(const int32_t* positions, int64_t n);

}  // namespace tuna
