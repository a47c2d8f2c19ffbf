// Shared helpers of the kernel tests: a seeded random source that says how to replay a failure, random
// fills, relative error norms, central finite differences and thread-count control for determinism checks.
#pragma once

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace tuna::test {

// Every test draws fresh inputs. The seed comes from TUNA_TEST_SEED when set (to replay a failure), else
// from std::random_device; put SCOPED_TRACE(rng.describe()) in the test so a failure prints it.
class TestRng {
 public:
  TestRng() : seed_(pick_seed()), engine_(seed_) {}

  std::string describe() const {
    return "random seed " + std::to_string(seed_) + " (replay with TUNA_TEST_SEED=" + std::to_string(seed_) + ")";
  }

  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(engine_); }
  int64_t integer(int64_t lo, int64_t hi) {  // inclusive bounds
    return std::uniform_int_distribution<int64_t>(lo, hi)(engine_);
  }

  template <typename T>
  std::vector<T> vector(size_t n, double lo = -1.0, double hi = 1.0) {
    std::vector<T> values(n);
    for (T& value : values) value = static_cast<T>(uniform(lo, hi));
    return values;
  }

 private:
  static uint64_t pick_seed() {
    if (const char* env = std::getenv("TUNA_TEST_SEED")) return std::strtoull(env, nullptr, 10);
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }

  uint64_t seed_;
  std::mt19937_64 engine_;
};

// ||actual - expected|| / ||expected|| in double (plain ||actual - expected|| when expected is all zeros).
template <typename A, typename B>
double rel_error_norm(const std::vector<A>& actual, const std::vector<B>& expected) {
  double diff_sq = 0.0, ref_sq = 0.0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) {
    const double diff = static_cast<double>(actual[i]) - static_cast<double>(expected[i]);
    diff_sq += diff * diff;
    ref_sq += static_cast<double>(expected[i]) * static_cast<double>(expected[i]);
  }
  if (actual.size() != expected.size()) return INFINITY;
  return ref_sq > 0.0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(diff_sq);
}

template <typename T>
std::vector<double> to_double(const std::vector<T>& values) {
  return std::vector<double>(values.begin(), values.end());
}

inline float round_bf16(double x) { return bf16_to_f32(f32_to_bf16(static_cast<float>(x))); }

// Random values already representable in bf16 (so CPU and GPU read the same numbers).
inline std::vector<float> random_bf16_values(TestRng& rng, size_t n, double lo = -1.0, double hi = 1.0) {
  std::vector<float> v(n);
  for (float& x : v) x = round_bf16(rng.uniform(lo, hi));
  return v;
}

// Runs fn with OpenMP limited to n_threads, then restores the previous limit.
template <typename Fn>
void with_omp_threads(int n_threads, Fn&& fn) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(n_threads);
  fn();
  omp_set_num_threads(saved);
}

// The scalar test objective L = sum_i out[i] * weights[i]; its gradient with respect to out is weights.
inline double weighted_sum(const std::vector<double>& out, const std::vector<double>& weights) {
  double sum = 0.0;
  for (size_t i = 0; i < out.size(); ++i) sum += out[i] * weights[i];
  return sum;
}

// Central differences dL/dx[i] ~ (L(x + h e_i) - L(x - h e_i)) / 2h for every element of x; x is perturbed
// in place and restored, and `objective` reads it. With O(1) values in double, h = 1e-5 balances
// truncation (~h^2 = 1e-10) against cancellation (~1e-16 / h = 1e-11): a correct gradient then matches to
// a relative error norm of about 1e-9, while a wrong term shows up at 1e-3 or worse.
// The objective runs single-threaded: thousands of tiny calls would otherwise mostly time OpenMP barriers.
inline std::vector<double> numeric_gradient(std::vector<double>& x, const std::function<double()>& objective,
                                            double h = 1e-5) {
  std::vector<double> gradient(x.size());
  with_omp_threads(1, [&] {
    for (size_t i = 0; i < x.size(); ++i) {
      const double saved = x[i];
      x[i] = saved + h;
      const double plus = objective();
      x[i] = saved - h;
      const double minus = objective();
      x[i] = saved;
      gradient[i] = (plus - minus) / (2.0 * h);
    }
  });
  return gradient;
}

// Relative error norm that a correct backward reaches against numeric_gradient; see the h comment above.
constexpr double kFiniteDifferenceTolerance = 1e-6;

template <typename T>
std::vector<T> nan_filled(size_t n) {
  return std::vector<T>(n, static_cast<T>(NAN));
}

template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename T>
bool all_finite(const std::vector<T>& values) {
  for (T value : values)
    if (!std::isfinite(value)) return false;
  return true;
}

// The thread counts a determinism test compares: serial, the machine's count, and an odd count that splits
// work unevenly (oversubscription is fine for a test).
inline std::vector<int> determinism_thread_counts() { return {1, 2, 3, 7}; }

}  // namespace tuna::test
