// ckpt/hf_convert.h's export from a checkpoint written by several ranks: the rank files are read a bounded run
// at a time (no copy of the model on the host), and the export is the same bytes as from the single-file
// checkpoint of the same weights. (The round trips through transformers are tests/tools/test_convert.cpp's.)
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "ckpt/checkpoint.h"
#include "ckpt/hf_convert.h"
#include "model/llama.h"
#include "model/optimizer.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::TempDir;

TEST(HfConvert, ExportsRankFilesThroughBoundedBuffers) {
  TempDir tmp("hf_export");
  const LlamaConfig cfg = LlamaConfig::load("tests/fixtures/llama2_tiny");
  Llama model(cfg, 1, 4);
  model.init_random(5);
  const ParamLayout& layout = model.layout();
  AdamW opt(layout, OptimizerConfig{});
  const nlohmann::json config_json = cfg.to_json();
  CheckpointContents whole{&config_json, model.params.data(), {opt.m.data(), opt.v.data(), 0}, {}, {}};
  const fs::path single = save_checkpoint(tmp / "single", 1, layout, whole, 0);

  // Two ranks, each a piece of every unit (ZeRO's split), writing their files.
  prepare_sharded_checkpoint(tmp / "sharded", 1);
  for (int rank = 0; rank < 2; rank++) {
    const std::vector<Segment> pieces = dp_unit_pieces(layout, rank, 2);
    const StateExport export_state = [&](const StateSink& sink) {
      for (size_t i = 0; i < pieces.size(); i++)
        sink(i, model.params.data() + pieces[i].begin, opt.m.data() + pieces[i].begin, opt.v.data() + pieces[i].begin);
    };
    write_checkpoint_shard(checkpoint_tmp_dir(tmp / "sharded", 1), rank, layout,
                           ShardState{&pieces, export_state, 0, true});
  }
  const fs::path sharded =
      finish_sharded_checkpoint(tmp / "sharded", 1, CheckpointContents{&config_json, nullptr, {}, {}, {}}, 0);
  ASSERT_TRUE(is_sharded_checkpoint(sharded));

  for (const char* dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    const ConvertReport a = export_hf(single, tmp / (std::string("hf_single_") + dtype), dtype, int64_t(1) << 30);
    const ConvertReport b = export_hf(sharded, tmp / (std::string("hf_sharded_") + dtype), dtype, int64_t(1) << 30);
    EXPECT_TRUE(read_file(tmp / (std::string("hf_single_") + dtype) / "model.safetensors") ==
                read_file(tmp / (std::string("hf_sharded_") + dtype) / "model.safetensors"));
    EXPECT_EQ(a.parameters, layout.total());
    // One run of one tensor at a time, in fp32 and in the target dtype: never the model.
    int64_t largest = 0;
    for (const ParamTensor& t : layout.tensors()) largest = std::max(largest, t.numel);
    const int64_t model_bytes = layout.total() * int64_t(sizeof(float));
    std::printf("  %s: host staging %.3f MB for a model of %.3f MB (largest tensor %.3f MB in fp32)\n", dtype,
                b.host_staging_bytes / 1e6, model_bytes / 1e6, largest * 4 / 1e6);
    EXPECT_GT(b.host_staging_bytes, 0);
    EXPECT_LE(b.host_staging_bytes, largest * int64_t(sizeof(float) + 2));
    EXPECT_LT(b.host_staging_bytes, model_bytes / 4);
  }
}

}  // namespace
}  // namespace tuna
