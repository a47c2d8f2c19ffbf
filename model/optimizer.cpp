#include "model/optimizer.h"

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <numbers>

#include "core/error.h"
#include "core/memory.h"
#include "kernels/cpu/adamw.h"

namespace tuna {

std::string schedule_warning(const OptimizerConfig& c, int64_t total_steps) {
  if (c.warmup_steps < total_steps || total_steps <= 0) return "";
  char peak[32], lr[32];
  std::snprintf(peak, sizeof peak, "%.3g", learning_rate(c, total_steps - 1, total_steps));
  std::snprintf(lr, sizeof lr, "%.3g", c.lr);
  return str("warmup_steps ", c.warmup_steps, " >= steps ", total_steps, ": the learning rate rises for the whole run, "
             "peaks at ", peak, " instead of lr ", lr, " and never decays; give a --warmup_steps below --steps (a few "
             "percent of it is usual)");
}

double learning_rate(const OptimizerConfig& c, int64_t step, int64_t total_steps) {
  if (step < c.warmup_steps) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  const int64_t span = std::max<int64_t>(1, total_steps - c.warmup_steps);
  const double p = std::clamp(static_cast<double>(step - c.warmup_steps) / static_cast<double>(span), 0.0, 1.0);
  if (c.schedule == "constant") return c.lr;
  if (c.schedule == "cosine") return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(std::numbers::pi * p));
  if (c.schedule == "linear") return c.lr + (c.min_lr - c.lr) * p;
  if (c.schedule == "wsd") {
    const int64_t decay_steps = std::max<int64_t>(1, static_cast<int64_t>(std::llround(c.decay_fraction * total_steps)));
    const int64_t decay_start = total_steps - decay_steps;
    if (step < decay_start) return c.lr;
    const double q = std::clamp(static_cast<double>(step - decay_start + 1) / static_cast<double>(decay_steps), 0.0, 1.0);
    return c.lr + (c.min_lr - c.lr) * q;
  }
  fail("option 'schedule': expected cosine, linear, constant or wsd, found '", c.schedule, "'");
}

void validate(const OptimizerConfig& c) {
  if (c.schedule != "cosine" && c.schedule != "linear" && c.schedule != "constant" && c.schedule != "wsd")
    fail("option 'schedule': expected cosine, linear, constant or wsd, found '", c.schedule, "'");
  // Written so that NaN fails every test (a NaN compares false): inf and nan are refused like any bad value.
  if (!(c.lr > 0 && std::isfinite(c.lr))) fail("option 'lr': expected a finite number > 0, found ", c.lr);
  if (!(c.min_lr >= 0 && c.min_lr <= c.lr)) fail("option 'min_lr': expected 0 <= min_lr <= lr, found ", c.min_lr);
  if (c.warmup_steps < 0) fail("option 'warmup_steps': expected >= 0, found ", c.warmup_steps);
  if (!(c.decay_fraction > 0 && c.decay_fraction <= 1))
    fail("option 'decay_fraction': expected in (0, 1], found ", c.decay_fraction);
  if (!(c.beta1 >= 0 && c.beta1 < 1)) fail("option 'beta1': expected in [0, 1), found ", c.beta1);
  if (!(c.beta2 >= 0 && c.beta2 < 1)) fail("option 'beta2': expected in [0, 1), found ", c.beta2);
  if (!(c.eps > 0 && std::isfinite(c.eps))) fail("option 'eps': expected a finite number > 0, found ", c.eps);
  if (!(c.weight_decay >= 0 && std::isfinite(c.weight_decay)))
    fail("option 'weight_decay': expected a finite number >= 0, found ", c.weight_decay);
  if (!(c.grad_clip >= 0 && std::isfinite(c.grad_clip)))
    fail("option 'grad_clip': expected a finite number >= 0 (0 disables), found ", c.grad_clip);
}

bool step_is_finite(double loss, int64_t tokens, double grad_norm) {
  // A step of only ignored targets has no mean loss (NaN by convention, llama.h); its gradient decides alone.
  return (tokens == 0 || std::isfinite(loss)) && std::isfinite(grad_norm);
}

double clip_scale(const OptimizerConfig& c, double grad_norm) {
  return c.grad_clip > 0 ? std::min(1.0, c.grad_clip / (grad_norm + 1e-6)) : 1.0;
}

std::vector<Segment> dp_unit_pieces(const ParamLayout& layout, int dp_rank, int dp_size) {
  std::vector<Segment> out;
  for (int u = 0; u < layout.num_units(); u++) {
    const auto [begin, end] = layout.unit_range(u);
    const Range r = shard_range(end - begin, dp_rank, dp_size);
    out.push_back({begin + r.begin, r.size()});
  }
  return out;
}

std::vector<ShardPiece> shard_pieces(const ParamLayout& layout, const std::vector<Segment>& segments) {
  std::vector<ShardPiece> pieces;
  int64_t shard = 0;
  for (const Segment& s : segments) {
    for (const ParamTensor& t : layout.tensors()) {
      const int64_t begin = std::max(s.begin, t.offset), end = std::min(s.begin + s.size, t.offset + t.numel);
      if (begin < end) pieces.push_back({shard + (begin - s.begin), begin, end - begin, &t});
    }
    shard += s.size;
  }
  return pieces;
}

AdamW::AdamW(const ParamLayout& layout, const OptimizerConfig& config)
    : AdamW(layout, config, {Segment{0, layout.total()}}) {}

AdamW::AdamW(const ParamLayout& layout, const OptimizerConfig& config, std::vector<Segment> segments)
    : layout_(layout), config_(config), segments_(std::move(segments)), pieces_(shard_pieces(layout, segments_)) {
  validate(config_);
  int64_t shard = 0;
  for (const Segment& s : segments_) shard += s.size;
  allocate_host(str("the AdamW moments (", shard, " parameters, fp32)"), uint64_t(shard) * 2 * sizeof(float), [&] {
    m.assign(shard, 0.0f);
    v.assign(shard, 0.0f);
  });
}

OptimizerStats AdamW::step(float* params, const float* grads, double loss_scale, double lr) {
  TUNA_CHECK(size() == layout_.total(), "step() is for an optimizer that owns the whole layout");
  OptimizerStats stats;
  stats.grad_norm = std::sqrt(cpu::sum_of_squares(grads, layout_.total())) * loss_scale;
  stats.clip_scale = clip_scale(config_, stats.grad_norm);
  stats.applied = std::isfinite(stats.grad_norm);
  if (stats.applied) update(params, grads, loss_scale * stats.clip_scale, lr);
  return stats;
}

namespace {
int64_t offset_in(BufferOrder order, const ShardPiece& p) { return order == BufferOrder::Flat ? p.flat_offset : p.shard_offset; }
}  // namespace

double AdamW::grad_sum_of_squares(const float* grads, bool count_replicated, BufferOrder grads_order) const {
  double sum = 0;
  for (const ShardPiece& p : pieces_)
    if ((count_replicated || p.tensor->split_dim >= 0) && !p.tensor->copy)  // another stage counts a copy's
      sum += cpu::sum_of_squares(grads + offset_in(grads_order, p), p.size);
  return sum;
}

void AdamW::update(float* params, const float* grads, double grad_scale, double lr, BufferOrder params_order,
                   BufferOrder grads_order) {
  steps_taken++;
  for (const ShardPiece& p : pieces_) {
    cpu::AdamWStep s{lr, config_.beta1, config_.beta2, config_.eps, p.tensor->decays ? config_.weight_decay : 0.0,
                     steps_taken, grad_scale};
    cpu::adamw_update(params + offset_in(params_order, p), grads + offset_in(grads_order, p), m.data() + p.shard_offset,
                      v.data() + p.shard_offset, p.size, s);
  }
}

}  // namespace tuna
