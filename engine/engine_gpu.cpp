// The CUDA engine (engine/engine.h): LlamaGpu on this rank's GPU, data parallel over the device comm (NCCL) as
// ZeRO-0, 1, 2 or 3.
//
// ZeRO-0. A step: forward_backward per micro-batch accumulates fp32 gradients on the device; finish_step sums
// the loss over dp ranks (host comm), all-reduces the gradients on the device comm, then LlamaGpu::adamw_step
// takes the global norm, clips and updates. Every rank then holds the same gradients and applies the same
// update, so the weights stay identical without a broadcast.
//
// ZeRO-1. The fp32 master weights and AdamW moments exist only for this rank's shard (OptimizerShard,
// dist/zero_gpu.h); the model keeps only its bf16 weights and fp32 gradients. finish_step reduce-scatters each
// unit's gradient into the shard, takes the norm over the shard and sums it over dp, runs the fused AdamW over
// the shard, then all-gathers the updated master pieces into the (by then unused) gradient buffer and rewrites
// the bf16 weights from it (with the update's stochastic-rounding bits, so every rank holds the weights ZeRO-0
// would).
//
// ZeRO-2 and 3 (ShardedStore, dist/zero_gpu.h, the model's GpuWeightStore). The gradient shard is filled unit by
// unit during the backward on a communication stream, and ZeRO-3 gathers each unit's weights just before use.
// The update runs over the shard as ZeRO-1's and writes the shard's bf16 weights, which the store then gathers.
//
// The clip norm is over the shards (squares summed over this rank's shard, then over dp). At one rank the
// shard is the whole layout in layout order, so every stage computes ZeRO-0's bits.
//
// LoRA (EngineOptions::lora): the model's base is frozen (bf16 or nf4), filled once, never saved, whole on every
// dp rank below ZeRO-3; what trains, the dp collectives, the update and the checkpoint state are the adapters'
// (LlamaGpu::trained_layout(), PEFT names, one unit per layer), at ZeRO 0-3 as above: ZeRO-1 shards their
// master and moments, ZeRO-2 their gradient too (a layer's reduce-scattered as its backward ends), and the update
// writes the whole bf16 copy the GEMMs read. ZeRO-3 also shards the frozen bf16 base over dp (FrozenShard, written
// once), its units gathered before use as a full fine-tune's are, while the adapters train as at ZeRO-2 (a quantized
// base is not sharded: refused, model/llama_gpu.cpp).
// Dropout masks are keyed by (seed, step, micro-batch, dp rank) as on cpu, so the two engines draw the same ones.
//
// Pipeline stages (--pp, ZeRO 0 and 1): this rank's LlamaGpu is its stage (model/pipeline.h's split, the stage's
// ParamLayout; with adapters on a bf16 or nf4 base, the stage's frozen units and its layers' adapters), with activation
// slots for the micro-batches 1F1B keeps in flight there; forward_backward_step runs the CPU engine's schedule
// (pipeline_step below) over a device comm of the stages, on a stream of its own: the sends and receives ordered with
// the compute by events, the next backward's gradient received while a forward computes (pipeline_step says what
// overlaps, why the order cannot deadlock and how --comm_timeout still holds). The loss and the gradient norm's squares
// are summed over the stages as Zero sums them on cpu (each stage counts its own tensors, the last stage's copy of a
// tied table not), so every stage clips, and skips a non-finite step, alike. Checkpoints are in global coordinates (the
// stage layout's global names), so a run resumes at another pp.
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
#include "dist/zero_gpu.h"
#include "kernels/adamw.cuh"  // f32_to_bf16
#include "kernels/attention.cuh"  // resolve_attention_path
#include "model/decode_gpu.h"
#include "engine/backends.h"
#include "model/llama_gpu.h"

namespace tuna {

namespace {

// The bytes of the plan's item `name`; 0 when the plan has none.
int64_t planned_bytes(const MemoryPlan& plan, const std::string& name) {
  for (const MemoryItem& item : plan.items)
    if (item.name == name) return item.bytes;
  return 0;
}

// Refuses what the CUDA engine does not do yet, before any device memory is touched.
void check_supported(const EngineOptions& o, const Mesh& mesh, bool have_device_comm) {
  if (o.zero < 0 || o.zero > 3) fail("option 'zero': expected 0, 1, 2 or 3, found ", o.zero);
  // QLoRA: an nf4 base (LlamaGpu's), each tensor quantized whole; the CPU engine's other layouts are not built here.
  if (o.base_quant == BaseQuant::Int8)
    fail("option 'base_quant' int8 with --device cuda: an int8 frozen base is not implemented on the CUDA engine; use "
         "--base_quant nf4 (QLoRA) or none (a bf16 base), or --device cpu");
  if (o.base_quant != BaseQuant::None && mesh.tp_size > 1)
    fail("option 'base_quant' ", base_quant_name(o.base_quant), " with --tp ", mesh.tp_size, " and --device cuda: not "
         "implemented (the CUDA model quantizes its own block of each tensor, a base that would depend on tp; the CPU "
         "engine quantizes whole tensors); use --tp 1, or --device cpu");
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
        model_(config, engine_memory_layout(o, mesh), o.opt, o.gpu),
        segments_(dp_unit_pieces(model_.trained_layout(), mesh.dp_rank, mesh.dp_size)) {
    model_.set_document_mode(o.documents);
    cudaStream_t stream = model_.stream();
    // ZeRO-2 and 3 communicate on a stream of their own, overlapping the compute; 0 and 1 between passes.
    if (o.zero >= 2) TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    if (mesh.dp_size > 1) dp_device_ = device_comm(*mesh.dp, o.zero >= 2 ? comm_stream_ : stream);
    if (dp_device_) dp_device_->reserve_scratch(planned_bytes(model_.memory_plan(), "NCCL padding scratch (the comm's own)"));
    if (mesh.tp_size > 1) {  // the tensor-parallel all-reduces run on the compute stream, inside each layer
      tp_device_ = device_comm(*mesh.tp, stream);
      model_.set_tp_comm(tp_device_.get());
    }
    // The pipeline's sends and receives run on a stream of their own, overlapping the compute (pipeline_step).
    if (mesh.pp_size > 1) {
      TUNA_CUDA_CHECK(cudaStreamCreateWithFlags(&pp_stream_, cudaStreamNonBlocking));
      TUNA_CUDA_CHECK(cudaEventCreateWithFlags(&produced_, cudaEventDisableTiming));
      set_up_pipeline(device_comm(*mesh.pp, pp_stream_));
    }
    const bool adapters = model_.has_adapters();
    if (o.zero >= 1)
      shard_ = std::make_unique<OptimizerShard>(model_.arena(), model_.trained_layout(), segments_, o.bf16_moments,
                                                o.zero >= 2, adapters ? "LoRA " : "");
    if (o.zero >= 2)
      store_ = std::make_unique<ShardedStore>(model_, *shard_, segments_, dp_device_.get(), comm_stream_,
                                              adapters ? 2 : o.zero, o.zero_prefetch, adapters);
    if (adapters && o.zero == 3) {
      base_segments_ = dp_unit_pieces(model_.layout(), mesh.dp_rank, mesh.dp_size);
      base_shard_ = std::make_unique<FrozenShard>(model_.arena(), model_.layout(), base_segments_);
      base_store_ = std::make_unique<ShardedStore>(model_, *base_shard_, base_segments_, dp_device_.get(),
                                                   comm_stream_, o.zero_prefetch);
    }
    model_.arena().check_all_taken();
    if (initial) fill_weights(initial);
    cudaDeviceProp prop{};
    TUNA_CUDA_CHECK(cudaGetDeviceProperties(&prop, o.gpu.device));
    describe_ = str("cuda:", o.gpu.device, " (", prop.name, ", ", prop.multiProcessorCount, " SMs, ",
                    static_cast<int64_t>(prop.totalGlobalMem >> 30), " GiB)");
    peak_flops_ = gpu_peak_bf16_flops(o.gpu.device);
    attention_ = cuda::attention_path_name(cuda::resolve_attention_path(o.attention));
  }
  ~GpuEngine() override {
    store_.reset();
    pp_device_.reset();
    base_store_.reset();
    dp_device_.reset();
    tp_device_.reset();
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
    if (produced_) cudaEventDestroy(produced_);
    if (pp_stream_) cudaStreamDestroy(pp_stream_);
  }

  std::string describe() const override { return describe_; }
  std::string attention_kernels() const override { return attention_; }
  const ParamLayout& layout() const override { return model_.trained_layout(); }
  const ParamLayout& base_layout() const override { return model_.layout(); }

  void begin_step() override {
    if (store_) store_->begin_step();
    else model_.zero_grads();
    micro_batch_ = 0;
  }
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                           const int32_t* positions) override {
    key_dropout(micro_batch_++);
    return model_.forward_backward(inputs, targets, batch, seq, positions);
  }
  LossSum forward_backward_step(const std::vector<MicroBatch>& micro_batches) override {
    return pp_device_ ? pipeline_step(micro_batches) : Engine::forward_backward_step(micro_batches);
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
      dp_device_->all_reduce(model_.grads(), model_.trained_layout().total(), CommType::F32, ReduceOp::Sum,
                             "gradients");
      dp_device_->barrier("gradients all-reduced");  // a bounded wait (--comm_timeout) instead of a blind sync
    }
    r.stats = model_.adamw_step(loss_scale, lr, loss_is_finite);
    return r;
  }
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                       const int32_t* positions) override {
    if (!pp_device_) return model_.forward_loss(inputs, targets, batch, seq, positions);
    // One micro-batch down the pipe (the loss on the last stage; all_reduce_loss sums over the stages).
    const int s = pp_device_->rank(), last = pp_device_->size() - 1;
    const int64_t count = model_.residual_rows(batch * seq) * model_.config().hidden_size;
    if (s > 0) {
      after_compute();  // the last pass that read stage_input(0)
      pp_device_->recv(model_.stage_input(0), count, CommType::BF16, s - 1, links_.recv_activations.c_str());
    }
    const LossSum loss = model_.forward_stage(0, inputs, targets, batch, seq, positions, /*backward_follows=*/false);
    if (s < last) {
      after_compute();
      pp_device_->send(model_.stage_output(), count, CommType::BF16, s + 1, links_.send_activations.c_str());
    }
    return loss;
  }
  // Over dp, then over the stages (the stages before the last add nothing), as Zero sums it on cpu.
  LossSum all_reduce_loss(const LossSum& local) override {
    const LossSum over_dp = sum_over_ranks(*mesh_.dp, local);
    return pp_device_ ? sum_over_ranks(*mesh_.pp, over_dp) : over_dp;
  }

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
    return format_memory_table(model_.memory_plan(), gpu_memory(options_.gpu.device).total_bytes,
                               str("device memory per GPU (this rank's plan, allocated at start; ", describe_, ")")) +
           format_host_staging(plan_gpu_host_staging(model_.config(), engine_memory_layout(options_, mesh_)));
  }
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

  // Pipeline stages: the device comm over the stages (on pp_stream_), the labels of the stage's
  // sends and receives (a timeout names them), and with tied embeddings the other stage that holds the table.
  void set_up_pipeline(std::unique_ptr<Comm> pp_device) {
    pp_device_ = std::move(pp_device);
    model_.set_pp_comm(mesh_.pp.get());
    links_ = pipeline_links(model_.layout(), model_.config().tie_word_embeddings, model_.has_adapters(),
                            pp_device_->rank(), pp_device_->size());
    if (const ParamTensor* tied = links_.tied) {
      TUNA_CHECK(model_.tied_peer_grad() != nullptr, "no buffer for the tied embedding's gradient from the other stage");
      tied_offset_ = tied->offset, tied_numel_ = tied->numel;
    }
    warm_up_links();
  }

  // NCCL connects two ranks at their first send or receive. One element each way over every link the step uses (the
  // neighbouring stages, the tied table's other stage), all started before any is waited for (one NCCL group), makes
  // those connections here, at set-up, instead of inside the first step while its tp kernels run.
  void warm_up_links() {
    Comm& pp = *pp_device_;
    const int s = pp.rank(), last = pp.size() - 1;
    std::vector<int> peers;
    for (int peer : {s - 1, s + 1, links_.tied_peer})
      if (peer >= 0 && peer <= last && peer != s && std::find(peers.begin(), peers.end(), peer) == peers.end())
        peers.push_back(peer);
    float* words = nullptr;  // a send's word and a receive's per peer; freed at once (set-up, not the loop)
    TUNA_CUDA_CHECK(cudaMalloc(&words, 2 * peers.size() * sizeof(float)));
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

  // The step's micro-batches through this stage in the 1F1B order, as the CPU engine runs them
  // (engine/engine_cpu.cpp). The sends carry bf16 (the stage's activations and their gradients as the device holds
  // them; the CPU engine's are fp32).
  //
  // Overlap. The device comm runs on its own stream (pp_stream_). A send waits there for an event recorded on the
  // compute stream after the pass that wrote its buffer; the compute stream waits (wait_on_stream) for a receive
  // before the pass that reads it, and for a send before the pass that rewrites its buffer, so the host queues pass
  // after pass without waiting for a transfer. In the steady 1F1B phase a stage before the last posts the receive of
  // the next backward's output gradient before it queues the forward between them: that transfer runs while the
  // forward computes (d_resid, where it lands, is the backward's alone; the last send out of it is ordered before it
  // on the comm's stream). The receive of the next forward's input is not posted ahead: it lands in the activation
  // slot the backward before it reads, and the memory plan has no second input buffer.
  //
  // Order and deadlock. Each send and receive is flushed as a group of its own, so on the comm's stream they run one
  // at a time in the order started, and an NCCL send or receive may wait until its peer reaches the matching one.
  // Between stages s and s+1 both then meet in the same order: s+1 sends the gradient of each backward before
  // receiving the input of the forward after it, and s posts that gradient's receive just before the send of the
  // forward's output that precedes the backward (in 1F1B s's forward before backward k is one micro-batch later than
  // s+1's). That holds only where s has a steady phase; in a step of fewer micro-batches than s's warm-up, the
  // gradient is received where the backward starts, as everything else. Every transfer also waits for the compute
  // queued before it, so none can need a pass that waits for a later transfer. A rendezvous model of both streams
  // per stage finishes for pp 2-8 over 0-19 micro-batches, and deadlocks when a stage in its warm-up posts ahead
  // (tests/model/test_pipeline.cpp).
  //
  // --comm_timeout. Every request gets a bounded host wait (wait()): those the compute stream waits on one pass
  // later, before the next pass's token upload waits for the compute stream (LlamaGpu::upload_tokens), and on the
  // last stage before the forward whose loss the host reads; the others at the end of the step. A dead stage thus
  // stops this one inside a wait that names the send or receive, never in an unbounded stream synchronize.
  //
  // Then, with tied embeddings, the first and last stages exchange the table's gradient (fp32) and each adds the
  // other's: both hold the sum (a + b == b + a, bit for bit), so the copies' updates agree.
  //
  // Backends: NCCL orders all of this on the device, and so does the loopback comm (ranks as threads sharing one GPU:
  // device copies ordered by these events alone); the staged comm completes each send and receive on the host (its
  // wait_on_stream is wait()), a host-ordered path with the same results. The emulator with streams out of order
  // (--streams concurrent --jitter) runs the loopback path as a GPU may: a missing event there fails the tests. With tp
  // the tp comm's kernels (compute stream) and the pipeline's may run at once, as dp's and tp's already do at ZeRO 2-3:
  // NCCL expects that to work while both fit on the device at once, and documents no stronger promise.
  LossSum pipeline_step(const std::vector<MicroBatch>& micro_batches) {
    Comm& pp = *pp_device_;
    const int s = pp.rank(), last = pp.size() - 1;
    const int64_t C = model_.config().hidden_size;
    cudaStream_t compute = model_.stream();
    CommRequest activations_sent = 0, gradient_sent = 0, gradient_posted = 0;
    std::vector<CommRequest> waited_last_pass, waited_this_pass;  // for the bounded host waits
    const auto device_wait = [&](CommRequest& r) {  // the compute stream waits for r; the host later
      if (!r) return;
      pp.wait_on_stream(r, compute);
      waited_this_pass.push_back(r), r = 0;
    };
    const auto host_wait = [&](std::vector<CommRequest>& requests) {
      for (CommRequest r : requests) pp.wait(r);
      requests.clear();
    };
    LossSum loss;
    const int64_t m = static_cast<int64_t>(micro_batches.size());
    const std::vector<PipelineOp> ops = pipeline_schedule(pp.size(), s, m);
    const bool ahead = pipeline_gradient_ahead(pp.size(), s, m);  // only with a steady phase (see above)
    for (size_t i = 0; i < ops.size(); i++) {
      const PipelineOp& op = ops[i];
      const MicroBatch& b = micro_batches[op.micro_batch];
      const int64_t slot = op.micro_batch % model_.in_flight();
      key_dropout(op.micro_batch);
      const int64_t count = model_.residual_rows(b.batch * b.seq) * C;
      host_wait(waited_last_pass);  // the pass below waits for the previous pass's upload (see above)
      if (op.forward) {
        if (s > 0) {
          after_compute();  // the backward that last read this slot
          CommRequest r = pp.recv_start(model_.stage_input(slot), count, CommType::BF16, s - 1,
                                        links_.recv_activations.c_str());
          pp.flush();
          device_wait(r);
        }
        device_wait(activations_sent);  // this forward rewrites stage_output()
        if (ahead && i + 1 < ops.size() && !ops[i + 1].forward) {  // the next backward's gradient, posted ahead
          const MicroBatch& nb = micro_batches[ops[i + 1].micro_batch];
          after_compute();  // the backward before, which read d_resid (the first stage sends nothing after it)
          gradient_posted = pp.recv_start(model_.stage_output_grad(), model_.residual_rows(nb.batch * nb.seq) * C,
                                          CommType::BF16, s + 1, links_.recv_gradient.c_str());
          pp.flush();
        }
        if (s == last) host_wait(waited_this_pass);  // the forward below waits for its loss on the host
        const LossSum l = model_.forward_stage(slot, b.inputs, b.targets, b.batch, b.seq, b.positions,
                                               /*backward_follows=*/true);
        loss.sum += l.sum, loss.count += l.count;
        if (s < last) {
          after_compute();
          activations_sent = pp.send_start(model_.stage_output(), count, CommType::BF16, s + 1,
                                           links_.send_activations.c_str());
          pp.flush();
        }
      } else {
        device_wait(gradient_sent);  // the recv below and this backward rewrite stage_input_grad()
        if (s < last) {
          if (!gradient_posted) after_compute();
          CommRequest r = gradient_posted ? gradient_posted
                                          : pp.recv_start(model_.stage_output_grad(), count, CommType::BF16, s + 1,
                                                          links_.recv_gradient.c_str());
          gradient_posted = 0;
          pp.flush();
          device_wait(r);
        }
        model_.backward_stage(slot, b.inputs, b.batch, b.seq, b.positions);
        if (s > 0) {
          after_compute();
          gradient_sent = pp.send_start(model_.stage_input_grad(), count, CommType::BF16, s - 1,
                                        links_.send_gradient.c_str());
          pp.flush();
        }
      }
      waited_last_pass.swap(waited_this_pass);
    }
    // Every request is waited for once: those the compute stream waited on above, then the last sends.
    host_wait(waited_last_pass);
    if (activations_sent) pp.wait(activations_sent);
    if (gradient_sent) pp.wait(gradient_sent);
    if (links_.tied_peer >= 0) {
      float* mine = model_.grads() + tied_offset_;  // zero when no micro-batch ran (grads() zeroes it then)
      float* theirs = model_.tied_peer_grad();
      after_compute();
      const CommRequest sent =
          pp.send_start(mine, tied_numel_, CommType::F32, links_.tied_peer, links_.tied_exchange.c_str());
      pp.recv(theirs, tied_numel_, CommType::F32, links_.tied_peer, links_.tied_exchange.c_str());
      pp.wait(sent);
      cuda::accumulate(mine, theirs, tied_numel_, model_.stream());
    }
    return loss;
  }

  // Orders the pipeline comm's stream after the compute queued so far (what a send reads was written there).
  void after_compute() {
    TUNA_CUDA_CHECK(cudaEventRecord(produced_, model_.stream()));
    TUNA_CUDA_CHECK(cudaStreamWaitEvent(pp_stream_, produced_, 0));
  }

  // The sharded update of ZeRO 1-3 (see the top of this file). Returns the norm and clip as AdamW::step would;
  // no update when the step's loss or the norm is not finite.
  OptimizerStats sharded_update(double loss_scale, double lr, bool loss_is_finite) {
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
  void fill_weights(const WeightFill& initial) {
    if (model_.has_adapters()) return fill_base_and_adapters(initial);
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
  void fill_base_and_adapters(const WeightFill& base) {
    const auto fill = [&](const ParamLayout& layout, const WeightFill& source, auto&& set) {
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
    const WeightFill adapters = options_.adapters ? options_.adapters : initial_adapters(options_.seed);
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
  void fill_base_shard(const WeightFill& base) {
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
  void refresh_shard_weights() {
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
  void gather_master() {
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

  EngineOptions options_;
  Mesh& mesh_;
  LlamaGpu model_;
  std::vector<Segment> segments_;
  cudaStream_t comm_stream_ = nullptr;     // ZeRO-2/3: where the dp device comm and the shard accumulation run
  std::unique_ptr<Comm> dp_device_;        // NCCL over the dp group; null on one rank
  std::unique_ptr<Comm> tp_device_;        // NCCL over the tp group, on the compute stream; null without tp
  std::unique_ptr<Comm> pp_device_;        // NCCL over the pipeline's stages, on pp_stream_; null without pp
  cudaStream_t pp_stream_ = nullptr;       // the pipeline's sends and receives
  cudaEvent_t produced_ = nullptr;         // recorded on the compute stream before a send (after_compute)
  PipelineLinks links_;  // the labels of the stage's sends and receives, and the tied table's other stage
  int64_t tied_offset_ = 0, tied_numel_ = 0;  // tied embeddings over stages: where the table's gradient is here
  std::unique_ptr<OptimizerShard> shard_;  // ZeRO 1-3's optimizer state; null for ZeRO-0
  std::unique_ptr<ShardedStore> store_;    // ZeRO-2/3's weights and gradients for the model (the adapters')
  std::vector<Segment> base_segments_;     // ZeRO-3 with adapters: this rank's piece of each unit of the base,
  std::unique_ptr<FrozenShard> base_shard_;  // their bf16 values,
  std::unique_ptr<ShardedStore> base_store_;  // and the store that gathers them for the model
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
  TUNA_CUDA_CHECK(cudaSetDevice(options.gpu.device));
  // Refused before anything is allocated when the plan does not fit the device's free memory.
  size_t free_bytes = 0, total_bytes = 0;
  TUNA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const GpuFit fit = plan_gpu_fit(config, options, mesh, static_cast<int64_t>(free_bytes));
  if (!fit.fits) fail("this run does not fit on GPU ", options.gpu.device, ":\n", fit.report);
  return std::make_unique<GpuEngine>(config, options, mesh, initial, device_comm);
}

}  // namespace tuna

#endif  // TUNA_CUDA
