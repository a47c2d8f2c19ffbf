// kernels/nf4.cu against kernels/cpu/nf4.cpp on fresh random weights, bit for bit (both round each product and
// the absmax's sum on their own, then to bf16 to nearest even): a layer's seven projections in one launch, with
// sizes on the 16-element vector path and off it (odd counts, a count not a multiple of 16, an output off
// 16-byte alignment), more than 256 blocks so that the second-level absmax changes inside a tensor, a block of
// zeros, and nothing written past each tensor's end.
#if TUNA_CUDA
#include "kernels/cpu/nf4.h"
#include "kernels/nf4.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

struct HostNf4 {
  std::vector<uint8_t> packed, qabsmax;
  std::vector<float> absmax2;
  float offset = 0;
  cpu::Nf4Tensor view(int64_t n) const { return {n, packed.data(), qabsmax.data(), absmax2.data(), offset}; }
};

HostNf4 quantize(const std::vector<float>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  const cpu::Nf4Sizes s = cpu::nf4_sizes(n);
  HostNf4 q;
  q.packed.resize(s.packed_bytes), q.qabsmax.resize(s.blocks), q.absmax2.resize(s.stat_blocks);
  std::vector<float> scratch(s.blocks);
  cpu::nf4_quantize(x.data(), n, q.packed.data(), q.qabsmax.data(), q.absmax2.data(), &q.offset, scratch.data(), "x");
  return q;
}

// Weights as a checkpoint holds them: normal-ish values of a per-row scale, one block of zeros.
std::vector<float> random_weights(TestRng& rng, int64_t n) {
  std::vector<float> x(n);
  const double scale = std::exp(rng.uniform(-5, 0));
  for (float& v : x) v = static_cast<float>(scale * (rng.uniform(-1, 1) + rng.uniform(-1, 1) + rng.uniform(-1, 1)));
  if (n >= 192) std::fill(x.begin() + 64, x.begin() + 128, 0.0f);
  return x;
}

TEST(Nf4Gpu, DequantizeEqualsCpuTwin) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  // (elements, element offset of the output inside its buffer): a 16-multiple above 256 blocks (two absmax2
  // values), odd and non-16 counts, a tensor smaller than one group, an output at an odd element (off 16 bytes).
  const int64_t big = 16 * (1100 + rng.integer(0, 200));
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {big, 0}, {64 * 257 + 16 * rng.integer(1, 3), 0}, {4096, 0}, {2 * rng.integer(400, 900) + 1, 0},
      {16 * 37 + 8, 0}, {7, 0}, {1024, 1}};
  std::vector<HostNf4> host;
  std::vector<std::vector<float>> weights;
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> packed, qabsmax;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> absmax2;
  std::vector<std::unique_ptr<DeviceBf16>> out;
  std::vector<cuda::Nf4Dequant> batch;
  constexpr int64_t kGuard = 24;  // poisoned elements after each output, which must stay poisoned
  for (const auto& [n, at] : shapes) {
    weights.push_back(random_weights(rng, n));
    host.push_back(quantize(weights.back()));
    packed.push_back(std::make_unique<DeviceBuffer<uint8_t>>(host.back().packed));
    qabsmax.push_back(std::make_unique<DeviceBuffer<uint8_t>>(host.back().qabsmax));
    absmax2.push_back(std::make_unique<DeviceBuffer<float>>(host.back().absmax2));
    out.push_back(std::make_unique<DeviceBf16>(static_cast<size_t>(at + n + kGuard)));
    out.back()->poison();
    batch.push_back({out.back()->bf() + at, packed.back()->get(), qabsmax.back()->get(), absmax2.back()->get(),
                     host.back().offset, n});
  }
  cuda::nf4_dequantize(batch.data(), static_cast<int>(batch.size()), nullptr);
  for (size_t t = 0; t < shapes.size(); ++t) {
    const auto [n, at] = shapes[t];
    SCOPED_TRACE("tensor " + std::to_string(t) + ": " + std::to_string(n) + " elements at " + std::to_string(at));
    std::vector<uint16_t> expected(n);
    cpu::nf4_dequantize(host[t].view(n), expected.data());
    const std::vector<uint16_t> got = out[t]->download();
    int64_t mismatches = 0, first = -1;
    for (int64_t i = 0; i < n; ++i)
      if (got[at + i] != expected[i]) mismatches += 1, first = first < 0 ? i : first;
    EXPECT_EQ(mismatches, 0) << "first at element " << first;
    for (int64_t i = 0; i < at; ++i) EXPECT_EQ(got[i], 0xffff) << "written before the output, element " << i;
    for (int64_t i = at + n; i < at + n + kGuard; ++i) EXPECT_EQ(got[i], 0xffff) << "written past the end, element " << i;
    // And the values are the weights, to NF4's precision (a wrong scale or nibble order would not be).
    std::vector<double> back(n), ref(weights[t].begin(), weights[t].end());
    for (int64_t i = 0; i < n; ++i) back[i] = bf16_to_f32(got[at + i]);
    EXPECT_LT(rel_error_norm(back, ref), 0.15);
  }
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
