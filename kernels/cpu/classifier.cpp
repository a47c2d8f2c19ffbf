// Softmax cross-entropy over the vocabulary, forward and backward fused, CPU twin of kernels/classifier.cu.
//
//   logits: [n, vocab], targets: [n], losses: [n] (optional)
//   lse_i = max_i + log sum_j exp(logits[i, j] - max_i)        (max-subtracted: no overflow for large logits)
//   losses[i] = lse_i - logits[i, targets[i]]                   OVERWRITTEN; 0 for kIgnoreIndex rows
//   when dloss != 0: logits[i, j] = (exp(logits[i, j] - lse_i) - [j == targets[i]]) * dloss
//                    OVERWRITTEN in place; all zeros for ignored rows. When dloss == 0 logits is untouched.
//   returns sum_i losses[i] over rows that are not ignored, in double, summed in row order.
//
// The vocab-parallel steps (classifier_partial_stats, classifier_rescale_sums, classifier_parallel_fwd_bwd) compute
// the same over a rank's columns, around the two reductions over the ranks that the caller does.
//
// Rows are independent and parallel; the loss total is summed serially from per-row doubles so it does not
// depend on the thread count. Within a row: the max, exp(x - max) in T (exp_lanes: fp32 for the CPU backend,
// within an ulp) summed in double, all vectorized for the CPU's vector units (kernels/cpu/vector_math.h).
#include "kernels/cpu/classifier.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vector_math.h"

namespace tuna::cpu {
namespace {

// One row that is not ignored: returns its loss; with dloss != 0 the row becomes its gradient.
template <typename T>
TUNA_CPU_CLONES double classifier_row(T* row, int64_t vocab, int32_t target, double dloss) {
  T max_logit = row[0];
#pragma omp simd reduction(max : max_logit)
  for (int64_t j = 0; j < vocab; ++j) max_logit = std::max(max_logit, row[j]);
  const double target_logit = row[target];
  double sum_exp = 0.0;
  if (dloss == 0.0) {
#pragma omp simd reduction(+ : sum_exp)
    for (int64_t j = 0; j < vocab; ++j) sum_exp += exp_lanes(static_cast<T>(row[j] - max_logit));
    return max_logit + std::log(sum_exp) - target_logit;
  }
  // One exp per element: exp(x - max) is parked in the row itself and normalized below, instead of being
  // computed a second time.
#pragma omp simd reduction(+ : sum_exp)
  for (int64_t j = 0; j < vocab; ++j) {
    const T e = exp_lanes(static_cast<T>(row[j] - max_logit));
    sum_exp += e;
    row[j] = e;
  }
  const double scale = dloss / sum_exp;
#pragma omp simd
  for (int64_t j = 0; j < vocab; ++j) row[j] = static_cast<T>(row[j] * scale);
  row[target] = static_cast<T>(row[target] - dloss);
  return max_logit + std::log(sum_exp) - target_logit;
}

// Targets come from data files: a bad one is a user error, reported before anything is written.
void check_targets(const int32_t* targets, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i)
    if (targets[i] != kIgnoreIndex && (targets[i] < 0 || targets[i] >= vocab))
      fail("classifier: target of row ", i, " is ", targets[i], ", outside the vocabulary [0, ", vocab,
           ") and not the ignore index ", kIgnoreIndex);
}

}  // namespace

template <typename T>
double classifier_fwd_bwd(T* logits, std::type_identity_t<T>* losses, const int32_t* targets, int64_t n, int64_t vocab,
                          double dloss) {
  TUNA_CHECK(n >= 0 && vocab > 0, "n ", n, ", vocab ", vocab);
  check_targets(targets, n, vocab);

  const bool backward = dloss != 0.0;
  std::vector<double> row_loss(n);
#pragma omp parallel for schedule(static) if (n * vocab >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    T* row = logits + i * vocab;
    const int32_t target = targets[i];
    if (target == kIgnoreIndex) {
      row_loss[i] = 0.0;
      if (backward) std::fill(row, row + vocab, T(0));
      continue;
    }
    row_loss[i] = classifier_row(row, vocab, target, backward ? dloss : 0.0);
  }

  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    total += row_loss[i];
    if (losses != nullptr) losses[i] = static_cast<T>(row_loss[i]);
  }
  return total;
}

template <typename T>
void classifier_weighted_bwd(T* logits, const int32_t* targets, const std::type_identity_t<T>* weights, int64_t n,
                             int64_t vocab) {
  TUNA_CHECK(n >= 0 && vocab > 0, "n ", n, ", vocab ", vocab);
  check_targets(targets, n, vocab);
#pragma omp parallel for schedule(static) if (n * vocab >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    T* row = logits + i * vocab;
    if (targets[i] == kIgnoreIndex || weights[i] == T(0)) {
      std::fill(row, row + vocab, T(0));
      continue;
    }
    classifier_row(row, vocab, targets[i], static_cast<double>(weights[i]));
  }
}

void classifier_target_logps(const float* logits, const int32_t* targets, int64_t n, int64_t vocab, float* logps,
                             uint8_t* greedy) {
  TUNA_CHECK(n >= 0 && vocab > 0, "n ", n, ", vocab ", vocab);
  check_targets(targets, n, vocab);
#pragma omp parallel for schedule(static) if (n * vocab >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] == kIgnoreIndex) {
      logps[i] = 0.0f, greedy[i] = 0;
      continue;
    }
    // dloss 0: the row is read, never written.
    float* row = const_cast<float*>(logits + i * vocab);
    logps[i] = static_cast<float>(-classifier_row(row, vocab, targets[i], 0.0));
    greedy[i] = std::max_element(row, row + vocab) - row == targets[i];  // the first of equal maxima
  }
}

template <typename T>
void classifier_partial_stats(const T* logits, std::type_identity_t<T>* stats, const int32_t* targets, int64_t n,
                              int64_t count, int64_t vocab_begin, int64_t vocab) {
  TUNA_CHECK(n >= 0 && count > 0 && vocab_begin >= 0 && vocab_begin + count <= vocab, "n ", n, ", slice [",
             vocab_begin, ", +", count, ") of ", vocab);
  check_targets(targets, n, vocab);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* row = logits + i * count;
    if (targets[i] == kIgnoreIndex) {
      stats[i] = stats[n + i] = stats[2 * n + i] = T(0);
      continue;
    }
    const double max_logit = *std::max_element(row, row + count);
    double sum_exp = 0.0;
    for (int64_t j = 0; j < count; ++j) sum_exp += std::exp(row[j] - max_logit);
    const int64_t t = targets[i] - vocab_begin;
    stats[i] = static_cast<T>(max_logit);
    stats[n + i] = static_cast<T>(sum_exp);
    stats[2 * n + i] = t >= 0 && t < count ? row[t] : T(0);
  }
}

template <typename T>
void classifier_rescale_sums(T* stats, const std::type_identity_t<T>* global_max, int64_t n) {
  for (int64_t i = 0; i < n; ++i) stats[n + i] = static_cast<T>(stats[n + i] * std::exp(double(stats[i]) - global_max[i]));
}

template <typename T>
double classifier_parallel_fwd_bwd(T* logits, std::type_identity_t<T>* losses, const int32_t* targets,
                                   const std::type_identity_t<T>* global_max,
                                   const std::type_identity_t<T>* sum_and_target, int64_t n, int64_t count,
                                   int64_t vocab_begin, double dloss) {
  TUNA_CHECK(n >= 0 && count > 0, "n ", n, ", count ", count);
  std::vector<double> row_loss(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    T* row = logits + i * count;
    if (targets[i] == kIgnoreIndex) {
      row_loss[i] = 0.0;
      if (dloss != 0.0) std::fill(row, row + count, T(0));
      continue;
    }
    const double lse = global_max[i] + std::log(double(sum_and_target[i]));
    row_loss[i] = lse - sum_and_target[n + i];
    if (dloss == 0.0) continue;
    const int64_t t = targets[i] - vocab_begin;
    for (int64_t j = 0; j < count; ++j)
      row[j] = static_cast<T>((std::exp(row[j] - lse) - (j == t ? 1.0 : 0.0)) * dloss);
  }
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    total += row_loss[i];
    if (losses != nullptr) losses[i] = static_cast<T>(row_loss[i]);
  }
  return total;
}

template <typename T>
void classifier_parallel_weighted_bwd(T* logits, const int32_t* targets, const std::type_identity_t<T>* global_max,
                                      const std::type_identity_t<T>* sum_and_target,
                                      const std::type_identity_t<T>* weights, int64_t n, int64_t count,
                                      int64_t vocab_begin) {
  TUNA_CHECK(n >= 0 && count > 0, "n ", n, ", count ", count);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    T* row = logits + i * count;
    if (targets[i] == kIgnoreIndex || weights[i] == T(0)) {
      std::fill(row, row + count, T(0));
      continue;
    }
    const double lse = global_max[i] + std::log(double(sum_and_target[i]));
    const int64_t t = targets[i] - vocab_begin;
    for (int64_t j = 0; j < count; ++j)
      row[j] = static_cast<T>((std::exp(row[j] - lse) - (j == t ? 1.0 : 0.0)) * double(weights[i]));
  }
}

template double classifier_fwd_bwd<float>(float*, float*, const int32_t*, int64_t, int64_t, double);
template void classifier_parallel_weighted_bwd<float>(float*, const int32_t*, const float*, const float*, const float*,
                                                      int64_t, int64_t, int64_t);
template void classifier_parallel_weighted_bwd<double>(double*, const int32_t*, const double*, const double*,
                                                       const double*, int64_t, int64_t, int64_t);
template void classifier_weighted_bwd<float>(float*, const int32_t*, const float*, int64_t, int64_t);
template void classifier_weighted_bwd<double>(double*, const int32_t*, const double*, int64_t, int64_t);
template void classifier_partial_stats<float>(const float*, float*, const int32_t*, int64_t, int64_t, int64_t, int64_t);
template void classifier_partial_stats<double>(const double*, double*, const int32_t*, int64_t, int64_t, int64_t,
                                               int64_t);
template void classifier_rescale_sums<float>(float*, const float*, int64_t);
template void classifier_rescale_sums<double>(double*, const double*, int64_t);
template double classifier_parallel_fwd_bwd<float>(float*, float*, const int32_t*, const float*, const float*, int64_t,
                                                   int64_t, int64_t, double);
template double classifier_parallel_fwd_bwd<double>(double*, double*, const int32_t*, const double*, const double*,
                                                    int64_t, int64_t, int64_t, double);
template double classifier_fwd_bwd<double>(double*, double*, const int32_t*, int64_t, int64_t, double);

}  // namespace tuna::cpu
