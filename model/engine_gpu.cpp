// The CUDA engine (model/engine.h): LlamaGpu on this rank's GPU, data parallel over NCCL as ZeRO-0 or ZeRO-1.
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
#include "model/engine.h"
#include "model/llama_gpu.h"

namespace tuna {

namespace {

GpuOptions gpu_options(const EngineOptions& o) {
  GpuOptions g;
  g.with_optimizer = g.keep_master = o.zero == 0;  // ZeRO-1: the engine keeps master and moments, sharded
  g.bf16_moments = o.bf16_moments;
  g.stochastic_rounding = o.stochastic_rounding;
  g.seed = static_cast<uint32_t>(o.seed);
  g.device = o.gpu;
  return g;
}

// Refuses what the CUDA engine does not do yet, before any device memory is touched.
void check_supported(const EngineOptions& o, const Mesh& mesh, bool have_device_comm) {
  if (mesh.tp_size > 1)
    fail("--tp ", mesh.tp_size, " with --device cuda: tensor parallelism runs on the CPU backend only so far; "
         "on cuda use --tp 1 (data parallel over all ranks)");
  if (o.zero > 1)
    fail("--zero ", o.zero, " with --device cuda: the CUDA backend shards the optimizer state (ZeRO-1) but not yet "
         "the gradients or the weights; use --zero 1 or 0, or --device cpu for ZeRO ", o.zero);
  if (mesh.dp_size > 1 && !have_device_comm)
    fail("data parallel on ", mesh.dp_size, " ranks with --device cuda needs NCCL, and this build has none "
         "(nccl.h was not found at build time, or NCCL=0)");
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
  OptimizerShard(const ParamLayout& layout, const std::vector<Segment>& segments, bool bf16_moments)
      : bf16_moments_(bf16_moments) {
    for (const Segment& seg : segments) unit_offset.push_back(size), size += seg.size;
    padded = (size + 3) / 4 * 4;  // the fused AdamW takes 4 elements per thread; the tail stays 0
    const AdamWTable table = adamw_table(layout, segments);
    n_segments = static_cast<int>(table.starts.size());
    DeviceArenaPlan plan;
    plan.add(&master, padded);
    plan.add(&grad, padded);
    const int64_t moment_bytes = bf16_moments ? 2 : 4;
    plan.add(reinterpret_cast<char**>(&m), padded * moment_bytes);
    plan.add(reinterpret_cast<char**>(&v), padded * moment_bytes);
    plan.add(&table_starts, n_segments);
    plan.add(&table_decays, n_segments);
    plan.add(&norm_total, 1);
    plan.add(&norm_scratch, cuda::sum_of_squares_scratch_doubles());
    bytes_ = plan.bytes();
    TUNA_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&arena_), static_cast<size_t>(bytes_)));
    TUNA_CUDA_CHECK(cudaMemset(arena_, 0, static_cast<size_t>(bytes_)));
    plan.assign(arena_);
    TUNA_CUDA_CHECK(cudaMemcpy(table_starts, table.starts.data(), table.starts.size() * sizeof(int64_t),
                               cudaMemcpyHostToDevice));
    TUNA_CUDA_CHECK(cudaMemcpy(table_decays, table.decays.data(), table.decays.size(), cudaMemcpyHostToDevice));
    TUNA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~OptimizerShard() {
    if (arena_) cudaFree(arena_);
  }
  OptimizerShard(const OptimizerShard&) = delete;
  OptimizerShard& operator=(const OptimizerShard&) = delete;

  bool bf16_moments() const { return bf16_moments_; }
  int64_t bytes() const { return bytes_; }
  cuda::AdamWSegments table() const { return {table_starts, table_decays, n_segments}; }

  int64_t size = 0, padded = 0;
  std::vector<int64_t> unit_offset;  // where unit u's piece starts in shard order
  float *master = nullptr, *grad = nullptr;
  void *m = nullptr, *v = nullptr;  // float, or __nv_bfloat16 with bf16 moments
  int64_t* table_starts = nullptr;
  uint8_t* table_decays = nullptr;
  int n_segments = 0;
  double *norm_total = nullptr, *norm_scratch = nullptr;

 private:
  bool bf16_moments_;
  char* arena_ = nullptr;
  int64_t bytes_ = 0;
};

class GpuEngine final : public Engine {
 public:
  GpuEngine(const LlamaConfig& config, const EngineOptions& o, Mesh& mesh, const WeightFill& initial,
            const DeviceCommFactory& device_comm)
      : options_(o),
        mesh_(mesh),
        model_(config, o.micro_batch, o.seq_len, o.opt, gpu_options(o)),
        segments_(dp_unit_pieces(model_.layout(), mesh.dp_rank, mesh.dp_size)) {
    if (mesh.dp_size > 1) dp_device_ = device_comm(model_.stream());
    if (o.zero == 1) shard_ = std::make_unique<OptimizerShard>(model_.layout(), segments_, o.bf16_moments);
    if (initial) {
      std::vector<float> host(model_.layout().total());
      initial(model_.layout(), host.data());
      model_.set_params(host.data());
      if (shard_) {  // every rank starts from the same whole model: keep this rank's pieces
        for (size_t u = 0; u < segments_.size(); u++)
          TUNA_CUDA_CHECK(cudaMemcpyAsync(shard_->master + shard_->unit_offset[u], host.data() + segments_[u].begin,
                                          segments_[u].size * sizeof(float), cudaMemcpyHostToDevice, model_.stream()));
        TUNA_CUDA_CHECK(cudaStreamSynchronize(model_.stream()));
      }
    }
    cudaDeviceProp prop{};
    TUNA_CUDA_CHECK(cudaGetDeviceProperties(&prop, o.gpu));
    describe_ = str("cuda:", o.gpu, " (", prop.name, ", ", prop.multiProcessorCount, " SMs, ",
                    static_cast<int64_t>(prop.totalGlobalMem >> 30), " GiB)");
    peak_flops_ = gpu_peak_bf16_flops(o.gpu);
  }

  std::string describe() const override { return describe_; }
  const ParamLayout& layout() const override { return model_.layout(); }

  void begin_step() override { model_.zero_grads(); }
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq) override {
    return model_.forward_backward(inputs, targets, batch, seq);
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
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq) override {
    return model_.forward_loss(inputs, targets, batch, seq);
  }
  LossSum all_reduce_loss(const LossSum& local) override { return sum_over_ranks(*mesh_.dp, local); }

  const std::vector<Segment>& segments() const override { return segments_; }

  void export_shard(std::vector<float>& p, std::vector<float>& m, std::vector<float>& v) const override {
    if (shard_) return export_optimizer_shard(p, m, v);
    int64_t n = 0;
    for (const Segment& s : segments_) n += s.size;
    p.resize(n), m.resize(n), v.resize(n);
    const LlamaGpu& model = model_;
    TUNA_CUDA_CHECK(cudaStreamSynchronize(model.stream()));
    std::vector<uint16_t> bits;
    int64_t at = 0;
    for (const Segment& s : segments_) {
      TUNA_CUDA_CHECK(cudaMemcpy(p.data() + at, model.master_params() + s.begin, s.size * sizeof(float),
                                 cudaMemcpyDeviceToHost));
      for (auto [dst, src] : {std::pair{m.data() + at, model.moment_m()}, std::pair{v.data() + at, model.moment_v()}}) {
        if (!model.bf16_moments()) {
          TUNA_CUDA_CHECK(cudaMemcpy(dst, static_cast<const float*>(src) + s.begin, s.size * sizeof(float),
                                     cudaMemcpyDeviceToHost));
          continue;
        }
        bits.resize(s.size);
        TUNA_CUDA_CHECK(cudaMemcpy(bits.data(), static_cast<const uint16_t*>(src) + s.begin, s.size * sizeof(uint16_t),
                                   cudaMemcpyDeviceToHost));
        convert_to_f32(bits.data(), DType::BF16, dst, s.size);
      }
      at += s.size;
    }
  }

  void import_shard(const std::vector<float>& p, const std::vector<float>& m, const std::vector<float>& v) override {
    if (shard_) return import_optimizer_shard(p, m, v);
    const ParamLayout& layout = model_.layout();
    const int64_t P = layout.total();
    cudaStream_t stream = model_.stream();
    float* staging = model_.grads();  // P floats, unused between steps
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int which = 0; which < 3; which++) {
      const std::vector<float>& src = which == 0 ? p : which == 1 ? m : v;
      int64_t at = 0;
      for (const Segment& s : segments_) {
        TUNA_CHECK(at + s.size <= static_cast<int64_t>(src.size()), "shard of ", src.size(), " elements is short");
        TUNA_CUDA_CHECK(cudaMemcpyAsync(staging + s.begin, src.data() + at, s.size * sizeof(float),
                                        cudaMemcpyHostToDevice, stream));
        at += s.size;
      }
      if (dp_device_) {  // every rank holds everything (ZeRO-0): gather the pieces of each unit in place
        for (int u = 0; u < layout.num_units(); u++) {
          const auto [begin, end] = layout.unit_range(u);
          dp_device_->all_gather(staging + segments_[u].begin, staging + begin, end - begin, "restored state of a unit");
        }
      }
      void* dst = which == 0 ? static_cast<void*>(model_.master_params()) : which == 1 ? model_.moment_m() : model_.moment_v();
      if (which > 0 && model_.bf16_moments())
        cuda::f32_to_bf16(static_cast<__nv_bfloat16*>(dst), staging, P, stream);
      else
        TUNA_CUDA_CHECK(cudaMemcpyAsync(dst, staging, P * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
    model_.refresh_params();
    model_.zero_grads();
    if (dp_device_) dp_device_->barrier("state restored");
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  int64_t steps_taken() const override { return model_.steps_taken(); }
  void set_steps_taken(int64_t steps) override {
    model_.set_steps_taken(steps);
    // Stochastic rounding: the bf16 copy as the update at `steps` rounded it.
    if (shard_) return gather_master();
    model_.refresh_params();
    TUNA_CUDA_CHECK(cudaStreamSynchronize(model_.stream()));
  }

  int64_t activation_bytes() const override { return model_.device_bytes() - model_.state_bytes(); }
  int64_t state_bytes() const override { return model_.state_bytes() + (shard_ ? shard_->bytes() : 0); }
  double flops_per_token(int64_t seq) const override { return model_.flops_per_token(seq); }
  double peak_flops() const override { return peak_flops_; }

  EngineStatus status() override {
    EngineStatus s;
    const HostMemory host = host_memory();
    s.host_mb = host.resident_mb, s.host_peak_mb = host.peak_mb;
    const GpuMemory mem = gpu_memory(options_.gpu);
    // Everything is allocated at construction, so the peak is the largest use seen (cuBLASLt's workspace and
    // NCCL's buffers arrive with the first step).
    gpu_peak_mb_ = std::max(gpu_peak_mb_, mem.used_bytes / 1e6);
    s.gpu_mb = mem.used_bytes / 1e6, s.gpu_peak_mb = gpu_peak_mb_, s.gpu_total_mb = mem.total_bytes / 1e6;
    s.gpu_util = gpu_utilization_percent(options_.gpu);
    return s;
  }

 private:
  // ZeRO-1's update (see the top of this file). Returns the norm and clip as AdamW::step would.
  OptimizerStats sharded_update(double loss_scale, double lr, bool loss_is_finite) {
    OptimizerShard& sh = *shard_;
    const ParamLayout& layout = model_.layout();
    cudaStream_t stream = model_.stream();
    for (int u = 0; u < layout.num_units(); u++) {  // this rank's piece of each unit's gradient, summed over dp
      const auto [begin, end] = layout.unit_range(u);
      float* piece = sh.grad + sh.unit_offset[u];
      if (dp_device_) dp_device_->reduce_scatter(model_.grads() + begin, piece, end - begin, "gradients of a unit");
      else
        TUNA_CUDA_CHECK(cudaMemcpyAsync(piece, model_.grads() + segments_[u].begin, segments_[u].size * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream));
    }
    cuda::sum_of_squares(sh.norm_total, sh.grad, sh.size, sh.norm_scratch, stream);
    if (dp_device_) dp_device_->all_reduce(sh.norm_total, 1, CommType::F64, ReduceOp::Sum, "grad norm");
    double sum_sq = 0;
    TUNA_CUDA_CHECK(cudaMemcpyAsync(&sum_sq, sh.norm_total, sizeof(double), cudaMemcpyDeviceToHost, stream));
    if (dp_device_) dp_device_->barrier("gradients reduced");  // a bounded wait (--comm_timeout)
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream));
    OptimizerStats stats;
    stats.grad_norm = std::sqrt(sum_sq) * loss_scale;
    stats.clip_scale = clip_scale(options_.opt, stats.grad_norm);
    // Not finite: no update; the master shard and the bf16 weights stay as they are (begin_step zeroes the
    // gradients of the next step). Decided from the norm already read back above: no extra sync.
    stats.applied = loss_is_finite && std::isfinite(stats.grad_norm);
    if (!stats.applied) return stats;
    const int64_t step = model_.steps_taken() + 1;
    const OptimizerConfig& oc = options_.opt;
    const cuda::AdamWArgs args{lr, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, step, loss_scale * stats.clip_scale,
                               options_.stochastic_rounding, static_cast<uint32_t>(options_.seed)};
    if (sh.bf16_moments())
      cuda::adamw_update(sh.master, nullptr, sh.grad, static_cast<__nv_bfloat16*>(sh.m), static_cast<__nv_bfloat16*>(sh.v),
                         sh.padded, sh.table(), args, stream);
    else
      cuda::adamw_update(sh.master, nullptr, sh.grad, static_cast<float*>(sh.m), static_cast<float*>(sh.v), sh.padded,
                         sh.table(), args, stream);
    model_.set_steps_taken(step);
    gather_master();
    return stats;
  }

  // Every rank's master pieces, gathered whole into the gradient buffer (free between a step's update and the
  // next step), then the bf16 weights from them; the buffer is zeroed again for the next step's gradients.
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

  void export_optimizer_shard(std::vector<float>& p, std::vector<float>& m, std::vector<float>& v) const {
    const OptimizerShard& sh = *shard_;
    p.resize(sh.size), m.resize(sh.size), v.resize(sh.size);
    TUNA_CUDA_CHECK(cudaStreamSynchronize(model_.stream()));
    TUNA_CUDA_CHECK(cudaMemcpy(p.data(), sh.master, sh.size * sizeof(float), cudaMemcpyDeviceToHost));
    for (auto [dst, src] : {std::pair{&m, sh.m}, std::pair{&v, sh.v}}) {
      if (!sh.bf16_moments()) {
        TUNA_CUDA_CHECK(cudaMemcpy(dst->data(), src, sh.size * sizeof(float), cudaMemcpyDeviceToHost));
        continue;
      }
      std::vector<uint16_t> bits(sh.size);
      TUNA_CUDA_CHECK(cudaMemcpy(bits.data(), src, sh.size * sizeof(uint16_t), cudaMemcpyDeviceToHost));
      convert_to_f32(bits.data(), DType::BF16, dst->data(), sh.size);
    }
  }

  void import_optimizer_shard(const std::vector<float>& p, const std::vector<float>& m, const std::vector<float>& v) {
    OptimizerShard& sh = *shard_;
    cudaStream_t stream = model_.stream();
    for (const std::vector<float>* src : {&p, &m, &v})
      TUNA_CHECK(static_cast<int64_t>(src->size()) >= sh.size, "shard of ", src->size(), " elements, expected ", sh.size);
    TUNA_CUDA_CHECK(cudaMemcpyAsync(sh.master, p.data(), sh.size * sizeof(float), cudaMemcpyHostToDevice, stream));
    for (auto [dst, src] : {std::pair{sh.m, &m}, std::pair{sh.v, &v}}) {
      if (!sh.bf16_moments()) {
        TUNA_CUDA_CHECK(cudaMemcpyAsync(dst, src->data(), sh.size * sizeof(float), cudaMemcpyHostToDevice, stream));
        continue;
      }
      // Through the (unused between steps) gradient shard, rounded to nearest: exact for values saved from bf16.
      TUNA_CUDA_CHECK(cudaMemcpyAsync(sh.grad, src->data(), sh.size * sizeof(float), cudaMemcpyHostToDevice, stream));
      cuda::f32_to_bf16(static_cast<__nv_bfloat16*>(dst), sh.grad, sh.size, stream);
    }
    TUNA_CUDA_CHECK(cudaMemsetAsync(sh.grad, 0, sh.padded * sizeof(float), stream));
    gather_master();
  }

  EngineOptions options_;
  Mesh& mesh_;
  LlamaGpu model_;
  std::vector<Segment> segments_;
  std::unique_ptr<Comm> dp_device_;  // NCCL over the dp group, on model_.stream(); null on one rank
  std::unique_ptr<OptimizerShard> shard_;  // ZeRO-1's optimizer state; null for ZeRO-0
  std::string describe_;
  double peak_flops_ = NAN, gpu_peak_mb_ = 0;
};

class GpuForwardModel final : public ForwardModel {
 public:
  GpuForwardModel(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const WeightFill& weights)
      : model_(config, max_batch, max_seq, OptimizerConfig{}, forward_only()) {
    std::vector<float> host(model_.layout().total());
    weights(model_.layout(), host.data());
    model_.set_params(host.data());
    cudaDeviceProp prop{};
    TUNA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    describe_ = str("cuda:0 (", prop.name, ")");
  }
  std::string describe() const override { return describe_; }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq) override {
    return model_.forward_loss(inputs, targets, batch, seq);
  }
  void forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* logits) override {
    model_.forward_logits(inputs, batch, seq, logits);
  }

 private:
  static GpuOptions forward_only() {  // bf16 weights only: no moments, no fp32 master copy
    GpuOptions g;
    g.with_optimizer = g.keep_master = false;
    return g;
  }
  LlamaGpu model_;
  std::string describe_;
};

}  // namespace

std::unique_ptr<ForwardModel> make_gpu_forward_model(const LlamaConfig& config, int64_t max_batch, int64_t max_seq,
                                                     const WeightFill& weights) {
  return std::make_unique<GpuForwardModel>(config, max_batch, max_seq, weights);
}

std::unique_ptr<Engine> make_gpu_engine(const LlamaConfig& config, const EngineOptions& options, Mesh& mesh,
                                        const WeightFill& initial, const DeviceCommFactory& device_comm) {
  check_supported(options, mesh, static_cast<bool>(device_comm));
  TUNA_CUDA_CHECK(cudaSetDevice(options.gpu));
  return std::make_unique<GpuEngine>(config, options, mesh, initial, device_comm);
}

}  // namespace tuna

#endif  // TUNA_CUDA
