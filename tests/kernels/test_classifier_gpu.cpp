// kernels/classifier.cu against kernels/cpu/classifier.cpp: losses (fp32) and dlogits (bf16, in place), with
// ignored rows, on a vocabulary that takes the vector path and one that does not (odd size).
#if TUNA_CUDA
#include "kernels/classifier.cuh"
#include "kernels/cpu/classifier.h"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

TEST(ClassifierGpu, LossAndGradientInPlace) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  // LLaMA-3's 128256 is wider than the shared memory a block may keep (pass 2 reads its tail from global
  // memory): a few rows, with targets in the kept head and in the tail.
  for (int64_t vocab : {int64_t(4096), int64_t(1003), int64_t(128256)}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const bool wide = vocab > 100000;
    const int64_t n = wide ? 3 + rng.integer(0, 2) : 37 + rng.integer(0, 20);
    std::vector<float> logits = random_bf16_values(rng, n * vocab, -8, 8);
    std::vector<int32_t> targets(n);
    for (auto& t : targets) t = rng.integer(0, 4) == 0 ? cpu::kIgnoreIndex : static_cast<int32_t>(rng.integer(0, vocab - 1));
    if (wide)
      targets[0] = static_cast<int32_t>(vocab - 1 - rng.integer(0, 100)), targets[1] = rng.integer(0, 1000);
    const double dloss = 0.37;
    DeviceBf16 d_logits(logits);
    DeviceBuffer<int32_t> d_targets(targets);
    DeviceBuffer<float> d_losses(n);
    DeviceBuffer<double> d_total(1);
    d_losses.poison();
    cuda::classifier_fwd_bwd(d_logits.bf(), d_losses.get(), d_targets.get(), n, vocab, static_cast<float>(dloss), nullptr);
    cuda::loss_sum(d_total.get(), d_losses.get(), n, nullptr);
    std::vector<double> ref(logits.begin(), logits.end()), ref_losses(n);
    const double ref_total = cpu::classifier_fwd_bwd(ref.data(), ref_losses.data(), targets.data(), n, vocab, dloss);
    std::vector<double> naive(n * vocab);
    for (int64_t i = 0; i < n * vocab; ++i) naive[i] = round_bf16(ref[i]);
    expect_close_to_naive("classifier dlogits", d_logits.values(), naive, ref);
    expect_close_to_naive("classifier losses (fp32)", d_losses.download(), ref_losses, ref_losses);
    EXPECT_NEAR(d_total.download()[0], ref_total, 1e-5 * std::abs(ref_total));

    // The same inputs again: bit for bit the same gradient and losses.
    const std::vector<float> first_losses = d_losses.download();
    DeviceBf16 d_again(logits);
    cuda::classifier_fwd_bwd(d_again.bf(), d_losses.get(), d_targets.get(), n, vocab, static_cast<float>(dloss), nullptr);
    EXPECT_TRUE(bitwise_equal(d_again.download(), d_logits.download())) << "the gradient is not deterministic";
    EXPECT_TRUE(bitwise_equal(d_losses.download(), first_losses)) << "the losses are not deterministic";

    // dloss = 0: losses only (the same ones: one code path for them), logits untouched.
    DeviceBf16 d_keep(logits);
    cuda::classifier_fwd_bwd(d_keep.bf(), d_losses.get(), d_targets.get(), n, vocab, 0.0f, nullptr);
    EXPECT_TRUE(bitwise_equal(d_keep.download(), to_bf16_bits(logits)));
    EXPECT_TRUE(bitwise_equal(d_losses.download(), first_losses));
  }
}

// The weighted backward of a preference objective against its CPU twin (kernels/cpu/classifier.h
// classifier_weighted_bwd, in double): each row's own weight (some 0, some negative), ignored rows, the vector path,
// an odd vocabulary and a row wider than the shared memory a block keeps; deterministic.
TEST(ClassifierGpu, WeightedBackwardFollowsTheCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (int64_t vocab : {int64_t(4096), int64_t(1003), int64_t(128256)}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const bool wide = vocab > 100000;
    const int64_t n = wide ? 3 + rng.integer(0, 2) : 29 + rng.integer(0, 20);
    std::vector<float> logits = random_bf16_values(rng, n * vocab, -8, 8);
    std::vector<int32_t> targets(n);
    std::vector<float> weights(n);
    for (int64_t i = 0; i < n; ++i) {
      targets[i] = rng.integer(0, 5) == 0 ? cpu::kIgnoreIndex : static_cast<int32_t>(rng.integer(0, vocab - 1));
      weights[i] = rng.integer(0, 4) == 0 ? 0.0f : static_cast<float>(rng.integer(-300, 300)) / 100.0f;
    }
    if (wide) targets[0] = static_cast<int32_t>(vocab - 1 - rng.integer(0, 100)), weights[0] = 0.75f;
    DeviceBf16 d_logits(logits);
    DeviceBuffer<int32_t> d_targets(targets);
    DeviceBuffer<float> d_weights(weights);
    cuda::classifier_weighted_bwd(d_logits.bf(), d_targets.get(), d_weights.get(), n, vocab, nullptr);
    std::vector<double> ref(logits.begin(), logits.end()), ref_weights(weights.begin(), weights.end());
    cpu::classifier_weighted_bwd(ref.data(), targets.data(), ref_weights.data(), n, vocab);
    std::vector<double> naive(n * vocab);
    for (int64_t i = 0; i < n * vocab; ++i) naive[i] = round_bf16(ref[i]);
    expect_close_to_naive("weighted dlogits", d_logits.values(), naive, ref);
    // Rows of weight 0 and ignored rows are exactly zero, as the twin's.
    const std::vector<double> got = d_logits.values();
    for (int64_t i = 0; i < n; ++i) {
      if (targets[i] != cpu::kIgnoreIndex && weights[i] != 0.0f) continue;
      for (int64_t j = 0; j < vocab; ++j) ASSERT_EQ(got[i * vocab + j], 0.0) << "row " << i;
    }
    DeviceBf16 d_again(logits);
    cuda::classifier_weighted_bwd(d_again.bf(), d_targets.get(), d_weights.get(), n, vocab, nullptr);
    EXPECT_TRUE(bitwise_equal(d_again.download(), d_logits.download())) << "the gradient is not deterministic";
  }
}

// Vocab-parallel: the rows split over 2 or 3 "ranks" by columns, the two reductions done here on the host as the
// tensor-parallel comm does them; the concatenated gradients and every rank's losses must be those of the whole
// row (cpu::classifier_fwd_bwd in double), within the tolerances above. Weighted (the preference objectives' step 3,
// classifier_parallel_weighted_bwd): the gradient of cpu::classifier_weighted_bwd on the whole rows, each row its own
// weight (one 0, one negative).
TEST(ClassifierGpu, VocabParallelStepsGiveTheWholeRowsLossAndGradient) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  for (const bool weighted : {false, true})
  for (int64_t vocab : {int64_t(4096), int64_t(1003)}) {
    SCOPED_TRACE(weighted ? "weighted" : "dloss");
    const int ranks = vocab == 4096 ? 2 : 3;
    SCOPED_TRACE("vocab " + std::to_string(vocab) + " over " + std::to_string(ranks));
    const int64_t n = 29 + rng.integer(0, 20);
    std::vector<float> logits = random_bf16_values(rng, n * vocab, -8, 8);
    std::vector<int32_t> targets(n);
    for (auto& t : targets) t = rng.integer(0, 4) == 0 ? cpu::kIgnoreIndex : static_cast<int32_t>(rng.integer(0, vocab - 1));
    DeviceBuffer<int32_t> d_targets(targets);
    const double dloss = 0.37;
    std::vector<float> weights(n);
    for (auto& w : weights) w = static_cast<float>(rng.integer(10, 200)) / 100.0f;
    weights[1] = 0.0f, weights[2] = -0.6f;
    DeviceBuffer<float> d_weights(weights);
    struct Slice {
      int64_t begin, count;
      std::unique_ptr<DeviceBf16> logits;
      std::unique_ptr<DeviceBuffer<float>> stats;
    };
    std::vector<Slice> slices;
    std::vector<float> global_max(n, -INFINITY);
    for (int r = 0; r < ranks; r++) {
      const int64_t begin = vocab * r / ranks, count = vocab * (r + 1) / ranks - begin;
      std::vector<float> part(n * count);
      for (int64_t i = 0; i < n; i++) std::copy_n(logits.begin() + i * vocab + begin, count, part.begin() + i * count);
      Slice s{begin, count, std::make_unique<DeviceBf16>(part), std::make_unique<DeviceBuffer<float>>(3 * n)};
      s.stats->poison();
      cuda::classifier_partial_stats(s.logits->bf(), s.stats->get(), d_targets.get(), n, count, begin, vocab, nullptr);
      const std::vector<float> stats = s.stats->download();
      for (int64_t i = 0; i < n; i++) global_max[i] = std::max(global_max[i], stats[i]);
      slices.push_back(std::move(s));
    }
    DeviceBuffer<float> d_max(global_max);
    std::vector<float> sum_and_target(2 * n, 0.0f);
    for (Slice& s : slices) {
      cuda::classifier_rescale_sums(s.stats->get(), d_max.get(), n, nullptr);
      const std::vector<float> stats = s.stats->download();
      for (int64_t i = 0; i < 2 * n; i++) sum_and_target[i] += stats[n + i];
    }
    DeviceBuffer<float> d_sum(sum_and_target), d_losses(n);
    std::vector<double> dlogits(n * vocab);
    for (Slice& s : slices) {
      if (weighted) {
        cuda::classifier_parallel_weighted_bwd(s.logits->bf(), d_targets.get(), d_max.get(), d_sum.get(),
                                               d_weights.get(), n, s.count, s.begin, nullptr);
      } else {
        d_losses.poison();
        cuda::classifier_parallel_fwd_bwd(s.logits->bf(), d_losses.get(), d_targets.get(), d_max.get(), d_sum.get(),
                                          n, s.count, s.begin, static_cast<float>(dloss), nullptr);
        std::vector<double> ref(logits.begin(), logits.end()), ref_losses(n);
        cpu::classifier_fwd_bwd(ref.data(), ref_losses.data(), targets.data(), n, vocab, dloss);
        expect_close_to_naive("parallel classifier losses (fp32)", d_losses.download(), ref_losses, ref_losses);
      }
      const std::vector<double> part = s.logits->values();
      for (int64_t i = 0; i < n; i++) std::copy_n(part.begin() + i * s.count, s.count, dlogits.begin() + i * vocab + s.begin);
    }
    std::vector<double> ref(logits.begin(), logits.end()), ref_losses(n);
    if (weighted) {
      const std::vector<double> ref_weights(weights.begin(), weights.end());
      cpu::classifier_weighted_bwd(ref.data(), targets.data(), ref_weights.data(), n, vocab);
    } else {
      cpu::classifier_fwd_bwd(ref.data(), ref_losses.data(), targets.data(), n, vocab, dloss);
    }
    std::vector<double> naive(n * vocab);
    for (int64_t i = 0; i < n * vocab; ++i) naive[i] = round_bf16(ref[i]);
    expect_close_to_naive("parallel classifier dlogits", dlogits, naive, ref);
  }
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
