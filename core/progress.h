// Progress of a long job (a 140 GB conversion, a checkpoint write): what is done of the total, the rate, the
// share and the time left, on one line.
//
// On a terminal the line is rewritten in place (carriage return) a few times a second; into a file or a pipe
// (a batch job's log) it is a new line every `period_s` seconds, so a log shows the job moving without
// thousands of lines. Either way finish() prints the closing line with the total time and the mean rate.
// Also the formatting of sizes and durations every human-facing line of tuna uses, and the trainer's ETA
// (TrainingEta: the steps left plus the validations and checkpoints still to come).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace tuna {

// 1536 -> "1.5 KB", 3.2e9 -> "3.2 GB" (decimal units, as disks and networks count).
std::string human_bytes(double bytes);
// 75 -> "1m15s", 7300 -> "2h01m", 200000 -> "2d07h"; "?" for a negative or non-finite duration.
std::string human_duration(double seconds);

// True when `out` is a terminal a person watches. Under an MPI launcher (Open MPI, PMIx, PMI, Slurm's srun),
// a rank's stdout and stderr may be a pseudo-terminal that the launcher forwards into whatever its own output
// is, often a log file: a rank never treats them as a terminal, so that no carriage return or ESC[K reaches a log.
bool is_live_terminal(std::FILE* out);

class ProgressLine {
 public:
  enum class Unit { Bytes, Items };
  // `label` starts the line ("convert: writing model.safetensors"); `total` in `unit`s (0: unknown, no share or
  // ETA); `items_name` names Items ("documents", "tensors"). Live on a terminal unless `live` says otherwise.
  ProgressLine(std::string label, double total, Unit unit = Unit::Bytes, std::FILE* out = stderr,
               double period_s = 10.0, std::string items_name = "items");
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;
  ~ProgressLine();  // an unfinished line on a terminal gets its newline

  void set_live(bool live) { live_ = live; }
  void update(double done);           // absolute progress; prints when the period has passed
  void add(double delta) { update(done_ + delta); }
  void finish();                      // the closing line (once)
  double done() const { return done_; }
  // The line as it would print now (tests).
  std::string text(bool final) const;

 private:
  using Clock = std::chrono::steady_clock;
  std::string amount(double x) const;
  std::string label_, items_name_;
  double total_, done_ = 0, period_s_;
  Unit unit_;
  std::FILE* out_;
  bool live_, finished_ = false, pending_newline_ = false;
  Clock::time_point start_, last_print_;
};

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

}  // namespace tuna
