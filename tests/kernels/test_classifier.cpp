// kernels/cpu/classifier: cross-entropy forward against a float64 loop (including huge logits), fused
// gradient against finite differences, ignored rows, dloss == 0, bad targets.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "kernels/cpu/classifier.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

std::vector<int32_t> random_targets(TestRng& rng, int64_t n, int64_t vocab, int64_t n_ignored) {
  std::vector<int32_t> targets(n);
  for (int32_t& target : targets) target = static_cast<int32_t>(rng.integer(0, vocab - 1));
  for (int64_t i = 0; i < n_ignored; ++i) targets[rng.integer(0, n - 1)] = kIgnoreIndex;
  return targets;
}

// Per-row cross-entropy by the textbook formula, with the max subtracted so that it survives huge logits.
std::vector<double> naive_losses(const std::vector<double>& logits, const std::vector<int32_t>& targets,
                                 int64_t n, int64_t vocab) {
  std::vector<double> losses(n, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] == kIgnoreIndex) continue;
    const double* row = &logits[i * vocab];
    double max_logit = row[0];
    for (int64_t j = 0; j < vocab; ++j) max_logit = std::max(max_logit, row[j]);
    double sum = 0.0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(row[j] - max_logit);
    losses[i] = max_logit + std::log(sum) - row[targets[i]];
  }
  return losses;
}

// The kernel works in double from the same inputs as the loop, so a float loss differs only by its final
// fp32 rounding (~6e-8). With huge logits the loss (~5) is a difference of two numbers near 1000, which
// amplifies double rounding ~200x: still far below the 1e-12 used there for double.
template <typename T>
void check_forward(TestRng& rng, double offset, double tolerance) {
  const int64_t n = 13, vocab = 101;
  const std::vector<int32_t> targets = random_targets(rng, n, vocab, 3);
  std::vector<T> logits = rng.vector<T>(n * vocab, offset - 8.0, offset + 8.0);
  std::vector<T> losses = test::nan_filled<T>(n);
  const std::vector<T> logits_before = logits;
  const double total = classifier_fwd_bwd(logits.data(), losses.data(), targets.data(), n, vocab, 0.0);

  const std::vector<double> expected = naive_losses(test::to_double(logits_before), targets, n, vocab);
  double expected_total = 0.0;
  for (double loss : expected) expected_total += loss;
  EXPECT_LT(test::rel_error_norm(losses, expected), tolerance);
  EXPECT_NEAR(total, expected_total, tolerance * std::abs(expected_total));
  EXPECT_TRUE(test::bitwise_equal(logits, logits_before)) << "dloss == 0 must leave the logits alone";
}

TEST(ClassifierTest, LossesMatchFloat64Loop) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_forward<float>(rng, 0.0, 1e-6);
  check_forward<double>(rng, 0.0, 1e-13);
}

TEST(ClassifierTest, LossesStayFiniteForHugeLogits) {
  // exp(1000) overflows even in double: only the max-subtracted form gives a finite loss.
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check_forward<float>(rng, 1000.0, 1e-6);
  check_forward<double>(rng, 1000.0, 1e-12);
}

TEST(ClassifierTest, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 7, vocab = 37;
  const double dloss = 0.37;  // d(objective)/d(loss sum), as a mean-reduction scale would be
  const std::vector<int32_t> targets = random_targets(rng, n, vocab, 2);
  std::vector<double> logits = rng.vector<double>(n * vocab, -3.0, 3.0);
  auto objective = [&] {
    std::vector<double> copy = logits;
    return dloss * classifier_fwd_bwd<double>(copy.data(), nullptr, targets.data(), n, vocab, 0.0);
  };
  std::vector<double> gradient = logits;
  classifier_fwd_bwd<double>(gradient.data(), nullptr, targets.data(), n, vocab, dloss);
  EXPECT_LT(test::rel_error_norm(gradient, test::numeric_gradient(logits, objective)),
            test::kFiniteDifferenceTolerance);
}

TEST(ClassifierTest, IgnoredRowsHaveZeroLossAndZeroGradient) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 13, vocab = 37;
  std::vector<int32_t> targets = random_targets(rng, n, vocab, 0);
  targets[0] = targets[5] = targets[12] = kIgnoreIndex;
  const std::vector<float> logits_before = rng.vector<float>(n * vocab, -3.0, 3.0);
  std::vector<float> logits = logits_before, losses = test::nan_filled<float>(n);
  const double total = classifier_fwd_bwd(logits.data(), losses.data(), targets.data(), n, vocab, 1.0);

  double kept_total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double row_grad_sum = 0.0;
    for (int64_t j = 0; j < vocab; ++j) row_grad_sum += logits[i * vocab + j];
    if (targets[i] == kIgnoreIndex) {
      EXPECT_EQ(losses[i], 0.0f) << "row " << i;
      for (int64_t j = 0; j < vocab; ++j) ASSERT_EQ(logits[i * vocab + j], 0.0f) << "row " << i;
    } else {
      kept_total += losses[i];
      EXPECT_GT(losses[i], 0.0f) << "row " << i;
      EXPECT_NEAR(row_grad_sum, 0.0, 1e-6) << "softmax - onehot sums to 0, row " << i;
    }
  }
  EXPECT_NEAR(total, kept_total, 1e-5);
  // Every row ignored: nothing to learn from, total 0.
  std::vector<int32_t> all_ignored(n, kIgnoreIndex);
  std::vector<float> logits_all = logits_before;
  EXPECT_EQ(classifier_fwd_bwd<float>(logits_all.data(), nullptr, all_ignored.data(), n, vocab, 1.0), 0.0);
}

TEST(ClassifierTest, BadTargetIsAnErrorNamingRowAndValue) {
  const int64_t n = 4, vocab = 37;
  for (int32_t bad : {37, -1, -99, 1000000}) {
    const std::vector<int32_t> targets = {0, kIgnoreIndex, bad, 3};
    std::vector<float> logits(n * vocab, 0.5f);
    try {
      classifier_fwd_bwd<float>(logits.data(), nullptr, targets.data(), n, vocab, 1.0);
      ADD_FAILURE() << "target " << bad << ": expected tuna::Error";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("row 2"), std::string::npos) << message;
      EXPECT_NE(message.find(std::to_string(bad)), std::string::npos) << message;
    }
    EXPECT_TRUE(test::bitwise_equal(logits, std::vector<float>(n * vocab, 0.5f))) << "nothing is written first";
  }
}

// The logits' vocabulary split over three ranks at `splits`, after the vocab-parallel steps 1 (each rank's partial
// stats, the rows' global max) and 2 (the sums rescaled to it and summed over the ranks), as the tp all-reduces do.
struct VocabSplit {
  std::vector<std::vector<double>> parts;           // each rank's columns [n, count]
  std::vector<double> global_max, sum_and_target;  // [n], [2 n]
};
VocabSplit split_vocab(const std::vector<double>& logits, const std::vector<int32_t>& targets, int64_t n, int64_t vocab,
                       const int64_t (&splits)[4]) {
  VocabSplit v;
  v.parts.resize(3);
  std::vector<std::vector<double>> stats(3, std::vector<double>(3 * n));
  v.global_max.assign(n, -INFINITY), v.sum_and_target.assign(2 * n, 0.0);
  for (int r = 0; r < 3; r++) {
    const int64_t begin = splits[r], count = splits[r + 1] - begin;
    for (int64_t i = 0; i < n; i++)
      v.parts[r].insert(v.parts[r].end(), logits.begin() + i * vocab + begin, logits.begin() + i * vocab + begin + count);
    classifier_partial_stats(v.parts[r].data(), stats[r].data(), targets.data(), n, count, begin, vocab);
    for (int64_t i = 0; i < n; i++) v.global_max[i] = std::max(v.global_max[i], stats[r][i]);
  }
  for (int r = 0; r < 3; r++) {
    classifier_rescale_sums(stats[r].data(), v.global_max.data(), n);
    for (int64_t i = 0; i < 2 * n; i++) v.sum_and_target[i] += stats[r][n + i];
  }
  return v;
}

}  // namespace

// The three vocab-parallel steps over a split of the columns, with the reductions done here, give the whole
// row's loss and gradient (up to the float rounding of the statistics).
TEST(ClassifierTest, VocabParallelStepsEqualTheWholeRow) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 9, vocab = 23;
  std::vector<double> logits = rng.vector<double>(n * vocab, -5.0, 5.0);
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = i == 3 ? kIgnoreIndex : static_cast<int32_t>(rng.integer(0, vocab - 1));
  std::vector<double> whole = logits, whole_losses(n);
  const double whole_total = classifier_fwd_bwd(whole.data(), whole_losses.data(), targets.data(), n, vocab, 0.5);
  const int64_t splits[] = {0, 8, 15, 23};
  VocabSplit v = split_vocab(logits, targets, n, vocab, splits);
  for (int r = 0; r < 3; r++) {
    const int64_t begin = splits[r], count = splits[r + 1] - begin;
    std::vector<double> losses(n);
    const double total = classifier_parallel_fwd_bwd(v.parts[r].data(), losses.data(), targets.data(),
                                                     v.global_max.data(), v.sum_and_target.data(), n, count, begin, 0.5);
    EXPECT_NEAR(total, whole_total, 1e-12 * std::abs(whole_total));
    for (int64_t i = 0; i < n; i++) {
      EXPECT_NEAR(losses[i], whole_losses[i], 1e-12) << i;
      for (int64_t j = 0; j < count; j++)
        EXPECT_NEAR(v.parts[r][i * count + j], whole[i * vocab + begin + j], 1e-12) << i << ", " << begin + j;
    }
  }
}

// The weighted backward's vocab-parallel step 3 over the same split (after steps 1 and 2): each rank's columns of the
// whole rows' weighted gradient (classifier_weighted_bwd), with a row of weight 0, a negative weight and an ignored row.
TEST(ClassifierTest, VocabParallelWeightedBackwardEqualsTheWholeRow) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 9, vocab = 23;
  std::vector<double> logits = rng.vector<double>(n * vocab, -5.0, 5.0), weights = rng.vector<double>(n, 0.1, 2.0);
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = i == 3 ? kIgnoreIndex : static_cast<int32_t>(rng.integer(0, vocab - 1));
  weights[5] = 0.0, weights[7] = -0.8;
  std::vector<double> whole = logits;
  classifier_weighted_bwd(whole.data(), targets.data(), weights.data(), n, vocab);
  const int64_t splits[] = {0, 8, 15, 23};
  VocabSplit v = split_vocab(logits, targets, n, vocab, splits);
  for (int r = 0; r < 3; r++) {
    const int64_t begin = splits[r], count = splits[r + 1] - begin;
    classifier_parallel_weighted_bwd(v.parts[r].data(), targets.data(), v.global_max.data(), v.sum_and_target.data(),
                                     weights.data(), n, count, begin);
    for (int64_t i = 0; i < n; i++)
      for (int64_t j = 0; j < count; j++)
        EXPECT_NEAR(v.parts[r][i * count + j], whole[i * vocab + begin + j], 1e-12) << i << ", " << begin + j;
  }
}

// Multiple-choice scoring's head: each target's log-prob against the float64 loop, and the greedy flag against the
// first argmax, with ties planted (a tie before the target makes it not greedy; one after it keeps it greedy).
TEST(Classifier, TargetLogpsAndFirstArgmax) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 37, vocab = 301;
  std::vector<float> logits = rng.vector<float>(n * vocab, -4.0, 4.0);
  std::vector<int32_t> targets = random_targets(rng, n, vocab, 5);
  for (int64_t i = 0; i < n; i += 3) {  // every third row: the target is a maximum
    if (targets[i] == kIgnoreIndex) continue;
    float* row = &logits[i * vocab];
    const float top = *std::max_element(row, row + vocab) + 1.0f;
    row[targets[i]] = top;
    if (i % 2 == 0 && targets[i] > 0) row[targets[i] - 1] = top;          // an equal maximum before it: not greedy
    if (i % 2 == 1 && targets[i] + 1 < vocab) row[targets[i] + 1] = top;  // after it: still greedy
  }
  const std::vector<float> before = logits;
  std::vector<float> logps(n, 7.0f);
  std::vector<uint8_t> greedy(n, 7);
  classifier_target_logps(logits.data(), targets.data(), n, vocab, logps.data(), greedy.data());
  EXPECT_EQ(logits, before);
  const std::vector<double> losses = naive_losses(std::vector<double>(logits.begin(), logits.end()), targets, n, vocab);
  int greedy_rows = 0;
  for (int64_t i = 0; i < n; i++) {
    if (targets[i] == kIgnoreIndex) {
      EXPECT_EQ(logps[i], 0.0f) << i;
      EXPECT_EQ(greedy[i], 0) << i;
      continue;
    }
    EXPECT_NEAR(logps[i], -losses[i], 1e-6 * std::max(1.0, losses[i])) << i;
    const float* row = &logits[i * vocab];
    int64_t first = 0;
    for (int64_t j = 1; j < vocab; j++)
      if (row[j] > row[first]) first = j;
    EXPECT_EQ(greedy[i], first == targets[i] ? 1 : 0) << i;
    greedy_rows += greedy[i];
  }
  EXPECT_GT(greedy_rows, 3);  // the planted maxima are seen
  std::vector<int32_t> bad = targets;
  bad[2] = static_cast<int32_t>(vocab);
  EXPECT_THROW(classifier_target_logps(logits.data(), bad.data(), n, vocab, logps.data(), greedy.data()), Error);
}

}  // namespace tuna::cpu
