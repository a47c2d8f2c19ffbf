// build/train with a preference objective under mpirun against one rank: dp 2 at ZeRO-3, tp 2 and tp 2 with sp (a full
// fine-tune, the reference precomputed by the ranks together), dp 2 at ZeRO-3 with LoRA (the reference the base with
// the adapters off), and pipeline stages: pp 2 with DPO (full, precomputed reference; LoRA, the base's forward down the
// stages; QLoRA), SimPO and ORPO, pp 2 x dp 2, pp 2 x tp 2 with sp, a resume at pp 2, and pp 4.
// Every run trains on the same global batch of 4 pair windows per step (one rank: micro_batch 4; dp 2: 2 each; tp 2:
// 4 on both; pp 2: 2 x grad_accum 2; pp 2 x dp 2: 1 x grad_accum 2 each; pp 4: 1 x 4); the pairs' sums then differ
// from one rank's only by fp32 summation order: relative 1e-5 on every step's loss, its reward metrics and the
// held-out ones, and (the pipelines) on the final weights or adapters as a relative norm.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "ckpt/checkpoint.h"  // load_weights
#include "ckpt/safetensors.h"
#include "data/shard.h"
#include "model/config.h"
#include "model/layout.h"
#include "tests/dist/dist_test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::metrics_rows;
using testing_util::mpirun;
using testing_util::read_file;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kTrain = testing_util::build_dir() + "/train";

// Learnable pairs (the chosen answer continues the prompt's arithmetic sequence), each pair its two documents.
void write_pairs(const fs::path& path, int n, uint32_t seed) {
  fs::create_directories(path.parent_path());
  std::mt19937 rng(seed);
  ShardWriter w(path.string(), 128, /*with_mask=*/true, 0, /*pairs=*/true);
  for (int i = 0; i < n; i++) {
    const int start = 3 + int(rng() % 60), stride = 1 + int(rng() % 5);
    std::vector<int32_t> prompt = {1};
    for (int j = 0; j < 4; j++) prompt.push_back(start + j * stride);
    std::vector<int32_t> chosen, rejected;
    for (int j = 4; j < 7; j++) chosen.push_back(start + j * stride);
    for (int j = 0; j < 3; j++) rejected.push_back(3 + int(rng() % 120));
    chosen.push_back(2), rejected.push_back(2);
    for (const auto* answer : {&chosen, &rejected}) {
      std::vector<int32_t> doc = prompt;
      std::vector<uint8_t> mask(prompt.size(), 0);
      for (int32_t t : *answer) doc.push_back(t), mask.push_back(1);
      w.add_document(doc, mask);
    }
  }
  w.finish();
}

class DistPreference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tmp_ = new TempDir("dist_preference"); }
  static void TearDownTestSuite() { delete tmp_; }

  // Each run its own copy of the data: each layout computes (and writes) its own precomputed reference.
  static std::string flags(const std::string& tag, const std::string& extra,
                           const std::string& objective = " --objective dpo --beta 0.2") {
    const fs::path data = *tmp_ / ("data_" + tag);
    write_pairs(data / "train-00000.bin", 40, 1);
    write_pairs(data / "val-00000.bin", 8, 2);
    // With adapters the base is a model directory (--init); a full fine-tune starts from a draw of the config.
    const bool lora = extra.find("--lora_rank") != std::string::npos;
    const bool own_model = extra.find("--model_config") != std::string::npos;  // extra names it
    return std::string(lora ? " --init tests/fixtures/llama32_tiny"
                            : own_model ? "" : " --model_config tests/fixtures/llama32_tiny/config.json") +
           objective + " --train_data " +
           (data / "train-00000.bin").string() + " --val_data " + (data / "val-00000.bin").string() +
           " --seq_len 48 --steps 6 --lr 3e-3 --warmup_steps 2 --ckpt_every 0 --val_every 3 --threads 1 --seed 11"
           " --comm_timeout 60 --device cpu" + extra + " --out_dir " + (*tmp_ / tag).string();
  }
  static void expect_follows(const std::string& ref, const std::string& tag) {
    for (const char* key : {"loss", "val_loss"}) {
      const auto a = metrics_rows(*tmp_ / ref / "metrics.jsonl", key), b = metrics_rows(*tmp_ / tag / "metrics.jsonl", key);
      ASSERT_FALSE(a.empty());
      ASSERT_EQ(a.size(), b.size()) << key;
      for (const auto& [step, want] : a)
        for (const auto& [name, value] : want.items()) {
          const bool metric = name == "loss" || name == "val_loss" || name.find("rewards/") != std::string::npos ||
                              name.find("logps/") != std::string::npos;
          if (!metric) continue;
          const double w = value.get<double>(), g = b.at(step).at(name).get<double>();
          EXPECT_NEAR(g, w, 1e-5 * std::max(1.0, std::abs(w))) << tag << " step " << step << " " << name;
        }
    }
  }
  // One rank's run, made once for the suite (several layouts follow the same reference).
  static void one_rank(const std::string& tag, const std::string& extra,
                       const std::string& objective = " --objective dpo --beta 0.2") {
    if (fs::exists(*tmp_ / tag / "metrics.jsonl")) return;
    const auto r = run_command(kTrain + flags(tag, extra, objective), *tmp_ / (tag + "_log"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  // The final weights (a full fine-tune: the model, every stage's rank files assembled) or adapters (PEFT's file) of
  // two runs, as a relative norm of their difference.
  static void expect_same_weights(const std::string& ref, const std::string& tag, bool lora,
                                  const std::string& config = "tests/fixtures/llama32_tiny/config.json") {
    const fs::path a = *tmp_ / ref / "ckpt" / "step_00000006", b = *tmp_ / tag / "ckpt" / "step_00000006";
    std::vector<float> wa, wb;
    if (lora) {
      const SafetensorsFile fa(a / "adapter_model.safetensors"), fb(b / "adapter_model.safetensors");
      ASSERT_EQ(fa.tensors().size(), fb.tensors().size()) << tag;
      for (const TensorInfo& t : fa.tensors()) {
        std::vector<float> x(t.numel), y(t.numel);
        fa.read_f32(t.name, t.shape, x.data());
        fb.read_f32(t.name, t.shape, y.data());
        wa.insert(wa.end(), x.begin(), x.end()), wb.insert(wb.end(), y.begin(), y.end());
      }
    } else {
      const ParamLayout layout(LlamaConfig::load(config));
      wa.resize(layout.total()), wb.resize(layout.total());
      load_weights(a, layout, wa.data());
      load_weights(b, layout, wb.data());
    }
    double diff = 0, norm = 0;
    for (size_t i = 0; i < wa.size(); i++)
      diff += double(wa[i] - wb[i]) * (wa[i] - wb[i]), norm += double(wa[i]) * wa[i];
    EXPECT_GT(norm, 0) << tag;
    EXPECT_LT(std::sqrt(diff / norm), 1e-5) << tag << ": final weights differ";
  }
  static TempDir* tmp_;
};
TempDir* DistPreference::tmp_ = nullptr;

TEST_F(DistPreference, DataParallelZero3AndTensorParallelFollowOneRank) {
  one_rank("one", " --micro_batch 4");
  auto r = run_command(mpirun(2) + kTrain + flags("dp2z3", " --micro_batch 2 --zero 3"), *tmp_ / "dp2z3_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_follows("one", "dp2z3");
  r = run_command(mpirun(2) + kTrain + flags("tp2", " --micro_batch 4 --tp 2"), *tmp_ / "tp2_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_follows("one", "tp2");
  r = run_command(mpirun(2) + kTrain + flags("tp2sp", " --micro_batch 4 --tp 2 --sp"), *tmp_ / "tp2sp_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_follows("one", "tp2sp");
}

const std::string kLora = " --lora_rank 4 --lora_alpha 8 --lr 2e-2";

TEST_F(DistPreference, LoraDataParallelZero3FollowsOneRank) {
  one_rank("lora_one", kLora + " --micro_batch 4");
  EXPECT_NE(read_file(*tmp_ / "lora_one_log").find("the base with the adapters off"), std::string::npos);
  const auto r = run_command(mpirun(2) + kTrain + flags("lora_dp2z3", kLora + " --micro_batch 2 --zero 3"),
                             *tmp_ / "lora_dp2z3_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_follows("lora_one", "lora_dp2z3");
}

// Two stages (the tied table's copy on the last one, its gradient exchanged): the last stage computes the log-probs,
// the loss and its token weights, the weighted backward flows back to the first; the precomputed reference's pass
// also runs down the stages, and rank 0 (the first stage) writes it. pp 2 x dp 2 at ZeRO-1 (ZeRO-2 and 3 do not run
// tied tables over stages), pp 2 x tp 2 with sp, and a resume.
TEST_F(DistPreference, DpoOverPipelineStagesFollowsOneRank) {
  one_rank("one", " --micro_batch 4");
  auto r = run_command(mpirun(2) + kTrain + flags("pp2", " --micro_batch 2 --grad_accum 2 --pp 2"), *tmp_ / "pp2_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("computed with the starting weights"), std::string::npos) << r.output;
  expect_follows("one", "pp2");
  expect_same_weights("one", "pp2", /*lora=*/false);
  r = run_command(mpirun(4) + kTrain + flags("pp2dp2", " --micro_batch 1 --grad_accum 2 --pp 2 --zero 1"),
                  *tmp_ / "pp2dp2_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_follows("one", "pp2dp2");
  expect_same_weights("one", "pp2dp2", /*lora=*/false);
  // Stages of two tp ranks each, with sp: the last stage's vocab-parallel log-probs give both its ranks the sums.
  r = run_command(mpirun(4) + kTrain + flags("pp2tp2sp", " --micro_batch 2 --grad_accum 2 --pp 2 --tp 2 --sp"),
                  *tmp_ / "pp2tp2sp_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_follows("one", "pp2tp2sp");
  expect_same_weights("one", "pp2tp2sp", /*lora=*/false);
  // A stop after step 3 and --resume over the same stages: the reference file is reused, the run follows one rank.
  r = run_command(mpirun(2) + kTrain + flags("pp2_resume", " --micro_batch 2 --grad_accum 2 --pp 2 --stop_at_step 3"),
                  *tmp_ / "pp2_resume_log_a");
  ASSERT_EQ(r.exit_code, 75) << r.output;
  r = run_command(mpirun(2) + kTrain + flags("pp2_resume", " --micro_batch 2 --grad_accum 2 --pp 2 --resume"),
                  *tmp_ / "pp2_resume_log_b");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(reused)"), std::string::npos) << r.output;
  expect_follows("one", "pp2_resume");
  expect_same_weights("one", "pp2_resume", /*lora=*/false);
}

// Four stages of a four-layer model (the tied table on the first and last): the two middle stages run neither the
// embedding nor the head, and the first holds up to four micro-batches in flight.
TEST_F(DistPreference, DpoOverFourPipelineStagesFollowsOneRank) {
  nlohmann::json c = nlohmann::json::parse(read_file("tests/fixtures/llama32_tiny/config.json"));
  c["num_hidden_layers"] = 4;
  fs::create_directories(*tmp_ / "four_layers");
  std::ofstream(*tmp_ / "four_layers" / "config.json") << c.dump();
  const std::string config = (*tmp_ / "four_layers" / "config.json").string();
  one_rank("four_one", " --model_config " + config + " --micro_batch 4");
  const auto r = run_command(mpirun(4) + kTrain + flags("four_pp4", " --model_config " + config +
                                                                       " --micro_batch 1 --grad_accum 4 --pp 4"),
                             *tmp_ / "four_pp4_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_follows("four_one", "four_pp4");
  expect_same_weights("four_one", "four_pp4", /*lora=*/false, config);
}

// With adapters the reference is the base's forward down the stages with the adapters off, before the step's 1F1B
// passes; with dropout the masks are keyed by the micro-batch's index in the step, as on one rank at the same
// micro-batches. pp 2 x dp 2 at ZeRO-2 over the stages' adapters (no dropout: the dp ranks draw their own masks), and
// QLoRA (an nf4 base) at pp 2.
TEST_F(DistPreference, LoraDpoOverPipelineStagesFollowsOneRank) {
  const std::string dropout = " --lora_dropout 0.1 --micro_batch 2 --grad_accum 2";
  one_rank("lora_one_dropout", kLora + dropout);
  auto r = run_command(mpirun(2) + kTrain + flags("lora_pp2", kLora + dropout + " --pp 2"), *tmp_ / "lora_pp2_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the base with the adapters off"), std::string::npos) << r.output;
  expect_follows("lora_one_dropout", "lora_pp2");
  expect_same_weights("lora_one_dropout", "lora_pp2", /*lora=*/true);
  one_rank("lora_one", kLora + " --micro_batch 4");
  r = run_command(mpirun(4) + kTrain + flags("lora_pp2dp2", kLora + " --micro_batch 1 --grad_accum 2 --pp 2 --zero 2"),
                  *tmp_ / "lora_pp2dp2_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_follows("lora_one", "lora_pp2dp2");
  expect_same_weights("lora_one", "lora_pp2dp2", /*lora=*/true);
  // QLoRA: each stage quantizes its layers' projections as one rank does, and the reference is that base's forward.
  one_rank("qlora_one", kLora + " --base_quant nf4 --micro_batch 4");
  r = run_command(mpirun(2) + kTrain + flags("qlora_pp2", kLora + " --base_quant nf4 --micro_batch 2 --grad_accum 2 --pp 2"),
                  *tmp_ / "qlora_pp2_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_follows("qlora_one", "qlora_pp2");
  expect_same_weights("qlora_one", "qlora_pp2", /*lora=*/true);
}

// The objectives without a reference: SimPO (with CPO's SFT term, rpo_alpha) and ORPO (its NLL over the chosen
// sequence), whose NLL token weights take the step's token count, summed before the stages run.
TEST_F(DistPreference, SimpoAndOrpoOverPipelineStagesFollowOneRank) {
  for (const auto& [tag, objective] :
       {std::pair<std::string, std::string>{"simpo", " --objective simpo --beta 2 --simpo_gamma 0.5 --rpo_alpha 0.3"},
        std::pair<std::string, std::string>{"orpo", " --objective orpo --beta 0.2"}}) {
    one_rank(tag + "_one", " --micro_batch 4", objective);
    const auto r = run_command(mpirun(2) + kTrain + flags(tag + "_pp2", " --micro_batch 2 --grad_accum 2 --pp 2", objective),
                               *tmp_ / (tag + "_pp2_log"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_follows(tag + "_one", tag + "_pp2");
    expect_same_weights(tag + "_one", tag + "_pp2", /*lora=*/false);
  }
}

}  // namespace
}  // namespace tuna
