// ZeRO stages 0-3 over the dp group; see zero.h for what each stage keeps and when it communicates.
#include "dist/zero.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/memory.h"
#include "model/memory_plan.h"  // zero_buffer_sizes

namespace tuna {

namespace {

template <typename T>
int64_t bytes_of(const std::vector<T>& v) {
  return static_cast<int64_t>(v.capacity() * sizeof(T));
}

}  // namespace

ZeroParams model_parameters(Llama& model) {
  return {&model.layout(), &model.params, &model.grads, [&model](WeightStore* store) { model.set_weight_store(store); }};
}

ZeroParams lora_parameters(Llama& model) {
  TUNA_CHECK(model.lora().enabled(), "a model without LoRA adapters");
  return {&model.lora_layout().params, &model.lora_params, &model.lora_grads,
          [&model](WeightStore* store) { model.set_lora_store(store); }};
}

Zero::Zero(Llama& model, const OptimizerConfig& opt, int stage, Comm& dp, Comm* tp, Comm* pp)
    : Zero(model_parameters(model), opt, stage, dp, tp, pp) {}

Zero::Zero(const ZeroParams& what, const OptimizerConfig& opt, int stage, Comm& dp, Comm* tp, Comm* pp)
    : params_(*what.params),
      grads_(*what.grads),
      layout_(*what.layout),
      stage_(stage),
      dp_(dp),
      tp_(tp && tp->size() > 1 ? tp : nullptr),
      pp_(pp && pp->size() > 1 ? pp : nullptr),
      segments_(dp_unit_pieces(*what.layout, dp.rank(), dp.size())),
      optimizer_(stage >= 1 ? AdamW(*what.layout, opt, segments_) : AdamW(*what.layout, opt)) {
  // The stages this class runs; the engines ask the support table (model/support.h) before they build one.
  TUNA_CHECK(stage >= 0 && stage <= 3 && !(stage == 3 && pp_), "ZeRO stage ", stage, pp_ ? " over pipeline stages" : "");
  TUNA_CHECK(params_.empty() == (stage == 3) && grads_.empty() == (stage >= 2),
             "stage 3 needs a model built with external weights, stage 2 with external gradients, others neither");
  for (const Segment& s : segments_) unit_shard_offset_.push_back(shard_size_), shard_size_ += s.size;
  for (int u = 0; u < layout_.num_units(); u++)
    max_unit_ = std::max(max_unit_, layout_.unit_range(u).second - layout_.unit_range(u).first);
  // Stages 1-2 keep whole fp32 weights in the model, which are the master weights: the update writes this
  // rank's pieces in place and an in-place all-gather brings the others' (no second copy of the shard). Stage 1
  // updates from the all-reduced whole gradient in place too; stages 2-3 own a gradient shard.
  if (stage_ >= 2)
    allocate_host(str("ZeRO-", stage_, "'s gradient shard (", shard_size_, " parameters, fp32)"),
                  uint64_t(shard_size_) * sizeof(float), [&] { grad_shard_.assign(shard_size_, 0.0f); });
  if (stage_ == 3) sharded_ = std::make_unique<ShardedWeights>(layout_, dp_);
  if (stage_ >= 2) {
    scatter_out_.resize(shard_range(max_unit_, 0, dp_.size()).size());
    what.install(this);
  }
  // The memory plan is made of zero_buffer_sizes: an allocation added here without it would make the plan wrong.
  const ZeroBufferSizes planned = zero_buffer_sizes(layout_, stage_, dp_.rank(), dp_.size());
  TUNA_CHECK(planned.shard == shard_size_ && planned.unit == max_unit_ &&
                 planned.master == (sharded_ ? sharded_->shard_size() : 0) &&
                 planned.grad_shard == static_cast<int64_t>(grad_shard_.size()) &&
                 planned.moments == optimizer_.size() &&
                 planned.scatter_out == static_cast<int64_t>(scatter_out_.size()) &&
                 planned.weight_buffers == (sharded_ ? sharded_->buffers() : 0),
             "Zero's buffers differ from zero_buffer_sizes (update it with the constructor)");
}

void Zero::begin_step() {
  if (stage_ >= 2) std::fill(grad_shard_.begin(), grad_shard_.end(), 0.0f);
  else std::fill(grads_.begin(), grads_.end(), 0.0f);
}

LossSum sum_over_ranks(Comm& dp, const LossSum& local) {
  double both[2] = {local.sum, static_cast<double>(local.count)};
  dp.all_reduce_sum(both, 2, "loss and token count");
  return {both[0], static_cast<int64_t>(std::llround(both[1]))};
}

LossSum Zero::all_reduce_loss(const LossSum& local) {
  const LossSum over_dp = sum_over_ranks(dp_, local);
  return pp_ ? sum_over_ranks(*pp_, over_dp) : over_dp;  // the stages before the last add nothing
}

double Zero::global_norm(const float* grads, BufferOrder order) {
  const bool count_replicated = !tp_ || tp_->rank() == 0;
  double sq = optimizer_.grad_sum_of_squares(grads, count_replicated, order);
  if (stage_ >= 1) dp_.all_reduce_sum(&sq, 1, "grad norm (dp)");
  if (tp_) tp_->all_reduce_sum(&sq, 1, "grad norm (tp)");
  if (pp_) pp_->all_reduce_sum(&sq, 1, "grad norm (pp)");
  return std::sqrt(sq);
}

StepResult Zero::finish_step(const LossSum& local, double lr) {
  StepResult r;
  const LossSum total = all_reduce_loss(local);
  r.tokens = total.count;
  r.loss = total.count ? total.sum / total.count : NAN;
  // Mean over every trained token of the step; a step of only ignored targets changes nothing.
  const double loss_scale = total.count ? 1.0 / total.count : 0.0;

  float* grads = nullptr;
  float* params = nullptr;
  // Stage 0's optimizer owns the whole layout, where shard order is the flat order.
  BufferOrder params_order = BufferOrder::Shard, grads_order = BufferOrder::Shard;
  switch (stage_) {
    case 0:
      dp_.all_reduce_sum(grads_.data(), layout_.total(), "gradients");
      grads = grads_.data(), params = params_.data();
      break;
    case 1:  // this rank's pieces of the reduced gradient and of the weights, in place
      dp_.all_reduce_sum(grads_.data(), layout_.total(), "gradients");
      grads = grads_.data(), params = params_.data();
      params_order = grads_order = BufferOrder::Flat;
      break;
    case 2:  // already reduce-scattered, unit by unit, during the backward
      grads = grad_shard_.data(), params = params_.data();
      params_order = BufferOrder::Flat;
      break;
    case 3:  // as stage 2
      grads = grad_shard_.data(), params = sharded_->shard();
      sharded_->wait_pending();  // no gather may still read the weights the update rewrites
      break;
  }
  r.stats.grad_norm = global_norm(grads, grads_order) * loss_scale;
  r.stats.clip_scale = clip_scale(optimizer_.config(), r.stats.grad_norm);
  // Not finite: no update, and the weights (hence any gathered copy of them) stay as they are.
  r.stats.applied = step_is_finite(r.loss, r.tokens, r.stats.grad_norm);
  if (!r.stats.applied) return r;
  optimizer_.update(params, grads, loss_scale * r.stats.clip_scale, lr, params_order, grads_order);
  if (stage_ == 1 || stage_ == 2) gather_params_in_place();
  if (stage_ == 3) sharded_->invalidate();  // gathered weights are stale now
  return r;
}

void Zero::gather_params_in_place() {
  for (int u = 0; u < layout_.num_units(); u++) {
    const auto [begin, end] = layout_.unit_range(u);
    dp_.all_gather(params_.data() + segments_[u].begin, params_.data() + begin, end - begin, "weights of a unit");
  }
}

void Zero::export_state(const std::function<void(size_t, const float*, const float*, const float*)>& sink) const {
  for (size_t i = 0; i < segments_.size(); i++) {
    const int64_t at = unit_shard_offset_[i], begin = segments_[i].begin;
    // Stages 0-2 hold whole weights (stage 0 whole moments too): this rank hands out its piece of them, in place.
    const int64_t moments_at = stage_ == 0 ? begin : at;
    sink(i, stage_ == 3 ? sharded_->shard() + at : params_.data() + begin, optimizer_.m.data() + moments_at,
         optimizer_.v.data() + moments_at);
  }
}

void Zero::import_state(const std::function<void(size_t, float*, float*, float*)>& source) {
  if (stage_ == 3) sharded_->wait_pending();
  if (stage_ >= 1) {
    // Each piece in place: stage 3's into its master shard, stages 1-2's into their piece of the whole weights.
    for (size_t i = 0; i < segments_.size(); i++) {
      const int64_t at = unit_shard_offset_[i], begin = segments_[i].begin;
      source(i, stage_ == 3 ? sharded_->shard() + at : params_.data() + begin, optimizer_.m.data() + at,
             optimizer_.v.data() + at);
    }
    if (stage_ == 3) {
      sharded_->invalidate();
    } else {
      gather_params_in_place();  // everyone's pieces
    }
    return;
  }
  // Stage 0 keeps whole copies: each rank reads its piece in place, then every unit is gathered in place.
  for (size_t i = 0; i < segments_.size(); i++) {
    const int64_t begin = segments_[i].begin;
    source(i, params_.data() + begin, optimizer_.m.data() + begin, optimizer_.v.data() + begin);
  }
  for (int u = 0; u < layout_.num_units(); u++) {
    const auto [begin, end] = layout_.unit_range(u);
    const int64_t mine = segments_[u].begin;
    dp_.all_gather(params_.data() + mine, params_.data() + begin, end - begin, "checkpoint weights");
    dp_.all_gather(optimizer_.m.data() + mine, optimizer_.m.data() + begin, end - begin, "checkpoint exp_avg");
    dp_.all_gather(optimizer_.v.data() + mine, optimizer_.v.data() + begin, end - begin, "checkpoint exp_avg_sq");
  }
}

void Zero::fill_weights(const std::function<void(const Segment& piece, float* out)>& fill) {
  TUNA_CHECK(stage_ == 3, "stages 0-2 read weights into the model's params");
  sharded_->fill(fill);
}

int64_t Zero::state_bytes() const {
  int64_t bytes = bytes_of(params_) + bytes_of(grads_) + bytes_of(optimizer_.m) + bytes_of(optimizer_.v) +
                  bytes_of(grad_shard_) + bytes_of(scatter_out_) + (sharded_ ? sharded_->bytes() : 0);
  for (const GradBuffer& b : grad_buffers_) bytes += bytes_of(b.data);
  return bytes;
}

// ---- stages 2 and 3: the WeightStore (weights: stage 3 only) ----

void Zero::plan(const std::vector<int>& order) {
  if (sharded_) sharded_->plan(order);
}

const float* Zero::acquire(int unit) {
  if (stage_ == 2) return params_.data() + layout_.unit_range(unit).first;  // whole weights, own gradients
  TUNA_CHECK(stage_ == 3, "acquire outside stages 2-3");
  return sharded_->acquire(unit);
}

void Zero::release(int unit) {
  if (stage_ == 3) sharded_->release(unit);
}

float* Zero::grads(int unit) {
  for (GradBuffer& b : grad_buffers_)
    if (b.unit == unit && b.in_use) return b.data.data();
  GradBuffer* free = nullptr;
  for (GradBuffer& b : grad_buffers_)
    if (!b.in_use) free = &b;
  if (!free) {
    grad_buffers_.emplace_back();
    free = &grad_buffers_.back();
    free->data.resize(max_unit_);
  }
  const auto [begin, end] = layout_.unit_range(unit);
  std::fill_n(free->data.data(), end - begin, 0.0f);
  free->unit = unit;
  free->in_use = true;
  return free->data.data();
}

void Zero::grads_done(int unit) {
  for (GradBuffer& b : grad_buffers_) {
    if (b.unit != unit || !b.in_use) continue;
    const auto [begin, end] = layout_.unit_range(unit);
    dp_.reduce_scatter(b.data.data(), scatter_out_.data(), end - begin, "gradients of a unit");
    float* shard = grad_shard_.data() + unit_shard_offset_[unit];
    for (int64_t i = 0; i < segments_[unit].size; i++) shard[i] += scatter_out_[i];
    b.in_use = false;
    b.unit = -1;
    return;
  }
  TUNA_CHECK(false, "grads_done for unit ", unit, " without grads()");
}

// ---- ShardedWeights ----

ShardedWeights::ShardedWeights(const ParamLayout& layout, Comm& dp)
    : layout_(layout), dp_(dp), segments_(dp_unit_pieces(layout, dp.rank(), dp.size())) {
  int64_t shard = 0;
  for (const Segment& s : segments_) unit_shard_offset_.push_back(shard), shard += s.size;
  for (int u = 0; u < layout_.num_units(); u++)
    max_unit_ = std::max(max_unit_, layout_.unit_range(u).second - layout_.unit_range(u).first);
  allocate_host(str("ZeRO-3's weight shard (", shard, " parameters, fp32) and its two gathered units (",
                    2 * max_unit_, ")"),
                uint64_t(shard + 2 * max_unit_) * sizeof(float), [&] {
                  shard_.assign(shard, 0.0f);
                  buffers_.resize(2);  // the pair: one computing, one arriving
                  for (UnitBuffer& b : buffers_) b.data.resize(max_unit_);
                });
}

void ShardedWeights::fill(const std::function<void(const Segment& piece, float* out)>& fill) {
  wait_pending();
  for (size_t i = 0; i < segments_.size(); i++) fill(segments_[i], shard_.data() + unit_shard_offset_[i]);
  invalidate();
}

void ShardedWeights::wait_pending() {
  for (UnitBuffer& b : buffers_)
    if (b.pending) dp_.wait(b.pending), b.pending = 0;
}

void ShardedWeights::invalidate() {
  for (UnitBuffer& b : buffers_) b.valid = false;
}

int64_t ShardedWeights::bytes() const {
  int64_t bytes = bytes_of(shard_);
  for (const UnitBuffer& b : buffers_) bytes += bytes_of(b.data);
  return bytes;
}

void ShardedWeights::plan(const std::vector<int>& order) {
  order_ = order;
  order_pos_ = 0;
}

void ShardedWeights::gather_into(UnitBuffer& b, int unit, bool async) {
  const auto [begin, end] = layout_.unit_range(unit);
  const float* piece = shard_.data() + unit_shard_offset_[unit];
  b.unit = unit;
  b.valid = true;  // once the request (if any) completes
  if (async) b.pending = dp_.all_gather_start(piece, b.data.data(), end - begin, "prefetch of a unit's weights");
  else dp_.all_gather(piece, b.data.data(), end - begin, "weights of a unit");
}

// Starts gathering the unit that the plan acquires next into a free buffer, if one is free and the unit
// is not already there.
void ShardedWeights::prefetch_next() {
  if (!prefetch_ || order_pos_ >= order_.size()) return;
  const int next = order_[order_pos_];
  for (const UnitBuffer& b : buffers_)
    if (b.unit == next && b.valid) return;
  for (UnitBuffer& b : buffers_)
    if (!b.in_use && b.pending == 0) return gather_into(b, next, /*async=*/true);
}

const float* ShardedWeights::acquire(int unit) {
  // Follow the plan (a unit off-plan still works, it just was not prefetched).
  while (order_pos_ < order_.size() && order_[order_pos_] != unit) order_pos_++;
  if (order_pos_ < order_.size()) order_pos_++;
  UnitBuffer* found = nullptr;
  for (UnitBuffer& b : buffers_)
    if (b.unit == unit && b.valid) found = &b;
  if (!found) {
    // A free buffer, preferring one that does not hold (or receive) the next planned unit.
    const int next = order_pos_ < order_.size() ? order_[order_pos_] : -1;
    for (UnitBuffer& b : buffers_)
      if (!b.in_use && (!found || found->unit == next)) found = &b;
    if (!found) {  // every buffer busy (the tied head holds two): one more, kept for later steps
      buffers_.emplace_back();
      buffers_.back().data.resize(max_unit_);
      found = &buffers_.back();
    }
    if (found->pending) dp_.wait(found->pending), found->pending = 0;
    gather_into(*found, unit, /*async=*/false);
  }
  if (found->pending) dp_.wait(found->pending), found->pending = 0;
  found->in_use = true;
  const float* data = found->data.data();
  prefetch_next();
  return data;
}

void ShardedWeights::release(int unit) {
  for (UnitBuffer& b : buffers_)
    if (b.unit == unit && b.in_use) b.in_use = false;
  prefetch_next();
}

float* ShardedWeights::grads(int unit) {
  fail("sharded weights of unit ", unit, " were asked for a gradient: they are frozen or trained elsewhere");
}

void ShardedWeights::grads_done(int unit) { grads(unit); }

}  // namespace tuna
