// engine/engine.h on the CUDA backend (engine/engine_gpu.cpp), single rank: the engine the trainer drives with
// --device cuda follows the CPU engine over 10 AdamW steps, a checkpoint exchange (export_shard ->
// import_shard into a fresh engine) continues bit for bit with fp32 moments, bf16 moments and stochastic
// rounding, the exchange goes a piece at a time through one host buffer, and the status the log prints is the
// device's. Skipped without a device.
//
// Tolerances: those of tests/model/test_llama_gpu.cpp (TenAdamWStepsFollowTheCpuRun), where they are derived:
// 5e-2 relative on each step's loss and 0.15 on its gradient norm for a bf16 trajectory against fp32.
#if TUNA_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "engine/engine.h"
#include "tests/comm/jittered_comm.h"
#include "tests/kernels/gpu_test_util.h"
#include "tests/data/data_test_util.h"  // TempDir
#include "tests/engine/engine_test_util.h"
#include "tests/model/ranks_test_util.h"

namespace tuna {
namespace {

using testing_util::engine_options;
using testing_util::Fixture;
using testing_util::fixture_weights;
using testing_util::SingleRank;
using testing_util::train_step;
using testing_util::FourRows;

class EngineGpuParity : public testing::TestWithParam<std::string> {};

TEST_P(EngineGpuParity, TenStepsFollowTheCpuEngine) {
  TUNA_REQUIRE_GPU();
  Fixture f(GetParam());
  SingleRank rc, rg;
  std::unique_ptr<Engine> cpu = make_engine(f.config, engine_options(f, Device::Cpu), rc.mesh, fixture_weights(f));
  std::unique_ptr<Engine> gpu = make_engine(f.config, engine_options(f, Device::Cuda), rg.mesh, fixture_weights(f));
  std::printf("  %s\n", gpu->describe().c_str());
  const int64_t steps = f.meta.at("steps");
  for (int64_t s = 0; s < steps; s++) {
    const StepResult a = train_step(*cpu, f, s, steps), b = train_step(*gpu, f, s, steps);
    std::printf("  step %2lld  loss cpu %.5f gpu %.5f   grad norm cpu %.4f gpu %.4f\n", static_cast<long long>(s), a.loss,
                b.loss, a.stats.grad_norm, b.stats.grad_norm);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_NEAR(b.loss, a.loss, 5e-2 * std::abs(a.loss)) << "step " << s;
    EXPECT_NEAR(b.stats.grad_norm, a.stats.grad_norm, 0.15 * a.stats.grad_norm) << "step " << s;
  }
  EXPECT_EQ(gpu->steps_taken(), steps);
  // Validation on the device agrees with the CPU engine's on the trained weights.
  const LossSum vc = cpu->forward_loss(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  const LossSum vg = gpu->forward_loss(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  EXPECT_EQ(vc.count, vg.count);
  EXPECT_NEAR(vg.sum / vg.count, vc.sum / vc.count, 5e-2 * vc.sum / vc.count);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EngineGpuParity, testing::Values("llama2_tiny", "llama32_tiny"));

struct Rounding {
  bool bf16_moments, stochastic_rounding;
};

class EngineGpuResume : public testing::TestWithParam<Rounding> {};

TEST_P(EngineGpuResume, ExportImportContinuesBitForBit) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama32_tiny");
  EngineOptions o = engine_options(f, Device::Cuda);
  o.bf16_moments = GetParam().bf16_moments;
  o.gpu.stochastic_rounding = GetParam().stochastic_rounding;
  o.gpu.seed = 5;
  SingleRank ra, rb;
  std::unique_ptr<Engine> a = make_engine(f.config, o, ra.mesh, fixture_weights(f));
  for (int64_t s = 0; s < 3; s++) train_step(*a, f, s, 10);
  std::vector<float> p, m, v;
  a->export_shard(p, m, v);
  ASSERT_EQ(static_cast<int64_t>(p.size()), a->layout().total());
  // Moments moved away from zero: the export read real state.
  double m_norm = 0;
  for (float x : m) m_norm += double(x) * x;
  EXPECT_GT(m_norm, 0.0);

  std::unique_ptr<Engine> b = make_engine(f.config, o, rb.mesh, nullptr);
  b->import_shard(p, m, v);
  b->set_steps_taken(a->steps_taken());
  std::vector<float> pb, mb, vb;
  b->export_shard(pb, mb, vb);
  EXPECT_EQ(p, pb);
  EXPECT_EQ(m, mb);
  EXPECT_EQ(v, vb);
  const StepResult sa = train_step(*a, f, 3, 10), sb = train_step(*b, f, 3, 10);
  EXPECT_EQ(sa.loss, sb.loss);
  EXPECT_EQ(sa.stats.grad_norm, sb.stats.grad_norm);
  a->export_shard(p, m, v);
  b->export_shard(pb, mb, vb);
  EXPECT_EQ(p, pb);
  EXPECT_EQ(m, mb);
  EXPECT_EQ(v, vb);
}

// Stochastic rounding: the restored bf16 weights must carry the random bits of the last update
// (LlamaGpu::refresh_params), or the next step's loss differs.
INSTANTIATE_TEST_SUITE_P(Moments, EngineGpuResume,
                         testing::Values(Rounding{false, false}, Rounding{true, false}, Rounding{true, true}),
                         [](const testing::TestParamInfo<Rounding>& i) {
                           return std::string(i.param.bf16_moments ? "bf16" : "fp32") +
                                  (i.param.stochastic_rounding ? "_stochastic" : "");
                         });

// A checkpoint exchange goes through one host buffer of the largest piece (weights, both moments and a moment's
// bf16 bits: 14 bytes an element), never a copy of the shard, at every ZeRO stage and with bf16 moments.
struct StateCase {
  int zero;
  bool bf16_moments;
};

class EngineGpuState : public testing::TestWithParam<StateCase> {};

TEST_P(EngineGpuState, MovesAPieceAtATimeThroughOneHostBuffer) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  const LlamaConfig config = testing_util::many_layers(f);
  EngineOptions o = engine_options(f, Device::Cuda, GetParam().zero);
  o.bf16_moments = GetParam().bf16_moments;
  SingleRank ra, rb;
  std::unique_ptr<Engine> a = make_engine(config, o, ra.mesh, random_weights(3, 0.02));
  std::unique_ptr<Engine> b = make_engine(config, o, rb.mesh, nullptr);
  {  // once unmeasured, so that whatever the CUDA runtime sets up for pageable copies each way is there already
    std::vector<float> p, m, v;
    a->export_shard(p, m, v);
    b->import_shard(p, m, v);
  }
  const testing_util::StateExchange x = testing_util::exchange_state_piecewise(*a, *b);
  // The plan the trainer prints (engine/engine.h) is what the exchange holds.
  const int64_t staging = plan_gpu_host_staging(config, engine_memory_layout(o, ra.mesh)).checkpoint_bytes;
  const int64_t shard_bytes = x.shard_elements * int64_t(sizeof(float));
  std::printf("  shard %.2f MB per array, largest piece %.2f MB; heap growth export %.3f MB, import %.3f MB, planned "
              "%.3f MB\n", shard_bytes / 1e6, x.largest_piece * 4 / 1e6, x.export_heap_growth / 1e6,
              x.import_heap_growth / 1e6, staging / 1e6);
  ASSERT_GT(shard_bytes, 2 * staging);  // a shard copy would not fit under the bound below
  EXPECT_NEAR(double(x.export_heap_growth), double(staging), 64 << 10);
  EXPECT_NEAR(double(x.import_heap_growth), double(staging), 64 << 10);
}

INSTANTIATE_TEST_SUITE_P(Stages, EngineGpuState,
                         testing::Values(StateCase{0, false}, StateCase{1, true}, StateCase{2, false},
                                         StateCase{3, true}),
                         [](const testing::TestParamInfo<StateCase>& i) {
                           return "zero" + std::to_string(i.param.zero) + (i.param.bf16_moments ? "_bf16" : "");
                         });

TEST(EngineGpu, StatusIsTheDevices) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  SingleRank r;
  std::unique_ptr<Engine> e = make_engine(f.config, engine_options(f, Device::Cuda), r.mesh, fixture_weights(f));
  train_step(*e, f, 0, 10);
  const EngineStatus s = e->status();
  std::printf("  %s: gpu %.0f / %.0f MB (peak %.0f), util %.0f%%, peak %.0f TFLOP/s, state %.2f MB, activations %.2f MB\n",
              e->describe().c_str(), s.gpu_mb, s.gpu_total_mb, s.gpu_peak_mb, s.gpu_util, e->peak_flops() / 1e12,
              e->state_bytes() / 1e6, e->activation_bytes() / 1e6);
  EXPECT_GT(s.gpu_mb, e->state_bytes() / 1e6);  // the engine's arena is on the card
  EXPECT_GE(s.gpu_total_mb, s.gpu_mb);
  EXPECT_GE(s.gpu_peak_mb, s.gpu_mb);
  EXPECT_TRUE(std::isnan(s.gpu_util) || (s.gpu_util >= 0 && s.gpu_util <= 100)) << s.gpu_util;
  EXPECT_GT(e->peak_flops(), 1e13);
  EXPECT_GT(e->activation_bytes(), 0);
  // fp32 master, gradients and two moments, and the bf16 copy: 18 bytes per parameter.
  EXPECT_GE(e->state_bytes(), 18 * e->layout().total());
}

// ZeRO-1 on one rank: the shard is the whole model in layout order, so the sharded update (its own segment
// table, norm and AdamW launch, then the "gather" into the model's copy) must give ZeRO-0's results bit for bit,
// stochastic rounding included; and its checkpoint exchange must continue bit for bit too.
class EngineGpuZeroOne : public testing::TestWithParam<Rounding> {};

TEST_P(EngineGpuZeroOne, OnOneRankEqualsZeroZeroBitForBit) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama32_tiny");
  EngineOptions o0 = engine_options(f, Device::Cuda, 0);
  o0.bf16_moments = GetParam().bf16_moments, o0.gpu.stochastic_rounding = GetParam().stochastic_rounding, o0.gpu.seed = 5;
  EngineOptions o1 = o0;
  o1.zero = 1;
  SingleRank r0, r1, r2;
  std::unique_ptr<Engine> zero0 = make_engine(f.config, o0, r0.mesh, fixture_weights(f));
  std::unique_ptr<Engine> zero1 = make_engine(f.config, o1, r1.mesh, fixture_weights(f));
  for (int64_t s = 0; s < 4; s++) {
    const StepResult a = train_step(*zero0, f, s, 10), b = train_step(*zero1, f, s, 10);
    EXPECT_EQ(a.loss, b.loss) << "step " << s;
    EXPECT_EQ(a.stats.grad_norm, b.stats.grad_norm) << "step " << s;
  }
  std::vector<float> p0, m0, v0, p1, m1, v1;
  zero0->export_shard(p0, m0, v0);
  zero1->export_shard(p1, m1, v1);
  EXPECT_EQ(p0, p1);
  EXPECT_EQ(m0, m1);
  EXPECT_EQ(v0, v1);

  std::unique_ptr<Engine> restored = make_engine(f.config, o1, r2.mesh, nullptr);
  restored->import_shard(p1, m1, v1);
  restored->set_steps_taken(zero1->steps_taken());
  const StepResult a = train_step(*zero1, f, 4, 10), b = train_step(*restored, f, 4, 10);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.stats.grad_norm, b.stats.grad_norm);
  std::vector<float> p2, m2, v2;
  zero1->export_shard(p1, m1, v1);
  restored->export_shard(p2, m2, v2);
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(m1, m2);
  EXPECT_EQ(v1, v2);
}

INSTANTIATE_TEST_SUITE_P(Moments, EngineGpuZeroOne,
                         testing::Values(Rounding{false, false}, Rounding{true, true}),
                         [](const testing::TestParamInfo<Rounding>& i) {
                           return std::string(i.param.bf16_moments ? "bf16" : "fp32") +
                                  (i.param.stochastic_rounding ? "_stochastic" : "");
                         });

// Every ZeRO stage and recompute mode on one rank computes ZeRO-0's bits: at one rank the shard is the whole
// layout in layout order (the norm sums the same elements in the same order, the stochastic rounding draws the
// same bits), sharded accumulation adds each micro-batch's unit gradient into the shard with the fp32 add that
// ZeRO-0's GEMM epilogue does (acc + C), and recompute reruns the same deterministic kernels on the same inputs.
// llama2_tiny (untied) runs its two rows as two micro-batches; llama32_tiny ties the embedding, whose head and
// lookup gradients ZeRO-2/3 add up in a fresh unit buffer before the shard ((head + lookup) + shard instead of
// (shard + head) + lookup), so it runs one micro-batch per step.
struct StageCase {
  int zero;
  bool prefetch;
  Recompute recompute;
};

class EngineGpuStages : public testing::TestWithParam<StageCase> {};

TEST_P(EngineGpuStages, OnOneRankEqualZeroZeroBitForBit) {
  TUNA_REQUIRE_GPU();
  for (const char* name : {"llama2_tiny", "llama32_tiny"}) {
    Fixture f(name);
    const bool two_micro_batches = !f.config.tie_word_embeddings;
    SCOPED_TRACE(name);
    EngineOptions base = engine_options(f, Device::Cuda, 0);
    base.bf16_moments = true, base.gpu.stochastic_rounding = true, base.gpu.seed = 7;
    if (two_micro_batches) base.micro_batch = 1;
    EngineOptions o = base;
    o.zero = GetParam().zero, o.zero_prefetch = GetParam().prefetch, o.recompute = GetParam().recompute;
    SingleRank r0, r1, r2;
    std::unique_ptr<Engine> ref = make_engine(f.config, base, r0.mesh, fixture_weights(f));
    std::unique_ptr<Engine> e = make_engine(f.config, o, r1.mesh, fixture_weights(f));
    const auto step = [&](Engine& x, int64_t s) {
      return two_micro_batches ? testing_util::train_step_by_rows(x, f, s, 10) : train_step(x, f, s, 10);
    };
    // A restored engine of the same stage continues bit for bit.
    std::unique_ptr<Engine> restored = make_engine(f.config, o, r2.mesh, nullptr);
    testing_util::expect_steps_and_restore_bit_equal(*ref, *e, *restored, f, step);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, EngineGpuStages,
    testing::Values(StageCase{0, true, Recompute::Selective}, StageCase{0, true, Recompute::Full},
                    StageCase{1, true, Recompute::Full}, StageCase{2, true, Recompute::None},
                    StageCase{3, true, Recompute::None}, StageCase{3, false, Recompute::Full},
                    StageCase{3, true, Recompute::Selective}),
    [](const testing::TestParamInfo<StageCase>& i) {
      return "zero" + std::to_string(i.param.zero) + (i.param.prefetch ? "" : "_no_prefetch") + "_recompute_" +
             recompute_name(i.param.recompute);
    });

// Several ranks on ONE device, as threads of this process (NCCL refuses two ranks on one GPU, and the GPU
// machine has no MPI): each thread builds its engine on device 0 with a LocalComm world and staged device comms
// over its dp and tp groups (comm/comm_local.cpp, comm/comm_staged.cpp), and must follow one rank on the whole
// batch (tests/model/ranks_test_util.h, which also argues the bound). The same cases run under mpirun on the
// emulator (tests/mpi/test_engine_gpu_emulated.cpp).
class EngineGpuThreadRanks : public testing::TestWithParam<testing_util::RanksCase> {};

TEST_P(EngineGpuThreadRanks, FollowOneRankOnTheWholeBatch) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama32_tiny");
  const testing_util::OneRankRun reference(f);
  testing_util::run_thread_ranks(GetParam().ranks,
                                 [&](Comm& world) { testing_util::follow_one_rank(world, f, GetParam(), reference); });
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, EngineGpuThreadRanks,
    testing::ValuesIn(testing_util::kRanksCases),
    [](const testing::TestParamInfo<testing_util::RanksCase>& i) { return testing_util::name(i.param); });

// Sequence parallelism over tp 2 (ranks as threads on one device, as above): the norm and residual regions split
// by rows, the all-gathers and reductions around the tp GEMMs, the norm weights' gradients summed over tp. Tied
// (llama32_tiny) and untied (llama2_tiny) embeddings, packed documents, each recompute mode, over dp 2 at ZeRO-1 and
// ZeRO-3 (the norm gradients written into the sharded store's unit buffers), and at tp 4 (llama2_tiny, whose 4 kv
// heads split; held to tp 4's bound, tests/model/ranks_test_util.h tp_bound, for NCCL's bf16 ring on GPUs). The one
// rank follows the CPU engine (EngineGpuParity), and the CPU engine with sp follows it too
// (tests/model/test_llama_sp.cpp).
struct SequenceParallelCase {
  const char* fixture;
  testing_util::RanksCase layout;
};
class EngineGpuSequenceParallel : public testing::TestWithParam<SequenceParallelCase> {};

// The layout's ranks as threads, each following the one-rank run of the fixture's whole batch.
void follows_one_rank_on_the_whole_batch(const SequenceParallelCase& c) {
  Fixture f(c.fixture);
  const testing_util::OneRankRun reference(f);
  testing_util::run_thread_ranks(c.layout.ranks, [&](Comm& world) {
    testing_util::follow_one_rank(world, f, c.layout, reference);
  });
}

TEST_P(EngineGpuSequenceParallel, FollowsOneRankOnTheWholeBatch) {
  TUNA_REQUIRE_GPU();
  follows_one_rank_on_the_whole_batch(GetParam());
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, EngineGpuSequenceParallel,
    testing::Values(SequenceParallelCase{"llama32_tiny", {2, 2, 0, true, Recompute::None, true}},
                    SequenceParallelCase{"llama2_tiny", {2, 2, 0, true, Recompute::Selective, true}},
                    SequenceParallelCase{"llama2_tiny", {4, 2, 1, true, Recompute::Full, true}},
                    SequenceParallelCase{"llama32_tiny", {4, 2, 3, true, Recompute::None, true}},
                    SequenceParallelCase{"llama2_tiny", {4, 4, 0, true, Recompute::None, true}}),
    [](const testing::TestParamInfo<SequenceParallelCase>& i) {
      std::string fixture = i.param.fixture;
      return fixture + "_" + testing_util::name(i.param.layout);
    });

// Pipeline stages (ranks as threads on one device, as above, the stages' transfers over the loopback device comm): 4
// micro-batches of one row through 2 stages in the 1F1B order, the activations and their gradients sent between the
// stages in bf16, the loss and the gradient norm summed
// over the stages. Tied (llama32_tiny: the last stage's copy of the table, whose gradient the two stages exchange)
// and untied (llama2_tiny) embeddings, recompute (the working activations of a micro-batch are gone by its
// backward on the first stage), and with dp 2 at ZeRO-1 and tp 2 (with sp) inside each stage.
class EngineGpuPipeline : public testing::TestWithParam<SequenceParallelCase> {};

TEST_P(EngineGpuPipeline, FollowsOneRankOnTheWholeBatch) {
  TUNA_REQUIRE_GPU();
  follows_one_rank_on_the_whole_batch(GetParam());
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, EngineGpuPipeline,
    testing::Values(SequenceParallelCase{"llama32_tiny", {2, 1, 0, true, Recompute::None, false, 2}},
                    SequenceParallelCase{"llama2_tiny", {2, 1, 0, true, Recompute::Selective, false, 2}},
                    SequenceParallelCase{"llama32_tiny", {4, 1, 1, true, Recompute::Full, false, 2}},
                    SequenceParallelCase{"llama32_tiny", {4, 2, 1, true, Recompute::None, true, 2}}),
    [](const testing::TestParamInfo<SequenceParallelCase>& i) {
      std::string fixture = i.param.fixture;
      return fixture + "_" + testing_util::name(i.param.layout);
    });

// The pipeline's stream order as a multi-GPU run has it, on one device: the stages' sends and receives over the loopback
// device comm (comm/comm_loopback.cpp: device copies on each stage's comm stream, ordered against the compute by
// the pipeline's events alone (GpuStage), where the staged comm would complete each on the host), plain and with random-length
// sleep kernels queued on the comm and compute streams (tests/comm/jittered_comm.h, three seeds), so that transfers
// and passes run late against each other in several ways. pp 2 and 3 over a 4-layer model (the fixtures' 2 layers
// are too few for 3 stages), 4 micro-batches of one row, clipping off, against one stage running the same
// micro-batches: the stages run the same GEMM shapes and add each layer's micro-batch gradients in the same order, so
// with untied embeddings every step's loss and the final weights are bit for bit the one stage's, and the gradient
// norm (its squares summed per stage, then over the stages) within 1e-12. With tied embeddings (pp 3: the first and
// last stages, not neighbours, exchange the table's gradient) the first loss is bit for bit and the rest hold the dp
// bound of tests/model/ranks_test_util.h, the table's two gradients being summed after the backwards.
struct PipelineLoopbackCase {
  int pp;
  bool tied;
  uint64_t jitter;  // the sleeps' seed; 0: none
};
class EngineGpuPipelineLoopback : public testing::TestWithParam<PipelineLoopbackCase> {};

TEST_P(EngineGpuPipelineLoopback, EqualsOneStageOverTheSameMicroBatches) {
  TUNA_REQUIRE_GPU();
  const PipelineLoopbackCase c = GetParam();
  Fixture f(c.tied ? "llama32_tiny" : "llama2_tiny");
  LlamaConfig config = f.config;
  config.num_hidden_layers = 4;
  const WeightFill weights = random_weights(11, 0.05);
  const FourRows data(config.vocab_size);
  EngineOptions o = testing_util::rows_options(f, 0, 1);
  o.opt.grad_clip = 0;
  std::vector<StepResult> want;
  std::vector<float> one_weights;
  {
    SingleRank one;
    std::unique_ptr<Engine> e = make_engine(config, o, one.mesh, weights);
    for (int64_t s = 0; s < testing_util::kRanksSteps; s++)
      want.push_back(testing_util::row_micro_batches_step(*e, f, data, 0, FourRows::kRows, s));
    std::vector<float> m, v;
    e->export_shard(one_weights, m, v);
  }
  const ParamLayout whole(config);
  testing_util::run_thread_ranks(c.pp, [&](Comm& world) {
    Mesh mesh = make_mesh(world, 1, c.pp);
    const DeviceCommFactory device_comm = [&](Comm& group, void* stream) -> std::unique_ptr<Comm> {
      std::unique_ptr<Comm> loopback = make_loopback_device_comm(group.split(0, group.rank()), stream, 120);
      if (c.jitter == 0) return loopback;
      return std::make_unique<testing_util::JitteredComm>(std::move(loopback), stream, c.jitter);
    };
    std::unique_ptr<Engine> e = make_engine(config, o, mesh, weights, device_comm);
    for (int64_t s = 0; s < testing_util::kRanksSteps; s++) {
      const StepResult r = testing_util::row_micro_batches_step(*e, f, data, 0, FourRows::kRows, s);
      if (world.rank() == 0)
        std::printf("  step %lld  loss 1 stage %.9g pp %d %.9g   grad norm %.9g %.9g\n", static_cast<long long>(s),
                    want[s].loss, c.pp, r.loss, want[s].stats.grad_norm, r.stats.grad_norm);
      EXPECT_EQ(r.tokens, want[s].tokens);
      if (!c.tied || s == 0) {
        EXPECT_EQ(r.loss, want[s].loss) << "step " << s;
      } else {
        EXPECT_NEAR(r.loss, want[s].loss, testing_util::kRanksLossTol * want[s].loss) << "step " << s;
      }
      EXPECT_NEAR(r.stats.grad_norm, want[s].stats.grad_norm,
                  (c.tied ? testing_util::kRanksNormTol : 1e-12) * want[s].stats.grad_norm)
          << "step " << s;
    }
    if (c.tied) {
      EXPECT_LE(testing_util::shard_error_against_whole(*e, whole, one_weights.data()), testing_util::kRanksWeightTol)
          << "stage " << world.rank() << "'s final weights";
      return;
    }
    std::vector<float> p, m, v;
    e->export_shard(p, m, v);  // one dp rank at ZeRO-0: the stage's layout in order
    int64_t differ = 0, compared = 0;
    for (const ParamTensor& t : e->layout().tensors()) {
      const float* theirs = one_weights.data() + whole.find(t.name)->offset;
      for (int64_t i = 0; i < t.numel; i++) differ += p[t.offset + i] != theirs[i];
      compared += t.numel;
    }
    EXPECT_GT(compared, 0);
    EXPECT_EQ(differ, 0) << "of stage " << world.rank() << "'s " << compared << " final weights differ from the one stage's";
  });
}

INSTANTIATE_TEST_SUITE_P(
    Stages, EngineGpuPipelineLoopback,
    testing::Values(PipelineLoopbackCase{2, false, 0}, PipelineLoopbackCase{3, false, 0},
                    PipelineLoopbackCase{3, true, 0}, PipelineLoopbackCase{2, false, 1},
                    PipelineLoopbackCase{3, false, 2}, PipelineLoopbackCase{3, true, 3}),
    [](const testing::TestParamInfo<PipelineLoopbackCase>& i) {
      return "pp" + std::to_string(i.param.pp) + (i.param.tied ? "_tied" : "") +
             (i.param.jitter ? "_jitter" + std::to_string(i.param.jitter) : "");
    });

// The pipeline's set-up exchanges one element each way over every link its steps use, so that NCCL makes those
// connections there and not inside the first step: pp 3 with tied embeddings, whose first and last stages (not
// neighbours) also exchange the table's gradient. The sends and receives the stages start while the engines are
// built, recorded by peer.
class RecordingComm final : public testing_util::ForwardingComm {
 public:
  RecordingComm(std::unique_ptr<Comm> inner, std::set<std::string>* calls)
      : ForwardingComm(std::move(inner)), calls_(calls) {}
  CommRequest send_start(const void* buf, int64_t n, CommType type, int peer, const char* what) override {
    calls_->insert("send to " + std::to_string(peer));
    return inner_->send_start(buf, n, type, peer, what);
  }
  CommRequest recv_start(void* buf, int64_t n, CommType type, int peer, const char* what) override {
    calls_->insert("recv from " + std::to_string(peer));
    return inner_->recv_start(buf, n, type, peer, what);
  }

 private:
  std::set<std::string>* calls_;
};

TEST(EngineGpuPipelineLinks, AreWarmedUpAtSetUp) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama32_tiny");
  LlamaConfig config = f.config;
  config.num_hidden_layers = 4;
  std::vector<std::set<std::string>> calls(3);
  testing_util::run_thread_ranks(3, [&](Comm& world) {
    Mesh mesh = make_mesh(world, 1, 3);
    const DeviceCommFactory device_comm = [&](Comm& group, void* stream) -> std::unique_ptr<Comm> {
      return std::make_unique<RecordingComm>(make_loopback_device_comm(group.split(0, group.rank()), stream, 120),
                                             &calls[world.rank()]);
    };
    make_engine(config, testing_util::rows_options(f, 0, 1), mesh, random_weights(11, 0.05), device_comm);
  });
  using Calls = std::set<std::string>;
  EXPECT_EQ(calls[0], (Calls{"send to 1", "recv from 1", "send to 2", "recv from 2"}));
  EXPECT_EQ(calls[1], (Calls{"send to 0", "recv from 0", "send to 2", "recv from 2"}));
  EXPECT_EQ(calls[2], (Calls{"send to 0", "recv from 0", "send to 1", "recv from 1"}));
}

// With tensor parallelism the tp collectives run on the compute stream, so every host wait the model makes for that
// stream (the token upload's, the loss's, the gradient norm's) goes through the tp comm (Comm::wait_event), which
// NCCL bounds by --comm_timeout, naming what waited and the group's last collective: never a bare synchronize that a
// hung tp peer holds forever. The tp comm here records those waits, and then fails them as NCCL's does at its
// timeout: the step stops with that error.
class WaitRecordingComm final : public testing_util::ForwardingComm {
 public:
  WaitRecordingComm(std::unique_ptr<Comm> inner, std::vector<std::string>* waits, bool time_out)
      : ForwardingComm(std::move(inner)), waits_(waits), time_out_(time_out) {}
  bool wait_event(void* cuda_event, const char* what) override {
    waits_->push_back(what);
    if (time_out_) fail("rank ", rank(), " of ", size(), ": ", what, " did not complete within 1 s (--comm_timeout)");
    return false;  // the caller synchronizes itself, as for a comm without device work
  }

 private:
  std::vector<std::string>* waits_;
  bool time_out_;
};

TEST(EngineGpuTensorParallel, HostWaitsGoThroughTheTpComm) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  const FourRows data(f.config.vocab_size);
  for (bool time_out : {false, true}) {
    std::vector<std::vector<std::string>> waits(2);
    std::vector<std::string> errors(2);
    testing_util::run_thread_ranks(2, [&](Comm& world) {
      Mesh mesh = make_mesh(world, 2, 1);
      const DeviceCommFactory device_comm = [&](Comm& group, void* stream) -> std::unique_ptr<Comm> {
        return std::make_unique<WaitRecordingComm>(make_staged_device_comm(group.split(0, group.rank()), stream),
                                                   &waits[world.rank()], time_out);
      };
      std::unique_ptr<Engine> e = make_engine(f.config, testing_util::rows_options(f, 0, FourRows::kRows), mesh,
                                              random_weights(11, 0.05), device_comm);
      try {
        testing_util::row_micro_batches_step(*e, f, data, 0, FourRows::kRows, 0);
      } catch (const Error& x) {
        errors[world.rank()] = x.what();
      }
    });
    for (int r = 0; r < 2; r++) {
      SCOPED_TRACE(str("tp rank ", r, time_out ? ", timing out" : ""));
      ASSERT_FALSE(waits[r].empty());
      if (time_out) {
        EXPECT_NE(errors[r].find("tp group: the compute stream's work before a token upload did not complete within 1 s "
                                 "(--comm_timeout)"),
                  std::string::npos)
            << errors[r];
        continue;
      }
      EXPECT_EQ(errors[r], "");
      for (const char* what : {"tp group: the compute stream's work before a token upload",
                               "tp group: the backward, before the gradient norm is read",
                               "tp group: the gradient norm's all-reduce"})
        EXPECT_NE(std::find(waits[r].begin(), waits[r].end(), what), waits[r].end()) << what;
    }
  }
}

// A pipeline run's checkpoint is rank files in global coordinates (each stage's tensors under their global names, the
// last stage's copy of a tied table not written): one rank without stages restores every weight and moment bit for
// bit as the stages held them, and its next step follows theirs (the same micro-batches; only the fp32 order of the
// tied table's gradient sum differs, so within the dp bound of tests/model/ranks_test_util.h); and the one rank's
// checkpoint restored on two stages continues as the one rank does.
TEST(EngineGpuPipelineCheckpoint, ResumesWithoutStagesAndBack) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama32_tiny");
  const testing_util::FourRows data(f.config.vocab_size);
  testing_data::TempDir tmp;
  const nlohmann::json config_json = f.config.to_json();
  std::mutex mutex;
  std::map<std::string, std::array<std::vector<float>, 3>> held;  // by name (a copy's marked): weights, m, v
  std::filesystem::path dir;
  StepResult next_on_stages;
  testing_util::run_thread_ranks(2, [&](Comm& world) {
    Mesh mesh = make_mesh(world, 1, 2);
    const DeviceCommFactory device_comm = [](Comm& group, void* stream) {
      return make_staged_device_comm(group.split(0, group.rank()), stream);
    };
    std::unique_ptr<Engine> e =
        make_engine(f.config, testing_util::rows_options(f, 0, 1), mesh, fixture_weights(f), device_comm);
    for (int64_t s = 0; s < 2; s++) testing_util::row_micro_batches_step(*e, f, data, 0, FourRows::kRows, s);
    if (world.rank() == 0) prepare_sharded_checkpoint(tmp.path(), 2);
    world.barrier("test checkpoint directory");
    const StateExport state = [&](const StateSink& sink) { e->export_state(sink); };
    write_checkpoint_shard(checkpoint_tmp_dir(tmp.path(), 2), world.rank(), e->layout(),
                           ShardState{&e->segments(), state, e->steps_taken(), /*write_replicated=*/true});
    world.barrier("test checkpoint shards");
    if (world.rank() == 0) dir = finish_sharded_checkpoint(tmp.path(), 2, {&config_json, nullptr, {}, {}, {}}, 0);
    std::vector<float> p, m, v;
    e->export_shard(p, m, v);  // one dp rank at ZeRO-0: the stage's layout in order
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (const ParamTensor& t : e->layout().tensors())
        for (int k = 0; k < 3; k++) {
          const std::vector<float>& x = k == 0 ? p : k == 1 ? m : v;
          held[t.name + (t.copy ? " (copy)" : "")][k].assign(x.begin() + t.offset, x.begin() + t.offset + t.numel);
        }
    }
    const StepResult r = testing_util::row_micro_batches_step(*e, f, data, 0, FourRows::kRows, 2);
    if (world.rank() == 0) next_on_stages = r;
  });
  ASSERT_FALSE(dir.empty());
  // The last stage's copy of the table took the first stage's updates.
  ASSERT_EQ(held.count("model.embed_tokens.weight (copy)"), 1u);
  EXPECT_EQ(held["model.embed_tokens.weight (copy)"], held["model.embed_tokens.weight"]);

  SingleRank one;
  std::unique_ptr<Engine> e = make_engine(f.config, testing_util::rows_options(f, 0, 1), one.mesh, nullptr);
  const int64_t steps = load_checkpoint_state(dir, e->layout(), e->segments(),
                                              [&](const StateSource& source) { e->import_state(source); });
  EXPECT_EQ(steps, 2);
  e->set_steps_taken(steps);
  std::vector<float> p, m, v;
  e->export_shard(p, m, v);
  for (const ParamTensor& t : e->layout().tensors()) {
    ASSERT_EQ(held.count(t.name), 1u) << t.name;
    for (int k = 0; k < 3; k++) {
      const std::vector<float>& x = k == 0 ? p : k == 1 ? m : v;
      EXPECT_TRUE(std::equal(x.begin() + t.offset, x.begin() + t.offset + t.numel, held[t.name][k].begin()))
          << t.name << (k == 0 ? " weights" : k == 1 ? " m" : " v");
    }
  }
  // And back: the one rank's checkpoint (the single file) restored on 2 stages, whose next step is the one rank's.
  const StateExport one_state = [&](const StateSink& sink) { e->export_state(sink); };
  const std::filesystem::path single =
      save_checkpoint(tmp.path() / "one", 2, e->layout(),
                      CheckpointContents{&config_json, nullptr, {nullptr, nullptr, e->steps_taken()},
                                         {{"step", 2}}, {}, nullptr, &e->segments(), one_state},
                      0);
  const StepResult r = testing_util::row_micro_batches_step(*e, f, data, 0, FourRows::kRows, 2);
  EXPECT_EQ(r.tokens, next_on_stages.tokens);
  EXPECT_NEAR(r.loss, next_on_stages.loss, testing_util::kRanksLossTol * next_on_stages.loss);
  EXPECT_NEAR(r.stats.grad_norm, next_on_stages.stats.grad_norm,
              testing_util::kRanksNormTol * next_on_stages.stats.grad_norm);
  testing_util::run_thread_ranks(2, [&](Comm& world) {
    Mesh mesh = make_mesh(world, 1, 2);
    const DeviceCommFactory device_comm = [](Comm& group, void* stream) {
      return make_staged_device_comm(group.split(0, group.rank()), stream);
    };
    std::unique_ptr<Engine> stage =
        make_engine(f.config, testing_util::rows_options(f, 0, 1), mesh, nullptr, device_comm);
    const int64_t taken = load_checkpoint_state(single, stage->layout(), stage->segments(),
                                                [&](const StateSource& source) { stage->import_state(source); });
    EXPECT_EQ(taken, 2);
    stage->set_steps_taken(taken);
    const StepResult again = testing_util::row_micro_batches_step(*stage, f, data, 0, FourRows::kRows, 2);
    EXPECT_EQ(again.tokens, r.tokens);
    EXPECT_NEAR(again.loss, r.loss, testing_util::kRanksLossTol * r.loss) << "stage " << world.rank();
    EXPECT_NEAR(again.stats.grad_norm, r.stats.grad_norm, testing_util::kRanksNormTol * r.stats.grad_norm);
  });
}

// A step whose loss is not finite changes nothing at every ZeRO stage (the decision is made on the host from
// values the step reads back anyway); the next finite step trains as if the bad one had not happened.
class EngineGpuNonFinite : public testing::TestWithParam<int> {};

TEST_P(EngineGpuNonFinite, StepIsSkippedAndTheNextOneTrains) {
  TUNA_REQUIRE_GPU();
  testing_util::expect_non_finite_steps_skipped(Fixture("llama32_tiny"), Device::Cuda, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Zero, EngineGpuNonFinite, testing::Values(0, 1, 2, 3));

// No stage zeroes the gradient at the start of a step (the step's first writes overwrite it); a step in which no
// backward ran must still see a zero gradient, not the previous step's: norm 0, as on the CPU engine.
class EngineGpuEmptyStep : public testing::TestWithParam<int> {};

TEST_P(EngineGpuEmptyStep, HasAZeroGradient) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama32_tiny");
  SingleRank rc, rg;
  std::unique_ptr<Engine> cpu = make_engine(f.config, engine_options(f, Device::Cpu, GetParam()), rc.mesh, fixture_weights(f));
  std::unique_ptr<Engine> gpu = make_engine(f.config, engine_options(f, Device::Cuda, GetParam()), rg.mesh, fixture_weights(f));
  train_step(*cpu, f, 0, 10), train_step(*gpu, f, 0, 10);
  for (Engine* e : {cpu.get(), gpu.get()}) {
    e->begin_step();
    const StepResult r = e->finish_step(LossSum{0.0, 1}, 1e-3);
    EXPECT_TRUE(r.stats.applied);
    EXPECT_EQ(r.stats.grad_norm, 0.0) << e->describe();
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, EngineGpuEmptyStep, testing::Values(0, 1, 2, 3));

// The forward-only model of build/eval and build/sample on the device against the CPU's, with the
// tolerances of test_llama_gpu.cpp (3e-2 on the logits' relative error norm, 1e-2 on the loss).
TEST(EngineGpu, ForwardModelMatchesTheCpus) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  std::unique_ptr<ForwardModel> cpu = make_forward_model(f.config, Device::Cpu, f.batch, f.seq, fixture_weights(f));
  std::unique_ptr<ForwardModel> gpu = make_forward_model(f.config, Device::Cuda, f.batch, f.seq, fixture_weights(f));
  const LossSum a = cpu->forward_loss(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  const LossSum b = gpu->forward_loss(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  EXPECT_EQ(a.count, b.count);
  EXPECT_NEAR(b.sum / b.count, a.sum / a.count, 1e-2 * a.sum / a.count);
  const size_t n = static_cast<size_t>(f.batch * f.seq * f.config.vocab_size);
  std::vector<float> la(n), lb(n, NAN);
  cpu->forward_logits(f.inputs.data(), f.batch, f.seq, la.data());
  gpu->forward_logits(f.inputs.data(), f.batch, f.seq, lb.data());
  const std::vector<double> ref(la.begin(), la.end());
  EXPECT_LE(testing_util::rel_err_norm(lb.data(), ref.data(), static_cast<int64_t>(n)), 3e-2);
}

// Multiple-choice scoring on the device (build/eval --tasks): each target's log-prob within the forward's tolerance of
// the CPU's (1e-2 of the loss scale: bf16 against fp32), and the greedy flag equal wherever the CPU's top two logits
// are apart by more than the logits' error; one request per row (positions null), packed positions refused.
TEST(EngineGpu, ForwardModelScoresTargetsAsTheCpu) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  const int64_t V = f.config.vocab_size, n = f.batch * f.seq;
  std::unique_ptr<ForwardModel> cpu = make_forward_model(f.config, Device::Cpu, f.batch, f.seq, fixture_weights(f));
  std::unique_ptr<ForwardModel> gpu = make_forward_model(f.config, Device::Cuda, f.batch, f.seq, fixture_weights(f));
  EXPECT_TRUE(cpu->packs_documents());
  EXPECT_FALSE(gpu->packs_documents());
  std::vector<float> la(n), lb(n, NAN);
  std::vector<uint8_t> ga(n), gb(n, 7);
  cpu->forward_target_logps(f.inputs.data(), f.targets.data(), f.batch, f.seq, nullptr, la.data(), ga.data());
  gpu->forward_target_logps(f.inputs.data(), f.targets.data(), f.batch, f.seq, nullptr, lb.data(), gb.data());
  std::vector<float> logits(n * V);
  cpu->forward_logits(f.inputs.data(), f.batch, f.seq, logits.data());
  int64_t compared = 0;
  for (int64_t i = 0; i < n; i++) {
    if (f.targets[i] < 0) {
      EXPECT_EQ(lb[i], 0.0f) << i;
      EXPECT_EQ(gb[i], 0) << i;
      continue;
    }
    EXPECT_NEAR(lb[i], la[i], 1e-2 * std::max(1.0f, std::abs(la[i]))) << i;
    std::vector<float> row(logits.begin() + i * V, logits.begin() + (i + 1) * V);
    std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
    if (row[0] - row[1] <= 0.1f) continue;
    EXPECT_EQ(gb[i], ga[i]) << i;
    compared++;
  }
  EXPECT_GT(compared, n / 2);
  std::vector<int32_t> positions(n, 0);
  EXPECT_THROW(gpu->forward_target_logps(f.inputs.data(), f.targets.data(), f.batch, f.seq, positions.data(), lb.data(),
                                         gb.data()),
               Error);
}

// --eval_tasks on the device: the training engine's target log-probs and greedy flags are the forward model's on the
// same weights bit for bit (the same forward, the head's logits a chunk at a time on the host), ZeRO-3's gathered
// weights too; packed positions are refused.
class EngineGpuTaskScoring : public testing::TestWithParam<int> {};

TEST_P(EngineGpuTaskScoring, EqualsTheForwardModel) {
  TUNA_REQUIRE_GPU();
  Fixture f("llama2_tiny");
  const int64_t n = f.batch * f.seq;
  SingleRank r;
  std::unique_ptr<Engine> e =
      make_engine(f.config, engine_options(f, Device::Cuda, GetParam()), r.mesh, fixture_weights(f));
  std::unique_ptr<ForwardModel> m = make_forward_model(f.config, Device::Cuda, f.batch, f.seq, fixture_weights(f));
  std::vector<float> la(n, NAN), lb(n, NAN);
  std::vector<uint8_t> ga(n, 7), gb(n, 7);
  e->target_logps(f.inputs.data(), f.targets.data(), f.batch, f.seq, nullptr, la.data(), ga.data());
  m->forward_target_logps(f.inputs.data(), f.targets.data(), f.batch, f.seq, nullptr, lb.data(), gb.data());
  int64_t scored = 0;
  for (int64_t i = 0; i < n; i++) {
    EXPECT_EQ(la[i], lb[i]) << i;
    EXPECT_EQ(ga[i], gb[i]) << i;
    scored += f.targets[i] >= 0;
  }
  EXPECT_GT(scored, 0);
  // Training moves the weights the scoring reads.
  train_step(*e, f, 0, 10);
  e->target_logps(f.inputs.data(), f.targets.data(), f.batch, f.seq, nullptr, la.data(), ga.data());
  int64_t moved = 0;
  for (int64_t i = 0; i < n; i++) moved += la[i] != lb[i];
  EXPECT_GT(moved, 0);
  std::vector<int32_t> positions(n, 0);
  EXPECT_THROW(e->target_logps(f.inputs.data(), f.targets.data(), f.batch, f.seq, positions.data(), la.data(),
                               ga.data()),
               Error);
}

INSTANTIATE_TEST_SUITE_P(Zero, EngineGpuTaskScoring, testing::Values(0, 3));

}  // namespace
}  // namespace tuna
#endif  // TUNA_CUDA
