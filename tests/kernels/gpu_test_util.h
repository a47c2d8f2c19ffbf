// Helpers of the GPU op tests (compiled only with TUNA_CUDA): device buffers, bf16 round trips, the skip when
// no device is visible, and the tolerance rule every bf16 check uses.
//
// Tolerance rule (docs/architecture.md, Numbers): each GPU result is compared with the CPU twin run in double on
// the very bf16 values the GPU read (`ref`). Alongside, the test computes a naive same-precision version on the host
// (`naive`: fp32 math, rounded to bf16 exactly where the GPU kernel stores or feeds bf16). The GPU passes when
//   err(gpu, ref) <= 2 * err(naive, ref) + floor,
// err being the relative error norm: the GPU may differ from naive bf16 arithmetic only by summation order and
// fp32 rounding, which cannot double the error that bf16 storage already causes; a wrong index, sign or
// scale is O(1) and fails by orders of magnitude. fp32 outputs use the floor of 1e-5 of that rule.
#pragma once

#if TUNA_CUDA

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "tests/kernels/op_test_util.h"

namespace tuna::test {

inline bool gpu_visible() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define TUNA_REQUIRE_GPU()                                                     \
  do {                                                                         \
    if (!::tuna::test::gpu_visible()) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

// A device array of T, freed on scope exit.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    TUNA_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), std::max<size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    TUNA_CHECK(host.size() == n_, "upload of ", host.size(), " into ", n_);
    TUNA_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    TUNA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> host(n_);
    TUNA_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // Every byte 0xff: NaN in bf16 and fp32, so an element the kernel fails to write shows up as NaN.
  void poison() { TUNA_CUDA_CHECK(cudaMemset(ptr_, 0xff, n_ * sizeof(T))); }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

inline std::vector<uint16_t> to_bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = f32_to_bf16(v[i]);
  return bits;
}

inline std::vector<double> bf16_bits_to_double(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_to_f32(bits[i]);
  return v;
}

// A bf16 tensor on the device from fp32 host values (which should be bf16-exact).
struct DeviceBf16 : DeviceBuffer<uint16_t> {
  explicit DeviceBf16(size_t n) : DeviceBuffer<uint16_t>(n) {}
  explicit DeviceBf16(const std::vector<float>& v) : DeviceBuffer<uint16_t>(to_bf16_bits(v)) {}
  __nv_bfloat16* bf() const { return reinterpret_cast<__nv_bfloat16*>(get()); }
  std::vector<double> values() const { return bf16_bits_to_double(download()); }
};

template <typename T>
bool all_finite_values(const std::vector<T>& v) {
  for (const T& x : v)
    if (!std::isfinite(static_cast<double>(x))) return false;
  return true;
}

// An FP8 product with fp32 output (the weight gradient) against the twin's fp32 sums of the exact products. The
// emulator's double sums in fp32 as the twin: 1e-5. Hopper's FP8 tensor cores keep about 14 bits of each partial sum
// between cuBLASLt's promotions to fp32 (the DeepSeek-V3 report measured it on the H800), so a sum of K products
// carries a relative error of order 2^-14 = 6.1e-5; measured on an H200 (cuBLASLt 13.1, K 64-192): 3.6e-5 to 8.1e-5.
// The bound is 2^-12, four times that order.
#ifdef TUNA_EMULATOR
constexpr double kFp8Fp32OutputBound = 1e-5;
#else
constexpr double kFp8Fp32OutputBound = 0x1p-12;
#endif

// The tolerance rule above, with both errors printed (gpu-check.sh's logs keep them).
template <typename G, typename N>
void expect_close_to_naive(const std::string& what, const std::vector<G>& gpu, const std::vector<N>& naive,
                           const std::vector<double>& ref, double floor = 1e-5) {
  ASSERT_TRUE(all_finite_values(gpu)) << what << ": non-finite value (unwritten output or overflow)";
  std::vector<double> g(gpu.begin(), gpu.end()), nv(naive.begin(), naive.end());
  const double err_gpu = rel_error_norm(g, ref), err_naive = rel_error_norm(nv, ref);
  std::printf("  %-28s gpu err %.3e   naive bf16 err %.3e   bound %.3e\n", what.c_str(), err_gpu, err_naive,
              2 * err_naive + floor);
  EXPECT_LE(err_gpu, 2 * err_naive + floor) << what;
}

}  // namespace tuna::test

#endif  // TUNA_CUDA
