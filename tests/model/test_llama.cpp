// The CPU model against Hugging Face transformers: logits, loss, every gradient and 10 AdamW steps on
// the fixtures made by tools/reference/make_fixtures.py (float64 reference from the same float32 weights).
//
// Tolerances: the model runs in fp32 (24-bit mantissa, unit roundoff 6e-8); over two layers, a 128-way
// softmax and sums of a few hundred terms the relative error norm stays near 1e-6, so 1e-5 (the parity
// bound) leaves a 10x margin without hiding a real bug (a wrong sign, pairing or scale is O(1)). The 10
// AdamW steps use hyperparameters chosen (tools/reference/README.md) so that fp32 drifts <= 1e-5 from the
// float64 trajectory while each deliberate optimizer bug (decay on norms, no bias correction, no clipping,
// no warmup) moves the losses by >= 2.4e-3: the 1e-4 bound sits between the two with margin both ways.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "ckpt/checkpoint.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/optimizer.h"
#include "ckpt/safetensors.h"
#include "tests/model/fixture.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;

using testing_util::Fixture;
using testing_util::rel_err_norm;

class LlamaParity : public testing::TestWithParam<std::string> {};

TEST_P(LlamaParity, LogitsLossAndEveryGradientMatchTransformers) {
  Fixture f(GetParam());
  Llama model(f.config, f.batch, f.seq);
  load_weights(f.dir, model.layout(), model.params.data());
  SafetensorsFile ref(f.dir / "reference.safetensors");
  const int64_t V = f.config.vocab_size;

  std::vector<float> logits(f.batch * f.seq * V);
  model.forward_logits(f.inputs.data(), f.batch, f.seq, logits.data());
  std::vector<double> ref_logits(logits.size());
  ref.read_f64("logits", {f.batch, f.seq, V}, ref_logits.data());
  const double logits_err = rel_err_norm(logits.data(), ref_logits.data(), logits.size());
  EXPECT_LE(logits_err, 1e-5);
  RecordProperty("logits_rel_err", std::to_string(logits_err));

  model.zero_grads();
  LossSum loss = model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  double ref_loss = 0;
  ref.read_f64("loss", {1}, &ref_loss);
  ASSERT_GT(loss.count, 0);
  EXPECT_NEAR(loss.sum / loss.count, ref_loss, 1e-5);

  for (const ParamTensor& t : model.layout().tensors()) {
    std::vector<double> ref_grad(t.numel);
    ref.read_f64("grad." + t.name, t.shape, ref_grad.data());
    const double err = rel_err_norm(model.grads.data() + t.offset, ref_grad.data(), t.numel, 1.0 / loss.count);
    EXPECT_LE(err, 1e-5) << t.name;
  }
}

// The same batch as packed documents (tools/reference/make_fixtures.py: transformers with position_ids restarting
// at each document and a block-diagonal causal mask, float64): logits, loss and every gradient at the bound above.
// Its position_ids are valid loader positions (0 where a document begins), which the model turns into the same
// document starts and RoPE positions.
TEST_P(LlamaParity, PackedDocumentsMatchTransformers) {
  Fixture f(GetParam());
  Llama model(f.config, f.batch, f.seq);
  load_weights(f.dir, model.layout(), model.params.data());
  SafetensorsFile ref(f.dir / "packed.safetensors");
  const int64_t V = f.config.vocab_size;
  std::vector<int32_t> positions(f.batch * f.seq);
  ref.read_i32("position_ids", {f.batch, f.seq}, positions.data());

  std::vector<float> logits(f.batch * f.seq * V);
  model.forward_logits(f.inputs.data(), f.batch, f.seq, logits.data(), positions.data());
  std::vector<double> ref_logits(logits.size());
  ref.read_f64("logits", {f.batch, f.seq, V}, ref_logits.data());
  EXPECT_LE(rel_err_norm(logits.data(), ref_logits.data(), logits.size()), 1e-5);

  model.zero_grads();
  const LossSum loss = model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq, positions.data());
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

TEST_P(LlamaParity, TenAdamWStepsFollowTorch) {
  Fixture f(GetParam());
  Llama model(f.config, f.batch, f.seq);
  load_weights(f.dir, model.layout(), model.params.data());
  SafetensorsFile ref(f.dir / "reference.safetensors");

  const nlohmann::json& m = f.meta;
  const OptimizerConfig oc = f.optimizer();
  const int64_t steps = m.at("steps");
  std::vector<double> ref_losses(steps), ref_norms(steps), ref_lrs(steps);
  ref.read_f64("train_losses", {steps}, ref_losses.data());
  ref.read_f64("grad_norms", {steps}, ref_norms.data());
  ref.read_f64("lrs", {steps}, ref_lrs.data());

  AdamW opt(model.layout(), oc);
  for (int64_t s = 0; s < steps; s++) {
    model.zero_grads();
    LossSum loss = model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
    const double lr = learning_rate(oc, s, steps);
    EXPECT_NEAR(lr, ref_lrs[s], 1e-12 * ref_lrs[s]) << "step " << s;
    OptimizerStats stats = opt.step(model.params.data(), model.grads.data(), 1.0 / loss.count, lr);
    EXPECT_NEAR(loss.sum / loss.count, ref_losses[s], 1e-4 * std::abs(ref_losses[s])) << "step " << s;
    EXPECT_NEAR(stats.grad_norm, ref_norms[s], 1e-4 * ref_norms[s]) << "step " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LlamaParity, testing::Values("llama2_tiny", "llama32_tiny"));

TEST(Llama, GradientAccumulationOverMicroBatchesEqualsOneBatch) {
  // Two micro-batches of 1 row accumulate exactly the gradient of one batch of 2 rows (up to fp32
  // summation order): the loss convention (sums, one division per step) makes the split irrelevant.
  Fixture f("llama2_tiny");
  Llama whole(f.config, f.batch, f.seq), split(f.config, 1, f.seq);
  load_weights(f.dir, whole.layout(), whole.params.data());
  split.params = whole.params;
  whole.zero_grads();
  split.zero_grads();
  LossSum a = whole.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  LossSum b{};
  for (int64_t r = 0; r < f.batch; r++) {
    LossSum l = split.forward_backward(f.inputs.data() + r * f.seq, f.targets.data() + r * f.seq, 1, f.seq);
    b.sum += l.sum;
    b.count += l.count;
  }
  EXPECT_EQ(a.count, b.count);
  EXPECT_NEAR(a.sum, b.sum, 1e-5 * std::abs(a.sum));
  std::vector<double> ref(whole.grads.begin(), whole.grads.end());
  EXPECT_LE(rel_err_norm(split.grads.data(), ref.data(), ref.size()), 1e-6);
}

// The oracle of packed documents: a window's loss and gradients, with the document mask and restarted positions,
// equal the sums over its documents each run alone with positions from 0. Row 0 packs a document continued from an
// earlier window (loader positions 7..), a one-token one and a longer one; row 1 is one document. Both are fp32
// computations of the same function in different summation orders: the file's parity bound, 1e-5.
std::vector<int32_t> loader_positions(const std::vector<std::vector<int64_t>>& lengths, int32_t first_offset) {
  std::vector<int32_t> positions;
  for (const std::vector<int64_t>& row : lengths)
    for (size_t d = 0; d < row.size(); ++d)
      for (int64_t i = 0; i < row[d]; ++i) positions.push_back(static_cast<int32_t>(i + (d == 0 ? first_offset : 0)));
  return positions;
}

TEST_P(LlamaParity, PackedWindowEqualsItsDocumentsAlone) {
  Fixture f(GetParam());
  ASSERT_EQ(f.seq, 16);
  const std::vector<std::vector<int64_t>> lengths{{5, 1, 10}, {16}};
  const std::vector<int32_t> positions = loader_positions(lengths, /*first_offset=*/7);
  Llama packed(f.config, f.batch, f.seq), alone(f.config, 1, f.seq);
  load_weights(f.dir, packed.layout(), packed.params.data());
  alone.params = packed.params;
  packed.zero_grads();
  alone.zero_grads();
  const LossSum a = packed.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq, positions.data());
  LossSum b{};
  for (size_t row = 0; row < lengths.size(); ++row) {
    int64_t at = static_cast<int64_t>(row) * f.seq;
    for (int64_t n : lengths[row]) {
      const LossSum l = alone.forward_backward(f.inputs.data() + at, f.targets.data() + at, 1, n);
      b.sum += l.sum, b.count += l.count;
      at += n;
    }
  }
  EXPECT_EQ(a.count, b.count);
  EXPECT_NEAR(a.sum, b.sum, 1e-5 * std::abs(b.sum));
  const std::vector<double> ref(alone.grads.begin(), alone.grads.end());
  EXPECT_LE(rel_err_norm(packed.grads.data(), ref.data(), ref.size()), 1e-5);

  // Without the mask and the restart, the same window is a different function (the documents see each other).
  Llama crossing(f.config, f.batch, f.seq);
  crossing.params = packed.params;
  crossing.set_document_mode({/*mask=*/false, /*restart_positions=*/false});
  const LossSum c = crossing.forward_loss(f.inputs.data(), f.targets.data(), f.batch, f.seq, positions.data());
  EXPECT_GT(std::abs(c.sum - b.sum), 1e-3 * std::abs(b.sum));
  // ... and exactly the window without positions, as before documents existed.
  const LossSum d = crossing.forward_loss(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  EXPECT_EQ(c.sum, d.sum);
}

// Each switch alone does what it says: the mask alone is the oracle with positions continuing along the window
// (each document run alone from its offset in the window), the restart alone changes only RoPE.
TEST(Llama, DocumentMaskAndPositionsAreIndependentSwitches) {
  Fixture f("llama32_tiny");
  const std::vector<std::vector<int64_t>> lengths{{6, 10}, {3, 13}};
  const std::vector<int32_t> positions = loader_positions(lengths, 0);
  Llama model(f.config, f.batch, f.seq);
  load_weights(f.dir, model.layout(), model.params.data());
  auto loss_with = [&](bool mask, bool restart) {
    model.set_document_mode({mask, restart});
    return model.forward_loss(f.inputs.data(), f.targets.data(), f.batch, f.seq, positions.data()).sum;
  };
  const double plain = loss_with(false, false), mask_only = loss_with(true, false), restart_only = loss_with(false, true),
               both = loss_with(true, true);
  EXPECT_GT(std::abs(plain - mask_only), 1e-4 * std::abs(plain));
  EXPECT_GT(std::abs(plain - restart_only), 1e-4 * std::abs(plain));
  // Masked with continuing positions: a document at offset o sees RoPE positions o.., which rotate q and k alike,
  // so its attention scores (relative positions only) equal those from 0: the same loss as the restart, to fp32.
  EXPECT_NEAR(mask_only, both, 1e-5 * std::abs(both));
}

// Generation with a KV cache: a prompt of 5 positions, then one position at a time to the fixture's length,
// both sequences of the batch at once; every step's last logits equal the whole-context forward's at that
// position. Both are fp32 computations of the same function differing in summation order (GEMMs of other
// shapes, attention rows read from the cache): the fp32 parity bound of this file, 1e-5, holds with margin.
TEST_P(LlamaParity, CachedForwardEqualsTheWholeContext) {
  Fixture f(GetParam());
  Llama model(f.config, f.batch, f.seq);
  load_weights(f.dir, model.layout(), model.params.data());
  const int64_t V = f.config.vocab_size, prompt = 5;
  std::vector<float> whole(f.batch * f.seq * V);
  model.forward_logits(f.inputs.data(), f.batch, f.seq, whole.data());

  KvCache cache = model.make_kv_cache(f.batch, f.seq);
  std::vector<float> last(f.batch * V);
  for (int64_t pos = 0; pos < f.seq;) {
    const int64_t n = pos == 0 ? prompt : 1;
    std::vector<int32_t> tokens(f.batch * n);
    for (int64_t b = 0; b < f.batch; b++)
      std::copy_n(f.inputs.begin() + b * f.seq + pos, n, tokens.begin() + b * n);
    model.forward_cached(tokens.data(), f.batch, n, cache, last.data());
    pos += n;
    EXPECT_EQ(cache.length, pos);
    for (int64_t b = 0; b < f.batch; b++) {
      const float* expected = whole.data() + (b * f.seq + pos - 1) * V;
      const std::vector<double> ref(expected, expected + V);
      EXPECT_LE(rel_err_norm(last.data() + b * V, ref.data(), V), 1e-5) << "sequence " << b << ", position " << pos - 1;
    }
  }
  std::vector<int32_t> one(f.batch, 3);
  EXPECT_THROW(model.forward_cached(one.data(), f.batch, 1, cache, last.data()), Error);  // the cache is full
}

// Greedy decoding with the cache produces exactly the tokens of greedy decoding over the whole context
// (build/sample's two paths). Weights drawn with std 0.3 give decisive logits, as a trained model has, so an
// argmax is not decided by the last bits that the two paths may round differently.
TEST_P(LlamaParity, GreedyTokensWithTheCacheEqualTheWholeContexts) {
  Fixture f(GetParam());
  const int64_t steps = 40, V = f.config.vocab_size;
  const std::vector<int32_t> prompt{1, 17, 42, 5};
  const int64_t capacity = static_cast<int64_t>(prompt.size()) + steps;
  Llama model(f.config, 1, capacity);
  model.init_random(7, 0.3);
  std::vector<float> logits(capacity * V);
  const std::vector<int32_t> whole =
      testing_util::greedy_tokens(prompt, capacity, V, testing_util::whole_context_logits(model, logits, V));
  KvCache cache = model.make_kv_cache(1, capacity);
  const std::vector<int32_t> cached =
      testing_util::greedy_tokens(prompt, capacity, V, [&](const std::vector<int32_t>& tokens, int64_t n_new) {
        model.forward_cached(tokens.data() + tokens.size() - n_new, 1, n_new, cache, logits.data());
        return logits.data();
      });
  EXPECT_EQ(cached, whole);
  EXPECT_GT(std::set<int32_t>(whole.begin() + prompt.size(), whole.end()).size(), 3u) << "a degenerate model";
}

}  // namespace
}  // namespace tuna
