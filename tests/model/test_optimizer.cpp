// Learning-rate schedules at their defining points, and the AdamW step against a hand-computed update.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "core/error.h"
#include "model/config.h"
#include "model/optimizer.h"

namespace tuna {
namespace {

OptimizerConfig schedule(const std::string& name) {
  OptimizerConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 10;
  c.schedule = name;
  c.decay_fraction = 0.25;
  return c;
}

TEST(Schedule, WarmupIsLinearFromLrOverWarmup) {
  for (const char* name : {"cosine", "linear", "constant", "wsd"}) {
    OptimizerConfig c = schedule(name);
    EXPECT_DOUBLE_EQ(learning_rate(c, 0, 110), 0.1) << name;
    EXPECT_DOUBLE_EQ(learning_rate(c, 4, 110), 0.5) << name;
    EXPECT_DOUBLE_EQ(learning_rate(c, 9, 110), 1.0) << name;
  }
}

TEST(Schedule, CosineLinearConstantAfterWarmup) {
  EXPECT_DOUBLE_EQ(learning_rate(schedule("cosine"), 10, 110), 1.0);
  EXPECT_NEAR(learning_rate(schedule("cosine"), 60, 110), 0.1 + 0.45 * (1 + std::cos(std::numbers::pi * 0.5)), 1e-15);
  EXPECT_NEAR(learning_rate(schedule("cosine"), 110, 110), 0.1, 1e-15);
  EXPECT_NEAR(learning_rate(schedule("linear"), 60, 110), 0.55, 1e-15);
  EXPECT_DOUBLE_EQ(learning_rate(schedule("constant"), 100, 110), 1.0);
}

TEST(Schedule, WsdHoldsThenDecaysOverTheLastFraction) {
  OptimizerConfig c = schedule("wsd");
  // 100 steps, decay over the last 25: steps 75..99.
  EXPECT_DOUBLE_EQ(learning_rate(c, 74, 100), 1.0);
  EXPECT_NEAR(learning_rate(c, 75, 100), 1.0 - 0.9 / 25, 1e-15);
  EXPECT_NEAR(learning_rate(c, 99, 100), 0.1, 1e-15);
}

TEST(Schedule, BadOptionsAreRefusedByName) {
  OptimizerConfig c = schedule("cosinus");
  EXPECT_THROW(validate(c), Error);
  try {
    validate(c);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cosinus"), std::string::npos);
  }
  c = schedule("cosine");
  c.beta2 = 1.0;
  EXPECT_THROW(validate(c), Error);
  c = schedule("cosine");
  c.min_lr = 2.0;
  EXPECT_THROW(validate(c), Error);
}

// The smallest model with every kind of tensor: matrices that decay and norm weights that do not.
LlamaConfig one_layer_config() {
  LlamaConfig cfg;
  cfg.hidden_size = 2;
  cfg.intermediate_size = 2;
  cfg.num_hidden_layers = 1;
  cfg.num_attention_heads = 1;
  cfg.num_key_value_heads = 1;
  cfg.head_dim = 2;
  cfg.vocab_size = 3;
  return cfg;
}

// warmup_steps >= steps (an example config's 100 warmup steps in an 8-step run): a warning with the peak.
TEST(Schedule, WarmupLongerThanTheRunIsWarned) {
  OptimizerConfig c;
  c.lr = 2e-5, c.warmup_steps = 100;
  const std::string w = schedule_warning(c, 8);
  EXPECT_NE(w.find("warmup_steps 100 >= steps 8"), std::string::npos) << w;
  EXPECT_NE(w.find("peaks at 1.6e-06 instead of lr 2e-05"), std::string::npos) << w;
  EXPECT_EQ(schedule_warning(c, 101), "");
}

TEST(AdamW, OneStepMatchesTheFormulaAndDecaysOnlyMatrices) {
  ParamLayout layout(one_layer_config());
  OptimizerConfig oc;
  oc.lr = 0.1;
  oc.beta1 = 0.9;
  oc.beta2 = 0.99;
  oc.eps = 1e-8;
  oc.weight_decay = 0.5;
  oc.grad_clip = 0;
  AdamW opt(layout, oc);
  std::vector<float> params(layout.total(), 1.0f), grads(layout.total(), 4.0f);
  OptimizerStats stats = opt.step(params.data(), grads.data(), 0.5, oc.lr);  // g = 2 everywhere
  EXPECT_NEAR(stats.grad_norm, 2.0 * std::sqrt(double(layout.total())), 1e-9);
  // First step: m = 0.1 g, v = 0.01 g^2; m_hat = g, v_hat = g^2: update = lr * g / (|g| + eps) = lr.
  const double step = 0.1 * 2.0 / (2.0 + 1e-8);
  const ParamTensor* norm = layout.find("model.norm.weight");
  const ParamTensor* q = layout.find("model.layers.0.self_attn.q_proj.weight");
  EXPECT_NEAR(params[norm->offset], 1.0 - step, 1e-7);
  EXPECT_NEAR(params[q->offset], 1.0 * (1 - 0.1 * 0.5) - step, 1e-7);
}

TEST(AdamW, ClipsToTheMaxNorm) {
  ParamLayout layout(one_layer_config());
  OptimizerConfig oc;
  oc.grad_clip = 1.0;
  AdamW opt(layout, oc);
  std::vector<float> params(layout.total(), 0.0f), grads(layout.total(), 3.0f);
  OptimizerStats stats = opt.step(params.data(), grads.data(), 1.0, 1e-3);
  EXPECT_NEAR(stats.clip_scale, 1.0 / (stats.grad_norm + 1e-6), 1e-12);
  // m after clipping is (1 - beta1) * clipped gradient.
  EXPECT_NEAR(opt.m[0], 0.1 * 3.0 * stats.clip_scale, 1e-7);
}

}  // namespace
}  // namespace tuna
