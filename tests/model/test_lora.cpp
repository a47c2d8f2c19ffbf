// model/lora.h and the CPU model with adapters (model/llama.h): option parsing and every refusal, the adapter
// layout's shapes and tensor-parallel splits, PEFT's adapter_config.json both ways, PEFT's initialisation under every
// split, the dropout stream's statistics, and the model's adapter gradients against finite differences (with and
// without dropout: a backward that drew another mask than its forward fails the second), with the base frozen, and
// the GEMMs a step runs (none for a frozen weight's gradient; one per input for the adapters sharing it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "core/error.h"
#include "kernels/cpu/matmul.h"  // gemm_count
#include "model/config.h"
#include "model/layout.h"
#include "model/llama.h"
#include "model/lora.h"
#include "tests/model/fixture.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::Fixture;

// fn fails with a tuna::Error whose message holds every one of `parts`.
void expect_fails(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << parts.front() << "'";
  } catch (const Error& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

LlamaConfig tiny() { return LlamaConfig::load("tests/fixtures/llama2_tiny/config.json"); }

LoraConfig lora_of(int64_t rank, double alpha, uint32_t targets = kAllLoraTargets, double dropout = 0) {
  LoraConfig l;
  l.rank = rank, l.alpha = alpha, l.targets = targets, l.dropout = dropout;
  return l;
}

TEST(LoraTargets, ParseAndPrint) {
  EXPECT_EQ(parse_lora_targets("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"), kAllLoraTargets);
  const uint32_t qv = parse_lora_targets(" v_proj , q_proj");
  EXPECT_EQ(qv, (1u << int(LoraTarget::Q)) | (1u << int(LoraTarget::V)));
  EXPECT_EQ(lora_targets_string(qv), "q_proj,v_proj");  // forward order, whatever the given one
  EXPECT_EQ(lora_targets_string(kAllLoraTargets), "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
  expect_fails([] { parse_lora_targets("q_proj,lm_head"); }, {"lora_targets", "'lm_head'", "q_proj,k_proj"});
  expect_fails([] { parse_lora_targets("q_proj,,v_proj"); }, {"lora_targets", "empty name"});
  expect_fails([] { parse_lora_targets(""); }, {"lora_targets", "empty name"});
  expect_fails([] { parse_lora_targets("q_proj,q_proj"); }, {"lora_targets", "'q_proj' given twice"});
  EXPECT_TRUE(lora_target_row_parallel(LoraTarget::O));
  EXPECT_TRUE(lora_target_row_parallel(LoraTarget::Down));
  EXPECT_FALSE(lora_target_row_parallel(LoraTarget::Gate));
}

TEST(LoraConfigCheck, EveryBadInputNamesItsOption) {
  const LlamaConfig c = tiny();  // hidden 64, q/kv 64, ffn 160
  EXPECT_NO_THROW(validate_lora(lora_of(4, 8), c));
  EXPECT_NO_THROW(validate_lora(lora_of(64, 1), c));  // the smaller dimension of every projection
  expect_fails([&] { validate_lora(lora_of(0, 8), c); }, {"lora_rank", "at least 1", "0"});
  expect_fails([&] { validate_lora(lora_of(-3, 8), c); }, {"lora_rank", "-3"});
  expect_fails([&] { validate_lora(lora_of(65, 8), c); }, {"lora_rank", "65", "q_proj", "64 x 64"});
  // Only the targeted projections bound the rank: gate/up/down alone are 160 x 64, still 64.
  expect_fails([&] { validate_lora(lora_of(65, 8, parse_lora_targets("down_proj")), c); }, {"down_proj", "64 x 160"});
  expect_fails([&] { validate_lora(lora_of(4, 0), c); }, {"lora_alpha", "above 0", "0"});
  expect_fails([&] { validate_lora(lora_of(4, -1), c); }, {"lora_alpha", "-1"});
  expect_fails([&] { validate_lora(lora_of(4, NAN), c); }, {"lora_alpha", "nan"});
  expect_fails([&] { validate_lora(lora_of(4, INFINITY), c); }, {"lora_alpha", "inf"});
  expect_fails([&] { validate_lora(lora_of(4, 8, kAllLoraTargets, NAN), c); }, {"lora_dropout", "[0, 1)", "nan"});
  expect_fails([&] { validate_lora(lora_of(4, 8, kAllLoraTargets, 1.0), c); }, {"lora_dropout", "1"});
  expect_fails([&] { validate_lora(lora_of(4, 8, kAllLoraTargets, -0.1), c); }, {"lora_dropout", "-0.1"});
  expect_fails([&] { validate_lora(lora_of(4, 8, 0), c); }, {"lora_targets"});
  expect_fails([&] { validate_lora(lora_of(4, 8, 1u << 7), c); }, {"lora_targets"});
  expect_fails([&] { lora_layout(c, lora_of(0, 8)); }, {"lora_rank"});  // the layout validates too
}

TEST(LoraLayout, ShapesNamesAndOneUnitPerLayer) {
  const LlamaConfig c = tiny();
  const LoraLayout l = lora_layout(c, lora_of(4, 8));
  EXPECT_FALSE(l.params.is_model());
  ASSERT_EQ(l.params.num_units(), c.num_hidden_layers);
  ASSERT_EQ(static_cast<int64_t>(l.layers.size()), c.num_hidden_layers);
  EXPECT_EQ(l.params.total(), lora_parameter_count(c, lora_of(4, 8)));
  EXPECT_EQ(l.params.total(), 2 * 4 * (4 * (64 + 64) + 2 * (64 + 160) + (160 + 64)));
  const ParamTensor* a = l.params.find("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight");
  const ParamTensor* b = l.params.find("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight");
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(b->shape, (std::vector<int64_t>{64, 4}));
  EXPECT_EQ(a->offset, l.layers[1].a[int(LoraTarget::Q)]);
  EXPECT_EQ(b->offset, l.layers[1].b[int(LoraTarget::Down)]);
  EXPECT_TRUE(a->decays && b->decays);
  for (int u = 0; u < l.params.num_units(); u++) {
    const auto [begin, end] = l.params.unit_range(u);
    for (const ParamTensor& t : l.params.tensors())
      if (t.layer == u) {
        EXPECT_TRUE(t.offset >= begin && t.offset + t.numel <= end) << t.name;
      }
  }
  // A subset: q and v only, the others absent (-1).
  const LoraLayout qv = lora_layout(c, lora_of(2, 4, parse_lora_targets("q_proj,v_proj")));
  EXPECT_EQ(qv.params.tensors().size(), 2u * 2 * 2);
  EXPECT_EQ(qv.layers[0].a[int(LoraTarget::K)], -1);
  EXPECT_EQ(qv.layers[0].b[int(LoraTarget::O)], -1);
  EXPECT_EQ(lora_tensor_name(3, LoraTarget::Gate, 'B'), "base_model.model.model.layers.3.mlp.gate_proj.lora_B.weight");
}

// A pipeline stage's adapters (--pp): its layers' tensors only, under the whole layout's names, shapes and random
// streams (so a stage draws the adapters one rank draws), one unit per layer of the model with the other stages'
// empty and their offsets -1; the stages together hold every tensor once, and each stage's start equals the whole's.
TEST(LoraLayout, AStageHoldsItsLayersAdaptersWithTheWholeModelsStreams) {
  LlamaConfig c = tiny();
  c.num_hidden_layers = 5;
  const LoraConfig lora = lora_of(4, 8, parse_lora_targets("q_proj,v_proj,down_proj"));
  const LoraLayout whole = lora_layout(c, lora);
  std::vector<float> all(whole.params.total());
  init_lora_weights_piece(whole.params, 9, Segment{0, whole.params.total()}, all.data());
  size_t held = 0;
  for (int64_t pp : {2, 3})
    for (const PipelineStage& stage : pipeline_stages(c, pp, 16)) {
      const LoraLayout part = lora_layout(c, lora, 0, 1, &stage);
      ASSERT_EQ(part.params.num_units(), 5);
      ASSERT_EQ(part.layers.size(), 5u);
      std::vector<float> mine(part.params.total());
      init_lora_weights_piece(part.params, 9, Segment{0, part.params.total()}, mine.data());
      for (const ParamTensor& t : part.params.tensors()) {
        const ParamTensor* g = whole.params.find(t.name);
        ASSERT_TRUE(g) << t.name;
        EXPECT_TRUE(t.layer >= stage.layer_begin && t.layer < stage.layer_end) << t.name;
        EXPECT_EQ(t.stream, g->stream) << t.name;
        EXPECT_EQ(t.shape, g->shape) << t.name;
        EXPECT_TRUE(std::equal(mine.begin() + t.offset, mine.begin() + t.offset + t.numel, all.begin() + g->offset))
            << t.name;
        held += pp == 3;
      }
      for (int64_t l = 0; l < 5; l++) {
        const auto [begin, end] = part.params.unit_range(static_cast<int>(l));
        const bool mine_layer = l >= stage.layer_begin && l < stage.layer_end;
        EXPECT_EQ(end > begin, mine_layer) << "layer " << l;
        EXPECT_EQ(part.layers[l].a[int(LoraTarget::Q)] >= 0, mine_layer) << "layer " << l;
        EXPECT_EQ(part.layers[l].a[int(LoraTarget::K)], -1);
      }
    }
  EXPECT_EQ(held, whole.params.tensors().size());  // pp 3: every tensor on exactly one stage
}

// Under tp 2: column-parallel A whole and B split by rows like W; row-parallel A split by columns like W and B
// whole; the two ranks' blocks of every tensor tile the whole one, and each rank holds its share.
TEST(LoraLayout, TensorParallelSplitsFollowTheBaseWeights) {
  const LlamaConfig c = tiny();
  const LoraConfig lora = lora_of(4, 8);
  const LoraLayout whole = lora_layout(c, lora);
  for (int rank = 0; rank < 2; rank++) {
    const LoraLayout part = lora_layout(c, lora, rank, 2);
    const ParamLayout base(c, rank, 2);
    ASSERT_EQ(part.params.tensors().size(), whole.params.tensors().size());
    for (const ParamTensor& t : part.params.tensors()) {
      const ParamTensor* g = whole.params.find(t.name);
      ASSERT_TRUE(g);
      EXPECT_EQ(t.global_shape, g->shape) << t.name;
      const bool is_a = t.name.find("lora_A") != std::string::npos;
      const bool row = t.name.find("o_proj") != std::string::npos || t.name.find("down_proj") != std::string::npos;
      // The base weight this adapter sits on.
      std::string w = t.name.substr(std::string("base_model.model.").size());
      w = w.substr(0, w.find(".lora_")) + ".weight";
      const ParamTensor* bw = base.find(w);
      ASSERT_TRUE(bw) << w;
      if (is_a == row) {  // A of o/down, B of the others: split like W
        const int dim = is_a ? 1 : 0;
        EXPECT_EQ(t.split_dim, dim) << t.name;
        EXPECT_EQ(t.split_begin, bw->split_begin) << t.name;
        EXPECT_EQ(t.shape[dim], bw->shape[dim]) << t.name;
        EXPECT_EQ(t.shape[dim] * 2, g->shape[dim]) << t.name;  // even split of this model
      } else {
        EXPECT_EQ(t.split_dim, -1) << t.name;
        EXPECT_EQ(t.shape, g->shape) << t.name;
      }
    }
  }
}

TEST(LoraPeftConfig, WrittenAndReadBack) {
  testing_util::TempDir dir("lora_config");
  const LoraConfig lora = lora_of(8, 16, parse_lora_targets("q_proj,v_proj,down_proj"), 0.05);
  {
    std::ofstream out(dir / "adapter_config.json");
    out << peft_adapter_config(lora, "/models/base").dump(2);
  }
  const LoraConfig back = read_peft_adapter_config(dir.path);  // a directory finds its adapter_config.json
  EXPECT_EQ(back.rank, 8);
  EXPECT_EQ(back.alpha, 16);
  EXPECT_EQ(back.dropout, 0.05);
  EXPECT_EQ(back.targets, lora.targets);
  const nlohmann::json j = peft_adapter_config(lora, "/models/base");
  EXPECT_EQ(j["base_model_name_or_path"], "/models/base");
  EXPECT_EQ(j["target_modules"], nlohmann::json({"q_proj", "v_proj", "down_proj"}));
}

TEST(LoraPeftConfig, RefusesWhatTunaDoesNotTrain) {
  testing_util::TempDir dir("lora_config_bad");
  const nlohmann::json good = peft_adapter_config(lora_of(4, 8), "base");
  auto expect_refused = [&](const std::function<void(nlohmann::json&)>& edit, const std::vector<std::string>& parts) {
    nlohmann::json j = good;
    edit(j);
    const auto file = dir / "adapter_config.json";
    std::ofstream(file) << j.dump();
    std::vector<std::string> all = parts;
    all.push_back(file.string());
    expect_fails([&] { read_peft_adapter_config(file); }, all);
  };
  expect_refused([](nlohmann::json& j) { j["peft_type"] = "IA3"; }, {"peft_type", "LORA"});
  expect_refused([](nlohmann::json& j) { j.erase("peft_type"); }, {"missing field 'peft_type'"});
  expect_refused([](nlohmann::json& j) { j["bias"] = "all"; }, {"bias"});
  expect_refused([](nlohmann::json& j) { j["use_dora"] = true; }, {"use_dora"});
  expect_refused([](nlohmann::json& j) { j["use_rslora"] = true; }, {"use_rslora"});
  expect_refused([](nlohmann::json& j) { j["rank_pattern"] = {{"q_proj", 8}}; }, {"rank_pattern"});
  expect_refused([](nlohmann::json& j) { j["modules_to_save"] = {"lm_head"}; }, {"modules_to_save"});
  expect_refused([](nlohmann::json& j) { j["target_modules"] = ".*proj"; }, {"target_modules", "regular expression"});
  expect_refused([](nlohmann::json& j) { j["target_modules"] = {"q_proj", "lm_head"}; }, {"target_modules", "lm_head"});
  expect_refused([](nlohmann::json& j) { j["target_modules"] = 3; }, {"target_modules"});
  expect_refused([](nlohmann::json& j) { j.erase("target_modules"); }, {"target_modules"});
  expect_refused([](nlohmann::json& j) { j["r"] = 0; }, {"'r'"});
  expect_refused([](nlohmann::json& j) { j["lora_alpha"] = "eight"; }, {"lora_alpha"});
  // "all-linear" is the seven projections.
  nlohmann::json j = good;
  j["target_modules"] = "all-linear";
  std::ofstream(dir / "all.json") << j.dump();
  EXPECT_EQ(read_peft_adapter_config(dir / "all.json").targets, kAllLoraTargets);
}

// PEFT's start: A ~ U(-1/sqrt(in), 1/sqrt(in)) with in the whole layer's in_features, B = 0; every tp rank's blocks
// are cut from the same global draw, and a piece gives the values the whole buffer has there.
TEST(LoraInit, PeftInitialisationIsTheSameUnderEverySplit) {
  const LlamaConfig c = tiny();
  const LoraConfig lora = lora_of(4, 8);
  const LoraLayout whole = lora_layout(c, lora);
  std::vector<float> w(whole.params.total());
  init_lora_weights_piece(whole.params, 7, Segment{0, whole.params.total()}, w.data());
  for (const ParamTensor& t : whole.params.tensors()) {
    const bool is_b = t.name.find("lora_B") != std::string::npos;
    const double bound = 1.0 / std::sqrt(double(t.global_shape[1]));
    double lo = 0, hi = 0, sum = 0;
    for (int64_t i = 0; i < t.numel; i++) {
      const float x = w[t.offset + i];
      if (is_b) {
        ASSERT_EQ(x, 0.0f) << t.name;
      }
      lo = std::min<double>(lo, x), hi = std::max<double>(hi, x), sum += x;
    }
    if (is_b) continue;
    EXPECT_LE(hi, bound) << t.name;
    EXPECT_GE(lo, -bound) << t.name;
    EXPECT_GT(hi, 0.9 * bound) << t.name;  // 256+ draws of a uniform reach near its ends
    EXPECT_LT(lo, -0.9 * bound) << t.name;
    EXPECT_LT(std::abs(sum / t.numel), 0.2 * bound) << t.name;
  }
  for (int rank = 0; rank < 2; rank++) {
    const LoraLayout part = lora_layout(c, lora, rank, 2);
    std::vector<float> p(part.params.total()), expected(part.params.total());
    // In two uneven pieces, as ZeRO would ask.
    const int64_t half = part.params.total() / 3;
    init_lora_weights_piece(part.params, 7, Segment{0, half}, p.data());
    init_lora_weights_piece(part.params, 7, Segment{half, part.params.total() - half}, p.data() + half);
    for (const ParamTensor& t : part.params.tensors())
      copy_block(t, w.data() + whole.params.find(t.name)->offset, expected.data() + t.offset);
    EXPECT_EQ(p, expected) << "tp rank " << rank;
  }
  std::vector<float> other(whole.params.total());
  init_lora_weights_piece(whole.params, 8, Segment{0, whole.params.total()}, other.data());
  EXPECT_NE(other, w);  // the seed matters
}

// The dropout stream: the kept fraction is 1 - p within its binomial spread, masks of different layers, targets,
// steps or micro-batches are unrelated, and the same counter always gives the same answer.
TEST(LoraDropout, MaskStatistics) {
  const int64_t n = 1 << 20;
  for (double p : {0.05, 0.1, 0.5}) {
    const uint64_t s = lora_dropout_stream(lora_dropout_key(11, 3, 1, 0), 1, LoraTarget::V);
    int64_t kept = 0, both = 0, runs = 0;
    const uint64_t other = lora_dropout_stream(lora_dropout_key(11, 3, 2, 0), 1, LoraTarget::V);
    bool prev = false;
    for (int64_t i = 0; i < n; i++) {
      const bool k = lora_dropout_keeps(s, i, p);
      kept += k;
      both += k && lora_dropout_keeps(other, i, p);
      runs += i > 0 && k != prev;
      prev = k;
      if (i < 1000) {
        ASSERT_EQ(k, lora_dropout_keeps(s, i, p));
      }
    }
    const double q = 1 - p, sd = std::sqrt(n * p * q);
    EXPECT_NEAR(double(kept), n * q, 5 * sd) << "p " << p;
    EXPECT_NEAR(double(both), n * q * q, 5 * std::sqrt(n * q * q * (1 - q * q))) << "p " << p;  // independent
    EXPECT_NEAR(double(runs), 2 * n * p * q, 5 * std::sqrt(2 * n * p * q)) << "p " << p;  // no serial correlation
  }
  const uint64_t key = lora_dropout_key(1, 0, 0, 0);
  EXPECT_NE(lora_dropout_stream(key, 0, LoraTarget::Q), lora_dropout_stream(key, 0, LoraTarget::K));
  EXPECT_NE(lora_dropout_stream(key, 0, LoraTarget::Q), lora_dropout_stream(key, 1, LoraTarget::Q));
  EXPECT_NE(key, lora_dropout_key(1, 1, 0, 0));
  EXPECT_NE(key, lora_dropout_key(1, 0, 0, 1));
  EXPECT_NE(key, lora_dropout_key(2, 0, 0, 0));
}

TEST(LoraFlops, FrozenBaseCostsFourPerWeight) {
  const LlamaConfig c = tiny();
  const LoraConfig lora = lora_of(4, 8);
  const double full = model_flops_per_token(c, 16), with = lora_flops_per_token(c, lora, 16);
  const double matmul = double(c.n_params() - c.vocab_size * c.hidden_size);  // untied: the embedding is no matmul
  EXPECT_NEAR(full - with, 2 * matmul - 6.0 * lora_parameter_count(c, lora), 1e-6 * full);
}

// ---- the model with adapters ----

// The fixture's base with adapters on `lora`: A from PEFT's start, B non-zero (so every path carries gradient).
struct AdaptedModel {
  Fixture f;
  Llama model;
  AdaptedModel(const std::string& fixture, const LoraConfig& lora)
      : f(fixture), model(f.config, f.batch, f.seq, LlamaParallel{}, lora) {
    load_weights(f.dir, model.layout(), model.params.data());
    const ParamLayout& l = model.lora_layout().params;
    init_lora_weights_piece(l, 5, Segment{0, l.total()}, model.lora_params.data());
    std::mt19937_64 rng(9);
    std::normal_distribution<double> normal(0, 0.3);
    for (const ParamTensor& t : l.tensors())
      if (t.name.find("lora_B") != std::string::npos)
        for (int64_t i = 0; i < t.numel; i++) model.lora_params[t.offset + i] = float(normal(rng));
  }
  double loss() {  // the summed loss of a training pass (dropout on), gradients discarded
    model.zero_grads();
    return model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq).sum;
  }
};

// Each adapter tensor's gradient g against the central difference of the loss along g / |g| (which is |g| when g
// is right; a wrong g' gives g . g' / |g'| instead): one evaluation pair per tensor.
void expect_gradients_match_differences(AdaptedModel& m, double tol) {
  m.model.zero_grads();
  m.model.forward_backward(m.f.inputs.data(), m.f.targets.data(), m.f.batch, m.f.seq);
  const std::vector<float> g = m.model.lora_grads;
  const std::vector<float> w0 = m.model.lora_params;
  ASSERT_TRUE(m.model.grads.empty());  // the frozen base has no gradient buffer
  for (const ParamTensor& t : m.model.lora_layout().params.tensors()) {
    double norm = 0, wnorm = 0;
    for (int64_t i = 0; i < t.numel; i++) norm += double(g[t.offset + i]) * g[t.offset + i];
    for (int64_t i = 0; i < t.numel; i++) wnorm += double(w0[t.offset + i]) * w0[t.offset + i];
    norm = std::sqrt(norm);
    ASSERT_GT(norm, 0) << t.name;
    const double eps = 2e-3 * std::max(1.0, std::sqrt(wnorm));
    double at[2];
    for (int side = 0; side < 2; side++) {
      const double e = side ? -eps : eps;
      for (int64_t i = 0; i < t.numel; i++) m.model.lora_params[t.offset + i] = float(w0[t.offset + i] + e * g[t.offset + i] / norm);
      at[side] = m.loss();
    }
    m.model.lora_params = w0;
    const double fd = (at[0] - at[1]) / (2 * eps);
    EXPECT_NEAR(fd, norm, tol * norm) << t.name;
  }
}

TEST(LlamaLora, AdapterGradientsMatchFiniteDifferences) {
  AdaptedModel m("llama2_tiny", lora_of(4, 8));
  expect_gradients_match_differences(m, 2e-3);
}

TEST(LlamaLora, AdapterGradientsMatchFiniteDifferencesOnATiedSubset) {
  AdaptedModel m("llama32_tiny", lora_of(2, 6, parse_lora_targets("q_proj,v_proj,down_proj")));
  expect_gradients_match_differences(m, 2e-3);
}

// With dropout the loss depends on the mask; the difference quotient is taken under the forward's mask (the key stays
// the same), so the backward's gradient matches it only if it regenerated that mask.
TEST(LlamaLora, DropoutBackwardUsesTheForwardsMask) {
  AdaptedModel m("llama2_tiny", lora_of(4, 8, kAllLoraTargets, 0.3));
  m.model.set_lora_dropout_key(lora_dropout_key(3, 1, 0, 0));
  expect_gradients_match_differences(m, 2e-3);
  // And dropout acts: another key gives another training loss; evaluation has none (equal for every key).
  const double a = m.loss();
  m.model.set_lora_dropout_key(lora_dropout_key(3, 2, 0, 0));
  EXPECT_NE(a, m.loss());
  const double eval = m.model.forward_loss(m.f.inputs.data(), m.f.targets.data(), m.f.batch, m.f.seq).sum;
  m.model.set_lora_dropout_key(lora_dropout_key(3, 1, 0, 0));
  EXPECT_EQ(eval, m.model.forward_loss(m.f.inputs.data(), m.f.targets.data(), m.f.batch, m.f.seq).sum);
}

// What a training step multiplies, counted by kernels/cpu/matmul.h: with adapters the frozen base costs its forward
// and its input gradient (n each per weight, the tied head included) and no weight gradient, and each adapter weight n
// x 3 (u or its B product; dB and dt, or the input gradient and dA); a full fine-tune costs n x 3 per weight. And the
// adapters on one input share their products: per input with k adapters, 1 + k GEMMs forward (one down-projection
// for the k A's stacked, k B products added into the base's outputs) and 2k + 2 backward (dB and dt each, then one
// input gradient and one dA); with dropout each adapter's masked input is its own: 2k and 4k.
TEST(LlamaLora, AStepMultipliesTheFrozenBaseTwiceAndSharesEachInputsProducts) {
  Fixture f("llama32_tiny");  // tied: the head is the embedding, which trains in a full fine-tune only
  const LlamaConfig& c = f.config;
  const int64_t n = f.batch * f.seq, L = c.num_hidden_layers;
  int64_t matmul_weights = c.vocab_size * c.hidden_size;  // the head
  for (int t = 0; t < kLoraTargets; t++) {
    const auto [out, in] = lora_target_shape(c, LoraTarget(t));
    matmul_weights += L * out * in;
  }
  struct Case {
    std::string targets;
    double dropout;
  };
  for (const Case& k : {Case{"", 0}, Case{lora_targets_string(kAllLoraTargets), 0}, Case{"q_proj", 0},
                        Case{"q_proj,v_proj,gate_proj,down_proj", 0}, Case{"k_proj,v_proj,up_proj,o_proj", 0.2}}) {
    SCOPED_TRACE(k.targets.empty() ? "full fine-tune" : k.targets + ", dropout " + std::to_string(k.dropout));
    const LoraConfig lora = k.targets.empty() ? LoraConfig{} : lora_of(4, 8, parse_lora_targets(k.targets), k.dropout);
    Llama model(c, f.batch, f.seq, LlamaParallel{}, lora);
    load_weights(f.dir, model.layout(), model.params.data());
    if (lora.enabled()) {
      const ParamLayout& l = model.lora_layout().params;
      init_lora_weights_piece(l, 5, Segment{0, l.total()}, model.lora_params.data());
    }
    const int64_t chunk = llama_buffer_sizes(c, model.layout().tp(), f.batch, f.seq).head_chunk_rows;
    const int64_t head_chunks = (n + chunk - 1) / chunk;
    model.zero_grads();
    const cpu::GemmCount before = cpu::gemm_count();
    model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
    const cpu::GemmCount after = cpu::gemm_count();
    // The base: 7 projections a layer and the head's chunks, forward and input gradient, and weight gradients only
    // when it trains.
    const int passes = lora.enabled() ? 2 : 3;
    int64_t calls = passes * (7 * L + head_chunks), multiply_adds = passes * n * matmul_weights;
    if (lora.enabled()) {
      multiply_adds += 3 * n * lora_parameter_count(c, lora);
      for (int g = 0; g < kLoraInputs; g++) {
        int64_t adapters = 0;
        for (LoraTarget t : lora_input_targets(LoraInput(g))) adapters += lora.has(t);
        if (adapters > 0) calls += L * (lora.dropout > 0 ? 6 * adapters : 3 * adapters + 3);
      }
    }
    EXPECT_EQ(after.multiply_adds - before.multiply_adds, multiply_adds);
    EXPECT_EQ(after.calls - before.calls, calls);
  }
}

// PEFT's start (B = 0) is the base model exactly, and B's gradient is the only non-zero one then (dA = B^T ... = 0).
TEST(LlamaLora, StartsAsTheBase) {
  Fixture f("llama2_tiny");
  Llama base(f.config, f.batch, f.seq), adapted(f.config, f.batch, f.seq, LlamaParallel{}, lora_of(4, 8));
  load_weights(f.dir, base.layout(), base.params.data());
  adapted.params = base.params;
  const ParamLayout& l = adapted.lora_layout().params;
  init_lora_weights_piece(l, 1, Segment{0, l.total()}, adapted.lora_params.data());
  const int64_t V = f.config.vocab_size;
  std::vector<float> la(f.batch * f.seq * V), lb(la.size());
  base.forward_logits(f.inputs.data(), f.batch, f.seq, la.data());
  adapted.forward_logits(f.inputs.data(), f.batch, f.seq, lb.data());
  EXPECT_EQ(la, lb);
  adapted.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  for (const ParamTensor& t : l.tensors()) {
    double s = 0;
    for (int64_t i = 0; i < t.numel; i++) s += std::abs(adapted.lora_grads[t.offset + i]);
    if (t.name.find("lora_A") != std::string::npos) {
      EXPECT_EQ(s, 0.0) << t.name;
    } else {
      EXPECT_GT(s, 0.0) << t.name;
    }
  }
  EXPECT_TRUE(adapted.grads.empty());
  EXPECT_EQ(adapted.lora_grads.size(), size_t(l.total()));
}

// ---- against PEFT + transformers in float64 (tests/fixtures/lora_*, tools/reference) ----

// A LoRA fixture: its base (a model fixture), its adapter (adapter_config.json, adapter_model.safetensors), and its
// reference batch and values.
struct LoraFixture {
  std::filesystem::path dir;
  Fixture base;
  LoraConfig lora;
  SafetensorsFile ref;
  explicit LoraFixture(const std::string& name)
      : dir(std::filesystem::path("tests/fixtures") / name),
        base(read_json_base(dir)),
        lora(read_peft_adapter_config(dir)),
        ref(dir / "reference.safetensors") {
    ref.read_i32("input_ids", {base.batch, base.seq}, base.inputs.data());
    ref.read_i32("targets", {base.batch, base.seq}, base.targets.data());
    std::ifstream in(dir / "reference.json");
    base.meta = nlohmann::json::parse(in);  // the adapters' hyperparameters (Fixture::optimizer reads them)
  }
  static std::string read_json_base(const std::filesystem::path& dir) {
    std::ifstream in(dir / "reference.json");
    return nlohmann::json::parse(in).at("base").get<std::string>();
  }
  // The adapter file's values, into a layout's buffer (one rank: every tensor whole).
  void read_adapters(const ParamLayout& layout, float* out) const {
    SafetensorsFile a(dir / "adapter_model.safetensors");
    EXPECT_EQ(a.tensors().size(), layout.tensors().size());
    for (const ParamTensor& t : layout.tensors()) a.read_f32(t.name, t.shape, out + t.offset);
  }
};

class LoraParity : public testing::TestWithParam<std::string> {};

// Logits, the loss and every adapter's gradient equal PEFT's to 1e-5 (relative error norm), the base frozen.
TEST_P(LoraParity, LogitsLossAndAdapterGradientsFollowPeft) {
  LoraFixture x(GetParam());
  const Fixture& f = x.base;
  Llama model(f.config, f.batch, f.seq, LlamaParallel{}, x.lora);
  load_weights(f.dir, model.layout(), model.params.data());
  x.read_adapters(model.lora_layout().params, model.lora_params.data());
  const int64_t V = f.config.vocab_size, n = f.batch * f.seq;
  std::vector<float> logits(n * V);
  std::vector<double> want(n * V);
  model.forward_logits(f.inputs.data(), f.batch, f.seq, logits.data());
  x.ref.read_f64("logits", {f.batch, f.seq, V}, want.data());
  EXPECT_LE(testing_util::rel_err_norm(logits.data(), want.data(), n * V), 1e-5);
  const LossSum loss = model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  double ref_loss = 0;
  x.ref.read_f64("loss", {1}, &ref_loss);
  EXPECT_NEAR(loss.sum / loss.count, ref_loss, 1e-5 * ref_loss);
  for (const ParamTensor& t : model.lora_layout().params.tensors()) {
    std::vector<double> g(t.numel);
    x.ref.read_f64("grad." + t.name, t.shape, g.data());
    // Ours is the gradient of the summed loss; the reference's of the mean.
    EXPECT_LE(testing_util::rel_err_norm(model.lora_grads.data() + t.offset, g.data(), t.numel, 1.0 / loss.count), 1e-5)
        << t.name;
  }
  EXPECT_TRUE(model.grads.empty());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LoraParity, testing::Values("lora_llama2_tiny", "lora_llama32_tiny"));

}  // namespace
}  // namespace tuna
