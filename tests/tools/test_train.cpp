// build/train end to end on the CPU: 20 steps straight equal 10 steps + resume + 10 steps, bit for bit
// (weights, optimizer state and every logged loss), and bad options fail with a message naming them. The run
// directory's rules: an earlier run is continued, replaced or refused; a stopped run exits 75.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <functional>
#include <tuple>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "ckpt/checkpoint.h"  // load_weights, save_checkpoint: the dequantized base
#include "ckpt/safetensors.h"
#include "core/checksum.h"  // digest_file: a manifest entry rewritten
#include "data/shard.h"
#include "data/tokenizer.h"
#include "engine/engine.h"  // resolve_device
#include "model/quantized_weights.h"  // dequantize_quantized
#include "tests/test_util.h"
#include "tests/tools/tools_test_util.h"

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
  EXPECT_NE(r.output.find("kept the 8 rows up to step 5, dropped 7 logged after it"), std::string::npos) << r.output;
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

// A resume computes what its checkpoint's run computed, or says where it does not: a changed option is named
// with both values, the attention kernels follow the checkpoint's choice (tests/engine/test_engine.cpp,
// AttentionChoice), and no environment variable changes kernels behind the saved options.
TEST(Train, AResumeRunsItsCheckpointsKernelsOrSaysWhy) {
  TempDir tmp("trainkernels");
  testing_util::write_test_shards(tmp / "data");
  const std::string flags = common_flags(tmp / "data") + " --out_dir " + (tmp / "run").string();
  auto r = run_command(kTrain + flags + " --stop_at_step 5", tmp / "log_a");
  ASSERT_EQ(r.exit_code, 75) << r.output;
  const nlohmann::json state =
      nlohmann::json::parse(read_file(tmp / "run" / "ckpt" / "step_00000005" / "state.json"));
  EXPECT_EQ(state["train_config"]["attention"], "auto");
  EXPECT_FALSE(state.contains("kernels")) << "cpu has one attention: nothing to record";
  r = run_command("TUNA_ATTENTION=hopper " + kTrain + flags + " --resume", tmp / "log_b");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("TUNA_ATTENTION=hopper is not read: choose the attention kernels with --attention"),
            std::string::npos) << r.output;
  r = run_command(kTrain + flags + " --resume --attention mma", tmp / "log_c");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--attention mma with --device cpu"), std::string::npos) << r.output;
  r = run_command(kTrain + flags + " --resume --grad_clip 0.5 --stop_at_step 6", tmp / "log_d");
  EXPECT_EQ(r.exit_code, 75) << r.output;
  EXPECT_NE(r.output.find("note: option grad_clip was 1.0 in the checkpoint, now 0.5"), std::string::npos) << r.output;
}

// SFT shards train only the tokens their loss mask marks: the step line says how many of the step's tokens trained.
TEST(Train, AStepThatTrainsPartOfItsTokensSaysHowMany) {
  TempDir tmp("trainsft");
  fs::create_directories(tmp / "data");
  for (const char* name : {"train-00000.bin", "val-00000.bin"}) {
    ShardWriter w((tmp / "data" / name).string(), 128, /*with_mask=*/true, 0);
    for (int doc = 0; doc < 12; doc++) {
      std::vector<int32_t> tokens{1};
      std::vector<uint8_t> mask{0};
      for (int i = 0; i < 40; i++) tokens.push_back(3 + (doc * 5 + i * 7) % 120), mask.push_back(i >= 20);
      tokens.push_back(2), mask.push_back(1);
      w.add_document(tokens, mask);
    }
    w.finish();
  }
  const auto r = run_command(kTrain + common_flags(tmp / "data") + " --steps 2 --out_dir " + (tmp / "run").string(),
                             tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" of 64 tokens | "), std::string::npos) << r.output;  // 2 x 16 x 2 per step
  EXPECT_NE(r.output.find("| trained "), std::string::npos) << r.output;
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
  EXPECT_NE(r.output.find("--rope_scaling"), std::string::npos) << r.output;
  // A rope scaling that is not one of transformers' three, refused by the option's name before any work.
  r = run_command(kTrain + flags + " --model_config tests/fixtures/llama2_tiny/config.json --seq_len 300 "
                  "--rope_scaling ntk:2", tmp / "log5b");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("option 'rope_scaling': expected TYPE:FACTOR with TYPE linear, dynamic or yarn"),
            std::string::npos) << r.output;

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
  // val-00000 only: its 504 tokens give 503 targets, each scored once (31 windows x 16, and a padded tail of 7).
  EXPECT_NE(r.output.find("| 503 tokens"), std::string::npos) << r.output;

  r = run_command(kTrain + flags + " --steps 2", tmp / "log2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(out + " holds an earlier run (metrics.jsonl with 6 rows, 1 checkpoint up to step 2)"),
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

// One run per out_dir: a second run on a live run's out_dir is refused naming the holder; once the holder is
// killed (kill -9 leaves its lock), the next run takes the lock over with a warning and resumes.
TEST(Train, ASecondRunOnTheSameOutDirIsRefusedAndAKilledOnesLockTakenOver) {
  TempDir tmp("trainlock");
  testing_util::write_test_shards(tmp / "data");
  const fs::path out = tmp / "run";
  // Not a requeue of one job, whatever launched the tests: a second run is refused at once.
  const std::string no_job = "env -u SLURM_JOB_ID -u PBS_JOBID -u LSB_JOBID -u FLUX_JOB_ID ";
  const std::string cmd = no_job + kTrain + common_flags(tmp / "data") +
                          " --steps 100000 --ckpt_every 2 --val_every 0 --out_dir " + out.string() + " --resume auto";
  const std::string script =
      cmd + " > " + (tmp / "first.log").string() + " 2>&1 & pid=$!; " +
      "for i in $(seq 1200); do grep -q '\"loss\"' " + (out / "metrics.jsonl").string() +
      " 2>/dev/null && break; sleep 0.05; done; " + cmd + " > " + (tmp / "second.log").string() +
      " 2>&1; echo second=$?; sleep 1; kill -KILL $pid; wait $pid; echo first=$?; echo pid=$pid";
  std::ofstream(tmp / "two.sh") << script << "\n";
  auto r = run_command("bash " + (tmp / "two.sh").string(), tmp / "wrapper.log");
  EXPECT_NE(r.output.find("second=1"), std::string::npos) << r.output << read_file(tmp / "second.log");
  EXPECT_NE(r.output.find("first=137"), std::string::npos) << r.output << read_file(tmp / "first.log");
  const std::string second = read_file(tmp / "second.log");
  EXPECT_NE(second.find(out.string() + " is in use by another run (host "), std::string::npos) << second;
  const std::string pid = r.output.substr(r.output.find("pid=") + 4, r.output.find('\n', r.output.find("pid=")) - r.output.find("pid=") - 4);
  EXPECT_NE(second.find(", pid " + pid + ","), std::string::npos) << second << " pid " << pid;
  ASSERT_TRUE(fs::exists(out / "run.lock"));  // left by the killed run

  r = run_command(kTrain + common_flags(tmp / "data") + " --steps 4 --ckpt_every 2 --val_every 0 --out_dir " + out.string() +
                      " --resume auto",
                  tmp / "third.log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: " + (out / "run.lock").string() + ": took over the lock of a run that is gone (host"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("pid " + pid + ","), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out / "run.lock"));  // released at the end
}

// The run report lists a checkpoint as soon as it is written (not at the next validation), with the time it
// was written rather than an age frozen into the page.
TEST(Train, TheReportListsACheckpointOnceWritten) {
  TempDir tmp("trainreport");
  testing_util::write_test_shards(tmp / "data");
  const fs::path out = tmp / "run";
  const std::string cmd = kTrain + common_flags(tmp / "data") + " --steps 100000 --ckpt_every 5 --val_every 5 --out_dir " +
                          out.string();
  const std::string script = cmd + " > " + (tmp / "train.log").string() + " 2>&1 & pid=$!; " +
                             "for i in $(seq 1200); do grep -q 'checkpoint .*step_00000005' " + (tmp / "train.log").string() +
                             " 2>/dev/null && break; sleep 0.05; done; kill -KILL $pid; wait $pid";
  std::ofstream(tmp / "report.sh") << script << "\n";
  run_command("bash " + (tmp / "report.sh").string(), tmp / "wrapper.log");
  const std::string html = read_file(out / "report.html");
  EXPECT_NE(html.find((out / "ckpt" / "step_00000005").string()), std::string::npos) << read_file(tmp / "train.log");
  EXPECT_NE(html.find(" UTC</td></tr>"), std::string::npos);
  EXPECT_EQ(html.find(" ago</td>"), std::string::npos);
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

// LoRA: build/train --init BASE --lora_rank r trains the adapters on the frozen base, says how many parameters train,
// writes the adapter state (PEFT's names) in its checkpoints, and resumes exactly (the base read again from --init);
// bad LoRA options are refused by name.
TEST(Train, LoraTrainsAdaptersOnAFrozenBaseAndResumesExactly) {
  TempDir tmp("trainlora");
  testing_util::write_test_shards(tmp / "data");
  const std::string data = (tmp / "data").string();
  const std::string flags = " --init tests/fixtures/llama32_tiny --train_data " + data + " --val_data " + data +
                            " --seq_len 16 --micro_batch 2 --grad_accum 2 --steps 10 --lr 1e-2 --warmup_steps 2"
                            " --ckpt_every 5 --val_every 5 --threads 2 --seed 11 --device cpu"
                            " --lora_rank 4 --lora_alpha 8 --lora_dropout 0.1 --lora_targets q_proj,v_proj,down_proj";
  auto r = run_command(kTrain + flags + " --out_dir " + (tmp / "straight").string(), tmp / "log_a");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // llama32_tiny: 2 layers, q 64 x 64, v 16 x 64, down 64 x 160 -> 2 x 4 x (128 + 80 + 224) = 3456.
  EXPECT_NE(r.output.find("trainable parameters: 3456 LoRA adapter parameters"), std::string::npos) << r.output;
  // Every tensor file of a checkpoint (weights and optimizer state, whatever their names), in name order.
  const auto tensor_files = [](const fs::path& dir) {
    std::map<std::string, std::string> files;
    for (const auto& f : fs::directory_iterator(dir))
      if (f.path().extension() == ".safetensors") files[f.path().filename().string()] = read_file(f.path());
    return files;
  };
  const auto weights = tensor_files(tmp / "straight" / "ckpt" / "step_00000010");
  ASSERT_FALSE(weights.empty());
  bool has_adapter = false;
  for (const auto& [name, bytes] : weights) {
    has_adapter |= bytes.find("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight") != std::string::npos;
    EXPECT_EQ(bytes.find("\"model.layers.0.self_attn.q_proj.weight\""), std::string::npos) << name;  // never the base
  }
  EXPECT_TRUE(has_adapter);
  auto la = losses(tmp / "straight" / "metrics.jsonl");
  ASSERT_EQ(la.size(), 10u);
  EXPECT_LT(std::stod(la[10]), std::stod(la[1]) - 0.1);  // the adapters learn the repetitive stream

  r = run_command(kTrain + flags + " --out_dir " + (tmp / "split").string() + " --stop_at_step 5", tmp / "log_b");
  ASSERT_EQ(r.exit_code, 75) << r.output;
  r = run_command(kTrain + flags + " --out_dir " + (tmp / "split").string() + " --resume", tmp / "log_c");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(la, losses(tmp / "split" / "metrics.jsonl"));
  EXPECT_EQ(weights, tensor_files(tmp / "split" / "ckpt" / "step_00000010"));

  const std::string base = kTrain + " --init tests/fixtures/llama32_tiny --train_data " + data +
                           " --seq_len 16 --micro_batch 2 --steps 2 --threads 2 --device cpu --out_dir " +
                           (tmp / "bad").string();
  const std::vector<std::pair<std::string, std::string>> bad = {
      {" --lora_rank 0", "option 'lora_rank': expected a rank of at least 1, found 0"},
      {" --lora_rank 65", "option 'lora_rank': 65 exceeds the smaller dimension of q_proj"},
      {" --lora_rank 4 --lora_alpha 0", "option 'lora_alpha': expected a finite number above 0, found 0"},
      {" --lora_rank 4 --lora_dropout 1", "option 'lora_dropout': expected a probability in [0, 1), found 1"},
      {" --lora_rank 4 --lora_targets q_proj,lm_head", "option 'lora_targets': 'lm_head' is not a projection"},
      {" --lora_alpha 8", "option 'lora_alpha' is for LoRA training: give --lora_rank too"},
      {" --lora_rank 4 --base_quant nf4 --zero 3", "option 'base_quant' nf4 with --zero 3: sharding a quantized base is "
                                                  "not implemented"},
  };
  int i = 0;
  for (const auto& [extra, message] : bad) {
    r = run_command(base + extra, tmp / ("log_bad" + std::to_string(i++)));
    EXPECT_EQ(r.exit_code, 1) << extra << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << extra << "\n" << r.output;
  }
}

// QLoRA: --base_quant nf4 (and int8) trains exactly what LoRA trains on the base dequantize(quantize(base)) written out
// in fp32: the same losses, adapters and moments, bit for bit; the checkpoint records the quantization, a resume keeps
// it (exactly: 5 steps, a stop and --resume equal 10 straight) and refuses another, and build/eval and merge-lora apply
// it (the same loss, the same merged bytes as from the dequantized base). --base_quant without adapters is refused.
TEST(Train, QloraEqualsLoraOnTheDequantizedBaseAndKeepsItsQuantization) {
  TempDir tmp("trainqlora");
  testing_util::write_test_shards(tmp / "data");
  const std::string data = (tmp / "data").string();
  const std::string flags = " --train_data " + data + " --val_data " + data +
                            " --seq_len 16 --micro_batch 2 --grad_accum 2 --steps 10 --lr 1e-2 --warmup_steps 2"
                            " --ckpt_every 5 --val_every 5 --threads 2 --seed 11 --device cpu"
                            " --lora_rank 4 --lora_alpha 8 --lora_dropout 0.1 --lora_targets q_proj,v_proj,down_proj";
  const auto tensors = [](const fs::path& dir) { return testing_util::safetensors_tensors(dir); };
  const auto eval_loss = [&](const fs::path& ckpt, const std::string& tag) {
    auto r = run_command(testing_util::build_dir() + "/eval --checkpoint " + ckpt.string() + " --data " + data +
                             " --seq_len 16 --threads 2 --device cpu --quiet",
                         tmp / ("eval_" + tag));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const std::string last = r.output.substr(r.output.rfind('{'));
    return nlohmann::json::parse(last.substr(0, last.find('\n')))["loss"].get<double>();
  };
  for (BaseQuant quant : {BaseQuant::Nf4, BaseQuant::Int8}) {
    const std::string q = base_quant_name(quant);
    SCOPED_TRACE(q);
    // The base as the quantized run computes with it, in fp32.
    const LlamaConfig config = LlamaConfig::load("tests/fixtures/llama32_tiny");
    const ParamLayout layout(config);
    std::vector<float> params(layout.total());
    load_weights("tests/fixtures/llama32_tiny", layout, params.data());
    for (const ParamTensor& t : layout.tensors()) dequantize_quantized(t, quant, params.data() + t.offset);
    const nlohmann::json config_json = read_config_json("tests/fixtures/llama32_tiny");
    const fs::path dequantized =
        save_checkpoint(tmp / ("dequantized_" + q), 0, layout,
                        CheckpointContents{&config_json, params.data(), {}, nlohmann::json{{"step", 0}}, {}}, 0);

    const fs::path quantized_run = tmp / ("quantized_" + q), plain_run = tmp / ("plain_" + q);
    auto r = run_command(kTrain + " --init tests/fixtures/llama32_tiny --base_quant " + q + flags + " --out_dir " +
                             quantized_run.string(),
                         tmp / ("log_q_" + q));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = run_command(kTrain + " --init " + dequantized.string() + flags + " --out_dir " + plain_run.string(),
                    tmp / ("log_p_" + q));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto la = losses(quantized_run / "metrics.jsonl");
    ASSERT_EQ(la.size(), 10u);
    EXPECT_EQ(la, losses(plain_run / "metrics.jsonl"));
    const fs::path q10 = quantized_run / "ckpt" / "step_00000010", p10 = plain_run / "ckpt" / "step_00000010";
    const auto adapters = tensors(q10);
    ASSERT_FALSE(adapters.empty());
    EXPECT_TRUE(adapters == tensors(p10));
    EXPECT_EQ(nlohmann::json::parse(read_file(q10 / "base_model.json")).value("quantization", ""), q);
    EXPECT_FALSE(nlohmann::json::parse(read_file(p10 / "base_model.json")).contains("quantization"));
    // build/eval and merge-lora read the recorded quantization: what the run trained is what they compute and ship.
    EXPECT_EQ(eval_loss(q10, "q_" + q), eval_loss(p10, "p_" + q));
    const std::string convert = testing_util::build_dir() + "/convert merge-lora ";
    r = run_command(convert + q10.string() + " " + (tmp / ("merged_q_" + q)).string() + " --dtype fp32",
                    tmp / ("merge_q_" + q));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("merged onto the dequantized base"), std::string::npos) << r.output;
    r = run_command(convert + p10.string() + " " + (tmp / ("merged_p_" + q)).string() + " --dtype fp32",
                    tmp / ("merge_p_" + q));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(tensors(tmp / ("merged_q_" + q)) == tensors(tmp / ("merged_p_" + q)));
    if (quant != BaseQuant::Nf4) continue;

    // Resume: the base quantized again from --init, as recorded (no flag needed); exact.
    const fs::path split = tmp / "split";
    const std::string init = " --init tests/fixtures/llama32_tiny";
    r = run_command(kTrain + init + " --base_quant nf4" + flags + " --out_dir " + split.string() + " --stop_at_step 5",
                    tmp / "log_split_a");
    ASSERT_EQ(r.exit_code, 75) << r.output;
    r = run_command(kTrain + init + flags + " --out_dir " + split.string() + " --resume --base_quant int8",
                    tmp / "log_split_bad");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("option 'base_quant' is int8, but " + (split / "ckpt" / "step_00000005").string() +
                            "/base_model.json records nf4"),
              std::string::npos)
        << r.output;
    r = run_command(kTrain + init + flags + " --out_dir " + split.string() + " --resume", tmp / "log_split_b");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(la, losses(split / "metrics.jsonl"));
    EXPECT_TRUE(adapters == tensors(split / "ckpt" / "step_00000010"));
  }
  // Without adapters a quantized base is refused, by name.
  auto r = run_command(kTrain + " --init tests/fixtures/llama32_tiny --base_quant nf4 --train_data " + data +
                           " --seq_len 16 --steps 2 --device cpu --out_dir " + (tmp / "bad").string(),
                       tmp / "log_bad");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("option 'base_quant' is for LoRA runs"), std::string::npos) << r.output;
}

// QLoRA quantizes a base stored in bf16 or fp32 only: an fp16 base (the fixture's weights written as F16) is refused at
// start-up, naming the file, a tensor and the dtype found; LoRA over the same base trains.
TEST(Train, QloraRefusesABaseThatIsNotBf16OrFp32) {
  TempDir tmp("trainqlorafp16");
  testing_util::write_test_shards(tmp / "data");
  const fs::path base = tmp / "fp16_base";
  fs::create_directories(base);
  fs::copy_file("tests/fixtures/llama32_tiny/config.json", base / "config.json");
  const SafetensorsFile f32("tests/fixtures/llama32_tiny/model.safetensors");
  std::vector<std::vector<uint16_t>> halves;
  halves.reserve(f32.tensors().size());
  SafetensorsWriter writer;
  for (const TensorInfo& t : f32.tensors()) {
    std::vector<float> values(t.numel);
    f32.read_f32(t.name, t.shape, values.data());
    halves.emplace_back(t.numel);
    convert_from_f32(values.data(), DType::F16, halves.back().data(), t.numel);
    writer.add(t.name, DType::F16, std::span<const int64_t>(t.shape), halves.back().data());
  }
  writer.write(base / "model.safetensors");
  const std::string run = kTrain + " --init " + base.string() + " --train_data " + (tmp / "data").string() +
                          " --seq_len 16 --micro_batch 2 --steps 1 --threads 2 --device cpu --lora_rank 4";
  auto r = run_command(run + " --base_quant nf4 --out_dir " + (tmp / "q").string(), tmp / "log_q");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find((base / "model.safetensors").string() + ": tensor 'model.layers.0.self_attn.q_proj.weight': "
                          "--base_quant nf4 quantizes a base stored in BF16 or F32, found F16"),
            std::string::npos)
      << r.output;
  r = run_command(run + " --out_dir " + (tmp / "lora").string(), tmp / "log_lora");
  EXPECT_EQ(r.exit_code, 0) << r.output;
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
  if (resolve_device("auto") == Device::Cpu) {  // cuda where none is visible: refused before any work, saying why
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
  // A plan touches nothing on disk: an out_dir holding a run is neither refused, deleted (--overwrite) nor
  // verified (--resume auto), and a missing one is not created.
  fs::create_directories(tmp / "run" / "ckpt" / "step_00000002");
  std::ofstream(tmp / "run" / "ckpt" / "step_00000002" / "state.json") << "{\"step\": 2}";
  std::ofstream(tmp / "run" / "metrics.jsonl") << "{\"step\": 1, \"loss\": 4.5}\n";
  for (const char* extra : {"", " --overwrite", " --resume auto"}) {
    r = run_command(base + " --gpu_memory_gb 80" + extra, tmp / "log5");
    EXPECT_EQ(r.exit_code, 0) << extra << "\n" << r.output;
    EXPECT_TRUE(fs::exists(tmp / "run" / "ckpt" / "step_00000002" / "state.json")) << extra;
    EXPECT_EQ(read_file(tmp / "run" / "metrics.jsonl"), "{\"step\": 1, \"loss\": 4.5}\n") << extra;
  }
  r = run_command(kTrain + " --plan_only --device cuda --model_config demo/config.json --gpu_memory_gb 80 --out_dir " +
                      (tmp / "nowhere").string(), tmp / "log6");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "nowhere"));
  // With adapters: the CUDA engine's LoRA plan (the frozen base, the adapters' state), from the options alone.
  r = run_command(base + " --gpu_memory_gb 80 --lora_rank 4", tmp / "log7");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("LoRA r4 on all 7 modules"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bf16 base weights (frozen)"), std::string::npos) << r.output;
  // QLoRA: the base's projections in nf4, so its bf16 rest (embedding, norms, lm_head) is the largest weight buffer.
  r = run_command(base + " --gpu_memory_gb 80 --lora_rank 4 --base_quant nf4", tmp / "log8");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("QLoRA (nf4) r4 on all 7 modules"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("largest: bf16 base weights (frozen embedding, norms, lm_head)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("bf16 base weights (frozen)"), std::string::npos) << r.output;
}

// The demo's own config plans on cuda with nothing a run would be refused for (its --eval_tasks once was: the demo
// then failed at start on a GPU machine, which no CPU test saw); what the CUDA engine does not run says so beside the
// plan. (No tokenizer: the demo's is written by scripts/demo.sh, and a plan reads no text.)
TEST(Train, PlanOnlySaysWhatARunOfTheConfigWouldBeRefused) {
  TempDir tmp("trainplanrefusals");
  const std::string base = kTrain + " --config demo/train.toml --tokenizer '' --plan_only --device cuda " +
                           "--gpu_memory_gb 80 --out_dir " + (tmp / "run").string();
  auto r = run_command(base, tmp / "log1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("would be refused"), std::string::npos) << r.output;
  r = run_command(base + " --fp8 tensorwise --micro_batch 1 --seq_len 100", tmp / "log2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: a run of this config would be refused: --fp8 tensorwise with --device cuda: "
                          "micro_batch 1 x seq_len 100 = 100 tokens a pass, not a multiple of 16"),
            std::string::npos)
      << r.output;
}

// ---- no input crashes the trainer, no bad value trains silently -------------------------------------------

// The flags of a short run (8 steps, a checkpoint every 2, all kept).
std::string short_run(const fs::path& data, const fs::path& out) {
  return " --model_config tests/fixtures/llama32_tiny/config.json --train_data '" + (data / "train-*.bin").string() +
         "' --seq_len 16 --micro_batch 2 --steps 8 --lr 3e-3 --ckpt_every 2 --ckpt_keep 0 --threads 1 --seed 3"
         " --device cpu --out_dir " + out.string();
}

TEST(Train, BadValuesAreRefusedByName) {
  TempDir tmp("trainvalues");
  testing_util::write_test_shards(tmp / "data");
  const std::string flags = short_run(tmp / "data", tmp / "run");
  struct Case {
    std::string extra, expected;
  };
  const std::vector<Case> cases = {
      {" --lr inf", "option 'lr': expected (0, 1], found 'inf'"},
      {" --weight_decay nan", "option 'weight_decay'"},
      {" --grad_clip nan", "option 'grad_clip'"},  // would have disabled clipping
      {" --comm_timeout nan", "option 'comm_timeout'"},  // would have disabled every timeout
      {" --seq_len 2147483648", "option 'seq_len': expected [1, 4194304]"},
      {" --steps 99999999999999999999", "option 'steps'"},
      {" --device gpu", "expected auto, cpu or cuda"},
  };
  int i = 0;
  for (const Case& c : cases) {
    auto r = run_command(kTrain + flags + c.extra, tmp / ("log" + std::to_string(i++)));
    EXPECT_EQ(r.exit_code, 1) << c.extra << ": " << r.output;
    EXPECT_NE(r.output.find("error: command line: " + c.expected.substr(0, 0)), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.extra << ": " << r.output;
  }
  // TOML values must have the option's type: a number for a string option is not converted.
  std::ofstream(tmp / "typed.toml") << "tokenizer = 5\n";
  auto r = run_command(kTrain + flags + " --config " + (tmp / "typed.toml").string(), tmp / "log_toml");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("typed.toml:1: option 'tokenizer': expected a string, found the integer 5"), std::string::npos)
      << r.output;
  // config.json values that used to abort (std::bad_alloc, a JSON exception) or train nonsense.
  nlohmann::json cfg = nlohmann::json::parse(read_file("tests/fixtures/llama32_tiny/config.json"));
  for (auto [key, value] : {std::pair{"hidden_size", std::string("1e400")}, {"hidden_size", "4611686018427387904"},
                            {"rms_norm_eps", "1e308"}, {"num_hidden_layers", "\"2\""}}) {
    std::string text = cfg.dump();
    const std::string field = "\"" + std::string(key) + "\":";
    const size_t at = text.find(field) + field.size();
    text.replace(at, text.find_first_of(",}", at) - at, value);
    std::ofstream(tmp / "cfg.json") << text;
    r = run_command(kTrain + flags + " --model_config " + (tmp / "cfg.json").string(), tmp / "log_cfg");
    EXPECT_EQ(r.exit_code, 1) << key << " = " << value << ": " << r.output;
    EXPECT_NE(r.output.find("error: " + (tmp / "cfg.json").string()), std::string::npos) << r.output;
  }
}

// A model or batch that cannot fit this machine's memory is refused before anything is allocated: the trainer
// by its memory plan (model/memory_plan.h), each item named with its size.
TEST(Train, MemoryExhaustionNamesTheAllocation) {
  TempDir tmp("trainoom");
  testing_util::write_test_shards(tmp / "data");
  nlohmann::json cfg = nlohmann::json::parse(read_file("tests/fixtures/llama32_tiny/config.json"));
  cfg["hidden_size"] = 1 << 18, cfg["intermediate_size"] = 1 << 18, cfg["num_hidden_layers"] = 64;
  cfg["num_attention_heads"] = 1 << 10, cfg["num_key_value_heads"] = 1 << 10, cfg["head_dim"] = 1 << 8;
  std::ofstream(tmp / "huge.json") << cfg.dump();  // ~3e13 parameters: 123 TB of fp32 weights
  std::string flags = short_run(tmp / "data", tmp / "run");
  flags.replace(flags.find("tests/fixtures/llama32_tiny/config.json"), std::string("tests/fixtures/llama32_tiny/config.json").size(),
                (tmp / "huge.json").string());
  auto r = run_command(kTrain + flags, tmp / "log1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: the memory plan's peak per rank is"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("weights (fp32, whole)"), std::string::npos) << r.output;
  // The activations of an enormous batch on a small model: named, with the way out.
  r = run_command(kTrain + short_run(tmp / "data", tmp / "run") + " --seq_len 131072 --micro_batch 16384", tmp / "log2");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("activations kept for the backward"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("a smaller micro_batch or seq_len"), std::string::npos) << r.output;
}

TEST(Train, FifoAsDataIsRefusedInsteadOfHanging) {
  TempDir tmp("trainfifo");
  testing_util::write_test_shards(tmp / "data");
  ASSERT_EQ(::mkfifo((tmp / "pipe.bin").c_str(), 0600), 0);
  std::string flags = short_run(tmp / "data", tmp / "run");
  flags.replace(flags.find("--train_data '"), std::string("--train_data '").size() + (tmp / "data" / "train-*.bin").string().size() + 1,
                "--train_data " + (tmp / "pipe.bin").string());
  auto r = run_command("timeout 120 " + kTrain + flags, tmp / "log");
  EXPECT_EQ(r.exit_code, 1) << r.output;  // 124 would be the hang
  EXPECT_NE(r.output.find("pipe.bin: is a FIFO (named pipe), not a regular file"), std::string::npos) << r.output;
}

// A run whose loss goes NaN for two steps skips them (no update), logs them, and goes on; the skipped steps are
// counted in the checkpoint, so that the resume's cross-check (AdamW's updates + skipped = step) holds.
TEST(Train, NonFiniteStepsAreSkippedCountedAndResumable) {
  TempDir tmp("trainnan");
  testing_util::write_test_shards(tmp / "data");
  const std::string flags = short_run(tmp / "data", tmp / "run");
  auto r = run_command("TUNA_FAULT=nan:0:2-3 " + kTrain + flags + " --stop_at_step 6", tmp / "log1");
  ASSERT_EQ(r.exit_code, 75) << r.output;  // stopped before --steps
  EXPECT_NE(r.output.find("step      3 | loss nan"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not finite: update skipped (2 in a row, 2 in all)"), std::string::npos) << r.output;
  auto state = nlohmann::json::parse(read_file(tmp / "run" / "ckpt" / "step_00000006" / "state.json"));
  EXPECT_EQ(state["skipped_steps"], 2);
  int skipped = 0;
  std::istringstream in(read_file(tmp / "run" / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) skipped += nlohmann::json::parse(line).value("skipped", false);
  EXPECT_EQ(skipped, 2);
  r = run_command(kTrain + flags + " --resume", tmp / "log2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "run" / "ckpt" / "step_00000008"));
}

// A run that diverges for good stops after --max_bad_steps, with an error, and leaves the last good checkpoint.
TEST(Train, ARunThatStaysNonFiniteStops) {
  TempDir tmp("traindiverge");
  testing_util::write_test_shards(tmp / "data");
  auto r = run_command("TUNA_FAULT=nan:0:3 " + kTrain + short_run(tmp / "data", tmp / "run") + " --max_bad_steps 3",
                       tmp / "log");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("not finite in 3 steps in a row (up to step 6"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "run" / "ckpt" / "step_00000002"));
  EXPECT_FALSE(fs::exists(tmp / "run" / "ckpt" / "step_00000006"));
  EXPECT_FALSE(fs::exists(tmp / "run" / "ckpt" / "step_00000008"));
}

// --resume verifies the newest checkpoint against its manifest and falls back when it is damaged; state.json
// that disagrees with its directory stops the run instead of silently ending it or restarting the data.
TEST(Train, ResumeVerifiesAndFallsBack) {
  TempDir tmp("trainverify");
  testing_util::write_test_shards(tmp / "data");
  const std::string flags = short_run(tmp / "data", tmp / "run");
  auto r = run_command(kTrain + flags + " --stop_at_step 4", tmp / "log1");
  ASSERT_EQ(r.exit_code, 75) << r.output;  // stopped before --steps
  const fs::path ckpt = tmp / "run" / "ckpt";
  {  // one flipped byte in the newest checkpoint's weights
    std::fstream f(ckpt / "step_00000004" / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4000);
    f.put('\x7f');
  }
  r = run_command(kTrain + flags + " --resume --stop_at_step 6", tmp / "log2");
  ASSERT_EQ(r.exit_code, 75) << r.output;
  EXPECT_NE(r.output.find("step_00000004 fails verification"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model.safetensors: checksum"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("resumed from " + (ckpt / "step_00000002").string() + " at step 2"), std::string::npos)
      << r.output;
  EXPECT_TRUE(fs::exists(ckpt / "rejected-step_00000004"));

  // state.json's step disagrees with the directory, or its data cursor is gone: refused, even where no manifest
  // (a checkpoint of an older tuna, resumed unverified) would catch the edit.
  fs::remove(ckpt / "step_00000006" / "manifest.json");
  for (const std::string& state : {std::string("{\"step\": 417, \"data_cursor\": {}}"), std::string("{\"step\": 6}")}) {
    std::ofstream(ckpt / "step_00000006" / "state.json") << state;
    r = run_command(kTrain + flags + " --resume", tmp / "log3");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_TRUE(r.output.find("disagrees with the directory's name") != std::string::npos ||
                r.output.find("field 'data_cursor' is missing") != std::string::npos)
        << r.output;
  }
}

// A run whose run.lock another run takes over (here: a lock naming a live process of this host, moved over it)
// stops at the end of its step with exit code 73 and the holder named, by exit, never by a signal (the heartbeat
// thread once ended the process under the main thread's GEMM: SIGSEGV), and writes no checkpoint. Ten times.
TEST(Train, ALockTakenOverEndsTheRunWithExit73AndNoSignal) {
  TempDir tmp("trainlocklost");
  testing_util::write_test_shards(tmp / "data");
  const fs::path out = tmp / "run";
  const std::string cmd = "env -u SLURM_JOB_ID -u PBS_JOBID -u LSB_JOBID -u FLUX_JOB_ID TUNA_LOCK_HEARTBEAT_S=0.05 " +
                          kTrain + common_flags(tmp / "data") + " --steps 1000000 --ckpt_every 0 --val_every 0 --out_dir " +
                          out.string();
  // The thief: this script's shell, alive on this host since this boot, with a fresh heartbeat; moved over the
  // lock again while the trainer runs (a refresh that read the lock just before may rename its own over it), for at
  // most a minute: a trainer that has not stopped by then is killed (and the test fails on its exit code).
  const std::string lock = (out / "run.lock").string(), metrics = (out / "metrics.jsonl").string();
  const std::string script =
      "boot=$(cat /proc/sys/kernel/random/boot_id); host=$(hostname); "
      "for i in $(seq 10); do rm -rf " + out.string() + "; " + cmd + " > " + (tmp / "run").string() + ".$i.log 2>&1 & "
      "pid=$!; for t in $(seq 1200); do grep -q '\"loss\"' " + metrics + " 2>/dev/null && break; sleep 0.05; done; "
      "for t in $(seq 120); do kill -0 $pid 2>/dev/null || break; "
      "  now=$(date +%s.%N); printf '{\"format\": \"tuna run lock\", \"host\": \"%s\", \"boot_id\": \"%s\", \"pid\": %d, "
      "\"job\": \"\", \"started\": %s, \"heartbeat\": %s}\\n' \"$host\" \"$boot\" $$ $now $now > " + lock + ".thief; "
      "  mv -f " + lock + ".thief " + lock + "; sleep 0.5; done; "
      "kill -KILL $pid 2>/dev/null; wait $pid; echo \"run $i exit $?\"; ls " + (out / "ckpt").string() + " 2>/dev/null | grep -c step_ ; "
      "grep -c '\"pid\": '$$ " + lock + "; done; echo thief=$$";
  std::ofstream(tmp / "takeover.sh") << script << "\n";
  const auto r = run_command("bash " + (tmp / "takeover.sh").string(), tmp / "takeover.log");
  const std::string thief = r.output.substr(r.output.rfind("thief=") + 6, r.output.find('\n', r.output.rfind("thief=")) -
                                                                              r.output.rfind("thief=") - 6);
  for (int i = 1; i <= 10; i++) {
    SCOPED_TRACE(i);
    const std::string log = read_file(tmp / ("run." + std::to_string(i) + ".log"));
    // Exit 73 from the process itself (a signal shows as 128 + its number), no checkpoint, the thief's lock kept.
    EXPECT_NE(r.output.find("run " + std::to_string(i) + " exit 73\n0\n1\n"), std::string::npos) << r.output << log;
    EXPECT_NE(log.find("error: " + lock + ": this run's lock was taken over by another run (host "), std::string::npos)
        << log;
    EXPECT_NE(log.find(", pid " + thief + ", "), std::string::npos) << log << "thief " << thief;
    EXPECT_NE(log.find("(exit code 73)"), std::string::npos) << log;
  }
}

// run.lock as something no run writes (it hung the lock loop, blocked the open or was read without end): build/train
// ends within 5 s, saying what it is and to remove it, and leaves nothing behind; a damaged lock says "unreadable
// lock file" and its rule.
TEST(Train, ARunLockThatIsNotALockEndsTheRunAtOnce) {
  TempDir tmp("trainlockkinds");
  testing_util::write_test_shards(tmp / "data");
  const fs::path out = tmp / "run", lock = out / "run.lock";
  const std::vector<std::tuple<std::string, std::string, std::function<void()>>> kinds = {
      {"dangling symbolic link", "is a symbolic link to '" + (tmp / "nowhere").string() + "', not a lock file",
       [&] { fs::create_symlink(tmp / "nowhere", lock); }},
      {"FIFO", "is a FIFO (named pipe), not a lock file", [&] { ASSERT_EQ(::mkfifo(lock.c_str(), 0644), 0); }},
      {"link to /dev/zero", "is a symbolic link to '/dev/zero', not a lock file",
       [&] { fs::create_symlink("/dev/zero", lock); }},
      {"directory", "is a directory, not a lock file", [&] { fs::create_directories(lock / "x"); }},
      {"empty file", "unreadable lock file: " + lock.string() + ": empty", [&] { std::ofstream(lock) << ""; }},
  };
  for (const auto& [name, says, make] : kinds) {
    SCOPED_TRACE(name);
    fs::remove_all(out);
    fs::create_directories(out);
    make();
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = run_command("env -u SLURM_JOB_ID -u PBS_JOBID -u LSB_JOBID -u FLUX_JOB_ID " + kTrain +
                                   common_flags(tmp / "data") + " --steps 2 --out_dir " + out.string(),
                               tmp / "log");
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("error: " + (name == "empty file" ? "" : lock.string() + " ") + says), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("If no run uses " + out.string() + ", remove it and start again"), std::string::npos)
        << r.output;
    std::vector<std::string> left;
    for (const auto& e : fs::directory_iterator(out)) left.push_back(e.path().filename().string());
    EXPECT_EQ(left, std::vector<std::string>{"run.lock"});  // no .run.lock.<host>.<pid>, the thing untouched
  }
}

// A file of a checkpoint replaced, and its manifest entry with it: a checkpoint that verifies but says something else.
void rewrite_listed(const fs::path& dir, const std::string& name, const std::string& content) {
  std::ofstream(dir / name, std::ios::binary | std::ios::trunc) << content;
  nlohmann::json manifest = nlohmann::json::parse(read_file(dir / "manifest.json"));
  const FileDigest d = digest_file(dir / name);
  manifest["files"][name] = {{"bytes", d.bytes}, {"xxh3_64", hex64(d.xxh3)}};
  std::ofstream(dir / "manifest.json", std::ios::trunc) << manifest.dump(2);
}

// Every tool that reads a LoRA checkpoint refuses one with bits flipped in its adapter file (--lora_init and
// peft-to-tuna once used it, and peft-to-tuna gave it a fresh manifest), naming the file; --resume refuses a
// checkpoint whose adapter_config.json targets fewer projections than its adapter file holds (it once trained those
// alone); a value of adapter_config.json is refused naming the file and its key, not an option.
TEST(Train, LoraReadersRefuseADamagedOrDisagreeingCheckpoint) {
  TempDir tmp("trainlorareaders");
  testing_util::write_test_shards(tmp / "data");
  const std::string data = (tmp / "data").string();
  const std::string flags = " --init tests/fixtures/llama32_tiny --train_data " + data +
                            " --seq_len 16 --micro_batch 2 --steps 4 --ckpt_every 2 --val_every 0 --threads 2"
                            " --device cpu --lora_rank 4 --lora_targets q_proj,v_proj";
  auto r = run_command(kTrain + flags + " --out_dir " + (tmp / "run").string() + " --stop_at_step 2", tmp / "log_run");
  ASSERT_EQ(r.exit_code, 75) << r.output;
  const fs::path ckpt = tmp / "run" / "ckpt" / "step_00000002";
  const fs::path flipped = tmp / "flipped";
  fs::copy(ckpt, flipped);
  {
    std::fstream f(flipped / "adapter_model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x5a');
  }
  const std::string bin = testing_util::build_dir();
  const std::vector<std::pair<std::string, std::string>> readers = {
      {"train --lora_init", kTrain + flags + " --lora_init " + flipped.string() + " --out_dir " + (tmp / "init").string()},
      {"peft-to-tuna", bin + "/convert peft-to-tuna " + flipped.string() + " " + (tmp / "imported").string()},
      {"eval", bin + "/eval --checkpoint " + flipped.string() + " --data " + data + " --device cpu"},
      {"sample", bin + "/sample --checkpoint " + flipped.string() + " --prompt hi --device cpu"},
      {"merge-lora", bin + "/convert merge-lora " + flipped.string() + " " + (tmp / "merged").string()},
  };
  for (const auto& [name, command] : readers) {
    r = run_command(command, tmp / "log_reader");
    EXPECT_EQ(r.exit_code, 1) << name << "\n" << r.output;
    EXPECT_NE(r.output.find((flipped / "adapter_model.safetensors").string() + ": checksum "), std::string::npos)
        << name << "\n" << r.output;
  }
  EXPECT_FALSE(fs::exists(tmp / "imported"));

  // --resume: the newest checkpoint's config names q_proj alone, its manifest agreeing.
  nlohmann::json config = nlohmann::json::parse(read_file(ckpt / "adapter_config.json"));
  config["target_modules"] = {"q_proj"};
  rewrite_listed(ckpt, "adapter_config.json", config.dump(2));
  const std::string resume = flags.substr(0, flags.find(" --lora_targets"));  // the checkpoint's targets, whatever
  r = run_command(kTrain + resume + " --out_dir " + (tmp / "run").string() + " --resume", tmp / "log_resume");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find((ckpt / "adapter_model.safetensors").string() +
                          ": tensor 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight' is not an adapter of " +
                          (ckpt / "adapter_config.json").string() + " (target_modules q_proj, r = 4)"),
            std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "run" / "ckpt" / "step_00000004"));

  // lora_alpha 0 in the adapter --lora_init continues: the file and its key.
  fs::create_directories(tmp / "alpha0");
  config["target_modules"] = {"q_proj", "v_proj"};
  config["lora_alpha"] = 0;
  std::ofstream(tmp / "alpha0" / "adapter_config.json") << config.dump(2);
  fs::copy_file(ckpt / "adapter_model.safetensors", tmp / "alpha0" / "adapter_model.safetensors");
  r = run_command(kTrain + flags + " --lora_init " + (tmp / "alpha0").string() + " --out_dir " + (tmp / "a0").string(),
                  tmp / "log_alpha");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: " + (tmp / "alpha0" / "adapter_config.json").string() +
                          ": field 'lora_alpha': expected a number above 0"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("option 'lora_alpha'"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace tuna
