// Multiple-choice evaluation (build/eval --tasks, build/train --eval_tasks): every request of the task records
// (data/mc_tasks.h) scored by the model's per-token log-probs, and lm-evaluation-harness's metrics from them.
//
// A request is one document (identical requests are scored once): packed, many share a window under the document mask with positions restarting, so
// no padding is computed and no request sees another (the same numbers as one request per row, which is what a
// model without packed log-probs gets). Requests are placed longest first, each into the fullest window it fits
// (best fit), which packs a task's short choices densely. Under dp each rank scores every ranks-th batch and the
// scores are summed over ranks (a rank's others stay 0).
//
// The metrics are lm-eval's for output_type multiple_choice: acc (the highest log-likelihood is gold; the first
// of equal ones, numpy's argmax), acc_norm (log-likelihood over the choice's length in characters), and their
// standard errors (sample standard deviation over sqrt(n)); the aggregate over tasks weights each task by its
// records and pools the standard errors (lm-eval's group aggregation with weight_by_size).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "data/mc_tasks.h"

namespace tuna {

class Comm;
class Engine;

// Per-token log-probs of a batch of windows: logps[i] = log p(targets[i]) and greedy[i] = 1 when targets[i] is the
// first argmax of the logits (what lm-eval's greedy test compares), for [batch, seq] inputs, targets and positions
// (each token's place in its document; null: one document per row); both 0 where the target is ignored.
using TokenLogps = std::function<void(const int32_t* inputs, const int32_t* targets, const int32_t* positions,
                                      int64_t batch, int64_t seq, float* logps, uint8_t* greedy)>;

// Each request's summed continuation log-prob and whether every continuation token is greedy.
struct McScores {
  std::vector<double> loglikelihood;
  std::vector<uint8_t> greedy;
};

struct McScoring {
  int64_t batch = 1, seq = 0;  // windows per call, tokens per window (each request fits: encode_mc_requests)
  bool packed = true;          // many requests per window (false: one per row, positions null)
  int rank = 0, ranks = 1;     // this rank scores batches rank, rank + ranks, ...
  // Every rank makes the same number of calls (a rank out of batches scores an empty one): what ZeRO-3's gathers
  // over dp need of an engine.
  bool lockstep = false;
  // Given, a record whose choices share their context ids scores the context once (ForwardModel::forward_shared_logps:
  // the context but its last token, then each choice's row: that token and the continuation); the others are packed.
  std::function<void(const int32_t* context, int64_t c, const int32_t* tokens, const int32_t* targets, int64_t k,
                     int64_t m, float* logps, uint8_t* greedy)>
      shared;
  // After each batch (or shared record) this rank scored: those done and planned (this rank's), for progress lines.
  std::function<void(int64_t done, int64_t planned)> progress;
};

// The windows the requests take, for messages and plans.
struct McPacking {
  int64_t windows = 0, tokens = 0;  // windows used; input tokens placed (their fill is tokens / (windows x seq))
};
McPacking pack_mc_requests(const std::vector<McRequest>& requests, const McScoring& how,
                           std::vector<std::vector<int64_t>>* windows = nullptr);

McScores score_mc_requests(const std::vector<McRequest>& requests, const McScoring& how, const TokenLogps& logps);

struct McMetrics {
  std::string task;  // a task's name, or "all" for the aggregate
  int64_t records = 0;
  double acc = 0, acc_stderr = 0, acc_norm = 0, acc_norm_stderr = 0;  // stderr NaN with fewer than 2 records
  bool generative = false;                     // a generative task's row (engine/gen_eval.h): exact_match only
  double exact_match = 0, exact_match_stderr = 0;
};
// lm-eval's mean and mean_stderr of per-record scores (sample standard deviation over sqrt(n); NaN under 2 records),
// summed in the records' order as Python's sum.
double lm_eval_mean(const std::vector<double>& x);
double lm_eval_mean_stderr(const std::vector<double>& x);
// lm-eval's group aggregate of task rows (aggregate_subtask_metrics with weight_by_size, pooled_sample_stderr), in
// row order, named `name`: every metric field of the rows.
McMetrics aggregate_metrics(const std::vector<McMetrics>& rows, const std::string& name);
// Each task in the records' order of first appearance, then (more than one task) "all".
std::vector<McMetrics> mc_metrics(const McTasks& tasks, const std::vector<McRequest>& requests, const McScores& scores);

// One line per metric row for people: "arc_easy  acc 0.6120 ± 0.0100  acc_norm 0.5800 ± 0.0101  (2376 records)",
// "triviaqa  exact_match 0.4120 ± 0.0100  (1000 records)".
std::string format_mc_metrics(const std::vector<McMetrics>& metrics);
nlohmann::json mc_metrics_json(const std::vector<McMetrics>& metrics);
// --output's row for record i: its task, file, line, id, gold, each choice's log-likelihood and greedy flag, and the
// predictions acc and acc_norm take.
nlohmann::json mc_record_json(const McTasks& tasks, const std::vector<McRequest>& requests, const McScores& scores,
                              int64_t record, const std::vector<int64_t>& first_request);
// Index of each record's first request (records' requests are contiguous, in choice order).
std::vector<int64_t> mc_first_requests(const McTasks& tasks, const std::vector<McRequest>& requests);

// build/train --eval_tasks: the task records read and tokenized once at start, scored on the training engine at every
// validation (Engine::target_logps: the run's own layout) in windows of the run's micro-batch x seq_len, this dp
// rank's share, summed over dp. A request longer than seq_len keeps its last seq_len + 1 tokens. packed: many requests
// per window under the document mask (the CPU engine); else one per row, no positions (the CUDA engine's).
class McEvaluator {
 public:
  McEvaluator(const std::string& specs, const Tokenizer& tokenizer, bool skip_bad, int64_t micro_batch, int64_t seq_len,
              Comm* dp, bool packed = true);
  std::vector<McMetrics> run(Engine& engine);
  std::string describe() const;  // "eval_tasks: 3 tasks, 120 records, 480 requests in 31 windows (2 cut)"

 private:
  McTasks tasks_;
  std::vector<McRequest> requests_;
  McScoring how_;
  int64_t truncated_ = 0;
  Comm* dp_;
};

}  // namespace tuna
