// The preference objectives on the CUDA engine (engine/engine_gpu.cpp forward_pairs and pair_logps: model/llama_gpu.h
// forward_logps and backward_weighted under model/preference_step.h's flow) against the CPU engine, on TRL's fixtures'
// pairs (tests/fixtures/preference_*) packed into one window under document masks: DPO (sigmoid, with rpo_alpha, ipo;
// the precomputed reference), DPO with LoRA (the base with the adapters off as the reference), SimPO and ORPO. The
// reference pass, the first step's loss, TRL's metrics and every gradient, 10 AdamW steps and a validation pass follow
// the CPU engine (which tests/model/test_objective.cpp holds to TRL), also with LoRA dropout (the masks keyed as on
// cpu), with recompute, and with an nf4 base (QLoRA). ZeRO-3 on one rank equals ZeRO-0 bit for bit (the weighted
// head's second acquire of a tied lm_head is in the prefetch plan); dp 2 at ZeRO 1-3, tp 2 (with and without sp),
// tp 2 x dp 2, pp 2 and pp 2 x dp 2 follow one rank (over the stages the reference and validation passes too).
// Skipped without a device; on the emulator in CI.
//
// Tolerances: the bf16 forward's, derived in tests/model/test_llama_gpu.cpp: 1e-2 relative on a sum of token
// log-probs (a loss), 0.1 per gradient tensor, and over 10 AdamW steps 5e-2 relative on each step's loss and 0.15 on
// its gradient norm. A reward is beta times a log-prob less the reference's (the same precomputed numbers on both
// engines, or with LoRA each engine's base, whose error the policy's partly cancels), so its error is at most beta
// times the log-prob's: 1e-2 beta |logps|, and a margin's the sum of two. The first step's loss: 1e-2 relative (its
// NLL terms are sums of log-probs) plus the margin's tolerance, since a logistic loss -log sigmoid(z) of the margin z
// moves at most as much as z does (|d/dz| < 1): near saturation (SimPO's small losses) its relative error is the
// margin's absolute one, not 1e-2. The first step's gradients are read as AdamW's first moment, (1 - beta1) g
// (no clipping in the fixtures): the engines expose no gradient, and the moment is the gradient's exact multiple.
#if TUNA_CUDA
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "engine/engine.h"
#include "model/lora.h"
#include "model/objective.h"
#include "model/preference_step.h"  // PairBatch
#include "tests/engine/engine_test_util.h"
#include "tests/kernels/gpu_test_util.h"
#include "tests/model/preference_test_util.h"
#include "tests/engine/preference_ranks_test_util.h"  // fixture_optimizer, preference_options, the ranks check
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::Fixture;
using testing_util::PackedPairs;
using testing_util::PreferenceFixture;
using testing_util::preference_options;

// What a run of one case gives: the reference pass's log-probs, the first step's sums and first moment, each step's
// loss and gradient norm, and a validation pass's sums after the steps.
struct PreferenceRun {
  std::vector<double> start_chosen, start_rejected;
  PreferenceSums first;
  std::vector<float> first_m;
  std::vector<double> losses, norms;
  PreferenceSums validation;
  std::vector<float> weights;  // after the steps, in shard order
};

// A variant of a case: LoRA dropout (the masks keyed by step and micro-batch on both engines), on cuda what the
// backward recomputes, and a quantized frozen base (QLoRA: both engines quantize the same starting weights).
struct Variant {
  double dropout = 0;
  Recompute recompute = Recompute::None;
  BaseQuant base_quant = BaseQuant::None;
};

PreferenceRun run_case(Device device, const PreferenceFixture& fx, const nlohmann::json& c, const PackedPairs& b,
                       int zero, int64_t steps, const Variant& variant = {}) {
  const Fixture f(fx.base);
  const ObjectiveConfig config = testing_util::config_of(c);
  EngineOptions o = preference_options(device, fx, c, b.batch, b.seq, zero);
  o.lora.dropout = variant.dropout;
  o.base_quant = variant.base_quant;
  if (device == Device::Cuda) o.recompute = variant.recompute;
  testing_util::SingleRank rank;
  std::unique_ptr<Engine> e = make_engine(f.config, o, rank.mesh, testing_util::fixture_weights(f));
  const std::vector<double> rc = c.at("ref_chosen_logps"), rr = c.at("ref_rejected_logps");
  PairBatch batch{b.inputs.data(), b.targets.data(), b.positions.data(), b.rows(), b.batch, b.seq};
  if (config.reference == ReferenceSource::Precompute) batch.ref_chosen = rc.data(), batch.ref_rejected = rr.data();
  const PreferenceStep step{b.pairs, count_nll_tokens(config, b.rows(), b.targets.data())};

  PreferenceRun run;
  run.start_chosen.resize(b.pairs), run.start_rejected.resize(b.pairs);
  e->pair_logps(batch, run.start_chosen.data(), run.start_rejected.data());
  for (int64_t s = 0; s < steps; s++) {
    e->begin_step();
    const PreferenceSums sums = e->forward_pairs(batch, config, step, /*want_grad=*/true);
    const StepResult r = e->finish_step(LossSum{sums.loss, sums.pairs}, learning_rate(o.opt, s, steps));
    EXPECT_TRUE(r.stats.applied) << "step " << s;
    run.losses.push_back(r.loss), run.norms.push_back(r.stats.grad_norm);
    if (s == 0) {
      run.first = sums;
      std::vector<float> p, v;
      e->export_shard(p, run.first_m, v);
    }
  }
  run.validation = e->forward_pairs(batch, config, step, /*want_grad=*/false);
  std::vector<float> m, v;
  e->export_shard(run.weights, m, v);
  return run;
}

struct PreferenceGpuCase {
  const char* fixture;
  const char* name;  // the fixture's case
  Variant variant;
};

class EnginePreferenceGpu : public testing::TestWithParam<PreferenceGpuCase> {};

TEST_P(EnginePreferenceGpu, FollowsTheCpuEngine) {
  TUNA_REQUIRE_GPU();
  const PreferenceFixture fx(GetParam().fixture);
  const nlohmann::json& c = fx.cases().at(GetParam().name);
  const ObjectiveConfig config = testing_util::config_of(c);
  const PackedPairs b = testing_util::pack(fx.meta.at("pairs"), /*one_row=*/true);
  const int64_t steps = fx.meta.at("steps");
  const Variant& variant = GetParam().variant;
  const PreferenceRun cpu = run_case(Device::Cpu, fx, c, b, 0, steps, variant),
                      gpu = run_case(Device::Cuda, fx, c, b, 0, steps, variant);

  // The reference pass: each pair's summed completion log-probs under the starting weights (with LoRA the adapters on).
  for (int64_t p = 0; p < b.pairs; p++) {
    EXPECT_NEAR(gpu.start_chosen[p], cpu.start_chosen[p], 1e-2 * std::abs(cpu.start_chosen[p])) << "pair " << p;
    EXPECT_NEAR(gpu.start_rejected[p], cpu.start_rejected[p], 1e-2 * std::abs(cpu.start_rejected[p])) << "pair " << p;
  }

  // The first step: its loss and TRL's metrics.
  EXPECT_EQ(gpu.first.pairs, cpu.first.pairs);
  EXPECT_EQ(gpu.first.nll_tokens, cpu.first.nll_tokens);
  const double P = static_cast<double>(cpu.first.pairs);
  const nlohmann::json mc = metrics_json(cpu.first, config), mg = metrics_json(gpu.first, config);
  ASSERT_EQ(mc.size(), mg.size());
  const double lc = std::abs(mc.at("logps/chosen").get<double>()), lr = std::abs(mc.at("logps/rejected").get<double>());
  const double margin_tolerance = 1e-2 * config.beta * (lc + lr);
  std::printf("  %s/%s first loss cpu %.6f gpu %.6f (margin tolerance %.4f)\n", fx.base.c_str(), GetParam().name,
              cpu.first.loss / P, gpu.first.loss / P, margin_tolerance);
  EXPECT_NEAR(gpu.first.loss / P, cpu.first.loss / P, 1e-2 * std::abs(cpu.first.loss / P) + margin_tolerance);
  const std::map<std::string, double> tolerance = {
      {"logps/chosen", 1e-2 * lc},
      {"logps/rejected", 1e-2 * lr},
      {"rewards/chosen", 1e-2 * config.beta * lc},
      {"rewards/rejected", 1e-2 * config.beta * lr},
      {"rewards/margins", margin_tolerance},
      {"nll_loss", 1e-2 * (mc.contains("nll_loss") ? std::abs(mc.at("nll_loss").get<double>()) : 0.0)},
  };
  for (const auto& [key, want] : mc.items()) {
    if (key == "rewards/accuracies") continue;  // below
    ASSERT_TRUE(tolerance.count(key)) << key;
    EXPECT_NEAR(mg.at(key).get<double>(), want.get<double>(), tolerance.at(key)) << key;
  }
  // A pair's accuracy flips only when its margin is within the margin's error of 0. A full fine-tune's DPO starts at
  // its precomputed reference (margins 0 but for rounding: a coin toss on either engine); elsewhere the fixtures'
  // margins are far from 0.
  if (config.reference != ReferenceSource::Precompute) {
    EXPECT_EQ(mg.at("rewards/accuracies"), mc.at("rewards/accuracies"));
  }

  // Every gradient of the first step, as AdamW's first moment (1 - beta1) g.
  ASSERT_EQ(gpu.first_m.size(), cpu.first_m.size());
  Fixture f(fx.base);
  const fs::path lora_dir = fs::path("tests/fixtures") / ("lora_" + fx.base);
  const ParamLayout layout =
      c.at("lora") ? lora_layout(f.config, read_peft_adapter_config(lora_dir)).params : ParamLayout(f.config);
  for (const ParamTensor& t : layout.tensors()) {
    std::vector<double> want(cpu.first_m.begin() + t.offset, cpu.first_m.begin() + t.offset + t.numel);
    const double err = testing_util::rel_err_norm(gpu.first_m.data() + t.offset, want.data(), t.numel);
    EXPECT_LE(err, 0.1) << t.name;
  }

  // 10 AdamW steps, then a validation pass on the trained weights.
  for (int64_t s = 0; s < steps; s++) {
    std::printf("  step %2lld  loss cpu %.5f gpu %.5f   grad norm cpu %.4f gpu %.4f\n", static_cast<long long>(s),
                cpu.losses[s], gpu.losses[s], cpu.norms[s], gpu.norms[s]);
    EXPECT_NEAR(gpu.losses[s], cpu.losses[s], 5e-2 * std::abs(cpu.losses[s])) << "step " << s;
    EXPECT_NEAR(gpu.norms[s], cpu.norms[s], 0.15 * cpu.norms[s]) << "step " << s;
  }
  EXPECT_NEAR(gpu.validation.loss / P, cpu.validation.loss / P, 5e-2 * std::abs(cpu.validation.loss / P));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, EnginePreferenceGpu,
    testing::Values(PreferenceGpuCase{"llama2_tiny", "dpo_sigmoid", {}},
                    PreferenceGpuCase{"llama32_tiny", "dpo_sigmoid", {}},
                    PreferenceGpuCase{"llama32_tiny", "dpo_sigmoid_rpo", {}},
                    PreferenceGpuCase{"llama2_tiny", "dpo_ipo", {}},
                    PreferenceGpuCase{"llama2_tiny", "lora_dpo_sigmoid", {}},
                    PreferenceGpuCase{"llama32_tiny", "lora_dpo_sigmoid", {}},
                    PreferenceGpuCase{"llama2_tiny", "simpo", {}},
                    PreferenceGpuCase{"llama32_tiny", "simpo", {}},
                    PreferenceGpuCase{"llama32_tiny", "orpo", {}},
                    PreferenceGpuCase{"llama32_tiny", "lora_dpo_sigmoid", {0.1, Recompute::Full, BaseQuant::None}},
                    PreferenceGpuCase{"llama2_tiny", "lora_dpo_sigmoid", {0, Recompute::None, BaseQuant::Nf4}},
                    PreferenceGpuCase{"llama2_tiny", "dpo_sigmoid_rpo", {0, Recompute::Selective, BaseQuant::None}}),
    [](const testing::TestParamInfo<PreferenceGpuCase>& i) {
      const Variant& v = i.param.variant;
      return std::string(i.param.fixture) + "_" + i.param.name + (v.dropout > 0 ? "_dropout" : "") +
             (v.recompute != Recompute::None ? std::string("_recompute_") + recompute_name(v.recompute) : "") +
             (v.base_quant != BaseQuant::None ? std::string("_") + base_quant_name(v.base_quant) : "");
    });

// ZeRO-3 on one rank computes what ZeRO-0 does, bit for bit: the sharded store's gathers and gradient buffers carry the
// weighted backward's passes (a tied lm_head acquired again by the weighted head), for a full fine-tune and for LoRA
// (the frozen base sharded, the reference pass over it with the adapters off).
TEST(EnginePreferenceGpuZero, ZeroThreeEqualsZeroZeroOnOneRank) {
  TUNA_REQUIRE_GPU();
  const PreferenceFixture fx("llama32_tiny");  // tied embeddings
  const PackedPairs b = testing_util::pack(fx.meta.at("pairs"), /*one_row=*/true);
  for (const char* name : {"dpo_sigmoid_rpo", "lora_dpo_sigmoid"}) {
    SCOPED_TRACE(name);
    const nlohmann::json& c = fx.cases().at(name);
    const PreferenceRun a = run_case(Device::Cuda, fx, c, b, 0, 3), z = run_case(Device::Cuda, fx, c, b, 3, 3);
    EXPECT_EQ(a.losses, z.losses);
    EXPECT_EQ(a.norms, z.norms);
    EXPECT_EQ(a.weights, z.weights);
    EXPECT_EQ(a.validation.loss, z.validation.loss);
  }
}

// Several ranks as threads sharing the device (tests/engine/preference_ranks_test_util.h says what is held and why).
using testing_util::PreferenceRanksCase;
class EnginePreferenceGpuRanks : public testing::TestWithParam<PreferenceRanksCase> {};

TEST_P(EnginePreferenceGpuRanks, FollowOneRank) {
  TUNA_REQUIRE_GPU();
  const testing_util::PairsOneRankRun one(GetParam().name);
  testing_util::run_thread_ranks(GetParam().ranks,
                                 [&](Comm& world) { testing_util::follow_one_rank_on_pairs(world, GetParam(), one); });
}

INSTANTIATE_TEST_SUITE_P(Layouts, EnginePreferenceGpuRanks,
                         testing::Values(PreferenceRanksCase{"dpo_sigmoid_rpo", 2, 1, 1, false},
                                         PreferenceRanksCase{"simpo", 2, 1, 2, false},
                                         PreferenceRanksCase{"orpo", 2, 1, 3, false},
                                         PreferenceRanksCase{"lora_dpo_sigmoid", 2, 1, 3, false},
                                         PreferenceRanksCase{"dpo_sigmoid_rpo", 2, 2, 0, false},
                                         PreferenceRanksCase{"simpo", 2, 2, 0, true},
                                         PreferenceRanksCase{"dpo_ipo", 2, 2, 0, true},
                                         PreferenceRanksCase{"lora_dpo_sigmoid", 2, 2, 0, true},
                                         PreferenceRanksCase{"orpo", 4, 2, 1, true},
                                         PreferenceRanksCase{"dpo_sigmoid", 4, 2, 3, false},
                                         PreferenceRanksCase{"dpo_sigmoid_rpo", 2, 1, 0, false, 2},
                                         PreferenceRanksCase{"lora_dpo_sigmoid", 2, 1, 1, false, 2},
                                         PreferenceRanksCase{"dpo_sigmoid", 4, 1, 1, false, 2},
                                         PreferenceRanksCase{"lora_dpo_sigmoid", 4, 1, 0, false, 2},
                                         PreferenceRanksCase{"simpo", 2, 1, 1, false, 2},
                                         PreferenceRanksCase{"orpo", 4, 1, 0, false, 2}),
                         [](const testing::TestParamInfo<PreferenceRanksCase>& i) {
                           return testing_util::name(i.param);
                         });

}  // namespace
}  // namespace tuna

#endif  // TUNA_CUDA
