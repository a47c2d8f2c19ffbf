// Checkpoints: an atomic, complete directory per step, pruning, and weight loading that names what is
// wrong (missing tensor, wrong shape, tensor of another architecture).
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <filesystem>
#include <fstream>

#include "core/dtype.h"
#include "core/error.h"
#include "ckpt/checkpoint.h"
#include "model/llama.h"
#include "model/optimizer.h"
#include "ckpt/safetensors.h"
#include "comm/comm.h"
#include "tests/test_util.h"

#include <nlohmann/json.hpp>

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

// ckpt/latest follows every save (a symlink, replaced atomically), and resolve_checkpoint gives the same step
// directory with or without the link (a filesystem without symlinks); "latest" with no checkpoint is an error.
TEST(Checkpoint, LatestNamesTheNewestCheckpoint) {
  TempDir tmp("ckpt_latest");
  LlamaConfig cfg = tiny();
  Llama model(cfg, 1, 4);
  model.init_random(3);
  nlohmann::json config_json = cfg.to_json();
  const std::string latest = (tmp / "latest").string();
  EXPECT_NE(error_of([&] { resolve_checkpoint(latest); }).find("no complete checkpoint"), std::string::npos);
  for (int64_t step : {5, 10}) {
    CheckpointContents c{&config_json, model.params.data(), {}, {{"train_config", {{"seq_len", 64}}}}, {}};
    save_checkpoint(tmp.path, step, model.layout(), c, /*keep_last=*/1);
    ASSERT_TRUE(fs::is_symlink(tmp / "latest"));
    EXPECT_EQ(fs::read_symlink(tmp / "latest"), fs::path(step == 5 ? "step_00000005" : "step_00000010"));
    EXPECT_EQ(resolve_checkpoint(latest), tmp / (step == 5 ? "step_00000005" : "step_00000010"));
  }
  EXPECT_TRUE(fs::exists(tmp / "latest" / "model.safetensors"));  // any tool can open it
  fs::remove(tmp / "latest");
  EXPECT_EQ(resolve_checkpoint(latest), tmp / "step_00000010");
  // Other paths are what they say; a training checkpoint knows its seq_len, a model directory does not.
  EXPECT_EQ(resolve_checkpoint("tests/fixtures/llama32_tiny"), fs::path("tests/fixtures/llama32_tiny"));
  EXPECT_EQ(training_seq_len(tmp / "step_00000010"), std::optional<int64_t>(64));
  EXPECT_EQ(training_seq_len("tests/fixtures/llama32_tiny"), std::nullopt);
  // 12 bytes per parameter (weights and two moments in fp32) and a little more.
  EXPECT_GE(checkpoint_bytes(cfg.n_params(), std::vector<TokenizerFile>{}), 12 * cfg.n_params());
  EXPECT_LE(checkpoint_bytes(cfg.n_params(), std::vector<TokenizerFile>{}), 12 * cfg.n_params() + (int64_t(2) << 20));
}

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

// Rank files of a tp 2 x dp 2 run (column and row blocks, each cut in two ZeRO pieces) read back whole at tp 1 and as
// the other layout's blocks at tp 2: every element where it belongs (column blocks are read a row at a time, each
// row found in the piece by bisection).
TEST(Checkpoint, RankFilesOfATensorParallelRunReadBackAtAnyLayout) {
  TempDir tmp("ckpt_tp");
  TrainedState state;
  const ParamLayout& whole = state.model.layout();
  const nlohmann::json config_json = state.cfg.to_json();
  const CheckpointContents contents{&config_json, state.model.params.data(),
                                    {state.opt.m.data(), state.opt.v.data(), 3}, {}, {}};
  const fs::path single = save_checkpoint(tmp / "single", 1, whole, contents, 0);
  prepare_sharded_checkpoint(tmp / "tp", 1);
  for (int tp_rank = 0; tp_rank < 2; tp_rank++) {
    const ParamLayout block(state.cfg, tp_rank, 2);
    std::vector<float> p(block.total()), m(block.total()), v(block.total());
    CheckpointReader(single, block).read(Segment{0, block.total()}, p.data(), m.data(), v.data());
    for (int dp_rank = 0; dp_rank < 2; dp_rank++) {
      const std::vector<Segment> pieces = dp_unit_pieces(block, dp_rank, 2);
      write_checkpoint_shard(checkpoint_tmp_dir(tmp / "tp", 1), dp_rank * 2 + tp_rank, block,
                             ShardState{&pieces,
                                        [&](const StateSink& sink) {
                                          for (size_t i = 0; i < pieces.size(); i++) {
                                            const int64_t at = pieces[i].begin;
                                            sink(i, p.data() + at, m.data() + at, v.data() + at);
                                          }
                                        },
                                        3, /*write_replicated=*/tp_rank == 0});
    }
  }
  const fs::path sharded = finish_sharded_checkpoint(tmp / "tp", 1, {&config_json, nullptr, {}, {}, {}}, 0);
  std::vector<float> p(whole.total()), m(whole.total()), v(whole.total());
  CheckpointReader(sharded, whole).read(Segment{0, whole.total()}, p.data(), m.data(), v.data());
  EXPECT_EQ(p, state.model.params);
  EXPECT_EQ(m, state.opt.m);
  EXPECT_EQ(v, state.opt.v);
  const ParamLayout block(state.cfg, 1, 2);
  std::vector<float> from_tp(block.total()), from_single(block.total()), unused(block.total());
  CheckpointReader(sharded, block).read(Segment{0, block.total()}, from_tp.data(), unused.data(), unused.data());
  CheckpointReader(single, block).read(Segment{0, block.total()}, from_single.data(), unused.data(), unused.data());
  EXPECT_EQ(from_tp, from_single);
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

  // A pipeline stage's layout (its own tensors, end to end) reads them out of the whole model's directory: the other
  // stages' tensors are the model's, not foreign; a tensor no stage has still is.
  write_with("", "", "");
  const std::vector<PipelineStage> stages = pipeline_stages(cfg, 2, 16);
  for (const PipelineStage& stage : stages) {
    const ParamLayout part(cfg, 0, 1, stage);
    std::vector<float> mine(part.total(), 0.0f);
    EXPECT_NO_THROW(load_weights(tmp.path, part, mine.data()));
    EXPECT_EQ(mine, std::vector<float>(part.total(), 1.0f));
  }
  write_with("", "", "model.layers.0.self_attn.q_proj.bias");
  const ParamLayout last(cfg, 0, 1, stages.back());
  std::vector<float> mine(last.total());
  msg = error_of([&] { load_weights(tmp.path, last, mine.data()); });
  EXPECT_NE(msg.find("q_proj.bias"), std::string::npos) << msg;
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

// ---- checkpoints that check themselves ----------------------------------------------------------------

using nlohmann::json;

struct SingleRankRun {
  LlamaConfig cfg = tiny();
  Llama model{cfg, 1, 4};
  AdamW opt{model.layout(), OptimizerConfig{}};
  json config_json = cfg.to_json();
  SingleRankRun() {
    model.init_random(3);
    for (size_t i = 0; i < opt.m.size(); i++) opt.m[i] = 0.001f * i, opt.v[i] = 0.002f * i;
  }
  fs::path save(const fs::path& root, int64_t step, int64_t keep = 0) {
    opt.steps_taken = step;
    CheckpointContents c{&config_json, model.params.data(), {opt.m.data(), opt.v.data(), opt.steps_taken},
                         {{"data_cursor", {{"epoch", 0}}}}, {}};
    return save_checkpoint(root, step, model.layout(), c, keep);
  }
};

void flip_byte(const fs::path& p, uint64_t at) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(at);
  f.write(&c, 1);
}

TEST(Checkpoint, ManifestListsEveryFileAndVerifies) {
  TempDir tmp("manifest");
  SingleRankRun run;
  const fs::path dir = run.save(tmp.path, 10);
  const json manifest = json::parse(testing_util::read_file(dir / kManifestFile));
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "config.json", "state.json"}) {
    ASSERT_TRUE(manifest["files"].contains(f)) << f;
    EXPECT_EQ(manifest["files"][f]["bytes"].get<uint64_t>(), fs::file_size(dir / f)) << f;
    EXPECT_EQ(manifest["files"][f]["xxh3_64"].get<std::string>(), hex64(digest_file(dir / f).xxh3)) << f;
  }
  EXPECT_EQ(verify_checkpoint(dir), "");
  // Split over 3 "ranks": each checks its share, together all.
  for (int part = 0; part < 3; part++) EXPECT_EQ(verify_checkpoint(dir, part, 3), "");

  flip_byte(dir / "optimizer.safetensors", fs::file_size(dir / "optimizer.safetensors") - 3);
  std::string problem = verify_checkpoint(dir);
  EXPECT_NE(problem.find("optimizer.safetensors: checksum"), std::string::npos) << problem;
  fs::resize_file(dir / "model.safetensors", 100);
  problem = verify_checkpoint(dir);
  EXPECT_NE(problem.find("model.safetensors: 100 bytes, the manifest says"), std::string::npos) << problem;
  const fs::path other = run.save(tmp.path, 20);
  std::ofstream(other / "rank_00003.safetensors") << "x";
  EXPECT_NE(verify_checkpoint(other).find("rank_00003.safetensors: not in the manifest"), std::string::npos);
  fs::remove(other / kManifestFile);
  bool unverified = false;
  EXPECT_EQ(verify_checkpoint(other, 0, 1, &unverified), "");  // written before manifests: accepted, flagged
  EXPECT_TRUE(unverified);
}

TEST(Checkpoint, ResumeFallsBackToTheNewestThatVerifies) {
  TempDir tmp("fallback");
  SingleRankRun run;
  for (int64_t step : {10, 20, 30}) run.save(tmp.path, step);
  flip_byte(tmp / "step_00000030" / "model.safetensors", 200);
  std::unique_ptr<Comm> world = make_single_comm();
  std::vector<std::string> warnings;
  auto warn = [&](const std::string& m) { warnings.push_back(m); };
  std::optional<fs::path> dir = resume_checkpoint(tmp.path, *world, warn);
  ASSERT_TRUE(dir);
  EXPECT_EQ(dir->filename(), "step_00000020");
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find("step_00000030 fails verification"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[1].find("resuming from"), std::string::npos) << warnings[1];
  // Out of the rotation's way: a later save with keep 1 keeps the good checkpoint it resumed from's successor,
  // not the rejected one.
  EXPECT_FALSE(fs::exists(tmp / "step_00000030"));
  EXPECT_TRUE(fs::exists(tmp / "rejected-step_00000030"));
  run.save(tmp.path, 25, /*keep=*/1);
  EXPECT_EQ(list_checkpoints(tmp.path), std::vector<fs::path>{tmp / "step_00000025"});
  // Nothing verifies: an error, not a silent fresh start.
  flip_byte(tmp / "step_00000025" / "state.json", 3);
  EXPECT_NE(error_of([&] { resume_checkpoint(tmp.path, *world, warn); }).find("none of the 1 checkpoints verifies"),
            std::string::npos);
  TempDir empty("fallback_empty");
  EXPECT_FALSE(resume_checkpoint(empty.path, *world, warn));
}

// A kill -9 during the rotation leaves no half-deleted step_* directory: each checkpoint is renamed to
// .deleting-* before its files go, and the next start removes such names (and unfinished .tmp-step_*).
// A child process rotates checkpoints of many files (so that most of its time is spent deleting) and is
// killed at varying moments; every step_* directory left must be whole.
TEST(Checkpoint, RotationKilledMidwayLeavesNoHalfDeletedCheckpoint) {
  constexpr int kFiles = 1500;
  for (int trial = 0; trial < 5; trial++) {
    TempDir tmp("rotatekill");
    const fs::path root = tmp / "ckpt";
    fs::create_directories(root);
    const pid_t child = fork();
    if (child == 0) {
      for (int64_t step = 1;; step++) {
        const fs::path tmp_dir = root / (".tmp-" + step_dir_name(step));
        fs::create_directories(tmp_dir);
        for (int f = 0; f < kFiles; f++) std::ofstream(tmp_dir / ("part-" + std::to_string(f))) << f;
        std::ofstream(tmp_dir / "state.json") << "{\"step\": " << step << "}\n";
        fs::rename(tmp_dir, root / step_dir_name(step));
        prune_checkpoints(root, 1);
      }
    }
    // Killed in the middle of a rotation: once a new checkpoint is in place beside the old one (whose deletion
    // begins then), or an old one is seen under its .deleting-* name.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (bool rotating = false; !rotating && std::chrono::steady_clock::now() < deadline;) {
      int64_t steps = 0;
      std::error_code ec;
      for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        steps += checkpoint_step(it->path()) >= 0;
        rotating |= name.rfind(kDeletingPrefix, 0) == 0;
      }
      rotating |= steps >= 2;
    }
    kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    int64_t step_dirs = 0;
    for (const auto& e : fs::directory_iterator(root)) {
      if (checkpoint_step(e.path()) < 0) continue;
      step_dirs++;
      int64_t files = 0;
      for (auto it = fs::directory_iterator(e.path()); it != fs::directory_iterator(); ++it) files++;
      EXPECT_EQ(files, kFiles + 1) << e.path() << " is half deleted (trial " << trial << ")";
    }
    EXPECT_LE(step_dirs, 2);  // the one kept, and perhaps the new one before its rotation
    // The next start removes what the kill left (a .deleting-* or a .tmp-step_*), and only that.
    clean_checkpoint_leftovers(root);
    for (const auto& e : fs::directory_iterator(root))
      EXPECT_GE(checkpoint_step(e.path()), 0) << e.path() << " was left after the start's cleaning";
  }
}

TEST(Checkpoint, DirectoryNamesThatAreNotCheckpointsAreIgnored) {
  EXPECT_EQ(checkpoint_step("ckpt/step_00000010"), 10);
  EXPECT_EQ(checkpoint_step("ckpt/step_123456789"), 123456789);
  for (const char* bad : {"step_99999999999999999999", "step_10", "step_-0000001", "step_", "step_0000001x", "rejected-step_00000010"})
    EXPECT_EQ(checkpoint_step(bad), -1) << bad;
  TempDir tmp("names");
  SingleRankRun run;
  run.save(tmp.path, 10);
  fs::create_directories(tmp / "step_99999999999999999999");
  std::ofstream(tmp / "step_99999999999999999999" / "state.json") << "{\"step\": 1}";
  EXPECT_EQ(latest_checkpoint(tmp.path), tmp / "step_00000010");
}

TEST(Checkpoint, StateMustAgreeWithItsDirectoryAndTheOptimizer) {
  TempDir tmp("state");
  SingleRankRun run;
  const fs::path dir = run.save(tmp.path, 10);
  TrainingState state = read_training_state(dir);
  EXPECT_EQ(state.step, 10);
  EXPECT_NO_THROW(check_optimizer_steps(state, 10, dir));
  EXPECT_NE(error_of([&] { check_optimizer_steps(state, 7, dir); }).find("taken 7 updates"), std::string::npos);
  state.skipped_steps = 3;  // three non-finite steps that AdamW did not count
  EXPECT_NO_THROW(check_optimizer_steps(state, 7, dir));

  auto with_state = [&](const std::string& text) {
    std::ofstream(dir / "state.json") << text;
    return error_of([&] { read_training_state(dir); });
  };
  EXPECT_NE(with_state(R"({"step": 417, "data_cursor": {}})").find("step 417 disagrees with the directory's name"),
            std::string::npos);
  EXPECT_NE(with_state(R"({"step": -9223372036854775808, "data_cursor": {}})").find("field 'step'"), std::string::npos);
  EXPECT_NE(with_state(R"({"step": 10})").find("field 'data_cursor' is missing"), std::string::npos);
  EXPECT_NE(with_state(R"({"step": 10, "data_cursor": null})").find("field 'data_cursor' is null"), std::string::npos);
  EXPECT_NE(with_state(R"({"step": 10, "data_cursor": {}, "skipped_steps": 11})").find("field 'skipped_steps'"),
            std::string::npos);
  EXPECT_NE(with_state(R"({"step": "10", "data_cursor": {}})").find("field 'step': expected an integer"),
            std::string::npos);
  EXPECT_NE(with_state(std::string(5000, '{')).find("nested deeper"), std::string::npos);
}

TEST(Checkpoint, NonFiniteStateIsNeverWritten) {
  TempDir tmp("nonfinite");
  SingleRankRun run;
  run.save(tmp.path, 10, /*keep=*/1);
  run.model.params[run.model.layout().find("model.layers.1.mlp.up_proj.weight")->offset + 5] = NAN;
  const std::string msg = error_of([&] { run.save(tmp.path, 20, 1); });
  EXPECT_NE(msg.find("refusing to write the checkpoint of step 20: weight 'model.layers.1.mlp.up_proj.weight' element 5 is nan"),
            std::string::npos)
      << msg;
  EXPECT_EQ(list_checkpoints(tmp.path), std::vector<fs::path>{tmp / "step_00000010"});  // the last good one stays
  // Nor are the moments (NonFiniteStateIsNeverRead: nor is either read back).
  run.model.params[run.model.layout().find("model.layers.1.mlp.up_proj.weight")->offset + 5] = 1.0f;
  run.opt.v[17] = INFINITY;
  EXPECT_NE(error_of([&] { run.save(tmp.path, 20, 1); }).find("AdamW second moment"), std::string::npos);
}

// A checkpoint of 2 data-parallel ranks (one file per rank) whose pieces metadata can be tampered with.
struct ShardedRun {
  TempDir tmp{"pieces"};
  LlamaConfig cfg = tiny();
  ParamLayout layout{cfg};
  std::vector<float> params, m, v;
  fs::path dir;
  ShardedRun() {
    params.resize(layout.total()), m.resize(layout.total()), v.resize(layout.total());
    for (int64_t i = 0; i < layout.total(); i++) params[i] = 0.01f * (i % 97), m[i] = 1e-3f, v[i] = 1e-6f;
    json config_json = cfg.to_json();
    prepare_sharded_checkpoint(tmp.path, 5);
    for (int r = 0; r < 2; r++) {
      const std::vector<Segment> segs = dp_unit_pieces(layout, r, 2);
      std::vector<float> sp, sm, sv;
      for (const Segment& s : segs)
        for (int64_t i = s.begin; i < s.begin + s.size; i++) sp.push_back(params[i]), sm.push_back(m[i]), sv.push_back(v[i]);
      write_checkpoint_shard(checkpoint_tmp_dir(tmp.path, 5), r, layout,
                             ShardState{&segs, shard_buffers_export(segs, sp.data(), sm.data(), sv.data()), 5});
    }
    CheckpointContents c{&config_json, nullptr, {}, {{"data_cursor", json::object()}}, {}};
    dir = finish_sharded_checkpoint(tmp.path, 5, c, 0);
  }
  std::string load() {
    return error_of([&] {
      std::vector<float> p, mm, vv;
      load_checkpoint_shard(dir, layout, {Segment{0, layout.total()}}, p, mm, vv);
      EXPECT_EQ(p, params);
    });
  }
  // Rewrites rank 1's file with its pieces metadata edited.
  void edit_rank1(const std::function<void(json&)>& edit, const std::string& steps_taken = "5") {
    const fs::path file = dir / "rank_00001.safetensors";
    SafetensorsWriter w;
    std::vector<std::vector<std::byte>> copies;
    {
      SafetensorsFile f(file);
      json pieces = json::parse(f.metadata().at("pieces"));
      edit(pieces);
      w.add_metadata("pieces", pieces.dump());
      w.add_metadata("steps_taken", steps_taken);
      for (const TensorInfo& t : f.tensors()) {
        copies.emplace_back(f.data(t), f.data(t) + t.nbytes());
        w.add(t.name, t.dtype, t.shape, copies.back().data());
      }
    }
    w.write(file);
  }
};

// Rewrites a float32 safetensors file with element `index` of tensor `name` set to NaN (as damage, or a writer
// other than tuna's, would leave it).
void set_element_nan(const fs::path& file, const std::string& name, int64_t index) {
  SafetensorsWriter w;
  std::vector<std::vector<std::byte>> copies;
  {
    SafetensorsFile f(file);
    for (const auto& [key, value] : f.metadata()) w.add_metadata(key, value);
    for (const TensorInfo& t : f.tensors()) {
      copies.emplace_back(f.data(t), f.data(t) + t.nbytes());
      if (t.name == name) {
        ASSERT_EQ(t.dtype, DType::F32);
        const float nan = NAN;
        std::memcpy(copies.back().data() + index * sizeof(float), &nan, sizeof(float));
      }
      w.add(t.name, t.dtype, t.shape, copies.back().data());
    }
  }
  w.write(file);
}

// The read side of NonFiniteStateIsNeverWritten: a NaN that got into a file some other way is refused by file,
// tensor and index, from a single-file checkpoint (load_weights: eval, sample, --init) and from rank files
// (load_checkpoint_shard: --resume), on exactly the elements read.
TEST(Checkpoint, NonFiniteStateIsNeverRead) {
  TempDir tmp("nonfiniteread");
  SingleRankRun run;
  const fs::path dir = run.save(tmp.path, 10);
  set_element_nan(dir / "model.safetensors", "model.layers.1.mlp.up_proj.weight", 5);
  std::vector<float> weights(run.model.layout().total());
  std::string msg = error_of([&] { load_weights(dir, run.model.layout(), weights.data()); });
  EXPECT_NE(msg.find("tensor 'model.layers.1.mlp.up_proj.weight' in " + (dir / "model.safetensors").string() +
                     ": element 5 is nan"),
            std::string::npos)
      << msg;

  ShardedRun sharded;
  std::string piece;
  {
    SafetensorsFile f(sharded.dir / "rank_00001.safetensors");
    for (const TensorInfo& t : f.tensors())
      if (piece.empty() && t.name.rfind("exp_avg", 0) != 0 && t.shape[0] > 3) piece = t.name;
  }
  ASSERT_FALSE(piece.empty());
  set_element_nan(sharded.dir / "rank_00001.safetensors", piece, 3);
  msg = sharded.load();
  EXPECT_NE(msg.find("tensor '" + piece + "' in " + (sharded.dir / "rank_00001.safetensors").string() +
                     ": element 3 is nan"),
            std::string::npos)
      << msg;
}

TEST(Checkpoint, PiecesMetadataIsCheckedBeforeAnyElementIsPlaced) {
  ShardedRun run;
  EXPECT_EQ(run.load(), "");
  EXPECT_EQ(verify_checkpoint(run.dir), "");
  // A 2-D tensor that rank 1 holds part of, from an element past its start (so a begin of 0 overlaps rank 0's).
  std::string q;
  for (const ParamTensor& t : run.layout.tensors())
    for (const Segment& s : dp_unit_pieces(run.layout, 1, 2))
      if (q.empty() && t.shape.size() == 2 && s.begin > t.offset && s.begin < t.offset + t.numel) q = t.name;
  ASSERT_FALSE(q.empty());
  const std::vector<int64_t> shape = run.layout.find(q)->shape;
  struct Case {
    std::function<void(json&)> edit;
    std::string expected;
  };
  const std::vector<Case> cases = {
      // A heap overflow found before: a begin or split_begin far outside the tensor.
      {[&](json& p) { p[q]["begin"] = int64_t{1} << 40; }, "field 'begin': expected an integer in [0, "},
      {[&](json& p) { p[q]["begin"] = -1; }, "field 'begin'"},
      {[&](json& p) { p[q]["split_begin"] = 1000000; }, "field 'split_begin'"},
      {[&](json& p) { p[q]["split_dim"] = 0, p[q]["split_begin"] = 3; }, "field 'split_begin'"},
      // A zero dimension used to divide by zero (SIGFPE).
      {[&](json& p) { p[q]["shape"] = {0, 64}; }, "field 'shape' element 0"},
      {[&](json& p) { p[q]["global_shape"] = {64, 0}; }, "field 'global_shape' element 1"},
      {[&](json& p) { p[q].erase("shape"); }, "field 'shape'"},
      {[&](json& p) { p[q]["split_dim"] = "0"; }, "field 'split_dim': expected an integer"},
      {[&](json& p) { p[q]["split_dim"] = 7; }, "field 'split_dim'"},
      {[&](json& p) { p[q]["begin"] = 1.5; }, "field 'begin': expected an integer"},
      {[&](json& p) { p[q] = 3; }, "expected an object"},
      {[&](json& p) { p[q]["shape"] = {shape[0], shape[1] / 2}; }, "is not a block of the global shape"},
      {[&](json& p) { p[q]["shape"] = {shape[0] / 2, shape[1]}; }, "run past the"},
      {[&](json& p) { p[q]["begin"] = 0; }, "also in another piece"},
      {[&](json& p) { p[q]["global_shape"] = {shape[0] + 1, shape[1]}; }, "global shape ["},
      {[&](json& p) { p = json::array(); }, "metadata 'pieces': expected an object"},
      {[&](json& p) { p.erase(q); }, "hold"},
  };
  for (const Case& c : cases) {
    ShardedRun fresh;
    fresh.edit_rank1(c.edit);
    const std::string msg = fresh.load();
    EXPECT_NE(msg.find(c.expected), std::string::npos) << "expected \"" << c.expected << "\", got: " << msg;
    EXPECT_NE(verify_checkpoint(fresh.dir), "");  // and the manifest sees the file changed
  }
  ShardedRun steps;
  steps.edit_rank1([](json&) {}, "4");
  EXPECT_NE(steps.load().find("metadata 'steps_taken' is 4"), std::string::npos) << steps.load();
  steps.edit_rank1([](json&) {}, "-9223372036854775808");
  EXPECT_NE(steps.load().find("expected an integer in [0, 2^62]"), std::string::npos) << steps.load();
}

}  // namespace
}  // namespace tuna
