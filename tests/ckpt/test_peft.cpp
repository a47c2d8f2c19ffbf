// ckpt/peft.h: LoRA checkpoints in PEFT's format (one rank and rank files), the adapters read back for --lora_init,
// the base's identity, and base + adapters merged (eval/sample's weights, merge-lora, GGUF) against the PEFT +
// transformers fixtures of tools/reference/make_lora_fixtures.py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <tuple>

#include "ckpt/checkpoint.h"
#include "ckpt/gguf.h"
#include "ckpt/peft.h"
#include "ckpt/safetensors.h"
#include "comm/comm.h"
#include "core/checksum.h"  // digest_file: a manifest entry rewritten
#include "core/error.h"
#include "core/json.h"
#include "engine/engine.h"  // make_forward_model
#include "model/lora.h"
#include "tests/model/fixture.h"  // rel_err_norm
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing_util::read_file;
using testing_util::rel_err_norm;
using testing_util::TempDir;

const fs::path kBase2 = "tests/fixtures/llama2_tiny";
const fs::path kBase32 = "tests/fixtures/llama32_tiny";
const fs::path kLora2 = "tests/fixtures/lora_llama2_tiny";
const fs::path kLora32 = "tests/fixtures/lora_llama32_tiny";

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<float> random_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.5f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The elements of rank `tp`'s block of tensor t (a tp layout) out of the same tensor whole in `global`.
void copy_block(const ParamTensor& t, const ParamTensor& g, const float* global, float* out) {
  const int64_t cols = t.shape[1], gcols = g.shape[1];
  for (int64_t row = 0; row < t.shape[0]; row++)
    for (int64_t col = 0; col < cols; col++) {
      const int64_t grow = t.split_dim == 0 ? t.split_begin + row : row;
      const int64_t gcol = t.split_dim == 1 ? t.split_begin + col : col;
      out[t.offset + row * cols + col] = global[g.offset + grow * gcols + gcol];
    }
}

// A LoRA checkpoint of one rank with adapters `params` (the tp-1 layout of `lora`) on `base`.
fs::path write_lora_checkpoint(const fs::path& root, const fs::path& base, const LoraConfig& lora,
                               const std::vector<float>& params, int64_t step = 3) {
  const json config_json = read_config_json(base);
  const LoraLayout layout = lora_layout(LlamaConfig::from_json(config_json, "base"), lora);
  const std::vector<float> m = random_values(layout.params.total(), 11), v(layout.params.total(), 0.25f);
  const LoraFiles files = lora_files(lora, base);
  CheckpointContents c{&config_json, params.data(), {m.data(), v.data(), step}, json{{"step", step}}, {}};
  c.lora = &files;
  return save_checkpoint(root, step, layout.params, c, 0);
}

// The adapters of a PEFT directory, read through --lora_init's reader into the layout of `lora` on `base`.
std::vector<float> read_adapter(const fs::path& dir, const LlamaConfig& base, const LoraConfig& lora, int tp_rank = 0,
                                int tp_size = 1) {
  const LoraLayout layout = lora_layout(base, lora, tp_rank, tp_size);
  std::vector<float> out(layout.params.total());
  adapter_weights_from_peft(dir)(layout.params, Segment{0, layout.params.total()}, out.data());
  return out;
}

TEST(Peft, OneRankCheckpointIsAPeftAdapterDirectory) {
  TempDir tmp("peft_one");
  const LlamaConfig cfg = LlamaConfig::load(kBase2.string());
  LoraConfig lora;
  lora.rank = 4, lora.alpha = 8, lora.dropout = 0.05, lora.targets = parse_lora_targets("q_proj,v_proj,down_proj");
  const LoraLayout layout = lora_layout(cfg, lora);
  const std::vector<float> params = random_values(layout.params.total(), 1);
  const fs::path dir = write_lora_checkpoint(tmp.path, kBase2, lora, params);

  for (const char* name : {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "base_model.json",
                           "base_config.json", "state.json", "manifest.json"})
    EXPECT_TRUE(fs::exists(dir / name)) << name;
  // Not a model directory: transformers would take config.json for one and look for its weights.
  EXPECT_FALSE(fs::exists(dir / "config.json"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  EXPECT_EQ(verify_checkpoint(dir), "");
  EXPECT_EQ(read_config_json(kBase2), read_json_file(dir / "base_config.json", "test"));

  // PEFT's keys, global shapes, fp32, the values given.
  const SafetensorsFile f(dir / "adapter_model.safetensors");
  ASSERT_EQ(f.tensors().size(), layout.params.tensors().size());
  for (const ParamTensor& t : layout.params.tensors()) {
    const TensorInfo* info = f.find(t.name);
    ASSERT_TRUE(info) << t.name;
    EXPECT_EQ(info->dtype, DType::F32);
    EXPECT_EQ(info->shape, t.global_shape);
    std::vector<float> got(t.numel);
    f.read_f32(t.name, t.shape, got.data());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), params.begin() + t.offset)) << t.name;
  }
  EXPECT_TRUE(f.find("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"));
  EXPECT_EQ(f.find("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight")->shape,
            (std::vector<int64_t>{4, 160}));
  const LoraConfig back = read_peft_adapter_config(dir);
  EXPECT_EQ(back.rank, 4);
  EXPECT_EQ(back.alpha, 8);
  EXPECT_EQ(back.dropout, 0.05);
  EXPECT_EQ(back.targets, lora.targets);
  const json adapter_config = read_json_file(dir / "adapter_config.json", "test");
  EXPECT_EQ(adapter_config["base_model_name_or_path"], fs::absolute(kBase2).lexically_normal().string());
  const json base = read_json_file(dir / "base_model.json", "test");
  EXPECT_EQ(base["checksum"]["method"], "tensors");

  // Resume: weights and moments back exactly, through the reader every checkpoint goes through.
  std::vector<float> p, m, v;
  const int64_t steps = load_checkpoint_shard(dir, layout.params, {Segment{0, layout.params.total()}}, p, m, v);
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(p, params);
  EXPECT_EQ(m, random_values(layout.params.total(), 11));
}

TEST(Peft, RankFilesAreAssembledIntoTheAdapterFile) {
  TempDir tmp("peft_ranks");
  const LlamaConfig cfg = LlamaConfig::load(kBase2.string());
  LoraConfig lora;
  lora.rank = 4, lora.alpha = 16;  // every target: column- and row-parallel splits both
  const LoraLayout global = lora_layout(cfg, lora);
  const std::vector<float> params = random_values(global.params.total(), 2);
  const std::vector<float> moments = random_values(global.params.total(), 3);
  const json config_json = read_config_json(kBase2);
  const LoraFiles files = lora_files(lora, kBase2);

  // Two tp ranks, each writing its block of every adapter (B of q split by rows, A of o by columns, ...).
  prepare_sharded_checkpoint(tmp.path, 5);
  for (int rank = 0; rank < 2; rank++) {
    const LoraLayout local = lora_layout(cfg, lora, rank, 2);
    std::vector<float> p(local.params.total()), m(local.params.total());
    for (const ParamTensor& t : local.params.tensors()) {
      copy_block(t, *global.params.find(t.name), params.data(), p.data());
      copy_block(t, *global.params.find(t.name), moments.data(), m.data());
    }
    const std::vector<Segment> segments{Segment{0, local.params.total()}};
    write_checkpoint_shard(checkpoint_tmp_dir(tmp.path, 5), rank, local.params,
                           ShardState{&segments, shard_buffers_export(segments, p.data(), m.data(), m.data()), 5,
                                      /*write_replicated=*/rank == 0});
  }
  CheckpointContents c{&config_json, nullptr, {}, json{{"step", 5}}, {}};
  c.lora = &files;
  const fs::path dir = finish_sharded_checkpoint(tmp.path, 5, c, 0);
  ASSERT_TRUE(is_sharded_checkpoint(dir));
  EXPECT_EQ(verify_checkpoint(dir), "");  // the assembled file is in the manifest

  const SafetensorsFile f(dir / "adapter_model.safetensors");
  ASSERT_EQ(f.tensors().size(), global.params.tensors().size());
  for (const ParamTensor& t : global.params.tensors()) {
    std::vector<float> got(t.numel);
    f.read_f32(t.name, t.global_shape, got.data());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), params.begin() + t.offset)) << t.name;
  }
  // And a resume on one rank reads the rank files back into the whole adapters.
  std::vector<float> p, m, v;
  load_checkpoint_shard(dir, global.params, {Segment{0, global.params.total()}}, p, m, v);
  EXPECT_EQ(p, params);
  EXPECT_EQ(m, moments);
}

TEST(Peft, PeftAdapterRoundTripsThroughTheCheckpointExactly) {
  TempDir tmp("peft_round");
  const LlamaConfig cfg = LlamaConfig::load(kBase32.string());
  const LoraConfig lora = lora_init_config(kLora32, {});
  EXPECT_EQ(lora.rank, 2);
  EXPECT_EQ(lora.alpha, 6);
  EXPECT_EQ(lora_targets_string(lora.targets), "q_proj,v_proj,down_proj");
  // PEFT's file through --lora_init's reader: every value as PEFT saved it (no config.json in the directory).
  ASSERT_FALSE(fs::exists(kLora32 / "config.json"));
  const std::vector<float> adapter = read_adapter(kLora32, cfg, lora);
  const SafetensorsFile peft(kLora32 / "adapter_model.safetensors");
  const LoraLayout layout = lora_layout(cfg, lora);
  for (const ParamTensor& t : layout.params.tensors()) {
    std::vector<float> want(t.numel);
    peft.read_f32(t.name, t.shape, want.data());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), adapter.begin() + t.offset)) << t.name;
  }
  // Written as a tuna checkpoint and read back the same way: the same bits, and the same file as PEFT's tensors.
  const fs::path dir = write_lora_checkpoint(tmp.path, kBase32, lora, adapter);
  EXPECT_EQ(read_adapter(dir, cfg, lora), adapter);
  // A tp rank's share: the blocks of the same values.
  const LoraLayout half = lora_layout(cfg, lora, 1, 2);
  const std::vector<float> share = read_adapter(dir, cfg, lora, 1, 2);
  std::vector<float> want(half.params.total());
  for (const ParamTensor& t : half.params.tensors()) copy_block(t, *layout.params.find(t.name), adapter.data(), want.data());
  EXPECT_EQ(share, want);
}

TEST(Peft, ImportedPeftAdapterIsALoraCheckpoint) {
  TempDir tmp("peft_import");
  import_peft(kLora32, tmp / "imported", kBase32, {});
  EXPECT_EQ(verify_checkpoint(tmp / "imported"), "");
  EXPECT_EQ(lora_base(tmp / "imported"), fs::absolute(kBase32).lexically_normal());
  const LlamaConfig cfg = LlamaConfig::load(kBase32.string());
  const LoraConfig lora = lora_init_config(kLora32, {});
  EXPECT_EQ(read_adapter(tmp / "imported", cfg, lora), read_adapter(kLora32, cfg, lora));
  EXPECT_FALSE(fs::exists(tmp / "imported" / "optimizer.safetensors"));  // weights only: --lora_init continues it
  std::string e = error_of([&] { import_peft(kLora32, tmp / "imported", kBase32, {}); });
  EXPECT_NE(e.find("--overwrite"), std::string::npos) << e;
  import_peft(kLora32, tmp / "imported", kBase32, {}, /*overwrite=*/true);
  fs::create_directories(tmp / "other");
  std::ofstream(tmp / "other" / "notes.txt") << "mine";
  e = error_of([&] { import_peft(kLora32, tmp / "other", kBase32, {}, true); });
  EXPECT_NE(e.find("not a LoRA checkpoint"), std::string::npos) << e;
  EXPECT_TRUE(fs::exists(tmp / "other" / "notes.txt"));
}

TEST(Peft, LoraInitRefusesWhatDisagrees) {
  TempDir tmp("peft_bad");
  LoraOptionsGiven given;
  given.rank = 8;
  std::string e = error_of([&] { lora_init_config(kLora2, given); });
  EXPECT_NE(e.find("option 'lora_rank' is 8"), std::string::npos) << e;
  EXPECT_NE(e.find("r = 4"), std::string::npos) << e;
  given = {};
  given.targets = parse_lora_targets("q_proj,v_proj");
  e = error_of([&] { lora_init_config(kLora2, given); });
  EXPECT_NE(e.find("lora_targets"), std::string::npos) << e;
  given = {};
  given.rank = 4, given.alpha = 8.0, given.dropout = 0.0;  // agreeing options are fine
  EXPECT_EQ(lora_init_config(kLora2, given).rank, 4);

  // No adapter_config.json.
  fs::create_directories(tmp / "empty");
  e = error_of([&] { lora_init_config(tmp / "empty", {}); });
  EXPECT_NE(e.find("adapter_config.json"), std::string::npos) << e;
  EXPECT_NE(e.find("missing"), std::string::npos) << e;
  // A field PEFT would set that tuna does not train.
  fs::create_directories(tmp / "dora");
  json config = read_json_file(kLora2 / "adapter_config.json", "test");
  config["use_dora"] = true;
  std::ofstream(tmp / "dora" / "adapter_config.json") << config.dump();
  e = error_of([&] { lora_init_config(tmp / "dora", {}); });
  EXPECT_NE(e.find("'use_dora'"), std::string::npos) << e;

  // An adapter of another base's shapes: the llama32 adapter on the llama2 base (v_proj is 16 rows there, 64 here).
  const LlamaConfig cfg2 = LlamaConfig::load(kBase2.string());
  const LoraConfig lora32 = lora_init_config(kLora32, {});
  e = error_of([&] { read_adapter(kLora32, cfg2, lora32); });
  EXPECT_NE(e.find("v_proj.lora_B.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("expected shape [64, 2]"), std::string::npos) << e;
  EXPECT_NE(e.find("found [16, 2]"), std::string::npos) << e;
  // An adapter with tensors the configuration does not target.
  LoraConfig fewer = lora32;
  fewer.targets = parse_lora_targets("q_proj");
  e = error_of([&] { read_adapter(kLora32, LlamaConfig::load(kBase32.string()), fewer); });
  EXPECT_NE(e.find("is not one of the adapters expected"), std::string::npos) << e;
}

// W + (alpha / r) B A of every targeted projection, directly from the fixture files (double accumulation).
std::vector<float> merged_reference(const fs::path& base, const fs::path& adapter_dir) {
  const LlamaConfig cfg = LlamaConfig::load(base.string());
  const ParamLayout layout(cfg);
  std::vector<float> w(layout.total());
  load_weights(base, layout, w.data());
  const LoraConfig lora = read_peft_adapter_config(adapter_dir);
  const SafetensorsFile f(adapter_dir / "adapter_model.safetensors");
  for (int64_t l = 0; l < cfg.num_hidden_layers; l++)
    for (int i = 0; i < kLoraTargets; i++) {
      const LoraTarget t = static_cast<LoraTarget>(i);
      if (!lora.has(t)) continue;
      const auto [out, in] = lora_target_shape(cfg, t);
      std::vector<float> a(lora.rank * in), b(out * lora.rank);
      f.read_f32(lora_tensor_name(l, t, 'A'), {lora.rank, in}, a.data());
      f.read_f32(lora_tensor_name(l, t, 'B'), {out, lora.rank}, b.data());
      const ParamTensor* p = layout.find(str("model.layers.", l, ".", lora_target_module(t), ".", lora_target_name(t), ".weight"));
      for (int64_t row = 0; row < out; row++)
        for (int64_t col = 0; col < in; col++) {
          double d = 0;
          for (int64_t k = 0; k < lora.rank; k++) d += double(b[row * lora.rank + k]) * double(a[k * in + col]);
          float& x = w[p->offset + row * in + col];
          x = float(double(x) + lora.scale() * d);
        }
    }
  return w;
}

TEST(Peft, MergedWeightsAreBasePlusScaledBA) {
  for (const auto& [base, adapter] : {std::pair{kBase2, kLora2}, std::pair{kBase32, kLora32}}) {
    SCOPED_TRACE(adapter.string());
    const LlamaConfig cfg = LlamaConfig::load(base.string());
    const std::vector<float> want = merged_reference(base, adapter);
    const ParamLayout layout(cfg);
    std::vector<float> got(layout.total());
    const LayoutFill fill = merged_lora_weights(base, adapter);
    // In unit pieces, as engines ask.
    for (int u = 0; u < layout.num_units(); u++) {
      const auto [b, e] = layout.unit_range(u);
      fill(layout, Segment{b, e - b}, got.data() + b);
    }
    EXPECT_EQ(got, want);
    // A tp rank's blocks (rows of q/k/v/gate/up, columns of o/down), in odd-sized pieces.
    const ParamLayout half(cfg, 1, 2);
    std::vector<float> share(half.total()), expect(half.total());
    const LayoutFill fill_half = merged_lora_weights(base, adapter);
    for (int64_t at = 0; at < half.total(); at += 997)
      fill_half(half, Segment{at, std::min<int64_t>(997, half.total() - at)}, share.data() + at);
    for (const ParamTensor& t : half.tensors()) {
      if (t.shape.size() == 2) {
        copy_block(t, *layout.find(t.name), want.data(), expect.data());
      } else {
        std::copy_n(want.begin() + layout.find(t.name)->offset, t.numel, expect.begin() + t.offset);
      }
    }
    EXPECT_EQ(share, expect);
  }
}

// PEFT + transformers' logits (float64) of the fixture's batch.
std::vector<double> reference_logits(const fs::path& adapter, std::vector<int32_t>& inputs, int64_t& batch, int64_t& seq) {
  const json ref = read_json_file(adapter / "reference.json", "test");
  batch = ref["batch"].get<int64_t>(), seq = ref["seq_len"].get<int64_t>();
  const SafetensorsFile f(adapter / "reference.safetensors");
  inputs.resize(batch * seq);
  f.read_i32("input_ids", {batch, seq}, inputs.data());
  const int64_t vocab = f.find("logits")->shape[2];
  std::vector<double> logits(batch * seq * vocab);
  f.read_f64("logits", {batch, seq, vocab}, logits.data());
  return logits;
}

std::vector<float> cpu_logits(const LlamaConfig& cfg, const LayoutFill& fill, const std::vector<int32_t>& inputs,
                              int64_t batch, int64_t seq) {
  std::unique_ptr<ForwardModel> model = make_forward_model(cfg, Device::Cpu, batch, seq, fill);
  std::vector<float> logits(batch * seq * cfg.vocab_size);
  model->forward_logits(inputs.data(), batch, seq, logits.data());
  return logits;
}

TEST(Peft, MergedForwardAndMergeLoraEqualPeftLogits) {
  for (const auto& [base, adapter] : {std::pair{kBase2, kLora2}, std::pair{kBase32, kLora32}}) {
    SCOPED_TRACE(adapter.string());
    TempDir tmp("peft_logits");
    std::vector<int32_t> inputs;
    int64_t batch = 0, seq = 0;
    const std::vector<double> want = reference_logits(adapter, inputs, batch, seq);
    const LlamaConfig cfg = LlamaConfig::load(base.string());
    ASSERT_EQ(int64_t(want.size()), batch * seq * cfg.vocab_size);

    // Eval's path on a LoRA checkpoint written from the fixture's adapter: base + adapters merged on load.
    const LoraConfig lora = lora_init_config(adapter, {});
    const fs::path dir = write_lora_checkpoint(tmp / "ckpt", base, lora, read_adapter(adapter, cfg, lora));
    const ModelSource source = open_model(dir);
    EXPECT_EQ(source.config_dir, fs::absolute(base).lexically_normal());
    const std::vector<float> merged = cpu_logits(cfg, source.fill, inputs, batch, seq);
    const double err = rel_err_norm(merged.data(), want.data(), int64_t(want.size()));
    std::printf("  %s: merged forward vs PEFT logits, relative error %.2e\n", adapter.filename().c_str(), err);
    EXPECT_LT(err, 1e-5);
    // The adapters matter: the base alone is far from these logits.
    const std::vector<float> plain = cpu_logits(cfg, open_model(base).fill, inputs, batch, seq);
    EXPECT_GT(rel_err_norm(plain.data(), want.data(), int64_t(want.size())), 1e-2);

    // merge-lora's model directory, read as any Hugging Face model: the same logits.
    const ConvertReport r = merge_lora(dir, tmp / "merged", "float32", int64_t(1) << 30);
    EXPECT_EQ(r.dtype, "float32");
    const std::vector<float> exported = cpu_logits(cfg, open_model(tmp / "merged").fill, inputs, batch, seq);
    EXPECT_EQ(exported, merged);
    EXPECT_LT(rel_err_norm(exported.data(), want.data(), int64_t(want.size())), 1e-5);
  }
}

TEST(Peft, MergeLoraWritesShardedBf16AndRefusesAnExistingOutput) {
  TempDir tmp("peft_merge");
  const LlamaConfig cfg = LlamaConfig::load(kBase2.string());
  const std::vector<float> want = merged_reference(kBase2, kLora2);
  // A PEFT directory straight from PEFT: its base is adapter_config.json's (relative to here), or --base.
  const ConvertReport r = merge_lora(kLora2, tmp / "bf16", "bfloat16", 64 << 10, kBase2);
  EXPECT_EQ(r.dtype, "bfloat16");
  EXPECT_GT(r.shards, 1);
  EXPECT_TRUE(fs::exists(tmp / "bf16" / "model.safetensors.index.json"));
  EXPECT_EQ(read_config_json(tmp / "bf16")["torch_dtype"], "bfloat16");
  const ParamLayout layout(cfg);
  const HfCheckpointDir out(tmp / "bf16");
  for (const ParamTensor& t : layout.tensors()) {
    const HfCheckpointDir::Entry e = out.find(t.name);
    ASSERT_TRUE(e) << t.name;
    EXPECT_EQ(e.info->dtype, DType::BF16);
    std::vector<std::byte> expect(t.numel * 2);
    convert_from_f32(want.data() + t.offset, DType::BF16, expect.data(), t.numel);
    EXPECT_EQ(std::memcmp(e.file->data(*e.info), expect.data(), expect.size()), 0) << t.name;
  }
  std::string e = error_of([&] { merge_lora(kLora2, tmp / "bf16", "float32", int64_t(1) << 30, kBase2); });
  EXPECT_NE(e.find("--overwrite"), std::string::npos) << e;
  merge_lora(kLora2, tmp / "bf16", "float32", int64_t(1) << 30, kBase2, nullptr, /*overwrite=*/true);
  EXPECT_EQ(read_config_json(tmp / "bf16")["torch_dtype"], "float32");
  e = error_of([&] { merge_lora(kBase2, tmp / "x", "float32", int64_t(1) << 30); });
  EXPECT_NE(e.find("not a LoRA checkpoint"), std::string::npos) << e;
}

// A copy of a fixture base that the test may change.
fs::path copy_base(const fs::path& to) {
  fs::create_directories(to);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(kBase2 / f, to / f);
  return to;
}

TEST(Peft, ChangedBaseIsRefusedAndBaseOverrides) {
  TempDir tmp("peft_base");
  const fs::path base = copy_base(tmp / "base");
  const LlamaConfig cfg = LlamaConfig::load(base.string());
  const LoraConfig lora = lora_init_config(kLora2, {});
  const fs::path dir = write_lora_checkpoint(tmp / "ckpt", base, lora, read_adapter(kLora2, cfg, lora));
  EXPECT_EQ(lora_base(dir), fs::absolute(base).lexically_normal());

  // The same weights elsewhere: --base finds them (moved or copied bases keep their identity).
  const fs::path moved = copy_base(tmp / "moved");
  EXPECT_EQ(lora_base(dir, moved), moved);
  EXPECT_EQ(open_model(dir, moved).config_dir, moved);
  // The recorded base gone: --base is the way out.
  fs::rename(base, tmp / "gone");
  std::string e = error_of([&] { lora_base(dir); });
  EXPECT_NE(e.find("--base"), std::string::npos) << e;
  fs::rename(tmp / "gone", base);

  // One weight changed in place (the last element of the file, still finite): refused, naming both paths.
  {
    std::fstream f(moved / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-4, std::ios::end);
    float x;
    f.read(reinterpret_cast<char*>(&x), 4);
    x = std::nextafter(x, 1.0f);
    f.seekp(-4, std::ios::end);
    f.write(reinterpret_cast<const char*>(&x), 4);
  }
  e = error_of([&] { lora_base(dir, moved); });
  EXPECT_NE(e.find("has changed"), std::string::npos) << e;
  EXPECT_NE(e.find(fs::absolute(base).lexically_normal().string()), std::string::npos) << e;
  EXPECT_NE(e.find(fs::absolute(moved).lexically_normal().string()), std::string::npos) << e;
  // --base on a directory that is not a LoRA checkpoint.
  e = error_of([&] { open_model(base, moved); });
  EXPECT_NE(e.find("not a LoRA checkpoint"), std::string::npos) << e;

  // A tuna checkpoint as the base: its manifest is its identity, and its files are held to the manifest.
  const json config_json = read_config_json(kBase2);
  const ParamLayout layout(cfg);
  std::vector<float> w(layout.total());
  load_weights(kBase2, layout, w.data());
  const fs::path tuna_base =
      save_checkpoint(tmp / "tuna_base", 0, layout, CheckpointContents{&config_json, w.data(), {}, json{{"step", 0}}, {}}, 0);
  EXPECT_EQ(base_identity(tuna_base).method, "manifest");
  const fs::path dir2 = write_lora_checkpoint(tmp / "ckpt2", tuna_base, lora, read_adapter(kLora2, cfg, lora));
  EXPECT_EQ(lora_base(dir2), fs::absolute(tuna_base).lexically_normal());
  e = error_of([&] { lora_base(dir2, base); });  // the same weights, but not the recorded checkpoint
  EXPECT_NE(e.find("has changed"), std::string::npos) << e;
}

TEST(Peft, RanksShareOneBaseCheck) {
  TempDir tmp("peft_ranks_base");
  const fs::path base = copy_base(tmp / "base");
  const LlamaConfig cfg = LlamaConfig::load(base.string());
  const LoraConfig lora = lora_init_config(kLora2, {});
  const fs::path dir = write_lora_checkpoint(tmp / "ckpt", base, lora, read_adapter(kLora2, cfg, lora));
  for (const bool changed : {false, true}) {
    if (changed) {
      std::fstream f(base / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(-4, std::ios::end);
      const float x = 0.25f;
      f.write(reinterpret_cast<const char*>(&x), 4);
    }
    std::vector<std::unique_ptr<Comm>> comms = make_local_comms(2, 60);
    std::vector<std::string> found(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; r++)
      ranks.emplace_back([&, r] {
        try {
          found[r] = lora_base(dir, {}, *comms[r]).string();
        } catch (const Error& e) {
          found[r] = str("error: ", e.what());
        }
      });
    for (std::thread& t : ranks) t.join();
    for (int r = 0; r < 2; r++) {
      if (changed) {
        EXPECT_EQ(found[r].rfind("error: ", 0), 0u) << r << ": " << found[r];
      } else {
        EXPECT_EQ(fs::path(found[r]), fs::absolute(base).lexically_normal()) << r;
      }
    }
    if (changed) {
      EXPECT_NE(found[0].find("has changed"), std::string::npos) << found[0];
    }
  }
}

TEST(Peft, LoraStartFindsConfigurationBaseAndAdapters) {
  TempDir tmp("peft_start");
  std::unique_ptr<Comm> world = make_single_comm();
  LoraConfig options;
  options.rank = 8, options.alpha = 16;
  const LoraStart fresh = lora_start(options, {}, {}, kBase2, std::nullopt, {}, *world);
  EXPECT_EQ(fresh.lora.rank, 8);
  EXPECT_EQ(fresh.base, kBase2);
  EXPECT_FALSE(fresh.adapters);
  // --lora_init: the file's configuration and weights.
  const LoraStart init = lora_start(options, {}, kLora2, kBase2, std::nullopt, {}, *world);
  EXPECT_EQ(init.lora.rank, 4);
  ASSERT_TRUE(init.adapters);
  const LlamaConfig cfg = LlamaConfig::load(kBase2.string());
  const LoraLayout layout = lora_layout(cfg, init.lora);
  std::vector<float> got(layout.params.total());
  init.adapters(layout.params, Segment{0, layout.params.total()}, got.data());
  EXPECT_EQ(got, read_adapter(kLora2, cfg, init.lora));
  LoraOptionsGiven given;
  given.alpha = 16.0;
  std::string e = error_of([&] { lora_start(options, given, kLora2, kBase2, std::nullopt, {}, *world); });
  EXPECT_NE(e.find("option 'lora_alpha' is 16"), std::string::npos) << e;
  // A resume: the checkpoint's configuration and base; --base only there.
  const fs::path dir = write_lora_checkpoint(tmp / "ckpt", kBase2, init.lora, got);
  const LoraStart resumed = lora_start(options, {}, {}, kBase2, dir, {}, *world);
  EXPECT_EQ(resumed.lora.rank, 4);
  EXPECT_EQ(resumed.base, fs::absolute(kBase2).lexically_normal());
  EXPECT_FALSE(resumed.adapters);
  e = error_of([&] { lora_start(options, {}, {}, kBase2, std::nullopt, kBase32, *world); });
  EXPECT_NE(e.find("option 'base'"), std::string::npos) << e;
  // A tuna LoRA checkpoint as --lora_init on another base: refused by its recorded identity.
  e = error_of([&] { lora_start(options, {}, dir, kBase32, std::nullopt, {}, *world); });
  EXPECT_NE(e.find("has changed"), std::string::npos) << e;
}

TEST(Peft, GgufOfALoraCheckpointIsTheMergedModels) {
  TempDir tmp("peft_gguf");
  const LlamaConfig cfg = LlamaConfig::load(kBase2.string());
  const LoraConfig lora = lora_init_config(kLora2, {});
  const fs::path dir = write_lora_checkpoint(tmp / "a", kBase2, lora, read_adapter(kLora2, cfg, lora));
  fs::create_directories(tmp / "b");
  merge_lora(dir, tmp / "b" / dir.filename(), "float32", int64_t(1) << 30);  // the same name: general.name agrees
  GgufVocabulary vocab;
  vocab.model = "llama";
  for (int i = 0; i < cfg.vocab_size; i++) vocab.tokens.push_back(str("<t", i, ">"));
  vocab.scores.assign(cfg.vocab_size, 0.0f);
  vocab.types.assign(cfg.vocab_size, 1);
  export_gguf(dir, tmp / "lora.gguf", GgufWeights::f32, vocab);
  export_gguf(tmp / "b" / dir.filename(), tmp / "merged.gguf", GgufWeights::f32, vocab);
  EXPECT_TRUE(read_file(tmp / "lora.gguf") == read_file(tmp / "merged.gguf"));
}

// ---- One rule for every reader of a LoRA checkpoint (ckpt/peft.h open_lora_checkpoint) ----

// A file of a checkpoint replaced, and its manifest entry with it: a checkpoint that verifies but says something else.
void rewrite_listed(const fs::path& dir, const std::string& name, const std::string& content) {
  std::ofstream(dir / name, std::ios::binary | std::ios::trunc) << content;
  json manifest = read_json_file(dir / kManifestFile, "test");
  const FileDigest d = digest_file(dir / name);
  manifest["files"][name] = {{"bytes", d.bytes}, {"xxh3_64", hex64(d.xxh3)}};
  std::ofstream(dir / kManifestFile, std::ios::trunc) << manifest.dump(2);
}

// The last weight of a file nudged (still finite): the bytes differ from what the manifest recorded.
void flip_last_weight(const fs::path& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-4, std::ios::end);
  float x;
  f.read(reinterpret_cast<char*>(&x), 4);
  x = std::nextafter(x, 2.0f * x + 1.0f);
  f.seekp(-4, std::ios::end);
  f.write(reinterpret_cast<const char*>(&x), 4);
}

GgufVocabulary test_vocabulary(const LlamaConfig& cfg) {
  GgufVocabulary vocab;
  vocab.model = "llama";
  for (int i = 0; i < cfg.vocab_size; i++) vocab.tokens.push_back(str("<t", i, ">"));
  vocab.scores.assign(cfg.vocab_size, 0.0f);
  vocab.types.assign(cfg.vocab_size, 1);
  return vocab;
}

// Every reader of a LoRA checkpoint, as its tool calls the library: each returns its refusal (empty: accepted).
std::vector<std::pair<std::string, std::string>> every_reader(const fs::path& dir, const fs::path& base,
                                                              const fs::path& scratch) {
  std::unique_ptr<Comm> world = make_single_comm();
  LoraConfig options;
  options.rank = 4, options.alpha = 8;
  const LlamaConfig cfg = LlamaConfig::load(base.string());
  std::vector<std::pair<std::string, std::string>> out;
  const auto reader = [&](const std::string& name, const std::function<void()>& f) {
    fs::remove_all(scratch);
    fs::create_directories(scratch);
    out.emplace_back(name, error_of(f));
  };
  reader("--lora_init", [&] { lora_start(options, {}, dir, base, std::nullopt, {}, *world); });
  reader("--resume", [&] {  // a run directory whose newest checkpoint is dir
    fs::create_directories(scratch / "run" / "ckpt");
    fs::copy(dir, scratch / "run" / "ckpt" / "step_00000003");
    try {
      const auto from = resume_checkpoint(scratch / "run" / "ckpt", *world, [](const std::string& w) { throw Error(w); });
      lora_start(options, {}, {}, base, from, {}, *world);
    } catch (const Error& e) {  // named as the directory it was copied from
      std::string m = e.what();
      const std::string copy = (scratch / "run" / "ckpt" / "step_00000003").string();
      for (size_t at; (at = m.find(copy)) != std::string::npos;) m.replace(at, copy.size(), dir.string());
      throw Error(m);
    }
  });
  reader("peft-to-tuna", [&] { import_peft(dir, scratch / "imported", {}, {}); });
  reader("eval, sample", [&] {  // their order: the directory against its manifest, then the model
    verify_model_directory(dir, ModelFiles::Weights);
    const ModelSource source = open_model(dir);
    std::vector<float> w(ParamLayout(cfg).total());
    source.fill(ParamLayout(cfg), Segment{0, 1}, w.data());
  });
  reader("merge-lora", [&] { merge_lora(dir, scratch / "merged", "float32", int64_t(1) << 30); });
  reader("tuna-to-gguf", [&] { export_gguf(dir, scratch / "x.gguf", GgufWeights::f32, test_vocabulary(cfg)); });
  return out;
}

// A tuna LoRA checkpoint with bits flipped in adapter_model.safetensors: refused by every reader, naming the file
// (--lora_init and peft-to-tuna once used it, and peft-to-tuna wrote a fresh manifest over it).
TEST(Peft, EveryReaderRefusesABitFlippedCheckpoint) {
  TempDir tmp("peft_flipped");
  const LlamaConfig cfg = LlamaConfig::load(kBase2.string());
  const LoraConfig lora = lora_init_config(kLora2, {});
  const fs::path dir = write_lora_checkpoint(tmp / "ckpt", kBase2, lora, read_adapter(kLora2, cfg, lora));
  for (const auto& [reader, e] : every_reader(dir, kBase2, tmp / "scratch")) EXPECT_EQ(e, "(no error)") << reader;
  flip_last_weight(dir / kAdapterWeightsFile);
  for (const auto& [reader, e] : every_reader(dir, kBase2, tmp / "scratch")) {
    EXPECT_NE(e.find((dir / kAdapterWeightsFile).string() + ": checksum "), std::string::npos) << reader << ": " << e;
    EXPECT_NE(e.find("the file is damaged"), std::string::npos) << reader << ": " << e;
  }
  EXPECT_FALSE(fs::exists(tmp / "scratch" / "imported"));
}

// adapter_config.json and adapter_model.safetensors that disagree (fewer targets than tensors, or more), in a
// checkpoint whose manifest matches: refused by every reader alike; --resume once trained q_proj alone and saved 8 of
// the 56 adapter tensors.
TEST(Peft, EveryReaderRefusesAnAdapterFileThatDisagreesWithItsConfig) {
  TempDir tmp("peft_disagree");
  const LlamaConfig cfg = LlamaConfig::load(kBase2.string());
  const LoraConfig lora = lora_init_config(kLora2, {});
  const std::vector<float> adapters = read_adapter(kLora2, cfg, lora);
  const fs::path all = write_lora_checkpoint(tmp / "all", kBase2, lora, adapters);
  LoraConfig q = lora;
  q.targets = parse_lora_targets("q_proj");
  const LoraLayout whole = lora_layout(cfg, lora), q_layout = lora_layout(cfg, q);
  std::vector<float> q_adapters(q_layout.params.total());
  for (const ParamTensor& t : q_layout.params.tensors())
    copy_block(t, *whole.params.find(t.name), adapters.data(), q_adapters.data());
  const fs::path only_q = write_lora_checkpoint(tmp / "q", kBase2, q, q_adapters);
  // Fewer targets in the config than the file holds: an extra tensor.
  rewrite_listed(all, kAdapterConfigFile, read_file(only_q / kAdapterConfigFile));
  for (const auto& [reader, e] : every_reader(all, kBase2, tmp / "scratch")) {
    EXPECT_NE(e.find((all / kAdapterWeightsFile).string() + ": tensor 'base_model.model.model.layers.0.self_attn.k_proj"),
              std::string::npos) << reader << ": " << e;
    EXPECT_NE(e.find("is not an adapter of " + (all / kAdapterConfigFile).string() + " (target_modules q_proj, r = 4)"),
              std::string::npos) << reader << ": " << e;
    EXPECT_NE(e.find("the adapter file and its configuration disagree"), std::string::npos) << reader << ": " << e;
  }
  // More targets in the config than the file holds: a missing tensor.
  rewrite_listed(only_q, kAdapterConfigFile, read_file(kLora2 / kAdapterConfigFile));
  for (const auto& [reader, e] : every_reader(only_q, kBase2, tmp / "scratch"))
    EXPECT_NE(e.find((only_q / kAdapterWeightsFile).string() + ": has no tensor 'base_model.model.model.layers.0."),
              std::string::npos) << reader << ": " << e;
}

// A tuna LoRA checkpoint without base_model.json (its manifest agreeing): nothing would hold the adapters to their
// base, so every reader refuses, saying how to go on. A PEFT directory from elsewhere has none and is read as before.
TEST(Peft, ATunaCheckpointWithoutItsBaseRecordIsRefusedSayingHowToGoOn) {
  TempDir tmp("peft_no_base_record");
  const LlamaConfig cfg = LlamaConfig::load(kBase2.string());
  const LoraConfig lora = lora_init_config(kLora2, {});
  const fs::path dir = write_lora_checkpoint(tmp / "ckpt", kBase2, lora, read_adapter(kLora2, cfg, lora));
  fs::remove(dir / kBaseModelFile);
  json manifest = read_json_file(dir / kManifestFile, "test");
  manifest["files"].erase(kBaseModelFile);
  std::ofstream(dir / kManifestFile, std::ios::trunc) << manifest.dump(2);
  for (const auto& [reader, e] : every_reader(dir, kBase2, tmp / "scratch")) {
    EXPECT_NE(e.find(dir.string() + ": a tuna LoRA checkpoint (it has manifest.json) without base_model.json"),
              std::string::npos) << reader << ": " << e;
    EXPECT_NE(e.find("build/convert peft-to-tuna NEW_DIR OUT_DIR --base BASE_DIR"), std::string::npos) << reader << ": " << e;
  }
  // The way out the message gives: the two PEFT files alone, imported on a named base.
  fs::create_directories(tmp / "peft");
  for (const char* f : {kAdapterConfigFile, kAdapterWeightsFile}) fs::copy_file(dir / f, tmp / "peft" / f);
  import_peft(tmp / "peft", tmp / "imported", kBase2, {});
  EXPECT_EQ(verify_checkpoint(tmp / "imported"), "");
}

// A QLoRA checkpoint imported keeps its quantization (its adapters were trained on the dequantized base: without it
// eval scored them on the unquantized one), and a value the other readers refuse is refused by the import too.
TEST(Peft, ImportKeepsTheQuantizationAndRefusesWhatTheOthersRefuse) {
  TempDir tmp("peft_import_quant");
  const LlamaConfig cfg = LlamaConfig::load(kBase32.string());
  const LoraConfig lora = lora_init_config(kLora32, {});
  const LoraLayout layout = lora_layout(cfg, lora);
  const std::vector<float> params = read_adapter(kLora32, cfg, lora);
  const json config_json = read_config_json(kBase32);
  const LoraFiles files = lora_files(lora, kBase32, BaseQuant::Nf4);
  CheckpointContents c{&config_json, params.data(), {}, json{{"step", 0}}, {}};
  c.lora = &files;
  const fs::path dir = save_checkpoint(tmp / "qlora", 0, layout.params, c, 0);
  import_peft(dir, tmp / "imported", {}, {});
  EXPECT_EQ(read_json_file(tmp / "imported" / kBaseModelFile, "test").value("quantization", ""), "nf4");
  EXPECT_EQ(lora_base_quant(tmp / "imported"), BaseQuant::Nf4);
  // The merged weights (what eval and sample compute with) are the original's.
  const ParamLayout model(cfg);
  std::vector<float> a(model.total()), b(model.total());
  merged_lora_weights(kBase32, dir)(model, Segment{0, model.total()}, a.data());
  merged_lora_weights(kBase32, tmp / "imported")(model, Segment{0, model.total()}, b.data());
  EXPECT_EQ(a, b);
  merged_lora_weights(kBase32, kLora32)(model, Segment{0, model.total()}, b.data());
  EXPECT_NE(a, b);  // the quantization changes them: it is what the import would have lost
  json record = read_json_file(dir / kBaseModelFile, "test");
  for (const json& bad : {json("fp8"), json(""), json(nullptr), json(4)}) {
    record["quantization"] = bad;
    rewrite_listed(dir, kBaseModelFile, record.dump(2));
    for (const auto& [reader, e] : every_reader(dir, kBase32, tmp / "scratch"))
      EXPECT_NE(e.find((dir / kBaseModelFile).string() + ": field 'quantization': expected none, nf4 or int8, found "),
                std::string::npos) << reader << " " << bad.dump() << ": " << e;
  }
}

// Values of adapter_config.json are refused naming the file and its key, never an option the user did not give.
TEST(Peft, AdapterConfigValuesAreRefusedNamingTheFileAndKey) {
  TempDir tmp("peft_config_values");
  const json good = read_json_file(kLora2 / kAdapterConfigFile, "test");
  const fs::path file = tmp / kAdapterConfigFile;
  const auto refusal = [&](const char* key, const json& value) {
    json j = good;
    j[key] = value;
    std::ofstream(file, std::ios::trunc) << j.dump(2);
    return error_of([&] { read_peft_adapter_config(file); });
  };
  const std::vector<std::tuple<const char*, json, std::string>> bad = {
      {"lora_alpha", 0, "field 'lora_alpha': expected a number above 0"},
      {"lora_alpha", -2, "field 'lora_alpha'"},
      {"lora_dropout", 1, "field 'lora_dropout': expected a probability in [0, 1), found 1"},
      {"target_modules", json::array({"q_proj "}), "field 'target_modules': \"q_proj \" is not the name of a projection"},
      {"target_modules", json::array({"q_proj", ""}), "field 'target_modules': \"\" is not the name of a projection"},
      {"target_modules", json::array({" v_proj"}), "field 'target_modules': \" v_proj\" is not the name"},
      {"target_modules", json::array({"q_proj,v_proj"}), "field 'target_modules': \"q_proj,v_proj\" is not the name"},
      {"target_modules", json::array(), "field 'target_modules': expected a non-empty list of names, found []"},
      {"target_modules", json::array({"q_proj", "q_proj"}), "\"q_proj\" is given twice"},
  };
  for (const auto& [key, value, message] : bad) {
    const std::string e = refusal(key, value);
    EXPECT_EQ(e.rfind(file.string() + ": ", 0), 0u) << key << " " << value.dump() << ": " << e;
    EXPECT_NE(e.find(message), std::string::npos) << key << " " << value.dump() << ": " << e;
    EXPECT_EQ(e.find("option '"), std::string::npos) << e;
  }
  // A rank the base cannot hold: the file's key, in every reader (here --lora_init on the llama2 base).
  fs::create_directories(tmp / "peft");
  json j = good;
  j["r"] = 65;
  std::ofstream(tmp / "peft" / kAdapterConfigFile) << j.dump(2);
  fs::copy_file(kLora2 / kAdapterWeightsFile, tmp / "peft" / kAdapterWeightsFile);
  const std::string e = error_of([&] { open_lora_checkpoint(tmp / "peft", kBase2); });
  EXPECT_NE(e.find((tmp / "peft" / kAdapterConfigFile).string() + ": field 'r': 65 exceeds the smaller dimension of "),
            std::string::npos) << e;
}

}  // namespace
}  // namespace tuna
