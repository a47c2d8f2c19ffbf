// The CUDA engine (engine/engine.h): LlamaGpu on this rank's GPU, with ZeRO 0-3 over the dp group (ZeroGpu,
// dist/zero_gpu.h) and the pipeline driver over the stages (dist/pipeline.h); this file makes the streams and device
// comms and wires them together.
//
// LoRA (EngineOptions::lora): the model's base is frozen (bf16 or nf4), filled once, never saved, whole on every
// dp rank below ZeRO-3; what trains, the dp collectives, the update and the checkpoint state are the adapters'
// (LlamaGpu::trained_layout(), PEFT names, one unit per layer), at ZeRO 0-3 as for a full fine-tune: ZeRO-1 shards
// their master and moments, ZeRO-2 their gradient too (a layer's reduce-scattered as its backward ends), and the update
// writes the whole bf16 copy the GEMMs read. ZeRO-3 also shards the frozen bf16 base over dp (FrozenShard, written
// once), its units gathered before use as a full fine-tune's are, while the adapters train as at ZeRO-2 (a quantized
// base is not sharded: refused, model/llama_gpu.cpp).
// Dropout masks are keyed by (seed, step, micro-batch, dp rank) as on cpu, so the two engines draw the same ones.
//
// Preference objectives (forward_pairs, pair_logps): the CPU engine's flow (model/preference_step.h) over LlamaGpu's
// forward_logps and backward_weighted; over pipeline stages dist/pipeline_pairs.h with the same passes, over this
// stage (GpuStage, so the transfers keep its ordering) and the driver's links.
//
// Pipeline stages (--pp, ZeRO 0 and 1): this rank's LlamaGpu is its stage (model/pipeline.h's split, the stage's
// ParamLayout; with adapters on a bf16 or nf4 base, the stage's frozen units and its layers' adapters), with activation
// slots for the micro-batches 1F1B keeps in flight there; forward_backward_step hands the step to the pipeline driver
// (dist/pipeline.h), the one the CPU engine uses, over a device comm of the stages on a stream of its own. This stage's
// hooks (GpuStage below) send bf16 and order the transfers with the compute by an event on each side, so the next
// backward's gradient is received while a forward computes (dist/pipeline.h says what overlaps, why the order cannot
// deadlock and how --comm_timeout still holds). Backends: NCCL orders all of this on the device, and so does the
// loopback comm (ranks as threads sharing one GPU: device copies ordered by these events alone); the staged comm
// completes each send and receive on the host (its wait_on_stream is wait()), a host-ordered path with the same
// results. The emulator with streams out of order (--streams concurrent --jitter) runs the loopback path as a GPU
// may: a missing event there fails the tests. With tp the tp comm's kernels (compute stream) and the pipeline's may run
// at once, as dp's and tp's already do at ZeRO 2-3: NCCL expects that to work while both fit on the device at once,
// and documents no stronger promise. The loss and the gradient norm's squares are summed over the stages as Zero sums
// them on cpu (each stage counts its own tensors, the last stage's copy of a tied table not), so every stage clips,
// and skips a non-finite step, alike. Checkpoints are in global coordinates (the stage layout's global names), so a run
// resumes at another pp.
#if TUNA_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/memory.h"
#include "dist/pipeline.h"  // PipelineDriver, PipelineStageModel
#include "dist/pipeline_pairs.h"  // PipelinePairs: the preference objectives over the stages
#include "dist/zero_gpu.h"
#include "kernels/adamw.cuh"  // accumulate
#include "kernels/attention.cuh"  // resolve_attention_path
#include "model/decode_gpu.h"
#include "model/support.h"  // eval_tasks_support
#include "engine/backends.h"
#include "engine/device_gpu.h"  // gpu_info, gpu_memory, gpu_peak_bf16_flops, gpu_utilization_percent
#include "model/llama_gpu.h"
#include "model/preference_step.h"  // pair_step: the preference objectives' flow, the CPU engine's

namespace tuna {

namespace {

// The bytes of the plan's item `name`; 0 when the plan has none.
int64_t planned_bytes(const MemoryPlan& plan, const std::string& name) {
  for (const MemoryItem& item : plan.items)
    if (item.name == name) return item.bytes;
  return 0;
}

// What this process lacks for the run, before any device memory is touched (the layout is the support table's,
// model/support.h, which the factory asked): NCCL for several ranks, a GPU for this rank.
void check_devices(const EngineOptions& o, const Mesh& mesh, bool have_device_comm) {
  if ((mesh.dp_size > 1 || mesh.tp_size > 1 || mesh.pp_size > 1) && !have_device_comm)
    fail(mesh.dp_size * mesh.pp_size * mesh.tp_size, " ranks (dp ", mesh.dp_size, " x pp ", mesh.pp_size, " x tp ",
         mesh.tp_size, ") with --device cuda need NCCL, and this build has none (nccl.h was not found at build time, "
         "or NCCL=0)");
  int count = 0;
  TUNA_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (o.gpu.device < 0 || o.gpu.device >= count)
    fail("this rank wants GPU ", o.gpu.device, " (its index among the ranks of its node), but ", count,
         " GPU(s) are visible: launch at most ", count, " ranks per node (mpirun --map-by ppr:", count,
         ":node) or widen CUDA_VISIBLE_DEVICES");
}

// LlamaGpu as a pipeline stage (dist/pipeline.h): bf16 activations in device memory. The device comm of the stages
// runs on a stream of its own (`transfers`): a transfer waits there for an event recorded on the compute stream after
// the passes queued before it, and the compute stream waits (Comm::wait_on_stream) for a receive before the pass that
// reads it and for a send before the pass that rewrites its buffer, so the host queues pass after pass. d_resid, where
// a backward's output gradient lands, is the backward's alone, so that gradient may be received while a forward
// computes.
class GpuStage final : public ModelStage<LlamaGpu> {
 public:
  GpuStage(LlamaGpu& model, cudaStream_t transfers, std::function<void(int64_t)> key_dropout)
      : ModelStage(model, std::move(key_dropout)), transfers_(transfers) {
    TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&produced_, cudaEventDisableTiming));
  }
  ~GpuStage() override {
    if (produced_) cudaEventDestroy(produced_);
  }
  GpuStage(const GpuStage&) = delete;
  GpuStage& operator=(const GpuStage&) = delete;

  float* gradients() override { return model_.grads(); }  // zero when no micro-batch ran (grads() zeroes it then)
  float* tied_peer_gradient() override { return model_.tied_peer_grad(); }
  void add_tied_peer_gradient(float* mine, const float* theirs, int64_t n) override {
    cuda::accumulate(mine, theirs, n, model_.stream());
  }

  CommType wire_type() const override { return CommType::BF16; }
  // The transfers' stream runs what it is given next after the compute queued so far.
  void before_transfer() override {
    TUNA_CUDA_CHECK(cudaEventRecord(produced_, model_.stream()));
    TUNA_CUDA_CHECK(cudaStreamWaitEvent(transfers_, produced_, 0));
  }
  CommRequest compute_waits_for(Comm& comm, CommRequest request) override {
    comm.wait_on_stream(request, model_.stream());
    return request;  // the host's bounded wait comes a pass later (dist/pipeline.h)
  }
  bool receives_gradient_ahead() const override { return true; }

 private:
  cudaStream_t transfers_;
  cudaEvent_t produced_ = nullptr;  // recorded on the compute stream before a transfer
};

class GpuEngine final : public Engine {
 public:
  GpuEngine(const LlamaConfig& config, const EngineOptions& o, const MemoryLayout& run, Mesh& mesh,
            const WeightFill& initial, const DeviceCommFactory& device_comm)
      : options_(o),
        mesh_(mesh),
        model_(config, run, o.opt, o.gpu) {
    model_.set_document_mode(o.documents);
    cudaStream_t stream = model_.stream();
    // ZeRO-2 and 3 communicate on a stream of their own, overlapping the compute; 0 and 1 between passes.
    if (o.zero >= 2) TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    if (mesh.dp_size > 1) dp_device_ = device_comm(*mesh.dp, o.zero >= 2 ? comm_stream_ : stream);
    // NCCL's padding scratch, sized once from the plan's largest padded collective (no regrowth mid-pass).
    if (dp_device_)
      dp_device_->reserve_scratch(planned_bytes(model_.memory_plan(), "NCCL padding scratch (the comm's own)"));
    if (mesh.tp_size > 1) {  // the tensor-parallel all-reduces run on the compute stream, inside each layer
      tp_device_ = device_comm(*mesh.tp, stream);
      model_.set_tp_comm(tp_device_.get());
    }
    // The pipeline's sends and receives run on a stream of their own, overlapping the compute (GpuStage).
    if (mesh.pp_size > 1) {
      TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&pp_stream_, cudaStreamNonBlocking));
      set_up_pipeline(device_comm(*mesh.pp, pp_stream_));
    }
    zero_ = std::make_unique<ZeroGpu>(model_, ZeroGpuOptions{o.zero, o.bf16_moments, o.zero_prefetch, o.opt, o.gpu},
                                      mesh, dp_device_.get(), comm_stream_);
    model_.arena().check_all_taken();
    if (initial) zero_->fill_weights(initial, o.adapters ? o.adapters : initial_adapters(o.seed));
    const GpuInfo gpu = gpu_info(o.gpu.device);
    describe_ = str("cuda:", o.gpu.device, " (", gpu.name, ", ", gpu.multiprocessors, " SMs, ", gpu.memory_bytes >> 30,
                    " GiB)");
    peak_flops_ = gpu_peak_bf16_flops(o.gpu.device);
    attention_ = cuda::attention_path_name(cuda::resolve_attention_path(o.attention));
  }
  ~GpuEngine() override {
    zero_.reset();
    pipeline_pairs_.reset();
    pipeline_.reset();
    pipeline_stage_.reset();
    pp_device_.reset();
    dp_device_.reset();
    tp_device_.reset();
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
    if (pp_stream_) cudaStreamDestroy(pp_stream_);
  }

  std::string describe() const override { return describe_; }
  std::string attention_kernels() const override { return attention_; }
  const ParamLayout& layout() const override { return model_.trained_layout(); }
  const ParamLayout& base_layout() const override { return model_.layout(); }

  void begin_step() override {
    zero_->begin_step();
    micro_batch_ = 0;
  }
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                           const int32_t* positions) override {
    key_dropout(micro_batch_++);
    return model_.forward_backward(inputs, targets, batch, seq, positions);
  }
  LossSum forward_backward_step(const std::vector<MicroBatch>& micro_batches) override {
    return pipeline_ ? pipeline_->step(micro_batches) : Engine::forward_backward_step(micro_batches);
  }
  StepResult finish_step(const LossSum& local, double lr) override { return zero_->finish_step(local, lr); }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       const int32_t* positions) override {
    if (!pipeline_) return model_.forward_loss(inputs, targets, batch, seq, positions);
    return pipeline_->forward_loss(MicroBatch{inputs, targets, positions, batch, seq});
  }

  LossSum all_reduce_loss(const LossSum& local) override { return zero_->all_reduce_loss(local); }
  // The preference passes: the CPU engine's flow (model/preference_step.h) over this model's two passes, on the whole
  // model or down the pipeline's stages (dist/pipeline_pairs.h).
  PreferenceSums forward_pairs(const PairBatch& batch, const ObjectiveConfig& objective, const PreferenceStep& step,
                               bool want_grad) override {
    if (pipeline_) {
      TUNA_CHECK(!want_grad, "a pipeline trains a step's pairs together (forward_pairs_step)");
      return pipeline_pairs_->forward(batch, objective, step);
    }
    if (want_grad) key_dropout(micro_batch_++);
    return pair_step(passes(batch), objective, batch, step, want_grad);
  }
  PairStepSums forward_pairs_step(const std::vector<PairBatch>& micro_batches, const ObjectiveConfig& objective,
                                  const PreferenceStep& step) override {
    if (!pipeline_) return Engine::forward_pairs_step(micro_batches, objective, step);
    const PipelinePairSums sums = pipeline_pairs_->step(micro_batches, objective, step);
    return PairStepSums{sums.sums, sums.counted};
  }
  void pair_logps(const PairBatch& batch, double* chosen, double* rejected) override {
    if (pipeline_) return pipeline_pairs_->pair_logps(batch, chosen, rejected);
    pair_logp_sums(passes(batch), batch, /*adapters_off=*/false, chosen, rejected);
  }
  // --eval_tasks: one request per row (no positions), on the layouts model/support.cpp's eval_tasks_support names (the
  // trainer asks it before the run starts). Under ZeRO-3 the forward gathers as a step's does, each dp rank in lockstep.
  void target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq, const int32_t* positions,
                    float* logps, uint8_t* greedy) override {
    if (positions != nullptr) fail("--eval_tasks on cuda scores one request per row (no packed windows)");
    if (const Support s = eval_tasks_support(engine_memory_layout(options_, mesh_), Device::Cuda); !s.runs())
      fail(s.reason);
    model_.forward_target_logps(inputs, targets, batch, seq, logps, greedy);
  }

  const std::vector<Segment>& segments() const override { return zero_->segments(); }
  void export_state(const StateSink& sink) const override { zero_->export_state(sink); }
  void import_state(const StateSource& source) override { zero_->import_state(source); }

  int64_t steps_taken() const override { return model_.steps_taken(); }
  void set_steps_taken(int64_t steps) override { zero_->set_steps_taken(steps); }

  std::string memory_report() const override {
    return format_memory_table(model_.memory_plan(), gpu_memory(options_.gpu.device).total_bytes,
                               str("device memory per GPU (this rank's plan, allocated at start; ", describe_, ")")) +
           format_host_staging(plan_gpu_host_staging(model_.config(), engine_memory_layout(options_, mesh_)));
  }
  std::vector<float> fp8_amaxes() override { return model_.fp8_amaxes(); }
  int64_t activation_bytes() const override { return model_.memory_plan().bytes(MemoryKind::Activations); }
  int64_t state_bytes() const override { return model_.state_bytes(); }  // the shard is in the model's arena
  double flops_per_token(int64_t seq) const override { return model_.flops_per_token(seq); }
  double peak_flops() const override { return peak_flops_; }

  EngineStatus status() override {
    EngineStatus s;
    const HostMemory host = host_memory();
    s.host_mb = host.resident_mb, s.host_peak_mb = host.peak_mb;
    const GpuMemory mem = gpu_memory(options_.gpu.device);
    // Everything is allocated at construction, so the peak is the largest use seen (NCCL's buffers arrive with
    // the first step).
    gpu_peak_mb_ = std::max(gpu_peak_mb_, mem.used_bytes / 1e6);
    s.gpu_mb = mem.used_bytes / 1e6, s.gpu_peak_mb = gpu_peak_mb_, s.gpu_total_mb = mem.total_bytes / 1e6;
    s.gpu_util = gpu_utilization_percent(options_.gpu.device);
    return s;
  }

 private:
  // Dropout masks by (seed, step, micro-batch of the step, dp rank): the CPU engine's, and a resumed run's the same.
  // A pipeline stage sets them before each pass of a micro-batch, its forward's and its backward's (1F1B interleaves
  // other micro-batches between the two), as the CPU engine does.
  void key_dropout(int64_t micro_batch) {
    if (model_.has_adapters())
      model_.set_lora_dropout_key(lora_dropout_key(options_.seed, steps_taken(), micro_batch, mesh_.dp_rank));
  }

  // This model's two passes over `b` (model/preference_step.h PairPasses).
  PairPasses passes(const PairBatch& b) {
    return PairPasses{
        [this, &b](float* logps, bool backward_follows, bool adapters_off) {
          model_.forward_logps(b.inputs, b.targets, b.batch, b.seq, b.positions, logps, backward_follows, adapters_off);
        },
        [this, &b](const float* weights) { model_.backward_weighted(b.targets, weights, b.batch, b.seq); }};
  }

  // Pipeline stages: the device comm over the stages (on pp_stream_), this model as the driver's stage, and the
  // driver with the labels of the stage's sends and receives (a timeout names them) and, with tied embeddings, the
  // other stage that holds the table.
  void set_up_pipeline(std::unique_ptr<Comm> pp_device) {
    pp_device_ = std::move(pp_device);
    model_.set_pp_comm(mesh_.pp.get());
    PipelineLinks links = pipeline_links(model_.layout(), model_.config().tie_word_embeddings, model_.has_adapters(),
                                         pp_device_->rank(), pp_device_->size());
    if (links.tied)
      TUNA_CHECK(model_.tied_peer_grad() != nullptr, "no buffer for the tied embedding's gradient from the other stage");
    pipeline_stage_ =
        std::make_unique<GpuStage>(model_, pp_stream_, [this](int64_t micro_batch) { key_dropout(micro_batch); });
    pipeline_pairs_ = std::make_unique<PipelinePairs>(*pp_device_, *pipeline_stage_, links, *mesh_.pp,
                                                      [this](const PairBatch& b) { return passes(b); });
    pipeline_ = std::make_unique<PipelineDriver>(*pp_device_, *pipeline_stage_, std::move(links));
    warm_up_links();
  }

  // NCCL connects two ranks at their first send or receive. One element each way over every link the step uses (the
  // neighbouring stages, the tied table's other stage), all started before any is waited for (one NCCL group), makes
  // those connections here, at set-up, instead of inside the first step while its tp kernels run.
  void warm_up_links() {
    Comm& pp = *pp_device_;
    const int s = pp.rank(), last = pp.size() - 1;
    std::vector<int> peers;
    for (int peer : {s - 1, s + 1, pipeline_->links().tied_peer})
      if (peer >= 0 && peer <= last && peer != s && std::find(peers.begin(), peers.end(), peer) == peers.end())
        peers.push_back(peer);
    float* words = nullptr;  // a send's word and a receive's per peer; freed at once (set-up, not the loop)
    TUNA_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&words), 2 * peers.size() * sizeof(float)));
    TUNA_CUDA_CHECK(cudaMemsetAsync(words, 0, 2 * peers.size() * sizeof(float), pp_stream_));
    std::vector<CommRequest> requests;
    for (size_t i = 0; i < peers.size(); i++) {
      requests.push_back(pp.send_start(words + 2 * i, 1, CommType::F32, peers[i], "pipeline link warm-up"));
      requests.push_back(pp.recv_start(words + 2 * i + 1, 1, CommType::F32, peers[i], "pipeline link warm-up"));
    }
    for (CommRequest r : requests) pp.wait(r);
    TUNA_CUDA_CHECK(cudaStreamSynchronize(pp_stream_));
    TUNA_CUDA_CHECK(cudaFree(words));
  }

  EngineOptions options_;
  Mesh& mesh_;
  LlamaGpu model_;
  cudaStream_t comm_stream_ = nullptr;     // ZeRO-2/3: where the dp device comm and the shard accumulation run
  std::unique_ptr<Comm> dp_device_;        // NCCL over the dp group; null on one rank
  std::unique_ptr<Comm> tp_device_;        // NCCL over the tp group, on the compute stream; null without tp
  std::unique_ptr<Comm> pp_device_;        // NCCL over the pipeline's stages, on pp_stream_; null without pp
  cudaStream_t pp_stream_ = nullptr;       // the pipeline's sends and receives
  std::unique_ptr<GpuStage> pipeline_stage_;  // --pp: this model as the driver's stage,
  std::unique_ptr<PipelineDriver> pipeline_;  // and the driver
  std::unique_ptr<PipelinePairs> pipeline_pairs_;  // --pp: the preference objectives' passes over the stages
  std::unique_ptr<ZeroGpu> zero_;          // ZeRO 0-3 over dp: the step's synchronization and update, the state
  std::string describe_, attention_;
  double peak_flops_ = NAN, gpu_peak_mb_ = 0;
  int64_t micro_batch_ = 0;  // of the current step (LoRA dropout)
};

class GpuForwardModel final : public ForwardModel {
 public:
  GpuForwardModel(const LlamaConfig& config, int64_t max_batch, int64_t max_seq, const WeightFill& weights,
                  const DocumentMode& documents)
      : model_(config, single_rank_layout(max_batch, max_seq, /*training=*/false)), max_seq_(max_seq) {
    model_.set_document_mode(documents);
    const ParamLayout& layout = model_.layout();
    std::vector<float> host;
    for (int u = 0; u < layout.num_units(); u++) {  // a unit at a time through the host
      const Segment piece{layout.unit_range(u).first, layout.unit_range(u).second - layout.unit_range(u).first};
      host.resize(piece.size);
      weights(layout, piece, host.data());
      model_.set_params_piece(piece, host.data());
    }
    describe_ = str("cuda:0 (", gpu_info(0).name, ")");
  }
  std::string describe() const override { return describe_; }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       const int32_t* positions) override {
    return model_.forward_loss(inputs, targets, batch, seq, positions);
  }
  void forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* logits) override {
    model_.forward_logits(inputs, batch, seq, logits);
  }
  // Each target's log-prob and greedy flag from the head's logits a chunk at a time on the host
  // (LlamaGpu::forward_target_logps): one request per row, since the model takes no document positions here.
  void forward_target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                            const int32_t* positions, float* logps, uint8_t* greedy) override {
    if (positions) fail("cuda: multiple-choice scoring takes one request per row (no packed documents)");
    model_.forward_target_logps(inputs, targets, batch, seq, logps, greedy);
  }
  bool packs_documents() const override { return false; }
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

std::unique_ptr<Engine> make_gpu_engine(const LlamaConfig& config, const EngineOptions& options, const MemoryLayout& run,
                                        Mesh& mesh, const WeightFill& initial, const DeviceCommFactory& device_comm) {
  check_devices(options, mesh, static_cast<bool>(device_comm));
  TUNA_CUDA_CHECK(cudaSetDevice(options.gpu.device));
  // Refused before anything is allocated when the plan does not fit the device's free memory.
  size_t free_bytes = 0, total_bytes = 0;
  TUNA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const GpuFit fit = plan_gpu_fit(config, options, mesh, static_cast<int64_t>(free_bytes));
  if (!fit.fits) fail("this run does not fit on GPU ", options.gpu.device, ":\n", fit.report);
  return std::make_unique<GpuEngine>(config, options, run, mesh, initial, device_comm);
}

}  // namespace tuna

#endif  // TUNA_CUDA
