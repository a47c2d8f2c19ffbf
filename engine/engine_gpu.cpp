// The CUDA engine (engine/engine.h): LlamaGpu on this rank's GPU, data parallel over the device comm (NCCL) as
// ZeRO-0, 1, 2 or 3.
//
// ZeRO-0. A step: forward_backward per micro-batch accumulates fp32 gradients on the device; finish_step sums
// the loss over dp ranks (host comm), all-reduces the gradients on the device comm, then LlamaGpu::adamw_step
// takes the global norm, clips and updates. Every rank then holds the same gradients and applies the same
// update, so the weights stay identical without a broadcast.
//
// ZeRO-1. The fp32 master weights and AdamW moments exist only for this rank's shard (OptimizerShard: its
// piece of every unit, dp_unit_pieces, in shard order), 12 bytes per parameter divided by dp instead of 12;
// the model keeps only its bf16 weights and fp32 gradients. finish_step reduce-scatters each unit's gradient
// into the shard, takes the norm over the shard and sums it over dp, runs the fused AdamW over the shard,
// then all-gathers the updated master pieces into the (by then unused) gradient buffer and rewrites the bf16
// weights from it (with the update's stochastic-rounding bits, so every rank holds the weights ZeRO-0 would).
//
// ZeRO-2 and 3 (ShardedStore, the model's GpuWeightStore). No whole gradient exists: the backward writes each
// unit's gradient into one of a few unit-sized buffers (handed out fresh: the pass's first writes overwrite, so
// none is zeroed), and as soon as the unit's backward is done the buffer is reduce-scattered on a communication
// stream and this rank's piece written into the fp32 gradient shard on the step's first micro-batch, added to it
// on the others (sharded accumulation), while the compute stream goes on with the next unit. ZeRO-3 keeps
// only the bf16 weights of the shard: each unit is all-gathered into a rotating gather buffer on the
// communication stream just before the model uses it, the next unit of the pass gathered into the other buffer
// while this one computes (prefetch), in the forward and again in the backward. Events order the two streams
// (a buffer is regathered only after the compute that read it, and computed on only after its gather), so the
// host never waits inside the pass. The update runs over the shard and writes the shard's bf16 weights, which
// ZeRO-2 gathers whole after the step and ZeRO-3 gathers unit by unit in the next pass.
//
// The clip norm is over the shards (squares summed over this rank's shard, then over dp). At one rank the
// shard is the whole layout in layout order, so every stage computes ZeRO-0's bits.
//
// Checkpoints: each dp rank writes its piece of every unit (dp_unit_pieces, as the CPU ZeRO-0 does). Restoring
// uploads this rank's pieces into the (then unused) gradient buffer, all-gathers each unit on the device, and
// copies the result into the master weights and moments: no rank ever holds the whole state in host memory.
#if TUNA_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/memory.h"
#include "kernels/adamw.cuh"  // f32_to_bf16
#include "model/decode_gpu.h"
#include "engine/engine.h"
#include "model/llama_gpu.h"

namespace tuna {

namespace {

GpuOptions gpu_options(const EngineOptions& o, const Mesh& mesh) {
  GpuOptions g;
  g.zero = o.zero;  // ZeRO 1-3: the engine keeps master and moments, sharded, in the model's arena
  g.zero_prefetch = o.zero_prefetch;
  g.recompute = o.recompute;
  g.dp = mesh.dp_size, g.dp_rank = mesh.dp_rank;
  g.tp = mesh.tp_size, g.tp_rank = mesh.tp_rank;
  g.bf16_moments = o.bf16_moments;
  g.stochastic_rounding = o.stochastic_rounding;
  g.seed = static_cast<uint32_t>(o.seed);
  g.device = o.gpu;
  return g;
}

// Refuses what the CUDA engine does not do yet, before any device memory is touched.
void check_supported(const EngineOptions& o, const Mesh& mesh, bool have_device_comm) {
  if (o.zero < 0 || o.zero > 3) fail("option 'zero': expected 0, 1, 2 or 3, found ", o.zero);
  if ((mesh.dp_size > 1 || mesh.tp_size > 1) && !have_device_comm)
    fail(mesh.dp_size * mesh.tp_size, " ranks (dp ", mesh.dp_size, " x tp ", mesh.tp_size, ") with --device cuda need "
         "NCCL, and this build has none (nccl.h was not found at build time, or NCCL=0)");
  int count = 0;
  TUNA_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (o.gpu < 0 || o.gpu >= count)
    fail("this rank wants GPU ", o.gpu, " (its index among the ranks of its node), but ", count,
         " GPU(s) are visible: launch at most ", count, " ranks per node (mpirun --map-by ppr:", count,
         ":node) or widen CUDA_VISIBLE_DEVICES");
}

// ZeRO-1's state on the device: this rank's shard of the master weights, moments and reduced gradient, in
// shard order, and the fused AdamW's segment table for that order (which tensor, hence which decay, each
// element belongs to). One allocation, made at construction.
class OptimizerShard {
 public:
  // The buffers are the memory plan's "(shard)" items, in the model's arena.
  // with_bf16_weights (ZeRO-2 and 3): the update also writes the bf16 weights of the shard.
  OptimizerShard(DeviceArena& arena, const ParamLayout& layout, const std::vector<Segment>& segments,
                 bool bf16_moments, bool with_bf16_weights)
      : pieces(shard_pieces(layout, segments)), bf16_moments_(bf16_moments) {
    for (const Segment& seg : segments) unit_offset.push_back(size), size += seg.size;
    padded = (size + 3) / 4 * 4;  // the fused AdamW takes 4 elements per thread; the tail stays 0
    const AdamWTable table = adamw_table(layout, segments);
    n_segments = static_cast<int>(table.starts.size());
    master = arena.take<float>("fp32 master weights (shard)", padded);
    grad = arena.take<float>("fp32 gradients (shard)", padded);
    const int64_t moment_bytes = bf16_moments ? 2 : 4;
    m = arena.take<char>("AdamW m (shard)", padded * moment_bytes);
    v = arena.take<char>("AdamW v (shard)", padded * moment_bytes);
    table_starts = arena.take<int64_t>("AdamW segment starts (shard)", n_segments);
    table_decays = arena.take<uint8_t>("AdamW segment decays (shard)", n_segments);
    if (with_bf16_weights) weights = arena.take<__nv_bfloat16>("bf16 weights (shard)", padded);
    norm_scratch = arena.take<double>("gradient norm scratch", cuda::sum_of_squares_scratch_doubles());
    norm_total = arena.take<double>("gradient norm", 1);
    if (layout.tp().tp_size > 1)
      replicated_norms = arena.take<double>("replicated gradient norms", std::max<int64_t>(1, replicated_piece_count(pieces)));
    for (void* p : {static_cast<void*>(master), static_cast<void*>(grad)})
      TUNA_CUDA_CHECK(cudaMemset(p, 0, padded * sizeof(float)));
    for (void* p : {m, v}) TUNA_CUDA_CHECK(cudaMemset(p, 0, padded * moment_bytes));
    if (weights != nullptr) TUNA_CUDA_CHECK(cudaMemset(weights, 0, padded * sizeof(__nv_bfloat16)));
    TUNA_CUDA_CHECK(cudaMemcpy(table_starts, table.starts.data(), table.starts.size() * sizeof(int64_t),
                               cudaMemcpyHostToDevice));
    TUNA_CUDA_CHECK(cudaMemcpy(table_decays, table.decays.data(), table.decays.size(), cudaMemcpyHostToDevice));
    TUNA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  OptimizerShard(const OptimizerShard&) = delete;
  OptimizerShard& operator=(const OptimizerShard&) = delete;

  bool bf16_moments() const { return bf16_moments_; }
  cuda::AdamWSegments table() const { return {table_starts, table_decays, n_segments}; }

  std::vector<ShardPiece> pieces;  // the shard's pieces of each tensor (which are replicated over tp)
  int64_t size = 0, padded = 0;
  std::vector<int64_t> unit_offset;  // where unit u's piece starts in shard order
  float *master = nullptr, *grad = nullptr;
  void *m = nullptr, *v = nullptr;  // float, or __nv_bfloat16 with bf16 moments
  __nv_bfloat16* weights = nullptr;  // ZeRO-2 and 3: the bf16 weights of the shard
  int64_t* table_starts = nullptr;
  uint8_t* table_decays = nullptr;
  int n_segments = 0;
  double *norm_total = nullptr, *norm_scratch = nullptr, *replicated_norms = nullptr;

 private:
  bool bf16_moments_;
};

// An event recorded on one stream and waited on by another: the only way the compute and communication streams
// order each other. Reusable: a wait takes the event's state at the time it is issued.
class StreamEvent {
 public:
  StreamEvent() { TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~StreamEvent() {
    if (event_) cudaEventDestroy(event_);
  }
  StreamEvent(StreamEvent&& other) noexcept : event_(other.event_) { other.event_ = nullptr; }
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;
  void record(cudaStream_t on) { TUNA_CUDA_CHECK(cudaEventRecord(event_, on)); }
  void wait(cudaStream_t by) const { TUNA_CUDA_CHECK(cudaStreamWaitEvent(by, event_, 0)); }

 private:
  cudaEvent_t event_ = nullptr;
};

// `waiter` runs what it is given next only after what `producer` has been given so far.
void join(cudaStream_t waiter, cudaStream_t producer, StreamEvent& event) {
  event.record(producer);
  event.wait(waiter);
}

// ZeRO-2 and 3's weights and gradients for the model, unit by unit (see the top of this file). Gathers,
// reduce-scatters and shard accumulation run on `comm_stream` (where the dp device comm enqueues); the model
// computes on `compute`.
class ShardedStore final : public GpuWeightStore {
 public:
  ShardedStore(LlamaGpu& model, OptimizerShard& shard, const std::vector<Segment>& segments, Comm* dp_device,
               cudaStream_t comm_stream, int stage, bool prefetch)
      : model_(model), layout_(model.layout()), shard_(shard), segments_(segments), dp_(dp_device),
        comm_(comm_stream), compute_(model.stream()), stage_(stage), prefetch_(prefetch) {
    const bool tied = layout_.lm_head_unit() == 0;
    for (int u = 0; u < layout_.num_units(); u++)
      max_unit_ = std::max(max_unit_, layout_.unit_range(u).second - layout_.unit_range(u).first);
    DeviceArena& arena = model.arena();
    // The buffers of the memory plan (model/memory_plan_gpu.cpp), as many as it planned.
    for (int i = 0; i < (tied ? 3 : 2); i++)
      gradients_.emplace_back().data = arena.take<float>(str("gradient buffer ", i), max_unit_);
    if (dp_ != nullptr) {
      int64_t largest_piece = 0;
      for (const Segment& s : segments_) largest_piece = std::max(largest_piece, s.size);
      scatter_out_ = arena.take<float>("reduce-scatter output", largest_piece);
    }
    if (stage_ == 3)
      for (int i = 0; i < (prefetch || tied ? 2 : 1); i++)
        gathered_.emplace_back().data = arena.take<__nv_bfloat16>(str("weight gather buffer ", i), max_unit_);
    shard_written_.assign(layout_.num_units(), true);  // the shard starts zeroed (OptimizerShard)
    model.set_weight_store(this);
  }

  // A step begins: the gradient shard holds nothing of it. Not zeroed: each unit's piece is written by the step's
  // first reduce-scatter of the unit (grads_done), on the comm stream, after what the compute stream did so far.
  void begin_step() {
    std::fill(shard_written_.begin(), shard_written_.end(), false);
    join(comm_, compute_, compute_to_comm_);
  }
  // Every unit's gradient is in the shard: the compute stream may read it. A unit that no backward of the step
  // reached (a step without micro-batches) has a zero gradient.
  void gradients_ready() {
    for (int u = 0; u < layout_.num_units(); u++)
      if (!shard_written_[u])
        TUNA_CUDA_CHECK(
            cudaMemsetAsync(shard_.grad + shard_.unit_offset[u], 0, segments_[u].size * sizeof(float), comm_));
    join(compute_, comm_, comm_to_compute_);
  }
  // The shard's bf16 weights were rewritten (an update, a restore) on the compute stream: ZeRO-2 gathers them
  // into the whole weights; ZeRO-3's gathered units are stale.
  void weights_updated() {
    join(comm_, compute_, compute_to_comm_);
    for (Gathered& b : gathered_) {
      TUNA_CHECK(!b.in_use, "unit ", b.unit, " still acquired at the update");
      b.unit = -1;
    }
    if (stage_ != 2) return;
    for (int u = 0; u < layout_.num_units(); u++)
      gather(u, model_.params() + layout_.unit_range(u).first, "weights of a unit");
    join(compute_, comm_, comm_to_compute_);
  }

  void plan(const std::vector<int>& order) override {
    order_ = order;
    position_ = 0;
  }

  const __nv_bfloat16* acquire(int unit) override {
    if (stage_ == 2) return model_.params() + layout_.unit_range(unit).first;
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

  void release(int unit) override {
    if (stage_ == 2) return;
    for (Gathered& b : gathered_)
      if (b.unit == unit && b.in_use) {
        b.released.record(compute_);  // a later gather into b waits for the compute that read it
        b.in_use = false;
      }
    prefetch_next();
  }

  // A buffer holds one unit for one pass, so it is always handed out fresh: the pass overwrites what an earlier
  // unit left in it (LlamaGpu::GradWrites), no memset.
  UnitGrads grads(int unit) override {
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

  void grads_done(int unit) override {
    for (Gradient& b : gradients_) {
      if (b.unit != unit) continue;
      join(comm_, compute_, b.filled);
      const auto [begin, end] = layout_.unit_range(unit);
      float* piece = shard_.grad + shard_.unit_offset[unit];
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

 private:
  struct Gathered {
    __nv_bfloat16* data = nullptr;
    int unit = -1;        // the unit it holds or receives (its gather is queued on the comm stream)
    bool in_use = false;  // acquired and not released
    StreamEvent ready, released;
  };
  struct Gradient {
    float* data = nullptr;
    int unit = -1;  // the unit whose gradient it collects; -1: free
    int64_t last_use = 0;
    StreamEvent filled, drained;
  };

  // The bf16 weights of `unit` from every rank's shard into dst, on the comm stream.
  void gather(int unit, __nv_bfloat16* dst, const char* what) {
    const auto [begin, end] = layout_.unit_range(unit);
    const __nv_bfloat16* piece = shard_.weights + shard_.unit_offset[unit];
    if (dp_ != nullptr)
      dp_->all_gather(piece, dst, end - begin, CommType::BF16, what);
    else
      TUNA_CUDA_CHECK(cudaMemcpyAsync(dst, piece, (end - begin) * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice,
                                      comm_));
  }

  void gather_into(Gathered& b, int unit) {
    b.released.wait(comm_);  // the compute that last read the buffer is done
    gather(unit, b.data, "weights of a unit");
    b.ready.record(comm_);
    b.unit = unit;
  }

  // Starts the gather of the unit the plan acquires next into a free buffer, unless it is there already.
  void prefetch_next() {
    if (!prefetch_ || position_ >= order_.size()) return;
    const int next = order_[position_];
    for (const Gathered& b : gathered_)
      if (b.unit == next) return;
    for (Gathered& b : gathered_)
      if (!b.in_use) return gather_into(b, next);
  }

  LlamaGpu& model_;
  const ParamLayout& layout_;
  OptimizerShard& shard_;
  const std::vector<Segment>& segments_;
  Comm* dp_;
  cudaStream_t comm_, compute_;
  int stage_;
  bool prefetch_;
  int64_t max_unit_ = 0, uses_ = 0;
  float* scatter_out_ = nullptr;
  std::vector<Gathered> gathered_;
  std::vector<Gradient> gradients_;
  std::vector<bool> shard_written_;  // per unit: its piece of the shard holds this step's gradient
  StreamEvent compute_to_comm_, comm_to_compute_;
  std::vector<int> order_;
  size_t position_ = 0;
};

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

class GpuEngine final : public Engine {
 public:
  GpuEngine(const LlamaConfig& config, const EngineOptions& o, Mesh& mesh, const WeightFill& initial,
            const DeviceCommFactory& device_comm)
      : options_(o),
        mesh_(mesh),
        model_(config, o.micro_batch, o.seq_len, o.opt, gpu_options(o, mesh)),
        segments_(dp_unit_pieces(model_.layout(), mesh.dp_rank, mesh.dp_size)) {
    model_.set_document_mode(o.documents);
    cudaStream_t stream = model_.stream();
    // ZeRO-2 and 3 communicate on a stream of their own, overlapping the compute; 0 and 1 between passes.
    if (o.zero >= 2) TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    if (mesh.dp_size > 1) dp_device_ = device_comm(*mesh.dp, o.zero >= 2 ? comm_stream_ : stream);
    if (mesh.tp_size > 1) {  // the tensor-parallel all-reduces run on the compute stream, inside each layer
      tp_device_ = device_comm(*mesh.tp, stream);
      model_.set_tp_comm(tp_device_.get());
    }
    if (o.zero >= 1)
      shard_ = std::make_unique<OptimizerShard>(model_.arena(), model_.layout(), segments_, o.bf16_moments, o.zero >= 2);
    if (o.zero >= 2)
      store_ = std::make_unique<ShardedStore>(model_, *shard_, segments_, dp_device_.get(), comm_stream_, o.zero,
                                              o.zero_prefetch);
    model_.arena().check_all_taken();
    if (initial) fill_weights(initial);
    cudaDeviceProp prop{};
    TUNA_CUDA_CHECK(cudaGetDeviceProperties(&prop, o.gpu));
    describe_ = str("cuda:", o.gpu, " (", prop.name, ", ", prop.multiProcessorCount, " SMs, ",
                    static_cast<int64_t>(prop.totalGlobalMem >> 30), " GiB)");
    peak_flops_ = gpu_peak_bf16_flops(o.gpu);
  }
  ~GpuEngine() override {
    store_.reset();
    dp_device_.reset();
    tp_device_.reset();
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
  }

  std::string describe() const override { return describe_; }
  const ParamLayout& layout() const override { return model_.layout(); }

  void begin_step() override {
    if (store_) store_->begin_step();
    else model_.zero_grads();
  }
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                           const int32_t* positions) override {
    return model_.forward_backward(inputs, targets, batch, seq, positions);
  }
  StepResult finish_step(const LossSum& local, double lr) override {
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
      dp_device_->all_reduce(model_.grads(), model_.layout().total(), CommType::F32, ReduceOp::Sum, "gradients");
      dp_device_->barrier("gradients all-reduced");  // a bounded wait (--comm_timeout) instead of a blind sync
    }
    r.stats = model_.adamw_step(loss_scale, lr, loss_is_finite);
    return r;
  }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       const int32_t* positions) override {
    return model_.forward_loss(inputs, targets, batch, seq, positions);
  }
  LossSum all_reduce_loss(const LossSum& local) override { return sum_over_ranks(*mesh_.dp, local); }

  const std::vector<Segment>& segments() const override { return segments_; }

  // A piece at a time through one host buffer of the largest piece (weights and both moments): a rank never holds
  // its shard on the host. ZeRO-0 hands out this rank's piece of each unit of its whole copy, ZeRO 1-3 its shard.
  void export_state(const StateSink& sink) const override {
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
  void import_state(const StateSource& source) override {
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
      const ParamLayout& layout = model_.layout();
      const CommType moment_type = bf16 ? CommType::BF16 : CommType::F32;
      const int64_t moment_bytes = bf16 ? 2 : 4;
      for (int u = 0; u < layout.num_units(); u++) {
        const auto [begin, end] = layout.unit_range(u);
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

  int64_t steps_taken() const override { return model_.steps_taken(); }
  void set_steps_taken(int64_t steps) override {
    model_.set_steps_taken(steps);
    // Stochastic rounding: the bf16 weights as the update at `steps` rounded them.
    if (store_) return refresh_shard_weights();
    if (shard_) return gather_master();
    model_.refresh_params();
    TUNA_CUDA_CHECK(cudaStreamSynchronize(model_.stream()));
  }

  std::string memory_report() const override {
    return format_memory_table(model_.memory_plan(), gpu_memory(options_.gpu).total_bytes,
                               str("device memory per GPU (this rank's plan, allocated at start; ", describe_, ")")) +
           format_host_staging(plan_gpu_host_staging(model_.config(), options_, mesh_.dp_size, mesh_.dp_rank,
                                                     mesh_.tp_size, mesh_.tp_rank));
  }
  int64_t activation_bytes() const override { return model_.memory_plan().bytes(MemoryKind::Activations); }
  int64_t state_bytes() const override { return model_.state_bytes(); }  // the shard is in the model's arena
  double flops_per_token(int64_t seq) const override { return model_.flops_per_token(seq); }
  double peak_flops() const override { return peak_flops_; }

  EngineStatus status() override {
    EngineStatus s;
    const HostMemory host = host_memory();
    s.host_mb = host.resident_mb, s.host_peak_mb = host.peak_mb;
    const GpuMemory mem = gpu_memory(options_.gpu);
    // Everything is allocated at construction, so the peak is the largest use seen (NCCL's buffers arrive with
    // the first step).
    gpu_peak_mb_ = std::max(gpu_peak_mb_, mem.used_bytes / 1e6);
    s.gpu_mb = mem.used_bytes / 1e6, s.gpu_peak_mb = gpu_peak_mb_, s.gpu_total_mb = mem.total_bytes / 1e6;
    s.gpu_util = gpu_utilization_percent(options_.gpu);
    return s;
  }

 private:
  // The sharded update of ZeRO 1-3 (see the top of this file). Returns the norm and clip as AdamW::step would;
  // no update when the step's loss or the norm is not finite.
  OptimizerStats sharded_update(double loss_scale, double lr, bool loss_is_finite) {
    OptimizerShard& sh = *shard_;
    const ParamLayout& layout = model_.layout();
    cudaStream_t stream = model_.stream();
    if (store_) {
      store_->gradients_ready();  // ZeRO-2/3: reduce-scattered and accumulated during the backward
    } else {
      for (int u = 0; u < layout.num_units(); u++) {  // this rank's piece of each unit's gradient, summed over dp
        const auto [begin, end] = layout.unit_range(u);
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
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (mesh_.tp_rank > 0) sum_sq -= replicated_sum_of_squares(sh.grad, sh.pieces, sh.replicated_norms, sh.norm_scratch, stream);
    if (mesh_.dp_size > 1) mesh_.dp->all_reduce_sum(&sum_sq, 1, "grad norm (dp)");
    if (mesh_.tp_size > 1) mesh_.tp->all_reduce_sum(&sum_sq, 1, "grad norm (tp)");
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
                                 options_.stochastic_rounding, static_cast<uint32_t>(options_.seed)};
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
  void fill_weights(const WeightFill& initial) {
    const ParamLayout& layout = model_.layout();
    std::vector<Segment> pieces = segments_;
    if (!shard_)
      for (int u = 0; u < layout.num_units(); u++)
        pieces[u] = Segment{layout.unit_range(u).first, layout.unit_range(u).second - layout.unit_range(u).first};
    int64_t largest = 0;
    for (const Segment& p : pieces) largest = std::max(largest, p.size);
    std::vector<float> host(largest);
    for (size_t u = 0; u < pieces.size(); u++) {
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

  // ZeRO-2/3: the shard's bf16 weights from its fp32 master, rounded as the update at steps_taken() rounded
  // them (the shard's positions draw the stochastic bits, as in adamw_update), then handed to the store.
  void refresh_shard_weights() {
    OptimizerShard& sh = *shard_;
    cudaStream_t stream = model_.stream();
    cuda::AdamWArgs args{};
    args.step = std::max<int64_t>(1, model_.steps_taken());
    args.stochastic_rounding = options_.stochastic_rounding && model_.steps_taken() > 0;
    args.seed = static_cast<uint32_t>(options_.seed);
    cuda::bf16_params_as_updated(sh.weights, sh.master, sh.padded, args, stream);
    store_->weights_updated();
    if (dp_device_) dp_device_->barrier("weights restored");
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  // ZeRO-1: every rank's master pieces, gathered whole into the gradient buffer (free between a step's update and
  // the next step), then the bf16 weights from them; the buffer then reads as zero again (zero_grads: the next
  // backward overwrites it).
  void gather_master() {
    OptimizerShard& sh = *shard_;
    const ParamLayout& layout = model_.layout();
    float* whole = model_.grads();
    for (int u = 0; u < layout.num_units(); u++) {
      const auto [begin, end] = layout.unit_range(u);
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

  EngineOptions options_;
  Mesh& mesh_;
  LlamaGpu model_;
  std::vector<Segment> segments_;
  cudaStream_t comm_stream_ = nullptr;     // ZeRO-2/3: where the dp device comm and the shard accumulation run
  std::unique_ptr<Comm> dp_device_;        // NCCL over the dp group; null on one rank
  std::unique_ptr<Comm> tp_device_;        // NCCL over the tp group, on the compute stream; null without tp
  std::unique_ptr<OptimizerShard> shard_;  // ZeRO 1-3's optimizer state; null for ZeRO-0
  std::unique_ptr<ShardedStore> store_;    // ZeRO-2/3's weights and gradients for the model
  std::string describe_;
  double peak_flops_ = NAN, gpu_peak_mb_ = 0;
};

class GpuForwardModel final : public ForwardModel {
 public:
  GpuForwardModel(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const WeightFill& weights,
                  const DocumentMode& documents)
      : model_(config, max_batch, max_seq, OptimizerConfig{}, forward_only()), max_seq_(max_seq) {
    model_.set_document_mode(documents);
    const ParamLayout& layout = model_.layout();
    std::vector<float> host;
    for (int u = 0; u < layout.num_units(); u++) {  // a unit at a time through the host
      const Segment piece{layout.unit_range(u).first, layout.unit_range(u).second - layout.unit_range(u).first};
      host.resize(piece.size);
      weights(layout, piece, host.data());
      model_.set_params_piece(piece, host.data());
    }
    cudaDeviceProp prop{};
    TUNA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    describe_ = str("cuda:0 (", prop.name, ")");
  }
  std::string describe() const override { return describe_; }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       const int32_t* positions) override {
    return model_.forward_loss(inputs, targets, batch, seq, positions);
  }
  void forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* logits) override {
    model_.forward_logits(inputs, batch, seq, logits);
  }
  // Generation: model/decode_gpu.h over this model's bf16 weights.
  void clear_cache(int64_t batch) override {
    if (decoder_ && decoder_->batch() == batch) return decoder_->clear();
    decoder_.reset();
    decoder_ = std::make_unique<DecodeGpu>(GpuWeights{&model_.config(), &model_.layout(), model_.params(), 0}, batch,
                                           max_seq_);
  }
  void forward_cached(const int32_t* tokens, int64_t n, float* last_logits) override {
    if (!decoder_) fail("forward_cached: no KV cache (clear_cache first)");
    decoder_->append(tokens, n, last_logits);
  }

 private:
  static GpuOptions forward_only() {  // bf16 weights and activations only
    GpuOptions g;
    g.training = false;
    return g;
  }
  LlamaGpu model_;
  std::string describe_;
  int64_t max_seq_;
  std::unique_ptr<DecodeGpu> decoder_;
};

}  // namespace

std::unique_ptr<ForwardModel> make_gpu_forward_model(const LlamaConfig& config, int64_t max_batch, int64_t max_seq,
                                                     const WeightFill& weights, const DocumentMode& documents) {
  return std::make_unique<GpuForwardModel>(config, max_batch, max_seq, weights, documents);
}

std::unique_ptr<Engine> make_gpu_engine(const LlamaConfig& config, const EngineOptions& options, Mesh& mesh,
                                        const WeightFill& initial, const DeviceCommFactory& device_comm) {
  check_supported(options, mesh, static_cast<bool>(device_comm));
  TUNA_CUDA_CHECK(cudaSetDevice(options.gpu));
  // Refused before anything is allocated when the plan does not fit the device's free memory.
  const GpuFit fit = plan_gpu_run(config, options, mesh, /*capacity_gb=*/0);
  if (!fit.fits) fail("this run does not fit on GPU ", options.gpu, ":\n", fit.report);
  return std::make_unique<GpuEngine>(config, options, mesh, initial, device_comm);
}

}  // namespace tuna

#endif  // TUNA_CUDA
