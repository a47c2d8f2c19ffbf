// Several ranks of the CUDA engine against one rank: the check that runs on threads sharing one device
// (tests/engine/test_engine_gpu.cpp, on a GPU in gpu-check and on the emulator in CI) and under mpirun on the
// emulator (tests/mpi/test_engine_gpu_emulated.cpp). The ranks split a batch of 4 rows (dp rank r trains rows
// r*4/dp ..; the tp ranks of a dp rank the same rows) and must follow one rank that trains all 4 rows at ZeRO-0,
// step by step: the same token count, the loss and gradient norm within the bound below, and at the end each
// rank's master weights within the bound of the one rank's (its block of them, its ZeRO pieces).
// Sequence parallelism (RanksCase::sp) sums the same bf16 partial products per row as tp alone (each rank adds the
// residual of its own rows instead of rank 0 adding every row's), so it is held to the same tp bounds.
// Pipeline stages (RanksCase::pp) run a dp rank's rows as micro-batches of one row each through the stages in the
// 1F1B order (so a step of 4 micro-batches at pp 2 has warm-up, steady state and cool-down): the stages pass the
// bf16 activations the one rank keeps, so they change only the fp32 order of the gradient sums (micro-batches
// added in turn, a tied table's two gradients added after the backwards) and are held to the dp bounds.
//
// The bound. Data parallel ranks compute exactly the one rank's function; what differs is arithmetic order: each
// rank's weight gradients sum its own rows in the GEMM and the reduce-scatter adds the ranks' sums (fp32 order),
// and on a GPU, cuBLASLt may pick another algorithm for a GEMM of 16 rows than for one of 64, which can move a
// bf16 activation by one rounding (2^-8 relative) here and there. The loss is a mean over ~60 tokens of such
// values, and Adam's update is close to sign(m): a difference in the last bits of a gradient moves the weights by
// far less than one bf16 step, so after 3 steps the losses agree to ~1e-3 (1e-2 allowed, the bf16 tolerance of
// the GPU model's tests); on the emulator, whose GEMM double computes each row alike whatever the row count,
// only the fp32 order differs: 1e-6 (measured: the loss bit-equal, as the mpirun test measured first).
// Tensor parallelism changes the arithmetic itself: each rank rounds its partial product of a row-parallel GEMM
// (o_proj, down_proj, the lm_head's input gradient, the column-parallel input gradients) to bf16 before the
// all-reduce adds them, one more bf16 rounding (2^-9 relative) of those activations than one rank makes.
// Measured on the emulator at tp 2: the loss 2.4e-4 relative from the one rank's at step 0, the final weights
// 9e-4 (error norm). Bounds 5e-3 on the loss and the weights, 2e-2 on the gradient norm. A wrong reduction, a
// missing or doubled unit, a gather of the wrong buffer, a missing all-reduce or a residual added on every tp
// rank moves the loss by percents at step 1.
// Beyond tp 2 on NCCL (GPUs), the tp all-reduce and sequence parallelism's reduce-scatter of bf16 activations round
// the partial sum at each of the tp - 1 steps of NCCL's ring (comm/comm_nccl.cpp), where the staged comm (one GPU,
// the emulator) sums in fp32 and rounds once: up to tp - 1 roundings of 2^-9 where tp 2 has one. The tp bounds scale
// with them (tp_bound): tp 4 holds 3 times tp 2's.
#pragma once

#if TUNA_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "engine/engine.h"
#include "model/layout.h"
#include "tests/engine/engine_test_util.h"

namespace tuna::testing_util {

#ifdef TUNA_EMULATOR
constexpr double kRanksLossTol = 1e-6, kRanksNormTol = 1e-6, kRanksWeightTol = 1e-6;
#else
constexpr double kRanksLossTol = 1e-2, kRanksNormTol = 2e-2, kRanksWeightTol = 1e-2;
#endif
constexpr double kTpLossTol = 5e-3, kTpNormTol = 2e-2, kTpWeightTol = 5e-3;
// A tp bound above (measured at tp 2) at `tp` ranks: once per bf16 rounding NCCL's ring makes, tp - 1.
inline double tp_bound(double tp2_bound, int tp) { return tp2_bound * std::max(1, tp - 1); }

struct RanksCase {
  int ranks, tp, zero;
  bool prefetch;
  Recompute recompute;
  bool sp = false;  // sequence parallelism over the tp ranks
  int pp = 1;       // pipeline stages
};

// The layouts gpu-check and CI check: ZeRO-2, ZeRO-3 with and without prefetch, full and selective recompute,
// TP 2, and TP 2 x ZeRO-3 over dp 2, at 2 and 4 ranks.
inline const std::vector<RanksCase> kRanksCases = {
    {2, 1, 0, true, Recompute::None},      {2, 1, 2, true, Recompute::None}, {2, 1, 3, true, Recompute::None},
    {2, 1, 3, false, Recompute::None},     {4, 1, 3, true, Recompute::Full}, {4, 1, 2, true, Recompute::Selective},
    {2, 2, 0, true, Recompute::None},      {2, 2, 1, true, Recompute::Full}, {4, 2, 3, true, Recompute::None}};

inline std::string name(const RanksCase& c) {
  return std::to_string(c.ranks) + "ranks_tp" + std::to_string(c.tp) + "_zero" + std::to_string(c.zero) +
         (c.prefetch ? "" : "_no_prefetch") + "_recompute_" + recompute_name(c.recompute) + (c.sp ? "_sp" : "") +
         (c.pp > 1 ? "_pp" + std::to_string(c.pp) : "");
}

// 4 rows of 16 tokens over the fixture's vocabulary, targets the next token (the last ignored), each row packing
// documents (the loader's positions): row r holds documents of 5 + r, 1 and 10 - r tokens, so every layout runs
// with the engine's default document mask and restarted positions at work.
struct FourRows {
  static constexpr int64_t kRows = 4, kSeq = 16;
  std::vector<int32_t> inputs, targets, positions;
  explicit FourRows(int64_t vocab) : inputs(kRows * kSeq), targets(kRows * kSeq) {
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int32_t& t : inputs) x ^= x << 13, x ^= x >> 7, x ^= x << 17, t = static_cast<int32_t>(x % vocab);
    for (int64_t i = 0; i < kRows * kSeq; i++) targets[i] = (i + 1) % kSeq == 0 ? -100 : inputs[i + 1];
    for (int64_t r = 0; r < kRows; r++)
      for (int64_t n : {5 + r, int64_t{1}, 10 - r})
        for (int64_t i = 0; i < n; i++) positions.push_back(static_cast<int32_t>(i));
  }
};

constexpr int64_t kRanksSteps = 3;

inline EngineOptions rows_options(const Fixture& f, int zero, int64_t rows) {
  EngineOptions o = engine_options(f, Device::Cuda, zero);
  o.micro_batch = rows, o.seq_len = FourRows::kSeq;
  return o;
}

inline StepResult rows_step(Engine& e, const Fixture& f, const FourRows& data, int64_t first_row, int64_t rows,
                            int64_t s) {
  e.begin_step();
  const LossSum l = e.forward_backward(data.inputs.data() + first_row * FourRows::kSeq,
                                       data.targets.data() + first_row * FourRows::kSeq, rows, FourRows::kSeq,
                                       data.positions.data() + first_row * FourRows::kSeq);
  return e.finish_step(l, learning_rate(f.optimizer(), s, 10));
}

// The same rows as micro-batches of one row each (Engine::forward_backward_step: a pipeline's 1F1B order).
inline StepResult row_micro_batches_step(Engine& e, const Fixture& f, const FourRows& data, int64_t first_row,
                                         int64_t rows, int64_t s) {
  std::vector<MicroBatch> micro_batches;
  for (int64_t r = first_row; r < first_row + rows; r++) {
    const int64_t at = r * FourRows::kSeq;
    micro_batches.push_back({data.inputs.data() + at, data.targets.data() + at, data.positions.data() + at, 1,
                             FourRows::kSeq});
  }
  e.begin_step();
  const LossSum l = e.forward_backward_step(micro_batches);
  return e.finish_step(l, learning_rate(f.optimizer(), s, 10));
}

// One rank, ZeRO-0, all 4 rows: each step's result and the final master weights (ParamLayout order).
struct OneRankRun {
  FourRows data;
  std::vector<StepResult> steps;
  std::vector<float> weights;
  explicit OneRankRun(const Fixture& f) : data(f.config.vocab_size) {
    SingleRank one;
    std::unique_ptr<Engine> e = make_engine(f.config, rows_options(f, 0, FourRows::kRows), one.mesh, fixture_weights(f));
    for (int64_t s = 0; s < kRanksSteps; s++) steps.push_back(rows_step(*e, f, data, 0, FourRows::kRows, s));
    std::vector<float> m, v;
    e->export_shard(weights, m, v);
  }
};

// The device comms of ranks sharing one device: with ranks as threads the stages' sends and receives over the
// loopback comm (device copies ordered by the pipeline's events, as NCCL's are); the dp and tp collectives, and
// everything of ranks as processes (mpirun), staged through the host comms of the mesh.
inline DeviceCommFactory one_device_comms(const Mesh& mesh) {
  return [&mesh](Comm& group, void* stream) {
    if (&group == mesh.pp.get() && group.backend() == "threads")
      return make_loopback_device_comm(group.split(0, group.rank()), stream, 120);
    return make_staged_device_comm(group.split(0, group.rank()), stream);
  };
}

// This rank of `world` (one of c.ranks) trains its rows with the case's layout and checks them against the run
// of one rank, over the device comms above.
inline void follow_one_rank(Comm& world, const Fixture& f, const RanksCase& c, const OneRankRun& one) {
  const double loss_tol = c.tp > 1 ? std::max(tp_bound(kTpLossTol, c.tp), kRanksLossTol) : kRanksLossTol;
  const double norm_tol = c.tp > 1 ? std::max(tp_bound(kTpNormTol, c.tp), kRanksNormTol) : kRanksNormTol;
  const double weight_tol = c.tp > 1 ? std::max(tp_bound(kTpWeightTol, c.tp), kRanksWeightTol) : kRanksWeightTol;
  Mesh mesh = make_mesh(world, c.tp, c.pp);
  const DeviceCommFactory device_comm = one_device_comms(mesh);
  const int64_t rows = FourRows::kRows / mesh.dp_size;
  EngineOptions o = rows_options(f, c.zero, c.pp > 1 ? 1 : rows);
  o.zero_prefetch = c.prefetch, o.recompute = c.recompute, o.sp = c.sp;
  std::unique_ptr<Engine> e = make_engine(f.config, o, mesh, fixture_weights(f), device_comm);
  for (int64_t s = 0; s < kRanksSteps; s++) {
    const StepResult r = c.pp > 1 ? row_micro_batches_step(*e, f, one.data, mesh.dp_rank * rows, rows, s)
                                  : rows_step(*e, f, one.data, mesh.dp_rank * rows, rows, s);
    const StepResult& want = one.steps[s];
    if (world.rank() == 0)
      std::printf("  step %lld  loss 1 rank %.7f %d ranks %.7f   grad norm %.6f %.6f\n", static_cast<long long>(s),
                  want.loss, c.ranks, r.loss, want.stats.grad_norm, r.stats.grad_norm);
    EXPECT_EQ(r.tokens, want.tokens);
    EXPECT_NEAR(r.loss, want.loss, loss_tol * want.loss) << "step " << s;
    EXPECT_NEAR(r.stats.grad_norm, want.stats.grad_norm, norm_tol * want.stats.grad_norm) << "step " << s;
  }
  std::vector<float> p, m, v;
  e->export_shard(p, m, v);
  // The one rank's weights in this rank's tensor-parallel layout (its block of every split tensor), then its
  // ZeRO pieces of them.
  const ParamLayout whole_layout(f.config);
  EXPECT_LE(shard_error_against_whole(*e, whole_layout, one.weights.data()), weight_tol)
      << "rank " << world.rank() << "'s final master weights";
  // The replicated tensors (the norm weights) are one tensor kept on every tp rank: their gradients, and so their
  // weights, must agree bit for bit over the tp group. A norm gradient left partial (each rank's rows' share, as
  // sequence parallelism computes it before the sum) moves them apart while the loss and the whole weights'
  // error above hardly notice it (Adam's update is near sign(m)).
  if (c.tp > 1) {
    std::vector<float> replicated;
    int64_t at = 0;  // where each segment starts in p
    for (const Segment& seg : e->segments()) {
      for (const ParamTensor& t : e->layout().tensors()) {
        if (t.split_dim >= 0) continue;
        const int64_t begin = std::max(t.offset, seg.begin), end = std::min(t.offset + t.numel, seg.begin + seg.size);
        for (int64_t i = begin; i < end; i++) replicated.push_back(p[at + i - seg.begin]);
      }
      at += seg.size;
    }
    int64_t counts[2] = {static_cast<int64_t>(replicated.size()), -static_cast<int64_t>(replicated.size())};
    mesh.tp->all_reduce(counts, 2, CommType::I64, ReduceOp::Max, "test replicated count");
    // (A dp rank's ZeRO pieces may hold none; the other dp ranks' then do.)
    ASSERT_EQ(counts[0], -counts[1]) << "tp ranks hold different counts of replicated weights";
    std::vector<float> high = replicated, low(replicated.size());
    for (size_t i = 0; i < replicated.size(); i++) low[i] = -replicated[i];
    mesh.tp->all_reduce_max(high.data(), static_cast<int64_t>(high.size()), "test replicated max");
    mesh.tp->all_reduce_max(low.data(), static_cast<int64_t>(low.size()), "test replicated min");
    int64_t differ = 0;
    for (size_t i = 0; i < replicated.size(); i++) differ += high[i] != -low[i];
    EXPECT_EQ(differ, 0) << "of " << replicated.size() << " replicated weights (norms) differ over the tp ranks (rank "
                         << world.rank() << ")";
  }
}

}  // namespace tuna::testing_util

#endif  // TUNA_CUDA
