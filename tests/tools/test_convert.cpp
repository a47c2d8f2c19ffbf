// build/convert: HF -> tuna -> HF is bit-exact (fp32 and bf16, single file and sharded), pickle formats
// are refused with a way out, and, where Python with transformers is installed, transformers loads the
// exported directory and computes the same logits (tools/reference/check_export.py). tuna-to-gguf: the gguf
// Python package reads every export back and tools/reference/check_gguf.py holds it to what llama.cpp's converter
// and quantizers make from the same model; rank files export as the model they hold; bad input is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "model/config.h"
#include "model/layout.h"
#include "ckpt/checkpoint.h"  // rank files for tuna-to-gguf
#include "model/llama.h"  // init_random_weights
#include "model/optimizer.h"  // dp_unit_pieces
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

// ---- tuna-to-gguf ----------------------------------------------------------------------------------

// The gguf package's Python, as scripts/install-deps.sh installs it (a virtual environment of the build).
std::string gguf_python() { return testing_util::build_dir() + "/venv/bin/python3"; }

const char* const kLlama3ChatTemplate =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

// A Hugging Face directory: `config_file`'s model with `layers` layers and `vocab` tokens, its fp32 weights
// drawn at random, and the named tokenizer fixture (tests/fixtures/tokenizers/...; .zst decompressed).
void write_gguf_source(const fs::path& dir, const std::string& config_file, int64_t vocab, int64_t layers,
                       const std::vector<std::string>& tokenizer_files) {
  auto config_json = nlohmann::json::parse(read_file(config_file));
  config_json["vocab_size"] = vocab, config_json["num_hidden_layers"] = layers;
  fs::create_directories(dir);
  const LlamaConfig config = LlamaConfig::from_json(config_json, config_file);
  const ParamLayout layout(config);
  std::vector<float> weights(layout.total());
  init_random_weights(layout, 11, 0.02, weights.data());
  SafetensorsWriter w;
  for (const ParamTensor& t : layout.tensors()) w.add(t.name, DType::F32, t.global_shape, weights.data() + t.offset);
  w.write(dir / "model.safetensors");
  std::ofstream(dir / "config.json") << config_json.dump(2);
  for (const std::string& file : tokenizer_files) {
    const std::string source = "tests/fixtures/tokenizers/" + file;
    const std::string name = fs::path(file).filename().string();
    if (source.ends_with(".zst"))
      ASSERT_EQ(std::system(("zstd -dqf --long=27 " + source + " -o " + (dir / name.substr(0, name.size() - 4)).string())
                                .c_str()), 0);
    else
      fs::copy_file(source, dir / name);
  }
  // Meta-Llama-3-8B-Instruct's chat template, which the GGUF must carry as it is.
  if (fs::exists(dir / "tokenizer_config.json")) {
    auto c = nlohmann::json::parse(read_file(dir / "tokenizer_config.json"));
    c["chat_template"] = kLlama3ChatTemplate;
    std::ofstream(dir / "tokenizer_config.json") << c.dump(2);
  }
}

// Every type, from a Hugging Face directory and from the tuna checkpoint of it, for a sentencepiece LLaMA-2-style
// model (untied, no RoPE scaling) and a Llama 3 one (tied, llama3 RoPE scaling, grouped-query attention, the real
// Llama 3.2 tokenizer.json with its chat template): the gguf package reads every key and tensor back and
// check_gguf.py finds the metadata, the shapes, the Q/K permutation and every byte of the (quantized) tensors as
// llama.cpp's converter and quantizers make them from the source model.
TEST(ConvertGguf, TheGgufPackageReadsBackWhatLlamaCppExpects) {
  ASSERT_EQ(std::system((gguf_python() + " -c 'import gguf, numpy' > /dev/null 2>&1").c_str()), 0)
      << gguf_python() << " cannot import gguf: scripts/install-deps.sh (make deps) installs it";
  TempDir tmp("gguf");
  struct Case {
    std::string name, config;
    int64_t vocab;
    std::vector<std::string> tokenizer;
  };
  for (const Case& c : {Case{"spm", "tests/fixtures/llama2_tiny/config.json", 2048, {"spm/tokenizer.model"}},
                        Case{"llama3", "tests/fixtures/llama32_tiny/config.json", 128264,
                             {"llama3/tokenizer.json.zst", "llama3/tokenizer_config.json.zst"}}}) {
    const fs::path hf = tmp / ("hf-" + c.name), ckpt = tmp / ("tuna-" + c.name);
    write_gguf_source(hf, c.config, c.vocab, c.name == "spm" ? 2 : 1, c.tokenizer);
    auto r = run_command(kConvert + " hf-to-tuna " + hf.string() + " " + ckpt.string(), tmp / "l0");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const std::string type : {"bf16", "f16", "f32", "q8_0", "q4_0"}) {
      for (const fs::path& source : {hf, ckpt}) {
        // The reading path is the same for every type; the Llama 3 model's 8M-value embedding costs the reader ~20 s
        // per file on a loaded CI machine: its types are bf16 and q4_0 (whose head, the tied embedding, is q8_0).
        if (source == ckpt && type != "q4_0") continue;
        if (c.name == "llama3" && type != "q4_0" && type != "bf16") continue;
        const fs::path out = tmp / (c.name + "-" + type + ".gguf");
        r = run_command(kConvert + " tuna-to-gguf " + source.string() + " " + out.string() + " --type " + type +
                            " --overwrite", tmp / "l1");
        ASSERT_EQ(r.exit_code, 0) << r.output;
        EXPECT_NE(r.output.find("convert: writing " + out.string()), std::string::npos) << r.output;  // progress
        EXPECT_NE(r.output.find(c.name == "spm" ? "GGUF 'llama'" : "GGUF 'gpt2' pre-tokenizer llama-bpe"),
                  std::string::npos) << r.output;
        r = run_command(gguf_python() + " tools/reference/check_gguf.py " + out.string() + " " + hf.string() + " " +
                            type, tmp / "l2");
        EXPECT_EQ(r.exit_code, 0) << c.name << " " << type << " from " << source << "\n" << r.output;
        EXPECT_NE(r.output.find("check_gguf: OK"), std::string::npos) << r.output;
      }
    }
  }
}

// Rank files of a tp 2 x dp 2 run (column and row blocks, each cut in ZeRO pieces) export to the same bytes as the
// Hugging Face directory they hold the weights of: the pieces are read in global coordinates.
TEST(ConvertGguf, RankFilesExportAsTheModelTheyHold) {
  TempDir tmp("ggufranks");
  const fs::path hf = tmp / "hf" / "step_00000001";  // the same directory name: general.name is the directory's
  write_gguf_source(hf, "tests/fixtures/llama32_tiny/config.json", 2048, 2, {"spm/tokenizer.model"});
  const nlohmann::json config_json = nlohmann::json::parse(read_file(hf / "config.json"));
  const LlamaConfig config = LlamaConfig::from_json(config_json, (hf / "config.json").string());
  prepare_sharded_checkpoint(tmp / "ckpt", 1);
  for (int tp_rank = 0; tp_rank < 2; tp_rank++) {
    const ParamLayout block(config, tp_rank, 2);
    std::vector<float> p(block.total()), moments(block.total(), 0.0f);
    WeightReader(hf, block).read(Segment{0, block.total()}, p.data());
    for (int dp_rank = 0; dp_rank < 2; dp_rank++) {
      const std::vector<Segment> pieces = dp_unit_pieces(block, dp_rank, 2);
      write_checkpoint_shard(checkpoint_tmp_dir(tmp / "ckpt", 1), dp_rank * 2 + tp_rank, block,
                             ShardState{&pieces,
                                        [&](const StateSink& sink) {
                                          for (size_t i = 0; i < pieces.size(); i++) {
                                            const int64_t at = pieces[i].begin;
                                            sink(i, p.data() + at, moments.data() + at, moments.data() + at);
                                          }
                                        },
                                        0, /*write_replicated=*/tp_rank == 0});
    }
  }
  const fs::path sharded = finish_sharded_checkpoint(
      tmp / "ckpt", 1, {&config_json, nullptr, {}, {}, {{hf / "tokenizer.model", "tokenizer.model"}}}, 0);
  ASSERT_TRUE(is_sharded_checkpoint(sharded));
  for (const std::string type : {"bf16", "q4_0"}) {
    auto r = run_command(kConvert + " tuna-to-gguf " + sharded.string() + " " + (tmp / "ranks.gguf").string() +
                             " --overwrite --type " + type, tmp / "l1");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = run_command(kConvert + " tuna-to-gguf " + hf.string() + " " + (tmp / "hf.gguf").string() + " --overwrite --type " +
                        type, tmp / "l2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(read_file(tmp / "ranks.gguf") == read_file(tmp / "hf.gguf")) << type;
  }
}

// A tiktoken file alone gives the same GGUF vocabulary as tokenizer.json: its merges, which the file does not
// list, rebuilt from the ranks in the order Llama 3's tokenizer.json lists them.
TEST(ConvertGguf, TiktokenMergesEqualTokenizerJsons) {
  ASSERT_EQ(std::system((gguf_python() + " -c 'import gguf, numpy' > /dev/null 2>&1").c_str()), 0)
      << gguf_python() << " cannot import gguf: scripts/install-deps.sh (make deps) installs it";
  TempDir tmp("gguftik");
  const fs::path hf = tmp / "hf";
  write_gguf_source(hf, "tests/fixtures/llama32_tiny/config.json", 128264, 1,
                    {"llama3/tokenizer.json.zst", "llama3/tokenizer_config.json.zst"});
  const fs::path tik = tmp / "tik";
  fs::create_directories(tik);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer_config.json"}) fs::copy_file(hf / f, tik / f);
  ASSERT_EQ(std::system(("zstd -dq --long=27 tests/fixtures/tokenizers/llama3/original/tokenizer.model.zst -o " +
                         (tik / "tokenizer.model").string()).c_str()), 0);
  auto r = run_command(kConvert + " tuna-to-gguf " + tik.string() + " " + (tmp / "tik.gguf").string(), tmp / "l1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // check_gguf.py compares tokens, types and merges against the tokenizer.json of hf.
  fs::copy_file(hf / "tokenizer.json", tik / "tokenizer.json");
  fs::remove(tik / "tokenizer.model");
  r = run_command(gguf_python() + " tools/reference/check_gguf.py " + (tmp / "tik.gguf").string() + " " + tik.string() +
                      " bf16", tmp / "l2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// Bad input: an unknown --type, an existing output without --overwrite (left as it was), what llama.cpp cannot
// represent (a weight beyond f16's range under f16, a checkpoint without a tokenizer, a tokenizer larger than the
// model), a full disk (nothing under the final name).
TEST(ConvertGguf, RefusesWhatItCannotWriteByName) {
  TempDir tmp("ggufbad");
  const fs::path hf = tmp / "hf", out = tmp / "m.gguf";
  write_gguf_source(hf, "tests/fixtures/llama2_tiny/config.json", 2000, 1, {"spm/tokenizer.model"});
  auto r = run_command(kConvert + " tuna-to-gguf " + hf.string() + " " + out.string() + " --type q4_k_m", tmp / "l1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("option --type: expected bf16, f16, f32, q8_0 or q4_0, found 'q4_k_m'"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(out));

  std::ofstream(out) << "earlier";
  r = run_command(kConvert + " tuna-to-gguf " + hf.string() + " " + out.string(), tmp / "l2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(out.string() + ": already exists: --overwrite to replace it"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(out), "earlier");
  r = run_command(kConvert + " tuna-to-gguf " + hf.string() + " " + out.string() + " --overwrite", tmp / "l3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_file(out).substr(0, 4), "GGUF");

  // A full disk: RLIMIT_FSIZE (ulimit -f, in 1 KiB blocks) makes write() fail as ENOSPC would.
  fs::remove(out);
  r = run_command("bash -c \"trap '' XFSZ; ulimit -f 16; " + kConvert + " tuna-to-gguf " + hf.string() + " " +
                      out.string() + " --type f32\"", tmp / "l4");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("cannot write " + out.string()), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(out.string() + ".tmp"));

  // A weight f16 cannot hold: named, and bf16 takes it.
  {
    SafetensorsFile src(hf / "model.safetensors");
    SafetensorsWriter w;
    std::vector<std::vector<float>> copies;
    copies.reserve(src.tensors().size());
    for (const TensorInfo& info : src.tensors()) {
      copies.emplace_back(info.numel);
      std::memcpy(copies.back().data(), src.data(info), info.nbytes());
      if (info.name == "model.layers.0.mlp.up_proj.weight") copies.back()[5] = 70000.0f;
      w.add(info.name, DType::F32, info.shape, copies.back().data());
    }
    w.write(tmp / "big.safetensors");
  }
  fs::rename(tmp / "big.safetensors", hf / "model.safetensors");
  r = run_command(kConvert + " tuna-to-gguf " + hf.string() + " " + out.string() + " --type f16", tmp / "l5");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("tensor 'model.layers.0.mlp.up_proj.weight' holds 70000 at element 5, beyond f16's range"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--type bf16"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
  r = run_command(kConvert + " tuna-to-gguf " + hf.string() + " " + out.string() + " --type bf16", tmp / "l6");
  EXPECT_EQ(r.exit_code, 0) << r.output;

  // No tokenizer: llama.cpp cannot run the file.
  fs::remove(hf / "tokenizer.model");
  r = run_command(kConvert + " tuna-to-gguf " + hf.string() + " " + (tmp / "n.gguf").string(), tmp / "l7");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("has no tokenizer file"), std::string::npos) << r.output;

  // A tokenizer with more ids than the model has embedding rows.
  write_gguf_source(tmp / "small", "tests/fixtures/llama32_tiny/config.json", 128, 1, {"llama3/tokenizer.json.zst"});
  r = run_command(kConvert + " tuna-to-gguf " + (tmp / "small").string() + " " + (tmp / "s.gguf").string(), tmp / "l8");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("more than the model's vocab_size (128): llama.cpp needs an embedding row for every token"),
            std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "s.gguf"));
}

}  // namespace
}  // namespace tuna

namespace tuna {
namespace {

// LoRA adapters through build/convert: a PEFT adapter imported as a LoRA checkpoint, merged into a Hugging Face
// model, held to its base's checksum (--base names another copy of the same weights); what cannot work is refused.
TEST(ConvertLora, ImportMergeAndBase) {
  TempDir tmp("convert_lora");
  const std::string base = (tmp / "base").string();
  fs::create_directories(base);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(fs::path("tests/fixtures/llama2_tiny") / f, fs::path(base) / f);
  const std::string ckpt = (tmp / "ckpt").string(), merged = (tmp / "merged").string();
  auto r = run_command(kConvert + " peft-to-tuna tests/fixtures/lora_llama2_tiny " + ckpt + " --base " + base, tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(ckpt) / "adapter_model.safetensors"));
  r = run_command(kConvert + " merge-lora " + ckpt + " " + merged + " --dtype bf16 --max_shard_bytes 65536", tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(merged) / "model.safetensors.index.json"));
  EXPECT_EQ(read_config_json(merged)["torch_dtype"], "bfloat16");
  r = run_command(kConvert + " merge-lora " + ckpt + " " + merged, tmp / "log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("--overwrite"), std::string::npos) << r.output;
  r = run_command(kConvert + " tuna-to-hf " + ckpt + " " + (tmp / "hf").string(), tmp / "log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("merge-lora"), std::string::npos) << r.output;
  r = run_command(kConvert + " hf-to-tuna " + base + " " + (tmp / "imported").string() + " --base " + base, tmp / "log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("option 'base'"), std::string::npos) << r.output;

  // The base changed in place: refused, naming both; the fixture it was copied from is the same weights: accepted.
  {
    std::fstream f(fs::path(base) / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);
    const float x = 0.5f;
    f.write(reinterpret_cast<const char*>(&x), 4);
  }
  r = run_command(kConvert + " merge-lora " + ckpt + " " + merged + " --overwrite", tmp / "log");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("has changed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(base), std::string::npos) << r.output;
  r = run_command(kConvert + " merge-lora " + ckpt + " " + merged + " --overwrite --dtype fp32 --base tests/fixtures/llama2_tiny",
                  tmp / "log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_config_json(merged)["torch_dtype"], "float32");
}

// A QLoRA checkpoint imported with peft-to-tuna keeps its quantization: build/eval scores the import exactly as the
// original (it once scored it on the unquantized base: 6.5729 against 6.5800).
TEST(ConvertLora, AQloraCheckpointImportedEvaluatesAsTheOriginal) {
  TempDir tmp("convert_qlora");
  testing_util::write_test_shards(tmp / "data");
  const std::string data = (tmp / "data").string(), bin = testing_util::build_dir();
  auto r = run_command(bin + "/train --init tests/fixtures/llama32_tiny --base_quant nf4 --train_data " + data +
                           " --seq_len 16 --micro_batch 2 --steps 2 --lr 1e-2 --ckpt_every 0 --val_every 0 --threads 2"
                           " --device cpu --lora_rank 4 --out_dir " + (tmp / "run").string(),
                       tmp / "log_train");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path original = tmp / "run" / "ckpt" / "step_00000002", imported = tmp / "imported";
  r = run_command(kConvert + " peft-to-tuna " + original.string() + " " + imported.string(), tmp / "log_import");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(read_file(imported / "base_model.json")).value("quantization", ""), "nf4");
  const auto loss = [&](const fs::path& ckpt) {
    auto e = run_command(bin + "/eval --checkpoint " + ckpt.string() + " --data " + data +
                             " --seq_len 16 --threads 2 --device cpu --quiet",
                         tmp / "log_eval");
    EXPECT_EQ(e.exit_code, 0) << e.output;
    const std::string last = e.output.substr(e.output.rfind('{'));
    return nlohmann::json::parse(last.substr(0, last.find('\n')))["loss"].get<double>();
  };
  EXPECT_EQ(loss(imported), loss(original));
}

// merge-lora of adapters on a base whose tokenizer tuna cannot read: the merge succeeds (the files are copied as they
// are) with a warning; "error:" is only ever the line of a command that failed.
TEST(ConvertLora, ABaseTokenizerTunaCannotReadIsAWarningNotAnError) {
  TempDir tmp("convert_lora_tokenizer");
  const fs::path base = tmp / "base";
  fs::create_directories(base);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(fs::path("tests/fixtures/llama2_tiny") / f, base / f);
  auto r = run_command(kConvert + " peft-to-tuna tests/fixtures/lora_llama2_tiny " + (tmp / "ckpt").string() +
                           " --base " + base.string(),
                       tmp / "log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ofstream(base / "tokenizer.model") << "not a tokenizer";  // the base's checksum covers config and tensors
  r = run_command(kConvert + " merge-lora " + (tmp / "ckpt").string() + " " + (tmp / "merged").string(), tmp / "log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: the tokenizer files were copied as they are, but tuna cannot read them"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find((tmp / "merged" / "tokenizer.model").string()), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("error:"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "merged" / "tokenizer.model"));
}

}  // namespace
}  // namespace tuna
