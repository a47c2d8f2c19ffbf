#include "core/progress.h"

#include <cstdlib>

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tuna {

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  int u = 0;
  while (std::abs(b) >= 1000 && u < 5) b /= 1000, u++;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

std::string human_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = std::llround(seconds);
  char buf[32];
  if (s >= 86400) std::snprintf(buf, sizeof buf, "%lldd%02lldh", (long long)(s / 86400), (long long)(s % 86400 / 3600));
  else if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", (long long)(s / 3600), (long long)(s % 3600 / 60));
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  else std::snprintf(buf, sizeof buf, "%.1fs", seconds);
  return buf;
}

bool is_live_terminal(std::FILE* out) {
  if (out == nullptr || ::isatty(::fileno(out)) != 1) return false;
  for (const char* launcher : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID"})
    if (std::getenv(launcher)) return false;
  return true;
}

ProgressLine::ProgressLine(std::string label, double total, Unit unit, std::FILE* out, double period_s,
                           std::string items_name)
    : label_(std::move(label)),
      items_name_(std::move(items_name)),
      total_(total),
      period_s_(period_s),
      unit_(unit),
      out_(out),
      live_(is_live_terminal(out)),
      start_(Clock::now()),
      last_print_(start_) {}

ProgressLine::~ProgressLine() {
  if (pending_newline_ && out_) std::fputc('\n', out_), std::fflush(out_);
}

std::string ProgressLine::amount(double x) const {
  if (unit_ == Unit::Bytes) return human_bytes(x);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

std::string ProgressLine::text(bool final) const {
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const double rate = elapsed > 0 ? done_ / elapsed : 0;
  // Slow items (a batch of a big model takes seconds) with two significant digits: never "0 batches/s".
  char slow[64] = "";
  if (unit_ == Unit::Items && rate > 0 && rate < 10)
    std::snprintf(slow, sizeof slow, "%.2g %s/s", rate, items_name_.c_str());
  const std::string rate_text = slow[0] ? std::string(slow)
                                : unit_ == Unit::Bytes ? str(human_bytes(rate), "/s")
                                                       : str(amount(rate), " ", items_name_, "/s");
  std::string line = label_ + ": " + amount(done_);
  if (total_ > 0) line += " / " + amount(total_);
  if (unit_ == Unit::Items) line += " " + items_name_;
  line += " (" + rate_text + ")";
  if (final) return line + " in " + human_duration(elapsed);
  if (total_ > 0) {
    char share[16];
    std::snprintf(share, sizeof share, "%.0f%%", 100.0 * std::min(1.0, done_ / total_));
    line += str(", ", share, ", ETA ", rate > 0 ? human_duration((total_ - done_) / rate) : std::string("?"));
  }
  return line;
}

void ProgressLine::update(double done) {
  done_ = done;
  if (!out_ || finished_) return;
  const auto now = Clock::now();
  const double since = std::chrono::duration<double>(now - last_print_).count();
  if (since < (live_ ? 0.25 : period_s_)) return;
  last_print_ = now;
  if (live_) {
    // Rewrite the line; \033[K clears what a longer previous line left.
    std::fprintf(out_, "\r%s\033[K", text(false).c_str());
    pending_newline_ = true;
  } else {
    std::fprintf(out_, "%s\n", text(false).c_str());
  }
  std::fflush(out_);
}

void ProgressLine::finish() {
  if (finished_) return;
  finished_ = true;
  if (!out_) return;
  if (live_) std::fprintf(out_, "\r%s\033[K\n", text(true).c_str());
  else std::fprintf(out_, "%s\n", text(true).c_str());
  pending_newline_ = false;
  std::fflush(out_);
}

int64_t periodic_events_left(int64_t from, int64_t to, int64_t every) {
  if (to <= from) return 0;
  int64_t n = 1;  // at `to`
  if (every > 0) n += (to - 1) / every - from / every;
  return n;
}

double TrainingEta::seconds_left(int64_t steps_left, int64_t validations_left, int64_t checkpoints_left) const {
  if (steps_ == 0) return NAN;
  const double per_step = step_seconds_ / double(steps_);
  const double per_validation =
      validation_seconds_ >= 0 ? validation_seconds_
                               : per_step / double(micro_batches_per_step_) / 3.0 * double(batches_per_validation_);
  const double per_checkpoint = checkpoint_seconds_ >= 0 ? checkpoint_seconds_ : 0.0;
  return per_step * double(steps_left) + per_validation * double(validations_left) +
         per_checkpoint * double(checkpoints_left);
}

}  // namespace tuna
