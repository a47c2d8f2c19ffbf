#include "core/progress.h"

#include <cmath>
#include <cstdio>

namespace tuna {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", (long long)(s / 3600), (long long)(s % 3600 / 60));
  else std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  return buf;
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

ProgressLine::ProgressLine(std::string label, int64_t total, std::string unit, double interval_seconds)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), interval_(interval_seconds),
      start_(clock::now()), last_(start_) {}

void ProgressLine::update(int64_t done) {
  if (interval_ <= 0) return;
  const auto now = clock::now();
  if (std::chrono::duration<double>(now - last_).count() < interval_) return;
  last_ = now;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double left = done > 0 ? elapsed / double(done) * double(total_ - done) : NAN;
  std::fprintf(stderr, "%s: %lld/%lld %s (%.0f%%), %s, ETA %s\n", label_.c_str(), (long long)done, (long long)total_,
               unit_.c_str(), total_ > 0 ? 100.0 * double(done) / double(total_) : 0.0, format_duration(elapsed).c_str(),
               format_duration(left).c_str());
  std::fflush(stderr);
}

}  // namespace tuna
