// engine/engine.h on the CPU backend: the engine the trainer drives follows the transformers fixtures over 10
// AdamW steps, and a checkpoint exchange (export_shard -> import_shard) continues bit for bit at every ZeRO
// stage, a piece at a time without a host copy of the shard; the device choice says why it cannot give cuda.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "comm/comm.h"
#include "ckpt/checkpoint.h"
#include "engine/engine.h"
#include "ckpt/safetensors.h"
#include "dist/zero.h"
#include "tests/engine/engine_test_util.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::engine_options;
using testing_util::Fixture;
using testing_util::fixture_weights;
using testing_util::SingleRank;
using testing_util::train_step;

class EngineParity : public testing::TestWithParam<std::string> {};

TEST_P(EngineParity, TenStepsFollowTransformers) {
  Fixture f(GetParam());
  SingleRank r;
  std::unique_ptr<Engine> engine = make_engine(f.config, engine_options(f, Device::Cpu), r.mesh, fixture_weights(f));
  const int64_t steps = f.meta.at("steps");
  SafetensorsFile ref(f.dir / "reference.safetensors");
  std::vector<double> ref_losses(steps), ref_norms(steps);
  ref.read_f64("train_losses", {steps}, ref_losses.data());
  ref.read_f64("grad_norms", {steps}, ref_norms.data());
  for (int64_t s = 0; s < steps; s++) {
    engine->begin_step();
    const LossSum local = engine->forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
    const StepResult result = engine->finish_step(local, learning_rate(f.optimizer(), s, steps));
    EXPECT_EQ(result.tokens, local.count);
    EXPECT_NEAR(result.loss, ref_losses[s], 1e-4 * ref_losses[s]) << "step " << s;
    EXPECT_NEAR(result.stats.grad_norm, ref_norms[s], 1e-4 * ref_norms[s]) << "step " << s;
  }
  EXPECT_EQ(engine->steps_taken(), steps);
  EXPECT_TRUE(std::isnan(engine->peak_flops()));  // no MFU on the CPU
  EXPECT_GT(engine->flops_per_token(f.seq), 6.0 * f.config.n_params() - 6.0 * f.config.vocab_size * f.config.hidden_size);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EngineParity, testing::Values("llama2_tiny", "llama32_tiny"));

class EngineResume : public testing::TestWithParam<int> {};

TEST_P(EngineResume, ExportImportContinuesBitForBit) {
  Fixture f("llama32_tiny");
  const int zero = GetParam();
  auto step = [&](Engine& e, int64_t s) { return train_step(e, f, s, 10); };
  SingleRank ra, rb;
  std::unique_ptr<Engine> a = make_engine(f.config, engine_options(f, Device::Cpu, zero), ra.mesh, fixture_weights(f));
  for (int64_t s = 0; s < 3; s++) step(*a, s);
  std::vector<float> p, m, v;
  a->export_shard(p, m, v);
  ASSERT_EQ(static_cast<int64_t>(p.size()), a->layout().total());  // one rank: the whole model, in layout order

  std::unique_ptr<Engine> b = make_engine(f.config, engine_options(f, Device::Cpu, zero), rb.mesh, nullptr);
  b->import_shard(p, m, v);
  b->set_steps_taken(a->steps_taken());
  const StepResult sa = step(*a, 3), sb = step(*b, 3);
  EXPECT_EQ(sa.loss, sb.loss);
  EXPECT_EQ(sa.stats.grad_norm, sb.stats.grad_norm);
  std::vector<float> p2, m2, v2, p3, m3, v3;
  a->export_shard(p2, m2, v2);
  b->export_shard(p3, m3, v3);
  EXPECT_EQ(p2, p3);
  EXPECT_EQ(m2, m3);
  EXPECT_EQ(v2, v3);
  EXPECT_NE(p2, p);  // the step moved the weights
}

// The CPU engine hands out its own state and takes it in place, a piece at a time: the host heap does not grow by
// a copy of the shard (one fp32 array of it is 3 MB here, a piece at most a quarter of that).
TEST_P(EngineResume, StateMovesAPieceAtATimeWithoutAHostCopy) {
  Fixture f("llama2_tiny");
  const LlamaConfig config = testing_util::many_layers(f);
  SingleRank ra, rb;
  std::unique_ptr<Engine> a = make_engine(config, engine_options(f, Device::Cpu, GetParam()), ra.mesh, random_weights(3, 0.02));
  train_step(*a, f, 0, 10);  // moments away from zero
  std::unique_ptr<Engine> b = make_engine(config, engine_options(f, Device::Cpu, GetParam()), rb.mesh, nullptr);
  const testing_util::StateExchange x = testing_util::exchange_state_piecewise(*a, *b);
  const int64_t shard_bytes = x.shard_elements * int64_t(sizeof(float));
  std::printf("  ZeRO-%d: shard %.2f MB per array, largest piece %.2f MB; heap growth export %.3f MB, import %.3f MB\n",
              GetParam(), shard_bytes / 1e6, x.largest_piece * 4 / 1e6, x.export_heap_growth / 1e6,
              x.import_heap_growth / 1e6);
  ASSERT_GT(shard_bytes, 4 * x.largest_piece * int64_t(sizeof(float)));
  EXPECT_LT(x.export_heap_growth, x.largest_piece * int64_t(sizeof(float)));
  EXPECT_LT(x.import_heap_growth, x.largest_piece * int64_t(sizeof(float)));
  EXPECT_EQ(train_step(*a, f, 1, 10).loss, train_step(*b, f, 1, 10).loss);
}

INSTANTIATE_TEST_SUITE_P(ZeroStages, EngineResume, testing::Values(0, 1, 2, 3));

// A step whose loss or gradient is not finite updates nothing at any ZeRO stage, and the next finite step
// continues as if it had not happened (the same step on an engine that never saw the bad one).
class EngineNonFinite : public testing::TestWithParam<int> {};

TEST_P(EngineNonFinite, StepIsSkippedAndTheNextOneTrains) {
  testing_util::expect_non_finite_steps_skipped(Fixture("llama32_tiny"), Device::Cpu, GetParam());
}

INSTANTIATE_TEST_SUITE_P(ZeroStages, EngineNonFinite, testing::Values(0, 1, 2, 3));

// The gradient's half of the decision, where the gradient can be reached: AdamW over the whole layout and ZeRO-0/1.
TEST(Engine, NonFiniteGradientSkipsTheUpdate) {
  Fixture f("llama32_tiny");
  for (int stage : {0, 1}) {
    std::unique_ptr<Comm> dp = make_single_comm();
    Llama model(f.config, f.batch, f.seq);
    load_weights(f.dir, model.layout(), model.params.data());
    Zero zero(model, f.optimizer(), stage, *dp, nullptr);
    zero.begin_step();
    const LossSum local = model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
    model.grads[77] = INFINITY;
    const std::vector<float> before = model.params;
    const StepResult r = zero.finish_step(local, 1e-3);
    EXPECT_FALSE(r.stats.applied) << "stage " << stage;
    EXPECT_TRUE(std::isfinite(r.loss));
    EXPECT_EQ(model.params, before);
    EXPECT_EQ(zero.optimizer().steps_taken, 0);
  }
  Llama model(f.config, f.batch, f.seq);
  AdamW adamw(model.layout(), f.optimizer());
  model.grads.assign(model.grads.size(), 0.0f);
  model.grads[3] = NAN;
  const std::vector<float> before = model.params;
  EXPECT_FALSE(adamw.step(model.params.data(), model.grads.data(), 1.0, 1e-3).applied);
  EXPECT_EQ(model.params, before);
  EXPECT_EQ(adamw.steps_taken, 0);
}

// The attention kernels of a run: the option as given on a fresh run; with auto, a resume keeps the kernels its
// checkpoint's run recorded; an explicit other choice wins and says the bits will differ; the environment variable
// of earlier versions is refused, not silently ignored or obeyed.
TEST(Engine, AttentionChoice) {
  testing_util::ScopedEnv env;
  env.unset("TUNA_ATTENTION");
  std::string note;
  EXPECT_EQ(choose_attention("auto", nlohmann::json(), &note), AttentionPath::kDefault);
  EXPECT_EQ(choose_attention("hopper", nlohmann::json(), &note), AttentionPath::kHopper);
  EXPECT_EQ(choose_attention("mma", nlohmann::json{{"step", 5}}, &note), AttentionPath::kMma);
  EXPECT_TRUE(note.empty()) << note;
  const nlohmann::json hopper_run = {{"step", 5}, {"kernels", {{"attention", "hopper"}}}};
  EXPECT_EQ(choose_attention("auto", hopper_run, &note), AttentionPath::kHopper);
  EXPECT_NE(note.find("attention kernels: hopper, as the checkpoint's run"), std::string::npos) << note;
  note.clear();
  EXPECT_EQ(choose_attention("hopper", hopper_run, &note), AttentionPath::kHopper);
  EXPECT_TRUE(note.empty()) << note;
  EXPECT_EQ(choose_attention("mma", hopper_run, &note), AttentionPath::kMma);
  EXPECT_NE(note.find("the checkpoint's run used the hopper attention kernels; this run uses mma"), std::string::npos)
      << note;
  EXPECT_THROW(choose_attention("flash", nlohmann::json(), &note), Error);
  EXPECT_THROW(choose_attention("auto", nlohmann::json{{"kernels", {{"attention", "cudnn"}}}}, &note), Error);
  env.set("TUNA_ATTENTION", "hopper");
  try {
    choose_attention("auto", nlohmann::json(), &note);
    ADD_FAILURE() << "TUNA_ATTENTION obeyed or ignored";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not read: choose the attention kernels with --attention mma|hopper"),
              std::string::npos) << e.what();
  }
}

TEST(Engine, DeviceChoiceExplainsItself) {
  EXPECT_EQ(resolve_device("cpu"), Device::Cpu);
  try {
    resolve_device("gpu");
    ADD_FAILURE() << "'gpu' accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected auto, cpu or cuda, found 'gpu'"), std::string::npos) << e.what();
  }
  const Device automatic = resolve_device("auto");
  if (automatic == Device::Cuda) GTEST_SKIP() << "a CUDA device is visible: --device cuda is available here";
  EXPECT_EQ(automatic, Device::Cpu);
  try {
    resolve_device("cuda");
    ADD_FAILURE() << "cuda accepted without a device";
  } catch (const Error& e) {
    const std::string msg = e.what();
#if TUNA_CUDA
    EXPECT_NE(msg.find("no CUDA device is visible"), std::string::npos) << msg;
#else
    EXPECT_NE(msg.find("this build of tuna has no CUDA"), std::string::npos) << msg;
#endif
    EXPECT_NE(msg.find("--device cpu"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace tuna
