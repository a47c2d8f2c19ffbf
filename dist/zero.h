// ZeRO data parallelism over the dp group: one object that owns this rank's share of the training state
// (master weights, gradients, AdamW moments) and does every data-parallel collective of a step.
//
//   stage 0  every rank holds everything; gradients are all-reduced.
//   stage 1  AdamW moments are sharded; gradients are all-reduced, each rank updates its shard of the weights,
//            the new weights are all-gathered. The model's fp32 weights and gradients are the master copy and
//            the reduced gradient (updated and read in place), so a rank holds 8 + 8/dp bytes per parameter.
//   stage 2  gradients are sharded too: the model keeps no gradient buffer, Zero is its WeightStore for
//            gradients; each unit's gradient lives in a unit-sized buffer until the backward is done with
//            it, then is reduce-scattered and summed into the shard. Otherwise as stage 1.
//   stage 3  parameters are sharded too (FSDP): the model keeps no weights, Zero is its WeightStore.
//            Each unit (embedding, layer, head) is all-gathered into one of a pair of reused buffers just
//            before the forward uses it and again before the backward, the next one prefetched
//            (ShardedWeights, below). Each unit's gradient lives in a unit-sized buffer only until its
//            backward is done, then is reduce-scattered into the shard.
//
// Shards. Every unit is split over the dp ranks by shard_range (so one all-gather or reduce-scatter per
// unit moves it, and every rank has work in each): this rank's segments are its piece of each unit, in
// unit order. Stage 0 uses the same segments to spread checkpoint writes.
//
// When communication happens. Stages 0-1 accumulate micro-batch gradients locally and communicate only after
// the last micro-batch (finish_step). Stages 2-3 cannot: a whole gradient never exists on a rank (that is
// their memory saving), so each micro-batch's unit gradients are reduce-scattered as the backward finishes
// them and summed into the shard; on a GPU these overlap the backward of the layers below.
//
// Loss and norm. The step's loss is sum / count with both summed over dp ranks (llama.h's convention: one
// division per step, so the result equals the single-rank mean over the same global batch). The gradient
// norm is over the whole gradient: squares summed over the owned shard, then over dp, then over tp with
// replicated tensors counted once, then over the pipeline stages (each holds its own layers).
//
// Pipeline parallelism (pp): each stage's Zero trains the stage's layout (its own tensors) over its dp group; the
// loss (counted on the last stage) and the squares of the norm are summed over the pp group too, so every rank
// clips, skips a non-finite step and reports the loss as one rank would.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "model/llama.h"
#include "model/optimizer.h"

namespace tuna {

struct StepResult {
  double loss = 0;          // mean over every trained token of the step, all ranks
  int64_t tokens = 0;       // trained tokens of the step, all ranks
  OptimizerStats stats;
};

// A loss sum over the ranks of `dp` (the sum and the token count; one division per step, llama.h).
LossSum sum_over_ranks(Comm& dp, const LossSum& local);

// What a Zero trains: a flat layout, the model's buffers for it (whole weights and whole gradients, each empty where
// the stage keeps its own instead), and how Zero becomes the model's store of them (stages 2-3).
struct ZeroParams {
  const ParamLayout* layout = nullptr;
  std::vector<float>* params = nullptr;
  std::vector<float>* grads = nullptr;
  std::function<void(WeightStore*)> install;
};
ZeroParams model_parameters(Llama& model);  // the whole model: layout(), params, grads
// The LoRA adapters (lora_layout(), lora_params, lora_grads; the frozen base is held outside: whole, quantized, or a
// ShardedWeights at stage 3). Stages 0-2: their weights are whole on every rank; stage 3 shards them too (the model
// built with LlamaParallel::external_adapters).
ZeroParams lora_parameters(Llama& model);

// Weights sharded over dp (ZeRO-3): this rank's piece of every unit of a layout (dp_unit_pieces, shard order), and the
// buffers a unit is all-gathered into just before the model uses it, the next unit of the pass's plan gathered into
// the other buffer while this one computes (all_gather_start: on NCCL a communication stream, on MPI a non-blocking
// collective; a unit still in a buffer, the last layer between forward and backward, is not gathered again). Zero
// keeps one at stage 3 over what it trains; with adapters the frozen base is one on its own, which has no gradient.
class ShardedWeights final : public WeightStore {
 public:
  ShardedWeights(const ParamLayout& layout, Comm& dp);
  // this rank's pieces of every unit, concatenated (shard order); segments()[u] is unit u's piece.
  float* shard() { return shard_.data(); }
  const std::vector<Segment>& segments() const { return segments_; }
  int64_t shard_size() const { return static_cast<int64_t>(shard_.size()); }
  int64_t shard_offset(int unit) const { return unit_shard_offset_[unit]; }
  int buffers() const { return static_cast<int>(buffers_.size()); }
  void set_prefetch(bool on) { prefetch_ = on; }
  // fill(piece, out) writes each of this rank's pieces (segments()) of the (tp-local) layout into its place.
  void fill(const std::function<void(const Segment& piece, float* out)>& fill);
  // The shard is about to change (an update, a restore): no gather may still read it, and gathered copies go stale.
  void wait_pending();
  void invalidate();
  int64_t bytes() const;  // the shard and the unit buffers, allocated

  void plan(const std::vector<int>& order) override;
  const float* acquire(int unit) override;
  void release(int unit) override;
  float* grads(int unit) override;      // an error: these weights train elsewhere or not at all
  void grads_done(int unit) override;   // an error too

 private:
  struct UnitBuffer {
    std::vector<float> data;
    int unit = -1;          // the unit it holds (valid or arriving), -1: none
    bool in_use = false;
    bool valid = false;     // holds the current weights of `unit`
    CommRequest pending = 0;  // a prefetch in flight into it
  };
  void gather_into(UnitBuffer& b, int unit, bool async);
  void prefetch_next();

  const ParamLayout& layout_;
  Comm& dp_;
  std::vector<Segment> segments_;
  std::vector<int64_t> unit_shard_offset_;
  int64_t max_unit_ = 0;
  std::vector<float> shard_;
  std::vector<UnitBuffer> buffers_;
  std::vector<int> order_;
  size_t order_pos_ = 0;
  bool prefetch_ = true;
};

class Zero final : public WeightStore {
 public:
  // model must be built with LlamaParallel::external_weights iff stage == 3 and external_grads iff stage == 2.
  // For stages 0-2 the model's
  // params must already hold the initial weights (every rank the same); for stage 3, call
  // master_weights() and fill it (or import_state) before the first step.
  // pp: the pipeline's stages (null or size 1: none); stage 3 refuses it.
  Zero(Llama& model, const OptimizerConfig& opt, int stage, Comm& dp, Comm* tp, Comm* pp = nullptr);
  // The same over any ZeroParams (a model's, or its adapters', which need external_grads iff stage == 2).
  Zero(const ZeroParams& what, const OptimizerConfig& opt, int stage, Comm& dp, Comm* tp, Comm* pp = nullptr);

  int stage() const { return stage_; }
  // Stage 3: gather the next unit while the current one computes (default), or each unit only when used
  // (to measure what prefetching buys).
  void set_prefetch(bool on) {
    if (sharded_) sharded_->set_prefetch(on);
  }
  AdamW& optimizer() { return optimizer_; }
  // This rank's pieces of the flat layout (one per unit), in shard order.
  const std::vector<Segment>& segments() const { return segments_; }

  // Before a step's first micro-batch.
  void begin_step();
  // After its last: the loss over dp, gradient synchronization, norm, clip, AdamW, new weights.
  StepResult finish_step(const LossSum& local, double lr);
  // Sums an evaluation loss over dp (each dp rank evaluated its part of the split) and the pipeline's stages.
  LossSum all_reduce_loss(const LossSum& local);

  // Checkpoint exchange a piece at a time (segments() order): each piece's master weights and AdamW moments,
  // handed out in place (no copy) by export_state, and written in place by import_state's source, which then
  // refreshes whatever copies the stage keeps (gathers whole weights for stages 0-2, moments for stage 0).
  void export_state(const std::function<void(size_t, const float*, const float*, const float*)>& sink) const;
  void import_state(const std::function<void(size_t, float*, float*, float*)>& source);
  // Stage 3 initialization: fill(piece, out) writes each of this rank's pieces (segments()) of the (tp-local)
  // model into its place in the shard; no rank holds more than its shard.
  void fill_weights(const std::function<void(const Segment& piece, float* out)>& fill);

  // Bytes this rank holds for parameters, gradients and optimizer state (model buffers included), from
  // the allocated sizes; the same figure the test checks against malloc's own accounting.
  int64_t state_bytes() const;

  // WeightStore (stage 3).
  void plan(const std::vector<int>& order) override;
  const float* acquire(int unit) override;
  void release(int unit) override;
  float* grads(int unit) override;
  void grads_done(int unit) override;

 private:
  double global_norm(const float* grads, BufferOrder order);
  void gather_params_in_place();  // stages 1-2: every rank's pieces of the whole weights to every rank

  std::vector<float>& params_;  // whole (tp-local) weights (stages 0-2), updated in place
  std::vector<float>& grads_;   // whole gradients (stages 0-1)
  const ParamLayout& layout_;
  int stage_;
  Comm& dp_;
  Comm* tp_;
  Comm* pp_;
  std::vector<Segment> segments_;
  std::vector<int64_t> unit_shard_offset_;  // where unit u's piece starts in shard order
  int64_t shard_size_ = 0, max_unit_ = 0;
  AdamW optimizer_;
  std::unique_ptr<ShardedWeights> sharded_;  // stage 3: this rank's weights (master) and their gathering
  std::vector<float> grad_shard_;  // stages 2-3: this rank's gradient, shard order (stages 0-1: grads_)
  // Stages 2-3: unit-sized gradient buffers, the reduce-scatter output.
  struct GradBuffer {
    std::vector<float> data;
    int unit = -1;
    bool in_use = false;
  };
  std::vector<GradBuffer> grad_buffers_;
  std::vector<float> scatter_out_;
};

}  // namespace tuna
