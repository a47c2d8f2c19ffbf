// plan_cpu_memory on one rank: its items are what Llama + Zero allocate, to the byte, at every ZeRO stage, tied
// and untied; the stages shift bytes between kinds as zero.h says; options of the CUDA backend are refused by
// name. (Several ranks: tests/mpi/test_memory_plan.cpp; the trainer's measured peak: tests/dist/test_memory_plan.cpp.)
#include <gtest/gtest.h>

#include "core/error.h"
#include "model/memory_plan.h"
#include "tests/model/memory_plan_test_util.h"

namespace tuna {
namespace {

using testing_util::plan_and_allocate;
using testing_util::plan_test_config;

MemoryLayout layout_of(int zero, int64_t micro_batch = 2, int64_t seq = 12) {
  MemoryLayout m;
  m.zero = zero, m.micro_batch = micro_batch, m.seq_len = seq;
  return m;
}

TEST(MemoryPlanCpu, ItemsAreTheAllocationsOfOneRankAtEveryStage) {
  std::unique_ptr<Comm> alone = make_single_comm();
  for (bool tied : {false, true})
    for (int zero = 0; zero <= 3; zero++) {
      const auto r = plan_and_allocate(plan_test_config(3, tied), layout_of(zero), *alone, nullptr);
      EXPECT_EQ(r.planned_activations, r.allocated_activations) << "zero " << zero << " tied " << tied;
      EXPECT_EQ(r.planned_state, r.allocated_state) << "zero " << zero << " tied " << tied;
    }
}

// Each pipeline stage (pp 3 over 4 layers: the first stage keeps 3 micro-batches' activations, the last 1), ZeRO 0-2.
TEST(MemoryPlanCpu, ItemsAreTheAllocationsOfEveryPipelineStage) {
  std::unique_ptr<Comm> alone = make_single_comm();
  for (int64_t stage = 0; stage < 3; stage++)
    for (int zero = 0; zero <= 2; zero++) {
      MemoryLayout m = layout_of(zero);
      m.pp = 3, m.pp_rank = stage;
      const auto r = plan_and_allocate(plan_test_config(4, /*tied=*/false), m, *alone, nullptr);
      EXPECT_EQ(r.allocated_activations, r.planned_activations) << "stage " << stage << ", ZeRO-" << zero;
      EXPECT_EQ(r.allocated_state, r.planned_state) << "stage " << stage << ", ZeRO-" << zero;
    }
  // The first stage holds more activations than the last: its slots.
  MemoryLayout first = layout_of(0), last = layout_of(0);
  first.pp = last.pp = 3, last.pp_rank = 2;
  const LlamaConfig c = plan_test_config(4, false);
  EXPECT_GT(plan_cpu_memory(c, first).bytes(MemoryKind::Activations), plan_cpu_memory(c, last).bytes(MemoryKind::Activations));
}

// With LoRA adapters: the frozen base's weights and the adapters' state, to the byte, at ZeRO 0-3 (at 3 the base's
// shard and gathered units), with dropout (its scratch) and on a subset of targets; no base gradient or moment in the
// plan; a quantized base at ZeRO-3 refused.
TEST(MemoryPlanCpu, LoraItemsAreTheAllocationsOfOneRank) {
  std::unique_ptr<Comm> alone = make_single_comm();
  for (const char* targets : {"q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "q_proj,v_proj,down_proj"})
    for (int zero = 0; zero <= 3; zero++) {
      MemoryLayout m = layout_of(zero);
      m.lora.rank = 4, m.lora.alpha = 8, m.lora.dropout = zero == 1 ? 0.1 : 0.0;
      m.lora.targets = parse_lora_targets(targets);
      const auto r = plan_and_allocate(plan_test_config(3, zero == 2), m, *alone, nullptr);
      EXPECT_EQ(r.planned_activations, r.allocated_activations) << "zero " << zero << " " << targets;
      EXPECT_EQ(r.planned_state, r.allocated_state) << "zero " << zero << " " << targets;
    }
  const LlamaConfig c = plan_test_config(4, false);
  MemoryLayout m = layout_of(0);
  m.lora.rank = 4, m.lora.alpha = 8;
  const MemoryPlan plan = plan_cpu_memory(c, m);
  const int64_t A = lora_parameter_count(c, m.lora), P = c.n_params();
  EXPECT_EQ(plan.bytes(MemoryKind::Weights), 4 * (P + A));
  EXPECT_EQ(plan.bytes(MemoryKind::Gradients), 4 * A);
  EXPECT_EQ(plan.bytes(MemoryKind::Moments), 8 * A);
  m.zero = 3;
  m.lora.base_quant = BaseQuant::Nf4;
  EXPECT_THROW(plan_cpu_memory(c, m), Error);  // a quantized base is not sharded
}

// LoRA over pipeline stages (pp 3 over 4 layers): each stage's frozen base (the last stage's copy of a tied table
// too), its layers' adapters and their slots of r-wide intermediates, to the byte at ZeRO 0-2; the stages' adapters
// add up to the whole model's.
TEST(MemoryPlanCpu, LoraItemsAreTheAllocationsOfEveryPipelineStage) {
  std::unique_ptr<Comm> alone = make_single_comm();
  for (bool tied : {false, true})
    for (int64_t stage = 0; stage < 3; stage++)
      for (int zero = 0; zero <= 2; zero++) {
        MemoryLayout m = layout_of(zero);
        m.pp = 3, m.pp_rank = stage;
        m.lora.rank = 4, m.lora.alpha = 8, m.lora.dropout = zero == 1 ? 0.1 : 0.0;
        m.lora.targets = parse_lora_targets(tied ? "q_proj,v_proj,down_proj" : "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
        const auto r = plan_and_allocate(plan_test_config(4, tied), m, *alone, nullptr);
        EXPECT_EQ(r.allocated_activations, r.planned_activations) << "stage " << stage << ", ZeRO-" << zero << " tied " << tied;
        EXPECT_EQ(r.allocated_state, r.planned_state) << "stage " << stage << ", ZeRO-" << zero << " tied " << tied;
      }
  const LlamaConfig c = plan_test_config(4, false);
  MemoryLayout m = layout_of(0);
  m.lora.rank = 4, m.lora.alpha = 8;
  m.pp = 3;
  int64_t gradients = 0;
  for (m.pp_rank = 0; m.pp_rank < 3; m.pp_rank++) gradients += plan_cpu_memory(c, m).bytes(MemoryKind::Gradients);
  EXPECT_EQ(gradients, 4 * lora_parameter_count(c, m.lora));  // ZeRO-0: each stage its adapters' whole gradient
}

TEST(MemoryPlanCpu, StagesMoveBytesBetweenKindsAsZeroSays) {
  const LlamaConfig c = plan_test_config(4, false);
  const int64_t P = c.n_params();
  MemoryLayout m = layout_of(0);
  m.dp = 4;
  const MemoryPlan z0 = plan_cpu_memory(c, m);
  EXPECT_EQ(z0.bytes(MemoryKind::Weights), 4 * P);
  EXPECT_EQ(z0.bytes(MemoryKind::Gradients), 4 * P);
  EXPECT_EQ(z0.bytes(MemoryKind::Moments), 8 * P);
  EXPECT_EQ(z0.bytes(MemoryKind::Master), 0);
  m.zero = 3;
  const MemoryPlan z3 = plan_cpu_memory(c, m);
  EXPECT_EQ(z3.bytes(MemoryKind::Weights), 0);  // only the gathered units, counted as communication buffers
  // Each unit split in 4 pieces of ceil(size / 4): rank 0's shard is a quarter of the model, rounded up per unit.
  EXPECT_GE(z3.bytes(MemoryKind::Master), P);
  EXPECT_LT(z3.bytes(MemoryKind::Master), P + 4 * 4 * (c.num_hidden_layers + 2));
  EXPECT_EQ(z3.bytes(MemoryKind::Moments), 2 * z3.bytes(MemoryKind::Master));
  EXPECT_GT(z3.bytes(MemoryKind::Communication), 0);
  EXPECT_EQ(z0.bytes(MemoryKind::Activations), z3.bytes(MemoryKind::Activations));  // dp does not touch them
  // The peak adds the largest transient only; stage 0's is MPI's copy of the whole gradient at dp 4.
  EXPECT_EQ(z0.peak(), z0.total() + 4 * P);
  // A larger micro-batch grows the activations and nothing else.
  m.micro_batch = 4;
  const MemoryPlan z3b = plan_cpu_memory(c, m);
  EXPECT_GT(z3b.bytes(MemoryKind::Activations), z3.bytes(MemoryKind::Activations));
  EXPECT_EQ(z3b.bytes(MemoryKind::Moments), z3.bytes(MemoryKind::Moments));
}

TEST(MemoryPlanCpu, RefusesTheCudaBackendsOptionsByName) {
  const LlamaConfig c = plan_test_config(2, false);
  MemoryLayout m = layout_of(1);
  m.recompute = Recompute::Full;
  try {
    plan_cpu_memory(c, m);
    FAIL() << "recompute accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("recompute"), std::string::npos) << e.what();
  }
  m.recompute = Recompute::None, m.bf16_moments = true;
  EXPECT_THROW(plan_cpu_memory(c, m), Error);
  m.bf16_moments = false, m.zero = 4;
  EXPECT_THROW(plan_cpu_memory(c, m), Error);
  m.zero = 0, m.tp = 3;  // does not divide the 2 kv heads
  EXPECT_THROW(plan_cpu_memory(c, m), Error);
}

TEST(MemoryPlan, TheRunReportsRecordHasEveryItemTheTotalAndThePeak) {
  const MemoryPlan plan = plan_cpu_memory(plan_test_config(2, true), layout_of(2));
  const nlohmann::json j = memory_plan_json(plan);
  ASSERT_EQ(j["items"].size(), plan.items.size());
  for (size_t i = 0; i < plan.items.size(); i++) {
    EXPECT_EQ(j["items"][i]["name"], plan.items[i].name);
    EXPECT_EQ(j["items"][i]["bytes"].get<int64_t>(), plan.items[i].bytes);
  }
  EXPECT_EQ(j["total"].get<int64_t>(), plan.total());
  EXPECT_EQ(j["peak"].get<int64_t>(), plan.peak());
}

}  // namespace
}  // namespace tuna
