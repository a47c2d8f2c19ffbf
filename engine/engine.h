// Engine: the model as the trainer drives it, on one backend. train.cu runs one loop (micro-batches, the step's
// collectives and update, validation, checkpoints) over this interface, whichever device computes. Files: the
// backends engine_cpu.cpp and engine_gpu.cpp, the device choice and factory device.cpp, shared helpers engine.cpp.
//
// What each backend runs is the support table's (model/support.h), which make_engine asks first.
//
//   cpu   Llama (model/llama.h) + Zero (dist/zero.h): fp32, every parallel mode (dp x pp x tp, sp, ZeRO 0-3). With LoRA
//         (EngineOptions::lora) the base is frozen: whole on every rank (fp32, or quantized: base_quant), or at
//         ZeRO-3 sharded over dp (dist/zero.h ShardedWeights); Zero (ZeRO 0-3) trains the adapters: layout(),
//         segments() and the checkpoint state are the adapters' (PEFT names), base_layout() the model's.
//   cuda  LlamaGpu (model/llama_gpu.h), one GPU per rank (the rank's local index on its node): bf16 weights
//         and activations, fp32 master weights, gradients and moments (bf16 moments as an option). Data
//         parallel over the device comm (NCCL): ZeRO-0 (gradients all-reduced, every rank applies the same
//         update), ZeRO-1 (master weights and moments sharded: reduce-scatter, update the shard, all-gather),
//         ZeRO-2 (gradients sharded too: each unit's reduce-scattered as its backward finishes) or ZeRO-3 (bf16
//         weights sharded too: each unit gathered before use, the next one prefetched on a communication
//         stream). Activation recompute (none, selective, full). Tensor parallelism (Megatron splits by kv
//         groups, vocab-parallel embedding, lm_head and loss) with ZeRO over dp. Pipeline stages (--pp, 1F1B as on
//         cpu, the sends in bf16) at ZeRO 0 and 1. With LoRA the base is frozen (bf16, or nf4 below ZeRO-3), whole
//         on every rank or at ZeRO-3 sharded over dp (gathered a unit at a time), and the adapters train at ZeRO 0-3
//         (dp all-reduce, or their state and from ZeRO-2 their gradients sharded; tp as on cpu): layout(),
//         segments() and the checkpoint state are the adapters', as on cpu.
//
// Checkpoint exchange is in "shard order": the concatenation of segments() (runs of the flat ParamLayout
// buffer), this rank's share of the writing. One rank's segments cover the whole layout in order, so shard
// order is ParamLayout order there (the single-file checkpoint).
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/options.h"
#include "dist/pipeline.h"  // MicroBatch
#include "dist/zero.h"  // StepResult
#include "model/config.h"
#include "model/gpu_options.h"
#include "model/layout.h"
#include "model/llama.h"      // LossSum
#include "model/lora.h"       // LoraConfig
#include "model/lora_shape.h"  // BaseQuant
#include "model/memory_plan.h"  // Recompute
#include "model/objective.h"    // ObjectiveConfig, PreferenceSums
#include "model/optimizer.h"  // OptimizerConfig, Segment
#include "model/support.h"    // Device, the support table

namespace tuna {

struct PairBatch;  // model/preference_step.h

// Writes elements [piece.begin, piece.begin + piece.size) of the (tensor-parallel-local) model, ParamLayout
// order, into out: a checkpoint's or a fresh initialization's weights, a piece at a time. Engines ask for their
// own pieces (a unit, or their ZeRO piece of it), so no rank holds more of the model than its layout does.
using WeightFill = std::function<void(const ParamLayout& layout, const Segment& piece, float* out)>;

// One run's engine settings, as the trainer's options give them. The parallel layout is the mesh's; the two
// together make the run's MemoryLayout (engine_memory_layout), built once and taken whole by the memory plan and
// the model.
struct EngineOptions {
  Device device = Device::Cpu;
  int64_t micro_batch = 1, seq_len = 1;
  OptimizerConfig opt;
  int zero = 0;                // ZeRO stage
  bool sp = false;             // cpu: sequence parallelism over the tp ranks (LlamaParallel::sequence); tp > 1
  bool zero_prefetch = true;   // ZeRO-3: gather the next unit while this one computes
  Recompute recompute = Recompute::None;  // cuda: which activations the backward recomputes (cpu: none only)
  bool bf16_moments = false;   // cuda: AdamW moments in bf16
  AttentionPath attention = AttentionPath::kDefault;  // cuda: the attention kernels (--attention)
  GpuOptions gpu;              // cuda only: the device index, stochastic rounding
  DocumentMode documents;      // packed windows: attention inside documents, positions restarted (llama.h)
  // LoRA (model/lora.h; engine/adapters.h fills these): rank 0 is a full fine-tune. With adapters the base is frozen
  // and only they train: the engine's layout(), optimizer, dp synchronization and checkpoint state are the adapters'
  // (ZeRO 0-3 on both devices; a quantized base below ZeRO-3).
  LoraConfig lora;
  uint64_t seed = 0;           // LoRA: the adapters' starting values (without `adapters`) and the dropout masks
  WeightFill adapters;         // LoRA: the starting adapters (adapter layout order); null: PEFT's initialisation
  // LoRA: the frozen base held quantized, quantized from the starting weights as they are read, a unit at a time;
  // the model computes with the dequantized values. cpu: nf4 or int8, any tp (model/quantized_weights.h); cuda: nf4 at
  // tp 1 (model/llama_gpu.h). None: fp32 (cpu), bf16 (cuda).
  BaseQuant base_quant = BaseQuant::None;
  // --fp8 (model/fp8.h): the seven projections' GEMMs with FP8 operands; the model computes them so (Llama::set_fp8),
  // the support table says on which layouts and devices.
  Fp8Mode fp8 = Fp8Mode::Off;
  bool fp8_forward_codes = false;  // --fp8_weight_codes forward (model/fp8.h parse_fp8_forward_codes)
};

// The options that shape a run's parallel layout and its step, as build/train and build/plan both read them (one
// declaration: the same names, ranges and help in both). The world is dp x pp x tp: dp follows from the ranks.
struct LayoutOptions {
  int64_t tp = 1, pp = 1;
  bool sp = false;
  int64_t zero = 0;
  std::string recompute = "none";
  bool bf16_moments = false;
  int64_t micro_batch = 4, seq_len = 1024, grad_accum = 1;
  std::string rope_scaling;  // TYPE:FACTOR (model/config.h apply_rope_scaling); empty: the config's rope
  std::string fp8 = "off";   // model/fp8.h parse_fp8_mode
  std::string fp8_weight_codes = "both";  // model/fp8.h parse_fp8_forward_codes
};
void declare_layout_options(Options& o, LayoutOptions& l);

// The figures of the log line that depend on the backend. NaN: not known on this backend.
struct EngineStatus {
  double host_mb = 0, host_peak_mb = 0;  // resident memory of this process (both backends)
  double gpu_mb = NAN, gpu_peak_mb = NAN, gpu_total_mb = NAN;  // device memory in use (all processes), total
  double gpu_util = NAN;                 // percent of the last sample period with a kernel running (NVML)
};

// A model directory's weights (checkpoint.h WeightReader, opened at the first piece: only each piece's bytes
// are read) and a fresh initialization's (llama.h init_random_weights_piece).
WeightFill weights_from_directory(const std::filesystem::path& dir);
WeightFill random_weights(uint64_t seed, double std);
// PEFT's starting adapters for an adapter layout (model/lora.h init_lora_weights_piece).
WeightFill initial_adapters(uint64_t seed);
// The whole layout through `fill`, a unit at a time, into out (ParamLayout order): for whoever holds the whole
// (tp-local) model by design (ZeRO 0-2 on cpu, the forward model, tests).
void fill_whole(const WeightFill& fill, const ParamLayout& layout, float* out);
// Makes a device comm (NCCL) over the ranks of a host group (the mesh's dp or tp comm) that enqueues on a CUDA
// stream of the engine. The trainer supplies it, so that only binaries that need NCCL link it; tests supply the
// staged device comm (comm/comm.h), with which several ranks share one GPU.
using DeviceCommFactory = std::function<std::unique_ptr<Comm>(Comm& group, void* cuda_stream)>;

class Engine {
 public:
  virtual ~Engine() = default;

  // For the banner: "cpu" or "cuda:0 (NVIDIA H200, 132 SMs, 140 GiB)".
  virtual std::string describe() const = 0;
  // What trains and what the checkpoint state holds (segments(), export_state): the model's ParamLayout, or with
  // LoRA the adapters' (PEFT names). base_layout() is the model's either way (with LoRA: frozen, never saved).
  virtual const ParamLayout& layout() const = 0;
  virtual const ParamLayout& base_layout() const { return layout(); }
  // The attention kernels this engine runs ("mma", "hopper"); empty on cpu (one attention). Saved in state.json.
  virtual std::string attention_kernels() const { return ""; }

  // The step: begin_step, forward_backward per micro-batch (sums; llama.h's loss convention), finish_step
  // (loss over dp ranks, gradient synchronization, global-norm clip, AdamW).
  virtual void begin_step() = 0;
  // positions: the loader's document positions of the batch ([batch, seq]), or null: one document per row.
  virtual LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                                   const int32_t* positions = nullptr) = 0;
  // The step's micro-batches, in order, their loss sums added: forward_backward on each in turn by default; a
  // pipeline (--pp) runs them through its stages in the 1F1B order, the loss counted on the last stage.
  virtual LossSum forward_backward_step(const std::vector<MicroBatch>& micro_batches);
  virtual StepResult finish_step(const LossSum& local, double lr) = 0;
  // Validation: this rank's loss, and the sum over dp ranks (and pipeline stages: only the last one counts it).
  virtual LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                               const int32_t* positions = nullptr) = 0;
  virtual LossSum all_reduce_loss(const LossSum& local) = 0;

  // Preference objectives (model/objective.h), a micro-batch of packed pairs at a time (model/preference_step.h
  // PairBatch): the reference's log-probs where the objective has one (the base with the adapters off, or the batch's
  // precomputed ones), the policy's, this micro-batch's share of the loss and metrics and, with want_grad, the
  // backward with per-token weights into the step's gradients (finish_step then takes LossSum{loss, step.pairs}).
  // want_grad false: validation. An engine without them refuses (the support table refuses first:
  // model/support.h objective_support).
  virtual PreferenceSums forward_pairs(const PairBatch& batch, const ObjectiveConfig& objective,
                                       const PreferenceStep& step, bool want_grad);
  // A training step's micro-batches of pairs, in order: forward_pairs with want_grad on each in turn by default; a
  // pipeline (--pp) runs them through its stages in the 1F1B order, the loss and its token weights on the last stage.
  // sums: the step's, the same on every rank of a pipeline; counted: what finish_step takes from this rank,
  // LossSum{loss, pairs} where the loss is counted (the last stage), nothing on the stages before it.
  struct PairStepSums {
    PreferenceSums sums;
    LossSum counted;
  };
  virtual PairStepSums forward_pairs_step(const std::vector<PairBatch>& micro_batches, const ObjectiveConfig& objective,
                                          const PreferenceStep& step);
  // Each pair's summed completion log-probs under the current weights (one per pair of the batch): DPO's
  // precomputed reference, taken before the first step.
  virtual void pair_logps(const PairBatch& batch, double* chosen, double* rejected);

  // Multiple-choice scoring under the current weights (build/train --eval_tasks, engine/mc_eval.h TokenLogps): each
  // target's log-prob and whether it is the logits' first argmax, [batch, seq] with batch <= micro_batch and seq <=
  // seq_len, the documents masked and positions restarting whatever the run's document mode. Every rank of a tp group
  // gets them. An engine or layout without it refuses, naming it.
  virtual void target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                            const int32_t* positions, float* logps, uint8_t* greedy);

  // Checkpoints: this rank's segments, and its master weights and AdamW moments (fp32) a segment at a time, in
  // segments() order: export_state hands each piece to sink, import_state asks source for each (then makes the
  // copies the stage keeps). A rank never holds more than one piece of its shard in host memory for them.
  virtual const std::vector<Segment>& segments() const = 0;
  virtual void export_state(const StateSink& sink) const = 0;
  virtual void import_state(const StateSource& source) = 0;
  // The same for the whole shard at once, in shard order (tests, small models).
  void export_shard(std::vector<float>& params, std::vector<float>& m, std::vector<float>& v) const;
  void import_shard(const std::vector<float>& params, const std::vector<float>& m, const std::vector<float>& v);
  virtual int64_t steps_taken() const = 0;  // AdamW updates so far (bias correction)
  virtual void set_steps_taken(int64_t steps) = 0;

  // What this rank's device memory holds, for the log at start: on cuda the per-GPU table of the memory plan
  // the engine allocated (model/memory_plan.h); on cpu nothing (the trainer prints the host plan before the
  // engine exists, model/memory_plan_cpu.cpp).
  virtual std::string memory_report() const = 0;
  // Memory planned at construction: activations, and parameters + gradients + optimizer state.
  virtual int64_t activation_bytes() const = 0;
  virtual int64_t state_bytes() const = 0;
  // Model FLOPs per trained token at this sequence length (model_flops_per_token in config.h) and the
  // device's dense bf16 peak in FLOP/s for MFU; NaN peak on cpu (no MFU there).
  virtual double flops_per_token(int64_t seq) const = 0;
  virtual double peak_flops() const = 0;
  virtual EngineStatus status() = 0;
  // --fp8 on cuda: the amaxes this rank's last passes cast with (each cast weight group's, the current micro-batch's
  // layer inputs', the last backward's output gradients'), for diagnostics and tests: a tp group's ranks must hold the
  // same ones (model/fp8_gpu.h fp8_operand_split). Empty without FP8 and on cpu.
  virtual std::vector<float> fp8_amaxes() { return {}; }
};

// The forward pass alone, for build/eval and build/sample: one rank, no optimizer state.
class ForwardModel {
 public:
  virtual ~ForwardModel() = default;
  virtual std::string describe() const = 0;
  // Loss sums as Llama::forward_loss (positions as Engine's); logits [batch, seq, vocab] in fp32 on the host.
  virtual LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                               const int32_t* positions = nullptr) = 0;
  virtual void forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* logits) = 0;
  // Multiple-choice scoring (engine/mc_eval.h TokenLogps): each target's log-prob and whether it is the logits' first
  // argmax, [batch, seq]. positions as forward_loss's, under the document mask with positions restarting whatever the
  // model's document mode; a model that cannot pack (packs_documents false) takes null positions (one document per
  // row) only.
  virtual void forward_target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                                    const int32_t* positions, float* logps, uint8_t* greedy) = 0;
  virtual bool packs_documents() const = 0;
  // The same for k continuations that share a context, the context's forward once (a KV cache): context [c] (c may be
  // 0), then each row of tokens [k, m] after it (positions c .. c + m - 1), its targets' log-probs and greedy flags
  // [k, m]. A model without it (shares_context false) refuses.
  virtual bool shares_context() const { return false; }
  virtual void forward_shared_logps(const int32_t* context, int64_t c, const int32_t* tokens, const int32_t* targets,
                                    int64_t k, int64_t m, float* logps, uint8_t* greedy);

  // Generation with a KV cache (Llama::forward_cached's contract). clear_cache starts an empty cache for
  // `batch` sequences (at most max_batch) of up to max_seq positions; forward_cached appends n tokens to each
  // (tokens [batch, n]) and writes the logits of each sequence's last new position, [batch, vocab] fp32 on
  // the host: the logits forward_logits gives at those positions over the whole context.
  virtual void clear_cache(int64_t batch) = 0;
  virtual void forward_cached(const int32_t* tokens, int64_t n, float* last_logits) = 0;
};

// `device` as resolve_device returns it; weights fills the whole model (ParamLayout order); documents: how
// forward_loss treats the documents of a window given with positions.
std::unique_ptr<ForwardModel> make_forward_model(const LlamaConfig& config, Device device,
                                                 int64_t max_batch, int64_t max_seq, const WeightFill& weights,
                                                 const DocumentMode& documents = {});

// This rank's layout (model/memory_plan.h) for these options on `mesh`: the one place a run's parallel layout,
// batch shape and buffer switches come together. With the model it is placed (model/support.h place_layout: the
// pipeline split, fails naming the option on an invalid layout): what the engines, their models and memory plans take.
MemoryLayout engine_memory_layout(const EngineOptions& options, const Mesh& mesh);
MemoryLayout engine_memory_layout(const LlamaConfig& config, const EngineOptions& options, const Mesh& mesh);

// The CUDA engine's plan for this rank of `mesh`, checked against a device of capacity_gb (0: the free memory of
// this rank's visible GPU, which then must exist): what build/train --plan_only prints, without allocating.
GpuFit plan_gpu_run(const LlamaConfig& config, const EngineOptions& options, const Mesh& mesh, double capacity_gb);
// The same against capacity_bytes, with no device query (the CUDA engine's check before it allocates).
GpuFit plan_gpu_fit(const LlamaConfig& config, const EngineOptions& options, const Mesh& mesh, int64_t capacity_bytes);

// The CUDA engine's host memory per rank beyond the process's own (engine/engine_gpu.cpp): the starting weights go
// through one fp32 buffer of the largest piece the rank fills (its piece of each unit at ZeRO 1-3, each whole unit
// at ZeRO-0); a checkpoint save or resume through one piece of the weights and both moments (fp32) and a moment's
// bf16 bits. With adapters: each whole unit of the base, then of the adapters; a checkpoint the adapters' pieces.
// Weight and checkpoint files are mapped and read a piece at a time, never copied whole.
struct HostStaging {
  int64_t init_bytes = 0, checkpoint_bytes = 0;
};
HostStaging plan_gpu_host_staging(const LlamaConfig& config, const MemoryLayout& run);
// One line for the logs: "host memory per rank ...".
std::string format_host_staging(const HostStaging& staging);

// The attention kernels a run uses (cuda): --attention when it names them; with auto, a resume keeps those its
// checkpoint's run used (state.json "kernels"), so that a resumed run computes what the run before it did. `note`
// gets a line when the choice differs from the checkpoint's, or follows it. The environment variable of earlier
// versions (TUNA_ATTENTION) is refused rather than ignored.
AttentionPath choose_attention(const std::string& option, const nlohmann::json& checkpoint_state, std::string* note);

// This rank's memory plan before anything large is allocated, as metrics.jsonl records it. On cpu it is printed
// and checked against the node's available memory (a run that cannot fit stops here); the CUDA engine checks its
// device plan itself when it is made.
nlohmann::json check_memory_plan(const LlamaConfig& config, const EngineOptions& options, const Mesh& mesh,
                                 double resident_mb_at_start, int ranks_on_node);

// "auto" -> cuda when this build has CUDA and a device is visible, else cpu. "cuda" without a visible device, or
// in a CPU-only build, fails with a message saying why.
Device resolve_device(const std::string& requested);

// The model on the chosen backend for this rank of `mesh`. `initial` fills the starting weights (every rank
// the same); null when the caller restores a checkpoint with import_state before the first step.
// `device_comm` makes the device dp and tp comms (cuda with dp > 1 or tp > 1 only; may be null otherwise).
std::unique_ptr<Engine> make_engine(const LlamaConfig& config, const EngineOptions& options, Mesh& mesh,
                                    const WeightFill& initial, const DeviceCommFactory& device_comm = nullptr);

}  // namespace tuna
