// Pipeline stages (--pp): which decoder layers each stage runs. The embedding goes with the first stage, the final
// norm and lm_head with the last. Under 1F1B the slowest stage sets the pace of every micro-batch, so the layers are
// split to make the costliest stage as cheap as it can be, counting the head's product as the work it is (about a
// third of a 70B layer, most of a 1B one). The trainer, the memory plan and build/plan all take this one split; the
// schedule that runs the stages is dist/pipeline.h's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace tuna {

class ParamLayout;  // model/layout.h, which includes this header (its stage constructor takes a PipelineStage)

struct PipelineStage {
  int64_t layer_begin = 0, layer_end = 0;  // decoder layers [layer_begin, layer_end)
  bool embedding = false;                  // the first stage: the token embedding
  bool head = false;                       // the last stage: the final norm, lm_head and the loss
  double flops_per_token = 0;              // this stage's forward + backward FLOPs per token (the split's cost)
  int64_t layers() const { return layer_end - layer_begin; }
};

// The split of `config`'s layers over pp stages at sequence length seq (attention's cost grows with it). Every
// stage gets at least one layer; among the splits whose costliest stage is cheapest, earlier stages get fewer
// layers (the first stage holds the most micro-batches in flight). pp is at least 1 and at most the layers (the
// support table's rule, model/support.h; its place_layout is how the run's layout gets the split).
std::vector<PipelineStage> pipeline_stages(const LlamaConfig& config, int64_t pp, int64_t seq);

// The units of `layout` (model/layout.h: the embedding, each layer, the head) that `stage` holds, in order: the
// embedding on the first stage, its layers, the final norm (and an untied lm_head) on the last. With tied embeddings
// and more than one stage the last stage holds the embedding unit too, as its lm_head: a copy with its own gradient
// and optimizer state (Megatron's way; the copies' gradients are summed between the two stages so they stay equal).
// At pp 1 the one stage holds every unit once.
std::vector<int> pipeline_stage_units(const ParamLayout& layout, const PipelineStage& stage);
// "stage 0: embedding + layers 0-39 (40), stage 1: layers 40-79 (40) + head; costliest stage 50.3% of the model's
// FLOPs": the line the trainer prints at start.
std::string format_pipeline_stages(const std::vector<PipelineStage>& stages);

}  // namespace tuna
