// Multiple-choice and generative evaluation under mpirun, on the lm-eval fixture (tests/fixtures/mc_eval: a tiny LLaMA
// with its tokenizer, tasks of 2, 4 and 10 choices and generative ones): build/eval --tasks at dp 2 writes the
// per-choice log-likelihoods and the answers one rank does, and build/train --eval_tasks reports the same accuracies at dp 2 with ZeRO-3, tp 2 and tp 2 with sp as one
// rank at every validation, and so does pp 2 (the last stage's log-probs broadcast to every stage).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "data/shard.h"
#include "tests/dist/dist_test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::metrics_rows;
using testing_util::mpirun;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kFixture = "tests/fixtures/mc_eval";

std::vector<nlohmann::json> read_rows(const fs::path& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

TEST(DistEvalTasks, DataParallelEvalWritesOneRanksScores) {
  TempDir tmp("dist_eval_tasks");
  // The multiple-choice tasks and the generative ones (each rank answers every other record).
  const std::string eval = testing_util::build_dir() + "/eval --checkpoint " + kFixture + " --tasks " + kFixture +
                           "/tasks," + kFixture + "/gen/tasks --micro_batch 2 --threads 1 --quiet --output ";
  auto r = run_command(eval + (tmp / "one.jsonl").string(), tmp / "one_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(mpirun(2) + eval + (tmp / "dp2.jsonl").string(), tmp / "dp2_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\"ranks\":2"), std::string::npos) << r.output;
  const std::vector<nlohmann::json> one = read_rows(tmp / "one.jsonl"), dp2 = read_rows(tmp / "dp2.jsonl");
  ASSERT_GT(one.size(), 50u);
  ASSERT_EQ(one.size(), dp2.size());
  nlohmann::json ref;
  std::ifstream(kFixture + "/gen/reference.json") >> ref;
  int64_t answered = 0;
  for (size_t i = 0; i < one.size(); i++) {
    SCOPED_TRACE(one[i].dump());
    if (one[i].contains("answer")) {  // a generative record: lm-eval's answer, on one rank and at dp 2
      for (const nlohmann::json& e : ref.at("tasks").at(one[i].at("task").get<std::string>()).at("records"))
        if (e.at("id") == one[i].at("id")) {
          EXPECT_EQ(one[i].at("answer"), e.at("response"));
        }
      EXPECT_EQ(dp2[i].at("answer"), one[i].at("answer"));
      EXPECT_EQ(dp2[i].at("exact_match"), one[i].at("exact_match"));
      answered++;
      continue;
    }
    EXPECT_EQ(dp2[i].at("greedy"), one[i].at("greedy"));
    EXPECT_EQ(dp2[i].at("pred"), one[i].at("pred"));
    const auto a = one[i].at("loglikelihoods").get<std::vector<double>>();
    const auto b = dp2[i].at("loglikelihoods").get<std::vector<double>>();
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); k++) EXPECT_NEAR(b[k], a[k], 1e-6 * std::abs(a[k]));
  }
  EXPECT_EQ(answered, 60);
}

class DistTrainEvalTasks : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir("dist_train_eval_tasks");
    // Token shards over the fixture tokenizer's ids (512): random text, as learnable as needed for 3 steps.
    std::mt19937 rng(3);
    for (const char* name : {"train-00000.bin", "val-00000.bin"}) {
      ShardWriter w((tmp_->path / name).string(), 512, /*with_mask=*/false, 0);
      for (int doc = 0; doc < 24; doc++) {
        std::vector<int32_t> tokens;
        for (int i = 0; i < 60; i++) tokens.push_back(static_cast<int32_t>(rng() % 510));
        w.add_document(tokens);
      }
      w.finish();
    }
  }
  static void TearDownTestSuite() { delete tmp_; }
  static std::string flags(const std::string& tag, const std::string& extra) {
    return " --init " + kFixture + " --train_data " + (tmp_->path / "train-00000.bin").string() + " --val_data " +
           (tmp_->path / "val-00000.bin").string() + " --eval_tasks " + kFixture +
           "/tasks --seq_len 64 --steps 3 --lr 1e-3 --warmup_steps 1 --ckpt_every 0 --val_every 1 --val_batches 2"
           " --threads 1 --seed 5 --comm_timeout 60 --device cpu" + extra + " --out_dir " + (tmp_->path / tag).string();
  }
  static void expect_same_accuracy(const std::string& ref, const std::string& tag) {
    const auto a = metrics_rows(tmp_->path / ref / "metrics.jsonl", "eval_acc/all");
    const auto b = metrics_rows(tmp_->path / tag / "metrics.jsonl", "eval_acc/all");
    ASSERT_EQ(a.size(), 4u);  // steps 0 (the start), 1, 2 and 3 (the end)
    ASSERT_EQ(a.size(), b.size()) << tag;
    for (const auto& [step, want] : a) {
      for (const auto& [name, value] : want.items()) {
        if (!name.starts_with("eval_")) continue;
        EXPECT_EQ(b.at(step).at(name), value) << tag << " step " << step << " " << name;
      }
    }
  }
  static TempDir* tmp_;
};
TempDir* DistTrainEvalTasks::tmp_ = nullptr;

TEST_F(DistTrainEvalTasks, DataAndTensorParallelReportOneRanksAccuracy) {
  auto r = run_command(testing_util::build_dir() + "/train" + flags("one", " --micro_batch 4"), tmp_->path / "one_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("eval_tasks: 4 task(s)"), std::string::npos) << r.output;
  // fill.jsonl's continuations are whole sentences: those longer than the 64-token windows are counted and left out.
  EXPECT_NE(r.output.find("skipped: a choice longer than seq_len"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("all acc "), std::string::npos) << r.output;
  for (const auto& [tag, extra] : std::vector<std::pair<std::string, std::string>>{
           {"dp2z3", " --micro_batch 2 --zero 3"}, {"tp2", " --micro_batch 4 --tp 2"}, {"tp2sp", " --micro_batch 4 --tp 2 --sp"}}) {
    r = run_command(mpirun(2) + testing_util::build_dir() + "/train" + flags(tag, extra), tmp_->path / (tag + "_log"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_accuracy("one", tag);
  }
}

TEST_F(DistTrainEvalTasks, PipelineStagesReportOneRanksAccuracy) {
  auto r = run_command(testing_util::build_dir() + "/train" + flags("one_pp", " --micro_batch 2 --grad_accum 2"),
                       tmp_->path / "one_pp_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(mpirun(2) + testing_util::build_dir() + "/train" + flags("pp2", " --micro_batch 2 --grad_accum 2 --pp 2"),
                  tmp_->path / "pp2_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_accuracy("one_pp", "pp2");
}

}  // namespace
}  // namespace tuna
