// RoPE scaling on the GPU model and the GPU sampler: tools/reference/make_rope_fixtures.py's linear, dynamic and yarn
// fixtures (a batch longer than the original context) against their float64 transformers references, at the GPU
// model's bf16 tolerances (tests/model/test_llama_gpu.cpp explains them: 3e-2 on logits, 1e-2 on the loss, 0.1 per
// gradient tensor); dynamic generation with the KV cache (DecodeGpu) against transformers' cached logits, at the
// decode tests' 3e-2. The kernels are unchanged: the scaling is in the tables the host uploads. Skipped without a
// device (CI runs it on the host emulator).
#if TUNA_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "model/decode_gpu.h"
#include "model/llama_gpu.h"
#include "model/memory_plan.h"  // single_rank_layout
#include "tests/kernels/gpu_test_util.h"
#include "tests/model/fixture.h"

namespace tuna {
namespace {

using testing_util::Fixture;
using testing_util::rel_err_norm;

class RopeScalingGpu : public testing::TestWithParam<std::string> {};

TEST_P(RopeScalingGpu, LogitsLossAndGradientsMatchTransformers) {
  TUNA_REQUIRE_GPU();
  Fixture f(GetParam());
  std::vector<float> weights(ParamLayout(f.config).total());
  load_weights(f.dir, ParamLayout(f.config), weights.data());
  LlamaGpu model(f.config, f.batch, f.seq);
  model.set_params(weights.data());
  SafetensorsFile ref(f.dir / "reference.safetensors");
  const int64_t V = f.config.vocab_size;

  std::vector<float> logits(f.batch * f.seq * V, NAN);
  model.forward_logits(f.inputs.data(), f.batch, f.seq, logits.data());
  std::vector<double> ref_logits(logits.size());
  ref.read_f64("logits", {f.batch, f.seq, V}, ref_logits.data());
  const double logits_err = rel_err_norm(logits.data(), ref_logits.data(), logits.size());
  std::printf("  %s logits rel err %.3e\n", GetParam().c_str(), logits_err);
  EXPECT_LE(logits_err, 3e-2);

  model.zero_grads();
  const LossSum loss = model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  double ref_loss = 0;
  ref.read_f64("loss", {1}, &ref_loss);
  ASSERT_GT(loss.count, 0);
  EXPECT_NEAR(loss.sum / loss.count, ref_loss, 1e-2 * std::abs(ref_loss));
  std::vector<float> grads(model.layout().total());
  model.get_grads(grads.data());
  for (const ParamTensor& t : model.layout().tensors()) {
    std::vector<double> ref_grad(t.numel);
    ref.read_f64("grad." + t.name, t.shape, ref_grad.data());
    EXPECT_LE(rel_err_norm(grads.data() + t.offset, ref_grad.data(), t.numel, 1.0 / loss.count), 0.1) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RopeScalingGpu, testing::Values("rope_linear", "rope_dynamic", "rope_yarn"));

TEST(RopeScalingGpuDecode, DynamicGenerationWithACacheEqualsTransformers) {
  TUNA_REQUIRE_GPU();
  Fixture f("rope_dynamic");
  LlamaGpu model(f.config, single_rank_layout(f.batch, f.seq, /*training=*/false));
  std::vector<float> weights(model.layout().total());
  load_weights(f.dir, model.layout(), weights.data());
  model.set_params(weights.data());
  SafetensorsFile ref(f.dir / "reference.safetensors");
  const int64_t V = f.config.vocab_size, prompt = f.meta.at("cached_generation").at("prompt");
  const int64_t steps = f.seq - prompt + 1;
  std::vector<double> expected(f.batch * steps * V);
  ref.read_f64("cached_last_logits", {f.batch, steps, V}, expected.data());

  // The whole set of cached logits is held to the GPU model's logits bound (3e-2 relative, as the fixture test
  // above); each position alone, a vector of 64 bf16-rounded logits, to 0.1: rotating a position with the wrong
  // frequencies (the whole-context ones) moves the last one by 0.34 (reference.json).
  DecodeGpu decoder({&model.config(), &model.layout(), model.params(), 0}, f.batch, f.seq);
  std::vector<float> last(f.batch * V, NAN), ours(f.batch * steps * V, NAN);
  double worst = 0;
  for (int64_t pos = 0, step = 0; pos < f.seq; ++step) {
    const int64_t n = pos == 0 ? prompt : 1;
    std::vector<int32_t> tokens(f.batch * n);
    for (int64_t b = 0; b < f.batch; b++) std::copy_n(f.inputs.begin() + b * f.seq + pos, n, tokens.begin() + b * n);
    decoder.append(tokens.data(), n, last.data());
    pos += n;
    for (int64_t b = 0; b < f.batch; b++) {
      std::copy_n(last.data() + b * V, V, ours.data() + (b * steps + step) * V);
      const double err = rel_err_norm(last.data() + b * V, expected.data() + (b * steps + step) * V, V);
      worst = std::max(worst, err);
      EXPECT_LE(err, 0.1) << "sequence " << b << ", position " << pos - 1;
    }
  }
  const double all = rel_err_norm(ours.data(), expected.data(), ours.size());
  std::printf("  rope_dynamic: cached logits vs transformers', rel err %.3e, worst position %.3e\n", all, worst);
  EXPECT_LE(all, 3e-2);
}

}  // namespace
}  // namespace tuna
#endif  // TUNA_CUDA
