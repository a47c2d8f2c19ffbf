// Time left: the trainer's ETA (steps plus the validations and checkpoints still to come) and a throttled
// progress line for tools that otherwise print nothing for a long while (build/eval).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace tuna {

// "12m05s", "3h07m"; "?" for a negative or non-finite time.
std::string format_duration(double seconds);

// How many of a periodic event fall in a run from step `from` (done) to step `to`: one at each multiple of
// `every` (0: none) strictly between them, and one at `to` itself when from < to (the trainer validates
// and checkpoints at the end as well).
int64_t periodic_events_left(int64_t from, int64_t to, int64_t every);

// The trainer's ETA: training steps at their mean measured time, plus every validation and checkpoint still
// to come at the last one's measured time. A validation not yet measured (a resumed run) is guessed from the
// training steps: a validation batch is a forward only, about a third of a micro-batch's forward + backward.
// A checkpoint not yet measured counts nothing (its cost is the disk's, not the model's).
class TrainingEta {
 public:
  TrainingEta(int64_t micro_batches_per_step, int64_t batches_per_validation)
      : micro_batches_per_step_(micro_batches_per_step), batches_per_validation_(batches_per_validation) {}
  void step_done(double seconds) { step_seconds_ += seconds, steps_++; }
  void validation_done(double seconds) { validation_seconds_ = seconds; }
  void checkpoint_done(double seconds) { checkpoint_seconds_ = seconds; }
  double seconds_left(int64_t steps_left, int64_t validations_left, int64_t checkpoints_left) const;

 private:
  int64_t micro_batches_per_step_, batches_per_validation_;
  double step_seconds_ = 0;
  int64_t steps_ = 0;
  double validation_seconds_ = -1, checkpoint_seconds_ = -1;  // -1: not measured yet
};

// A line on stderr at most every `interval` seconds (and the first after `interval`): "eval: 40/125 batches
// (32%), 12s, ETA 26s". Quiet runs (interval <= 0) print nothing.
class ProgressLine {
 public:
  ProgressLine(std::string label, int64_t total, std::string unit, double interval_seconds = 5);
  void update(int64_t done);

 private:
  using clock = std::chrono::steady_clock;
  std::string label_, unit_;
  int64_t total_;
  double interval_;
  clock::time_point start_, last_;
};

}  // namespace tuna
