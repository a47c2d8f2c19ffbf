#include "dist/zero_gpu.h"

#if TUNA_CUDA

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/adamw.cuh"  // adamw_update, f32_to_bf16, sum_of_squares

namespace tuna {

OptimizerShard::OptimizerShard(DeviceArena& arena, const ParamLayout& layout, const std::vector<Segment>& segments,
                               bool bf16_moments, bool with_bf16_weights, const std::string& name_prefix)
    : pieces(shard_pieces(layout, segments)), bf16_moments_(bf16_moments) {
  for (const Segment& seg : segments) unit_offset.push_back(size), size += seg.size;
  padded = (size + 3) / 4 * 4;  // the fused AdamW takes 4 elements per thread; the tail stays 0
  const AdamWTable table = adamw_table(layout, segments);
  n_segments = static_cast<int>(table.starts.size());
  const std::string& p = name_prefix;
  master = arena.take<float>(p + "fp32 master weights (shard)", padded);
  grad = arena.take<float>(p + "fp32 gradients (shard)", padded);
  const int64_t moment_bytes = bf16_moments ? 2 : 4;
  m = arena.take<char>(p + "AdamW m (shard)", padded * moment_bytes);
  v = arena.take<char>(p + "AdamW v (shard)", padded * moment_bytes);
  table_starts = arena.take<int64_t>(p + "AdamW segment starts (shard)", n_segments);
  table_decays = arena.take<uint8_t>(p + "AdamW segment decays (shard)", n_segments);
  if (with_bf16_weights) weights = arena.take<__nv_bfloat16>(p + "bf16 weights (shard)", padded);
  norm_scratch = arena.take<double>("gradient norm scratch", cuda::sum_of_squares_scratch_doubles());
  norm_total = arena.take<double>("gradient norm", 1);
  if (layout.tp().tp_size > 1)
    replicated_norms =
        arena.take<double>("replicated gradient norms", std::max<int64_t>(1, replicated_piece_count(pieces)));
  for (void* p : {static_cast<void*>(master), static_cast<void*>(grad)})
    TUNA_CUDA_CHECK(cudaMemset(p, 0, padded * sizeof(float)));
  for (void* p : {m, v}) TUNA_CUDA_CHECK(cudaMemset(p, 0, padded * moment_bytes));
  if (weights != nullptr) TUNA_CUDA_CHECK(cudaMemset(weights, 0, padded * sizeof(__nv_bfloat16)));
  TUNA_CUDA_CHECK(cudaMemcpy(table_starts, table.starts.data(), table.starts.size() * sizeof(int64_t),
                             cudaMemcpyHostToDevice));
  TUNA_CUDA_CHECK(cudaMemcpy(table_decays, table.decays.data(), table.decays.size(), cudaMemcpyHostToDevice));
  TUNA_CUDA_CHECK(cudaDeviceSynchronize());
}

FrozenShard::FrozenShard(DeviceArena& arena, const ParamLayout& layout, const std::vector<Segment>& segments) {
  TUNA_CHECK(static_cast<int>(segments.size()) == layout.num_units(), segments.size(), " pieces of ",
             layout.num_units(), " units");
  for (const Segment& seg : segments) unit_offset.push_back(size), size += seg.size;
  weights = arena.take<__nv_bfloat16>("bf16 base weights (frozen, shard)", size);
  TUNA_CUDA_CHECK(cudaMemset(weights, 0, size * sizeof(__nv_bfloat16)));
  // cudaMemset runs on the legacy default stream, which the engine's streams (cudaStreamNonBlocking) do not wait for:
  // done before the fill's copies on the compute stream.
  TUNA_CUDA_CHECK(cudaDeviceSynchronize());
}

StreamEvent::StreamEvent() { TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
StreamEvent::~StreamEvent() {
  if (event_) cudaEventDestroy(event_);
}
void StreamEvent::record(cudaStream_t on) { TUNA_CUDA_CHECK(cudaEventRecord(event_, on)); }
void StreamEvent::wait(cudaStream_t by) const { TUNA_CUDA_CHECK(cudaStreamWaitEvent(by, event_, 0)); }

void join(cudaStream_t waiter, cudaStream_t producer, StreamEvent& event) {
  event.record(producer);
  event.wait(waiter);
}

ShardedStore::ShardedStore(LlamaGpu& model, OptimizerShard& shard, const std::vector<Segment>& segments,
                           Comm* dp_device, cudaStream_t comm_stream, int stage, bool prefetch, bool adapters)
    : model_(model), layout_(adapters ? model.trained_layout() : model.layout()),
      whole_(adapters ? model.adapter_params() : model.params()), shard_(&shard), shard_weights_(shard.weights),
      unit_offset_(shard.unit_offset), segments_(segments), dp_(dp_device), comm_(comm_stream),
      compute_(model.stream()), stage_(stage), prefetch_(prefetch) {
  TUNA_CHECK(!adapters || (stage == 2 && model.has_adapters()), "an adapter store is ZeRO-2's (stage ", stage, ")");
  // A tied head keeps the embedding's gradient open through the head's backward; adapters have no such unit.
  const bool tied = !adapters && layout_.lm_head_unit() == 0;
  for (int u = 0; u < layout_.num_units(); u++)
    max_unit_ = std::max(max_unit_, layout_.unit_range(u).second - layout_.unit_range(u).first);
  DeviceArena& arena = model.arena();
  // The buffers of the memory plan (model/memory_plan_gpu.cpp), as many as it planned.
  const std::string prefix = adapters ? "LoRA " : "";
  for (int i = 0; i < (tied ? 3 : 2); i++)
    gradients_.emplace_back().data = arena.take<float>(str(prefix, "gradient buffer ", i), max_unit_);
  if (dp_ != nullptr) {
    int64_t largest_piece = 0;
    for (const Segment& s : segments_) largest_piece = std::max(largest_piece, s.size);
    scatter_out_ = arena.take<float>(prefix + "reduce-scatter output", largest_piece);
  }
  if (stage_ == 3)
    for (int i = 0; i < (prefetch || tied ? 2 : 1); i++)
      gathered_.emplace_back().data = arena.take<__nv_bfloat16>(str("weight gather buffer ", i), max_unit_);
  shard_written_.assign(layout_.num_units(), true);  // the shard starts zeroed (OptimizerShard)
  if (adapters) model.set_adapter_grad_store(this);
  else model.set_weight_store(this);
}

ShardedStore::ShardedStore(LlamaGpu& model, const FrozenShard& base, const std::vector<Segment>& segments,
                           Comm* dp_device, cudaStream_t comm_stream, bool prefetch)
    : model_(model), layout_(model.layout()), whole_(nullptr), shard_(nullptr), shard_weights_(base.weights),
      unit_offset_(base.unit_offset), segments_(segments), dp_(dp_device), comm_(comm_stream),
      compute_(model.stream()), stage_(3), prefetch_(prefetch) {
  TUNA_CHECK(model.has_adapters(), "a frozen base store is for a model with adapters");
  const bool tied = layout_.lm_head_unit() == 0;  // the head reads the embedding's unit and its own at once
  for (int u = 0; u < layout_.num_units(); u++)
    max_unit_ = std::max(max_unit_, layout_.unit_range(u).second - layout_.unit_range(u).first);
  for (int i = 0; i < (prefetch || tied ? 2 : 1); i++)
    gathered_.emplace_back().data = model.arena().take<__nv_bfloat16>(str("base gather buffer ", i), max_unit_);
  model.set_weight_store(this);
}

void ShardedStore::begin_step() {
  TUNA_CHECK(shard_ != nullptr, "the frozen base has no gradient");
  std::fill(shard_written_.begin(), shard_written_.end(), false);
  join(comm_, compute_, compute_to_comm_);
}

void ShardedStore::gradients_ready() {
  TUNA_CHECK(shard_ != nullptr, "the frozen base has no gradient");
  for (int u = 0; u < layout_.num_units(); u++)
    if (!shard_written_[u])
      TUNA_CUDA_CHECK(
          cudaMemsetAsync(shard_->grad + unit_offset_[u], 0, segments_[u].size * sizeof(float), comm_));
  join(compute_, comm_, comm_to_compute_);
}

void ShardedStore::weights_updated() {
  // The model's weights (ZeRO-2's whole copy, ZeRO-3's shard: params() null), not the adapters': with --fp8 the model
  // casts them again at their next use.
  if (whole_ == model_.params()) model_.weights_changed();
  join(comm_, compute_, compute_to_comm_);
  for (Gathered& b : gathered_) {
    TUNA_CHECK(!b.in_use, "unit ", b.unit, " still acquired at the update");
    b.unit = -1;
  }
  if (stage_ != 2) return;
  for (int u = 0; u < layout_.num_units(); u++)
    gather(u, whole_ + layout_.unit_range(u).first, "weights of a unit");
  join(compute_, comm_, comm_to_compute_);
}

void ShardedStore::plan(const std::vector<int>& order) {
  order_ = order;
  position_ = 0;
}

const __nv_bfloat16* ShardedStore::acquire(int unit) {
  if (stage_ == 2) return whole_ + layout_.unit_range(unit).first;
  // Follow the plan (a unit off the plan still works: it just was not prefetched).
  while (position_ < order_.size() && order_[position_] != unit) position_++;
  if (position_ < order_.size()) position_++;
  Gathered* found = nullptr;
  for (Gathered& b : gathered_)
    if (b.unit == unit) found = &b;
  if (found == nullptr) {
    // A free buffer, preferring one that does not hold the next planned unit.
    const int next = position_ < order_.size() ? order_[position_] : -1;
    for (Gathered& b : gathered_)
      if (!b.in_use && (found == nullptr || found->unit == next)) found = &b;
    TUNA_CHECK(found != nullptr, "ZeRO-3: every gather buffer is in use when unit ", unit, " is acquired");
    gather_into(*found, unit);
  }
  found->ready.wait(compute_);
  found->in_use = true;
  prefetch_next();
  return found->data;
}

void ShardedStore::release(int unit) {
  if (stage_ == 2) return;
  for (Gathered& b : gathered_)
    if (b.unit == unit && b.in_use) {
      b.released.record(compute_);  // a later gather into b waits for the compute that read it
      b.in_use = false;
    }
  prefetch_next();
}

GpuWeightStore::UnitGrads ShardedStore::grads(int unit) {
  TUNA_CHECK(shard_ != nullptr, "the frozen base has no gradient (unit ", unit, ")");
  for (Gradient& b : gradients_)
    if (b.unit == unit) return {b.data, /*fresh=*/true};
  Gradient* free = nullptr;
  for (Gradient& b : gradients_)  // the least recently drained free buffer
    if (b.unit < 0 && (free == nullptr || b.last_use < free->last_use)) free = &b;
  TUNA_CHECK(free != nullptr, "ZeRO-", stage_, ": every gradient buffer is in use when unit ", unit, " needs one");
  free->drained.wait(compute_);  // its last reduce-scatter has read it
  free->unit = unit;
  free->last_use = ++uses_;
  return {free->data, /*fresh=*/true};
}

void ShardedStore::grads_done(int unit) {
  for (Gradient& b : gradients_) {
    if (b.unit != unit) continue;
    join(comm_, compute_, b.filled);
    const auto [begin, end] = layout_.unit_range(unit);
    float* piece = shard_->grad + unit_offset_[unit];
    const int64_t piece_size = segments_[unit].size;
    // This rank's piece of the sum over dp: written into the shard by the step's first micro-batch, added to it
    // by the others (the same fp32 sum as ZeRO-0's, whose first GEMM overwrites and the next add).
    if (!shard_written_[unit]) {
      if (dp_ != nullptr)
        dp_->reduce_scatter(b.data, piece, end - begin, "gradients of a unit");
      else
        TUNA_CUDA_CHECK(
            cudaMemcpyAsync(piece, b.data, piece_size * sizeof(float), cudaMemcpyDeviceToDevice, comm_));
      shard_written_[unit] = true;
    } else if (dp_ != nullptr) {
      dp_->reduce_scatter(b.data, scatter_out_, end - begin, "gradients of a unit");
      cuda::accumulate(piece, scatter_out_, piece_size, comm_);
    } else {
      cuda::accumulate(piece, b.data, piece_size, comm_);
    }
    b.drained.record(comm_);
    b.unit = -1;
    return;
  }
  TUNA_CHECK(false, "grads_done for unit ", unit, " without grads()");
}

void ShardedStore::gather(int unit, __nv_bfloat16* dst, const char* what) {
  const auto [begin, end] = layout_.unit_range(unit);
  const __nv_bfloat16* piece = shard_weights_ + unit_offset_[unit];
  if (dp_ != nullptr)
    dp_->all_gather(piece, dst, end - begin, CommType::BF16, what);
  else
    TUNA_CUDA_CHECK(cudaMemcpyAsync(dst, piece, (end - begin) * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice,
                                    comm_));
}

void ShardedStore::gather_into(Gathered& b, int unit) {
  b.released.wait(comm_);  // the compute that last read the buffer is done
  gather(unit, b.data, "weights of a unit");
  b.ready.record(comm_);
  b.unit = unit;
}

void ShardedStore::prefetch_next() {
  if (!prefetch_ || position_ >= order_.size()) return;
  const int next = order_[position_];
  for (const Gathered& b : gathered_)
    if (b.unit == next) return;
  for (Gathered& b : gathered_)
    if (!b.in_use) return gather_into(b, next);
}

namespace {

// The host buffers of a checkpoint exchange: one piece (the largest of `segments`) of the weights and both
// moments, and its bf16 bits for a moment's device copy.
struct StateStaging {
  explicit StateStaging(const std::vector<Segment>& segments) {
    int64_t largest = 0;
    for (const Segment& s : segments) largest = std::max(largest, s.size);
    p.resize(largest), m.resize(largest), v.resize(largest), bits.resize(largest);
  }
  std::vector<float> p, m, v;
  std::vector<uint16_t> bits;
};

}  // namespace

ZeroGpu::ZeroGpu(LlamaGpu& model, const ZeroGpuOptions& options, const Mesh& mesh, Comm* dp_device,
                 cudaStream_t comm_stream)
    : model_(model),
      options_(options),
      mesh_(mesh),
      dp_device_(dp_device),
      segments_(dp_unit_pieces(model.trained_layout(), mesh.dp_rank, mesh.dp_size)) {
  const bool adapters = model_.has_adapters();
  const int stage = options_.stage;
  if (stage >= 1)
    shard_ = std::make_unique<OptimizerShard>(model_.arena(), model_.trained_layout(), segments_,
                                              options_.bf16_moments, stage >= 2, adapters ? "LoRA " : "");
  if (stage >= 2)
    store_ = std::make_unique<ShardedStore>(model_, *shard_, segments_, dp_device_, comm_stream, adapters ? 2 : stage,
                                            options_.prefetch, adapters);
  if (adapters && stage == 3) {
    base_segments_ = dp_unit_pieces(model_.layout(), mesh.dp_rank, mesh.dp_size);
    base_shard_ = std::make_unique<FrozenShard>(model_.arena(), model_.layout(), base_segments_);
    base_store_ = std::make_unique<ShardedStore>(model_, *base_shard_, base_segments_, dp_device_, comm_stream,
                                                 options_.prefetch);
  }
}

void ZeroGpu::begin_step() {
  if (store_) store_->begin_step();
  else model_.zero_grads();
}

// Over dp, then over the stages (the stages before the last add nothing), as Zero sums it on cpu.
LossSum ZeroGpu::all_reduce_loss(const LossSum& local) {
  const LossSum over_dp = sum_over_ranks(*mesh_.dp, local);
  return mesh_.pp_size > 1 ? sum_over_ranks(*mesh_.pp, over_dp) : over_dp;
}

StepResult ZeroGpu::finish_step(const LossSum& local, double lr) {
  StepResult r;
  const LossSum total = all_reduce_loss(local);
  r.tokens = total.count;
  r.loss = total.count ? total.sum / total.count : NAN;
  // Mean over every trained token of the step; a step of only ignored targets changes nothing but decay.
  const double loss_scale = total.count ? 1.0 / total.count : 0.0;
  const bool loss_is_finite = step_is_finite(r.loss, r.tokens, 0.0);
  if (shard_) {
    r.stats = sharded_update(loss_scale, lr, loss_is_finite);
    return r;
  }
  if (dp_device_) {
    dp_device_->all_reduce(model_.grads(), model_.trained_layout().total(), CommType::F32, ReduceOp::Sum,
                           "gradients");
    dp_device_->barrier("gradients all-reduced");  // a bounded wait (--comm_timeout) instead of a blind sync
  }
  r.stats = model_.adamw_step(loss_scale, lr, loss_is_finite);
  return r;
}

// A piece at a time through one host buffer of the largest piece (weights and both moments): a rank never holds
// its shard on the host. ZeRO-0 hands out this rank's piece of each unit of its whole copy, ZeRO 1-3 its shard.
void ZeroGpu::export_state(const StateSink& sink) const {
  const LlamaGpu& model = model_;
  StateStaging host(segments_);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(model.stream()));
  for (size_t i = 0; i < segments_.size(); i++) {
    const int64_t at = shard_ ? shard_->unit_offset[i] : segments_[i].begin, n = segments_[i].size;
    const float* master = shard_ ? shard_->master : model.master_params();
    const void* moments[2] = {shard_ ? shard_->m : model.moment_m(), shard_ ? shard_->v : model.moment_v()};
    TUNA_CUDA_CHECK(cudaMemcpy(host.p.data(), master + at, n * sizeof(float), cudaMemcpyDeviceToHost));
    for (int k = 0; k < 2; k++) {
      float* dst = k == 0 ? host.m.data() : host.v.data();
      if (!model.bf16_moments()) {
        TUNA_CUDA_CHECK(cudaMemcpy(dst, static_cast<const float*>(moments[k]) + at, n * sizeof(float),
                                   cudaMemcpyDeviceToHost));
        continue;
      }
      TUNA_CUDA_CHECK(cudaMemcpy(host.bits.data(), static_cast<const uint16_t*>(moments[k]) + at,
                                 n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
      convert_to_f32(host.bits.data(), DType::BF16, dst, n);
    }
    sink(i, host.p.data(), host.m.data(), host.v.data());
  }
}

// The reverse, a piece at a time: each piece goes to its place (ZeRO-0: this rank's piece of each unit in the
// whole copy, ZeRO 1-3: the shard); bf16 moments are rounded to nearest on the device through the (unused
// between steps) fp32 gradients. ZeRO-0 with dp then gathers every unit in place; then the copies the stage
// keeps are made.
void ZeroGpu::import_state(const StateSource& source) {
  cudaStream_t stream = model_.stream();
  StateStaging host(segments_);
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
  float* master = shard_ ? shard_->master : model_.master_params();
  void* moments[2] = {shard_ ? shard_->m : model_.moment_m(), shard_ ? shard_->v : model_.moment_v()};
  float* staging = shard_ ? shard_->grad : model_.grads();  // fp32, the shard's (or the model's) size
  const bool bf16 = model_.bf16_moments();
  for (size_t i = 0; i < segments_.size(); i++) {
    const int64_t at = shard_ ? shard_->unit_offset[i] : segments_[i].begin, n = segments_[i].size;
    source(i, host.p.data(), host.m.data(), host.v.data());
    TUNA_CUDA_CHECK(cudaMemcpyAsync(master + at, host.p.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream));
    for (int k = 0; k < 2; k++) {
      const float* src = k == 0 ? host.m.data() : host.v.data();
      if (!bf16) {
        TUNA_CUDA_CHECK(cudaMemcpyAsync(static_cast<float*>(moments[k]) + at, src, n * sizeof(float),
                                        cudaMemcpyHostToDevice, stream));
        continue;
      }
      TUNA_CUDA_CHECK(cudaMemcpyAsync(staging + at, src, n * sizeof(float), cudaMemcpyHostToDevice, stream));
      cuda::f32_to_bf16(static_cast<__nv_bfloat16*>(moments[k]) + at, staging + at, n, stream);
    }
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));  // the host buffers are refilled next
  }
  if (shard_) {
    TUNA_CUDA_CHECK(cudaMemsetAsync(shard_->grad, 0, shard_->padded * sizeof(float), stream));
    if (store_) return refresh_shard_weights();
    return gather_master();
  }
  if (dp_device_) {  // every rank holds everything (ZeRO-0): gather the pieces of each unit in place
    const ParamLayout& layout = model_.trained_layout();
    const CommType moment_type = bf16 ? CommType::BF16 : CommType::F32;
    const int64_t moment_bytes = bf16 ? 2 : 4;
    for (int u = 0; u < layout.num_units(); u++) {
      const auto [begin, end] = layout.unit_range(u);
      if (begin == end) continue;  // another pipeline stage's unit
      const int64_t mine = segments_[u].begin;
      dp_device_->all_gather(master + mine, master + begin, end - begin, "restored weights of a unit");
      for (void* moment : moments) {
        char* base = static_cast<char*>(moment);
        dp_device_->all_gather(base + mine * moment_bytes, base + begin * moment_bytes, end - begin, moment_type,
                               "restored AdamW moments of a unit");
      }
    }
  }
  model_.refresh_params();
  model_.zero_grads();
  if (dp_device_) dp_device_->barrier("state restored");
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void ZeroGpu::set_steps_taken(int64_t steps) {
  model_.set_steps_taken(steps);
  // Stochastic rounding: the bf16 weights as the update at `steps` rounded them.
  if (store_) return refresh_shard_weights();
  if (shard_) return gather_master();
  model_.refresh_params();
  TUNA_CUDA_CHECK(cudaStreamSynchronize(model_.stream()));
}

// The sharded update of ZeRO 1-3 (see the top of dist/zero_gpu.h). Returns the norm and clip as AdamW::step would;
// no update when the step's loss or the norm is not finite.
OptimizerStats ZeroGpu::sharded_update(double loss_scale, double lr, bool loss_is_finite) {
  OptimizerShard& sh = *shard_;
  const ParamLayout& layout = model_.trained_layout();
  cudaStream_t stream = model_.stream();
  if (store_) {
    store_->gradients_ready();  // ZeRO-2/3: reduce-scattered and accumulated during the backward
  } else {
    for (int u = 0; u < layout.num_units(); u++) {  // this rank's piece of each unit's gradient, summed over dp
      const auto [begin, end] = layout.unit_range(u);
      if (begin == end) continue;  // another pipeline stage's unit
      float* piece = sh.grad + sh.unit_offset[u];
      if (dp_device_) dp_device_->reduce_scatter(model_.grads() + begin, piece, end - begin, "gradients of a unit");
      else
        TUNA_CUDA_CHECK(cudaMemcpyAsync(piece, model_.grads() + segments_[u].begin, segments_[u].size * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream));
    }
  }
  // The norm over the shards: this rank's squares (replicated tensors counted on tp rank 0 only), summed over
  // dp and tp on the host comms (one double each).
  cuda::sum_of_squares(sh.norm_total, sh.grad, sh.size, sh.norm_scratch, stream);
  double sum_sq = 0;
  TUNA_CUDA_CHECK(cudaMemcpyAsync(&sum_sq, sh.norm_total, sizeof(double), cudaMemcpyDeviceToHost, stream));
  if (dp_device_) dp_device_->barrier("gradients reduced");  // a bounded wait (--comm_timeout)
  model_.wait_for_stream("the backward, before the gradient norm is read");  // bounded too, with tp
  if (mesh_.tp_rank > 0) sum_sq -= replicated_sum_of_squares(sh.grad, sh.pieces, sh.replicated_norms, sh.norm_scratch, stream);
  // The last stage's copy of a tied table: the first stage counts it.
  sum_sq -= copy_sum_of_squares(sh.grad, sh.pieces, sh.norm_total, sh.norm_scratch, stream);
  if (mesh_.dp_size > 1) mesh_.dp->all_reduce_sum(&sum_sq, 1, "grad norm (dp)");
  if (mesh_.tp_size > 1) mesh_.tp->all_reduce_sum(&sum_sq, 1, "grad norm (tp)");
  if (mesh_.pp_size > 1) mesh_.pp->all_reduce_sum(&sum_sq, 1, "grad norm (pp)");
  OptimizerStats stats;
  stats.grad_norm = std::sqrt(sum_sq) * loss_scale;
  stats.clip_scale = clip_scale(options_.opt, stats.grad_norm);
  // Not finite: no update; the master shard and the bf16 weights stay as they are (the next step's first
  // writes overwrite the gradients). Decided from the norm already read back above: no extra sync.
  stats.applied = loss_is_finite && std::isfinite(stats.grad_norm);
  if (stats.applied) {
    const int64_t step = model_.steps_taken() + 1;
    const OptimizerConfig& oc = options_.opt;
    const cuda::AdamWArgs args{lr, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, step, loss_scale * stats.clip_scale,
                               options_.gpu.stochastic_rounding, options_.gpu.seed};
    if (sh.bf16_moments())
      cuda::adamw_update(sh.master, sh.weights, sh.grad, static_cast<__nv_bfloat16*>(sh.m),
                         static_cast<__nv_bfloat16*>(sh.v), sh.padded, sh.table(), args, stream);
    else
      cuda::adamw_update(sh.master, sh.weights, sh.grad, static_cast<float*>(sh.m), static_cast<float*>(sh.v),
                         sh.padded, sh.table(), args, stream);
    model_.set_steps_taken(step);
  }
  if (store_) {  // the weight store's step ends the same way, updated or not
    store_->weights_updated();
    if (dp_device_) dp_device_->barrier("weights updated");
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else if (stats.applied) {
    gather_master();
  }
  return stats;
}

// The starting weights a unit at a time through one host buffer of the largest piece this rank fills: ZeRO-0
// fills the whole model (it holds it), ZeRO 1-3 this rank's piece of each unit into the master shard, whose
// bf16 weights are then made as a restore makes them.
void ZeroGpu::fill_weights(const LayoutFill& initial, const LayoutFill& adapters) {
  if (model_.has_adapters()) return fill_base_and_adapters(initial, adapters);
  const ParamLayout& layout = model_.layout();
  std::vector<Segment> pieces = segments_;
  if (!shard_)
    for (int u = 0; u < layout.num_units(); u++)
      pieces[u] = Segment{layout.unit_range(u).first, layout.unit_range(u).second - layout.unit_range(u).first};
  int64_t largest = 0;
  for (const Segment& p : pieces) largest = std::max(largest, p.size);
  std::vector<float> host(largest);
  for (size_t u = 0; u < pieces.size(); u++) {
    if (pieces[u].size == 0) continue;  // another pipeline stage's unit, or an empty piece
    initial(layout, pieces[u], host.data());
    if (!shard_) {
      model_.set_params_piece(pieces[u], host.data());
      continue;
    }
    TUNA_CUDA_CHECK(cudaMemcpyAsync(shard_->master + shard_->unit_offset[u], host.data(), pieces[u].size * sizeof(float),
                                    cudaMemcpyHostToDevice, model_.stream()));
    TUNA_CUDA_CHECK(cudaStreamSynchronize(model_.stream()));  // the host buffer is refilled next
  }
  if (store_) refresh_shard_weights();
  else if (shard_) gather_master();
}

// With adapters: the frozen base whole, a unit at a time, and the adapters (the options', or PEFT's
// initialisation drawn per global tensor, so that every tp and dp layout starts from the same ones): whole at
// ZeRO-0; at ZeRO 1-2 this rank's piece of each unit into the master shard, whose bf16 copy is then made and
// gathered as a restore makes it.
void ZeroGpu::fill_base_and_adapters(const LayoutFill& base, const LayoutFill& adapters) {
  const auto fill = [&](const ParamLayout& layout, const LayoutFill& source, auto&& set) {
    std::vector<float> host;
    for (int u = 0; u < layout.num_units(); u++) {
      const Segment piece{layout.unit_range(u).first, layout.unit_range(u).second - layout.unit_range(u).first};
      if (piece.size == 0) continue;  // another pipeline stage's unit
      host.resize(piece.size);
      source(layout, piece, host.data());
      set(piece, host.data());
    }
  };
  if (base_shard_) fill_base_shard(base);
  else fill(model_.layout(), base, [&](const Segment& p, const float* h) { model_.set_params_piece(p, h); });
  if (!shard_)
    return fill(model_.trained_layout(), adapters,
                [&](const Segment& p, const float* h) { model_.set_adapters_piece(p, h); });
  std::vector<float> host;
  for (size_t u = 0; u < segments_.size(); u++) {
    if (segments_[u].size == 0) continue;  // another pipeline stage's layer, or an empty piece
    host.resize(segments_[u].size);
    adapters(model_.trained_layout(), segments_[u], host.data());
    TUNA_CUDA_CHECK(cudaMemcpyAsync(shard_->master + shard_->unit_offset[u], host.data(),
                                    segments_[u].size * sizeof(float), cudaMemcpyHostToDevice, model_.stream()));
    TUNA_CUDA_CHECK(cudaStreamSynchronize(model_.stream()));  // the host buffer is refilled next
  }
  if (store_) refresh_shard_weights();
  else gather_master();
}

// ZeRO-3 with adapters: this rank's piece of each unit of the frozen base, rounded to nearest on the host (as a
// whole base is), into the base's shard.
void ZeroGpu::fill_base_shard(const LayoutFill& base) {
  std::vector<float> host;
  std::vector<uint16_t> bits;
  for (size_t u = 0; u < base_segments_.size(); u++) {
    const Segment& piece = base_segments_[u];
    host.resize(piece.size), bits.resize(piece.size);
    base(model_.layout(), piece, host.data());
    convert_from_f32(host.data(), DType::BF16, bits.data(), piece.size);
    TUNA_CUDA_CHECK(cudaMemcpyAsync(base_shard_->weights + base_shard_->unit_offset[u], bits.data(),
                                    piece.size * sizeof(uint16_t), cudaMemcpyHostToDevice, model_.stream()));
    TUNA_CUDA_CHECK(cudaStreamSynchronize(model_.stream()));  // the host buffers are refilled next
  }
}

// ZeRO-2/3: the shard's bf16 weights from its fp32 master, rounded as the update at steps_taken() rounded
// them (the shard's positions draw the stochastic bits, as in adamw_update), then handed to the store.
void ZeroGpu::refresh_shard_weights() {
  OptimizerShard& sh = *shard_;
  cudaStream_t stream = model_.stream();
  cuda::AdamWArgs args{};
  args.step = std::max<int64_t>(1, model_.steps_taken());
  args.stochastic_rounding = options_.gpu.stochastic_rounding && model_.steps_taken() > 0;
  args.seed = options_.gpu.seed;
  cuda::bf16_params_as_updated(sh.weights, sh.master, sh.padded, args, stream);
  store_->weights_updated();
  if (dp_device_) dp_device_->barrier("weights restored");
  TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// ZeRO-1: every rank's master pieces, gathered whole into the gradient buffer (free between a step's update and
// the next step), then the bf16 weights from them; the buffer then reads as zero again (zero_grads: the next
// backward overwrites it).
void ZeroGpu::gather_master() {
  OptimizerShard& sh = *shard_;
  const ParamLayout& layout = model_.trained_layout();
  float* whole = model_.grads();
  for (int u = 0; u < layout.num_units(); u++) {
    const auto [begin, end] = layout.unit_range(u);
    if (begin == end) continue;  // another pipeline stage's unit
    if (dp_device_)
      dp_device_->all_gather(sh.master + sh.unit_offset[u], whole + begin, end - begin, "weights of a unit");
    else
      TUNA_CUDA_CHECK(cudaMemcpyAsync(whole + segments_[u].begin, sh.master + sh.unit_offset[u],
                                      segments_[u].size * sizeof(float), cudaMemcpyDeviceToDevice, model_.stream()));
  }
  model_.refresh_params_from(whole);  // rounded as the update at steps_taken() rounds (stochastic rounding too)
  model_.zero_grads();
  if (dp_device_) dp_device_->barrier("weights gathered");
  TUNA_CUDA_CHECK(cudaStreamSynchronize(model_.stream()));
}

}  // namespace tuna

#endif  // TUNA_CUDA
