// The pipeline split: every layer in exactly one stage, the embedding first and the head last, the costliest stage as
// cheap as any contiguous split makes it, and earlier stages no larger than they must be. The 1F1B schedule, and a
// stage's parameter layout (its tensors, under the whole model's names, blocks and random streams).
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "model/config.h"
#include "model/layout.h"
#include "model/pipeline.h"

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
  const LlamaConfig c = shape(64, 176, 4, 4, 2, 1000);
  for (int64_t pp : {int64_t(0), int64_t(5)}) {
    try {
      pipeline_stages(c, pp, 64);
      ADD_FAILURE() << "pp " << pp << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("option 'pp': expected 1 to 4 stages"), std::string::npos) << e.what();
    }
  }
}

// Every micro-batch's forward and backward once each, the forward first; the warm-up's pp - stage - 1 forwards, then
// alternation; never more than pp - stage micro-batches in flight, and i mod (pp - stage) free for micro-batch i.
TEST(Pipeline, OneForwardOneBackwardSchedule) {
  for (int64_t pp = 1; pp <= 5; pp++)
    for (int64_t stage = 0; stage < pp; stage++)
      for (int64_t m = 0; m <= 9; m++) {
        const std::vector<PipelineOp> ops = pipeline_schedule(pp, stage, m);
        ASSERT_EQ(static_cast<int64_t>(ops.size()), 2 * m);
        int64_t next_forward = 0, next_backward = 0;
        std::vector<int64_t> in_flight;
        const int64_t slots = pp - stage;
        for (size_t k = 0; k < ops.size(); k++) {
          const PipelineOp& op = ops[k];
          if (op.forward) {
            EXPECT_EQ(op.micro_batch, next_forward++);
            for (int64_t other : in_flight) EXPECT_NE(other % slots, op.micro_batch % slots);
            in_flight.push_back(op.micro_batch);
            EXPECT_LE(static_cast<int64_t>(in_flight.size()), slots);
          } else {
            EXPECT_EQ(op.micro_batch, next_backward++);
            ASSERT_FALSE(in_flight.empty());
            EXPECT_EQ(in_flight.front(), op.micro_batch);
            in_flight.erase(in_flight.begin());
          }
          // Warm-up: forwards only, as many as the stages after this one need to fill.
          if (static_cast<int64_t>(k) < std::min(pp - stage - 1, m)) {
            EXPECT_TRUE(op.forward);
          }
        }
        EXPECT_TRUE(in_flight.empty());
      }
  // Stage 0 of 4 over 6 micro-batches: F0 F1 F2 | F3 B0 F4 B1 F5 B2 | B3 B4 B5.
  std::string order;
  for (const PipelineOp& op : pipeline_schedule(4, 0, 6)) order += (op.forward ? "F" : "B") + std::to_string(op.micro_batch) + " ";
  EXPECT_EQ(order, "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
}

// The CUDA engine's transfer order (engine/engine_gpu.cpp pipeline_step) under NCCL's worst case: each send or receive
// runs alone, in the order started, on the stage's comm stream, and completes only together with its peer's matching
// one; each waits for the compute queued before it, and a pass for the transfers it reads or whose buffer it
// rewrites. A stage receives a forward's input at the forward, posts the next backward's gradient ahead of the
// forward where pipeline_gradient_ahead allows, else at the backward, and sends after each pass. Every stage must
// finish; posting ahead regardless must not (the model can see a deadlock).
namespace overlap {
struct Transfer {
  bool send;
  int peer;
  bool gradient;
  int64_t micro_batch;
  size_t passes_before;  // compute queued on the stage before this transfer starts
};
struct Stage {
  std::vector<Transfer> transfers;
  std::vector<std::vector<size_t>> pass_waits;  // per pass: the transfers it waits for
};

Stage stage_order(int64_t pp, int64_t s, int64_t m, bool ahead) {
  Stage st;
  const std::vector<PipelineOp> ops = pipeline_schedule(pp, s, m);
  const auto start = [&](bool send, int64_t peer, bool gradient, int64_t mb) {
    st.transfers.push_back({send, static_cast<int>(peer), gradient, mb, st.pass_waits.size()});
    return st.transfers.size() - 1;
  };
  std::vector<size_t> waits;
  int64_t activations_sent = -1, gradient_sent = -1, posted = -1;
  for (size_t i = 0; i < ops.size(); i++) {
    const PipelineOp& op = ops[i];
    if (op.forward) {
      if (s > 0) waits.push_back(start(false, s - 1, false, op.micro_batch));
      if (activations_sent >= 0) waits.push_back(activations_sent), activations_sent = -1;
      if (ahead && i + 1 < ops.size() && !ops[i + 1].forward)
        posted = static_cast<int64_t>(start(false, s + 1, true, ops[i + 1].micro_batch));
      st.pass_waits.push_back(waits), waits.clear();
      if (s < pp - 1) activations_sent = start(true, s + 1, false, op.micro_batch);
    } else {
      if (gradient_sent >= 0) waits.push_back(gradient_sent), gradient_sent = -1;
      if (s < pp - 1) waits.push_back(posted >= 0 ? posted : start(false, s + 1, true, op.micro_batch)), posted = -1;
      st.pass_waits.push_back(waits), waits.clear();
      if (s > 0) gradient_sent = start(true, s - 1, true, op.micro_batch);
    }
  }
  return st;
}

// Whether every stage runs to the end.
bool finishes(int64_t pp, int64_t m, bool force_ahead) {
  std::vector<Stage> stages;
  for (int64_t s = 0; s < pp; s++)
    stages.push_back(stage_order(pp, s, m, (force_ahead && s < pp - 1) || pipeline_gradient_ahead(pp, s, m)));
  std::vector<size_t> passes(pp, 0), transfers(pp, 0);  // how many of each are done
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < pp; s++) {
      const Stage& st = stages[s];
      while (passes[s] < st.pass_waits.size() &&
             std::all_of(st.pass_waits[passes[s]].begin(), st.pass_waits[passes[s]].end(),
                         [&](size_t t) { return t < transfers[s]; }))
        passes[s]++, progress = true;
    }
    for (int64_t s = 0; s < pp; s++) {
      if (transfers[s] == stages[s].transfers.size()) continue;
      const Transfer& a = stages[s].transfers[transfers[s]];
      if (passes[s] < a.passes_before || transfers[a.peer] == stages[a.peer].transfers.size()) continue;
      const Transfer& b = stages[a.peer].transfers[transfers[a.peer]];
      if (b.peer != s || b.send == a.send || b.gradient != a.gradient || b.micro_batch != a.micro_batch ||
          passes[a.peer] < b.passes_before)
        continue;
      transfers[s]++, transfers[a.peer]++, progress = true;
    }
  }
  for (int64_t s = 0; s < pp; s++)
    if (passes[s] < stages[s].pass_waits.size() || transfers[s] < stages[s].transfers.size()) return false;
  return true;
}
}  // namespace overlap

TEST(Pipeline, TransferOrderOfTheOverlapCannotDeadlock) {
  for (int64_t pp = 2; pp <= 8; pp++)
    for (int64_t m = 0; m <= 19; m++) EXPECT_TRUE(overlap::finishes(pp, m, false)) << "pp " << pp << ", " << m;
  // Posting ahead in a warm-up followed at once by the cool-down: the next stage needs the forward's output first.
  EXPECT_FALSE(overlap::finishes(2, 1, true));
  EXPECT_FALSE(overlap::finishes(4, 3, true));
  EXPECT_TRUE(pipeline_gradient_ahead(4, 0, 4));
  EXPECT_FALSE(pipeline_gradient_ahead(4, 0, 3));
  EXPECT_FALSE(pipeline_gradient_ahead(4, 3, 9));  // the last stage receives no gradient
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
