// model/decode_gpu: generation with a KV cache on the GPU computes what the GPU model's whole-context forward
// computes at the new positions, and greedy decoding gives the same tokens. Skipped without a device (CI runs
// it on the host emulator, with the cuBLASLt double).
//
// Tolerance: both paths are bf16 computations of the same function; they differ only where attention is taken
// (the training kernels over the whole context, kernels/decode_attention over the cache), whose bf16 outputs
// may differ by an ulp, and that difference travels through the later layers like the rounding that
// tests/model/test_llama_gpu.cpp bounds by 3e-2 on these fixtures' logits: the same bound, which an indexing
// or position error (O(1)) exceeds by far.
#if TUNA_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <set>

#include "core/error.h"
#include "ckpt/checkpoint.h"
#include "model/decode_gpu.h"
#include "model/llama.h"
#include "model/llama_gpu.h"
#include "tests/kernels/gpu_test_util.h"
#include "tests/model/fixture.h"

namespace tuna {
namespace {

using testing_util::Fixture;
using testing_util::rel_err_norm;

// bf16 weights only: no gradients, master copy or moments.
MemoryLayout forward_only(int64_t batch, int64_t seq) { return single_rank_layout(batch, seq, /*training=*/false); }

GpuWeights weights_of(LlamaGpu& model) { return {&model.config(), &model.layout(), model.params(), 0}; }

class DecodeGpuParity : public testing::TestWithParam<std::string> {};

TEST_P(DecodeGpuParity, CachedLogitsFollowTheWholeContextForward) {
  TUNA_REQUIRE_GPU();
  Fixture f(GetParam());
  LlamaGpu model(f.config, forward_only(f.batch, f.seq));
  std::vector<float> weights(model.layout().total());
  load_weights(f.dir, model.layout(), weights.data());
  model.set_params(weights.data());
  const int64_t V = f.config.vocab_size, prompt = 5;
  std::vector<float> whole(f.batch * f.seq * V);
  model.forward_logits(f.inputs.data(), f.batch, f.seq, whole.data());

  DecodeGpu decoder(weights_of(model), f.batch, f.seq);
  std::vector<float> last(f.batch * V, NAN);
  double worst = 0;
  for (int64_t pos = 0; pos < f.seq;) {
    const int64_t n = pos == 0 ? prompt : 1;
    std::vector<int32_t> tokens(f.batch * n);
    for (int64_t b = 0; b < f.batch; b++)
      std::copy_n(f.inputs.begin() + b * f.seq + pos, n, tokens.begin() + b * n);
    decoder.append(tokens.data(), n, last.data());
    pos += n;
    EXPECT_EQ(decoder.length(), pos);
    for (int64_t b = 0; b < f.batch; b++) {
      const float* expected = whole.data() + (b * f.seq + pos - 1) * V;
      const std::vector<double> ref(expected, expected + V);
      const double err = rel_err_norm(last.data() + b * V, ref.data(), V);
      worst = std::max(worst, err);
      EXPECT_LE(err, 3e-2) << "sequence " << b << ", position " << pos - 1;
    }
  }
  std::printf("  %s: cached vs whole-context logits, worst rel err %.3e over %lld positions\n", GetParam().c_str(),
              worst, (long long)(f.seq - prompt + 1));
  std::vector<int32_t> one(f.batch, 3);
  EXPECT_THROW(decoder.append(one.data(), 1, last.data()), Error);  // the cache is full
  decoder.clear();
  one[0] = static_cast<int32_t>(V);
  EXPECT_THROW(decoder.append(one.data(), 1, last.data()), Error);  // a token outside the vocabulary
}

// As the CPU test of the same name (tests/model/test_llama.cpp): decisive logits from weights of std 0.3.
TEST_P(DecodeGpuParity, GreedyTokensWithTheCacheEqualTheWholeContexts) {
  TUNA_REQUIRE_GPU();
  Fixture f(GetParam());
  const int64_t steps = 24, V = f.config.vocab_size;
  const std::vector<int32_t> prompt{1, 17, 42, 5};
  const int64_t capacity = static_cast<int64_t>(prompt.size()) + steps;
  LlamaGpu model(f.config, forward_only(1, capacity));
  std::vector<float> weights(model.layout().total());
  init_random_weights(model.layout(), 7, 0.3, weights.data());
  model.set_params(weights.data());
  std::vector<float> logits(capacity * V);
  const std::vector<int32_t> whole =
      testing_util::greedy_tokens(prompt, capacity, V, testing_util::whole_context_logits(model, logits, V));
  DecodeGpu decoder(weights_of(model), 1, capacity);
  const std::vector<int32_t> cached =
      testing_util::greedy_tokens(prompt, capacity, V, [&](const std::vector<int32_t>& tokens, int64_t n_new) {
        decoder.append(tokens.data() + tokens.size() - n_new, n_new, logits.data());
        return logits.data();
      });
  EXPECT_EQ(cached, whole);
  EXPECT_GT(std::set<int32_t>(whole.begin() + prompt.size(), whole.end()).size(), 3u) << "a degenerate model";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DecodeGpuParity, testing::Values("llama2_tiny", "llama32_tiny"));

}  // namespace
}  // namespace tuna
#endif  // TUNA_CUDA
