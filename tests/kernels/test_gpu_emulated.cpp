// The GPU tests on the host emulator (build/emulated_gpu_tests, from tests/kernels/emulator): every build runs
// tests/kernels/*_gpu.cpp (but matmul's, which needs cuBLASLt) through the real launchers of kernels/*.cu and
// the kernels' own device code, compiled with g++ against an emulated CUDA runtime, with the GPU tests' own
// checks and tolerances against the CPU twins; and the GPU model's tests (tests/model/*_gpu.cpp: LlamaGpu and
// the CUDA engine against the transformers fixtures and the CPU model), which run model/llama_gpu.cpp and
// engine/engine_gpu.cpp on those kernels, with a host test double standing in for cuBLASLt
// (emulator/matmul_host.cpp). A GPU is not needed; on a GPU machine the same tests also run for real in the
// tuna_tests binary.
//
// Two runs at opposite ends of what the hardware may do (see emulator/main.cpp): cp.async data (and TMA copies,
// and wgmma results) landing at issue with the warps in near lockstep, and landing as late as allowed with each
// warp running ahead (and 3 SMs, so that the persistent attention forward loops over tiles, and the blocks of
// each grid last first, which CUDA allows as much as blockIdx order: the hopper attention backward's blocks wait
// on each other, so they must not rely on the order they were dispatched in). A read too
// early or a missing barrier shows as wrong numbers in one or the other, and a read of a tile that a cp.async
// may still be writing fails the launch in both (the race check of emulator/ptx.h). The model tests run in the
// first only: what they add to the op tests is the orchestration (the arena plan, op order, accumulate flags,
// checkpoint exchange), which does not depend on how the warps of a kernel interleave.
//
// A third run has streams out of order (each stream on a thread of its own, random delays drawn from a seed), over
// the tests whose streams order each other, under three seeds.
//
// The CUDA engine's data-parallel code (engine/engine_gpu.cpp at dp > 1: the gradient all-reduce, the
// checkpoint restore that gathers each unit on the device) runs in a fourth binary, build/emulated_gpu_mpi_tests
// (tests/mpi/*_emulated.cpp), under `mpirun -np 2`, with an MpiComm standing in for NCCL.
#include <gtest/gtest.h>

#include <cstdio>
#include <regex>
#include <string>

#include "tests/dist/dist_test_util.h"  // mpirun
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::run_command;
using testing_util::TempDir;

// `command` exits 0 and its closing line ("tests: N passed, N failed, N skipped", or under mpirun rank 0's
// "mpi tests (rank 0): N passed, ...") says every test ran (none skipped for want of a device or of ranks)
// and none failed.
void expect_all_ran_and_passed(const std::string& command) {
  TempDir tmp("gpu_emulated");
  const auto r = run_command(command, tmp / "log");
  std::printf("%s", r.output.c_str());  // each check's error against its bound, as on a GPU
  EXPECT_EQ(r.exit_code, 0) << "see the emulated tests' output above";
  std::smatch counts;
  ASSERT_TRUE(std::regex_search(r.output, counts, std::regex("tests.*: (\\d+) passed, (\\d+) failed, (\\d+) skipped")))
      << "no closing line in the emulated tests' output above";
  EXPECT_GT(std::stoi(counts[1]), 0);
  EXPECT_EQ(counts[2], "0");
  EXPECT_EQ(counts[3], "0");
}

void run_emulated(const std::string& options) {
  expect_all_ran_and_passed(testing_util::build_dir() + "/emulated_gpu_tests " + options);
}

TEST(GpuTestsEmulated, CopiesLandAtIssueWarpsInLockstep) { run_emulated("--copies at-issue --warps lockstep"); }

// Also with 3 SMs (the persistent attention forward then runs several tiles per CTA), and blocks last first.
TEST(GpuTestsEmulated, CopiesLandAtTheirWaitWarpsInTurn) {
  run_emulated("--copies at-wait --warps in-turn --sms 3 --blocks reversed --gtest_filter=-*LlamaGpu*:*EngineGpu*");
}

// Streams run out of order, as a GPU may run them (emulator/runtime.h, --streams concurrent): each stream's work on
// a host thread of its own, ordered against the others only by events, the legacy default stream and the host's
// waits, each piece delayed a random while drawn from the seed. The tests whose streams order each other must give,
// under every seed, what they give in order (bit for bit where they compare bits): the pipeline's transfers and
// passes (pp 2 and 3, tied, LoRA with dropout, nf4, tp with sp, preference pairs, over the loopback comm, whose
// copies only events order), ZeRO-2/3's reduce-scatters and gathers on the comm stream (the preference objectives'
// passes too), the frozen base's prefetch, the device comms. A missing cudaStreamWaitEvent in the pipeline step or
// the ZeRO-3 prefetch fails one of them.
const char* const kStreamOrderTests =
    "Layouts/EngineGpuPipeline.*:Stages/EngineGpuPipelineLoopback.*:EngineGpuPipelineLinks.*:"
    "EngineGpuPipelineCheckpoint.*:Modes/EngineGpuStages.*zero2*:Modes/EngineGpuStages.*zero3*:"
    "Layouts/EngineGpuThreadRanks.*zero2*:Layouts/EngineGpuThreadRanks.*zero3*:Modes/EngineLoraGpuStages.*:"
    "Layouts/EngineLoraGpuRanks.*zero3:Layouts/EngineLoraGpuPipeline.*:CommLoopbackGpu.*:CommStagedGpu.*:"
    "Layouts/EnginePreferenceGpuRanks.*zero2*:Layouts/EnginePreferenceGpuRanks.*zero3*:EnginePreferenceGpuZero.*:"
    "Layouts/EnginePreferenceGpuRanks.*pp2*";

class GpuTestsEmulatedStreams : public testing::TestWithParam<int> {};

TEST_P(GpuTestsEmulatedStreams, OutOfOrderWithJitter) {
  run_emulated("--streams concurrent --jitter " + std::to_string(GetParam()) + " --gtest_filter=" + kStreamOrderTests);
}

INSTANTIATE_TEST_SUITE_P(Seeds, GpuTestsEmulatedStreams, testing::Values(1, 2, 3),
                         [](const testing::TestParamInfo<int>& i) { return "seed" + std::to_string(i.param); });

// The engine at dp = 2 against one rank, and its sharded checkpoint restored at 2 ranks and at 1
// (tests/mpi/test_engine_gpu_emulated.cpp).
TEST(GpuTestsEmulated, DataParallelEngineOnTwoRanks) {
  expect_all_ran_and_passed(testing_util::mpirun(2) + testing_util::build_dir() + "/emulated_gpu_mpi_tests");
}

}  // namespace
}  // namespace tuna
