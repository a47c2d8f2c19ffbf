// engine/engine_gpu.cpp data parallel, under `mpirun -np 2` on the host emulator (build/emulated_gpu_mpi_tests,
// which tests/kernels/test_gpu_emulated.cpp launches): the CUDA engine at dp = 2 follows the one-rank engine
// on the whole batch, and its checkpoint (export_state -> the sharded checkpoint writer -> load_checkpoint_state
// -> import_state) restores at 2 ranks and at 1; with two micro-batches a step too. And the preference objectives
// over two pipeline stages follow one rank.
//
// The device comm. A real build all-reduces gradients and gathers restored units with NCCL on the engine's
// stream (train.cu's DeviceCommFactory, comm/comm_nccl.cpp), whose own code runs only on GPUs. Here the staged
// device comm (comm/comm_staged.cpp: device buffers copied through pinned host memory on the stream) carries them
// over an MpiComm of the same dp ranks, as it carries a LocalComm when ranks share one GPU in gpu-check. What
// runs is the engine's own data-parallel code: which buffers it reduces or gathers, when, and where.
//
// Tolerance of dp = 2 against one rank on both rows: 1e-6 relative on each step's loss and gradient norm and
// on the final master weights (error norm). The GPU model computes each row on its own except the weight
// gradients, which sum over every token of a micro-batch in the matmul. The one rank trains the two rows as two
// micro-batches of one row, accumulating: a weight's gradient is then (0 + row 0's sum) + row 1's sum, the very
// fp32 additions the two ranks' all-reduce makes. Only the tied embedding's gradient differs, in the order of
// its additions (the lm_head's and the embedding's of each row: h0 + e0 + h1 + e1 on the one rank, (h0 + e0) +
// (h1 + e1) over two). Measured on llama32_tiny over its 10 steps: the loss bit-equal at every step, the gradient
// norm within 1.3e-9, the final master weights within 6.6e-10, the moments within 6.5e-8. 1e-6 is a thousand
// times the weights' worst; a real mistake (a missing or doubled gradient reduction, the wrong row, the wrong
// token count) moves the loss by percents from step 1.
//
// The one rank used to take both rows in one micro-batch, summing both rows' tokens in one fp32 reduction: every
// weight gradient then differed in its last bits from step 0 (the master weights by up to 7.8e-9), and the test
// held only while no update moved a master weight across a bf16 rounding boundary on one run and not the
// other. Fusing the q|k|v and gate|up GEMMs (one bf16 rounding fewer in their input gradients) changed the
// trajectory, and at step 8 one did (measured: 1745 master weights apart by at most 3e-8 after step 7, then the
// loss 2e-3 apart at every ZeRO stage alike): a coin toss, not the engine's data-parallel code. One micro-batch
// against rows split over ranks is still checked, over 3 steps, by the rank tests of tests/model/ranks_test_util.h
// (here under mpirun and on threads), and on one rank by LlamaGpu.GradientAccumulationOverMicroBatchesMatches-
// OneBatch.
#ifndef TUNA_EMULATOR
#error "runs on the host emulator only: its device comm is an MpiComm on host buffers (a GPU needs NCCL)"
#endif
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "comm/comm.h"
#include "ckpt/checkpoint.h"
#include "engine/engine.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/preference_ranks_test_util.h"  // the preference objectives on several ranks
#include "tests/model/ranks_test_util.h"
#include "tests/mpi/mpi_test_util.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::engine_options;
using testing_util::Fixture;
using testing_util::fixture_weights;
using testing_util::SingleRank;

// See the file comment.
constexpr double kLossTol = 1e-6;      // relative, each step's loss
constexpr double kGradNormTol = 1e-6;  // relative, each step's gradient norm
constexpr double kWeightTol = 1e-6;    // relative error norm of the final master weights

// The dp mesh over the test's world (dp = world size, tp = 1) and its device comm.
struct DataParallel {
  Mesh mesh = make_mesh(test::world(), 1);
  // Stands in for NCCL (comm/comm_nccl.cpp, GPUs only): the staged device comm over the same dp ranks.
  DeviceCommFactory device_comm = [](Comm& group, void* stream) {
    return make_staged_device_comm(group.split(0, group.rank()), stream);
  };
};

// One rank's row of the fixture's batch (dp rank r trains row r) at micro-batch 1, ZeRO stage `zero`.
EngineOptions row_options(const Fixture& f, int zero) {
  EngineOptions o = engine_options(f, Device::Cuda, zero);
  o.micro_batch = 1;
  return o;
}

// One rank on every row of the fixture's batch, a micro-batch of one row at a time (see the file comment).
StepResult whole_batch_step(Engine& e, const Fixture& f, int64_t s, int64_t steps) {
  e.begin_step();
  LossSum total;
  for (int64_t row = 0; row < f.batch; row++) {
    const LossSum l = e.forward_backward(f.inputs.data() + row * f.seq, f.targets.data() + row * f.seq, 1, f.seq);
    total.sum += l.sum, total.count += l.count;
  }
  return e.finish_step(total, learning_rate(f.optimizer(), s, steps));
}

StepResult row_step(Engine& e, const Fixture& f, int row, int64_t s, int64_t steps) {
  e.begin_step();
  const LossSum local = e.forward_backward(f.inputs.data() + row * f.seq, f.targets.data() + row * f.seq, 1, f.seq);
  return e.finish_step(local, learning_rate(f.optimizer(), s, steps));
}

// Bit-equal state; on a mismatch, how many elements differ and the first (the vectors are too long to print).
void expect_bit_equal(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t differ = 0, first = -1;
  for (size_t i = 0; i < want.size(); i++)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && differ++ == 0) first = static_cast<int64_t>(i);
  if (differ == 0) return;
  ADD_FAILURE() << what << ": " << differ << " of " << want.size() << " elements differ, the first at shard index "
                << first << " (" << got[first] << " instead of " << want[first] << ")";
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

// The elements of `whole` (ParamLayout order) at `segments`, in shard order.
std::vector<float> pick(const std::vector<float>& whole, const std::vector<Segment>& segments) {
  std::vector<float> out;
  for (const Segment& s : segments) out.insert(out.end(), whole.begin() + s.begin, whole.begin() + s.begin + s.size);
  return out;
}

double rel_err_norm(const std::vector<float>& ours, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); i++) {
    num += (double(ours[i]) - ref[i]) * (double(ours[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Both dp replicas hold the same weights (ZeRO-0 keeps them identical without a broadcast, ZeRO-1 by gathering): the loss of the
// whole batch, evaluated on each rank, is bit-equal to rank 0's.
void expect_replicas_identical(Engine& e, const Fixture& f, Comm& dp) {
  double sum = 0;
  for (int64_t row = 0; row < f.batch; row++)
    sum += e.forward_loss(f.inputs.data() + row * f.seq, f.targets.data() + row * f.seq, 1, f.seq).sum;
  double root = sum;
  dp.broadcast(&root, sizeof root, 0, "rank 0's validation loss");
  EXPECT_EQ(sum, root) << "rank " << dp.rank() << " drifted from rank 0";
}

// llama32_tiny's two rows on one rank (the whole batch) and over two (dp rank r trains row r) at ZeRO stage `zero`,
// from the same weights.
struct OneRankAndTwo {
  Fixture f{"llama32_tiny"};
  DataParallel dp;
  int row = dp.mesh.dp_rank;
  SingleRank one;
  std::unique_ptr<Engine> whole, rows;
  explicit OneRankAndTwo(int zero) {
    TUNA_CHECK(f.batch == 2, "llama32_tiny has ", f.batch, " rows, these tests take 2");
    whole = make_engine(f.config, engine_options(f, Device::Cuda), one.mesh, fixture_weights(f));
    rows = make_engine(f.config, row_options(f, zero), dp.mesh, fixture_weights(f), dp.device_comm);
  }
};

// ZeRO-0 all-reduces the gradients; ZeRO-1 reduce-scatters them, updates its shard and all-gathers the weights;
// ZeRO-2 reduce-scatters each unit's gradient as the backward finishes it; ZeRO-3 also gathers each unit's
// weights before use.
class EngineGpuDataParallel : public testing::TestWithParam<int> {};

TEST_P(EngineGpuDataParallel, TwoRanksFollowOneRankOnTheWholeBatch) {
  if (test::world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  OneRankAndTwo t(GetParam());
  const Fixture& f = t.f;
  const int row = t.row;
  Engine &whole = *t.whole, &rows = *t.rows;
  const int64_t steps = f.meta.at("steps");
  double worst_loss = 0, worst_norm = 0;
  for (int64_t s = 0; s < steps; s++) {
    const StepResult a = whole_batch_step(whole, f, s, steps), b = row_step(rows, f, row, s, steps);
    if (row == 0)
      std::printf("  step %2lld  loss 1 rank %.7f 2 ranks %.7f   grad norm %.6f %.6f\n", static_cast<long long>(s),
                  a.loss, b.loss, a.stats.grad_norm, b.stats.grad_norm);
    EXPECT_EQ(a.tokens, b.tokens) << "step " << s;  // the token count is summed over the ranks
    EXPECT_LE(rel(b.loss, a.loss), kLossTol) << "step " << s << ": " << b.loss << " vs " << a.loss;
    EXPECT_LE(rel(b.stats.grad_norm, a.stats.grad_norm), kGradNormTol)
        << "step " << s << ": " << b.stats.grad_norm << " vs " << a.stats.grad_norm;
    worst_loss = std::max(worst_loss, rel(b.loss, a.loss));
    worst_norm = std::max(worst_norm, rel(b.stats.grad_norm, a.stats.grad_norm));
  }
  EXPECT_EQ(rows.steps_taken(), steps);
  expect_replicas_identical(rows, f, *t.dp.mesh.dp);
  // ZeRO-1 at 2 ranks holds bf16 weights and fp32 gradients (6 bytes per parameter) plus half of the 16 bytes
  // of master, moments and reduced gradient: 14 of ZeRO-0's 18 (2 + 4 master + 4 gradients + 8 moments).
  if (GetParam() == 1) {
    const double ratio = double(rows.state_bytes()) / double(whole.state_bytes());
    if (row == 0) std::printf("  ZeRO-1 state at 2 ranks: %.3f of ZeRO-0's\n", ratio);
    EXPECT_LT(ratio, 14.0 / 18.0 + 0.02);
  }
  // Final master weights and moments: this rank's pieces against the same elements of the one rank's.
  std::vector<float> pw, mw, vw, pr, mr, vr;
  whole.export_shard(pw, mw, vw);
  rows.export_shard(pr, mr, vr);
  const double weight_err = rel_err_norm(pr, pick(pw, rows.segments()));
  if (row == 0)
    std::printf("  worst relative difference: loss %.2e, grad norm %.2e; final weights %.2e, m %.2e, v %.2e\n",
                worst_loss, worst_norm, weight_err, rel_err_norm(mr, pick(mw, rows.segments())),
                rel_err_norm(vr, pick(vw, rows.segments())));
  EXPECT_LE(weight_err, kWeightTol);
}

INSTANTIATE_TEST_SUITE_P(ZeroStages, EngineGpuDataParallel, testing::Values(0, 1, 2, 3),
                         [](const testing::TestParamInfo<int>& i) { return "zero" + std::to_string(i.param); });

// Gradient accumulation at dp = 2: each rank runs two micro-batches a step (its own row, then the other rank's), so
// that every ZeRO stage takes its second path: the step's first micro-batch overwrites each gradient (ZeRO-2/3:
// its reduce-scatter writes the shard), the second adds (ZeRO-2/3: reduce-scattered, then added to the shard).
// Each rank's local sum is both rows' gradient, the dp sum twice that over twice the tokens: the same mean as one
// rank's on the whole batch, up to fp32 summation order, with the tolerances of the file comment.
class EngineGpuDataParallelAccumulation : public testing::TestWithParam<int> {};

TEST_P(EngineGpuDataParallelAccumulation, TwoMicroBatchesOnTwoRanksFollowOneRank) {
  if (test::world().size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  OneRankAndTwo t(GetParam());
  const Fixture& f = t.f;
  const int row = t.row;
  Engine &whole = *t.whole, &rows = *t.rows;
  const int64_t steps = 3;
  for (int64_t s = 0; s < steps; s++) {
    const StepResult a = whole_batch_step(whole, f, s, steps);
    rows.begin_step();
    LossSum local;
    for (int r : {row, 1 - row}) {
      const LossSum l = rows.forward_backward(f.inputs.data() + r * f.seq, f.targets.data() + r * f.seq, 1, f.seq);
      local.sum += l.sum, local.count += l.count;
    }
    const StepResult b = rows.finish_step(local, learning_rate(f.optimizer(), s, steps));
    EXPECT_EQ(2 * a.tokens, b.tokens) << "step " << s;
    EXPECT_LE(rel(b.loss, a.loss), kLossTol) << "step " << s << ": " << b.loss << " vs " << a.loss;
    EXPECT_LE(rel(b.stats.grad_norm, a.stats.grad_norm), kGradNormTol)  // of the mean: twice the sum, twice the tokens
        << "step " << s << ": " << b.stats.grad_norm << " vs " << a.stats.grad_norm;
  }
  std::vector<float> pw, mw, vw, pr, mr, vr;
  whole.export_shard(pw, mw, vw);
  rows.export_shard(pr, mr, vr);
  EXPECT_LE(rel_err_norm(pr, pick(pw, rows.segments())), kWeightTol);
}

INSTANTIATE_TEST_SUITE_P(ZeroStages, EngineGpuDataParallelAccumulation, testing::Values(0, 1, 2, 3),
                         [](const testing::TestParamInfo<int>& i) { return "zero" + std::to_string(i.param); });

// A path every rank agrees on: rank 0 makes the directory (and removes it when the test ends).
struct SharedTempDir {
  std::optional<testing_util::TempDir> owned;
  std::filesystem::path path;
  explicit SharedTempDir(Comm& world) {
    char buf[512] = {};
    if (world.rank() == 0) {
      owned.emplace("engine_gpu_dp");
      std::strncpy(buf, owned->path.c_str(), sizeof buf - 1);
    }
    world.broadcast(buf, sizeof buf, 0, "temporary directory");
    path = buf;
  }
};

// As train.cu saves at several ranks: rank 0 prepares, every rank writes its shard, rank 0 finishes.
std::filesystem::path save_sharded(Engine& e, const Fixture& f, Comm& world, const std::filesystem::path& root,
                                   int64_t step) {
  if (world.rank() == 0) prepare_sharded_checkpoint(root, step);
  world.barrier("checkpoint directory created");
  write_checkpoint_shard(checkpoint_tmp_dir(root, step), world.rank(), e.layout(),
                         ShardState{&e.segments(), [&](const StateSink& sink) { e.export_state(sink); },
                                    e.steps_taken(), true});
  world.barrier("checkpoint shards written");
  const nlohmann::json config_json = read_config_json(f.dir);
  if (world.rank() == 0)
    finish_sharded_checkpoint(root, step, CheckpointContents{&config_json, nullptr, {}, {{"step", step}}, {}}, 0);
  world.barrier("checkpoint renamed");
  const std::optional<std::filesystem::path> dir = latest_checkpoint(root);
  TUNA_CHECK(dir, "no checkpoint under ", root.string());
  return *dir;
}

// As train.cu resumes: this rank's segments from the checkpoint, a piece at a time into the engine.
void restore(Engine& e, const std::filesystem::path& dir) {
  e.set_steps_taken(load_checkpoint_state(dir, e.layout(), e.segments(),
                                          [&](const StateSource& source) { e.import_state(source); }));
}

struct Rounding {
  int zero;
  bool bf16_moments, stochastic_rounding;
};

class EngineGpuDataParallelResume : public testing::TestWithParam<Rounding> {};

// bf16 moments: import_shard narrows the gathered fp32 moments on the device. Stochastic rounding: the bf16
// weights of the restored engine must be rounded as the last update rounded them (set_steps_taken).
TEST_P(EngineGpuDataParallelResume, CheckpointRestoresAtTwoRanksAndAtOne) {
  Comm& world = test::world();
  if (world.size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  Fixture f("llama32_tiny");
  const int64_t steps = 10, saved_at = 3;
  DataParallel dp;
  const int row = dp.mesh.dp_rank;
  EngineOptions rows = row_options(f, GetParam().zero), whole = engine_options(f, Device::Cuda);
  for (EngineOptions* o : {&rows, &whole}) {
    o->bf16_moments = GetParam().bf16_moments;
    o->gpu.stochastic_rounding = GetParam().stochastic_rounding;
    o->gpu.seed = 5;
  }
  std::unique_ptr<Engine> a = make_engine(f.config, rows, dp.mesh, fixture_weights(f), dp.device_comm);
  for (int64_t s = 0; s < saved_at; s++) row_step(*a, f, row, s, steps);
  SharedTempDir tmp(world);
  const std::filesystem::path dir = save_sharded(*a, f, world, tmp.path / "ckpt", saved_at);
  ASSERT_TRUE(is_sharded_checkpoint(dir)) << dir;
  std::vector<float> pa, ma, va;
  a->export_shard(pa, ma, va);

  // Two ranks, as the run that wrote it: the same state and the same next step, bit for bit.
  std::unique_ptr<Engine> b = make_engine(f.config, rows, dp.mesh, nullptr, dp.device_comm);
  restore(*b, dir);
  EXPECT_EQ(b->steps_taken(), saved_at);
  std::vector<float> pb, mb, vb;
  b->export_shard(pb, mb, vb);
  expect_bit_equal(pb, pa, "restored at 2 ranks: weights");
  expect_bit_equal(mb, ma, "restored at 2 ranks: first moments");
  expect_bit_equal(vb, va, "restored at 2 ranks: second moments");
  // One rank on the whole batch: the same state bit for bit (each rank checks its pieces of it).
  SingleRank one;
  std::unique_ptr<Engine> c = make_engine(f.config, whole, one.mesh, nullptr);
  restore(*c, dir);
  std::vector<float> pc, mc, vc;
  c->export_shard(pc, mc, vc);
  expect_bit_equal(pick(pc, a->segments()), pa, "restored at 1 rank: weights");
  expect_bit_equal(pick(mc, a->segments()), ma, "restored at 1 rank: first moments");
  expect_bit_equal(pick(vc, a->segments()), va, "restored at 1 rank: second moments");

  const StepResult sa = row_step(*a, f, row, saved_at, steps), sb = row_step(*b, f, row, saved_at, steps);
  const StepResult sc = whole_batch_step(*c, f, saved_at, steps);
  if (row == 0)
    std::printf("  step %lld  loss uninterrupted %.7f restored at 2 ranks %.7f at 1 rank %.7f; grad norm %.7f %.7f "
                "%.7f\n", static_cast<long long>(saved_at), sa.loss, sb.loss, sc.loss, sa.stats.grad_norm,
                sb.stats.grad_norm, sc.stats.grad_norm);
  EXPECT_EQ(sa.loss, sb.loss);
  EXPECT_EQ(sa.stats.grad_norm, sb.stats.grad_norm);
  a->export_shard(pa, ma, va);
  b->export_shard(pb, mb, vb);
  expect_bit_equal(pb, pa, "a step after the restore at 2 ranks: weights");
  expect_bit_equal(mb, ma, "a step after the restore at 2 ranks: first moments");
  expect_bit_equal(vb, va, "a step after the restore at 2 ranks: second moments");
  // One rank: the step's gradient is summed in another order (the file comment), one step from equal states.
  EXPECT_EQ(sa.tokens, sc.tokens);
  EXPECT_LE(rel(sc.loss, sa.loss), kLossTol);
  EXPECT_LE(rel(sc.stats.grad_norm, sa.stats.grad_norm), kGradNormTol);
  c->export_shard(pc, mc, vc);
  EXPECT_LE(rel_err_norm(pick(pc, a->segments()), pa), kWeightTol);
  world.barrier("checkpoint read by every rank");  // before rank 0 removes it
}

INSTANTIATE_TEST_SUITE_P(Moments, EngineGpuDataParallelResume,
                         // ZeRO-1 with bf16 moments rounds them to nearest here: stochastic rounding draws its
                         // bits by position in the moment buffer, which is shard order under ZeRO-1, so the
                         // one-rank ZeRO-0 comparison would differ by design (not by error).
                         testing::Values(Rounding{0, false, false}, Rounding{0, true, true},
                                         Rounding{1, false, false}, Rounding{1, true, false},
                                         Rounding{2, true, false}, Rounding{3, false, false}),
                         [](const testing::TestParamInfo<Rounding>& i) {
                           return "zero" + std::to_string(i.param.zero) + (i.param.bf16_moments ? "_bf16" : "_fp32") +
                                  (i.param.stochastic_rounding ? "_stochastic" : "");
                         });

// The multi-rank layouts of gpu-check's threads on one GPU (tests/model/ranks_test_util.h), here as MPI
// processes: each case at the world size it was written for.
class EngineGpuMpiRanks : public testing::TestWithParam<testing_util::RanksCase> {};

TEST_P(EngineGpuMpiRanks, FollowOneRankOnTheWholeBatch) {
  if (test::world().size() != GetParam().ranks) GTEST_SKIP() << "runs at " << GetParam().ranks << " ranks";
  Fixture f("llama32_tiny");
  const testing_util::OneRankRun reference(f);
  testing_util::follow_one_rank(test::world(), f, GetParam(), reference);
}

// At the 2 ranks CI runs this binary with: data parallel ZeRO-2/3, tensor parallel, with and without sequence
// parallelism, and two pipeline stages (the 4-rank cases run on threads in build/emulated_gpu_tests).
INSTANTIATE_TEST_SUITE_P(Layouts, EngineGpuMpiRanks,
                         testing::Values(testing_util::RanksCase{2, 1, 3, false, Recompute::None},
                                         testing_util::RanksCase{2, 2, 0, true, Recompute::None},
                                         testing_util::RanksCase{2, 2, 1, true, Recompute::Full},
                                         testing_util::RanksCase{2, 2, 0, true, Recompute::Selective, true},
                                         testing_util::RanksCase{2, 1, 1, true, Recompute::Selective, false, 2}),
                         [](const testing::TestParamInfo<testing_util::RanksCase>& i) {
                           return testing_util::name(i.param);
                         });

// The preference objectives over two pipeline stages as two processes (tests/engine/preference_ranks_test_util.h):
// DPO with its precomputed reference and LoRA DPO (the reference the base with the adapters off, down the stages),
// the stages' activations and gradients through the staged device comm.
class EnginePreferenceGpuMpiRanks : public testing::TestWithParam<testing_util::PreferenceRanksCase> {};

TEST_P(EnginePreferenceGpuMpiRanks, FollowOneRank) {
  if (test::world().size() != GetParam().ranks) GTEST_SKIP() << "runs at " << GetParam().ranks << " ranks";
  const testing_util::PairsOneRankRun one(GetParam().name);
  testing_util::follow_one_rank_on_pairs(test::world(), GetParam(), one);
}

INSTANTIATE_TEST_SUITE_P(Layouts, EnginePreferenceGpuMpiRanks,
                         testing::Values(testing_util::PreferenceRanksCase{"dpo_sigmoid", 2, 1, 0, false, 2},
                                         testing_util::PreferenceRanksCase{"lora_dpo_sigmoid", 2, 1, 1, false, 2}),
                         [](const testing::TestParamInfo<testing_util::PreferenceRanksCase>& i) {
                           return testing_util::name(i.param);
                         });

}  // namespace
}  // namespace tuna
