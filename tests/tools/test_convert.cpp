// build/convert: HF -> tuna -> HF is bit-exact (fp32 and bf16, single file and sharded), pickle formats
// are refused with a way out, and, where Python with transformers is installed, transformers loads the
// exported directory and computes the same logits (tools/reference/check_export.py).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "model/safetensors.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
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

}  // namespace
}  // namespace tuna
