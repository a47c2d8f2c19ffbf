// The CPU engine (Llama + Zero), the device choice and the factory; the CUDA engine is model/engine_gpu.cpp.
#include "model/engine.h"

#include "core/error.h"
#include "core/memory.h"

#if TUNA_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tuna {

namespace {

class CpuEngine final : public Engine {
 public:
  CpuEngine(const LlamaConfig& config, const EngineOptions& o, Mesh& mesh, const WeightFill& initial)
      : config_(config),
        model_(config, o.micro_batch, o.seq_len,
               LlamaParallel{mesh.tp.get(), /*external_weights=*/o.zero == 3, /*external_grads=*/o.zero == 2}) {
    // Stages 0-2 keep the (tp-local) weights in model.params, which Zero reads at construction; stage 3 keeps
    // only its shard, taken from a temporary whole copy.
    std::vector<float> staging;
    if (initial) {
      if (o.zero == 3) staging.resize(model_.layout().total());
      initial(model_.layout(), o.zero == 3 ? staging.data() : model_.params.data());
    }
    zero_ = std::make_unique<Zero>(model_, o.opt, o.zero, *mesh.dp, mesh.tp.get());
    zero_->set_prefetch(o.zero_prefetch);
    if (o.zero == 3 && initial) zero_->set_weights_from_full(staging.data());
  }

  std::string describe() const override { return "cpu"; }
  const ParamLayout& layout() const override { return model_.layout(); }
  void begin_step() override { zero_->begin_step(); }
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq) override {
    return model_.forward_backward(inputs, targets, batch, seq);
  }
  StepResult finish_step(const LossSum& local, double lr) override { return zero_->finish_step(local, lr); }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq) override {
    return model_.forward_loss(inputs, targets, batch, seq);
  }
  LossSum all_reduce_loss(const LossSum& local) override { return zero_->all_reduce_loss(local); }

  const std::vector<Segment>& segments() const override { return zero_->segments(); }
  void export_shard(std::vector<float>& p, std::vector<float>& m, std::vector<float>& v) const override {
    zero_->export_shard(p, m, v);
  }
  void import_shard(const std::vector<float>& p, const std::vector<float>& m, const std::vector<float>& v) override {
    zero_->import_shard(p, m, v);
  }
  int64_t steps_taken() const override { return zero_->optimizer().steps_taken; }
  void set_steps_taken(int64_t steps) override { zero_->optimizer().steps_taken = steps; }

  int64_t activation_bytes() const override { return model_.activation_bytes(); }
  int64_t state_bytes() const override { return zero_->state_bytes(); }
  double flops_per_token(int64_t seq) const override { return model_flops_per_token(config_, seq); }
  double peak_flops() const override { return NAN; }
  EngineStatus status() override {
    const HostMemory mem = host_memory();
    EngineStatus s;
    s.host_mb = mem.resident_mb, s.host_peak_mb = mem.peak_mb;
    return s;
  }

 private:
  LlamaConfig config_;
  Llama model_;
  std::unique_ptr<Zero> zero_;
};

class CpuForwardModel final : public ForwardModel {
 public:
  CpuForwardModel(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const WeightFill& weights)
      : model_(config, max_batch, max_seq) {
    weights(model_.layout(), model_.params.data());
  }
  std::string describe() const override { return "cpu"; }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq) override {
    return model_.forward_loss(inputs, targets, batch, seq);
  }
  void forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* logits) override {
    model_.forward_logits(inputs, batch, seq, logits);
  }
  void clear_cache(int64_t batch) override { cache_ = model_.make_kv_cache(batch, model_.max_seq()); }
  void forward_cached(const int32_t* tokens, int64_t n, float* last_logits) override {
    if (cache_.keys.empty()) fail("forward_cached: no KV cache (clear_cache first)");
    model_.forward_cached(tokens, cache_.batch, n, cache_, last_logits);
  }

 private:
  Llama model_;
  KvCache cache_;
};

}  // namespace

std::string resolve_device(const std::string& requested) {
  if (requested != "auto" && requested != "cpu" && requested != "cuda")
    fail("option 'device': expected auto, cpu or cuda, found '", requested, "'");
  if (requested == "cpu") return requested;
#if TUNA_CUDA
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc == cudaSuccess && count > 0) return "cuda";
  if (requested == "cuda")
    fail("option 'device' is cuda, but no CUDA device is visible (cudaGetDeviceCount: ",
         rc == cudaSuccess ? std::string("0 devices") : std::string(cudaGetErrorString(rc)),
         "); check nvidia-smi and CUDA_VISIBLE_DEVICES, or use --device cpu");
  return "cpu";
#else
  if (requested == "cuda")
    fail("option 'device' is cuda, but this build of tuna has no CUDA (nvcc was not found at build time; "
         "rebuild on a machine with the CUDA toolkit at /usr/local/cuda, or use --device cpu)");
  return "cpu";
#endif
}

std::unique_ptr<Engine> make_engine(const LlamaConfig& config, const EngineOptions& options, Mesh& mesh,
                                    const WeightFill& initial, const DeviceCommFactory& device_comm) {
  if (options.device == "cpu" && options.recompute != Recompute::None)
    fail("--recompute ", recompute_name(options.recompute), " with --device cpu: activation recompute is a CUDA "
         "engine feature (GPU memory is what it saves); the CPU backend keeps every activation: use --recompute none");
  if (options.device == "cpu") return std::make_unique<CpuEngine>(config, options, mesh, initial);
#if TUNA_CUDA
  if (options.device == "cuda") return make_gpu_engine(config, options, mesh, initial, device_comm);
#endif
  fail("engine: unknown or unavailable device '", options.device, "' (resolve_device picks cpu or cuda)");
}

std::unique_ptr<ForwardModel> make_forward_model(const LlamaConfig& config, const std::string& device,
                                                 int64_t max_batch, int64_t max_seq, const WeightFill& weights) {
  if (device == "cpu") return std::make_unique<CpuForwardModel>(config, max_batch, max_seq, weights);
#if TUNA_CUDA
  if (device == "cuda") return make_gpu_forward_model(config, max_batch, max_seq, weights);
#endif
  fail("forward model: unknown or unavailable device '", device, "' (resolve_device picks cpu or cuda)");
}

}  // namespace tuna
