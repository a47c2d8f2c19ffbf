#include "dist/pipeline.h"

#include <algorithm>

#include "core/error.h"

namespace tuna {

std::vector<PipelineOp> pipeline_schedule(int64_t pp, int64_t stage, int64_t micro_batches) {
  TUNA_CHECK(pp >= 1 && stage >= 0 && stage < pp && micro_batches >= 0, "pipeline schedule of stage ", stage, " of ",
             pp, " over ", micro_batches, " micro-batches");
  const int64_t warmup = std::min(pp - stage - 1, micro_batches), steady = micro_batches - warmup;
  std::vector<PipelineOp> ops;
  for (int64_t i = 0; i < warmup; i++) ops.push_back({true, i});
  for (int64_t i = 0; i < steady; i++) ops.push_back({true, warmup + i}), ops.push_back({false, i});
  for (int64_t i = steady; i < micro_batches; i++) ops.push_back({false, i});
  return ops;
}

bool pipeline_gradient_ahead(int64_t pp, int64_t stage, int64_t micro_batches) {
  return stage < pp - 1 && micro_batches > pp - stage - 1;
}

PipelineLinks pipeline_links(const ParamLayout& stage_layout, bool tie_word_embeddings, bool frozen, int stage,
                             int stages) {
  PipelineLinks links;
  links.recv_activations = str("stage ", stage, ": activations from stage ", stage - 1);
  links.send_activations = str("stage ", stage, ": activations to stage ", stage + 1);
  links.recv_gradient = str("stage ", stage, ": input gradient from stage ", stage + 1);
  links.send_gradient = str("stage ", stage, ": input gradient to stage ", stage - 1);
  links.tied_exchange = str("stage ", stage, ": the tied embedding's gradient");
  const ParamTensor* tied = stage_layout.tied_copy();
  if (!tied && tie_word_embeddings && stage_layout.has_embedding()) tied = stage_layout.find("model.embed_tokens.weight");
  if (tied && !frozen) links.tied = tied, links.tied_peer = tied->copy ? 0 : stages - 1;
  return links;
}

}  // namespace tuna
