// build/sample end to end on a model trained for one step with a real tokenizer: greedy decoding is
// deterministic and continues the prompt, sampling is reproducible by seed, and bad requests fail clearly.
#include <gtest/gtest.h>

#include <fstream>

#include "data/tokenizer.h"
#include "engine/engine.h"  // resolve_device
#include "tests/data/data_test_util.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kBuild = testing_util::build_dir();

// The generated text: the output without the loading line (stderr, first) and the closing timing line
// ("N tokens in T s: ... tokens/s ...").
std::string generated_text(const std::string& output) {
  const size_t begin = output.rfind("sample: loading ", 0) == 0 ? output.find('\n') + 1 : 0;  // stderr's first line
  const size_t stats = output.rfind(" tokens in ");
  if (stats == std::string::npos) return output.substr(begin);
  const size_t line = output.rfind('\n', stats);
  return output.substr(begin, line == std::string::npos || line < begin ? 0 : line + 1 - begin);
}

// A demo-sized model (vocab 1024) after one training step, with a 1024-piece tokenizer in its checkpoint.
class SampleTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("sample");
    const fs::path corpus = testing_data::demo_corpus();
    TokenizerTrainOptions options;
    options.num_threads = 2;
    train_tokenizer({(corpus / "GPL-3/001.txt").string(), (corpus / "MPL-2.0/001.txt").string(),
                     (corpus / "Apache-2.0/002.txt").string()},
                    (dir_->path / "tokenizer").string(), 1024, options);
    testing_util::write_test_shards(dir_->path / "data");
    auto r = run_command(kBuild + "/train --model_config demo/config.json --train_data " +
                             (dir_->path / "data" / "train-00000.bin").string() + " --tokenizer " + (dir_->path / "tokenizer.model").string() +
                             " --seq_len 16 --micro_batch 2 --steps 1 --threads 2 --device cpu --out_dir " +
                             (dir_->path / "run").string(),
                         dir_->path / "train.log");
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string sample(const std::string& flags) {
    return kBuild + "/sample --checkpoint " + (dir_->path / "run" / "ckpt" / "latest").string() + " --threads 2 " + flags;
  }
  static TempDir* dir_;
};
TempDir* SampleTest::dir_ = nullptr;

TEST_F(SampleTest, GreedyIsDeterministicAndSamplingFollowsTheSeed) {
  const std::string prompt = " --prompt 'This License' --max_tokens 12 --stop_at_eos false --device cpu";
  auto a = run_command(sample(prompt + " --greedy"), dir_->path / "a.log");
  auto b = run_command(sample(prompt + " --greedy"), dir_->path / "b.log");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(generated_text(a.output), generated_text(b.output));
  EXPECT_EQ(a.output.rfind("sample: loading ", 0), 0u) << a.output;  // on stderr, before any work
  EXPECT_EQ(generated_text(a.output).rfind("This License", 0), 0u) << a.output;  // the prompt, then its continuation
  EXPECT_GT(generated_text(a.output).size(), std::string("This License\n").size()) << a.output;
  EXPECT_NE(a.output.find("tokens/s (cpu, KV cache)"), std::string::npos) << a.output;

  auto s1 = run_command(sample(prompt + " --seed 3 --temperature 1.5"), dir_->path / "s1.log");
  auto s2 = run_command(sample(prompt + " --seed 3 --temperature 1.5"), dir_->path / "s2.log");
  ASSERT_EQ(s1.exit_code, 0) << s1.output;
  EXPECT_EQ(generated_text(s1.output), generated_text(s2.output));
}

TEST_F(SampleTest, TheKvCacheGivesTheWholeContextsText) {
  const std::string prompt = " --prompt 'This License' --max_tokens 24 --stop_at_eos false --device cpu";
  for (const std::string mode : {" --greedy", " --seed 5 --temperature 1.2"}) {
    auto cached = run_command(sample(prompt + mode), dir_->path / "cached.log");
    auto whole = run_command(sample(prompt + mode + " --kv_cache false"), dir_->path / "whole.log");
    ASSERT_EQ(cached.exit_code, 0) << cached.output;
    ASSERT_EQ(whole.exit_code, 0) << whole.output;
    EXPECT_EQ(generated_text(cached.output), generated_text(whole.output)) << mode;
    EXPECT_NE(whole.output.find("no KV cache"), std::string::npos) << whole.output;
  }
}

// The context is the checkpoint's training seq_len (16 here) unless asked otherwise, and never more than
// max_position_embeddings; flags take dashes as well as underscores.
TEST_F(SampleTest, ContextIsTheTrainingSeqLen) {
  auto r = run_command(sample("--prompt 'This License' --max-tokens 40 --stop-at-eos false --greedy --device cpu"),
                       dir_->path / "c1.log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("context up to 16"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stopped at the context limit of 16 tokens"), std::string::npos) << r.output;
  r = run_command(sample("--prompt 'This License' --max-tokens 40 --seq-len 24 --greedy --device cpu"), dir_->path / "c2.log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("context up to 24"), std::string::npos) << r.output;
  r = run_command(sample("--prompt x --seq_len 4096 --device cpu"), dir_->path / "c3.log");  // demo: 1024 positions
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("4096 tokens is more than the model's max_position_embeddings 1024"), std::string::npos)
      << r.output;
}

TEST_F(SampleTest, BadRequestsFailClearly) {
  auto r = run_command(sample("--prompt x --temperature 0 --device cpu"), dir_->path / "e1.log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("option 'temperature': expected > 0"), std::string::npos) << r.output;
  r = run_command(sample("--prompt x --device tpu"), dir_->path / "e2.log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("expected auto, cpu or cuda, found 'tpu'"), std::string::npos) << r.output;
  if (resolve_device("auto") == Device::Cpu) {
    r = run_command(sample("--prompt x --device cuda"), dir_->path / "e3.log");
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.output.find("--device cpu"), std::string::npos) << r.output;
  }
}

// One rule in every tool: the files a tool reads are checked against the checkpoint's manifest. A checkpoint
// whose model.safetensors has 8 flipped bytes is refused by sample, eval and --init, naming the file, where eval
// had printed an infinite perplexity with exit code 0.
TEST_F(SampleTest, ADamagedCheckpointIsRefusedByEveryTool) {
  const fs::path damaged = dir_->path / "damaged";
  fs::remove_all(damaged);
  fs::copy(fs::canonical(dir_->path / "run" / "ckpt" / "latest"), damaged, fs::copy_options::recursive);
  {
    std::fstream f(damaged / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-64, std::ios::end);
    const char flipped[8] = {'\x7f', '\x7f', '\x7f', '\x7f', '\x7f', '\x7f', '\x7f', '\x7f'};
    f.write(flipped, 8);
  }
  const std::string why = (damaged / "model.safetensors").string() + ": checksum";
  auto r = run_command(kBuild + "/sample --checkpoint " + damaged.string() + " --prompt x --device cpu --threads 2",
                       dir_->path / "d1.log");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("fails verification against its manifest.json, not used"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
  r = run_command(kBuild + "/eval --checkpoint " + damaged.string() + " --data " + (dir_->path / "data").string() +
                      " --device cpu --threads 2",
                  dir_->path / "d2.log");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
  r = run_command(kBuild + "/train --init " + damaged.string() + " --train_data " +
                      (dir_->path / "data" / "train-00000.bin").string() + " --seq_len 16 --micro_batch 2 --steps 1 " +
                      "--threads 2 --device cpu --out_dir " + (dir_->path / "from_damaged").string(),
                  dir_->path / "d3.log");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
  // The optimizer's file is not read by these tools: damage there is found by --resume, not by sample.
  fs::remove_all(damaged);
  fs::copy(fs::canonical(dir_->path / "run" / "ckpt" / "latest"), damaged, fs::copy_options::recursive);
  {
    std::fstream f(damaged / "optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-64, std::ios::end);
    f.write("\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f", 8);
  }
  r = run_command(kBuild + "/sample --checkpoint " + damaged.string() + " --prompt x --max_tokens 2 --device cpu --threads 2",
                  dir_->path / "d4.log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// The same rule as train and eval: a tokenizer that is not the model's (another vocabulary) is refused, where
// sample had printed mojibake with exit code 0.
TEST_F(SampleTest, AnotherModelsTokenizerIsRefused) {
  TokenizerTrainOptions options;
  options.num_threads = 2;
  train_tokenizer({(testing_data::demo_corpus() / "GPL-3/001.txt").string()}, (dir_->path / "other").string(), 400,
                  options);
  auto r = run_command(sample("--prompt x --device cpu --tokenizer " + (dir_->path / "other.model").string()),
                       dir_->path / "t1.log");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("is not the model's"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("leave out --tokenizer"), std::string::npos) << r.output;
  // The model's own tokenizer, named explicitly, is fine.
  r = run_command(sample("--prompt x --max_tokens 2 --device cpu --tokenizer " + (dir_->path / "tokenizer.model").string()),
                  dir_->path / "t2.log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace tuna
