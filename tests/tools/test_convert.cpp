// build/convert: HF -> tuna -> HF is bit-exact (fp32 and bf16, single file and sharded), pickle formats
// are refused with a way out, and, where Python with transformers is installed, transformers loads the
// exported directory and computes the same logits (tools/reference/check_export.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "model/config.h"
#include "model/layout.h"
#include "model/llama.h"  // init_random_weights
#include "ckpt/safetensors.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kConvert = testing_util::build_dir() + "/convert";

// Every tensor of a has the same name, dtype, shape and bytes in b (b may be sharded differently).
void expect_same_tensors(const fs::path& a, const fs::path& b) {
  HfCheckpointDir da(a), db(b);
  ASSERT_EQ(da.tensor_names().size(), db.tensor_names().size());
  for (const std::string& name : da.tensor_names()) {
    auto ea = da.find(name), eb = db.find(name);
    ASSERT_TRUE(eb) << name;
    EXPECT_EQ(ea.info->dtype, eb.info->dtype) << name;
    EXPECT_EQ(ea.info->shape, eb.info->shape) << name;
    ASSERT_EQ(ea.info->nbytes(), eb.info->nbytes()) << name;
    EXPECT_EQ(0, std::memcmp(ea.file->data(*ea.info), eb.file->data(*eb.info), ea.info->nbytes())) << name;
  }
}

class ConvertRoundTrip : public testing::TestWithParam<std::string> {};

TEST_P(ConvertRoundTrip, HfToTunaToHfIsBitExact) {
  TempDir tmp("convert");
  const fs::path hf = fs::path("tests/fixtures") / GetParam();
  auto r = run_command(kConvert + " hf-to-tuna " + hf.string() + " " + (tmp / "tuna").string(), tmp / "log1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "tuna" / "state.json"));
  // A progress line (the closing one, for a file this small) names what was written, its size and the time.
  EXPECT_NE(r.output.find("convert: writing " + (tmp / "tuna" / "model.safetensors").string() + ": "), std::string::npos)
      << r.output;
  r = run_command(kConvert + " tuna-to-hf " + (tmp / "tuna").string() + " " + (tmp / "hf").string(), tmp / "log2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" in "), std::string::npos) << r.output;
  expect_same_tensors(hf, tmp / "hf");

  // bf16: export as bf16, import keeps bf16, export (auto: config says bfloat16) gives the same bytes.
  r = run_command(kConvert + " tuna-to-hf " + (tmp / "tuna").string() + " " + (tmp / "hf16").string() +
                      " --dtype bfloat16",
                  tmp / "log3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(kConvert + " hf-to-tuna " + (tmp / "hf16").string() + " " + (tmp / "tuna16").string(), tmp / "log4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_command(kConvert + " tuna-to-hf " + (tmp / "tuna16").string() + " " + (tmp / "hf16b").string() +
                      " --max-shard-bytes 20000",
                  tmp / "log5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "hf16b" / "model.safetensors.index.json"));
  expect_same_tensors(tmp / "hf16", tmp / "hf16b");
  // The sharded directory is itself a valid input.
  r = run_command(kConvert + " hf-to-tuna " + (tmp / "hf16b").string() + " " + (tmp / "tuna16b").string(), tmp / "log6");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_tensors(tmp / "tuna16", tmp / "tuna16b");
}

TEST_P(ConvertRoundTrip, TransformersLoadsTheExport) {
  if (std::system("python3 -c 'import torch, transformers' > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3 with torch and transformers is not installed (pip install -r tools/reference/requirements.txt)";
  TempDir tmp("export");
  const fs::path hf = fs::path("tests/fixtures") / GetParam();
  ASSERT_EQ(run_command(kConvert + " hf-to-tuna " + hf.string() + " " + (tmp / "tuna").string(), tmp / "l1").exit_code, 0);
  ASSERT_EQ(run_command(kConvert + " tuna-to-hf " + (tmp / "tuna").string() + " " + (tmp / "hf").string(), tmp / "l2").exit_code, 0);
  auto r = run_command("python3 tools/reference/check_export.py " + (tmp / "hf").string() + " " + hf.string(), tmp / "l3");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ConvertRoundTrip, testing::Values("llama2_tiny", "llama32_tiny"));

// A Hugging Face model directory of llama2_tiny's width with one layer, `vocab` tokens and the given BOS/EOS ids,
// its fp32 weights drawn at random: a model whose vocabulary holds a real tokenizer's special ids (the llama3
// tokenizer's 128000/128001 need 128256 rows), which the config check requires.
void write_model_with_vocab(const fs::path& dir, int64_t vocab, int bos_id, int eos_id) {
  auto config_json = nlohmann::json::parse(read_file("tests/fixtures/llama2_tiny/config.json"));
  config_json["vocab_size"] = vocab, config_json["num_hidden_layers"] = 1;
  config_json["bos_token_id"] = bos_id, config_json["eos_token_id"] = eos_id;
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config_json.dump();
  const LlamaConfig config = LlamaConfig::from_json(config_json, (dir / "config.json").string());
  const ParamLayout layout(config);
  std::vector<float> weights(layout.total());
  init_random_weights(layout, 7, 0.02, weights.data());
  SafetensorsWriter w;
  for (const ParamTensor& t : layout.tensors()) w.add(t.name, DType::F32, t.global_shape, weights.data() + t.offset);
  w.write(dir / "model.safetensors");
}

// The export carries the checkpoint's tokenizer and writes what transformers' AutoTokenizer needs beside it
// (tokenizer_config.json, special_tokens_map.json, generation_config.json), keeping the model's own files;
// where transformers is installed, AutoTokenizer loads the export and gives tuna's ids.
TEST(Convert, ExportCarriesWhatAutoTokenizerNeeds) {
  TempDir tmp("exporttok");
  ASSERT_EQ(run_command(kConvert + " hf-to-tuna tests/fixtures/llama2_tiny " + (tmp / "tuna").string(), tmp / "l1").exit_code, 0);
  struct Case {
    std::string tokenizer_file, expected_class, bos, eos;
    int bos_id, eos_id;           // the model's config.json names them (BOS/EOS come from the model's config)
    std::string python_packages;  // what transformers needs to load it
  };
  const std::string text = "The Licensee shall pay the fees within 30 days.";
  std::string python_args;  // export directory, expected ids: for transformers, where it is installed
  for (const Case& c : {Case{"spm/tokenizer.model", "LlamaTokenizer", "<s>", "</s>", 1, 2, "transformers, sentencepiece, google.protobuf"},
                        Case{"llama3/tokenizer.json.zst", "PreTrainedTokenizerFast", "<|begin_of_text|>", "<|end_of_text|>",
                             128000, 128001, "transformers"}}) {
    const fs::path ckpt = tmp / ("tuna-" + c.expected_class), out = tmp / ("hf-" + c.expected_class);
    write_model_with_vocab(tmp / ("model-" + c.expected_class), c.eos_id < 128 ? 128 : 128256, c.bos_id, c.eos_id);
    ASSERT_EQ(run_command(kConvert + " hf-to-tuna " + (tmp / ("model-" + c.expected_class)).string() + " " + ckpt.string(),
                          tmp / "l1b").exit_code, 0);
    const std::string source = "tests/fixtures/tokenizers/" + c.tokenizer_file;
    if (source.ends_with(".zst"))
      ASSERT_EQ(std::system(("zstd -dq --long=27 " + source + " -o " + (ckpt / "tokenizer.json").string()).c_str()), 0);
    else
      fs::copy_file(source, ckpt / "tokenizer.model");
    auto r = run_command(kConvert + " tuna-to-hf " + ckpt.string() + " " + out.string(), tmp / "l2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("wrote " + out.string() + "/tokenizer_config.json"), std::string::npos) << r.output;
    const auto config = nlohmann::json::parse(read_file(out / "tokenizer_config.json"));
    EXPECT_EQ(config["tokenizer_class"], c.expected_class);
    EXPECT_EQ(config["bos_token"], c.bos);
    EXPECT_EQ(config["eos_token"], c.eos);
    EXPECT_EQ(nlohmann::json::parse(read_file(out / "special_tokens_map.json"))["bos_token"], c.bos);
    const auto generation = nlohmann::json::parse(read_file(out / "generation_config.json"));
    EXPECT_EQ(generation["bos_token_id"], c.bos_id);
    EXPECT_EQ(generation["eos_token_id"], c.eos_id);
    // Exported again from a checkpoint that has them: the model's own files are kept as they are.
    std::ofstream(ckpt / "tokenizer_config.json") << read_file(out / "tokenizer_config.json");
    r = run_command(kConvert + " tuna-to-hf " + ckpt.string() + " " + (tmp / "again").string(), tmp / "l3");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.find("wrote " + (tmp / "again").string() + "/tokenizer_config.json"), std::string::npos) << r.output;
    fs::remove_all(tmp / "again");
    if (std::system(("python3 -c 'import " + c.python_packages + "' > /dev/null 2>&1").c_str()) != 0) continue;
    const std::vector<int32_t> ids = Tokenizer(out.string()).encode(text);
    std::string expected;
    for (size_t i = 0; i < ids.size(); ++i) expected += (i ? ", " : "") + std::to_string(ids[i]);
    python_args += " " + out.string() + " '[" + expected + "]'";
  }
  // A tiktoken file alone: the export goes through, with a warning instead of a tokenizer_config.json that
  // transformers could only use with the tiktoken package.
  {
    const fs::path ckpt = tmp / "tuna-tiktoken";
    fs::create_directories(ckpt);
    for (const auto& e : fs::directory_iterator(tmp / "tuna")) fs::copy_file(e.path(), ckpt / e.path().filename());
    ASSERT_EQ(std::system(("zstd -dq --long=27 tests/fixtures/tokenizers/llama3/original/tokenizer.model.zst -o " +
                           (ckpt / "tokenizer.model").string()).c_str()), 0);
    auto r = run_command(kConvert + " tuna-to-hf " + ckpt.string() + " " + (tmp / "hf-tiktoken").string(), tmp / "l5");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("warning: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("tiktoken package"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(tmp / "hf-tiktoken" / "tokenizer_config.json"));
    EXPECT_TRUE(fs::exists(tmp / "hf-tiktoken" / "tokenizer.model"));
  }
  if (python_args.empty()) return;
  // One Python process for every case (importing transformers is the slow part).
  auto r = run_command("python3 -c \"import sys; from transformers import AutoTokenizer\n"
                       "for d, want in zip(sys.argv[2::2], sys.argv[3::2]):\n"
                       "    got = str(AutoTokenizer.from_pretrained(d).encode(sys.argv[1], add_special_tokens=False))\n"
                       "    print(d, 'OK' if got == want else 'MISMATCH ' + got + ' != ' + want)\" '" + text + "'" + python_args,
                       tmp / "l4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("MISMATCH"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("OK"), std::string::npos) << r.output;
}

TEST(Convert, RefusesPickleCheckpointsWithAWayOut) {
  TempDir tmp("pickle");
  fs::copy_file("tests/fixtures/llama2_tiny/config.json", tmp / "config.json");
  std::ofstream(tmp / "pytorch_model.bin") << "not really a pickle";
  auto r = run_command(kConvert + " hf-to-tuna " + tmp.path.string() + " " + (tmp / "out").string(), tmp / "log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("pytorch_model.bin"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("safetensors"), std::string::npos) << r.output;
}

TEST(Convert, RefusesWeightsThatDisagreeWithConfig) {
  TempDir tmp("mismatch");
  fs::copy_file("tests/fixtures/llama2_tiny/model.safetensors", tmp / "model.safetensors");
  // llama32's config (8 heads of 8, 2 kv heads) against llama2's weights (4 kv heads of 16): k_proj differs.
  fs::copy_file("tests/fixtures/llama32_tiny/config.json", tmp / "config.json");
  auto r = run_command(kConvert + " hf-to-tuna " + tmp.path.string() + " " + (tmp / "out").string(), tmp / "log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("k_proj.weight"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("expected shape"), std::string::npos) << r.output;
}

// A NaN in the weights is refused naming the tensor and the index, in either direction; an export verifies the
// checkpoint against its manifest first.
TEST(Convert, RefusesNonFiniteWeightsAndDamagedCheckpoints) {
  TempDir tmp("convertnan");
  fs::create_directories(tmp / "hf");
  fs::copy_file("tests/fixtures/llama32_tiny/config.json", tmp / "hf" / "config.json");
  {
    SafetensorsFile src("tests/fixtures/llama32_tiny/model.safetensors");
    std::vector<std::vector<float>> copies;
    SafetensorsWriter w;
    for (const TensorInfo& t : src.tensors()) {
      copies.emplace_back(t.numel);
      src.read_f32(t.name, t.shape, copies.back().data());
      if (t.name == "model.layers.1.mlp.down_proj.weight") copies.back()[37] = NAN;
      w.add(t.name, DType::F32, t.shape, copies.back().data());
    }
    w.write(tmp / "hf" / "model.safetensors");
  }
  auto r = run_command(kConvert + " hf-to-tuna " + (tmp / "hf").string() + " " + (tmp / "out").string(), tmp / "log1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("tensor 'model.layers.1.mlp.down_proj.weight'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("element 37 is nan"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "out" / "model.safetensors"));

  // A training checkpoint with a damaged file: refused before anything is written.
  testing_util::write_test_shards(tmp / "data");
  r = run_command(testing_util::build_dir() + "/train --model_config tests/fixtures/llama32_tiny/config.json --steps 1"
                  " --seq_len 16 --micro_batch 2 --device cpu --threads 1 --out_dir " + (tmp / "run").string() +
                  " --train_data " + (tmp / "data").string(), tmp / "log2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path ckpt = tmp / "run" / "ckpt" / "step_00000001";
  {
    std::fstream f(ckpt / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1000);
    f.put('\x55');
  }
  r = run_command(kConvert + " tuna-to-hf " + ckpt.string() + " " + (tmp / "export").string(), tmp / "log3");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("fails verification, nothing exported"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model.safetensors: checksum"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "export"));
}

// An existing model directory is replaced only with --overwrite (and then wholly: no stale shard stays);
// a directory holding anything else is never deleted; CKPT_DIR may be runs/X/ckpt/latest.
TEST(Convert, OverwritesOnlyWhenAskedAndReadsLatest) {
  TempDir tmp("overwrite");
  const std::string hf = "tests/fixtures/llama2_tiny", tuna = (tmp / "ckpt" / "step_00000007").string();
  const std::string out = (tmp / "out").string();
  ASSERT_EQ(run_command(kConvert + " hf-to-tuna " + hf + " " + tuna, tmp / "l1").exit_code, 0);
  auto r = run_command(kConvert + " hf-to-tuna " + hf + " " + tuna, tmp / "l2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(tuna + ": already holds a model (config.json): --overwrite to replace it"), std::string::npos)
      << r.output;

  // ckpt/latest without a symlink (written by build/convert, not the trainer): the newest step directory.
  r = run_command(kConvert + " tuna-to-hf " + (tmp / "ckpt" / "latest").string() + " " + out, tmp / "l3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step_00000007 -> "), std::string::npos) << r.output;
  r = run_command(kConvert + " tuna-to-hf " + tuna + " " + out + " --max-shard-bytes 20000", tmp / "l4");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("--overwrite"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(out) / "model.safetensors"));  // untouched
  r = run_command(kConvert + " tuna-to-hf " + tuna + " " + out + " --max-shard-bytes 20000 --overwrite", tmp / "l5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(out) / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(fs::path(out) / "model.safetensors"));  // the earlier export's file went with it
  expect_same_tensors(hf, out);

  // Not a model directory: refused even with --overwrite, and nothing in it is touched.
  fs::create_directories(tmp / "notes");
  std::ofstream(tmp / "notes" / "todo.txt") << "keep me\n";
  r = run_command(kConvert + " tuna-to-hf " + tuna + " " + (tmp / "notes").string() + " --overwrite", tmp / "l6");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("not a model directory (no config.json)"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "notes" / "todo.txt"));
}

}  // namespace
}  // namespace tuna
