// The CUDA engine with LoRA adapters (engine/engine_gpu.cpp, EngineOptions::lora) on one device: 10 AdamW steps
// of the adapters follow PEFT + transformers in float64 (tests/fixtures/lora_*: all targets untied, q/v/down tied),
// dropout with full recompute over accumulated micro-batches follows the CPU engine, a checkpoint exchange of the
// adapter state continues bit for bit (dropout on: the masks follow the restored step count), ZeRO 1 and 2 over the
// adapters equal ZeRO-0 bit for bit on one rank (a bf16 or nf4 base), dp 2 (ZeRO 0-2) or tp 2 as threads sharing
// the device follow one rank, and so do pipeline stages (pp 2, with dropout; pp 2 x dp 2 at ZeRO-1) over the same
// micro-batches. Skipped without a device; on the emulator in CI.
//
// Tolerances: a bf16 trajectory against fp32 or float64, as tests/engine/test_engine_gpu.cpp (5e-2 relative on a
// step's loss, 0.15 on its gradient norm; derived in tests/model/test_llama_gpu.cpp); ranks against one rank as
// tests/model/ranks_test_util.h argues them.
#if TUNA_CUDA
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "ckpt/safetensors.h"
#include "comm/comm.h"
#include "engine/engine.h"
#include "model/lora.h"
#include "tests/engine/engine_test_util.h"
#include "tests/kernels/gpu_test_util.h"
#include "tests/model/ranks_test_util.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::engine_options;
using testing_util::Fixture;
using testing_util::fixture_weights;
using testing_util::SingleRank;
using testing_util::train_step;
using testing_util::adapters_from;

EngineOptions lora_options(const Fixture& f, const LoraConfig& lora, Device device) {
  EngineOptions o = engine_options(f, device);
  o.lora = lora;
  o.seed = 17;
  return o;
}

class EngineLoraGpuParity : public testing::TestWithParam<std::string> {};

TEST_P(EngineLoraGpuParity, TenStepsFollowPeft) {
  TUNA_REQUIRE_GPU();
  const std::filesystem::path dir = std::filesystem::path("tests/fixtures") / GetParam();
  std::ifstream in(dir / "reference.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  Fixture f(meta.at("base").get<std::string>());
  f.meta = meta;
  SafetensorsFile ref(dir / "reference.safetensors");
  ref.read_i32("input_ids", {f.batch, f.seq}, f.inputs.data());
  ref.read_i32("targets", {f.batch, f.seq}, f.targets.data());
  EngineOptions o = lora_options(f, read_peft_adapter_config(dir), Device::Cuda);
  o.adapters = adapters_from(dir / "adapter_model.safetensors");
  SingleRank r;
  std::unique_ptr<Engine> e = make_engine(f.config, o, r.mesh, fixture_weights(f));
  EXPECT_EQ(e->layout().total(), lora_parameter_count(f.config, o.lora));
  EXPECT_EQ(e->base_layout().total(), f.config.n_params());
  EXPECT_NE(e->layout().find("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), nullptr);
  const int64_t steps = meta.at("steps");
  std::vector<double> losses(steps), norms(steps);
  ref.read_f64("train_losses", {steps}, losses.data());
  ref.read_f64("grad_norms", {steps}, norms.data());
  for (int64_t s = 0; s < steps; s++) {
    const StepResult result = train_step(*e, f, s, steps);
    std::printf("  step %2lld  loss PEFT %.5f gpu %.5f   grad norm PEFT %.4f gpu %.4f\n", static_cast<long long>(s),
                losses[s], result.loss, norms[s], result.stats.grad_norm);
    EXPECT_NEAR(result.loss, losses[s], 5e-2 * losses[s]) << "step " << s;
    EXPECT_NEAR(result.stats.grad_norm, norms[s], 0.15 * norms[s]) << "step " << s;
  }
  EXPECT_EQ(e->steps_taken(), steps);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EngineLoraGpuParity, testing::Values("lora_llama2_tiny", "lora_llama32_tiny"));

// Dropout (the CPU engine's masks, keyed by seed, step, micro-batch and dp rank), two micro-batches a step and
// full recompute (which draws the masks a third time) follow the CPU engine over 3 steps.
TEST(EngineLoraGpu, DropoutAccumulationAndRecomputeFollowTheCpuEngine) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  LoraConfig lora;
  lora.rank = 4, lora.alpha = 8, lora.dropout = 0.25, lora.targets = parse_lora_targets("q_proj,v_proj,o_proj,down_proj");
  EngineOptions oc = lora_options(f, lora, Device::Cpu), og = lora_options(f, lora, Device::Cuda);
  oc.micro_batch = og.micro_batch = 1;
  oc.adapters = og.adapters = random_weights(5, 0.1);  // B away from zero: every gradient non-zero from step 0
  og.recompute = Recompute::Full;
  SingleRank rc, rg;
  std::unique_ptr<Engine> cpu = make_engine(f.config, oc, rc.mesh, fixture_weights(f));
  std::unique_ptr<Engine> gpu = make_engine(f.config, og, rg.mesh, fixture_weights(f));
  for (int64_t s = 0; s < 3; s++) {
    StepResult r[2];
    Engine* engines[2] = {cpu.get(), gpu.get()};
    for (int k = 0; k < 2; k++) r[k] = testing_util::train_step_by_rows(*engines[k], f, s, 10);
    std::printf("  step %lld  loss cpu %.5f gpu %.5f   grad norm cpu %.4f gpu %.4f\n", static_cast<long long>(s),
                r[0].loss, r[1].loss, r[0].stats.grad_norm, r[1].stats.grad_norm);
    EXPECT_EQ(r[0].tokens, r[1].tokens);
    EXPECT_NEAR(r[1].loss, r[0].loss, 5e-2 * r[0].loss) << "step " << s;
    EXPECT_NEAR(r[1].stats.grad_norm, r[0].stats.grad_norm, 0.15 * r[0].stats.grad_norm) << "step " << s;
  }
}

// QLoRA (--base_quant nf4): the CUDA engine quantizes its base a unit at a time as it fills it (the CPU engine's
// whole-tensor NF4) and follows the CPU engine with the same nf4 base over 3 steps with dropout: each step's loss and
// gradient norm, and the final adapters (B away from zero from the start, so every adapter trains); its plan holds the
// nf4 base, smaller than LoRA's bf16 one. An int8 base and tp 2 are refused on cuda, by name.
TEST(EngineLoraGpu, QloraFollowsTheCpuEngineWithTheSameNf4Base) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  LoraConfig lora;
  lora.rank = 4, lora.alpha = 8, lora.dropout = 0.1;
  EngineOptions oc = lora_options(f, lora, Device::Cpu), og = lora_options(f, lora, Device::Cuda);
  oc.base_quant = og.base_quant = BaseQuant::Nf4;
  oc.adapters = og.adapters = random_weights(5, 0.1);
  SingleRank rc, rg, rl;
  std::unique_ptr<Engine> cpu = make_engine(f.config, oc, rc.mesh, fixture_weights(f));
  std::unique_ptr<Engine> gpu = make_engine(f.config, og, rg.mesh, fixture_weights(f));
  EXPECT_NE(gpu->memory_report().find("nf4 base weights"), std::string::npos) << gpu->memory_report();
  EngineOptions bf16_base = og;
  bf16_base.base_quant = BaseQuant::None;
  EXPECT_LT(gpu->state_bytes(), make_engine(f.config, bf16_base, rl.mesh, fixture_weights(f))->state_bytes());
  for (int64_t s = 0; s < 3; s++) {
    const StepResult c = train_step(*cpu, f, s, 10), g = train_step(*gpu, f, s, 10);
    std::printf("  step %lld  loss cpu %.5f gpu %.5f   grad norm cpu %.4f gpu %.4f\n", static_cast<long long>(s), c.loss,
                g.loss, c.stats.grad_norm, g.stats.grad_norm);
    EXPECT_EQ(c.tokens, g.tokens);
    EXPECT_NEAR(g.loss, c.loss, 5e-2 * c.loss) << "step " << s;
    EXPECT_NEAR(g.stats.grad_norm, c.stats.grad_norm, 0.15 * c.stats.grad_norm) << "step " << s;
  }
  std::vector<float> pc, pg, m, v;
  cpu->export_shard(pc, m, v);
  gpu->export_shard(pg, m, v);
  ASSERT_EQ(pc.size(), pg.size());
  const std::vector<double> want(pc.begin(), pc.end());
  const double adapters_err = testing_util::rel_err_norm(pg.data(), want.data(), static_cast<int64_t>(pg.size()));
  std::printf("  final adapters rel err %.3e\n", adapters_err);
  EXPECT_LE(adapters_err, 1e-2);

  EngineOptions int8 = og;
  int8.base_quant = BaseQuant::Int8;
  SingleRank r8;
  std::string e = testing_util::error_of([&] { make_engine(f.config, int8, r8.mesh, fixture_weights(f)); });
  EXPECT_NE(e.find("option 'base_quant' int8 with --device cuda: an int8 frozen base is not implemented"),
            std::string::npos) << e;
  testing_util::run_thread_ranks(2, [&](Comm& world) {
    Mesh mesh = make_mesh(world, 2);
    const std::string tp = testing_util::error_of([&] { make_engine(f.config, og, mesh, fixture_weights(f)); });
    EXPECT_NE(tp.find("option 'base_quant' nf4 with --tp 2 and --device cuda: not implemented"), std::string::npos)
        << tp;
  });
}

// Export -> import of the adapters' state continues bit for bit, with dropout on and stochastic rounding.
TEST(EngineLoraGpu, ExportImportContinuesBitForBit) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama32_tiny");
  LoraConfig lora;
  lora.rank = 2, lora.alpha = 6, lora.dropout = 0.1;
  EngineOptions o = lora_options(f, lora, Device::Cuda);
  o.gpu.stochastic_rounding = true, o.gpu.seed = 5;
  SingleRank ra, rb;
  std::unique_ptr<Engine> a = make_engine(f.config, o, ra.mesh, fixture_weights(f));
  std::unique_ptr<Engine> b = make_engine(f.config, o, rb.mesh, fixture_weights(f));
  for (int64_t s = 0; s < 2; s++) train_step(*a, f, s, 10);
  std::vector<float> p, m, v, pb, mb, vb;
  a->export_shard(p, m, v);
  ASSERT_EQ(static_cast<int64_t>(p.size()), a->layout().total());
  b->import_shard(p, m, v);
  b->set_steps_taken(a->steps_taken());
  const StepResult sa = train_step(*a, f, 2, 10), sb = train_step(*b, f, 2, 10);
  EXPECT_EQ(sa.loss, sb.loss);
  EXPECT_EQ(sa.stats.grad_norm, sb.stats.grad_norm);
  a->export_shard(p, m, v);
  b->export_shard(pb, mb, vb);
  EXPECT_EQ(p, pb);
  EXPECT_EQ(m, mb);
  EXPECT_EQ(v, vb);
}

// An nf4 base is not sharded: QLoRA at ZeRO-3 is refused by name (ZeRO 0-2 keep it whole on every rank).
TEST(EngineLoraGpu, RefusesAQuantizedBaseAtZeroThree) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  LoraConfig lora;
  lora.rank = 4, lora.alpha = 8;
  EngineOptions o = lora_options(f, lora, Device::Cuda);
  o.zero = 3, o.base_quant = BaseQuant::Nf4;
  SingleRank r;
  const std::string e = testing_util::error_of([&] { make_engine(f.config, o, r.mesh, fixture_weights(f)); });
  EXPECT_NE(e.find("--base_quant nf4 with --device cuda and --zero 3: sharding a quantized base over dp is not "
                   "implemented"), std::string::npos) << e;
}

// ZeRO 1-3 over the adapters on one rank: the shard is the whole adapter layout in layout order (and at ZeRO-3 the
// base's shard the whole base, gathered a unit at a time), so every step (two micro-batches with dropout, bf16
// moments, stochastic rounding) computes ZeRO-0's bits, with a bf16 or (ZeRO 1-2) an nf4 base; validation reads the
// same adapters, and a restored engine of the same stage continues bit for bit.
struct LoraStageCase {
  int zero;
  BaseQuant base_quant;
  Recompute recompute;
};

class EngineLoraGpuStages : public testing::TestWithParam<LoraStageCase> {};

TEST_P(EngineLoraGpuStages, OnOneRankEqualZeroZeroBitForBit) {
  TUNA_REQUIRE_GPU();
  const LoraStageCase c = GetParam();
  Fixture f("llama2_tiny");
  LoraConfig lora;
  lora.rank = 4, lora.alpha = 8, lora.dropout = 0.1, lora.targets = parse_lora_targets("q_proj,v_proj,o_proj,down_proj");
  EngineOptions base = lora_options(f, lora, Device::Cuda);
  base.micro_batch = 1, base.bf16_moments = true, base.gpu.stochastic_rounding = true, base.gpu.seed = 7;
  base.base_quant = c.base_quant, base.recompute = c.recompute;
  base.adapters = random_weights(5, 0.1);
  EngineOptions o = base;
  o.zero = c.zero;
  SingleRank r0, r1, r2;
  std::unique_ptr<Engine> ref = make_engine(f.config, base, r0.mesh, fixture_weights(f));
  std::unique_ptr<Engine> e = make_engine(f.config, o, r1.mesh, fixture_weights(f));
  const auto step = [&](Engine& x, int64_t s) { return testing_util::train_step_by_rows(x, f, s, 10); };
  std::unique_ptr<Engine> restored = make_engine(f.config, o, r2.mesh, fixture_weights(f));
  testing_util::expect_steps_and_restore_bit_equal(*ref, *e, *restored, f, step);
}

INSTANTIATE_TEST_SUITE_P(Modes, EngineLoraGpuStages,
                         testing::Values(LoraStageCase{1, BaseQuant::None, Recompute::Full},
                                         LoraStageCase{2, BaseQuant::None, Recompute::None},
                                         LoraStageCase{2, BaseQuant::Nf4, Recompute::Selective},
                                         LoraStageCase{3, BaseQuant::None, Recompute::Full},
                                         LoraStageCase{3, BaseQuant::None, Recompute::None}),
                         [](const testing::TestParamInfo<LoraStageCase>& i) {
                           return "zero" + std::to_string(i.param.zero) + "_" +
                                  (i.param.base_quant == BaseQuant::Nf4 ? "nf4" : "bf16") + "_recompute_" +
                                  recompute_name(i.param.recompute);
                         });

// dp 2 (the adapters' gradients all-reduced at ZeRO-0, reduce-scattered into the shards at ZeRO 1-3; at ZeRO-3 the
// base sharded and gathered) and tp 2 (A and B split as Megatron's layers, with dropout drawn over the whole layer's
// input) as threads sharing the device, against one rank (ZeRO-0) on the whole batch (llama32_tiny: tied
// embeddings). At ZeRO 1-3 a checkpoint exchange of each rank's shard into a fresh engine of the same layout
// continues bit for bit. Dropout only at dp 1: its masks are keyed by the dp rank, so a dp
// layout draws other masks than one rank does (the one-rank stage test above covers dropout at ZeRO 1-2).
struct LoraRanksCase {
  int ranks, tp;
  double dropout;
  bool sp = false;
  int zero = 0;
};

class EngineLoraGpuRanks : public testing::TestWithParam<LoraRanksCase> {};

TEST_P(EngineLoraGpuRanks, FollowOneRank) {
  TUNA_REQUIRE_GPU();
  using testing_util::FourRows;
  const LoraRanksCase c = GetParam();
  Fixture f("llama32_tiny");
  LoraConfig lora;
  lora.rank = 4, lora.alpha = 8, lora.dropout = c.dropout;
  const FourRows data(f.config.vocab_size);
  const auto options = [&](int64_t rows, bool sp) {
    EngineOptions o = testing_util::rows_options(f, 0, rows);
    o.lora = lora, o.seed = 17, o.adapters = random_weights(5, 0.1);
    o.sp = sp;
    return o;
  };
  std::vector<StepResult> want;
  std::vector<float> one_weights;
  {
    SingleRank one;
    std::unique_ptr<Engine> e = make_engine(f.config, options(FourRows::kRows, false), one.mesh, fixture_weights(f));
    for (int64_t s = 0; s < testing_util::kRanksSteps; s++)
      want.push_back(testing_util::rows_step(*e, f, data, 0, FourRows::kRows, s));
    std::vector<float> m, v;
    e->export_shard(one_weights, m, v);
  }
  const double loss_tol = c.tp > 1 ? testing_util::kTpLossTol : testing_util::kRanksLossTol;
  const double norm_tol = c.tp > 1 ? testing_util::kTpNormTol : testing_util::kRanksNormTol;
  const double weight_tol = c.tp > 1 ? testing_util::kTpWeightTol : testing_util::kRanksWeightTol;
  const ParamLayout whole = lora_layout(f.config, lora).params;
  testing_util::run_thread_ranks(c.ranks, [&](Comm& world) {
    Mesh mesh = make_mesh(world, c.tp);
    const DeviceCommFactory device_comm = [](Comm& group, void* stream) {
      return make_staged_device_comm(group.split(0, group.rank()), stream);
    };
    EngineOptions o = options(FourRows::kRows / mesh.dp_size, c.sp);
    o.zero = c.zero;
    std::unique_ptr<Engine> e = make_engine(f.config, o, mesh, fixture_weights(f), device_comm);
    for (int64_t s = 0; s < testing_util::kRanksSteps; s++) {
      const StepResult r = testing_util::rows_step(*e, f, data, mesh.dp_rank * o.micro_batch, o.micro_batch, s);
      if (world.rank() == 0)
        std::printf("  step %lld  loss 1 rank %.7f %d ranks %.7f   grad norm %.6f %.6f\n", static_cast<long long>(s),
                    want[s].loss, c.ranks, r.loss, want[s].stats.grad_norm, r.stats.grad_norm);
      EXPECT_EQ(r.tokens, want[s].tokens);
      EXPECT_NEAR(r.loss, want[s].loss, loss_tol * want[s].loss) << "step " << s;
      EXPECT_NEAR(r.stats.grad_norm, want[s].stats.grad_norm, norm_tol * want[s].stats.grad_norm) << "step " << s;
    }
    EXPECT_LE(testing_util::shard_error_against_whole(*e, whole, one_weights.data()), weight_tol)
        << "rank " << world.rank() << "'s final adapters";
    if (c.zero == 0) return;
    std::unique_ptr<Engine> restored = make_engine(f.config, o, mesh, fixture_weights(f), device_comm);
    testing_util::exchange_state_piecewise(*e, *restored);
    const int64_t s = testing_util::kRanksSteps, first = mesh.dp_rank * o.micro_batch;
    const StepResult a = testing_util::rows_step(*e, f, data, first, o.micro_batch, s);
    const StepResult b = testing_util::rows_step(*restored, f, data, first, o.micro_batch, s);
    EXPECT_EQ(a.loss, b.loss) << "rank " << world.rank();
    EXPECT_EQ(a.stats.grad_norm, b.stats.grad_norm) << "rank " << world.rank();
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, EngineLoraGpuRanks,
                         testing::Values(LoraRanksCase{2, 1, 0.0}, LoraRanksCase{2, 2, 0.1},
                                         LoraRanksCase{2, 2, 0.1, true}, LoraRanksCase{4, 2, 0.0, true},
                                         LoraRanksCase{2, 1, 0.0, false, 1}, LoraRanksCase{2, 1, 0.0, false, 2},
                                         LoraRanksCase{4, 2, 0.0, false, 2}, LoraRanksCase{2, 1, 0.0, false, 3},
                                         LoraRanksCase{4, 2, 0.0, false, 3}),
                         [](const testing::TestParamInfo<LoraRanksCase>& i) {
                           return "ranks" + std::to_string(i.param.ranks) + "_tp" + std::to_string(i.param.tp) +
                                  (i.param.sp ? "_sp" : "") + (i.param.dropout > 0 ? "_dropout" : "") + "_zero" +
                                  std::to_string(i.param.zero);
                         });

// Pipeline stages (pp 2, ranks as threads sharing the device, the stages' transfers over the loopback device comm, 4
// micro-batches of one row in the 1F1B order): each stage holds its frozen base units and its layers' adapters; tied
// embeddings (llama32_tiny) need no exchange, the table being frozen. Dropout masks are keyed by the micro-batch's
// index in the step and set again before its backward, so the stages draw the masks one rank draws over the same
// micro-batches (which runs them in turn) and must follow it within the dp bound of tests/model/ranks_test_util.h (only
// the fp32 order of the gradient norm's sum over the stages differs). With dp 2 inside each stage (no dropout: its
// masks are keyed by the dp rank), ZeRO-1 reduce-scatters each layer's adapter gradient over dp. A checkpoint exchange
// into a fresh engine of the same layout then continues bit for bit. With an nf4 base each stage quantizes its own
// layers' projections, the blocks one rank quantizes, and dequantizes them into a buffer shaped like its first layer's
// unit.
struct LoraPipelineCase {
  int ranks, zero;
  double dropout;
  Recompute recompute = Recompute::None;
  BaseQuant base_quant = BaseQuant::None;  // the same base on the one rank and the stages
};

class EngineLoraGpuPipeline : public testing::TestWithParam<LoraPipelineCase> {};

TEST_P(EngineLoraGpuPipeline, FollowsOneRankOverTheSameMicroBatches) {
  TUNA_REQUIRE_GPU();
  using testing_util::FourRows;
  const LoraPipelineCase c = GetParam();
  Fixture f("llama32_tiny");
  ASSERT_TRUE(f.config.tie_word_embeddings);
  LoraConfig lora;
  lora.rank = 4, lora.alpha = 8, lora.dropout = c.dropout;
  const FourRows data(f.config.vocab_size);
  const auto options = [&](int zero) {
    EngineOptions o = testing_util::rows_options(f, zero, 1);
    o.lora = lora, o.seed = 17, o.adapters = random_weights(5, 0.1);
    o.recompute = c.recompute, o.base_quant = c.base_quant;
    return o;
  };
  // One rank over the 4 rows as 4 micro-batches (micro-batch i: row i, as on every stage at dp 1).
  std::vector<StepResult> want;
  std::vector<float> one_weights;
  {
    SingleRank one;
    std::unique_ptr<Engine> e = make_engine(f.config, options(0), one.mesh, fixture_weights(f));
    for (int64_t s = 0; s < testing_util::kRanksSteps; s++)
      want.push_back(testing_util::row_micro_batches_step(*e, f, data, 0, FourRows::kRows, s));
    std::vector<float> m, v;
    e->export_shard(one_weights, m, v);
  }
  const ParamLayout whole = lora_layout(f.config, lora).params;
  testing_util::run_thread_ranks(c.ranks, [&](Comm& world) {
    Mesh mesh = make_mesh(world, 1, 2);
    const DeviceCommFactory device_comm = testing_util::one_device_comms(mesh);  // pp: loopback
    std::unique_ptr<Engine> e = make_engine(f.config, options(c.zero), mesh, fixture_weights(f), device_comm);
    // The stage's adapters only, under their global names.
    const int64_t layers = f.config.num_hidden_layers;
    EXPECT_LT(e->layout().tensors().size(), whole.tensors().size());
    EXPECT_EQ(e->layout().num_units(), layers);
    const int64_t rows = FourRows::kRows / mesh.dp_size;
    for (int64_t s = 0; s < testing_util::kRanksSteps; s++) {
      const StepResult r = testing_util::row_micro_batches_step(*e, f, data, mesh.dp_rank * rows, rows, s);
      if (world.rank() == 0)
        std::printf("  step %lld  loss 1 rank %.7f pp 2 %.7f   grad norm %.6f %.6f\n", static_cast<long long>(s),
                    want[s].loss, r.loss, want[s].stats.grad_norm, r.stats.grad_norm);
      EXPECT_EQ(r.tokens, want[s].tokens);
      EXPECT_NEAR(r.loss, want[s].loss, testing_util::kRanksLossTol * want[s].loss) << "step " << s;
      EXPECT_NEAR(r.stats.grad_norm, want[s].stats.grad_norm, testing_util::kRanksNormTol * want[s].stats.grad_norm)
          << "step " << s;
    }
    EXPECT_LE(testing_util::shard_error_against_whole(*e, whole, one_weights.data()), testing_util::kRanksWeightTol)
        << "rank " << world.rank() << "'s final adapters";
    // A checkpoint exchange of each stage's state (its pieces, or its ZeRO-1 shard) into a fresh engine of the same
    // layout continues bit for bit, dropout included (the masks follow the restored step count).
    std::unique_ptr<Engine> restored = make_engine(f.config, options(c.zero), mesh, fixture_weights(f), device_comm);
    testing_util::exchange_state_piecewise(*e, *restored);
    const int64_t s = testing_util::kRanksSteps;
    const StepResult a = testing_util::row_micro_batches_step(*e, f, data, mesh.dp_rank * rows, rows, s);
    const StepResult b = testing_util::row_micro_batches_step(*restored, f, data, mesh.dp_rank * rows, rows, s);
    EXPECT_EQ(a.loss, b.loss) << "rank " << world.rank();
    EXPECT_EQ(a.stats.grad_norm, b.stats.grad_norm) << "rank " << world.rank();
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, EngineLoraGpuPipeline,
                         testing::Values(LoraPipelineCase{2, 0, 0.1}, LoraPipelineCase{2, 1, 0.1, Recompute::Full},
                                         LoraPipelineCase{4, 1, 0.0},
                                         LoraPipelineCase{2, 0, 0.1, Recompute::None, BaseQuant::Nf4}),
                         [](const testing::TestParamInfo<LoraPipelineCase>& i) {
                           return "ranks" + std::to_string(i.param.ranks) + "_pp2_zero" +
                                  std::to_string(i.param.zero) + (i.param.dropout > 0 ? "_dropout" : "") +
                                  "_recompute_" + recompute_name(i.param.recompute) +
                                  (i.param.base_quant == BaseQuant::None ? "" : "_nf4");
                         });

}  // namespace
}  // namespace tuna
#endif  // TUNA_CUDA
