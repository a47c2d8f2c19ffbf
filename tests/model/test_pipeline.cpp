// The pipeline split: every layer in exactly one stage, the embedding first and the head last, the costliest stage as
// cheap as any contiguous split makes it, and earlier stages no larger than they must be; and a stage's parameter
// layout (its tensors, under the whole model's names, blocks and random streams). The schedule: tests/dist.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "core/error.h"
#include "model/config.h"
#include "model/layout.h"
#include "model/pipeline.h"
#include "model/support.h"  // place_layout

namespace tuna {
namespace {

LlamaConfig shape(int64_t hidden, int64_t ffn, int64_t layers, int64_t heads, int64_t kv, int64_t vocab) {
  LlamaConfig c;
  c.hidden_size = hidden, c.intermediate_size = ffn, c.num_hidden_layers = layers;
  c.num_attention_heads = heads, c.num_key_value_heads = kv, c.head_dim = hidden / heads, c.vocab_size = vocab;
  return c;
}

// The cheapest costliest stage over every contiguous split, by brute force (small layer counts).
double brute_force_best(const std::vector<double>& layer_cost, double head, int64_t pp) {
  const int64_t L = static_cast<int64_t>(layer_cost.size());
  double best = std::numeric_limits<double>::infinity();
  std::vector<int64_t> cut(pp + 1);
  const auto recurse = [&](auto&& self, int64_t s, int64_t begin) -> void {
    if (s == pp - 1) {
      double worst = head;
      for (int64_t l = begin; l < L; l++) worst += layer_cost[l];
      if (begin >= L) return;
      for (int64_t t = 0; t < s; t++) {
        double c = 0;
        for (int64_t l = cut[t]; l < cut[t + 1]; l++) c += layer_cost[l];
        worst = std::max(worst, c);
      }
      best = std::min(best, worst);
      return;
    }
    for (int64_t end = begin + 1; end < L; end++) {
      cut[s] = begin, cut[s + 1] = end;
      self(self, s + 1, end);
    }
  };
  cut[0] = 0;
  recurse(recurse, 0, 0);
  return best;
}

TEST(Pipeline, SplitsCoverEveryLayerOnceWithEmbeddingFirstAndHeadLast) {
  const LlamaConfig c = shape(256, 704, 11, 8, 2, 3000);
  for (int64_t pp = 1; pp <= 11; pp++) {
    const std::vector<PipelineStage> stages = pipeline_stages(c, pp, 512);
    ASSERT_EQ(static_cast<int64_t>(stages.size()), pp);
    int64_t next = 0;
    for (int64_t s = 0; s < pp; s++) {
      EXPECT_EQ(stages[s].layer_begin, next);
      EXPECT_GE(stages[s].layers(), 1);
      EXPECT_EQ(stages[s].embedding, s == 0);
      EXPECT_EQ(stages[s].head, s == pp - 1);
      next = stages[s].layer_end;
    }
    EXPECT_EQ(next, 11);
  }
}

TEST(Pipeline, CostliestStageIsAsCheapAsAnySplitMakesIt) {
  // A large vocabulary (the head worth several layers) and a small one (worth a fraction of one).
  for (int64_t vocab : {int64_t(64), int64_t(3000), int64_t(40000)}) {
    const LlamaConfig c = shape(128, 352, 9, 4, 2, vocab);
    for (int64_t pp = 1; pp <= 5; pp++) {
      const std::vector<PipelineStage> stages = pipeline_stages(c, pp, 256);
      double worst = 0, layer = stages[0].flops_per_token / stages[0].layers(), head = 0;
      if (pp == 1) head = stages[0].flops_per_token - 9 * layer;
      for (const PipelineStage& s : stages) worst = std::max(worst, s.flops_per_token);
      if (pp > 1) head = stages.back().flops_per_token - stages.back().layers() * layer;
      EXPECT_NEAR(worst, brute_force_best(std::vector<double>(9, layer), head, pp), 1e-6 * worst)
          << "vocab " << vocab << ", pp " << pp;
    }
  }
}

TEST(Pipeline, Llama2_70bOnTwoStagesSplitsFortyForty) {
  const LlamaConfig c = shape(8192, 28672, 80, 64, 8, 32000);
  const std::vector<PipelineStage> stages = pipeline_stages(c, 2, 4096);
  EXPECT_EQ(stages[0].layers(), 40);
  EXPECT_EQ(stages[1].layers(), 40);
  // The head is worth about 0.3 of a layer here, too little to move a layer off the last stage.
  EXPECT_NE(format_pipeline_stages(stages).find("stage 0: embedding + layers 0-39 (40), stage 1: layers 40-79 (40) + head"),
            std::string::npos)
      << format_pipeline_stages(stages);
}

TEST(Pipeline, AHeadWorthSeveralLayersTakesLayersOffTheLastStage) {
  // 4 layers of a 64-wide model and a 50,000-token vocabulary: the head costs more than all the layers.
  const LlamaConfig c = shape(64, 176, 4, 4, 2, 50000);
  const std::vector<PipelineStage> stages = pipeline_stages(c, 2, 64);
  EXPECT_EQ(stages[0].layers(), 3);
  EXPECT_EQ(stages[1].layers(), 1);
}

TEST(Pipeline, RefusesMoreStagesThanLayers) {
  // The user's --pp meets the support table first (place_layout); pipeline_stages only checks its contract.
  const LlamaConfig c = shape(64, 176, 4, 4, 2, 1000);
  for (const auto& [pp, message] : {std::pair<int64_t, const char*>{0, "option 'pp': expected at least 1 pipeline stage"},
                                    {5, "option 'pp': expected 1 to 4 stages"}}) {
    MemoryLayout l;
    l.pp = pp;
    l.micro_batch = 1, l.seq_len = 64;
    try {
      place_layout(c, l);
      ADD_FAILURE() << "pp " << pp << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
    EXPECT_THROW(pipeline_stages(c, pp, 64), Error) << "pp " << pp;
  }
}

// The stages' layouts hold the whole model's tensors between them, each once, under its name, block and random
// stream; units keep the model's numbering (other stages' empty). With tied embeddings the last stage holds a copy
// of the table as its lm_head (the table's stream, marked as a copy), and the first stage the table.
TEST(Pipeline, StageLayoutsPartitionTheModel) {
  LlamaConfig c = shape(64, 176, 5, 4, 2, 1000);
  for (int tp : {1, 2}) {
    const ParamLayout whole(c, 0, tp);
    std::vector<int> seen(whole.tensors().size(), 0);
    const std::vector<PipelineStage> stages = pipeline_stages(c, 3, 64);
    for (const PipelineStage& st : stages) {
      const ParamLayout stage(c, 0, tp, st);
      EXPECT_EQ(stage.num_units(), whole.num_units());
      EXPECT_EQ(stage.has_embedding(), st.embedding);
      EXPECT_EQ(stage.has_head(), st.head);
      EXPECT_FALSE(stage.whole());
      int64_t total = 0;
      for (int u = 0; u < stage.num_units(); u++) {
        const auto [begin, end] = stage.unit_range(u);
        const bool held = (u == 0 && st.embedding) || (u == stage.head_unit() && st.head) ||
                          (u >= 1 + st.layer_begin && u < 1 + st.layer_end);
        EXPECT_EQ(end > begin, held) << "unit " << u;
        total += end - begin;
      }
      EXPECT_EQ(total, stage.total());
      for (const ParamTensor& t : stage.tensors()) {
        const ParamTensor* w = whole.find(t.name);
        ASSERT_NE(w, nullptr) << t.name;
        EXPECT_EQ(t.stream, w->stream) << t.name;
        EXPECT_EQ(t.shape, w->shape) << t.name;
        EXPECT_EQ(t.split_begin, w->split_begin) << t.name;
        seen[w - whole.tensors().data()]++;
      }
    }
    for (size_t i = 0; i < seen.size(); i++) EXPECT_EQ(seen[i], 1) << whole.tensors()[i].name;
  }
  c.tie_word_embeddings = true;
  const ParamLayout whole(c);
  const std::vector<PipelineStage> stages = pipeline_stages(c, 2, 64);
  const ParamLayout first(c, 0, 1, stages[0]), last(c, 0, 1, stages[1]);
  EXPECT_EQ(first.tied_copy(), nullptr);
  EXPECT_EQ(first.embed_tokens(), first.find("model.embed_tokens.weight")->offset);
  const ParamTensor* copy = last.tied_copy();
  ASSERT_NE(copy, nullptr);
  EXPECT_EQ(copy->name, "model.embed_tokens.weight");
  EXPECT_EQ(copy->stream, whole.find("model.embed_tokens.weight")->stream);
  EXPECT_EQ(last.lm_head(), copy->offset);
  EXPECT_EQ(last.lm_head_unit(), last.head_unit());
  EXPECT_EQ(whole.lm_head_unit(), 0);
  EXPECT_EQ(first.total() + last.total(), whole.total() + copy->numel);
}

}  // namespace
}  // namespace tuna
