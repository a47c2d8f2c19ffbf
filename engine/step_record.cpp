// StepRecord (engine/step_record.h).
#include "engine/step_record.h"

#include <cstdio>

#include "core/error.h"     // str
#include "core/progress.h"  // human_duration

namespace tuna {

namespace {
std::string fixed(double x, int decimals) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, x);
  return buf;
}
}  // namespace

nlohmann::json StepRecord::json() const {
  nlohmann::json r = {{"step", step},          {"loss", loss},          {"lr", lr},
                      {"grad_norm", stats.grad_norm}, {"clip_scale", stats.clip_scale}, {"tokens", tokens},
                      {"tokens_per_s", tokens_per_s}, {"ms_per_step", seconds * 1e3}, {"elapsed_s", elapsed_s},
                      {"eta_s", eta_s}, {"mem_mb", status.host_mb}, {"peak_mem_mb", status.host_peak_mb}};
  if (!stats.applied) r["skipped"] = true, r["skipped_steps"] = skipped_steps;
  if (std::isfinite(mfu)) r["mfu"] = mfu;
  if (std::isfinite(status.gpu_mb)) r["gpu_mem_mb"] = status.gpu_mb, r["gpu_peak_mem_mb"] = status.gpu_peak_mb;
  if (std::isfinite(status.gpu_util)) r["gpu_util"] = status.gpu_util;
  if (std::isfinite(cost)) r["cost"] = cost;
  // A preference step's count is of pairs (its loss is a mean over them), not of tokens.
  if (!preference.empty()) r.erase("tokens"), r["pairs"] = tokens;
  for (const auto& [key, value] : preference.items()) r[key] = value;
  return r;
}

std::string StepRecord::line() const {
  std::string device;
  if (std::isfinite(mfu)) device += str(" | MFU ", fixed(100 * mfu, 1), "%");
  if (std::isfinite(status.gpu_mb))
    device += str(" | gpu mem ", fixed(status.gpu_mb / 1e3, 1), "/", fixed(status.gpu_total_mb / 1e3, 1), " GB (peak ",
                  fixed(status.gpu_peak_mb / 1e3, 1), ")");
  if (std::isfinite(status.gpu_util)) device += str(" | util ", fixed(status.gpu_util, 0), "%");
  const std::string priced = std::isfinite(cost) ? str(" | cost ", fixed(cost, 2)) : "";
  // A step that trains only part of its windows (SFT's loss mask) says how much of it trained.
  // A preference step trains pairs: its reward accuracy and margin (TRL's rewards/*) instead of a token count.
  std::string trained = tokens < window_tokens ? str(" | trained ", tokens, " of ", window_tokens, " tokens") : "";
  if (preference.contains("rewards/accuracies"))
    trained = str(" | ", tokens, " pairs | reward acc ", fixed(preference["rewards/accuracies"].get<double>(), 3),
                  " margin ", fixed(preference["rewards/margins"].get<double>(), 4), " | logps chosen ",
                  fixed(preference["logps/chosen"].get<double>(), 2), " rejected ",
                  fixed(preference["logps/rejected"].get<double>(), 2));
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "step %6lld/%lld | loss %.4f | lr %.3e | grad norm %.3f%s | %.0f tok/s | %.0f ms%s | mem %.0f MB (peak %.0f)%s | ETA %s",
                (long long)step, (long long)total_steps, loss, lr, stats.grad_norm, trained.c_str(), tokens_per_s,
                seconds * 1e3, device.c_str(), status.host_mb, status.host_peak_mb, priced.c_str(),
                human_duration(eta_s).c_str());
  return buf;
}

int64_t attention_span(const int32_t* positions, int64_t n) {
  if (n <= 0) return 0;
  double sum = 0;
  for (int64_t i = 0; i < n; i++) sum += 2.0 * positions[i] + 1.0;
  return std::llround(sum / static_cast<double>(n));
}

}  // namespace tuna
