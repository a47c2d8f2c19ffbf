// Checkpoints: an atomic, complete directory per step, pruning, and weight loading that names what is
// wrong (missing tensor, wrong shape, tensor of another architecture).
#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "model/checkpoint.h"
#include "model/llama.h"
#include "model/optimizer.h"
#include "model/safetensors.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::TempDir;

LlamaConfig tiny() { return LlamaConfig::load("tests/fixtures/llama32_tiny"); }

using testing_util::error_of;

TEST(Checkpoint, SavesLoadsAndKeepsTheNewest) {
  TempDir tmp("ckpt");
  LlamaConfig cfg = tiny();
  Llama model(cfg, 1, 4);
  model.init_random(7);
  AdamW opt(model.layout(), OptimizerConfig{});
  for (size_t i = 0; i < opt.m.size(); i++) opt.m[i] = 0.5f * i, opt.v[i] = 0.25f * i;
  opt.steps_taken = 3;
  nlohmann::json config_json = cfg.to_json();
  for (int64_t step : {10, 20, 30}) {
    CheckpointContents c{&config_json, model.params.data(), {opt.m.data(), opt.v.data(), opt.steps_taken}, {{"note", "x"}}, {}};
    save_checkpoint(tmp.path, step, model.layout(), c, /*keep_last=*/2);
  }
  EXPECT_FALSE(fs::exists(tmp / "step_00000010"));
  EXPECT_TRUE(fs::exists(tmp / "step_00000020"));
  // An interrupted write (no state.json, or still under its temporary name) is never taken.
  fs::create_directories(tmp / "step_00000040");
  fs::create_directories(tmp / ".tmp-step_00000050");
  auto latest = latest_checkpoint(tmp.path);
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->filename(), "step_00000030");
  EXPECT_EQ(read_state(*latest)["step"], 30);

  Llama back(cfg, 1, 4);
  load_weights(*latest, back.layout(), back.params.data());
  EXPECT_EQ(back.params, model.params);
  AdamW opt2(back.layout(), OptimizerConfig{});
  load_optimizer(*latest, back.layout(), opt2);
  EXPECT_EQ(opt2.m, opt.m);
  EXPECT_EQ(opt2.v, opt.v);
  EXPECT_EQ(opt2.steps_taken, 3);
}

TEST(Checkpoint, LoadWeightsNamesMissingWrongAndForeignTensors) {
  TempDir tmp("weights");
  LlamaConfig cfg = tiny();
  ParamLayout layout(cfg);
  std::vector<float> params(layout.total(), 1.0f);
  std::ofstream(tmp / "config.json") << cfg.to_json().dump();
  auto write_with = [&](const std::string& skip, const std::string& reshape, const std::string& extra) {
    SafetensorsWriter w;
    std::vector<int64_t> bad_shape;
    for (const ParamTensor& t : layout.tensors()) {
      if (t.name == skip) continue;
      if (t.name == reshape) {
        bad_shape = t.shape;
        bad_shape[0] -= 1;
        w.add(t.name, DType::F32, bad_shape, params.data() + t.offset);
      } else {
        w.add(t.name, DType::F32, t.shape, params.data() + t.offset);
      }
    }
    if (!extra.empty()) w.add(extra, DType::F32, {1}, params.data());
    w.write(tmp / "model.safetensors");
  };
  const std::string q = "model.layers.1.self_attn.q_proj.weight";

  write_with(q, "", "");
  std::string msg = error_of([&] { load_weights(tmp.path, layout, params.data()); });
  EXPECT_NE(msg.find(q), std::string::npos) << msg;

  write_with("", q, "");
  msg = error_of([&] { load_weights(tmp.path, layout, params.data()); });
  EXPECT_NE(msg.find("[64, 64]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[63, 64]"), std::string::npos) << msg;

  write_with("", "", "model.layers.0.self_attn.q_proj.bias");
  msg = error_of([&] { load_weights(tmp.path, layout, params.data()); });
  EXPECT_NE(msg.find("q_proj.bias"), std::string::npos) << msg;
  EXPECT_NE(msg.find(tmp.path.string()), std::string::npos) << msg;

  write_with("", "", "model.layers.0.self_attn.rotary_emb.inv_freq");  // old exports carry it: harmless
  EXPECT_NO_THROW(load_weights(tmp.path, layout, params.data()));
}

TEST(Checkpoint, ResumeWithoutOptimizerStateIsAnError) {
  TempDir tmp("noopt");
  LlamaConfig cfg = tiny();
  ParamLayout layout(cfg);
  AdamW opt(layout, OptimizerConfig{});
  std::string msg = error_of([&] { load_optimizer(tmp.path, layout, opt); });
  EXPECT_NE(msg.find("optimizer.safetensors"), std::string::npos) << msg;
}

}  // namespace
}  // namespace tuna
