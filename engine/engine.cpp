// The CPU engine (Llama + Zero), the device choice and the factory; the CUDA engine is engine/engine_gpu.cpp.
#include "engine/engine.h"

#include <algorithm>

#include "core/error.h"
#include "core/memory.h"
#include "ckpt/checkpoint.h"

#if TUNA_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
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
    // only its shard, filled piece by piece.
    model_.set_document_mode(o.documents);
    if (initial && o.zero != 3) fill_whole(initial, model_.layout(), model_.params.data());
    zero_ = std::make_unique<Zero>(model_, o.opt, o.zero, *mesh.dp, mesh.tp.get());
    zero_->set_prefetch(o.zero_prefetch);
    if (o.zero == 3 && initial)
      zero_->fill_weights([&](const Segment& piece, float* out) { initial(model_.layout(), piece, out); });
  }

  std::string describe() const override { return "cpu"; }
  const ParamLayout& layout() const override { return model_.layout(); }
  void begin_step() override { zero_->begin_step(); }
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                           const int32_t* positions) override {
    return model_.forward_backward(inputs, targets, batch, seq, positions);
  }
  StepResult finish_step(const LossSum& local, double lr) override { return zero_->finish_step(local, lr); }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       const int32_t* positions) override {
    return model_.forward_loss(inputs, targets, batch, seq, positions);
  }
  LossSum all_reduce_loss(const LossSum& local) override { return zero_->all_reduce_loss(local); }

  const std::vector<Segment>& segments() const override { return zero_->segments(); }
  void export_state(const StateSink& sink) const override { zero_->export_state(sink); }
  void import_state(const StateSource& source) override { zero_->import_state(source); }
  int64_t steps_taken() const override { return zero_->optimizer().steps_taken; }
  void set_steps_taken(int64_t steps) override { zero_->optimizer().steps_taken = steps; }

  std::string memory_report() const override { return ""; }  // the trainer prints the host plan itself
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
  CpuForwardModel(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const WeightFill& weights,
                  const DocumentMode& documents)
      : model_(config, max_batch, max_seq) {
    model_.set_document_mode(documents);
    fill_whole(weights, model_.layout(), model_.params.data());
  }
  std::string describe() const override { return "cpu"; }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       const int32_t* positions) override {
    return model_.forward_loss(inputs, targets, batch, seq, positions);
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

void Engine::export_shard(std::vector<float>& params, std::vector<float>& m, std::vector<float>& v) const {
  std::vector<int64_t> at;
  int64_t total = 0;
  for (const Segment& s : segments()) at.push_back(total), total += s.size;
  params.resize(total), m.resize(total), v.resize(total);
  export_state([&](size_t i, const float* p, const float* mi, const float* vi) {
    const int64_t n = segments()[i].size;
    std::copy_n(p, n, params.data() + at[i]), std::copy_n(mi, n, m.data() + at[i]), std::copy_n(vi, n, v.data() + at[i]);
  });
}

void Engine::import_shard(const std::vector<float>& params, const std::vector<float>& m, const std::vector<float>& v) {
  std::vector<int64_t> at;
  int64_t total = 0;
  for (const Segment& s : segments()) at.push_back(total), total += s.size;
  for (const std::vector<float>* x : {&params, &m, &v})
    TUNA_CHECK(static_cast<int64_t>(x->size()) == total, "shard of ", x->size(), " elements, expected ", total);
  import_state([&](size_t i, float* p, float* mi, float* vi) {
    const int64_t n = segments()[i].size;
    std::copy_n(params.data() + at[i], n, p), std::copy_n(m.data() + at[i], n, mi), std::copy_n(v.data() + at[i], n, vi);
  });
}

MemoryLayout engine_memory_layout(const EngineOptions& o, int dp_size, int dp_rank, int tp_size, int tp_rank) {
  MemoryLayout l;
  l.dp = dp_size, l.dp_rank = dp_rank, l.tp = tp_size, l.tp_rank = tp_rank;
  l.zero = o.zero, l.zero_prefetch = o.zero_prefetch, l.recompute = o.recompute;
  l.bf16_moments = o.bf16_moments;
  l.micro_batch = o.micro_batch, l.seq_len = o.seq_len;
  return l;
}

GpuFit plan_gpu_run(const LlamaConfig& config, const EngineOptions& options, const Mesh& mesh, double capacity_gb) {
  int64_t capacity = static_cast<int64_t>(capacity_gb * 1e9);
  if (capacity_gb <= 0) {
#if TUNA_CUDA
    if (resolve_device("cuda") == "cuda") {
      TUNA_CUDA_CHECK(cudaSetDevice(options.gpu));
      size_t free_bytes = 0, total_bytes = 0;
      TUNA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      capacity = static_cast<int64_t>(free_bytes);
    }
#else
    fail("option 'gpu_memory_gb': this build has no CUDA, so there is no GPU to measure: give the card's memory in GB "
         "(80 for an H100)");
#endif
  }
  GpuFit fit = check_gpu_fit(config, engine_memory_layout(options, mesh.dp_size, mesh.dp_rank, mesh.tp_size, mesh.tp_rank),
                             capacity);
  fit.report += format_host_staging(
      plan_gpu_host_staging(config, options, mesh.dp_size, mesh.dp_rank, mesh.tp_size, mesh.tp_rank));
  return fit;
}

HostStaging plan_gpu_host_staging(const LlamaConfig& config, const EngineOptions& options, int dp_size, int dp_rank,
                                  int tp_size, int tp_rank) {
  const ParamLayout layout(config, tp_rank, tp_size);
  int64_t largest_piece = 0, largest_unit = 0;
  for (const Segment& s : dp_unit_pieces(layout, dp_rank, dp_size)) largest_piece = std::max(largest_piece, s.size);
  for (int u = 0; u < layout.num_units(); u++)
    largest_unit = std::max(largest_unit, layout.unit_range(u).second - layout.unit_range(u).first);
  HostStaging h;
  h.init_bytes = (options.zero >= 1 ? largest_piece : largest_unit) * int64_t(sizeof(float));
  h.checkpoint_bytes = largest_piece * int64_t(3 * sizeof(float) + sizeof(uint16_t));
  return h;
}

std::string format_host_staging(const HostStaging& h) {
  return str("host memory per rank beyond the process's own: start-up ", format_bytes(h.init_bytes),
             " (one piece of the starting weights), checkpoint save or resume ", format_bytes(h.checkpoint_bytes),
             " (one piece of the weights and both moments); weight and checkpoint files are mapped and read a piece "
             "at a time\n");
}

WeightFill weights_from_directory(const std::filesystem::path& dir) {
  auto reader = std::make_shared<std::unique_ptr<WeightReader>>();
  return [dir, reader](const ParamLayout& layout, const Segment& piece, float* out) {
    if (!*reader) *reader = std::make_unique<WeightReader>(dir, layout);
    (*reader)->read(piece, out);
  };
}

WeightFill random_weights(uint64_t seed, double std) {
  return [seed, std](const ParamLayout& layout, const Segment& piece, float* out) {
    init_random_weights_piece(layout, seed, std, piece, out);
  };
}

void fill_whole(const WeightFill& fill, const ParamLayout& layout, float* out) {
  for (int u = 0; u < layout.num_units(); u++) {
    const auto [begin, end] = layout.unit_range(u);
    fill(layout, Segment{begin, end - begin}, out + begin);
  }
}

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
                                                 int64_t max_batch, int64_t max_seq, const WeightFill& weights,
                                                 const DocumentMode& documents) {
  if (device == "cpu") return std::make_unique<CpuForwardModel>(config, max_batch, max_seq, weights, documents);
#if TUNA_CUDA
  if (device == "cuda") return make_gpu_forward_model(config, max_batch, max_seq, weights, documents);
#endif
  fail("forward model: unknown or unavailable device '", device, "' (resolve_device picks cpu or cuda)");
}

}  // namespace tuna
