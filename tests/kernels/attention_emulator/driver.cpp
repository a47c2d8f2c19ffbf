// build/attention_emulator_tests: the attention kernels' device code (kernels/attention_kernels.cuh and
// kernels/attention_small_kernels.cuh, compiled by g++ as they are) run on the host emulator of emulator.h
// and ptx.h, against the CPU twin (kernels/cpu/attention.cpp) with the tolerance rule of the GPU tests:
//   err(emulated, twin) <= 2 * err(naive bf16, twin) + 1e-5        (gpu_test_util.h, attention_reference.h)
// on the same shapes as tests/kernels/test_attention_gpu.cpp: head dims 64 and 128 (tensor cores) and 8, 16,
// 32 (the plain kernels), grouped-query heads, sequence lengths that are not multiples of the 64-row tiles.
// Every ldmatrix read of shared memory is also checked for a race with an in-flight cp.async (ptx.h).
//
//   attention_emulator_tests [--quick] [--timing immediate|deferred|all] [--schedule round-robin|warps-in-turn|all]
//     --quick     the shapes tests/kernels/test_attention_emulated.cpp runs in CI (seconds, not a minute)
//     --timing    when cp.async copies land: at issue, or at their wait (ptx.h)
//     --schedule  how the warps of a block interleave: in near lockstep, or each as far ahead as it can
//                 (emulator.h)
//   Without --timing or --schedule, every combination runs, one after another.
// Prints each case's errors against their bounds, then "N cases, N failures, N blocks with races"; exits 1
// unless both counts are 0. Inputs are random (TUNA_TEST_SEED replays a run, as in the other tests).
//
// CI runs two combinations: copies at issue with warps in lockstep, and copies at their wait with warps in
// turn. Between them, a missing barrier (visible when one warp runs ahead) and a wait placed too early
// (visible when data lands late) show in the numbers, not only in the race check.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/attention_kernels.cuh"
#include "kernels/attention_small_kernels.cuh"
#include "kernels/cpu/attention.h"
#include "tests/kernels/attention_emulator/ptx.h"
#include "tests/kernels/attention_reference.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::test {
namespace {

namespace attention = tuna::cuda::attention;
namespace small_attention = tuna::cuda::small_attention;
using tuna::cuda::AttentionParams;
using tuna::emulator::CopyTiming;
using tuna::emulator::launch;
using tuna::emulator::Schedule;

unsigned blocks_for(int64_t rows, int64_t rows_per_block) {
  return static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block);
}

// The launch sequences of kernels/attention_launch.cuh and kernels/attention_small.cu, emulated: the same
// kernels with the same grids, block size and dynamic shared memory; the backward's step sizes per head dim
// as attention_bwd_hd64.cu and attention_bwd_hd128.cu choose them. Each returns its blocks with races.
template <int kHd>
int emulate_fwd(const AttentionParams& p) {
  const dim3 grid{blocks_for(p.seq_len, attention::kBlockRows), static_cast<unsigned>(p.n_heads),
                  static_cast<unsigned>(p.batch)};
  return launch(grid, attention::kThreads, attention::fwd_smem_bytes<kHd>(), [&] { attention::fwd_kernel<kHd>(p); });
}

template <int kHd, int kQueries, int kKeys>
int emulate_bwd(const AttentionParams& p) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads;
  int races = launch(dim3{blocks_for(rows, attention::kWarps), 1, 1}, attention::kThreads, 0,
                     [&] { attention::bwd_delta_kernel<kHd>(p); });
  const dim3 kv_grid{blocks_for(p.seq_len, attention::kBlockRows), static_cast<unsigned>(p.n_kv_heads),
                     static_cast<unsigned>(p.batch)};
  races += launch(kv_grid, attention::kThreads, attention::dkdv_smem_bytes<kHd, kQueries>(),
                  [&] { attention::bwd_dkdv_kernel<kHd, kQueries>(p); });
  const dim3 q_grid{blocks_for(p.seq_len, attention::kBlockRows), static_cast<unsigned>(p.n_heads),
                    static_cast<unsigned>(p.batch)};
  races += launch(q_grid, attention::kThreads, attention::dq_smem_bytes<kHd, kKeys>(),
                  [&] { attention::bwd_dq_kernel<kHd, kKeys>(p); });
  return races;
}

template <int kHd>
int emulate_small(const AttentionParams& p, bool backward) {
  const int64_t q_rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_heads;
  const int64_t kv_rows = static_cast<int64_t>(p.batch) * p.seq_len * p.n_kv_heads;
  const dim3 q_grid{blocks_for(q_rows, small_attention::kThreads), 1, 1};
  if (!backward)
    return launch(q_grid, small_attention::kThreads, 0, [&] { small_attention::small_fwd_kernel<kHd>(p); });
  const int races = launch(q_grid, small_attention::kThreads, 0, [&] { small_attention::small_dq_kernel<kHd>(p); });
  return races + launch(dim3{blocks_for(kv_rows, small_attention::kThreads), 1, 1}, small_attention::kThreads, 0,
                        [&] { small_attention::small_dkdv_kernel<kHd>(p); });
}

// As kernels/attention.cu dispatches on the head dim.
int emulate(const AttentionParams& p, int64_t head_dim, bool backward) {
  switch (head_dim) {
    case 64: return backward ? emulate_bwd<64, 64, 64>(p) : emulate_fwd<64>(p);
    case 128: return backward ? emulate_bwd<128, 32, 64>(p) : emulate_fwd<128>(p);
    case 8: return emulate_small<8>(p, backward);
    case 16: return emulate_small<16>(p, backward);
    case 32: return emulate_small<32>(p, backward);
    default: fail("no attention kernel for head_dim ", head_dim);
  }
}

// Raw bf16 bits of bf16-exact values, and back.
std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& values) {
  std::vector<__nv_bfloat16> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = __float2bfloat16_rn(values[i]);
  return bits;
}
std::vector<double> bf16_values(const std::vector<__nv_bfloat16>& bits) {
  std::vector<double> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = __bfloat162float(bits[i]);
  return values;
}

struct Tally {
  int cases = 0, failures = 0, blocks_with_races = 0;
};

// The tolerance rule of gpu_test_util.h's expect_close_to_naive, printed either way.
bool close_to_naive(const char* what, const std::vector<double>& emulated, const std::vector<double>& naive,
                    const std::vector<double>& ref, double floor = 1e-5) {
  const double err = rel_error_norm(emulated, ref), err_naive = rel_error_norm(naive, ref);
  const double bound = 2 * err_naive + floor;
  const bool ok = all_finite(emulated) && err <= bound;
  std::printf("  %-4s %-4s emulated err %.3e   naive bf16 err %.3e   bound %.3e\n", ok ? "ok" : "FAIL", what, err,
              err_naive, bound);
  return ok;
}

// One shape, as tests/kernels/test_attention_gpu.cpp's check(): the forward from q, k, v; the backward from
// the reference's out and lse (rounded as the GPU stores them), so that each is checked on its own.
void check(const AttentionShape& s, TestRng& rng, Tally& tally) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<float> q = random_bf16_values(rng, s.q_count(), -2, 2),
                           k = random_bf16_values(rng, s.kv_count(), -2, 2),
                           v = random_bf16_values(rng, s.kv_count()), dout = random_bf16_values(rng, s.q_count());
  const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()), vd(v.begin(), v.end()),
      gd(dout.begin(), dout.end());
  std::vector<double> ref_out(s.q_count()), ref_lse(s.batch * s.heads * s.seq);
  cpu::attention_fwd(ref_out.data(), ref_lse.data(), qd.data(), kd.data(), vd.data(), s.batch, s.seq, s.heads,
                     s.kv_heads, s.dim);
  std::vector<float> out_in(s.q_count()), lse_in(ref_lse.size());
  for (size_t i = 0; i < out_in.size(); ++i) out_in[i] = round_bf16(ref_out[i]);
  for (size_t i = 0; i < lse_in.size(); ++i) lse_in[i] = static_cast<float>(ref_lse[i]);
  const std::vector<double> out_in_d(out_in.begin(), out_in.end()), lse_in_d(lse_in.begin(), lse_in.end());
  std::vector<double> ref_dq(s.q_count()), ref_dk(s.kv_count()), ref_dv(s.kv_count());
  cpu::attention_bwd(ref_dq.data(), ref_dk.data(), ref_dv.data(), gd.data(), out_in_d.data(), lse_in_d.data(),
                     qd.data(), kd.data(), vd.data(), s.batch, s.seq, s.heads, s.kv_heads, s.dim);
  const NaiveAttention naive = naive_attention(s, qd, kd, vd, gd, out_in_d, lse_in_d);

  // Outputs start as NaN (bf16 0xffff, fp32 NaN) so that an element no kernel writes fails the check.
  const __nv_bfloat16 nan_bf16{0xffff};
  const std::vector<__nv_bfloat16> q_bf = to_bf16(q), k_bf = to_bf16(k), v_bf = to_bf16(v), dout_bf = to_bf16(dout),
                                   out_in_bf = to_bf16(out_in);
  std::vector<__nv_bfloat16> out(s.q_count(), nan_bf16), dq(s.q_count(), nan_bf16), dk(s.kv_count(), nan_bf16),
      dv(s.kv_count(), nan_bf16);
  std::vector<float> lse = nan_filled<float>(ref_lse.size()), delta = nan_filled<float>(ref_lse.size());

  AttentionParams p{};  // as kernels/attention.cu's make_params
  p.batch = static_cast<int>(s.batch), p.seq_len = static_cast<int>(s.seq);
  p.n_heads = static_cast<int>(s.heads), p.n_kv_heads = static_cast<int>(s.kv_heads);
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.dim)));
  p.scale_log2 = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.dim)) * 1.4426950408889634);
  p.q = q_bf.data(), p.k = k_bf.data(), p.v = v_bf.data(), p.out = out.data(), p.lse = lse.data();
  int races = emulate(p, s.dim, /*backward=*/false);
  const std::vector<double> out_d = bf16_values(out), lse_d(lse.begin(), lse.end());

  p.out = const_cast<__nv_bfloat16*>(out_in_bf.data()), p.lse = lse_in.data();
  p.dout = dout_bf.data(), p.dq = dq.data(), p.dk = dk.data(), p.dv = dv.data(), p.delta = delta.data();
  races += emulate(p, s.dim, /*backward=*/true);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(" %s (%.1f s)\n", s.describe().c_str(), seconds);
  bool ok = close_to_naive("out", out_d, naive.out, ref_out);
  ok &= close_to_naive("lse", lse_d, naive.lse, ref_lse);
  ok &= close_to_naive("dq", bf16_values(dq), naive.dq, ref_dq);
  ok &= close_to_naive("dk", bf16_values(dk), naive.dk, ref_dk);
  ok &= close_to_naive("dv", bf16_values(dv), naive.dv, ref_dv);
  if (races > 0) std::printf("  %d blocks with races\n", races);
  std::fflush(stdout);
  tally.cases += 1;
  tally.failures += !ok;
  tally.blocks_with_races += races;
}

// The shapes of tests/kernels/test_attention_gpu.cpp; --quick leaves out its longest (seq 257, 8 s a run here).
void run_cases(bool quick, TestRng& rng, Tally& tally) {
  // Head dim 64: two query blocks, the second partial; GQA groups of 2; 64-query dK/dV steps.
  check({2, 100 + rng.integer(0, 27), 4, 2, 64}, rng, tally);
  check({1, 1, 2, 1, 64}, rng, tally);   // one row: the tiles lie almost wholly past the sequence
  check({1, 64, 3, 3, 64}, rng, tally);  // exactly one tile, no GQA
  // Head dim 128: three blocks, one kv head for four query heads; 32-query dK/dV steps.
  check({2, 150 + rng.integer(0, 27), 4, 1, 128}, rng, tally);
  check({1, 33, 2, 2, 128}, rng, tally);
  // The plain kernels of the tiny models.
  check({2, 37, 4, 2, 8}, rng, tally);
  check({1, 20, 2, 1, 16}, rng, tally);
  check({1, 45, 3, 1, 32}, rng, tally);
  if (quick) return;
  check({1, 257, 8, 2, 128}, rng, tally);
  check({2, 127, 4, 4, 64}, rng, tally);
  check({1, 96, 4, 2, 128}, rng, tally);
  check({1, 193, 2, 2, 128}, rng, tally);
}

const char* describe(CopyTiming timing) {
  return timing == CopyTiming::kImmediate ? "cp.async lands at issue" : "cp.async lands at its wait";
}
const char* describe(Schedule schedule) {
  return schedule == Schedule::kRoundRobin ? "warps in lockstep (round-robin)" : "warps in turn";
}

constexpr const char* kUsage =
    "usage: attention_emulator_tests [--quick] [--timing immediate|deferred|all] "
    "[--schedule round-robin|warps-in-turn|all]";

int run(int argc, char** argv) {
  bool quick = false;
  std::vector<CopyTiming> timings{CopyTiming::kImmediate, CopyTiming::kDeferred};
  std::vector<Schedule> schedules{Schedule::kRoundRobin, Schedule::kWarpsInTurn};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string value = i + 1 < argc ? argv[i + 1] : "";
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--timing" && (value == "immediate" || value == "deferred" || value == "all")) {
      if (value == "immediate") timings = {CopyTiming::kImmediate};
      if (value == "deferred") timings = {CopyTiming::kDeferred};
      ++i;
    } else if (arg == "--schedule" && (value == "round-robin" || value == "warps-in-turn" || value == "all")) {
      if (value == "round-robin") schedules = {Schedule::kRoundRobin};
      if (value == "warps-in-turn") schedules = {Schedule::kWarpsInTurn};
      ++i;
    } else {
      fail("unexpected argument '", arg, "'; ", kUsage);
    }
  }
  TestRng rng;
  std::printf("attention emulator: inputs from %s\n", rng.describe().c_str());
  Tally tally;
  for (CopyTiming timing : timings)
    for (Schedule schedule : schedules) {
      tuna::emulator::g_shared.timing = timing;
      tuna::emulator::block().schedule = schedule;
      std::printf("%s, %s\n", describe(timing), describe(schedule));
      run_cases(quick, rng, tally);
    }
  std::printf("attention emulator: %d cases, %d failures, %d blocks with races\n", tally.cases, tally.failures,
              tally.blocks_with_races);
  return tally.failures == 0 && tally.blocks_with_races == 0 ? 0 : 1;
}

}  // namespace
}  // namespace tuna::test

int main(int argc, char** argv) {
  try {
    return tuna::test::run(argc, argv);
  } catch (const tuna::Error& e) {
    std::fflush(stdout);  // the cases before the error first, in a log that holds both streams
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
