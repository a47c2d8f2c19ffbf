// Progress of a long job (a 140 GB conversion, a checkpoint write): what is done of the total, the rate, the
// share and the time left, on one line.
//
// On a terminal the line is rewritten in place (carriage return) a few times a second; into a file or a pipe
// (a batch job's log) it is a new line every `period_s` seconds, so a log shows the job moving without
// thousands of lines. Either way finish() prints the closing line with the total time and the mean rate.
// Also the formatting of sizes and durations every human-facing line of tuna uses.
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

}  // namespace tuna
