// A rank that dies or hangs mid-step stops the whole job, within --comm_timeout, with an error naming the
// rank and the collective (comm/comm_mpi.cpp). The fault is injected by build/train itself (TUNA_FAULT, see
// comm/comm.h) after the rank's backward of step 3, so the others are already waiting in the step's first
// collective.
#include <gtest/gtest.h>

#include <chrono>

#include "tests/dist/dist_test_util.h"

namespace tuna {
namespace {

using testing_util::mpirun;
using testing_util::run_command;
using testing_util::TempDir;

using Clock = std::chrono::steady_clock;

const std::string kTrain = testing_util::build_dir() + "/train";

struct Outcome {
  testing_util::RunResult result;
  double seconds;
};

// Trains on np ranks with TUNA_FAULT=fault and --comm_timeout timeout_s (extra: more options, a model among them).
Outcome run_with_fault(int np, const std::string& fault, int timeout_s,
                       const std::string& extra = " --model_config tests/fixtures/llama32_tiny/config.json") {
  TempDir tmp("fault");
  testing_util::write_test_shards(tmp / "data");
  const std::string flags = extra + " --train_data '" +
                            (tmp / "data" / "train-*.bin").string() +
                            "' --seq_len 16 --micro_batch 1 --steps 1000 --ckpt_every 0 --log_every 1000 --threads 1 --device cpu"
                            " --comm_timeout " + std::to_string(timeout_s) + " --out_dir " + (tmp / "run").string();
  const auto start = Clock::now();
  auto r = run_command("TUNA_FAULT=" + fault + " " + mpirun(np) + kTrain + flags, tmp / "log");
  return {r, std::chrono::duration<double>(Clock::now() - start).count()};
}

TEST(DistFailure, AKilledRankStopsTheJob) {
  Outcome o = run_with_fault(2, "kill:1:3", 10);
  EXPECT_NE(o.result.exit_code, 0) << o.result.output;
  EXPECT_LT(o.seconds, 10.0) << o.result.output;
  // mpirun names the dead rank; the survivor names the collective it was left waiting in.
  EXPECT_NE(o.result.output.find("rank 1"), std::string::npos) << o.result.output;
  EXPECT_NE(o.result.output.find("rank 0: signal while waiting in all_reduce 'loss and token count'"), std::string::npos)
      << o.result.output;
}

TEST(DistFailure, AHungRankStopsTheJobWithinTheTimeout) {
  const int timeout_s = 3;
  Outcome o = run_with_fault(2, "hang:1:3", timeout_s);
  EXPECT_NE(o.result.exit_code, 0) << o.result.output;
  // The timeout, up to 5 s of asking the other ranks, and mpirun's teardown.
  EXPECT_LT(o.seconds, timeout_s + 10.0) << o.result.output;
  EXPECT_NE(o.result.output.find("error: rank 0: all_reduce 'loss and token count'"), std::string::npos) << o.result.output;
  EXPECT_NE(o.result.output.find("did not complete within 3 s (--comm_timeout): rank(s) 1 did not answer"),
            std::string::npos)
      << o.result.output;
}

// Pipeline stages (--pp 2): stage 0 hangs before its send of step 2's activations (its 3rd send or recv: a step is
// one send and one recv at grad_accum 1). Stage 1 stops the job within the timeout, naming itself, the recv it waited
// in (the stage and what it expected from which stage) and the hung rank.
TEST(DistFailure, AHungStageStopsTheJobNamingTheRecv) {
  const int timeout_s = 3;
  Outcome o = run_with_fault(2, "hang_p2p:0:3", timeout_s, " --model_config tests/fixtures/llama2_tiny/config.json --pp 2");
  EXPECT_NE(o.result.exit_code, 0) << o.result.output;
  EXPECT_LT(o.seconds, timeout_s + 10.0) << o.result.output;
  EXPECT_NE(o.result.output.find("TUNA_FAULT: rank 0 hangs at send/recv #3"), std::string::npos) << o.result.output;
  EXPECT_NE(o.result.output.find("error: rank 1: recv 'stage 1: activations from stage 0' (1024 elements from rank 0)"),
            std::string::npos)
      << o.result.output;
  EXPECT_NE(o.result.output.find("did not complete within 3 s (--comm_timeout): rank(s) 0 did not answer"),
            std::string::npos)
      << o.result.output;
}

// The last stage dies before it sends step 1's input gradient back: the job stops well within the timeout, and
// mpirun names the dead rank.
TEST(DistFailure, ADeadStageStopsTheJob) {
  const int timeout_s = 10;
  Outcome o = run_with_fault(2, "kill_p2p:1:2", timeout_s, " --model_config tests/fixtures/llama2_tiny/config.json --pp 2");
  EXPECT_NE(o.result.exit_code, 0) << o.result.output;
  EXPECT_LT(o.seconds, timeout_s + 10.0) << o.result.output;
  EXPECT_NE(o.result.output.find("TUNA_FAULT: rank 1 dies at send/recv #2"), std::string::npos) << o.result.output;
  EXPECT_NE(o.result.output.find("process rank 1"), std::string::npos) << o.result.output;  // mpirun's notice
}

}  // namespace
}  // namespace tuna
