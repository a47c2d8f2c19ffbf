// kernels/int8_rowwise.cu against kernels/cpu/int8_rowwise.cpp on fresh random weights, bit for bit: a layer's
// seven projections in one launch, widths on the 16-element vector path and off it (odd, not a multiple of 16, an
// output off 16-byte alignment), a row of zeros, and nothing written past each tensor's end.
#if TUNA_CUDA
#include "kernels/cpu/int8_rowwise.h"
#include "kernels/int8_rowwise.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

TEST(Int8RowwiseGpu, DequantizeEqualsCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  struct Shape {
    int64_t rows, cols, at;  // at: element offset of the output in its buffer
  };
  const std::vector<Shape> shapes = {{rng.integer(40, 90), 16 * rng.integer(20, 40), 0}, {64, 256, 0},
                                     {17, 2 * rng.integer(30, 90) + 1, 0}, {9, 16 * 5 + 8, 0}, {3, 5, 0},
                                     {12, 128, 3}, {1, 16, 0}};
  constexpr int64_t kGuard = 24;
  std::vector<std::vector<int8_t>> q;
  std::vector<std::vector<float>> scale;
  std::vector<std::unique_ptr<DeviceBuffer<int8_t>>> d_q;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> d_scale;
  std::vector<std::unique_ptr<DeviceBf16>> out;
  std::vector<cuda::Int8Dequant> batch;
  for (const Shape& s : shapes) {
    std::vector<float> w(s.rows * s.cols);
    for (int64_t r = 0; r < s.rows; ++r) {
      const double scale_r = std::exp(rng.uniform(-6, 1));
      for (int64_t c = 0; c < s.cols; ++c) w[r * s.cols + c] = r == 1 ? 0.0f : static_cast<float>(scale_r * rng.uniform(-1, 1));
    }
    q.emplace_back(w.size()), scale.emplace_back(s.rows);
    cpu::int8_rowwise_quantize(w.data(), s.rows, s.cols, q.back().data(), scale.back().data(), "w");
    d_q.push_back(std::make_unique<DeviceBuffer<int8_t>>(q.back()));
    d_scale.push_back(std::make_unique<DeviceBuffer<float>>(scale.back()));
    out.push_back(std::make_unique<DeviceBf16>(static_cast<size_t>(s.at + s.rows * s.cols + kGuard)));
    out.back()->poison();
    batch.push_back({out.back()->bf() + s.at, d_q.back()->get(), d_scale.back()->get(), s.rows, s.cols});
  }
  cuda::int8_rowwise_dequantize(batch.data(), static_cast<int>(batch.size()), nullptr);
  for (size_t t = 0; t < shapes.size(); ++t) {
    const Shape s = shapes[t];
    const int64_t n = s.rows * s.cols;
    SCOPED_TRACE("tensor " + std::to_string(t) + ": " + std::to_string(s.rows) + " x " + std::to_string(s.cols));
    std::vector<uint16_t> expected(n);
    cpu::int8_rowwise_dequantize(q[t].data(), scale[t].data(), s.rows, s.cols, expected.data());
    const std::vector<uint16_t> got = out[t]->download();
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i) mismatches += got[s.at + i] != expected[i];
    EXPECT_EQ(mismatches, 0);
    for (int64_t i = 0; i < s.at; ++i) EXPECT_EQ(got[i], 0xffff) << "written before the output, element " << i;
    for (int64_t i = s.at + n; i < s.at + n + kGuard; ++i) EXPECT_EQ(got[i], 0xffff) << "written past the end, " << i;
  }
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
