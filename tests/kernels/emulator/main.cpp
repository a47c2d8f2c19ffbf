// build/emulated_gpu_tests: the GPU tests (tests/kernels/*_gpu.cpp but matmul's, and the GPU model's
// tests/model/*_gpu.cpp) built with g++ against the host emulator of this folder, with the real launchers of
// kernels/*.cu and the GPU model (model/llama_gpu.cpp, engine/engine_gpu.cpp) compiled as C++ (-DTUNA_EMULATOR):
// the code a GPU runs, run on the host against the CPU twins, with the GPU tests' own checks and tolerances.
// cuBLASLt is replaced by a host test double of kernels/matmul.cuh (matmul_host.cpp).
// tests/kernels/test_gpu_emulated.cpp runs it in every build.
//
// One OpenMP thread: the emulator runs every kernel on this thread, and the host code around it (the CPU
// twins, the CPU model the GPU model is compared with) works on shapes of a few thousand elements, where
// worker threads only spin at every parallel region; on a busy two-core CI machine that made the model tests
// 15 times slower (10 s instead of 0.6 s for one engine test).
//
//   emulated_gpu_tests [--copies at-issue|at-wait] [--warps lockstep|in-turn] [--sms N]
//                      [--blocks in-order|reversed] [--streams in-order|concurrent] [--jitter SEED]
//                      [GoogleTest flags]
//     --copies  when asynchronous work takes effect: at its issue (the default) or as late as the hardware may
//               defer it: a cp.async at the wait that retires it (ptx.h), a TMA copy when a thread waits on its
//               mbarrier's phase, a wgmma at the wgmma.wait_group that retires it (ptx_sm90.h)
//     --warps   how the warps of a block interleave: in near lockstep (the default), or each running as far
//               ahead as it can before the next starts (emulator.h)
//     --sms     the multiprocessors the device reports (132 by default, an H100's): fewer make the persistent
//               kernels (one CTA per SM) loop over several tiles per CTA on the tests' small shapes
//     --blocks  the order a grid's blocks run in: blockIdx order (the default, what GPUs do in practice) or last
//               first; CUDA promises neither, so blocks that wait on each other must not rely on it (runtime.h)
//     --streams how streams run: each call completed before it returns (the default: fast, one order a GPU may
//               run them in), or each stream on a host thread of its own, ordered against the others only by
//               events, the legacy default stream and the host's synchronizing calls, as on a GPU (runtime.h)
//     --jitter  concurrent streams, each piece of queued work delayed a random while drawn from SEED (a seed
//               is one set of interleavings to try)
// A missing barrier (visible when one warp runs ahead) or a read of a tile before its wait (visible when data
// lands late) shows in the numbers in one mode or the other; the race check (ptx.h) flags the latter in both.
// Ends, as tests/main.cpp, with "tests: N passed, N failed, N skipped".
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdio>
#include <string>

#include "tests/kernels/emulator/runtime.h"
#include "tests/process_state.h"
#include "tests/slowest_tests.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  omp_set_num_threads(1);
  using tuna::emulator::CopyTiming;
  using tuna::emulator::Schedule;
  bool concurrent_streams = false, jitter = false;
  uint64_t jitter_seed = 0;
  const auto is_number = [](const std::string& v) {
    return !v.empty() && v.size() < 19 && v.find_first_not_of("0123456789") == std::string::npos;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i], value = i + 1 < argc ? argv[i + 1] : "";
    if (arg == "--copies" && (value == "at-issue" || value == "at-wait")) {
      tuna::emulator::g_shared.timing = value == "at-issue" ? CopyTiming::kImmediate : CopyTiming::kDeferred;
      ++i;
    } else if (arg == "--sms" && !value.empty() && value.find_first_not_of("0123456789") == std::string::npos &&
               std::stoi(value) > 0) {
      tuna::emulator::runtime().multiprocessors = std::stoi(value);
      ++i;
    } else if (arg == "--blocks" && (value == "in-order" || value == "reversed")) {
      tuna::emulator::runtime().blocks_reversed = value == "reversed";
      ++i;
    } else if (arg == "--warps" && (value == "lockstep" || value == "in-turn")) {
      tuna::emulator::block().schedule = value == "lockstep" ? Schedule::kRoundRobin : Schedule::kWarpsInTurn;
      ++i;
    } else if (arg == "--streams" && (value == "in-order" || value == "concurrent")) {
      concurrent_streams = value == "concurrent";
      ++i;
    } else if (arg == "--jitter" && is_number(value)) {
      jitter = true, jitter_seed = std::stoull(value);
      ++i;
    } else {
      std::fprintf(stderr,
                   "emulated_gpu_tests: unexpected argument '%s'\n"
                   "usage: emulated_gpu_tests [--copies at-issue|at-wait] [--warps lockstep|in-turn] [--sms N] "
                   "[--blocks in-order|reversed] [--streams in-order|concurrent] [--jitter SEED] [GoogleTest flags]\n",
                   arg.c_str());
      return 2;
    }
  }
  if (jitter && !concurrent_streams) {
    std::fprintf(stderr, "emulated_gpu_tests: --jitter delays the work of concurrent streams: add --streams concurrent\n");
    return 2;
  }
  tuna::emulator::set_stream_order(concurrent_streams, jitter, jitter_seed);
  const std::string streams = !concurrent_streams ? "in order"
                              : jitter            ? "concurrent, jitter seed " + std::to_string(jitter_seed)
                                                  : "concurrent";
  std::printf("emulated GPU: cp.async lands %s, warps %s, %d SMs, blocks %s, streams %s\n",
              tuna::emulator::g_shared.timing == CopyTiming::kImmediate ? "at issue" : "at its wait",
              tuna::emulator::block().schedule == Schedule::kRoundRobin ? "in lockstep" : "in turn",
              tuna::emulator::runtime().multiprocessors,
              tuna::emulator::runtime().blocks_reversed ? "last first" : "in blockIdx order", streams.c_str());
  const tuna::testing_util::ProcessStateGuard& guard = tuna::testing_util::guard_process_state();
  tuna::testing_util::print_slowest_tests(15);
  int rc = RUN_ALL_TESTS();
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  std::printf("tests: %d passed, %d failed, %d skipped\n", unit.successful_test_count(), unit.failed_test_count(),
              unit.skipped_test_count());
  if (guard.tests_that_changed_state() > 0) {
    std::printf("tests: %d left the process changed (see PROCESS STATE above)\n", guard.tests_that_changed_state());
    rc = rc ? rc : 1;
  }
  return rc;
}
