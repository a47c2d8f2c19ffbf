// build/eval end to end: the loss it prints is the model's loss over every window of the shards (the same
// numbers the CPU model computes in process), and bad input fails with a message naming it. --tasks on the lm-eval
// fixture (tests/fixtures/mc_eval): the metrics line and --output rows, the shared context and packing giving the
// same, and a bad record named by file and line, or counted by reason under --skip_bad_records.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>

#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/loader.h"
#include "ckpt/checkpoint.h"
#include "model/config.h"
#include "engine/engine.h"  // resolve_device
#include "model/llama.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kEval = testing_util::build_dir() + "/eval";
const fs::path kModel = "tests/fixtures/llama2_tiny";

// The last line of build/eval's output: its JSON record.
nlohmann::json json_line(const std::string& output) {
  const size_t end = output.find_last_not_of('\n');
  const size_t begin = output.rfind('\n', end);
  return nlohmann::json::parse(output.substr(begin == std::string::npos ? 0 : begin + 1, end - begin));
}

TEST(Eval, LossIsTheModelsOverEveryWindow) {
  TempDir tmp("eval");
  testing_util::write_test_shards(tmp / "data");
  const std::string data = (tmp / "data" / "val-00000.bin").string();
  auto r = run_command(kEval + " --checkpoint " + kModel.string() + " --data " + data +
                           " --seq_len 16 --micro_batch 3 --threads 2 --device cpu",
                       tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json got = json_line(r.output);

  const LlamaConfig config = LlamaConfig::load(kModel.string());
  Llama model(config, 3, 16);
  load_weights(kModel, model.layout(), model.params.data());
  LoaderOptions lo;
  lo.seq_len = 16, lo.micro_batch = 3, lo.vocab_size = config.vocab_size, lo.eval = true;
  DataLoader loader({data}, lo);
  std::vector<int32_t> inputs(48), targets(48), positions(48);
  LossSum total;
  int windows = 0;
  // A model tuna did not train: the default document mode (mask, restarted positions), as the model's own default.
  while (loader.next(inputs.data(), targets.data(), positions.data())) {
    const LossSum l = model.forward_loss(inputs.data(), targets.data(), 3, 16, positions.data());
    total.sum += l.sum, total.count += l.count, windows += 3;
  }
  ASSERT_GT(total.count, 0);
  EXPECT_EQ(got["tokens"].get<int64_t>(), total.count);
  EXPECT_NEAR(got["loss"].get<double>(), total.sum / total.count, 1e-12 * total.sum / total.count);
  EXPECT_NEAR(got["perplexity"].get<double>(), std::exp(total.sum / total.count), 1e-9);
  EXPECT_EQ(got["device"], "cpu");
  EXPECT_EQ(got["document_mask"], true);
  EXPECT_EQ(got["document_positions"], "restart");
  EXPECT_NE(r.output.find(std::to_string(loader.total_windows()) + " windows of 16"), std::string::npos) << r.output;
  EXPECT_LT(static_cast<int>(loader.total_windows()), windows);  // 32 windows in batches of 3: the last batch was padded
}

TEST(Eval, BadInputFailsNamingIt) {
  TempDir tmp("evalbad");
  testing_util::write_test_shards(tmp / "data");
  const std::string data = " --data " + (tmp / "data" / "val-00000.bin").string() + " --seq_len 16";
  auto r = run_command(kEval + " --checkpoint " + (tmp / "nowhere").string() + data + " --device cpu", tmp / "log1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find((tmp / "nowhere").string()), std::string::npos) << r.output;

  r = run_command(kEval + " --checkpoint " + kModel.string() + data + " --device gpu", tmp / "log2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("expected auto, cpu or cuda, found 'gpu'"), std::string::npos) << r.output;

  if (resolve_device("auto") == Device::Cpu) {
    r = run_command(kEval + " --checkpoint " + kModel.string() + data + " --device cuda", tmp / "log3");
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find("--device cpu"), std::string::npos) << r.output;
  }

  // Windows longer than the shard holds: one window, padded after its last token, scores every target once
  // (llama32_tiny allows 131072 positions).
  r = run_command(kEval + " --checkpoint tests/fixtures/llama32_tiny --data " + (tmp / "data" / "val-00000.bin").string() +
                      " --seq_len 1000 --device cpu",
                  tmp / "log4");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(json_line(r.output)["tokens"].get<int64_t>(),
            static_cast<int64_t>(ShardReader((tmp / "data" / "val-00000.bin").string()).token_count()) - 1)
      << r.output;

  // A FIFO as data: refused by name instead of blocking forever in open().
  ASSERT_EQ(::mkfifo((tmp / "pipe.bin").c_str(), 0600), 0);
  r = run_command("timeout 60 " + kEval + " --checkpoint " + kModel.string() + " --data " + (tmp / "pipe.bin").string() +
                      " --seq_len 16 --device cpu",
                  tmp / "log5");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("is a FIFO (named pipe), not a regular file"), std::string::npos) << r.output;

  // A model far larger than this machine: the allocation is refused before it is made, named with its size
  // (instead of std::bad_alloc without a message, or the OOM killer).
  nlohmann::json cfg = nlohmann::json::parse(testing_util::read_file(kModel / "config.json"));
  cfg["hidden_size"] = 1 << 18, cfg["intermediate_size"] = 1 << 18, cfg["num_hidden_layers"] = 64;
  cfg["num_attention_heads"] = 1 << 10, cfg["num_key_value_heads"] = 1 << 10, cfg["head_dim"] = 1 << 8;
  fs::create_directories(tmp / "huge");
  std::ofstream(tmp / "huge" / "config.json") << cfg.dump();
  r = run_command(kEval + " --checkpoint " + (tmp / "huge").string() + data + " --device cpu", tmp / "log6");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: out of memory: allocating the model's weights"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("available"), std::string::npos) << r.output;
  // Windows longer than the model's positions (llama2_tiny: 256): refused, saying how to extend the context.
  r = run_command(kEval + " --checkpoint " + kModel.string() + data.substr(0, data.find(" --seq_len")) +
                      " --seq_len 1000 --device cpu",
                  tmp / "log5");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("1000 tokens is more than the model's max_position_embeddings 256"), std::string::npos)
      << r.output;
}

// Without --seq_len, eval scores the checkpoint's training windows and so reproduces the trainer's own
// validation loss of the same weights; a directory gives its val-* shards; ckpt/latest names the checkpoint.
TEST(Eval, DefaultsToTheTrainingSeqLenAndMatchesTheTrainersValidation) {
  TempDir tmp("evaltrained");
  testing_util::write_test_shards(tmp / "data");
  const fs::path run = tmp / "run";
  auto r = run_command(testing_util::build_dir() + "/train --model_config tests/fixtures/llama32_tiny/config.json"
                           " --train-data " + (tmp / "data").string() + " --val-data " + (tmp / "data").string() +
                           " --seq-len 24 --micro-batch 2 --steps 3 --lr 3e-3 --threads 2 --device cpu --out-dir " + run.string(),
                       tmp / "train_log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  double trainer_val = NAN;
  std::istringstream metrics(testing_util::read_file(run / "metrics.jsonl"));
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("val_loss") && j["step"] == 3) trainer_val = j["val_loss"].get<double>();
  }
  ASSERT_FALSE(std::isnan(trainer_val));

  r = run_command(kEval + " --checkpoint " + (run / "ckpt" / "latest").string() + " --data " + (tmp / "data").string() +
                      " --micro-batch 4 --threads 2 --device cpu",
                  tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json got = json_line(r.output);
  EXPECT_EQ(got["seq_len"], 24);
  EXPECT_EQ(got["checkpoint"], (run / "ckpt" / "step_00000003").string());
  EXPECT_NEAR(got["loss"].get<double>(), trainer_val, 1e-6 * trainer_val);
  EXPECT_EQ(got["document_mask"], true);  // the run's (default) document mode, from its state.json
  EXPECT_NE(r.output.find("eval: loading "), std::string::npos) << r.output;

  // The same windows attending across documents: another loss (the shards' windows hold 1-2 documents).
  r = run_command(kEval + " --checkpoint " + (run / "ckpt" / "latest").string() + " --data " + (tmp / "data").string() +
                      " --micro-batch 4 --threads 2 --device cpu --document_mask false --document_positions continue",
                  tmp / "log_unmasked");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(json_line(r.output)["document_mask"], false);
  EXPECT_GT(std::abs(json_line(r.output)["loss"].get<double>() - trainer_val), 1e-4 * trainer_val);
  EXPECT_NE(r.output.find("(the checkpoint's training seq_len)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("in 1 shard(s)"), std::string::npos) << r.output;  // val-00000.bin only

  // A model tuna did not train: 1024, or its max_position_embeddings when fewer (llama2_tiny: 256).
  r = run_command(kEval + " --checkpoint " + kModel.string() + " --data " + (tmp / "data").string() + " --device cpu --quiet",
                  tmp / "log2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(json_line(r.output)["seq_len"], 256);
  EXPECT_EQ(r.output.find("eval: "), std::string::npos) << r.output;  // --quiet
}

}  // namespace
}  // namespace tuna

namespace tuna {
namespace {

// A LoRA checkpoint is scored as its base with the adapters merged on load: the same loss as merge-lora's model
// (fp32: the same weights), not the base's; --base takes the base from elsewhere, held to the recorded checksum.
TEST(Eval, LoraCheckpointIsItsMergedModel) {
  TempDir tmp("eval_lora");
  testing_util::write_test_shards(tmp / "data");
  const std::string data = (tmp / "data" / "val-00000.bin").string();
  const std::string convert = testing_util::build_dir() + "/convert";
  const std::string ckpt = (tmp / "ckpt").string(), merged = (tmp / "merged").string();
  auto r = run_command(convert + " peft-to-tuna tests/fixtures/lora_llama2_tiny " + ckpt + " --base " + kModel.string(),
                       tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(convert + " merge-lora " + ckpt + " " + merged + " --dtype fp32", tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto loss = [&](const std::string& args) {
    auto e = run_command(kEval + " " + args + " --data " + data + " --seq_len 32 --device cpu --threads 2 --quiet",
                         tmp / "eval.log");
    EXPECT_EQ(e.exit_code, 0) << e.output;
    return e.exit_code == 0 ? json_line(e.output)["loss"].get<double>() : NAN;
  };
  const double lora = loss("--checkpoint " + ckpt), plain = loss("--checkpoint " + merged);
  EXPECT_EQ(lora, plain);
  EXPECT_GT(std::fabs(lora - loss("--checkpoint " + kModel.string())), 1e-3);  // the adapters change the model
  // --base: another copy of the same weights is that base; a changed one is refused naming both.
  const fs::path copy = tmp / "base";
  fs::create_directories(copy);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(kModel / f, copy / f);
  EXPECT_EQ(loss("--checkpoint " + ckpt + " --base " + copy.string()), lora);
  {
    std::fstream f(copy / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);
    const float x = 0.125f;
    f.write(reinterpret_cast<const char*>(&x), 4);
  }
  r = run_command(kEval + " --checkpoint " + ckpt + " --base " + copy.string() + " --data " + data + " --device cpu",
                  tmp / "log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("has changed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(copy.string()), std::string::npos) << r.output;
  r = run_command(kEval + " --checkpoint " + merged + " --base " + copy.string() + " --data " + data + " --device cpu",
                  tmp / "log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("not a LoRA checkpoint"), std::string::npos) << r.output;
}

TEST(Eval, TasksScoreTheFixtureAndNameBadRecords) {
  TempDir tmp("eval_tasks");
  const std::string fixture = "tests/fixtures/mc_eval";
  const std::string base = kEval + " --checkpoint " + fixture + " --threads 1 --quiet --tasks ";
  auto r = run_command(base + fixture + "/tasks --output " + (tmp / "shared.jsonl").string(), tmp / "log1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json line = json_line(r.output);
  EXPECT_EQ(line.at("records"), 106);
  EXPECT_EQ(line.at("metrics").size(), 5u);  // four tasks and "all"
  EXPECT_NE(r.output.find("mc_four "), std::string::npos) << r.output;
  r = run_command(base + fixture + "/tasks --share_context false --output " + (tmp / "packed.jsonl").string(), tmp / "log2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(json_line(r.output).at("metrics"), line.at("metrics"));
  std::ifstream a(tmp / "shared.jsonl"), b(tmp / "packed.jsonl");
  int rows = 0;
  for (std::string la, lb; std::getline(a, la) && std::getline(b, lb); rows++) {
    const nlohmann::json ra = nlohmann::json::parse(la), rb = nlohmann::json::parse(lb);
    EXPECT_EQ(ra.at("pred"), rb.at("pred"));
    const auto x = ra.at("loglikelihoods").get<std::vector<double>>(), y = rb.at("loglikelihoods").get<std::vector<double>>();
    for (size_t k = 0; k < x.size(); k++) EXPECT_NEAR(x[k], y[k], 1e-5 * std::abs(y[k])) << la;
  }
  EXPECT_EQ(rows, 106);
  // A bad record: the file and line, or with --skip_bad_records a count by reason.
  const fs::path bad = tmp / "bad.jsonl";
  std::ofstream(bad) << "{\"task\": \"t\", \"context\": \"Q\", \"choices\": [\" a\", \" b\"], \"gold\": 0}\n"
                     << "{\"task\": \"t\", \"context\": \"Q\", \"choices\": [\" a\", \" b\"], \"gold\": 5}\n";
  r = run_command(base + bad.string(), tmp / "log3");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(bad.string() + ":2: gold 5 is not an index of the 2 choices"), std::string::npos) << r.output;
  r = run_command(kEval + " --checkpoint " + fixture + " --threads 1 --skip_bad_records --tasks " + bad.string(), tmp / "log4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("skipped 1 bad record(s): gold out of range"), std::string::npos) << r.output;
  EXPECT_EQ(json_line(r.output).at("skipped").at("gold out of range"), 1);
}

}  // namespace
}  // namespace tuna
