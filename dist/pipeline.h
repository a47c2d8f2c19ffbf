// Pipeline parallelism (--pp): the 1F1B schedule and the one driver that runs a stage through it, for both engines.
// Which layers each stage holds is model/pipeline.h's split; the engines hand the driver their stage
// (PipelineStageModel), and the driver does every send and receive between the stages (the shape of torchtitan's
// pipeline schedules: a stage object with its passes and buffers, and a schedule's step over the micro-batches).
//
// A step (PipelineDriver::step): the stage's micro-batches in the 1F1B order, each forward's input received from the
// previous stage and each backward's output gradient from the next, each pass's result sent on without waiting; then,
// with tied embeddings, the first and last stages exchange the table's gradient and each adds the other's, so both
// hold the sum (bit for bit: a + b == b + a) and the identical updates keep the copies equal.
//
// Overlap. Where a stage computes on a queue of its own (a CUDA stream), its hooks order the transfers against that
// queue instead of the host: a send waits there for the pass that wrote its buffer (before_transfer), a pass for the
// receive it reads and the send whose buffer it rewrites (compute_waits_for), so the host queues pass after pass
// without waiting for a transfer. There, in the steady 1F1B phase, a stage before the last posts the receive of the
// next backward's output gradient before it queues the forward between them (receives_gradient_ahead): that transfer
// runs while the forward computes (the output gradient's buffer is the backward's alone; the last send out of it is
// ordered before it on the transfers' queue). The receive of the next forward's input is not posted ahead: it lands in
// the activation slot the backward before it reads, and the memory plans have no second input buffer. On the host
// (the CPU engine) a pass waits for a transfer by waiting for it, and nothing is posted ahead: the host computes on the
// thread that would progress the receive, so it would complete no sooner.
//
// Order and deadlock. Each send and receive is flushed as a group of its own, so on a device comm's queue they run
// one at a time in the order started, and an NCCL send or receive may wait until its peer reaches the matching one.
// Between stages s and s+1 both then meet in the same order: s+1 sends the gradient of each backward before receiving
// the input of the forward after it, and s posts that gradient's receive just before the send of the forward's output
// that precedes the backward (in 1F1B s's forward before backward k is one micro-batch later than s+1's). That holds
// only where s has a steady phase (pipeline_gradient_ahead); in a step of fewer micro-batches than s's warm-up, the
// gradient is received where the backward starts, as everything else. Every transfer also waits for the compute
// queued before it, so none can need a pass that waits for a later transfer. A rendezvous model of both queues per
// stage finishes for pp 2-8 over 0-19 micro-batches, and deadlocks when a stage in its warm-up posts ahead
// (tests/dist/test_pipeline.cpp, which also checks that this driver starts its transfers in the model's order).
//
// --comm_timeout. Every request gets a bounded host wait (Comm::wait): where the compute queue waits on one, the host
// waits for it one pass later, before the next pass (whose token upload waits for the compute queue:
// LlamaGpu::upload_tokens), and on the last stage before the forward whose loss the host reads; the others at the end
// of the step. A dead stage thus stops this one inside a wait that names the send or receive, never in an unbounded
// synchronize.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "model/layout.h"
#include "model/llama.h"  // LossSum

namespace tuna {

// One step of a stage's schedule: the forward or the backward of a micro-batch.
struct PipelineOp {
  bool forward = true;
  int64_t micro_batch = 0;
};
// 1F1B (PipeDream-Flush, Megatron's default): stage `stage` of pp runs pp - stage - 1 forwards first (warm-up), then
// alternates one forward and one backward (steady state), then the remaining backwards (cool-down). A stage then
// holds at most pp - stage micro-batches' activations at once (micro-batch i can use slot i mod (pp - stage)),
// against all of them under GPipe's all-forwards-then-all-backwards; the bubble is the same.
std::vector<PipelineOp> pipeline_schedule(int64_t pp, int64_t stage, int64_t micro_batches);
// Whether stage `stage` (before the last) may post the receive of a backward's output gradient before the forward
// that precedes that backward in its schedule (the overlap above): only when the stage has a steady phase (more
// micro-batches than its warm-up forwards). There the next stage sends that gradient before it needs the forward's
// output; in a warm-up followed at once by the cool-down it needs it first.
bool pipeline_gradient_ahead(int64_t pp, int64_t stage, int64_t micro_batches);

// What a pipeline stage needs to talk to its neighbours: the labels of its sends and receives, which a timeout names
// ("recv 'stage 1: activations from stage 0' (n elements from rank r)"), and with tied embeddings the tensor whose
// gradient the first and last stages exchange after the step's backwards (the table on the first stage, its copy on
// the last) and the stage holding the other one. No tensor when the table is not tied, sits on neither end, or is
// frozen (adapters train, so it has no gradient).
struct PipelineLinks {
  std::string recv_activations, send_activations, recv_gradient, send_gradient, tied_exchange;
  const ParamTensor* tied = nullptr;
  int tied_peer = -1;
};
PipelineLinks pipeline_links(const ParamLayout& stage_layout, bool tie_word_embeddings, bool frozen, int stage,
                             int stages);

// One micro-batch of a step, as the loader gives it: inputs, targets and positions, [batch, seq] each (positions may
// be null: one document per row).
struct MicroBatch {
  const int32_t* inputs = nullptr;
  const int32_t* targets = nullptr;
  const int32_t* positions = nullptr;
  int64_t batch = 0, seq = 0;
};

// A pipeline stage as the driver sees it: its passes and the buffers at its boundaries (model/llama.h forward_stage's
// contract, which Llama and LlamaGpu both keep), and the device's part of the ordering as hooks, whose defaults are the
// host's. Buffers are in wire_type() elements, where the stage's comm reads and writes them (host or device memory).
class PipelineStageModel {
 public:
  virtual ~PipelineStageModel() = default;

  // Activation slots: micro-batch i of a step uses slot i mod in_flight() from its forward to its backward.
  virtual int64_t in_flight() const = 0;
  // Elements of the activation (and of its gradient) that crosses a boundary for micro-batch b: the rows of the
  // residual stream this rank holds, times the hidden size.
  virtual int64_t boundary_elements(const MicroBatch& b) const = 0;
  virtual void* input(int64_t slot) = 0;          // the previous stage's activation lands here (not the first stage)
  virtual const void* output() const = 0;         // what the forward sends to the next stage (not the last)
  virtual void* output_grad() = 0;                // the next stage's input gradient lands here (not the last)
  virtual const void* input_grad() const = 0;     // what the backward sends to the previous stage (not the first)
  // Before each pass of micro-batch i of a step, its forward's and its backward's (1F1B runs other micro-batches'
  // passes between the two): LoRA keys its dropout masks by it, so that they do not depend on the order.
  virtual void begin_pass(int64_t micro_batch) {}
  // The passes: the loss sums on the last stage (nothing elsewhere); backward_follows false for evaluation.
  virtual LossSum forward(int64_t slot, const MicroBatch& b, bool backward_follows) = 0;
  virtual void backward(int64_t slot, const MicroBatch& b) = 0;
  // Tied embeddings over stages (PipelineLinks::tied): the stage's fp32 gradient buffer (the layout's order; the
  // table's at its offset), the buffer the other stage's gradient of the table lands in, and adding it into this one's.
  virtual float* gradients() = 0;
  virtual float* tied_peer_gradient() = 0;
  virtual void add_tied_peer_gradient(float* mine, const float* theirs, int64_t n) = 0;

  // Hooks. The element type of the activations on the wire (fp32 on the host, bf16 on a GPU).
  virtual CommType wire_type() const = 0;
  // Orders the transfer started next after the compute queued so far (what a send reads was written there, and what
  // a receive overwrites was last read there). The host: nothing to do.
  virtual void before_transfer() {}
  // The compute queued after this call waits for `request` (a receive it reads, a send whose buffer it rewrites).
  // Returns the request when the host still owes it its one bounded wait (Comm::wait), which the driver then makes
  // before the next pass; 0 when it waited already. The host: waits now.
  virtual CommRequest compute_waits_for(Comm& comm, CommRequest request) {
    comm.wait(request);
    return 0;
  }
  // Whether the next backward's output gradient may be received while a forward computes (the overlap above): only
  // where the compute runs on a queue of its own. output_grad() must then be the backward's alone.
  virtual bool receives_gradient_ahead() const { return false; }
};

// A model as a stage: the slots, boundary buffers and passes forwarded to the model's stage interface, which the CPU
// model (Llama) and the GPU model (LlamaGpu) share; the engines' stages (CpuStage, GpuStage) add the gradients and
// the hooks. key_dropout keys a micro-batch's LoRA dropout masks (begin_pass).
template <typename Model>
class ModelStage : public PipelineStageModel {
 public:
  ModelStage(Model& model, std::function<void(int64_t)> key_dropout)
      : model_(model), key_dropout_(std::move(key_dropout)) {}
  int64_t in_flight() const override { return model_.in_flight(); }
  int64_t boundary_elements(const MicroBatch& b) const override {
    return model_.residual_rows(b.batch * b.seq) * model_.config().hidden_size;
  }
  void* input(int64_t slot) override { return model_.stage_input(slot); }
  const void* output() const override { return model_.stage_output(); }
  void* output_grad() override { return model_.stage_output_grad(); }
  const void* input_grad() const override { return model_.stage_input_grad(); }
  void begin_pass(int64_t micro_batch) override { key_dropout_(micro_batch); }
  LossSum forward(int64_t slot, const MicroBatch& b, bool backward_follows) override {
    return model_.forward_stage(slot, b.inputs, b.targets, b.batch, b.seq, b.positions, backward_follows);
  }
  void backward(int64_t slot, const MicroBatch& b) override {
    model_.backward_stage(slot, b.inputs, b.batch, b.seq, b.positions);
  }

 protected:
  Model& model_;

 private:
  std::function<void(int64_t)> key_dropout_;
};

// Runs one stage of a pipeline over `stages` (this rank's comm over the pipeline's stages: the host one, or a device
// comm on the stage's transfer queue), in the 1F1B order (see the top of this file).
class PipelineDriver {
 public:
  PipelineDriver(Comm& stages, PipelineStageModel& stage, PipelineLinks links);
  // The step's micro-batches through this stage, the loss summed over those whose loss this stage computes (the last
  // stage's), then the tied table's gradient exchanged.
  LossSum step(const std::vector<MicroBatch>& micro_batches);
  // One micro-batch down the pipe without a backward (evaluation; the loss on the last stage).
  LossSum forward_loss(const MicroBatch& b);
  // One micro-batch's forward through the stages with `compute` in place of the stage's loss pass (multiple-choice
  // scoring's log-probs: model/llama.h forward_target_logps): its input received first, its output sent after.
  void forward_pass(const MicroBatch& b, const std::function<void()>& compute);
  const PipelineLinks& links() const { return links_; }

 private:
  void exchange_tied_gradient();

  Comm& comm_;
  PipelineStageModel& stage_;
  PipelineLinks links_;
};

}  // namespace tuna
