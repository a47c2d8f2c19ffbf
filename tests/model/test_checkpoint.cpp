// Checkpoints: an atomic, complete directory per step, pruning, and weight loading that names what is
// wrong (missing tensor, wrong shape, tensor of another architecture).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/dtype.h"
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

// A model with random weights and distinct moments at step 3: a checkpoint's state.
struct TrainedState {
  LlamaConfig cfg = tiny();
  Llama model{cfg, 1, 4};
  AdamW opt{model.layout(), OptimizerConfig{}};
  TrainedState() {
    model.init_random(7);
    for (size_t i = 0; i < opt.m.size(); i++) opt.m[i] = 0.5f * i, opt.v[i] = 0.25f * i;
    opt.steps_taken = 3;
  }
};

TEST(Checkpoint, SavesLoadsAndKeepsTheNewest) {
  TempDir tmp("ckpt");
  TrainedState state;
  const LlamaConfig& cfg = state.cfg;
  const Llama& model = state.model;
  const AdamW& opt = state.opt;
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

// Whole buffers as one rank's engine hands them out: a unit at a time, in order.
std::vector<Segment> unit_pieces(const ParamLayout& layout) {
  std::vector<Segment> units;
  for (int u = 0; u < layout.num_units(); u++)
    units.push_back({layout.unit_range(u).first, layout.unit_range(u).second - layout.unit_range(u).first});
  return units;
}

// The state handed a unit at a time becomes the same files, byte for byte, as the whole buffers written tensor by
// tensor (what the writer did before it streamed), and pieces out of order are refused, not written misplaced.
TEST(Checkpoint, StreamedPiecesWriteTheBytesOfTheWholeBuffers) {
  TempDir tmp("ckpt_stream");
  TrainedState state;
  const LlamaConfig& cfg = state.cfg;
  const Llama& model = state.model;
  const AdamW& opt = state.opt;
  const ParamLayout& layout = model.layout();
  const nlohmann::json config_json = cfg.to_json();
  std::vector<Segment> units = unit_pieces(layout);
  ASSERT_GT(units.size(), 2u);
  size_t handed = 0;
  auto export_of = [&](const std::vector<Segment>& pieces) {
    return [&, pieces](const StateSink& sink) {
      for (size_t i = 0; i < pieces.size(); i++, handed++)
        sink(i, model.params.data() + pieces[i].begin, opt.m.data() + pieces[i].begin, opt.v.data() + pieces[i].begin);
    };
  };
  CheckpointContents c{&config_json, nullptr, {nullptr, nullptr, 3}, {{"note", "x"}}, {}, nullptr, &units,
                       export_of(units)};
  const fs::path dir = save_checkpoint(tmp.path, 1, layout, c, 0);
  EXPECT_EQ(handed, 2 * units.size());  // once for the weights' file, once for the moments'

  SafetensorsWriter weights, moments;
  weights.add_metadata("format", "pt");
  weights.add_metadata("producer", "tuna");
  moments.add_metadata("producer", "tuna");
  moments.add_metadata("steps_taken", "3");
  for (const ParamTensor& t : layout.tensors()) {
    weights.add(t.name, DType::F32, t.shape, model.params.data() + t.offset);
    moments.add("exp_avg." + t.name, DType::F32, t.shape, opt.m.data() + t.offset);
    moments.add("exp_avg_sq." + t.name, DType::F32, t.shape, opt.v.data() + t.offset);
  }
  weights.write(tmp / "weights.safetensors");
  moments.write(tmp / "moments.safetensors");
  EXPECT_TRUE(testing_util::read_file(dir / "model.safetensors") == testing_util::read_file(tmp / "weights.safetensors"));
  EXPECT_TRUE(testing_util::read_file(dir / "optimizer.safetensors") ==
              testing_util::read_file(tmp / "moments.safetensors"));

  const std::vector<Segment> reversed(units.rbegin(), units.rend());
  CheckpointContents bad = c;
  bad.segments = &reversed;
  bad.export_state = export_of(reversed);
  EXPECT_NE(error_of([&] { save_checkpoint(tmp.path, 2, layout, bad, 0); }).find("out of layout order"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(tmp / "step_00000002"));
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

// Sharded init at scale: a Hugging Face directory with the weights split over two bf16 shard files and an index,
// read by a tensor-parallel rank (tp 2, rank 1) a ZeRO piece at a time (dp 3, rank 2): every piece equals the
// same elements of the whole model, cut to the rank's blocks. And the random initialization: any piece of any
// layout equals the whole initialization's elements.
TEST(Checkpoint, WeightReaderReadsPiecesOfShardedHfWeightsForAnyLayout) {
  TempDir tmp("ckpt_pieces");
  const LlamaConfig cfg = tiny();
  const ParamLayout whole(cfg);
  std::vector<float> values(whole.total());
  init_random_weights(whole, 11, 0.5, values.data());
  // Two shards, bf16 (as a published model), the index mapping each tensor to its file.
  std::vector<std::vector<uint16_t>> bits(2);
  nlohmann::json weight_map = nlohmann::json::object();
  {
    SafetensorsWriter shard[2];
    for (size_t k = 0; k < whole.tensors().size(); k++) {
      const ParamTensor& t = whole.tensors()[k];
      std::vector<uint16_t> b(t.numel);
      convert_from_f32(values.data() + t.offset, DType::BF16, b.data(), t.numel);
      for (int64_t i = 0; i < t.numel; i++) values[t.offset + i] = bf16_to_f32(b[i]);  // what the files hold
      bits.push_back(std::move(b));
      const int which = k % 2;
      shard[which].add(t.name, DType::BF16, t.shape, bits.back().data());
      weight_map[t.name] = which == 0 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    }
    shard[0].write(tmp / "model-00001-of-00002.safetensors");
    shard[1].write(tmp / "model-00002-of-00002.safetensors");
  }
  std::ofstream(tmp / "model.safetensors.index.json") << nlohmann::json{{"weight_map", weight_map}}.dump();
  std::ofstream(tmp / "config.json") << cfg.to_json().dump();

  const ParamLayout rank(cfg, /*tp_rank=*/1, /*tp_size=*/2);
  std::vector<float> expected(rank.total());
  for (const ParamTensor& t : rank.tensors())
    copy_block(t, values.data() + whole.find(t.name)->offset, expected.data() + t.offset);
  std::vector<float> random_expected(rank.total());
  init_random_weights(rank, 5, 0.02, random_expected.data());
  WeightReader reader(tmp.path, rank);
  for (int u = 0; u < rank.num_units(); u++) {
    const auto [begin, end] = rank.unit_range(u);
    const Range piece = shard_range(end - begin, /*rank=*/2, /*size=*/3);
    const Segment seg{begin + piece.begin, piece.size()};
    std::vector<float> got(seg.size, NAN), random(seg.size, NAN);
    reader.read(seg, got.data());
    init_random_weights_piece(rank, 5, 0.02, seg, random.data());
    for (int64_t i = 0; i < seg.size; i++) {
      ASSERT_EQ(got[i], expected[seg.begin + i]) << "unit " << u << " element " << i;
      ASSERT_EQ(random[i], random_expected[seg.begin + i]) << "unit " << u << " element " << i;
    }
  }
}

}  // namespace
}  // namespace tuna
