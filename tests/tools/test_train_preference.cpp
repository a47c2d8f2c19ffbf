// build/train with a preference objective, end to end on the CPU: DPO with LoRA (the base as the reference), SimPO and
// ORPO follow TRL 0.13.0 for 10 AdamW steps (tests/fixtures/preference_llama2_tiny); a full fine-tune's DPO with the precomputed
// reference logs TRL's metrics per step and on the held-out pairs, resumes bit for bit, reuses the reference on a
// second run and refuses it for another model; QLoRA's DPO takes the quantized base with the adapters off as its
// reference; what is not wired is refused through the support table.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "ckpt/checkpoint.h"  // load_weights, save_checkpoint: the dequantized base
#include "ckpt/safetensors.h"
#include "data/shard.h"
#include "model/objective.h"
#include "model/quantized_weights.h"  // dequantize_quantized
#include "model/support.h"
#include "tests/test_util.h"
#include "tests/tools/tools_test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kTrain = testing_util::build_dir() + "/train";

// metrics.jsonl's rows.
std::vector<nlohmann::json> rows(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  std::istringstream in(read_file(metrics));
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}
// step -> the training row (the last one logged for the step).
std::map<int64_t, nlohmann::json> steps(const fs::path& metrics) {
  std::map<int64_t, nlohmann::json> out;
  for (const nlohmann::json& r : rows(metrics))
    if (r.contains("loss")) out[r["step"]] = r;
  return out;
}

// A pair shard: each pair its chosen then its rejected document, the prompt's tokens unmasked.
struct Pair {
  std::vector<int32_t> prompt, chosen, rejected;
};
void write_pairs(const fs::path& path, const std::vector<Pair>& pairs) {
  fs::create_directories(path.parent_path());
  ShardWriter w(path.string(), 128, /*with_mask=*/true, 0, /*pairs=*/true);
  for (const Pair& p : pairs)
    for (const std::vector<int32_t>* answer : {&p.chosen, &p.rejected}) {
      std::vector<int32_t> doc = p.prompt;
      std::vector<uint8_t> mask(p.prompt.size(), 0);
      for (int32_t t : *answer) doc.push_back(t), mask.push_back(1);
      w.add_document(doc, mask);
    }
  w.finish();
}

// Learnable pairs: the chosen answer continues the prompt's arithmetic sequence, the rejected one does not.
std::vector<Pair> sequence_pairs(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Pair> out;
  for (int i = 0; i < n; i++) {
    Pair p;
    const int start = 3 + int(rng() % 60), stride = 1 + int(rng() % 5);
    p.prompt = {1};
    for (int j = 0; j < 4; j++) p.prompt.push_back(start + j * stride);
    for (int j = 4; j < 7; j++) p.chosen.push_back(start + j * stride);
    for (int j = 0; j < 3; j++) p.rejected.push_back(3 + int(rng() % 120));
    p.chosen.push_back(2), p.rejected.push_back(2);
    out.push_back(p);
  }
  return out;
}

// The fixture's cases that need no reference model besides the trainer's own, through build/train: DPO with adapters
// (--lora_init: the fixture's starting adapter; the reference the base with it off), SimPO and ORPO of the whole model.
// The fixture's base (--init), its three pairs in one window, its schedule: every step's loss, gradient norm and TRL
// metric equal TRL's to 1e-5. (The fixture's full fine-tune DPO cases take a perturbed second model as the reference,
// which a run does not have: the objective's tests hold them.)
class TrainFollowsTrl : public testing::TestWithParam<std::string> {};

TEST_P(TrainFollowsTrl, TenAdamWSteps) {
  TempDir tmp("trainpref_trl");
  std::ifstream in("tests/fixtures/preference_llama2_tiny/reference.json");
  const nlohmann::json fx = nlohmann::json::parse(in);
  const nlohmann::json& c = fx.at("cases").at(GetParam());
  std::vector<Pair> pairs;
  for (const auto& p : fx.at("pairs"))
    pairs.push_back({p.at("prompt").get<std::vector<int32_t>>(), p.at("chosen").get<std::vector<int32_t>>(),
                     p.at("rejected").get<std::vector<int32_t>>()});
  write_pairs(tmp / "data" / "train-00000.bin", pairs);
  const std::string flags =
      " --init tests/fixtures/llama2_tiny" +
      std::string(c.at("lora").get<bool>() ? " --lora_init tests/fixtures/lora_llama2_tiny" : "") + " --objective " +
      c.at("objective").get<std::string>() + " --beta " + c.at("beta").dump() + " --simpo_gamma " +
      c.at("simpo_gamma").dump() + " --train_data " + (tmp / "data" / "train-00000.bin").string() +
      " --seq_len 64 --micro_batch 1 --grad_accum 1 --steps " + fx.at("steps").dump() + " --lr " + fx.at("lr").dump() +
      " --min_lr " + fx.at("min_lr").dump() + " --warmup_steps " + fx.at("warmup_steps").dump() +
      " --schedule cosine --beta1 " + fx.at("beta1").dump() + " --beta2 " + fx.at("beta2").dump() + " --eps " +
      fx.at("eps").dump() + " --weight_decay " + fx.at("weight_decay").dump() +
      " --grad_clip 0 --ckpt_every 0 --threads 2 --device cpu --out_dir " + (tmp / "run").string();
  const auto r = run_command(kTrain + flags, tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  if (c.at("lora").get<bool>()) {
    EXPECT_NE(r.output.find("reference: the base with the adapters off"), std::string::npos) << r.output;
  }
  const auto got = steps(tmp / "run" / "metrics.jsonl");
  ASSERT_EQ(got.size(), 10u);
  for (int64_t s = 0; s < 10; s++) {
    const nlohmann::json& row = got.at(s + 1);
    const double want_loss = c.at("train_losses")[s], want_norm = c.at("grad_norms")[s];
    EXPECT_NEAR(row.at("loss").get<double>(), want_loss, 1e-5 * std::max(1e-2, want_loss)) << "step " << s + 1;
    EXPECT_NEAR(row.at("grad_norm").get<double>(), want_norm, 1e-5 * std::max(1e-2, want_norm)) << "step " << s + 1;
    EXPECT_EQ(row.at("pairs").get<int64_t>(), 3) << "pairs of step " << s + 1;
    for (const char* key : {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                            "logps/chosen", "logps/rejected"})
      ASSERT_TRUE(row.contains(key)) << key;
    for (const auto& [key, want] : c.at("step_metrics")[s].items()) {
      // TRL's mean logits, ORPO's log-odds, CPO's nll_loss at cpo_alpha 0: not tuna's metrics.
      if (!row.contains(key)) continue;
      EXPECT_NEAR(row.at(key).get<double>(), want.get<double>(), 1e-5 * std::max(1.0, std::abs(want.get<double>())))
          << key << " step " << s + 1;
    }
  }
  // The first step's metrics are the fixture's (TRL's, before any update).
  for (const auto& [key, want] : c.at("metrics").items()) {
    if (!got.at(1).contains(key)) continue;
    EXPECT_NEAR(got.at(1).at(key).get<double>(), want.get<double>(), 1e-5 * std::max(1.0, std::abs(want.get<double>())))
        << key;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixture, TrainFollowsTrl, testing::Values("lora_dpo_sigmoid", "simpo", "orpo"));

std::string full_flags(const fs::path& data, int64_t steps_total) {
  return " --model_config tests/fixtures/llama32_tiny/config.json --objective dpo --beta 0.2 --train_data '" +
         (data / "train-*.bin").string() + "' --val_data " + (data / "val-00000.bin").string() +
         " --seq_len 48 --micro_batch 2 --grad_accum 2 --steps " + std::to_string(steps_total) +
         " --lr 3e-3 --warmup_steps 2 --ckpt_every 3 --val_every 3 --threads 2 --seed 5 --device cpu";
}

// A full fine-tune's DPO, its reference precomputed with the starting weights: the first step's loss is ln 2 (the
// policy is the reference), the metrics are logged per step and on the held-out pairs, the reward accuracy rises on
// learnable pairs, a kill and --resume equals straight through, a second run reuses the reference, and a run from
// other starting weights is refused it, naming the file and what changed.
TEST(TrainPreference, FullFineTuneDpoWithPrecomputedReferenceResumesAndReuses) {
  TempDir tmp("trainpref_full");
  write_pairs(tmp / "data" / "train-00000.bin", sequence_pairs(24, 1));
  write_pairs(tmp / "data" / "val-00000.bin", sequence_pairs(8, 2));
  const std::string flags = full_flags(tmp / "data", 12);

  auto r = run_command(kTrain + flags + " --out_dir " + (tmp / "straight").string(), tmp / "log_a");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("computed with the starting weights"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "data" / "reference-logps.bin"));
  EXPECT_NE(r.output.find("reward acc"), std::string::npos) << r.output;
  const auto straight = steps(tmp / "straight" / "metrics.jsonl");
  ASSERT_EQ(straight.size(), 12u);
  EXPECT_NEAR(straight.at(1).at("loss").get<double>(), std::log(2.0), 1e-5);
  EXPECT_NEAR(straight.at(1).at("rewards/margins").get<double>(), 0.0, 1e-5);
  for (const char* key : {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                          "logps/rejected"})
    EXPECT_TRUE(straight.at(12).contains(key)) << key;
  EXPECT_LT(straight.at(12).at("loss").get<double>(), std::log(2.0) - 0.1);
  std::vector<nlohmann::json> val;
  for (const nlohmann::json& row : rows(tmp / "straight" / "metrics.jsonl"))
    if (row.contains("val_loss")) val.push_back(row);
  ASSERT_GE(val.size(), 2u);
  EXPECT_EQ(val.front().at("step"), 0);
  EXPECT_EQ(val.front().at("val_pairs"), 8);
  EXPECT_NEAR(val.front().at("val_rewards/margins").get<double>(), 0.0, 1e-5);  // the reference itself
  EXPECT_GT(val.back().at("val_rewards/margins").get<double>(), 0.0);
  EXPECT_TRUE(val.back().contains("val_rewards/accuracies"));
  EXPECT_TRUE(fs::exists(tmp / "data" / "reference-logps.bin"));
  EXPECT_NE(read_file(tmp / "straight" / "report.html").find("rewards"), std::string::npos);

  // Killed after step 7's log, before its checkpoint: the resume starts at step 6, reusing the reference.
  r = run_command(kTrain + flags + " --out_dir " + (tmp / "split").string() + " --stop_at_step 7", tmp / "log_b");
  ASSERT_EQ(r.exit_code, 75) << r.output;
  EXPECT_NE(r.output.find("(reused)"), std::string::npos) << r.output;  // the second run's reference
  fs::remove_all(tmp / "split" / "ckpt" / "step_00000007");
  r = run_command(kTrain + flags + " --out_dir " + (tmp / "split").string() + " --resume", tmp / "log_c");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  const auto split = steps(tmp / "split" / "metrics.jsonl");
  ASSERT_EQ(split.size(), 12u);
  for (int64_t s = 1; s <= 12; s++)
    for (const char* key : {"loss", "grad_norm", "pairs", "rewards/chosen", "rewards/rejected", "rewards/margins",
                            "rewards/accuracies", "logps/chosen", "logps/rejected"})
      EXPECT_EQ(split.at(s).at(key).dump(), straight.at(s).at(key).dump()) << "step " << s << " " << key;
  const fs::path a = tmp / "straight" / "ckpt" / "step_00000012", b = tmp / "split" / "ckpt" / "step_00000012";
  EXPECT_EQ(read_file(a / "model.safetensors"), read_file(b / "model.safetensors"));
  EXPECT_EQ(read_file(a / "optimizer.safetensors"), read_file(b / "optimizer.safetensors"));

  // Other starting weights (another draw): the file is refused, never silently reused or overwritten.
  r = run_command(kTrain + flags + " --seed 6 --out_dir " + (tmp / "other").string(), tmp / "log_d");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("another model"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("reference-logps.bin"), std::string::npos) << r.output;
  // A resume whose reference is gone cannot compute it again: it says so.
  fs::remove(tmp / "data" / "reference-logps.bin");
  r = run_command(kTrain + flags + " --steps 13 --out_dir " + (tmp / "split").string() + " --resume", tmp / "log_e");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no longer holds the starting weights"), std::string::npos) << r.output;
}

// What is not wired is refused with the reason; options and data of the wrong kind are refused by name.
// QLoRA's DPO (--base_quant nf4): the reference is the quantized base with the adapters off, the base the policy runs
// on. So the run equals DPO with LoRA on dequantize(quantize(base)) written out in fp32, bit for bit (every step's loss
// and metrics, the held-out ones, the final adapters), and the first step's rewards are exactly 0 (B starts at 0: the
// policy is its reference; against the unquantized base they would not be).
TEST(TrainPreference, QloraDpoTakesTheQuantizedBaseAsItsReference) {
  TempDir tmp("trainpref_qlora");
  write_pairs(tmp / "data" / "train-00000.bin", sequence_pairs(24, 3));
  write_pairs(tmp / "data" / "val-00000.bin", sequence_pairs(6, 4));
  const std::string flags = " --objective dpo --beta 0.2 --train_data " + (tmp / "data" / "train-00000.bin").string() +
                            " --val_data " + (tmp / "data" / "val-00000.bin").string() +
                            " --seq_len 48 --micro_batch 2 --grad_accum 2 --steps 6 --lr 2e-2 --warmup_steps 2"
                            " --ckpt_every 0 --val_every 3 --threads 2 --seed 5 --device cpu"
                            " --lora_rank 4 --lora_alpha 8 --lora_dropout 0.1 --lora_targets q_proj,v_proj,down_proj";
  const LlamaConfig config = LlamaConfig::load("tests/fixtures/llama32_tiny");
  const ParamLayout layout(config);
  std::vector<float> params(layout.total());
  load_weights("tests/fixtures/llama32_tiny", layout, params.data());
  for (const ParamTensor& t : layout.tensors()) dequantize_quantized(t, BaseQuant::Nf4, params.data() + t.offset);
  const nlohmann::json config_json = read_config_json("tests/fixtures/llama32_tiny");
  const fs::path dequantized = save_checkpoint(tmp / "dequantized", 0, layout,
                                               CheckpointContents{&config_json, params.data(), {}, nlohmann::json{{"step", 0}}, {}}, 0);

  const fs::path quantized = tmp / "quantized", plain = tmp / "plain";
  auto r = run_command(kTrain + " --init tests/fixtures/llama32_tiny --base_quant nf4" + flags + " --out_dir " +
                           quantized.string(), tmp / "log_q");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("reference: the base with the adapters off"), std::string::npos) << r.output;
  r = run_command(kTrain + " --init " + dequantized.string() + flags + " --out_dir " + plain.string(), tmp / "log_p");
  ASSERT_EQ(r.exit_code, 0) << r.output;

  const std::vector<nlohmann::json> q = rows(quantized / "metrics.jsonl"), p = rows(plain / "metrics.jsonl");
  ASSERT_EQ(q.size(), p.size());
  const std::vector<std::string> keys = {"loss", "val_loss", "grad_norm", "rewards/chosen", "rewards/rejected",
                                         "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"};
  int compared = 0;
  for (size_t i = 0; i < q.size(); i++)
    for (const std::string& key : keys) {
      if (!p[i].contains(key)) continue;
      ASSERT_TRUE(q[i].contains(key)) << key << " row " << i;
      EXPECT_EQ(q[i][key].get<double>(), p[i][key].get<double>()) << key << " row " << i;
      compared++;
    }
  EXPECT_GT(compared, 6 * 8);
  const auto got = steps(quantized / "metrics.jsonl");
  ASSERT_EQ(got.size(), 6u);
  EXPECT_EQ(got.at(1).at("rewards/chosen").get<double>(), 0.0);
  EXPECT_EQ(got.at(1).at("rewards/rejected").get<double>(), 0.0);
  EXPECT_NEAR(got.at(1).at("loss").get<double>(), std::log(2.0), 1e-6);
  EXPECT_NE(got.at(6).at("rewards/margins").get<double>(), 0.0);  // the adapters trained

  // The final adapters, file for file.
  const auto tensors = [](const fs::path& dir) { return testing_util::safetensors_tensors(dir); };
  const auto adapters = tensors(quantized / "ckpt" / "step_00000006");
  ASSERT_FALSE(adapters.empty());
  EXPECT_TRUE(adapters == tensors(plain / "ckpt" / "step_00000006"));
  EXPECT_EQ(nlohmann::json::parse(read_file(quantized / "ckpt" / "step_00000006" / "base_model.json")).value("quantization", ""),
            "nf4");
}

TEST(TrainPreference, RefusalsNameTheOptionAndTheWayOut) {
  TempDir tmp("trainpref_refuse");
  write_pairs(tmp / "pairs" / "train-00000.bin", sequence_pairs(4, 3));
  testing_util::write_test_shards(tmp / "plain");
  const std::string base = " --model_config tests/fixtures/llama32_tiny/config.json --seq_len 48 --micro_batch 1"
                           " --steps 1 --threads 2 --device cpu";
  const auto refused = [&](const std::string& flags, const std::string& want, const char* name) {
    const auto r = run_command(kTrain + base + flags + " --out_dir " + (tmp / name).string(),
                               tmp / (std::string(name) + "_log"));
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_NE(r.output.find(want), std::string::npos) << flags << "\n" << r.output;
  };
  const std::string pairs = " --train_data " + (tmp / "pairs" / "train-00000.bin").string();
  refused(pairs + " --objective dpo --reference model", "--reference precompute", "model");
  refused(pairs + " --objective dpo --reference model", "base with the adapters off", "model2");
  refused(pairs + " --objective simpo --loss_type ipo", "option 'loss_type'", "loss_type");
  refused(pairs, "which --objective sft does not train on", "sft_on_pairs");
  refused(" --train_data " + (tmp / "plain" / "train-00000.bin").string() + " --objective orpo",
          "build/prepare --preference", "orpo_on_plain");

  // The support table's verdicts: both devices run every layout.
  const ObjectiveConfig dpo = make_objective_config("dpo", 0.1, "sigmoid", 0.5, 0, "auto", false);
  const ObjectiveConfig sft = make_objective_config("sft", 0.1, "sigmoid", 0.5, 0, "auto", false);
  MemoryLayout one;
  MemoryLayout tp = one;
  tp.tp = 2, tp.sp = true;
  for (const Device device : {Device::Cpu, Device::Cuda}) {
    EXPECT_TRUE(objective_support(dpo, one, device).runs());
    EXPECT_TRUE(objective_support(sft, one, device).runs());
    EXPECT_TRUE(objective_support(dpo, tp, device).runs());
  }
  MemoryLayout pp = one;
  pp.pp = 2;
  EXPECT_TRUE(objective_support(dpo, pp, Device::Cpu).runs());  // tests/dist/test_train_preference_dist.cpp
  EXPECT_TRUE(objective_support(dpo, pp, Device::Cuda).runs());  // tests/engine/preference_ranks_test_util.h
}

}  // namespace
}  // namespace tuna
