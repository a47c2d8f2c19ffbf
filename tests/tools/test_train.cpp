// build/train end to end on the CPU: 20 steps straight equal 10 steps + resume + 10 steps, bit for bit
// (weights, optimizer state and every logged loss), and bad options fail with a message naming them.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "data/shard.h"
#include "data/tokenizer.h"
#include "model/engine.h"  // resolve_device
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kTrain = testing_util::build_dir() + "/train";

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
  r = run_command(kTrain + flags + " --out_dir " + (tmp / "split").string() + " --stop_at_step 10", tmp / "log_b");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "split" / "ckpt" / "step_00000010"));
  EXPECT_FALSE(fs::exists(tmp / "split" / "ckpt" / "step_00000020"));
  r = run_command(kTrain + flags + " --out_dir " + (tmp / "split").string() + " --resume", tmp / "log_c");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;

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
}

// --tokenizer names a file under any name: the checkpoints carry exactly it (as tokenizer.model), not what
// else lies in its directory; a tokenizer that does not exist stops the run before training; shards written by
// another tokenizer are refused, naming both.
TEST(Train, CarriesExactlyTheNamedTokenizerAndChecksShards) {
  TempDir tmp("traintok");
  const fs::path toks = tmp / "toks";
  fs::create_directories(toks);
  fs::copy_file("tests/fixtures/tokenizers/spm/tokenizer.model", toks / "contracts-2k.model");
  std::ofstream(toks / "tokenizer.model") << "another tokenizer's file, which must not travel";
  const uint64_t fingerprint = Tokenizer((toks / "contracts-2k.model").string()).fingerprint();
  testing_util::write_test_shards(tmp / "data", fingerprint);
  nlohmann::json cfg = nlohmann::json::parse(read_file("tests/fixtures/llama32_tiny/config.json"));
  cfg["vocab_size"] = 2000;  // the tokenizer's 2000 pieces
  std::ofstream(tmp / "config.json") << cfg.dump();
  const std::string flags = common_flags(tmp / "data") + " --model_config " + (tmp / "config.json").string() +
                            " --steps 2 --val_every 0";

  auto r = run_command(kTrain + flags + " --out_dir " + (tmp / "run").string() + " --tokenizer " +
                           (toks / "contracts-2k.model").string(), tmp / "log1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tokenizer " + (toks / "contracts-2k.model").string() + " (sentencepiece, 2000 tokens)"),
            std::string::npos) << r.output;
  const fs::path ckpt = tmp / "run" / "ckpt" / "step_00000002";
  EXPECT_EQ(read_file(ckpt / "tokenizer.model"), read_file(toks / "contracts-2k.model"));
  EXPECT_FALSE(fs::exists(ckpt / "tokenizer.json"));
  EXPECT_EQ(Tokenizer(ckpt.string()).fingerprint(), fingerprint);

  r = run_command(kTrain + flags + " --out_dir " + (tmp / "run2").string() + " --tokenizer " +
                      (toks / "missing.model").string(), tmp / "log2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find((toks / "missing.model").string() + ": no such file"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "run2" / "ckpt"));

  testing_util::write_test_shards(tmp / "other", fingerprint ^ 1);
  r = run_command(kTrain + common_flags(tmp / "other") + " --model_config " + (tmp / "config.json").string() +
                      " --steps 2 --out_dir " + (tmp / "run3").string() + " --tokenizer " + (toks / "contracts-2k.model").string(),
                  tmp / "log3");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("another tokenizer"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("contracts-2k.model"), std::string::npos) << r.output;
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

// --plan_only: the CUDA engine's per-GPU memory plan without a GPU (the card's memory given), and the refusal of
// a run that does not fit, with the options that would make it fit. The demo model at micro-batch 64 x 256.
TEST(Train, PlanOnlyPrintsThePerGpuTableAndRefusesWhatDoesNotFit) {
  TempDir tmp("trainplan");
  const std::string base = kTrain + " --plan_only --device cuda --model_config demo/config.json --micro_batch 64 "
                           "--seq_len 256 --out_dir " + (tmp / "run").string();
  auto r = run_command(base + " --gpu_memory_gb 80", tmp / "log1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* what : {"device memory per GPU", "weights", "gradients", "AdamW moments", "activations", "total",
                           "headroom"})
    EXPECT_NE(r.output.find(what), std::string::npos) << what << " missing from\n" << r.output;
  // Too small a card: refused with the table and what would fit (recompute shrinks the activations).
  r = run_command(base + " --gpu_memory_gb 0.62", tmp / "log2");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("does not fit"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("would fit with:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--recompute"), std::string::npos) << r.output;
  // Nothing fits a card of 1 MB.
  r = run_command(base + " --gpu_memory_gb 0.001", tmp / "log3");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no option of this layout fits"), std::string::npos) << r.output;
  r = run_command(base + " --device cpu --gpu_memory_gb 80", tmp / "log4");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("use --device cuda"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace tuna
