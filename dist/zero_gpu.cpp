#include "dist/zero_gpu.h"

#if TUNA_CUDA

#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"

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

}  // namespace tuna

#endif  // TUNA_CUDA
