// The CPU engine with LoRA adapters (engine/engine.h, EngineOptions::lora): its state is the adapters' (and the frozen
// base's weights), every parallel layout (dp 2 at ZeRO 0/1/2 with gradient accumulation, tp 2, dp 2 x tp 2) follows
// one rank, a checkpoint exchange of the adapter state continues bit for bit, and what is not implemented says so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"
#include "ckpt/safetensors.h"
#include "engine/engine.h"
#include "model/lora.h"
#include "tests/engine/engine_test_util.h"

namespace tuna {
namespace {

using testing_util::engine_options;
using testing_util::Fixture;
using testing_util::fixture_weights;
using testing_util::SingleRank;

LoraConfig lora_of(int64_t rank, double alpha, const std::string& targets, double dropout = 0) {
  LoraConfig l;
  l.rank = rank, l.alpha = alpha, l.targets = parse_lora_targets(targets), l.dropout = dropout;
  return l;
}

const std::string kAll = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";

EngineOptions lora_options(const Fixture& f, const LoraConfig& lora, int zero = 0) {
  EngineOptions o = engine_options(f, Device::Cpu, zero);
  o.lora = lora;
  o.seed = 17;
  return o;
}

// The step's state on one rank is the adapters' (weights, gradients, two moments: 16 bytes each) and the frozen
// base's fp32 weights: no base gradient, master copy or moment; the same figure as malloc's own accounting.
TEST(EngineLora, StateIsTheAdaptersAndTheFrozenBaseOnly) {
  Fixture f("llama2_tiny");
  f.config = testing_util::many_layers(f);  // 16 layers: the state outweighs the fixed buffers (rotary tables...)
  SingleRank r;
  const LoraConfig lora = lora_of(4, 8, kAll);
  const int64_t before = testing_util::host_heap_in_use();
  std::unique_ptr<Engine> e = make_engine(f.config, lora_options(f, lora), r.mesh, random_weights(3, 0.02));
  const int64_t heap = testing_util::host_heap_in_use() - before;
  const int64_t adapters = lora_parameter_count(f.config, lora), base = f.config.n_params();
  EXPECT_EQ(e->layout().total(), adapters);
  EXPECT_EQ(e->base_layout().total(), base);
  EXPECT_EQ(e->state_bytes(), 4 * (base + 4 * adapters));
  EXPECT_NEAR(double(heap - e->activation_bytes()), double(e->state_bytes()), 0.05 * e->state_bytes());
  // The checkpoint state is the adapters', under PEFT's names.
  EXPECT_NE(e->layout().find("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), nullptr);
  EXPECT_EQ(e->layout().find("model.layers.0.self_attn.q_proj.weight"), nullptr);
  int64_t covered = 0;
  for (const Segment& s : e->segments()) covered += s.size;
  EXPECT_EQ(covered, adapters);
  EXPECT_LT(e->flops_per_token(f.seq), model_flops_per_token(f.config, f.seq));
}

TEST(EngineLora, RefusesWhatIsNotImplemented) {
  Fixture f("llama2_tiny");
  SingleRank r;
  const LoraConfig lora = lora_of(4, 8, kAll);
  auto expect_fails = [&](const EngineOptions& o, const WeightFill& initial, const std::string& part) {
    try {
      make_engine(f.config, o, r.mesh, initial);
      ADD_FAILURE() << "no error, expected '" << part << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  EngineOptions quantized_zero3 = lora_options(f, lora, 3);
  quantized_zero3.base_quant = BaseQuant::Nf4;
  expect_fails(quantized_zero3, fixture_weights(f), "--zero 3: sharding a quantized base is not implemented");
  expect_fails(lora_options(f, lora), nullptr, "--init");
}

// 10 AdamW steps of the adapters (the reference's schedule, clipping and weight decay on every adapter tensor) follow
// PEFT + transformers in float64: each step's loss and gradient norm, and the final adapters.
class EngineLoraParity : public testing::TestWithParam<std::string> {};

TEST_P(EngineLoraParity, TenStepsFollowPeft) {
  const std::filesystem::path dir = std::filesystem::path("tests/fixtures") / GetParam();
  std::ifstream in(dir / "reference.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  Fixture f(meta.at("base").get<std::string>());
  f.meta = meta;  // the adapters' hyperparameters
  SafetensorsFile ref(dir / "reference.safetensors");
  ref.read_i32("input_ids", {f.batch, f.seq}, f.inputs.data());
  ref.read_i32("targets", {f.batch, f.seq}, f.targets.data());
  EngineOptions o = lora_options(f, read_peft_adapter_config(dir));
  // The fixture's starting adapters (PEFT names), a piece at a time as the engine asks.
  const SafetensorsFile adapters(dir / "adapter_model.safetensors");
  o.adapters = [&](const ParamLayout& layout, const Segment& piece, float* out) {
    for (const ParamTensor& t : layout.tensors()) {
      const int64_t lo = std::max(piece.begin, t.offset), hi = std::min(piece.begin + piece.size, t.offset + t.numel);
      if (lo >= hi) continue;
      std::vector<float> whole(t.numel);
      adapters.read_f32(t.name, t.shape, whole.data());
      std::copy(whole.begin() + (lo - t.offset), whole.begin() + (hi - t.offset), out + (lo - piece.begin));
    }
  };
  SingleRank r;
  std::unique_ptr<Engine> e = make_engine(f.config, o, r.mesh, fixture_weights(f));
  const int64_t steps = meta.at("steps");
  std::vector<double> losses(steps), norms(steps), lrs(steps);
  ref.read_f64("train_losses", {steps}, losses.data());
  ref.read_f64("grad_norms", {steps}, norms.data());
  ref.read_f64("lrs", {steps}, lrs.data());
  for (int64_t s = 0; s < steps; s++) {
    EXPECT_NEAR(learning_rate(f.optimizer(), s, steps), lrs[s], 1e-12) << "step " << s;
    const StepResult result = testing_util::train_step(*e, f, s, steps);
    EXPECT_NEAR(result.loss, losses[s], 1e-5 * losses[s]) << "step " << s;
    EXPECT_NEAR(result.stats.grad_norm, norms[s], 1e-5 * norms[s]) << "step " << s;
  }
  std::vector<float> p, m, v;
  e->export_shard(p, m, v);
  for (const ParamTensor& t : e->layout().tensors()) {
    std::vector<double> want(t.numel);
    ref.read_f64("final." + t.name, t.shape, want.data());
    EXPECT_LE(testing_util::rel_err_norm(p.data() + t.offset, want.data(), t.numel), 1e-5) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EngineLoraParity, testing::Values("lora_llama2_tiny", "lora_llama32_tiny"));

// 4 rows of 16 tokens, targets the next token (the last of each row ignored): the global batch of every layout.
struct FourRows {
  static constexpr int64_t kRows = 4, kSeq = 16;
  std::vector<int32_t> inputs, targets;
  explicit FourRows(int64_t vocab) : inputs(kRows * kSeq), targets(kRows * kSeq) {
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int32_t& t : inputs) x ^= x << 13, x ^= x >> 7, x ^= x << 17, t = static_cast<int32_t>(x % vocab);
    for (int64_t i = 0; i < kRows * kSeq; i++) targets[i] = (i + 1) % kSeq == 0 ? -100 : inputs[i + 1];
  }
};

constexpr int64_t kSteps = 3;

// A step over rows [first, first + rows) in micro-batches of `micro` rows.
StepResult rows_step(Engine& e, const Fixture& f, const FourRows& d, int64_t first, int64_t rows, int64_t micro,
                     int64_t s) {
  e.begin_step();
  LossSum sum;
  for (int64_t r = first; r < first + rows; r += micro) {
    const LossSum l = e.forward_backward(d.inputs.data() + r * FourRows::kSeq, d.targets.data() + r * FourRows::kSeq,
                                         micro, FourRows::kSeq);
    sum.sum += l.sum, sum.count += l.count;
  }
  OptimizerConfig opt = f.optimizer();
  opt.lr = 2e-2;  // large enough that 3 steps move the adapters well away from their start
  return e.finish_step(sum, learning_rate(opt, s, 10));
}

struct LayoutCase {
  int ranks, tp, zero;
  int64_t micro;  // rows per micro-batch (gradient accumulation when below the rank's rows)
  BaseQuant base_quant = BaseQuant::None;  // nf4: QLoRA, the one rank's base quantized alike
};

class EngineLoraLayouts : public testing::TestWithParam<LayoutCase> {};

TEST_P(EngineLoraLayouts, FollowOneRank) {
  const LayoutCase c = GetParam();
  Fixture f("llama2_tiny");
  const LoraConfig lora = lora_of(4, 8, kAll);
  const FourRows data(f.config.vocab_size);
  // One rank, all 4 rows in one micro-batch.
  std::vector<StepResult> want;
  std::vector<float> one_weights, m, v;
  {
    SingleRank one;
    EngineOptions o = lora_options(f, lora);
    o.micro_batch = FourRows::kRows, o.seq_len = FourRows::kSeq, o.base_quant = c.base_quant;
    std::unique_ptr<Engine> e = make_engine(f.config, o, one.mesh, fixture_weights(f));
    for (int64_t s = 0; s < kSteps; s++) want.push_back(rows_step(*e, f, data, 0, FourRows::kRows, FourRows::kRows, s));
    e->export_shard(one_weights, m, v);
  }
  const ParamLayout whole = lora_layout(f.config, lora).params;
  testing_util::run_thread_ranks(c.ranks, [&](Comm& world) {
    Mesh mesh = make_mesh(world, c.tp);
    const int64_t rows = FourRows::kRows / mesh.dp_size;
    EngineOptions o = lora_options(f, lora, c.zero);
    o.micro_batch = c.micro, o.seq_len = FourRows::kSeq, o.base_quant = c.base_quant;
    std::unique_ptr<Engine> e = make_engine(f.config, o, mesh, fixture_weights(f));
    for (int64_t s = 0; s < kSteps; s++) {
      const StepResult r = rows_step(*e, f, data, mesh.dp_rank * rows, rows, c.micro, s);
      EXPECT_EQ(r.tokens, want[s].tokens);
      EXPECT_NEAR(r.loss, want[s].loss, 1e-5 * want[s].loss) << "step " << s;
      EXPECT_NEAR(r.stats.grad_norm, want[s].stats.grad_norm, 1e-4 * want[s].stats.grad_norm) << "step " << s;
    }
    // This rank's pieces of the one rank's final adapters (its tp blocks, then its ZeRO pieces).
    EXPECT_LE(testing_util::shard_error_against_whole(*e, whole, one_weights.data()), 1e-5)
        << "rank " << world.rank() << "'s final adapters";
  });
}

INSTANTIATE_TEST_SUITE_P(Cpu, EngineLoraLayouts,
                         testing::Values(LayoutCase{2, 1, 0, 1}, LayoutCase{2, 1, 1, 1}, LayoutCase{2, 1, 2, 1},
                                         LayoutCase{2, 1, 2, 2}, LayoutCase{2, 2, 0, 2}, LayoutCase{4, 2, 1, 1},
                                         LayoutCase{4, 2, 2, 2}, LayoutCase{2, 1, 0, 1, BaseQuant::Nf4},
                                         LayoutCase{2, 1, 2, 1, BaseQuant::Nf4}),
                         [](const testing::TestParamInfo<LayoutCase>& i) {
                           return "ranks" + std::to_string(i.param.ranks) + "_tp" + std::to_string(i.param.tp) +
                                  "_zero" + std::to_string(i.param.zero) + "_micro" + std::to_string(i.param.micro) +
                                  (i.param.base_quant == BaseQuant::Nf4 ? "_nf4" : "");
                         });

// QLoRA under tensor parallelism: each rank quantizes the whole tensors and keeps its blocks (model/quantized_weights.h),
// so its base is one rank's; tp 2 (down_proj blocks of 80 columns, o_proj of 32: splits inside the 64-element blocks)
// and dp 2 x tp 2 follow QLoRA on one rank as LoRA's layouts follow LoRA's.
struct QloraCase {
  int ranks, zero;
  BaseQuant quant;
};

class EngineQloraTensorParallel : public testing::TestWithParam<QloraCase> {};

TEST_P(EngineQloraTensorParallel, FollowsOneRank) {
  const QloraCase c = GetParam();
  Fixture f("llama2_tiny");
  const LoraConfig lora = lora_of(4, 8, kAll);
  const FourRows data(f.config.vocab_size);
  const auto options = [&](int zero, int64_t micro) {
    EngineOptions o = lora_options(f, lora, zero);
    o.micro_batch = micro, o.seq_len = FourRows::kSeq, o.base_quant = c.quant;
    return o;
  };
  std::vector<StepResult> want;
  std::vector<float> one_weights, m, v;
  {
    SingleRank one;
    std::unique_ptr<Engine> e = make_engine(f.config, options(0, FourRows::kRows), one.mesh, fixture_weights(f));
    for (int64_t s = 0; s < kSteps; s++) want.push_back(rows_step(*e, f, data, 0, FourRows::kRows, FourRows::kRows, s));
    e->export_shard(one_weights, m, v);
  }
  const ParamLayout whole = lora_layout(f.config, lora).params;
  testing_util::run_thread_ranks(c.ranks, [&](Comm& world) {
    Mesh mesh = make_mesh(world, 2);
    const int64_t rows = FourRows::kRows / mesh.dp_size;
    std::unique_ptr<Engine> e = make_engine(f.config, options(c.zero, rows), mesh, fixture_weights(f));
    for (int64_t s = 0; s < kSteps; s++) {
      const StepResult r = rows_step(*e, f, data, mesh.dp_rank * rows, rows, rows, s);
      EXPECT_EQ(r.tokens, want[s].tokens);
      EXPECT_NEAR(r.loss, want[s].loss, 1e-5 * want[s].loss) << "step " << s;
      EXPECT_NEAR(r.stats.grad_norm, want[s].stats.grad_norm, 1e-4 * want[s].stats.grad_norm) << "step " << s;
    }
    EXPECT_LE(testing_util::shard_error_against_whole(*e, whole, one_weights.data()), 1e-5)
        << "rank " << world.rank() << "'s final adapters";
  });
}

INSTANTIATE_TEST_SUITE_P(Cpu, EngineQloraTensorParallel,
                         testing::Values(QloraCase{2, 0, BaseQuant::Nf4}, QloraCase{4, 1, BaseQuant::Int8}),
                         [](const testing::TestParamInfo<QloraCase>& i) {
                           return "ranks" + std::to_string(i.param.ranks) + "_tp2_zero" + std::to_string(i.param.zero) +
                                  "_" + base_quant_name(i.param.quant);
                         });

// A subset of targets at tp 2 (q, v column-parallel; down row-parallel), with dp 2 x tp 2 at ZeRO-2.
TEST(EngineLora, SubsetOfTargetsUnderTensorParallelFollowsOneRank) {
  Fixture f("llama32_tiny");
  const LoraConfig lora = lora_of(2, 6, "q_proj,v_proj,down_proj");
  const FourRows data(f.config.vocab_size);
  std::vector<StepResult> want;
  {
    SingleRank one;
    EngineOptions o = lora_options(f, lora);
    o.micro_batch = FourRows::kRows, o.seq_len = FourRows::kSeq;
    std::unique_ptr<Engine> e = make_engine(f.config, o, one.mesh, fixture_weights(f));
    for (int64_t s = 0; s < kSteps; s++) want.push_back(rows_step(*e, f, data, 0, FourRows::kRows, FourRows::kRows, s));
  }
  testing_util::run_thread_ranks(4, [&](Comm& world) {
    Mesh mesh = make_mesh(world, 2);
    EngineOptions o = lora_options(f, lora, 2);
    o.micro_batch = 1, o.seq_len = FourRows::kSeq;
    std::unique_ptr<Engine> e = make_engine(f.config, o, mesh, fixture_weights(f));
    for (int64_t s = 0; s < kSteps; s++) {
      const StepResult r = rows_step(*e, f, data, mesh.dp_rank * 2, 2, 1, s);
      EXPECT_NEAR(r.loss, want[s].loss, 1e-5 * want[s].loss) << "step " << s;
      EXPECT_NEAR(r.stats.grad_norm, want[s].stats.grad_norm, 1e-4 * want[s].stats.grad_norm) << "step " << s;
    }
  });
}

// Export -> import of the adapter state (weights and moments, a piece at a time) continues bit for bit: the next
// step of the importing engine equals the exporting one's, at every ZeRO stage the adapters take, with dropout on
// (the masks follow the step count the checkpoint carries).
class EngineLoraResume : public testing::TestWithParam<int> {};

TEST_P(EngineLoraResume, ExportImportContinuesBitForBit) {
  Fixture f("llama2_tiny");
  const LoraConfig lora = lora_of(4, 8, kAll, 0.1);
  SingleRank ra, rb;
  std::unique_ptr<Engine> a = make_engine(f.config, lora_options(f, lora, GetParam()), ra.mesh, fixture_weights(f));
  std::unique_ptr<Engine> b = make_engine(f.config, lora_options(f, lora, GetParam()), rb.mesh, fixture_weights(f));
  testing_util::train_step(*a, f, 0, 10);
  testing_util::train_step(*a, f, 1, 10);
  const testing_util::StateExchange x = testing_util::exchange_state_piecewise(*a, *b);
  EXPECT_EQ(x.shard_elements, a->layout().total());
  const StepResult sa = testing_util::train_step(*a, f, 2, 10), sb = testing_util::train_step(*b, f, 2, 10);
  EXPECT_EQ(sa.loss, sb.loss);
  EXPECT_EQ(sa.stats.grad_norm, sb.stats.grad_norm);
  std::vector<float> pa, ma, va, pb, mb, vb;
  a->export_shard(pa, ma, va);
  b->export_shard(pb, mb, vb);
  EXPECT_EQ(pa, pb);
  EXPECT_EQ(ma, mb);
  EXPECT_EQ(va, vb);
}

INSTANTIATE_TEST_SUITE_P(ZeroStages, EngineLoraResume, testing::Values(0, 1, 2));

}  // namespace
}  // namespace tuna
