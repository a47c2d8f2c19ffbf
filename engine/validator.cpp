// Validator (engine/validator.h).
#include "engine/validator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "core/progress.h"  // periodic_events_left

namespace tuna {

Validator::Validator(std::unique_ptr<DataLoader> data, int64_t every, int64_t max_batches)
    : data_(std::move(data)), every_(every), max_batches_(max_batches) {
  if (data_) {
    const LoaderOptions& o = data_->options();
    inputs_.resize(o.micro_batch * o.seq_len), targets_.resize(o.micro_batch * o.seq_len);
    positions_.resize(o.micro_batch * o.seq_len);
  }
}

int64_t Validator::batches() const {
  if (!data_) return 0;
  const int64_t all = static_cast<int64_t>(data_->batches_per_epoch());
  return max_batches_ > 0 ? std::min(max_batches_, all) : all;
}

int64_t Validator::left(int64_t step, int64_t total_steps) const {
  return enabled() ? periodic_events_left(step, total_steps, every_) : 0;
}

Validator::Result Validator::run(Engine& engine, int64_t step) {
  const auto started = std::chrono::steady_clock::now();
  Result r = data_ ? loss(engine, step) : Result{};
  r.step = step, r.has_loss = data_ != nullptr;
  if (tasks_) r.tasks = tasks_->run(engine);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return r;
}

Validator::Result Validator::loss(Engine& engine, int64_t step) {
  const auto started = std::chrono::steady_clock::now();
  if (preference_ && preference_->enabled()) {
    const Preference::Validation v = preference_->validate(engine, *data_, max_batches_, dp_);
    Result r;
    r.step = step, r.loss = v.loss, r.pairs = v.pairs, r.metrics = v.metrics;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return r;
  }
  const LoaderOptions& o = data_->options();
  data_->reset();
  LossSum local;
  for (int64_t b = 0;
       (max_batches_ == 0 || b < max_batches_) && data_->next(inputs_.data(), targets_.data(), positions_.data()); b++) {
    const LossSum l = engine.forward_loss(inputs_.data(), targets_.data(), o.micro_batch, o.seq_len, positions_.data());
    local.sum += l.sum;
    local.count += l.count;
  }
  const LossSum all = engine.all_reduce_loss(local);
  Result r;
  r.step = step, r.tokens = all.count;
  r.loss = all.count ? all.sum / all.count : NAN;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return r;
}

nlohmann::json Validator::Result::record() const {
  nlohmann::json r = {{"step", step}};
  if (has_loss && pairs >= 0) {
    r["val_loss"] = loss, r["val_pairs"] = pairs;
    for (const auto& [key, value] : metrics.items()) r["val_" + key] = value;
  } else if (has_loss) {
    r["val_loss"] = loss, r["val_ppl"] = std::exp(loss), r["val_tokens"] = tokens;
  }
  // --eval_tasks: eval_acc/TASK, eval_acc_norm/TASK (and /all over several tasks), eval_records/TASK.
  for (const McMetrics& m : tasks) {
    r["eval_acc/" + m.task] = m.acc, r["eval_acc_norm/" + m.task] = m.acc_norm;
    r["eval_records/" + m.task] = m.records;
  }
  return r;
}

std::string Validator::Result::line() const {
  std::string out = has_loss ? loss_line() : str("step ", step, " | eval_tasks");
  // Each task's acc and acc_norm and the aggregate's, up to four tasks; beyond, the aggregate alone (build/eval --tasks
  // and metrics.jsonl have every task's).
  const size_t first = tasks.size() <= 5 ? 0 : tasks.size() - 1;
  for (size_t i = first; i < tasks.size(); i++) {
    char buf[200];
    std::snprintf(buf, sizeof buf, " | %s acc %.4f acc_norm %.4f", tasks[i].task.c_str(), tasks[i].acc, tasks[i].acc_norm);
    out += buf;
  }
  return out;
}

std::string Validator::Result::loss_line() const {
  char buf[256];
  if (pairs >= 0) {
    const auto m = [&](const char* key) { return metrics.contains(key) ? metrics[key].get<double>() : NAN; };
    std::snprintf(buf, sizeof buf,
                  "step %6lld | val loss %.4f | reward accuracy %.3f | margin %.4f | chosen %.4f | rejected %.4f | %lld pairs",
                  (long long)step, loss, m("rewards/accuracies"), m("rewards/margins"), m("rewards/chosen"),
                  m("rewards/rejected"), (long long)pairs);
    return buf;
  }
  std::snprintf(buf, sizeof buf, "step %6lld | val loss %.4f | val ppl %.2f | %lld tokens", (long long)step, loss,
                std::exp(loss), (long long)tokens);
  return buf;
}

}  // namespace tuna
