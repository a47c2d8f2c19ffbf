// model/memory_plan_gpu.cpp: the CUDA engine's memory plan. Plain checks of the plan's arithmetic (every build),
// and, on a device or the emulator, that the engine allocates exactly what its plan lists: the device memory in
// use grows by the plan's arena bytes when an engine is built, at every stage the engine has.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "model/config.h"
#include "model/layout.h"
#include "model/memory_plan.h"
#include "tests/model/fixture.h"

#if TUNA_CUDA
#include "engine/engine.h"
#include "model/llama_gpu.h"
#include "tests/kernels/gpu_test_util.h"
#include "tests/engine/engine_test_util.h"
#endif

namespace tuna {
namespace {

using testing_util::Fixture;

const MemoryItem* find(const MemoryPlan& plan, const std::string& name) {
  for (const MemoryItem& i : plan.items)
    if (i.name == name) return &i;
  return nullptr;
}

TEST(MemoryPlanGpu, ZeroZeroHoldsEighteenBytesPerParameter) {
  Fixture f("llama32_tiny");
  MemoryLayout l;
  l.micro_batch = f.batch, l.seq_len = f.seq;
  const MemoryPlan plan = plan_gpu_memory(f.config, l);
  const int64_t P = ParamLayout(f.config).total();
  EXPECT_EQ(plan.bytes(MemoryKind::Weights), device_arena_bytes(2 * P));
  EXPECT_EQ(plan.bytes(MemoryKind::Master), device_arena_bytes(4 * P));
  EXPECT_EQ(plan.bytes(MemoryKind::Gradients), device_arena_bytes(4 * P));
  EXPECT_EQ(plan.bytes(MemoryKind::Moments), 2 * device_arena_bytes(4 * P));
  l.bf16_moments = true;
  EXPECT_EQ(plan_gpu_memory(f.config, l).bytes(MemoryKind::Moments), 2 * device_arena_bytes(2 * P));
  // Every layer's activations are kept without recompute: 13 buffers per layer (gate|up is one).
  int64_t per_layer = 0;
  for (const MemoryItem& i : plan.items) per_layer += i.name.rfind("layer 0 ", 0) == 0;
  EXPECT_EQ(per_layer, 13);
  for (const MemoryItem& i : plan.items) EXPECT_EQ(i.bytes % 256, 0) << i.name;
  EXPECT_EQ(plan.peak(), plan.total());  // no transients on cuda
}

TEST(MemoryPlanGpu, ZeroOneShardsMasterAndMomentsOverDp) {
  Fixture f("llama2_tiny");
  MemoryLayout l;
  l.zero = 1, l.dp = 4;
  const int64_t P = ParamLayout(f.config).total();
  const MemoryPlan plan = plan_gpu_memory(f.config, l);
  EXPECT_EQ(find(plan, "fp32 master weights"), nullptr);
  EXPECT_EQ(find(plan, "AdamW m"), nullptr);
  const MemoryItem* master = find(plan, "fp32 master weights (shard)");
  ASSERT_NE(master, nullptr);
  // Rank 0 holds ceil(unit / 4) of each unit: a quarter of the model, up to a few elements per unit.
  EXPECT_NEAR(double(master->bytes) / (4.0 * P), 0.25, 0.01);
  // The whole bf16 weights and fp32 gradient remain (6 bytes per parameter), as on ZeRO-0.
  EXPECT_EQ(find(plan, "bf16 weights")->bytes, device_arena_bytes(2 * P));
  EXPECT_EQ(find(plan, "fp32 gradients")->bytes, device_arena_bytes(4 * P));
  // NCCL pads units in a scratch of its own, outside the arena, at dp > 1.
  const MemoryItem* nccl = find(plan, "NCCL padding scratch (the comm's own)");
  ASSERT_NE(nccl, nullptr);
  EXPECT_FALSE(nccl->in_arena);
  EXPECT_EQ(nccl->kind, MemoryKind::Communication);
  // The last rank's pieces are no larger than rank 0's (shard_range gives the remainder to no one).
  l.dp_rank = 3;
  EXPECT_LE(find(plan_gpu_memory(f.config, l), "fp32 master weights (shard)")->bytes, master->bytes);
}

TEST(MemoryPlanGpu, ForwardOnlyHoldsWeightsAndActivations) {
  Fixture f("llama2_tiny");
  MemoryLayout l;
  l.training = false, l.micro_batch = 2, l.seq_len = 16;
  const MemoryPlan plan = plan_gpu_memory(f.config, l);
  EXPECT_EQ(plan.bytes(MemoryKind::Gradients), 0);
  EXPECT_EQ(plan.bytes(MemoryKind::Master), 0);
  EXPECT_EQ(plan.bytes(MemoryKind::Moments), 0);
  EXPECT_GT(plan.bytes(MemoryKind::Weights), 0);
  EXPECT_GT(plan.bytes(MemoryKind::Activations), 0);
}

TEST(MemoryPlanGpu, ActivationsScaleWithTokens) {
  Fixture f("llama2_tiny");
  MemoryLayout a, b;
  a.seq_len = 64, b.seq_len = 128;
  const int64_t act_a = plan_gpu_memory(f.config, a).bytes(MemoryKind::Activations);
  const int64_t act_b = plan_gpu_memory(f.config, b).bytes(MemoryKind::Activations);
  EXPECT_GT(act_b, act_a);
  EXPECT_LE(act_b, 2 * act_a + 256 * 512);  // linear up to each buffer's 256-byte rounding
}

TEST(MemoryPlanGpu, TableNamesEveryKindAndTheTotal) {
  Fixture f("llama2_tiny");
  MemoryLayout l;
  const MemoryPlan plan = plan_gpu_memory(f.config, l);
  const std::string table = format_memory_table(plan, int64_t(80) << 30, "per GPU");
  for (const char* word : {"weights", "gradients", "master weights", "AdamW moments", "activations", "workspace",
                           "total", "device capacity"})
    EXPECT_NE(table.find(word), std::string::npos) << word << " missing from\n" << table;
}

TEST(MemoryPlanGpu, HeadChunksAreAtLeast2048Rows) {
  EXPECT_EQ(gpu_head_chunk_rows(128256, 1 << 20), 2048);
  EXPECT_EQ(gpu_head_chunk_rows(1024, 1 << 20), (int64_t(32) << 20) / 1024);
  EXPECT_EQ(gpu_head_chunk_rows(32000, 100), 100);  // never more than the rows there are
}

#if TUNA_CUDA

int64_t device_used() {
  size_t free_bytes = 0, total_bytes = 0;
  TUNA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(total_bytes - free_bytes);
}

// The device memory an engine's construction takes, against its plan's arena. The emulator counts bytes exactly;
// a GPU reports memory in pages (2 MiB) and cuBLASLt's handle may take a little of its own.
void expect_allocation_is_the_plan(int64_t used, const MemoryPlan& plan) {
  int64_t arena = 0;
  for (const MemoryItem& i : plan.items) arena += i.in_arena ? i.bytes : 0;
#ifdef TUNA_EMULATOR
  EXPECT_EQ(used, arena);
#else
  EXPECT_NEAR(double(used), double(arena), double(int64_t(8) << 20));
#endif
}

TEST(MemoryPlanGpu, TheEngineAllocatesItsPlan) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama32_tiny");
  for (int zero : {0, 1}) {
    for (bool bf16 : {false, true}) {
      testing_util::SingleRank rank;
      EngineOptions o = testing_util::engine_options(f, Device::Cuda, zero);
      o.bf16_moments = bf16;
      const int64_t before = device_used();
      std::unique_ptr<Engine> e = make_engine(f.config, o, rank.mesh, testing_util::fixture_weights(f));
      MemoryLayout l;
      l.zero = zero, l.bf16_moments = bf16, l.micro_batch = f.batch, l.seq_len = f.seq;
      SCOPED_TRACE(testing::Message() << "ZeRO-" << zero << (bf16 ? " bf16 moments" : ""));
      expect_allocation_is_the_plan(device_used() - before, plan_gpu_memory(f.config, l));
    }
  }
}

TEST(MemoryPlanGpu, TheForwardModelAllocatesItsPlan) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  const int64_t before = device_used();
  std::unique_ptr<ForwardModel> m = make_forward_model(f.config, Device::Cuda, f.batch, f.seq, testing_util::fixture_weights(f));
  MemoryLayout l;
  l.training = false, l.micro_batch = f.batch, l.seq_len = f.seq;
  expect_allocation_is_the_plan(device_used() - before, plan_gpu_memory(f.config, l));
}

#endif  // TUNA_CUDA

}  // namespace
}  // namespace tuna
