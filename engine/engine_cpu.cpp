// The CPU engine: Llama (model/llama.h) + Zero (dist/zero.h), fp32, every parallel mode; and the CPU forward model.
//
// The engine takes the run's layout (engine_memory_layout, placed): this rank's Llama is built from it (its stage, its
// activation slots, sp, and which buffers Zero or a frozen base holds instead of the model).
//
// Pipeline parallelism (--pp): this rank's Llama is its stage (model/pipeline.h's split), with an activation slot
// for each micro-batch it can hold in flight under 1F1B (MemoryLayout::in_flight). forward_backward_step hands the step's
// micro-batches to the pipeline driver (dist/pipeline.h), which runs them in the 1F1B order over the host comm of the
// stages, fp32 on the wire, with the host's ordering: each input and output gradient received with a blocking wait,
// each send started without waiting and waited for only before its buffer is rewritten, so no two stages can block on
// each other's sends. With tied embeddings the last stage's lm_head is a copy of the first stage's table
// (model/layout.h ParamTensor::copy), whose gradients the driver sums between the two stages after the step's
// backwards, so the identical updates keep the copies equal.
//
// LoRA adapters with --pp: a stage holds the frozen base of its units and the adapters of its layers (model/lora.h
// lora_layout of the stage: global names and streams), and Zero trains those over dp with the loss and the norm summed
// over the stages, as for a full fine-tune. The frozen table has no gradient, so tied embeddings need no exchange.
// Each micro-batch's dropout masks are keyed by its index in the step, as at pp 1 (where the micro-batches run in
// order), and set again before its backward, which regenerates them after other micro-batches' forwards.
//
// Preference objectives with --pp: dist/pipeline_pairs.h, over this engine's stage and driver links, with Llama's
// passes (the last stage computes the log-probs, the loss and its token weights; the sums are broadcast from it).
#include <cmath>
#include <functional>

#include "core/error.h"
#include "core/memory.h"
#include "dist/pipeline.h"  // PipelineDriver, PipelineStageModel
#include "dist/pipeline_pairs.h"  // PipelinePairs: the preference objectives over the stages
#include "engine/backends.h"
#include "model/preference_step.h"  // llama_pair_step: the preference objectives' passes
#include "model/quantized_weights.h"  // QuantizedWeights: a quantized frozen base

namespace tuna {

namespace {

// The CPU model as a pipeline stage (dist/pipeline.h): fp32 activations in host memory, ordered by the host (the
// interface's default hooks).
class CpuStage final : public ModelStage<Llama> {
 public:
  CpuStage(Llama& model, std::function<void(int64_t)> key_dropout, std::vector<float>& tied_peer_grad)
      : ModelStage(model, std::move(key_dropout)), tied_peer_grad_(tied_peer_grad) {}
  float* gradients() override { return model_.grads.data(); }
  float* tied_peer_gradient() override { return tied_peer_grad_.data(); }
  void add_tied_peer_gradient(float* mine, const float* theirs, int64_t n) override {
    for (int64_t i = 0; i < n; i++) mine[i] += theirs[i];
  }
  CommType wire_type() const override { return CommType::F32; }

 private:
  std::vector<float>& tied_peer_grad_;
};

class CpuEngine final : public Engine {
 public:
  CpuEngine(const LlamaConfig& config, const EngineOptions& o, const MemoryLayout& run, Mesh& mesh,
            const WeightFill& initial)
      : config_(config),
        model_(config, run, mesh.tp.get()),
        seed_(o.seed),
        dp_rank_(mesh.dp_rank),
        pp_(mesh.pp_size > 1 ? mesh.pp.get() : nullptr) {
    if (pp_) {
      PipelineLinks links =
          pipeline_links(model_.layout(), config.tie_word_embeddings, o.lora.enabled(), pp_->rank(), pp_->size());
      if (const ParamTensor* tied = links.tied) {
        allocate_host(str("the tied embedding's gradient from stage ", links.tied_peer, " (", tied->numel, " parameters)"),
                      uint64_t(tied->numel) * sizeof(float), [&] { tied_peer_grad_.assign(tied->numel, 0.0f); });
      }
      pipeline_stage_ = std::make_unique<CpuStage>(
          model_, [this](int64_t micro_batch) { key_dropout(micro_batch); }, tied_peer_grad_);
      pipeline_pairs_ = std::make_unique<PipelinePairs>(*pp_, *pipeline_stage_, links, *pp_,
                                                        [this](const PairBatch& b) { return llama_passes(model_, b); });
      pipeline_ = std::make_unique<PipelineDriver>(*pp_, *pipeline_stage_, std::move(links));
    }
    // Stages 0-2 keep the (tp-local) weights in model.params, which Zero reads at construction; stage 3 keeps
    // only its shard, filled piece by piece.
    model_.set_document_mode(o.documents);
    if (o.base_quant != BaseQuant::None) {
      // QLoRA: the base quantized from the starting weights a unit at a time (never the fp32 model beside it).
      TUNA_CHECK(static_cast<bool>(initial), "a quantized base needs its starting weights");
      // With tp each rank quantizes whole tensors and keeps its blocks, so the base does not depend on tp.
      const ParamLayout whole = run.pp > 1 ? ParamLayout(config, 0, 1, run.stage()) : ParamLayout(config);
      quantized_base_ = std::make_unique<QuantizedWeights>(model_.layout(), o.base_quant, initial,
                                                           mesh.tp_size > 1 ? &whole : nullptr);
      model_.set_weight_store(quantized_base_.get());
    } else if (o.lora.enabled() && o.zero == 3) {
      // ZeRO-3 with adapters: the frozen base sharded over dp like a full fine-tune's weights (each rank fills its
      // pieces), gathered a unit at a time; it has no gradient and no optimizer state.
      TUNA_CHECK(static_cast<bool>(initial), "a frozen base needs its starting weights");
      frozen_base_ = std::make_unique<ShardedWeights>(model_.layout(), *mesh.dp);
      frozen_base_->set_prefetch(o.zero_prefetch);
      frozen_base_->fill([&](const Segment& piece, float* out) { initial(model_.layout(), piece, out); });
      model_.set_weight_store(frozen_base_.get());
    } else if (initial && o.zero != 3) {
      fill_whole(initial, model_.layout(), model_.params.data());
    }
    if (o.lora.enabled()) {
      // LoRA: the base is frozen (filled, quantized or sharded above); Zero trains the adapters alone, every rank
      // starting from the same ones (drawn per global tensor, or read: each rank its own blocks; at stage 3 its pieces).
      const WeightFill adapters = o.adapters ? o.adapters : initial_adapters(o.seed);
      if (o.zero != 3) fill_whole(adapters, model_.lora_layout().params, model_.lora_params.data());
      zero_ = std::make_unique<Zero>(lora_parameters(model_), o.opt, o.zero, *mesh.dp, mesh.tp.get(), pp_);
      zero_->set_prefetch(o.zero_prefetch);
      if (o.zero == 3)
        zero_->fill_weights(
            [&](const Segment& piece, float* out) { adapters(model_.lora_layout().params, piece, out); });
      return;
    }
    zero_ = std::make_unique<Zero>(model_, o.opt, o.zero, *mesh.dp, mesh.tp.get(), pp_);
    zero_->set_prefetch(o.zero_prefetch);
    if (o.zero == 3 && initial)
      zero_->fill_weights([&](const Segment& piece, float* out) { initial(model_.layout(), piece, out); });
  }

  std::string describe() const override { return "cpu"; }
  const ParamLayout& layout() const override {
    return model_.lora().enabled() ? model_.lora_layout().params : model_.layout();
  }
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
  // The preference passes: on the whole model, or down the pipeline's stages (the top of this file).
  PreferenceSums forward_pairs(const PairBatch& batch, const ObjectiveConfig& objective, const PreferenceStep& step,
                               bool want_grad) override {
    if (!pipeline_) {
      if (want_grad) key_dropout(micro_batch_++);
      return llama_pair_step(model_, objective, batch, step, want_grad);
    }
    TUNA_CHECK(!want_grad, "a pipeline trains a step's pairs together (forward_pairs_step)");
    return pipeline_pairs_->forward(batch, objective, step);
  }
  PairStepSums forward_pairs_step(const std::vector<PairBatch>& micro_batches, const ObjectiveConfig& objective,
                                  const PreferenceStep& step) override {
    if (!pipeline_) return Engine::forward_pairs_step(micro_batches, objective, step);
    const PipelinePairSums sums = pipeline_pairs_->step(micro_batches, objective, step);
    return PairStepSums{sums.sums, sums.counted};
  }
  void pair_logps(const PairBatch& batch, double* chosen, double* rejected) override {
    if (!pipeline_) return llama_pair_logps(model_, batch, /*adapters_off=*/false, chosen, rejected);
    pipeline_pairs_->pair_logps(batch, chosen, rejected);
  }

  void target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq, const int32_t* positions,
                    float* logps, uint8_t* greedy) override {
    if (!pipeline_) return model_.forward_target_logps(inputs, targets, batch, seq, positions, logps, greedy);
    pipeline_->forward_pass(MicroBatch{inputs, targets, positions, batch, seq}, [&] {
      model_.forward_target_logps(inputs, targets, batch, seq, positions, logps, greedy);
    });
    // The last stage has them; every stage reports them (the metrics are printed by rank 0, a first stage).
    const int last = pp_->size() - 1;
    pp_->broadcast(logps, batch * seq * static_cast<int64_t>(sizeof(float)), last, "eval_tasks log-probs");
    pp_->broadcast(greedy, batch * seq, last, "eval_tasks greedy");
  }

  const std::vector<Segment>& segments() const override { return zero_->segments(); }
  void export_state(const StateSink& sink) const override { zero_->export_state(sink); }
  void import_state(const StateSource& source) override { zero_->import_state(source); }
  int64_t steps_taken() const override { return zero_->optimizer().steps_taken; }
  void set_steps_taken(int64_t steps) override { zero_->optimizer().steps_taken = steps; }

  std::string memory_report() const override { return ""; }  // the trainer prints the host plan itself
  int64_t activation_bytes() const override { return model_.activation_bytes(); }
  // With LoRA: the adapters' state (Zero's) and the frozen base's weights; no base gradient or moment exists.
  int64_t state_bytes() const override {
    return zero_->state_bytes() +
           (model_.lora().enabled() ? static_cast<int64_t>(model_.params.capacity() * sizeof(float)) : 0) +
           (quantized_base_ ? quantized_base_->bytes().total() : 0) + (frozen_base_ ? frozen_base_->bytes() : 0);
  }
  double flops_per_token(int64_t seq) const override {
    return model_.lora().enabled() ? lora_flops_per_token(config_, model_.lora(), seq)
                                   : model_flops_per_token(config_, seq);
  }
  double peak_flops() const override { return NAN; }
  EngineStatus status() override {
    const HostMemory mem = host_memory();
    EngineStatus s;
    s.host_mb = mem.resident_mb, s.host_peak_mb = mem.peak_mb;
    return s;
  }

 private:
  // Dropout masks by (seed, step, micro-batch of the step, dp rank): a resumed run draws the ones it would have.
  void key_dropout(int64_t micro_batch) {
    if (model_.lora().enabled())
      model_.set_lora_dropout_key(lora_dropout_key(seed_, steps_taken(), micro_batch, dp_rank_));
  }

  LlamaConfig config_;
  Llama model_;
  uint64_t seed_;
  int dp_rank_;
  Comm* pp_;  // the pipeline's stages (null without --pp)
  std::vector<float> tied_peer_grad_;  // tied embeddings over stages: the other stage's gradient of the table
  std::unique_ptr<CpuStage> pipeline_stage_;  // --pp: this model as the driver's stage,
  std::unique_ptr<PipelineDriver> pipeline_;  // and the driver
  std::unique_ptr<PipelinePairs> pipeline_pairs_;  // --pp: the preference objectives' passes over the stages
  int64_t micro_batch_ = 0;  // of the current step (LoRA dropout)
  std::unique_ptr<QuantizedWeights> quantized_base_;  // QLoRA: the frozen base (the model reads it as its store)
  std::unique_ptr<ShardedWeights> frozen_base_;        // LoRA at ZeRO-3: the frozen base, sharded over dp
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
  void forward_target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                            const int32_t* positions, float* logps, uint8_t* greedy) override {
    model_.forward_target_logps(inputs, targets, batch, seq, positions, logps, greedy);
  }
  bool packs_documents() const override { return true; }
  bool shares_context() const override { return true; }
  void forward_shared_logps(const int32_t* context, int64_t c, const int32_t* tokens, const int32_t* targets, int64_t k,
                            int64_t m, float* logps, uint8_t* greedy) override {
    KvCache one = model_.make_kv_cache(1, c + m);
    if (c > 0) model_.prefill_cache(context, 1, c, one);
    KvCache rows = model_.repeat_kv_cache(one, k, c + m);
    model_.forward_cached_logps(tokens, k, m, rows, targets, logps, greedy);
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


std::unique_ptr<Engine> make_cpu_engine(const LlamaConfig& config, const EngineOptions& options, const MemoryLayout& run,
                                        Mesh& mesh, const WeightFill& initial) {
  return std::make_unique<CpuEngine>(config, options, run, mesh, initial);
}

std::unique_ptr<ForwardModel> make_cpu_forward_model(const LlamaConfig& config, int64_t max_batch, int64_t max_seq,
                                                     const WeightFill& weights, const DocumentMode& documents) {
  return std::make_unique<CpuForwardModel>(config, max_batch, max_seq, weights, documents);
}

}  // namespace tuna
