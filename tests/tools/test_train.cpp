// build/train end to end on the CPU: 20 steps straight equal 10 steps + resume + 10 steps, bit for bit
// (weights, optimizer state and every logged loss), and bad options fail with a message naming them. The run
// directory's rules: an earlier run is continued, replaced or refused; a stopped run exits 75.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "data/shard.h"
#include "model/engine.h"  // resolve_device
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kTrain = testing_util::build_dir() + "/train";

// Training rows ("loss") of metrics.jsonl, duplicates included.
int64_t loss_rows(const fs::path& metrics) {
  std::istringstream in(read_file(metrics));
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) n += nlohmann::json::parse(line).contains("loss");
  return n;
}

// step -> loss line (the last one logged for the step) from metrics.jsonl.
std::map<int64_t, std::string> losses(const fs::path& metrics) {
  std::map<int64_t, std::string> out;
  std::istringstream in(read_file(metrics));
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j["step"]] = j["loss"].dump();
  }
  return out;
}

std::string common_flags(const fs::path& data, const std::string& device = "cpu") {
  return " --model_config tests/fixtures/llama32_tiny/config.json --train_data '" + (data / "train-*.bin").string() + "'" +
         " --val_data " + (data / "val-00000.bin").string() +
         " --seq_len 16 --micro_batch 2 --grad_accum 2 --steps 20 --lr 3e-3 --warmup_steps 3 --ckpt_every 5"
         " --ckpt_keep 2 --val_every 5 --threads 2 --seed 11 --device " + device;
}

TEST(Train, ResumeContinuesBitForBit) {
  TempDir tmp("train");
  testing_util::write_test_shards(tmp / "data");
  const std::string flags = common_flags(tmp / "data");

  auto r = run_command(kTrain + flags + " --out_dir " + (tmp / "straight").string(), tmp / "log_a");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Stopped before --steps: exit code 75 (EX_TEMPFAIL), which job scripts requeue on.
  r = run_command(kTrain + flags + " --out_dir " + (tmp / "split").string() + " --stop_at_step 10", tmp / "log_b");
  ASSERT_EQ(r.exit_code, 75) << r.output;
  EXPECT_NE(r.output.find("stopped at step 10 of 20 (--stop_at_step)"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "split" / "ckpt" / "step_00000010"));
  EXPECT_FALSE(fs::exists(tmp / "split" / "ckpt" / "step_00000020"));
  // As if the job had been killed after logging step 10 but before its checkpoint: the newest checkpoint is
  // step 5, and metrics.jsonl holds rows up to step 10. The resume drops rows 6-10 (into a backup) and logs
  // them again, so metrics.jsonl ends with each step once.
  fs::remove_all(tmp / "split" / "ckpt" / "step_00000010");
  r = run_command(kTrain + flags + " --out_dir " + (tmp / "split").string() + " --resume", tmp / "log_c");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + (tmp / "split" / "ckpt" / "step_00000005").string()), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("kept the 7 rows up to step 5, dropped 6 logged after it"), std::string::npos) << r.output;
  const fs::path backup = tmp / "split" / "metrics.before_resume_step_00000005.jsonl";
  ASSERT_TRUE(fs::exists(backup));
  EXPECT_EQ(loss_rows(backup), 10);
  EXPECT_EQ(loss_rows(tmp / "split" / "metrics.jsonl"), 20);
  EXPECT_EQ(fs::read_symlink(tmp / "split" / "ckpt" / "latest"), fs::path("step_00000020"));

  const fs::path a = tmp / "straight" / "ckpt" / "step_00000020", b = tmp / "split" / "ckpt" / "step_00000020";
  EXPECT_EQ(read_file(a / "model.safetensors"), read_file(b / "model.safetensors"));
  EXPECT_EQ(read_file(a / "optimizer.safetensors"), read_file(b / "optimizer.safetensors"));
  auto la = losses(tmp / "straight" / "metrics.jsonl"), lb = losses(tmp / "split" / "metrics.jsonl");
  ASSERT_EQ(la.size(), 20u);
  ASSERT_EQ(lb.size(), 20u);
  EXPECT_EQ(la, lb);
  // The repetitive stream is learnable: the loss falls well below ln(128) = 4.85.
  EXPECT_LT(std::stod(la[20]), std::stod(la[1]) - 0.5);
  // keep 2: only the newest two checkpoints remain.
  EXPECT_FALSE(fs::exists(tmp / "straight" / "ckpt" / "step_00000010"));
  EXPECT_TRUE(fs::exists(tmp / "straight" / "ckpt" / "step_00000015"));
}

TEST(Train, BadOptionsAndInputsFailClearly) {
  TempDir tmp("trainbad");
  testing_util::write_test_shards(tmp / "data");
  const std::string flags = common_flags(tmp / "data") + " --out_dir " + (tmp / "run").string();
  auto r = run_command(kTrain + flags + " --micro_bacth 2", tmp / "log1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("unknown option 'micro_bacth'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("did you mean 'micro_batch'"), std::string::npos) << r.output;

  r = run_command(kTrain + flags + " --lr fast", tmp / "log2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("'lr': expected a number, found 'fast'"), std::string::npos) << r.output;

  std::ofstream(tmp / "bad.toml") << "seq_len = 16\nlr = [1, 2]\n";
  r = run_command(kTrain + flags + " --config " + (tmp / "bad.toml").string(), tmp / "log3");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("bad.toml:2"), std::string::npos) << r.output;

  // A model whose vocabulary is smaller than the shards' is refused before training.
  nlohmann::json cfg = nlohmann::json::parse(read_file("tests/fixtures/llama32_tiny/config.json"));
  cfg["vocab_size"] = 64;
  std::ofstream(tmp / "small.json") << cfg.dump();
  r = run_command(kTrain + flags + " --model_config " + (tmp / "small.json").string(), tmp / "log4");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("128"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("64"), std::string::npos) << r.output;

  // Windows longer than the model's positions (llama2_tiny: 256), refused before any work.
  r = run_command(kTrain + flags + " --model_config tests/fixtures/llama2_tiny/config.json --seq_len 300", tmp / "log5");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("option 'seq_len': 300 tokens is more than the model's max_position_embeddings 256 "
                          "(tests/fixtures/llama2_tiny/config.json)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("raise max_position_embeddings"), std::string::npos) << r.output;

  // A checkpoint directory that cannot be written is found at start, before the first step.
  fs::create_directories(tmp / "blocked");
  std::ofstream(tmp / "blocked" / "ckpt") << "a file where the checkpoints would go";
  r = run_command(kTrain + common_flags(tmp / "data") + " --out_dir " + (tmp / "blocked").string(), tmp / "log6");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("cannot create the checkpoint directory"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step      1/"), std::string::npos) << r.output;
}

// An out_dir that holds a run is continued (--resume), replaced (--overwrite) or refused; --resume with nothing
// to resume fails unless it is --resume auto. Directories as data give their own split; flags take dashes.
TEST(Train, AnEarlierRunIsContinuedReplacedOrRefused) {
  TempDir tmp("trainrundir");
  testing_util::write_test_shards(tmp / "data");
  const std::string data = (tmp / "data").string(), out = (tmp / "run").string();
  const std::string flags = " --model-config tests/fixtures/llama32_tiny/config.json --train-data " + data +
                            " --val-data " + data + " --seq-len 16 --micro-batch 2 --lr 3e-3 --threads 2 --device cpu" +
                            " --out-dir " + out;
  auto r = run_command(kTrain + flags + " --steps 2", tmp / "log1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("in 2 shard(s)"), std::string::npos) << r.output;  // train-0000{0,1}, not val-00000
  EXPECT_NE(r.output.find("| 496 tokens"), std::string::npos) << r.output;  // val-00000 only: 31 windows x 16

  r = run_command(kTrain + flags + " --steps 2", tmp / "log2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(out + " holds an earlier run (metrics.jsonl with 4 rows, 1 checkpoint up to step 2)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(loss_rows(tmp / "run" / "metrics.jsonl"), 2);  // untouched

  r = run_command(kTrain + flags + " --steps 2 --overwrite", tmp / "log3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--overwrite: deleted the earlier run"), std::string::npos) << r.output;
  EXPECT_EQ(loss_rows(tmp / "run" / "metrics.jsonl"), 2);  // steps 1, 2 once: not 1, 2, 1, 2

  r = run_command(kTrain + flags + " --steps 2 --resume --overwrite", tmp / "log4");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("contradict"), std::string::npos) << r.output;

  // --resume auto continues the run; in a new out_dir, --resume fails and --resume auto starts one.
  r = run_command(kTrain + flags + " --steps 3 --resume auto", tmp / "log5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + out + "/ckpt/step_00000002 at step 2"), std::string::npos) << r.output;
  const std::string fresh = " --out-dir " + (tmp / "fresh").string();
  r = run_command(kTrain + flags + fresh + " --steps 1 --resume", tmp / "log6");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("--resume: no complete checkpoint to resume from in " + (tmp / "fresh" / "ckpt").string()),
            std::string::npos)
      << r.output;
  r = run_command(kTrain + flags + fresh + " --steps 1 --resume auto", tmp / "log7");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("initialized from scratch"), std::string::npos) << r.output;
}

// SIGTERM (a preemption notice) checkpoints at the end of the current step and exits 75, not 0.
TEST(Train, StopSignalCheckpointsAndExits75) {
  TempDir tmp("trainsignal");
  testing_util::write_test_shards(tmp / "data");
  const fs::path out = tmp / "run";
  const std::string cmd = kTrain + common_flags(tmp / "data") + " --steps 100000 --ckpt_every 0 --val_every 0 --out_dir " +
                          out.string();
  // Start it, wait for its first step's row, then send the signal.
  const std::string script = cmd + " > " + (tmp / "train.log").string() + " 2>&1 & pid=$!; " +
                             "for i in $(seq 1200); do grep -q '\"loss\"' " + (out / "metrics.jsonl").string() +
                             " 2>/dev/null && break; sleep 0.05; done; kill -TERM $pid; wait $pid; echo exit=$?";
  std::ofstream(tmp / "stop.sh") << script << "\n";
  auto r = run_command("bash " + (tmp / "stop.sh").string(), tmp / "wrapper.log");
  EXPECT_NE(r.output.find("exit=75"), std::string::npos) << r.output << read_file(tmp / "train.log");
  const std::string log = read_file(tmp / "train.log");
  EXPECT_NE(log.find("stop requested (signal): checkpointing at step"), std::string::npos) << log;
  EXPECT_NE(log.find("(signal) after"), std::string::npos) << log;
  EXPECT_NE(log.find("rerun with --resume to continue"), std::string::npos) << log;
  ASSERT_TRUE(fs::is_symlink(out / "ckpt" / "latest")) << log;
  EXPECT_TRUE(fs::exists(out / "ckpt" / "latest" / "state.json")) << log;
}

// The example fine-tuning config of the README is a valid run.toml (every key an option of build/train).
TEST(Train, ExampleFineTuneConfigRuns) {
  TempDir tmp("trainexample");
  testing_util::write_test_shards(tmp / "data");
  const std::string data = (tmp / "data").string();
  auto r = run_command(kTrain + " --config examples/finetune.toml --init tests/fixtures/llama32_tiny --train_data " + data +
                           " --val_data " + data + " --out_dir " + (tmp / "run").string() +
                           " --seq_len 16 --micro_batch 2 --grad_accum 1 --steps 2 --val_batches 2 --threads 2 --device cpu"
                           " --zero 0",
                       tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("initialized from tests/fixtures/llama32_tiny"), std::string::npos) << r.output;
}

TEST(Train, ConfigFileAndFlagsAgree) {
  TempDir tmp("traintoml");
  testing_util::write_test_shards(tmp / "data");
  std::ofstream(tmp / "run.toml") << "model_config = \"tests/fixtures/llama32_tiny/config.json\"\n"
                                  << "train_data = \"" << (tmp / "data" / "train-*.bin").string() << "\"\n"
                                  << "seq_len = 16\nmicro_batch = 2\nsteps = 3\nlr = 1e-3\nthreads = 1\ndevice = \"cpu\"\n"
                                  << "out_dir = \"" << (tmp / "run").string() << "\"\n";
  auto r = run_command(kTrain + " --config " + (tmp / "run.toml").string() + " --steps 2", tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto state = nlohmann::json::parse(read_file(tmp / "run" / "ckpt" / "step_00000002" / "state.json"));
  EXPECT_EQ(state["train_config"]["steps"], 2);  // the flag overrode the file
  EXPECT_EQ(state["train_config"]["seq_len"], 16);
  EXPECT_DOUBLE_EQ(state["train_config"]["lr"].get<double>(), 1e-3);
}

TEST(Train, DeviceOptionsAndTheCostColumn) {
  TempDir tmp("traindevice");
  testing_util::write_test_shards(tmp / "data");
  const std::string run = " --steps 2 --out_dir " + (tmp / "run").string();
  if (resolve_device("auto") == "cpu") {  // cuda where none is visible: refused before any work, saying why
    auto r = run_command(kTrain + common_flags(tmp / "data", "cuda") + run, tmp / "log1");
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_TRUE(r.output.find("no CUDA device is visible") != std::string::npos ||
                r.output.find("this build of tuna has no CUDA") != std::string::npos) << r.output;
    EXPECT_NE(r.output.find("--device cpu"), std::string::npos) << r.output;
  }
  auto r = run_command(kTrain + common_flags(tmp / "data") + run + " --bf16_moments", tmp / "log2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("are for --device cuda"), std::string::npos) << r.output;

  r = run_command(kTrain + common_flags(tmp / "data") + run + " --gpu_hour_cost 2.5 --log_every 1", tmp / "log3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tuna train | device cpu |"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" | cost "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("MFU"), std::string::npos) << r.output;  // no device peak on the CPU
  std::istringstream in(read_file(tmp / "run" / "metrics.jsonl"));
  std::string line;
  int steps = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    steps++;
    ASSERT_TRUE(j.contains("cost")) << line;
    EXPECT_GE(j["cost"].get<double>(), 0.0);
    EXPECT_FALSE(j.contains("mfu")) << line;
    EXPECT_FALSE(j.contains("gpu_mem_mb")) << line;
  }
  EXPECT_EQ(steps, 2);
}

}  // namespace
}  // namespace tuna
