// The preference objectives on several ranks of the CUDA engine against one rank: the check that runs on threads
// sharing one device (tests/engine/test_engine_preference_gpu.cpp, on a GPU in gpu-check and on the emulator in CI)
// and under mpirun on the emulator (tests/mpi/test_engine_gpu_emulated.cpp), on llama32_tiny's TRL fixture
// (tests/fixtures/preference_llama32_tiny: tied embeddings, 2 kv heads for tp 2).
//
// The fixture's pairs are two windows (two_windows); one rank takes both as the step's two micro-batches (the second's
// gradient writes adding to the first's): dp 2 at ZeRO 1-3 (each dp rank one window), tp 2 with and without sp (every
// tp rank both windows, the vocab-parallel log-probs and weighted backward), tp 2 x dp 2, and pipeline stages. Each
// step's loss and gradient norm and the final weights within the bounds argued in tests/model/ranks_test_util.h (dp:
// the same per-token arithmetic, the gradients summed in another order; tp: one more bf16 rounding of the row-parallel
// partial sums). Under tp those bounds hold the first step (the arithmetic alone) and the final weights; the later
// steps' loss and gradient norm are held to the bf16 trajectory tolerance (5e-2, 0.15): each update turns last-bit
// gradient differences into weight differences of the order of lr (Adam's update is near sign(m)), and a preference
// loss is a function of margins between sums over whole completions, which magnify them (measured on the emulator at
// tp 2 with sp, IPO and LoRA DPO: 3e-4 relative at step 0, 5.5e-3 at step 2), while the weights stay within the tp
// bound. The step's normalizers are the whole step's on every rank (engine/preference.h sums them over dp), and
// finish_step sums the loss over the dp ranks.
//
// Pipeline stages (pp 2; with dp 2 each dp rank one window): the stages pass the bf16 activations the one rank keeps,
// the last stage computes the log-probs, the loss and its weights as the one rank does (dist/pipeline_pairs.h), and the
// reference (precomputed, or LoRA's base with the adapters off) runs down the stages: only the fp32 order of the
// gradient sums differs (the tied table's two gradients added after the backwards), so they are held to the dp bounds
// at every step. Before the first step the reference pass (the precompute pass's log-probs) and a validation pass of
// the first window run down the stages too, every stage getting the last stage's sums, held to the same bounds.
#pragma once

#if TUNA_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "engine/engine.h"
#include "model/lora.h"
#include "model/objective.h"
#include "model/preference_step.h"  // PairBatch
#include "tests/engine/engine_test_util.h"
#include "tests/model/preference_test_util.h"
#include "tests/model/ranks_test_util.h"  // one_device_comms, the dp and tp bounds

namespace tuna::testing_util {

inline OptimizerConfig fixture_optimizer(const nlohmann::json& m) {
  OptimizerConfig oc;
  oc.lr = m.at("lr"), oc.min_lr = m.at("min_lr"), oc.warmup_steps = m.at("warmup_steps");
  oc.schedule = "cosine", oc.beta1 = m.at("beta1"), oc.beta2 = m.at("beta2"), oc.eps = m.at("eps");
  oc.weight_decay = m.at("weight_decay"), oc.grad_clip = m.at("grad_clip");
  return oc;
}

// The engine options of a case: the fixture's optimizer, and with LoRA the fixture's adapters.
inline EngineOptions preference_options(Device device, const PreferenceFixture& fx, const nlohmann::json& c,
                                        int64_t batch, int64_t seq, int zero) {
  EngineOptions o;
  o.device = device;
  o.micro_batch = batch, o.seq_len = seq, o.zero = zero;
  o.opt = fixture_optimizer(fx.meta);
  if (c.at("lora")) {
    const std::filesystem::path dir = std::filesystem::path("tests/fixtures") / ("lora_" + fx.base);
    o.lora = read_peft_adapter_config(dir);
    o.adapters = adapters_from(dir / "adapter_model.safetensors");
    o.seed = 17;
  }
  return o;
}

// The fixture's pairs as two windows of one row each, pairs 0 and 1 packed in one and pair 2 in the other, each with
// its pairs' precomputed reference log-probs.
struct Window {
  PackedPairs b;
  std::vector<double> ref_chosen, ref_rejected;
  PairBatch batch(const ObjectiveConfig& config) const {
    PairBatch out{b.inputs.data(), b.targets.data(), b.positions.data(), b.rows(), b.batch, b.seq};
    if (config.reference == ReferenceSource::Precompute)
      out.ref_chosen = ref_chosen.data(), out.ref_rejected = ref_rejected.data();
    return out;
  }
};
inline std::vector<Window> two_windows(const PreferenceFixture& fx, const nlohmann::json& c) {
  const nlohmann::json& pairs = fx.meta.at("pairs");
  const std::vector<double> rc = c.at("ref_chosen_logps"), rr = c.at("ref_rejected_logps");
  std::vector<Window> windows(2);
  for (size_t p = 0; p < pairs.size(); p++) {
    Window& w = windows[p < 2 ? 0 : 1];
    w.ref_chosen.push_back(rc[p]), w.ref_rejected.push_back(rr[p]);
  }
  using Pairs = std::vector<nlohmann::json>;
  windows[0].b = pack(nlohmann::json(Pairs(pairs.begin(), pairs.begin() + 2)), /*one_row=*/true);
  windows[1].b = pack(nlohmann::json(Pairs(pairs.begin() + 2, pairs.end())), /*one_row=*/true);
  // Both padded to one length that sequence parallelism splits over 2 tp ranks (a multiple of 4).
  const int64_t seq = (std::max(windows[0].b.seq, windows[1].b.seq) + 3) / 4 * 4;
  for (Window& w : windows) {
    PackedPairs& b = w.b;
    b.seq = seq;
    b.inputs.resize(seq, 0), b.targets.resize(seq, cpu::kIgnoreIndex), b.positions.resize(seq, 0);
    b.sequence.resize(seq, -1), b.completion.resize(seq, 0);
  }
  return windows;
}

struct PreferenceRanksCase {
  const char* name;  // the fixture's case
  int ranks, tp, zero;
  bool sp;
  int pp = 1;
};

inline std::string name(const PreferenceRanksCase& c) {
  return std::string(c.name) + "_dp" + std::to_string(c.ranks / c.tp / c.pp) + "_tp" + std::to_string(c.tp) +
         (c.pp > 1 ? "_pp" + std::to_string(c.pp) : "") + "_zero" + std::to_string(c.zero) + (c.sp ? "_sp" : "");
}

// A case's data, its step, and the passes the ranks compare: the first window's reference log-probs and validation.
struct PairsCase {
  PreferenceFixture fx{"llama32_tiny"};
  Fixture f{fx.base};
  const nlohmann::json& c;
  ObjectiveConfig config;
  std::vector<Window> windows;
  PreferenceStep step{0, 0};
  OptimizerConfig oc;
  explicit PairsCase(const std::string& name)
      : c(fx.cases().at(name)), config(config_of(c)), windows(two_windows(fx, c)), oc(fixture_optimizer(fx.meta)) {
    for (const Window& w : windows)
      step.pairs += w.b.pairs, step.nll_tokens += count_nll_tokens(config, w.b.rows(), w.b.targets.data());
  }
  int64_t seq() const { return windows[0].b.seq; }
  // A step over some of the windows, each a micro-batch, through Engine::forward_pairs_step (a pipeline runs them in
  // the 1F1B order); what it counts (the last stage's loss sum and pairs) to finish_step, which sums it over the
  // stages and dp.
  StepResult step_over(Engine& e, size_t first, size_t end, int64_t s) const {
    e.begin_step();
    std::vector<PairBatch> micro_batches;
    for (size_t w = first; w < end; w++) micro_batches.push_back(windows[w].batch(config));
    const Engine::PairStepSums sums = e.forward_pairs_step(micro_batches, config, step);
    return e.finish_step(sums.counted, learning_rate(oc, s, kRanksSteps));
  }
  struct Passes {
    std::vector<double> chosen, rejected;
    PreferenceSums validation;
  };
  Passes passes_over(Engine& e) const {
    const PairBatch b = windows[0].batch(config);
    Passes p;
    p.chosen.resize(b.rows.pairs), p.rejected.resize(b.rows.pairs);
    e.pair_logps(b, p.chosen.data(), p.rejected.data());
    p.validation = e.forward_pairs(b, config, step, /*want_grad=*/false);
    return p;
  }
  ParamLayout whole_layout() const {
    if (!c.at("lora")) return ParamLayout(f.config);
    return lora_layout(f.config,
                       read_peft_adapter_config(std::filesystem::path("tests/fixtures") / ("lora_" + fx.base)))
        .params;
  }
};

// One rank, ZeRO-0, both windows a step: the passes before the first step, each step's result, the final master
// weights (ParamLayout order).
struct PairsOneRankRun {
  PairsCase pc;
  PairsCase::Passes passes;
  std::vector<StepResult> steps;
  std::vector<float> weights;
  explicit PairsOneRankRun(const std::string& name) : pc(name) {
    SingleRank one;
    std::unique_ptr<Engine> e = make_engine(pc.f.config, preference_options(Device::Cuda, pc.fx, pc.c, 1, pc.seq(), 0),
                                            one.mesh, fixture_weights(pc.f));
    passes = pc.passes_over(*e);
    for (int64_t s = 0; s < kRanksSteps; s++) steps.push_back(pc.step_over(*e, 0, pc.windows.size(), s));
    std::vector<float> m, v;
    e->export_shard(weights, m, v);
  }
};

// This rank of `world` (one of rc.ranks) trains the case with its layout and checks it against the one rank's run, over
// the device comms of tests/model/ranks_test_util.h.
inline void follow_one_rank_on_pairs(Comm& world, const PreferenceRanksCase& rc, const PairsOneRankRun& one) {
  const PairsCase& pc = one.pc;
  const double loss_tol = rc.tp > 1 ? std::max(tp_bound(kTpLossTol, rc.tp), kRanksLossTol) : kRanksLossTol;
  const double norm_tol = rc.tp > 1 ? std::max(tp_bound(kTpNormTol, rc.tp), kRanksNormTol) : kRanksNormTol;
  const double weight_tol = rc.tp > 1 ? std::max(tp_bound(kTpWeightTol, rc.tp), kRanksWeightTol) : kRanksWeightTol;
  Mesh mesh = make_mesh(world, rc.tp, rc.pp);
  EngineOptions o = preference_options(Device::Cuda, pc.fx, pc.c, 1, pc.seq(), rc.zero);
  o.sp = rc.sp;
  std::unique_ptr<Engine> e = make_engine(pc.f.config, o, mesh, fixture_weights(pc.f), one_device_comms(mesh));
  // dp 2: each dp rank its window; dp 1: both (every stage).
  const size_t first = mesh.dp_size == 1 ? 0 : mesh.dp_rank, end = mesh.dp_size == 1 ? pc.windows.size() : first + 1;
  if (rc.pp > 1) {  // every stage gets the last stage's sums
    const PairsCase::Passes got = pc.passes_over(*e);
    const PairsCase::Passes& want = one.passes;
    for (size_t p = 0; p < want.chosen.size(); p++) {
      EXPECT_NEAR(got.chosen[p], want.chosen[p], loss_tol * std::abs(want.chosen[p])) << "pair " << p;
      EXPECT_NEAR(got.rejected[p], want.rejected[p], loss_tol * std::abs(want.rejected[p])) << "pair " << p;
    }
    EXPECT_EQ(got.validation.pairs, want.validation.pairs);
    EXPECT_NEAR(got.validation.loss, want.validation.loss, loss_tol * std::abs(want.validation.loss));
    EXPECT_NEAR(got.validation.logps_chosen, want.validation.logps_chosen,
                loss_tol * std::abs(want.validation.logps_chosen));
  }
  for (int64_t s = 0; s < kRanksSteps; s++) {
    const StepResult r = pc.step_over(*e, first, end, s);
    const StepResult& want = one.steps[s];
    if (world.rank() == 0)
      std::printf("  step %lld  loss 1 rank %.7f %d ranks %.7f   grad norm %.6f %.6f\n", static_cast<long long>(s),
                  want.loss, rc.ranks, r.loss, want.stats.grad_norm, r.stats.grad_norm);
    // tp after an update: the bf16 trajectory tolerance of test_engine_gpu.cpp (the top of this file).
    const bool drifted = rc.tp > 1 && s > 0;
    EXPECT_NEAR(r.loss, want.loss, (drifted ? 5e-2 : loss_tol) * std::abs(want.loss)) << "step " << s;
    EXPECT_NEAR(r.stats.grad_norm, want.stats.grad_norm, (drifted ? 0.15 : norm_tol) * want.stats.grad_norm)
        << "step " << s;
  }
  EXPECT_LE(shard_error_against_whole(*e, pc.whole_layout(), one.weights.data()), weight_tol)
      << "rank " << world.rank() << "'s final master weights";
}

}  // namespace tuna::testing_util

#endif  // TUNA_CUDA
