// model/memory_plan_gpu.cpp: the CUDA engine's memory plan. Plain checks of the plan's arithmetic (every build),
// and, on a device or the emulator, that the engine allocates exactly what its plan lists: the device memory in
// use grows by the plan's arena bytes when an engine is built, at every stage the engine has.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "model/config.h"
#include "model/layout.h"
#include "model/lora_shape.h"
#include "model/memory_plan.h"
#include "model/pipeline.h"
#include "tests/model/fixture.h"
#include "tests/test_util.h"

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

// --fp8 tensorwise: every layer's projection weights as e4m3 codes in both layouts (2 bytes a weight), each group's
// amax and scale 16 bytes apart, four amaxes per layer kept for the backward, and one group's operand codes: its
// widest input (n x max(hidden, q_dim, ffn)) and its widest output gradient twice (n x max(q|k|v, hidden, 2 ffn)).
// A forward alone has none (the option is a training one).
TEST(MemoryPlanGpu, Fp8AddsTheWeightCodesAndOneGroupsOperands) {
  Fixture f("llama32_tiny");
  MemoryLayout l;
  l.micro_batch = f.batch, l.seq_len = f.seq, l.fp8 = Fp8Mode::Tensorwise;
  const MemoryPlan plan = plan_gpu_memory(f.config, l);
  const LlamaConfig& c = f.config;
  const int64_t L = c.num_hidden_layers, C = c.hidden_size, F = c.intermediate_size, n = f.batch * f.seq;
  const int64_t qkv = c.q_dim() + 2 * c.kv_dim();
  int64_t projections = 0;
  const ParamLayout layout(c);
  for (const ParamTensor& t : layout.tensors())
    if (t.layer >= 0 && t.shape.size() == 2) projections += t.numel;
  EXPECT_EQ(projections, L * (qkv * C + C * c.q_dim() + 3 * F * C));
  const MemoryItem* codes = find(plan, "FP8 weight codes (e4m3, both layouts, " + std::to_string(L) + " layers)");
  ASSERT_NE(codes, nullptr);
  EXPECT_EQ(codes->bytes, device_arena_bytes(2 * projections));
  EXPECT_EQ(codes->kind, MemoryKind::Weights);
  EXPECT_EQ(find(plan, "FP8 weight amaxes and scales")->bytes, device_arena_bytes(L * 4 * 2 * 16));
  EXPECT_EQ(find(plan, "FP8 activation amaxes (kept for the backward)")->bytes, device_arena_bytes(L * 4 * 4));
  EXPECT_EQ(find(plan, "FP8 codes of one group's input (e4m3)")->bytes, device_arena_bytes(n * std::max(C, F)));
  EXPECT_EQ(find(plan, "FP8 codes of one group's output gradient (e5m2)")->bytes,
            device_arena_bytes(n * std::max(qkv, 2 * F)));
  l.fp8 = Fp8Mode::Off;
  const MemoryPlan bf16 = plan_gpu_memory(c, l);
  EXPECT_EQ(plan.items.size(), bf16.items.size() + 8);
  // ZeRO-3 keeps one layer's codes, cast at each use.
  l.fp8 = Fp8Mode::Tensorwise, l.zero = 3, l.dp = 2;
  const MemoryPlan sharded = plan_gpu_memory(c, l);
  const MemoryItem* one = find(sharded, "FP8 weight codes (e4m3, both layouts, one layer: cast at each use)");
  ASSERT_NE(one, nullptr);
  EXPECT_EQ(one->bytes, device_arena_bytes(2 * projections / L));
  // Adapters: a frozen bf16 base keeps every layer's codes (cast once per run); an nf4 base one layer's, cast from
  // each dequantized layer at each use (its whole base in FP8 would outweigh its NF4 codes).
  l.zero = 0, l.dp = 1, l.lora.rank = 4;
  EXPECT_NE(find(plan_gpu_memory(c, l), "FP8 weight codes (e4m3, both layouts, " + std::to_string(L) + " layers)"),
            nullptr);
  l.lora.base_quant = BaseQuant::Nf4;
  const MemoryItem* qlora = find(plan_gpu_memory(c, l), "FP8 weight codes (e4m3, both layouts, one layer: cast at each use)");
  ASSERT_NE(qlora, nullptr);
  EXPECT_EQ(qlora->bytes, device_arena_bytes(2 * projections / L));
  l.lora = {};
  // --fp8_weight_codes forward: the forward's codes alone (1 byte a weight), and one group's transposed codes (the
  // widest group's: gate|up), cast at each backward.
  l.fp8_forward_codes = true;
  const MemoryPlan forward = plan_gpu_memory(c, l);
  const MemoryItem* kept = find(forward, "FP8 weight codes (e4m3, forward layout, " + std::to_string(L) + " layers)");
  ASSERT_NE(kept, nullptr);
  EXPECT_EQ(kept->bytes, device_arena_bytes(projections));
  const MemoryItem* t = find(forward, "FP8 transposed codes of one group's weight (e4m3, cast at each backward)");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->bytes, device_arena_bytes(std::max(qkv, 2 * F) * C));
  EXPECT_LT(forward.peak(), plan.peak());
  l.fp8_forward_codes = false;
  l.fp8 = Fp8Mode::Tensorwise, l.training = false;
  for (const MemoryItem& i : plan_gpu_memory(c, l).items) EXPECT_EQ(i.name.rfind("FP8", 0), std::string::npos) << i.name;
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

// With adapters, on llama2_tiny (hidden 64, ffn 160, 2 layers, 4 heads of 16, 4 kv heads, vocab 128, untied),
// rank 4 on all seven modules. Every figure below is the model's arithmetic, written out.
namespace lora_tiny {
constexpr int64_t C = 64, F = 160, L = 2, V = 128, r = 4;
// bf16 base: embedding and lm_head [128, 64], per layer two norms, q|k|v|o [64, 64], gate|up [160, 64], down [64, 160],
// the final norm.
constexpr int64_t base_params = 2 * V * C + L * (2 * C + 4 * C * C + 3 * C * F) + C;
// Per layer: A [r, in] and B [out, r] of q, k, v, o (in = out = 64) and gate, up, down (64 and 160).
constexpr int64_t adapters_per_layer = 4 * r * (C + C) + 3 * r * (C + F);
constexpr int64_t adapters = L * adapters_per_layer;
}  // namespace lora_tiny

MemoryLayout adapter_layout(int64_t rank) {
  MemoryLayout l;
  l.lora.rank = rank;
  return l;
}

TEST(MemoryPlanGpu, LoraHoldsAFrozenBf16BaseAndTheAdaptersState) {
  using namespace lora_tiny;
  Fixture f("llama2_tiny");
  ASSERT_EQ(base_params, 110912);
  ASSERT_EQ(adapters, 9472);
  MemoryLayout l = adapter_layout(r);
  l.micro_batch = 2, l.seq_len = 16;
  const MemoryPlan plan = plan_gpu_memory(f.config, l);
  // The base: bf16, no gradient, no master, no moments.
  ASSERT_NE(find(plan, "bf16 base weights (frozen)"), nullptr);
  EXPECT_EQ(find(plan, "bf16 base weights (frozen)")->bytes, device_arena_bytes(2 * base_params));
  EXPECT_EQ(find(plan, "bf16 weights"), nullptr);
  EXPECT_EQ(find(plan, "fp32 gradients"), nullptr);
  EXPECT_EQ(find(plan, "fp32 master weights"), nullptr);
  // The adapters: bf16 for the GEMMs, fp32 master, gradient and both moments: 2 + 4 + 4 + 8 bytes each.
  EXPECT_EQ(plan.bytes(MemoryKind::Weights), device_arena_bytes(2 * base_params) + device_arena_bytes(2 * adapters));
  EXPECT_EQ(plan.bytes(MemoryKind::Master), device_arena_bytes(4 * adapters));
  EXPECT_EQ(plan.bytes(MemoryKind::Gradients), device_arena_bytes(4 * adapters));
  EXPECT_EQ(plan.bytes(MemoryKind::Moments), 2 * device_arena_bytes(4 * adapters));
  // Per layer and target the r-wide A x, kept for dB: 32 tokens x 4 x 2 bytes; no dropout, no mask.
  int64_t ax = 0, masks = 0;
  for (const MemoryItem& i : plan.items) {
    if (i.name.find(" lora_ax ") != std::string::npos) {
      ax++;
      EXPECT_EQ(i.bytes, device_arena_bytes(32 * r * 2)) << i.name;
    }
    masks += i.name.find("lora_mask") != std::string::npos;
  }
  EXPECT_EQ(ax, L * 7);
  EXPECT_EQ(masks, 0);
  // The backward's dt of one target at a time.
  EXPECT_EQ(find(plan, "LoRA d(A x)")->bytes, device_arena_bytes(32 * r * 2));
  // The full fine-tune's activations are all there too.
  MemoryLayout full = l;
  full.lora.rank = 0;
  EXPECT_GT(plan.bytes(MemoryKind::Activations), plan_gpu_memory(f.config, full).bytes(MemoryKind::Activations));

  // Dropout keeps no mask (the backward draws it again from its key): one dropped input of the widest target.
  l.lora.dropout = 0.05;
  const MemoryPlan dropped = plan_gpu_memory(f.config, l);
  for (const MemoryItem& i : dropped.items) EXPECT_EQ(i.name.find("lora_mask"), std::string::npos) << i.name;
  EXPECT_EQ(find(dropped, "LoRA dropout(x)")->bytes, device_arena_bytes(32 * F * 2));
  // Full recompute keeps neither: one working copy per target, refilled by the recompute.
  l.recompute = Recompute::Full;
  const MemoryPlan recomputed = plan_gpu_memory(f.config, l);
  EXPECT_EQ(find(recomputed, "layer 0 lora_ax q_proj"), nullptr);
  EXPECT_NE(find(recomputed, "working lora_ax q_proj"), nullptr);

  // A subset of targets: q and v alone hold 2 x r x (64 + 64) per layer.
  MemoryLayout qv = adapter_layout(r);
  qv.lora.targets = parse_lora_targets("v_proj,q_proj");
  EXPECT_EQ(find(plan_gpu_memory(f.config, qv), "LoRA fp32 master weights")->bytes,
            device_arena_bytes(4 * L * 2 * r * (C + C)));
}

TEST(MemoryPlanGpu, LoraShardsTheAdaptersStateByZeroAndTheBaseAtZeroThree) {
  using namespace lora_tiny;
  Fixture f("llama2_tiny");
  MemoryLayout l = adapter_layout(r);
  l.zero = 1, l.dp = 3;
  // ZeRO shards each layer's adapters over dp: rank 0 holds ceil(4736 / 3) = 1579 of each of the 2 layers, padded
  // to the fused AdamW's 4: 3160 elements.
  const MemoryPlan z1 = plan_gpu_memory(f.config, l);
  EXPECT_EQ(find(z1, "LoRA fp32 master weights (shard)")->bytes, device_arena_bytes(3160 * 4));
  EXPECT_EQ(find(z1, "LoRA AdamW m (shard)")->bytes, device_arena_bytes(3160 * 4));
  EXPECT_EQ(find(z1, "LoRA fp32 gradients")->bytes, device_arena_bytes(4 * adapters));  // whole below ZeRO-2
  EXPECT_EQ(find(z1, "bf16 base weights (frozen)")->bytes, device_arena_bytes(2 * base_params));  // replicated
  // The shard's AdamW table: rank 0's piece [0, 1579) of a layer's 4736 touches q, k, v (A and B, 256 each) and
  // o's A (at 1536): 7 tensors a layer, 14 pieces.
  EXPECT_EQ(find(z1, "LoRA AdamW segment starts (shard)")->bytes, device_arena_bytes(14 * 8));
  EXPECT_EQ(find(z1, "LoRA bf16 weights")->bytes, device_arena_bytes(2 * adapters));  // the GEMMs' copy, whole
  EXPECT_EQ(find(z1, "LoRA bf16 weights (shard)"), nullptr);
  EXPECT_EQ(find(z1, "LoRA gradient buffer 0"), nullptr);
  // ZeRO-2: no whole adapter gradient; a layer's in one of two buffers until reduce-scattered into the shard
  // through a piece-sized output, and the update's bf16 shard gathered into the whole copy.
  l.zero = 2;
  const MemoryPlan z2_bf16 = plan_gpu_memory(f.config, l);
  EXPECT_EQ(find(z2_bf16, "LoRA fp32 gradients"), nullptr);
  EXPECT_EQ(find(z2_bf16, "LoRA fp32 gradients (shard)")->bytes, device_arena_bytes(3160 * 4));
  EXPECT_EQ(find(z2_bf16, "LoRA bf16 weights (shard)")->bytes, device_arena_bytes(3160 * 2));
  EXPECT_EQ(find(z2_bf16, "LoRA gradient buffer 0")->bytes, device_arena_bytes(4 * adapters_per_layer));
  EXPECT_EQ(find(z2_bf16, "LoRA gradient buffer 1")->bytes, device_arena_bytes(4 * adapters_per_layer));
  EXPECT_EQ(find(z2_bf16, "LoRA gradient buffer 2"), nullptr);
  EXPECT_EQ(find(z2_bf16, "LoRA reduce-scatter output")->bytes, device_arena_bytes(1579 * 4));
  EXPECT_EQ(find(z2_bf16, "bf16 base weights (frozen)")->bytes, device_arena_bytes(2 * base_params));
  // What the adapters' state costs falls with the stage: master, moments and gradients whole at 0; at 1 the gradient
  // stays whole; at 2 two layers' worth of gradient buffers, which at 2 layers is the whole gradient again and at 8
  // a quarter of it.
  const auto state = [&](const LlamaConfig& c, int zero) {
    MemoryLayout z = l;
    z.zero = zero;
    const MemoryPlan p = plan_gpu_memory(c, z);
    return p.bytes(MemoryKind::Master) + p.bytes(MemoryKind::Gradients) + p.bytes(MemoryKind::Moments);
  };
  EXPECT_GT(state(f.config, 0), state(f.config, 1));
  EXPECT_EQ(state(f.config, 1), state(f.config, 2));
  LlamaConfig deep = f.config;
  deep.num_hidden_layers = 8;
  EXPECT_GT(state(deep, 0), state(deep, 1));
  EXPECT_GT(state(deep, 1), state(deep, 2));
  // ZeRO-3 with an nf4 base: each unit's stored bytes split over dp. A [64, 64] weight in nf4: 2048 bytes of codes,
  // 64 absmax bytes, one fp32 scale of 256 absmax, one fp32 mean = 2120; [160, 64] and [64, 160]: 5120 + 160 + 4 + 4
  // = 5288. A layer: 4 x 2120 + 3 x 5288 + two bf16 norms of 64 = 24600 bytes; the embedding 128 x 64 x 2 = 16384;
  // the head (final norm and lm_head) 128 + 16384 = 16512.
  l.zero = 3, l.dp = 2, l.lora.base_quant = BaseQuant::Nf4;
  const MemoryPlan z3 = plan_gpu_memory(f.config, l);
  EXPECT_EQ(find(z3, "nf4 base weights (frozen, shard)")->bytes,
            device_arena_bytes(16384 / 2 + 2 * (24600 / 2) + 16512 / 2));
  EXPECT_EQ(find(z3, "base gather buffer 0")->bytes, device_arena_bytes(24600));
  EXPECT_EQ(find(z3, "base gather buffer 1")->bytes, device_arena_bytes(24600));
  // A layer dequantized into one bf16 buffer shaped like its unit: (4 x 64 x 64 + 3 x 160 x 64 + 2 x 64) x 2 bytes.
  EXPECT_EQ(find(z3, "dequantized layer weights (bf16, one layer)")->bytes,
            device_arena_bytes((4 * 64 * 64 + 3 * 160 * 64 + 2 * 64) * 2));
  // Below ZeRO-3 the nf4 decoder weights and the bf16 rest are whole on every rank.
  l.zero = 2;
  const MemoryPlan z2 = plan_gpu_memory(f.config, l);
  EXPECT_EQ(find(z2, "nf4 base weights (frozen decoder Linear weights)")->bytes, device_arena_bytes(2 * 24344));
  EXPECT_EQ(find(z2, "bf16 base weights (frozen embedding, norms, lm_head)")->bytes,
            device_arena_bytes(2 * 16384 + (2 * 2 * 64 + 64) * 2));
  EXPECT_EQ(find(z2, "base gather buffer 0"), nullptr);
  // ZeRO-3 with a bf16 base (what the CUDA engine runs): each unit's elements split over dp 2, the embedding 128 x 64
  // = 8192, a layer 2 x 64 + 4 x 64 x 64 + 3 x 160 x 64 = 47232, the head 64 + 8192 = 8256; gathered a layer at a
  // time into two buffers (the one computing and the prefetched next).
  l.zero = 3, l.lora.base_quant = BaseQuant::None;
  const MemoryPlan z3_bf16 = plan_gpu_memory(f.config, l);
  EXPECT_EQ(find(z3_bf16, "bf16 base weights (frozen, shard)")->bytes,
            device_arena_bytes(2 * (8192 / 2 + 2 * (47232 / 2) + 8256 / 2)));
  EXPECT_EQ(find(z3_bf16, "base gather buffer 0")->bytes, device_arena_bytes(2 * 47232));
  EXPECT_EQ(find(z3_bf16, "base gather buffer 1")->bytes, device_arena_bytes(2 * 47232));
  EXPECT_EQ(find(z3_bf16, "bf16 base weights (frozen)"), nullptr);
  EXPECT_EQ(find(z3_bf16, "LoRA gradient buffer 0")->bytes, device_arena_bytes(4 * adapters_per_layer));
  l.zero_prefetch = false;
  EXPECT_EQ(find(plan_gpu_memory(f.config, l), "base gather buffer 1"), nullptr);
}

TEST(MemoryPlanGpu, LoraUnderTensorParallelismFollowsMegatronSplits) {
  using namespace lora_tiny;
  Fixture f("llama2_tiny");
  // tp 2: 2 heads (q, k, v 32 wide) and 80 ffn columns per rank. Column-parallel q, k, v: A [4, 64] whole, B [32, 4];
  // gate, up: A [4, 64], B [80, 4]. Row-parallel o: A [4, 32], B [64, 4] whole; down: A [4, 80], B [64, 4].
  const int64_t per_layer = 3 * (4 * 64 + 32 * 4) + (4 * 32 + 64 * 4) + 2 * (4 * 64 + 80 * 4) + (4 * 80 + 64 * 4);
  LoraPlan plan;
  plan.rank = r;
  EXPECT_EQ(lora_layer_params(f.config, plan, 2), per_layer);
  EXPECT_EQ(per_layer, 3264);
  MemoryLayout l = adapter_layout(r);
  l.tp = 2;
  EXPECT_EQ(find(plan_gpu_memory(f.config, l), "LoRA fp32 master weights")->bytes, device_arena_bytes(4 * L * per_layer));
  // The replicated factors (A of q, k, v, gate, up; B of o, down), 7 per layer, have their norms summed once.
  EXPECT_EQ(find(plan_gpu_memory(f.config, l), "replicated gradient norms")->bytes, device_arena_bytes(L * 7 * 8));
}

TEST(MemoryPlanGpu, TheFitCheckOffersAnNf4BaseToAdapters) {
  // llama2_tiny LoRA on one rank, full recompute, bf16 moments, micro-batch 1 (nothing else left to try), with a
  // capacity between its nf4 plan and its bf16 plan (headroom included).
  Fixture f("llama2_tiny");
  MemoryLayout l = adapter_layout(4);
  l.recompute = Recompute::Full, l.bf16_moments = true;
  MemoryLayout q = l;
  q.lora.base_quant = BaseQuant::Nf4;
  const int64_t bf16 = plan_gpu_memory(f.config, l).peak(), nf4 = plan_gpu_memory(f.config, q).peak();
  ASSERT_LT(nf4, bf16);
  const GpuFit fit = check_gpu_fit(f.config, l, (bf16 + nf4) / 2 + gpu_headroom_bytes(l));
  EXPECT_FALSE(fit.fits);
  EXPECT_NE(fit.report.find("would fit with: --base_quant nf4"), std::string::npos) << fit.report;
}

TEST(MemoryPlanGpu, LoraRefusesWhatTheModelCannotTake) {
  Fixture f("llama2_tiny");
  MemoryLayout l = adapter_layout(65);  // q_proj is 64 x 64
  std::string e = testing_util::error_of([&] { plan_gpu_memory(f.config, l); });
  EXPECT_NE(e.find("lora_rank 65 is more than q_proj's smaller dimension 64"), std::string::npos) << e;
  l.lora.rank = 4, l.lora.dropout = std::nan("");
  e = testing_util::error_of([&] { plan_gpu_memory(f.config, l); });
  EXPECT_NE(e.find("lora_dropout must be in [0, 1)"), std::string::npos) << e;
  MemoryLayout q;
  q.lora.base_quant = BaseQuant::Nf4;  // a quantized base without adapters
  e = testing_util::error_of([&] { plan_gpu_memory(f.config, q); });
  EXPECT_NE(e.find("base_quant nf4"), std::string::npos) << e;
  e = testing_util::error_of([] { parse_lora_targets("q_proj,lm_head"); });
  EXPECT_NE(e.find("option 'lora_targets': 'lm_head' is not a projection"), std::string::npos) << e;
  EXPECT_NE(e.find("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"), std::string::npos) << e;
  e = testing_util::error_of([] { parse_base_quant("fp4", "option 'base_quant'"); });
  EXPECT_NE(e.find("option 'base_quant': expected none, nf4 or int8, found 'fp4'"), std::string::npos) << e;
}

TEST(MemoryPlanGpu, BaseStorageBytes) {
  // nf4 (bitsandbytes, blocksize 64, double-quantized): n/2 codes, n/64 absmax bytes, 4 bytes per 256 absmax, 4.
  EXPECT_EQ(base_tensor_bytes(1000, 10, BaseQuant::Nf4), 500 + 16 + 4 + 4);
  EXPECT_EQ(base_tensor_bytes(64 * 256 * 3, 8, BaseQuant::Nf4), 64 * 256 * 3 / 2 + 256 * 3 + 3 * 4 + 4);
  EXPECT_EQ(base_tensor_bytes(64 * 256 * 3 + 1, 8, BaseQuant::Nf4), (64 * 256 * 3 + 2) / 2 + 256 * 3 + 1 + 4 * 4 + 4);
  // int8: a byte each and an fp32 absmax per row; none: bf16.
  EXPECT_EQ(base_tensor_bytes(1000, 10, BaseQuant::Int8), 1000 + 40);
  EXPECT_EQ(base_tensor_bytes(1000, 10, BaseQuant::None), 2000);
  // LLaMA-2-70B's decoder Linear weights: 80 x (8192 x (8192 + 1024 + 1024 + 8192) + 3 x 8192 x 28672) = 68.45B
  // weights at 4.127 bits; the embedding, lm_head (2 x 32000 x 8192) and norms stay bf16.
  LlamaConfig c70 = LlamaConfig::from_json(
      {{"hidden_size", 8192}, {"intermediate_size", 28672}, {"num_hidden_layers", 80}, {"num_attention_heads", 64},
       {"num_key_value_heads", 8}, {"vocab_size", 32000}, {"max_position_embeddings", 4096}},
      "llama-2-70b");
  int64_t quantized = 0, plain = 0;
  const ParamLayout layout70(c70);
  for (const ParamTensor& t : layout70.tensors())
    (base_tensor_quantized(t) ? quantized : plain) += base_storage_bytes(t, BaseQuant::Nf4);
  const double linear = 80.0 * (8192.0 * 18432 + 3.0 * 8192 * 28672);
  EXPECT_NEAR(double(quantized), linear * (4 + 8.0 / 64 + 32.0 / (64 * 256)) / 8, 80 * 7 * 8);
  EXPECT_EQ(plain, 2 * (2 * int64_t(32000) * 8192 + 161 * 8192));
}

// ---- pipeline stages (the CUDA engine runs them at ZeRO 0 and 1) and sequence parallelism ----

// A fixture's shape with more layers, so that stages have several.
LlamaConfig deeper(const std::string& fixture, int64_t layers) {
  LlamaConfig c = Fixture(fixture).config;
  c.num_hidden_layers = layers;
  return c;
}

MemoryLayout stage_layout(int64_t pp, int64_t pp_rank, int zero = 0) {
  MemoryLayout l;
  l.pp = pp, l.pp_rank = pp_rank, l.zero = zero;
  l.micro_batch = 2, l.seq_len = 32;
  return l;
}

int64_t items_starting(const MemoryPlan& plan, const std::string& prefix) {
  int64_t count = 0;
  for (const MemoryItem& i : plan.items) count += i.name.rfind(prefix, 0) == 0;
  return count;
}

// The stages together hold the pp 1 plan's parameters, each its own layers' (weights, gradients, master and
// moments), the embedding on the first and the final norm and lm_head on the last; a tied model's last stage holds
// a copy of the embedding as its lm_head (Megatron's way), with its state.
TEST(MemoryPlanGpu, PipelineStagesTogetherHoldTheModelsParameters) {
  for (const char* fixture : {"llama2_tiny", "llama32_tiny"}) {
    const LlamaConfig c = deeper(fixture, 6);
    const ParamLayout layout(c);
    const int64_t P = layout.total();
    const int64_t embedding = layout.unit_range(0).second - layout.unit_range(0).first;
    const int64_t copy = layout.lm_head_unit() == 0 ? embedding : 0;
    for (int64_t pp : {2, 3}) {
      SCOPED_TRACE(testing::Message() << fixture << " pp " << pp);
      int64_t weights = 0, master = 0, moments = 0, gradients = 0;
      for (int64_t s = 0; s < pp; s++) {
        const MemoryPlan plan = plan_gpu_memory(c, stage_layout(pp, s));
        weights += plan.bytes(MemoryKind::Weights), master += plan.bytes(MemoryKind::Master);
        moments += plan.bytes(MemoryKind::Moments), gradients += find(plan, "fp32 gradients")->bytes;
        EXPECT_LT(plan.bytes(MemoryKind::Weights), device_arena_bytes(2 * P));
      }
      // Each stage's buffer rounds up to 256 bytes.
      EXPECT_NEAR(double(weights), double(2 * (P + copy)), 256.0 * pp);
      EXPECT_NEAR(double(master), double(4 * (P + copy)), 256.0 * pp);
      EXPECT_NEAR(double(gradients), double(4 * (P + copy)), 256.0 * pp);
      EXPECT_NEAR(double(moments), double(8 * (P + copy)), 2 * 256.0 * pp);
    }
    // At pp 1 the stage is the whole model, once.
    EXPECT_EQ(plan_gpu_memory(c, stage_layout(1, 0)).bytes(MemoryKind::Weights), device_arena_bytes(2 * P));
  }
}

// With adapters each stage holds the frozen base of its units (the last stage's copy of a tied table too) and the
// adapters of its layers with their state; together the stages hold the pp 1 plan's, and a stage keeps each of its
// layers' r-wide intermediates once per micro-batch in flight.
TEST(MemoryPlanGpu, LoraPipelineStagesTogetherHoldTheBaseAndTheAdapters) {
  for (const char* fixture : {"llama2_tiny", "llama32_tiny"}) {
    const LlamaConfig c = deeper(fixture, 6);
    const ParamLayout layout(c);
    const int64_t P = layout.total();
    const int64_t copy = layout.lm_head_unit() == 0 ? layout.unit_range(0).second - layout.unit_range(0).first : 0;
    MemoryLayout one = stage_layout(1, 0);
    one.lora.rank = 4, one.lora.alpha = 8;
    const int64_t A = lora_parameter_count(c, one.lora);
    for (int64_t pp : {2, 3}) {
      SCOPED_TRACE(testing::Message() << fixture << " pp " << pp);
      const std::vector<PipelineStage> stages = pipeline_stages(c, pp, 32);
      int64_t base = 0, master = 0, moments = 0;
      for (int64_t s = 0; s < pp; s++) {
        MemoryLayout l = one;
        l.pp = pp, l.pp_rank = s;
        const MemoryPlan plan = plan_gpu_memory(c, l);
        base += find(plan, "bf16 base weights (frozen)")->bytes;
        master += find(plan, "LoRA fp32 master weights")->bytes;
        moments += plan.bytes(MemoryKind::Moments);
        EXPECT_EQ(find(plan, "LoRA fp32 master weights")->bytes, device_arena_bytes(4 * A / 6 * stages[s].layers()));
        EXPECT_EQ(items_starting(plan, "layer ") - 13 * stages[s].layers() * (pp - s), 7 * stages[s].layers() * (pp - s));
        EXPECT_EQ(find(plan, "fp32 gradients"), nullptr);  // the base has none
      }
      EXPECT_NEAR(double(base), double(2 * (P + copy)), 256.0 * pp);
      EXPECT_NEAR(double(master), double(4 * A), 256.0 * pp);
      EXPECT_NEAR(double(moments), double(8 * A), 2 * 256.0 * pp);
    }
  }
}

// An nf4 base over stages: each stage holds the NF4 codes of its own layers (together the pp 1 plan's) and one
// layer's dequantized bf16 buffer, the size of the pp 1 plan's (every layer's unit is the same size, and a later
// stage holds no layer 0).
TEST(MemoryPlanGpu, AnNf4BaseOverStagesHoldsItsLayersAndOneDequantizedLayer) {
  for (const char* fixture : {"llama2_tiny", "llama32_tiny"}) {
    const LlamaConfig c = deeper(fixture, 6);
    MemoryLayout one = stage_layout(1, 0);
    one.lora.rank = 4, one.lora.alpha = 8, one.lora.base_quant = BaseQuant::Nf4;
    const MemoryPlan whole = plan_gpu_memory(c, one);
    const MemoryItem* dequant = find(whole, "dequantized layer weights (bf16, one layer)");
    ASSERT_NE(dequant, nullptr);
    const ParamLayout layout(c);
    EXPECT_EQ(dequant->bytes, device_arena_bytes(2 * (layout.unit_range(1).second - layout.unit_range(1).first)));
    for (int64_t pp : {2, 3}) {
      SCOPED_TRACE(testing::Message() << fixture << " pp " << pp);
      int64_t nf4 = 0;
      for (int64_t s = 0; s < pp; s++) {
        MemoryLayout l = one;
        l.pp = pp, l.pp_rank = s;
        const MemoryPlan plan = plan_gpu_memory(c, l);
        ASSERT_NE(find(plan, "dequantized layer weights (bf16, one layer)"), nullptr);
        EXPECT_EQ(find(plan, "dequantized layer weights (bf16, one layer)")->bytes, dequant->bytes) << "stage " << s;
        nf4 += find(plan, "nf4 base weights (frozen decoder Linear weights)")->bytes;
      }
      EXPECT_NEAR(double(nf4), double(find(whole, "nf4 base weights (frozen decoder Linear weights)")->bytes),
                  256.0 * pp);
    }
  }
}

// 1F1B: stage s keeps the activations of pp - s micro-batches (the first stage the most, the last one), of its own
// layers only; the head's buffers are the last stage's and the embedding's the first's.
TEST(MemoryPlanGpu, TheFirstStageHoldsPpMicroBatchesOfActivations) {
  const LlamaConfig c = deeper("llama2_tiny", 8);
  const int64_t pp = 4;
  const std::vector<PipelineStage> stages = pipeline_stages(c, pp, 32);
  const MemoryPlan whole = plan_gpu_memory(c, stage_layout(1, 0));
  for (int64_t s = 0; s < pp; s++) {
    SCOPED_TRACE(testing::Message() << "stage " << s);
    const MemoryPlan plan = plan_gpu_memory(c, stage_layout(pp, s));
    int64_t kept = 0;
    for (int64_t layer = 0; layer < c.num_hidden_layers; layer++) {
      const int64_t n = items_starting(plan, str("layer ", layer, " resid_in")) +
                        items_starting(plan, str("layer ", layer, " (in flight "));
      const bool mine = layer >= stages[s].layer_begin && layer < stages[s].layer_end;
      EXPECT_EQ(items_starting(plan, str("layer ", layer, " ")) > 0, mine) << "layer " << layer;
      if (mine) {
        EXPECT_EQ(items_starting(plan, str("layer ", layer, " resid_in")), 1);
      }
      kept += n;
    }
    // 13 kept buffers per layer and micro-batch without recompute, pp - s micro-batches in flight.
    int64_t layer_items = 0;
    for (const MemoryItem& i : plan.items) layer_items += i.name.rfind("layer ", 0) == 0;
    EXPECT_EQ(layer_items, 13 * stages[s].layers() * (pp - s));
    EXPECT_EQ(find(plan, "token ids") != nullptr, s == 0);
    EXPECT_EQ(find(plan, "logits chunk") != nullptr, s == pp - 1);
    EXPECT_EQ(find(plan, "targets") != nullptr, s == pp - 1);
    // Point to point: a stage receives an activation straight into its first layer's input and a gradient into
    // d_resid, and sends its input gradient from d_resid; every stage but the last has its output to send, a bf16
    // [tokens, hidden] (the last stage's is the final residual).
    const int64_t p2p = device_arena_bytes(2 * 32 * c.hidden_size * 2);
    EXPECT_EQ(items_starting(plan, "pipeline receive"), 0);
    EXPECT_EQ(items_starting(plan, "pipeline send: gradient"), 0);
    EXPECT_EQ(items_starting(plan, "pipeline send: activation"), s < pp - 1);
    EXPECT_EQ(find(plan, "final residual") != nullptr, s == pp - 1);
    EXPECT_EQ(plan.bytes(MemoryKind::Communication), p2p * (s < pp - 1));
    // The first stage's layer activations: pp micro-batches of its layers, each layer's as at pp 1.
    if (s == 0) {
      int64_t bytes = 0, whole_layer = 0;
      for (const MemoryItem& i : plan.items) bytes += i.name.rfind("layer ", 0) == 0 ? i.bytes : 0;
      for (const MemoryItem& i : whole.items) whole_layer += i.name.rfind("layer 0 ", 0) == 0 ? i.bytes : 0;
      EXPECT_EQ(bytes, pp * stages[0].layers() * whole_layer);
    }
  }
  // A forward alone keeps one micro-batch, and sends no gradients.
  MemoryLayout forward = stage_layout(pp, 0);
  forward.training = false;
  const MemoryPlan f = plan_gpu_memory(c, forward);
  EXPECT_EQ(items_starting(f, "layer 0 (in flight"), 0);
  EXPECT_EQ(items_starting(f, "pipeline receive: gradient"), 0);
  EXPECT_EQ(items_starting(f, "pipeline send: activation"), 1);
}

// Tied embeddings over stages: the first and the last stage receive the other's gradient of the table (fp32, this tp
// rank's rows) to add to their own; the stages between hold none, nor does a forward alone.
TEST(MemoryPlanGpu, TiedStagesReceiveTheTablesGradient) {
  const LlamaConfig c = deeper("llama32_tiny", 6);
  const std::string name = "pipeline: the tied embedding's gradient from the other stage";
  for (int64_t tp : {1, 2}) {
    for (int64_t s = 0; s < 3; s++) {
      MemoryLayout l = stage_layout(3, s);
      l.tp = tp;
      const MemoryItem* item = find(plan_gpu_memory(c, l), name);
      ASSERT_EQ(item != nullptr, s != 1) << "stage " << s;
      if (item) {
        EXPECT_EQ(item->bytes, device_arena_bytes(c.vocab_size / tp * c.hidden_size * 4));
      }
      l.training = false;
      EXPECT_EQ(find(plan_gpu_memory(c, l), name), nullptr);
    }
  }
  EXPECT_EQ(find(plan_gpu_memory(deeper("llama2_tiny", 6), stage_layout(3, 0)), name), nullptr);  // untied
}

// ZeRO inside a stage: the stage's units are sharded over dp as the whole model's are at pp 1.
TEST(MemoryPlanGpu, ZeroShardsEachStagesOwnParametersOverDp) {
  const LlamaConfig c = deeper("llama2_tiny", 6);
  int64_t master = 0, whole = 0;
  for (int64_t s = 0; s < 2; s++) {
    MemoryLayout l = stage_layout(2, s, 1);
    l.dp = 4;
    master += plan_gpu_memory(c, l).bytes(MemoryKind::Master);
    l.zero = 0, l.dp = 1;
    whole += plan_gpu_memory(c, l).bytes(MemoryKind::Master);
  }
  EXPECT_NEAR(double(master), double(whole) / 4, 4 * 256.0 + 64);
  MemoryLayout z3 = stage_layout(2, 1, 3);
  z3.dp = 2;
  const MemoryPlan p3 = plan_gpu_memory(c, z3);
  EXPECT_NE(find(p3, "weight gather buffer 0"), nullptr);
  EXPECT_EQ(find(p3, "bf16 weights"), nullptr);
}

// sp: the norm and residual region holds seq / tp rows (resid_in, the norms' outputs and rstd, resid_mid, and the
// residual stream's gradient); the GEMMs' inputs and outputs do not change, and one gathered input is added.
TEST(MemoryPlanGpu, SequenceParallelismDividesTheNormAndResidualBytesByTp) {
  const LlamaConfig c = Fixture("llama2_tiny").config;
  MemoryLayout l;
  l.tp = 2, l.micro_batch = 2, l.seq_len = 64;
  const int64_t n = 2 * 64, C = c.hidden_size;
  const MemoryPlan plain = plan_gpu_memory(c, l);
  l.sp = true;
  const MemoryPlan sp = plan_gpu_memory(c, l);
  for (const char* f : {"resid_in", "norm1", "resid_mid", "norm2"}) {
    EXPECT_EQ(find(plain, str("layer 0 ", f))->bytes, device_arena_bytes(n * C * 2)) << f;
    EXPECT_EQ(find(sp, str("layer 0 ", f))->bytes, device_arena_bytes(n / 2 * C * 2)) << f;
  }
  for (const char* f : {"rstd1", "rstd2"}) EXPECT_EQ(find(sp, str("layer 0 ", f))->bytes, device_arena_bytes(n / 2 * 4));
  for (const char* f : {"q", "att", "gate_up", "act"})
    EXPECT_EQ(find(sp, str("layer 0 ", f))->bytes, find(plain, str("layer 0 ", f))->bytes) << f;
  EXPECT_EQ(find(sp, "d_resid")->bytes, device_arena_bytes(n / 2 * C * 2));
  EXPECT_EQ(find(sp, "sequence-parallel gathered input")->bytes, device_arena_bytes(n * C * 2));
  EXPECT_EQ(find(plain, "sequence-parallel gathered input"), nullptr);
  // A layer's two norm-weight gradients from this rank's rows, summed over tp before they are written.
  EXPECT_EQ(find(sp, "sequence-parallel norm weight gradients")->bytes, device_arena_bytes(2 * C * 4));
  EXPECT_EQ(find(plain, "sequence-parallel norm weight gradients"), nullptr);
  // Per layer, the saving is exactly the norm and residual region's half.
  int64_t plain_layer = 0, sp_layer = 0;
  for (const MemoryItem& i : plain.items) plain_layer += i.name.rfind("layer 0 ", 0) == 0 ? i.bytes : 0;
  for (const MemoryItem& i : sp.items) sp_layer += i.name.rfind("layer 0 ", 0) == 0 ? i.bytes : 0;
  EXPECT_EQ(plain_layer - sp_layer, 4 * (device_arena_bytes(n * C * 2) - device_arena_bytes(n / 2 * C * 2)) +
                                        2 * (device_arena_bytes(n * 4) - device_arena_bytes(n / 2 * 4)));
  EXPECT_LT(sp.bytes(MemoryKind::Activations), plain.bytes(MemoryKind::Activations));
  // Selective recompute with sp keeps no norm output; the split residual stream stays.
  l.recompute = Recompute::Selective;
  const MemoryPlan selective = plan_gpu_memory(c, l);
  EXPECT_EQ(find(selective, "layer 0 norm1"), nullptr);
  EXPECT_EQ(find(selective, "layer 0 resid_mid")->bytes, device_arena_bytes(n / 2 * C * 2));
  // Pipeline sends with sp carry each tp rank's rows.
  l.pp = 2, l.pp_rank = 0;
  EXPECT_EQ(find(plan_gpu_memory(c, l), "pipeline send: activation to the next stage")->bytes,
            device_arena_bytes(n / 2 * C * 2));
}

TEST(MemoryPlanGpu, PipelineAndSequenceParallelRefusalsNameTheOption) {
  const LlamaConfig c = Fixture("llama2_tiny").config;  // 2 layers
  MemoryLayout l = stage_layout(3, 0);
  EXPECT_NE(testing_util::error_of([&] { plan_gpu_memory(c, l); }).find("option 'pp'"), std::string::npos);
  l = stage_layout(2, 2);
  EXPECT_NE(testing_util::error_of([&] { plan_gpu_memory(c, l); }).find("pipeline stage 2 of 2"), std::string::npos);
  l = MemoryLayout{};
  l.tp = 2, l.sp = true, l.seq_len = 33;
  EXPECT_NE(testing_util::error_of([&] { plan_gpu_memory(c, l); }).find("option 'sp'"), std::string::npos);
  // The fit check prints a pp plan at ZeRO 0 or 1 as the engine's own, at ZeRO-2 or 3 as the design (the CUDA engine
  // runs stages at ZeRO 0 and 1); sp is the engine's own plan.
  GpuFit fit = check_gpu_fit(c, stage_layout(2, 1), int64_t(80) << 30);
  EXPECT_TRUE(fit.fits);
  EXPECT_NE(fit.report.find("pipeline stage 1"), std::string::npos) << fit.report;
  EXPECT_EQ(fit.report.find("AS DESIGNED"), std::string::npos) << fit.report;
  MemoryLayout z2 = stage_layout(2, 1, 2);
  z2.dp = 2;
  fit = check_gpu_fit(c, z2, int64_t(80) << 30);
  EXPECT_NE(fit.report.find("AS DESIGNED"), std::string::npos) << fit.report;
  EXPECT_EQ(check_gpu_fit(c, stage_layout(1, 0), int64_t(80) << 30).report.find("AS DESIGNED"), std::string::npos);
  MemoryLayout sp = stage_layout(1, 0);
  sp.tp = 2, sp.sp = true;
  EXPECT_EQ(check_gpu_fit(c, sp, int64_t(80) << 30).report.find("AS DESIGNED"), std::string::npos);
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

// With adapters, at every stage the CUDA engine trains them (the arena's check_all_taken also holds at
// construction: every planned buffer was taken): a bf16 base at ZeRO 0-3, an nf4 base at ZeRO-2.
TEST(MemoryPlanGpu, TheLoraEngineAllocatesItsPlan) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  for (const auto& [zero, quant] : {std::pair{0, BaseQuant::None}, std::pair{1, BaseQuant::None},
                                    std::pair{2, BaseQuant::None}, std::pair{2, BaseQuant::Nf4},
                                    std::pair{3, BaseQuant::None}}) {
    testing_util::SingleRank rank;
    EngineOptions o = testing_util::engine_options(f, Device::Cuda, zero);
    o.lora.rank = 4, o.lora.alpha = 8, o.base_quant = quant;
    const int64_t before = device_used();
    std::unique_ptr<Engine> e = make_engine(f.config, o, rank.mesh, testing_util::fixture_weights(f));
    SCOPED_TRACE(testing::Message() << "ZeRO-" << zero << (quant == BaseQuant::Nf4 ? " nf4" : " bf16"));
    expect_allocation_is_the_plan(device_used() - before, plan_gpu_memory(f.config, engine_memory_layout(o, rank.mesh)));
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
