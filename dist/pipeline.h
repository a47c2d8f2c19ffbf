// Pipeline parallelism (--pp): the 1F1B schedule of a stage, and the labels of a stage's sends and receives. Which
// layers each stage holds is model/pipeline.h's split.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/layout.h"

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
// that precedes that backward in its schedule (the CUDA engine's overlap, engine/engine_gpu.cpp pipeline_step): only
// when the stage has a steady phase (more micro-batches than its warm-up forwards). There the next stage sends that
// gradient before it needs the forward's output; in a warm-up followed at once by the cool-down it needs it first.
bool pipeline_gradient_ahead(int64_t pp, int64_t stage, int64_t micro_batches);

// What a pipeline stage (--pp) of either engine needs to talk to its neighbours: the labels of its sends and receives,
// which a timeout names ("recv 'stage 1: activations from stage 0' (n elements from rank r)"), and with tied embeddings
// the tensor whose gradient the first and last stages exchange after the step's backwards (the table on the first
// stage, its copy on the last) and the stage holding the other one. No tensor when the table is not tied, sits on
// neither end, or is frozen (adapters train, so it has no gradient).
struct PipelineLinks {
  std::string recv_activations, send_activations, recv_gradient, send_gradient, tied_exchange;
  const ParamTensor* tied = nullptr;
  int tied_peer = -1;
};
PipelineLinks pipeline_links(const ParamLayout& stage_layout, bool tie_word_embeddings, bool frozen, int stage,
                             int stages);

}  // namespace tuna
