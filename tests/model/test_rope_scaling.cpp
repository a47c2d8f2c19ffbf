// RoPE scaling `linear`, `dynamic` (NTK-aware) and `yarn` against transformers: the frequencies, and the CPU model's
// logits, loss and every gradient on tools/reference/make_rope_fixtures.py's fixtures, whose batch (48 positions) is
// longer than the original context (32); dynamic's generation with a KV cache; config.json read and written back.
// Tolerances as tests/model/test_llama.cpp's (fp32 against a float64 reference: 1e-5).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "core/error.h"
#include "kernels/cpu/rope.h"
#include "model/config.h"
#include "model/llama.h"
#include "tests/model/fixture.h"

namespace tuna {
namespace {

using nlohmann::json;
using testing_util::Fixture;
using testing_util::rel_err_norm;

class RopeScalingParity : public testing::TestWithParam<std::string> {};

// The inverse frequencies of a forward over the fixture's batch, and the attention factor, equal transformers'
// (float64 formulas from modeling_rope_utils.py, asserted there against transformers' own float32 table).
TEST_P(RopeScalingParity, FrequenciesAndAttentionFactorEqualTransformers) {
  Fixture f(GetParam());
  const LlamaConfig& c = f.config;
  std::vector<double> inv_freq(c.head_dim / 2);
  cpu::rope_inv_freq(inv_freq.data(), c.head_dim, c.rope_theta, c.rope_scaling, f.seq);
  const std::vector<double> expected = f.meta.at("rope_inv_freq");
  ASSERT_EQ(expected.size(), inv_freq.size());
  for (size_t i = 0; i < inv_freq.size(); ++i) EXPECT_NEAR(inv_freq[i], expected[i], 1e-14 * expected[i]) << i;
  EXPECT_NEAR(cpu::rope_attention_factor(c.rope_scaling), f.meta.at("rope_attention_factor").get<double>(), 1e-15);
  EXPECT_GT(f.seq, f.meta.at("original_context").get<int64_t>());  // the point of these fixtures
  EXPECT_LE(f.seq, c.max_context());
}

TEST_P(RopeScalingParity, LogitsLossAndEveryGradientMatchTransformers) {
  Fixture f(GetParam());
  Llama model(f.config, f.batch, f.seq);
  load_weights(f.dir, model.layout(), model.params.data());
  SafetensorsFile ref(f.dir / "reference.safetensors");
  const int64_t V = f.config.vocab_size;

  std::vector<float> logits(f.batch * f.seq * V);
  model.forward_logits(f.inputs.data(), f.batch, f.seq, logits.data());
  std::vector<double> ref_logits(logits.size());
  ref.read_f64("logits", {f.batch, f.seq, V}, ref_logits.data());
  EXPECT_LE(rel_err_norm(logits.data(), ref_logits.data(), logits.size()), 1e-5);

  model.zero_grads();
  const LossSum loss = model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  double ref_loss = 0;
  ref.read_f64("loss", {1}, &ref_loss);
  ASSERT_GT(loss.count, 0);
  EXPECT_NEAR(loss.sum / loss.count, ref_loss, 1e-5);
  for (const ParamTensor& t : model.layout().tensors()) {
    std::vector<double> ref_grad(t.numel);
    ref.read_f64("grad." + t.name, t.shape, ref_grad.data());
    EXPECT_LE(rel_err_norm(model.grads.data() + t.offset, ref_grad.data(), t.numel, 1.0 / loss.count), 1e-5) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RopeScalingParity, testing::Values("rope_linear", "rope_dynamic", "rope_yarn"));

// Dynamic scaling while generating with a KV cache: a prompt inside the original context, then one token at a time
// past it. transformers rotates each new position with the frequencies of the length reached when it is appended,
// so these logits are not the whole-context forward's (the fixture asserts they differ); tuna's cached forward
// gives transformers' cached ones.
TEST(RopeScaling, DynamicGenerationWithACacheEqualsTransformers) {
  Fixture f("rope_dynamic");
  Llama model(f.config, f.batch, f.seq);
  load_weights(f.dir, model.layout(), model.params.data());
  SafetensorsFile ref(f.dir / "reference.safetensors");
  const int64_t V = f.config.vocab_size, prompt = f.meta.at("cached_generation").at("prompt");
  const int64_t steps = f.seq - prompt + 1;
  std::vector<double> expected(f.batch * steps * V);
  ref.read_f64("cached_last_logits", {f.batch, steps, V}, expected.data());

  KvCache cache = model.make_kv_cache(f.batch, f.seq);
  std::vector<float> last(f.batch * V);
  for (int64_t pos = 0, step = 0; pos < f.seq; ++step) {
    const int64_t n = pos == 0 ? prompt : 1;
    std::vector<int32_t> tokens(f.batch * n);
    for (int64_t b = 0; b < f.batch; b++) std::copy_n(f.inputs.begin() + b * f.seq + pos, n, tokens.begin() + b * n);
    model.forward_cached(tokens.data(), f.batch, n, cache, last.data());
    pos += n;
    for (int64_t b = 0; b < f.batch; b++)
      EXPECT_LE(rel_err_norm(last.data() + b * V, expected.data() + (b * steps + step) * V, V), 1e-5)
          << "sequence " << b << ", position " << pos - 1;
  }
}

// Dynamic's frequencies are the default ones up to the original context, and move only past it.
TEST(RopeScaling, DynamicFrequenciesMoveOnlyPastTheOriginalContext) {
  cpu::RopeScaling s;
  s.type = "dynamic", s.factor = 4, s.original_max_position_embeddings = 64;
  std::vector<double> plain(8), at_original(8), past(8);
  cpu::rope_inv_freq(plain.data(), 16, 10000.0, cpu::RopeScaling{});
  cpu::rope_inv_freq(at_original.data(), 16, 10000.0, s, 10);
  EXPECT_EQ(plain, at_original);
  cpu::rope_inv_freq(at_original.data(), 16, 10000.0, s, 64);
  EXPECT_EQ(plain, at_original);
  cpu::rope_inv_freq(past.data(), 16, 10000.0, s, 65);
  EXPECT_EQ(past[0], plain[0]);
  for (int i = 1; i < 8; ++i) EXPECT_LT(past[i], plain[i]) << i;
}

json tiny_config(int64_t max_position_embeddings, json rope_scaling) {
  return {{"hidden_size", 32},         {"intermediate_size", 64},  {"num_hidden_layers", 1},
          {"num_attention_heads", 2},  {"vocab_size", 64},         {"max_position_embeddings", max_position_embeddings},
          {"rope_theta", 10000.0},     {"rope_scaling", rope_scaling}};
}

TEST(RopeScaling, ConfigReadsEachTypeAndWritesItBack) {
  // Both spellings of the type; yarn's optional fields; max_context() = the original context x factor for
  // dynamic and yarn (transformers scales from max_position_embeddings), max_position_embeddings for linear.
  const LlamaConfig linear = LlamaConfig::from_json(tiny_config(4096, {{"type", "linear"}, {"factor", 4.0}}), "c.json");
  EXPECT_EQ(linear.rope_scaling.type, "linear");
  EXPECT_EQ(linear.max_context(), 4096);
  const LlamaConfig dynamic =
      LlamaConfig::from_json(tiny_config(1024, {{"rope_type", "dynamic"}, {"factor", 2.0}}), "c.json");
  EXPECT_EQ(dynamic.rope_scaling.original_max_position_embeddings, 1024);
  EXPECT_EQ(dynamic.max_context(), 2048);
  const LlamaConfig yarn = LlamaConfig::from_json(
      tiny_config(1024, {{"rope_type", "yarn"}, {"factor", 8.0}, {"beta_fast", 16}, {"beta_slow", 0},
                         {"attention_factor", 1.25}, {"finetuned", true}}),
      "c.json");
  EXPECT_EQ(yarn.rope_scaling.beta_fast, 16.0);
  EXPECT_EQ(yarn.rope_scaling.beta_slow, 1.0);  // transformers: `get("beta_slow") or 1`
  EXPECT_EQ(cpu::rope_attention_factor(yarn.rope_scaling), 1.25);
  EXPECT_EQ(yarn.max_context(), 8192);
  for (const LlamaConfig* c : {&linear, &dynamic, &yarn}) {
    const json written = c->to_json();
    const LlamaConfig back = LlamaConfig::from_json(written, "written.json");
    EXPECT_EQ(back.to_json(), written) << written.dump();
    std::vector<double> a(16), b(16);
    cpu::rope_inv_freq(a.data(), 32, c->rope_theta, c->rope_scaling, 3000);
    cpu::rope_inv_freq(b.data(), 32, back.rope_theta, back.rope_scaling, 3000);
    EXPECT_EQ(a, b) << written.dump();
    EXPECT_EQ(cpu::rope_attention_factor(c->rope_scaling), cpu::rope_attention_factor(back.rope_scaling));
    EXPECT_FALSE(written["rope_scaling"].contains("original_max_position_embeddings")) << written.dump();
  }
}

TEST(RopeScaling, ConfigRefusesWhatTransformersVersionsComputeDifferently) {
  auto error = [](json cfg) {
    try {
      LlamaConfig::from_json(cfg, "model/config.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto has = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  std::string e = error(tiny_config(1024, {{"rope_type", "longrope"}, {"factor", 2.0}}));
  EXPECT_TRUE(has(e, "model/config.json") && has(e, "'longrope' is not supported")) << e;
  e = error(tiny_config(1024, {{"rope_type", "linear"}}));
  EXPECT_TRUE(has(e, "rope_scaling") && has(e, "'factor'")) << e;
  e = error(tiny_config(1024, {{"rope_type", "dynamic"}, {"factor", 0.5}}));
  EXPECT_TRUE(has(e, "factor") && has(e, ">= 1")) << e;
  e = error(tiny_config(4096, {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 1024}}));
  EXPECT_TRUE(has(e, "original_max_position_embeddings") && has(e, "different transformers versions")) << e;
  e = error(tiny_config(1024, {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 0.7}, {"mscale_all_dim", 0.7}}));
  EXPECT_TRUE(has(e, "mscale") && has(e, "attention_factor")) << e;
  e = error(tiny_config(1024, {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fast", 1}, {"beta_slow", 2}}));
  EXPECT_TRUE(has(e, "beta_fast > beta_slow")) << e;
  e = error(tiny_config(1024, {{"rope_type", "dynamic"}, {"factor", 2.0}, {"original_max_position_embeddings", 512}}));
  EXPECT_TRUE(has(e, "original_max_position_embeddings") && has(e, "differs from max_position_embeddings")) << e;
  // Given explicitly, the attention factor makes mscale irrelevant in every version: accepted.
  EXPECT_EQ(error(tiny_config(1024, {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 0.7}, {"mscale_all_dim", 0.7},
                                     {"attention_factor", 1.0}})),
            "no error");
}

// --rope_scaling: recorded in the config and in the config.json checkpoints carry; linear extends
// max_position_embeddings, dynamic and yarn keep it as their original context; a resumed run's config already says
// so (nothing changes); another scaling, a bad spec or a shrinking factor are refused by name.
TEST(RopeScaling, OptionScalesTheConfigAndItsJson) {
  const json base = tiny_config(1024, nullptr);
  for (const auto& [spec, max_positions, context] :
       {std::tuple<std::string, int64_t, int64_t>{"linear:4", 4096, 4096}, {"dynamic:2.5", 1024, 2560},
        {"yarn:4", 1024, 4096}}) {
    LlamaConfig c = LlamaConfig::from_json(base, "c.json");
    json written = base;
    written["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};  // the newer spelling, kept
    apply_rope_scaling(c, written, spec, "rope_scaling", "c.json");
    EXPECT_EQ(c.max_position_embeddings, max_positions) << spec;
    EXPECT_EQ(c.max_context(), context) << spec;
    const LlamaConfig back = LlamaConfig::from_json(written, "written.json");
    EXPECT_EQ(back.to_json(), c.to_json()) << spec;
    EXPECT_EQ(written["rope_scaling"], c.to_json()["rope_scaling"]) << spec;
    EXPECT_EQ(written["rope_parameters"]["rope_type"], c.rope_scaling.type) << spec;
    EXPECT_EQ(written["rope_parameters"]["rope_theta"], 10000.0) << spec;
    // Resuming: the config already has it.
    json again = written;
    LlamaConfig resumed = back;
    apply_rope_scaling(resumed, again, spec, "rope_scaling", "c.json");
    EXPECT_EQ(again, written) << spec;
    EXPECT_EQ(resumed.max_position_embeddings, max_positions) << spec;
  }
  auto error = [&](const std::string& spec, json cfg) {
    LlamaConfig c = LlamaConfig::from_json(cfg, "model/config.json");
    try {
      apply_rope_scaling(c, cfg, spec, "rope_scaling", "model/config.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("ntk:4", base).find("linear, dynamic or yarn"), std::string::npos);
  EXPECT_NE(error("linear", base).find("TYPE:FACTOR"), std::string::npos);
  EXPECT_NE(error("linear:0.5", base).find("above 1"), std::string::npos);
  EXPECT_NE(error("linear:4x", base).find("above 1"), std::string::npos);
  const std::string e = error("yarn:4", tiny_config(1024, {{"rope_type", "linear"}, {"factor", 2.0}}));
  EXPECT_NE(e.find("already has linear rope scaling"), std::string::npos) << e;
  EXPECT_NE(e.find("model/config.json"), std::string::npos) << e;
  LlamaConfig plain = LlamaConfig::from_json(base, "c.json");
  json untouched = base;
  apply_rope_scaling(plain, untouched, "", "rope_scaling", "c.json");
  EXPECT_EQ(untouched, base);
}

}  // namespace
}  // namespace tuna
