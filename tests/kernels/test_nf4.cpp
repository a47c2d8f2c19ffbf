// kernels/cpu/nf4 against bitsandbytes bit for bit (tests/fixtures/base_quant/nf4.safetensors, tools/reference/make_quant_fixtures.py):
// the dynamic map and NF4 code, the packed nibbles, the first-level absmax, the double-quantized absmax and its
// state, and the dequantized weights in fp32 and bf16; then properties on fresh random inputs: the error bound
// of the format, determinism over thread counts, and a clear error for non-finite weights.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "kernels/cpu/nf4.h"
#include "tests/kernels/op_test_util.h"
#include "tests/test_util.h"

namespace tuna::cpu {
namespace {

using test::TestRng;

const SafetensorsFile& fixture() {
  static const SafetensorsFile file("tests/fixtures/base_quant/nf4.safetensors");
  return file;
}

std::vector<uint8_t> read_u8(const std::string& name) {
  const TensorInfo* info = fixture().find(name);
  if (!info) throw Error("nf4 fixture has no tensor " + name);
  EXPECT_EQ(info->dtype, DType::U8) << name;
  std::vector<uint8_t> v(info->numel);
  std::memcpy(v.data(), fixture().data(*info), v.size());
  return v;
}

std::vector<float> read_f32(const std::string& name) {
  const TensorInfo* info = fixture().find(name);
  if (!info) throw Error("nf4 fixture has no tensor " + name);
  std::vector<float> v(info->numel);
  fixture().read_f32(name, info->shape, v.data());
  return v;
}

std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<uint32_t>(v[i]);
  return b;
}

// Units in the last place between two positive floats.
int64_t ulps(float a, float b) {
  return std::abs(static_cast<int64_t>(std::bit_cast<int32_t>(a)) - static_cast<int64_t>(std::bit_cast<int32_t>(b)));
}

const char* kCases[] = {"odd_7x13", "tail_3x100", "zeros_5x77", "midpoints_1x64", "scales_8x512", "one_1x1",
                        "big_100x333_bf16"};

TEST(Nf4Test, TablesEqualBitsandbytes) {
  const std::vector<float> map = read_f32("dynamic_map"), code = read_f32("nf4_code");
  ASSERT_EQ(map.size(), 256u);
  ASSERT_EQ(code.size(), 16u);
  EXPECT_EQ(bits(std::vector<float>(dynamic_map().begin(), dynamic_map().end())), bits(map));
  EXPECT_EQ(bits(std::vector<float>(nf4_values().begin(), nf4_values().end())), bits(code));
}

TEST(Nf4Test, QuantizeEqualsBitsandbytes) {
  for (const char* name : kCases) {
    SCOPED_TRACE(name);
    const std::string c = name;
    const std::vector<float> x = read_f32(c + ".input");
    const int64_t n = static_cast<int64_t>(x.size());
    const Nf4Sizes s = nf4_sizes(n);
    std::vector<uint8_t> packed(s.packed_bytes), qabsmax(s.blocks);
    std::vector<float> absmax(s.blocks), absmax2(s.stat_blocks);
    float offset = NAN;
    nf4_quantize(x.data(), n, packed.data(), qabsmax.data(), absmax2.data(), &offset, absmax.data(), name);

    EXPECT_EQ(packed, read_u8(c + ".packed"));
    EXPECT_EQ(bits(absmax), bits(read_f32(c + ".absmax")));
    // The offset: tuna's is the correctly rounded mean, torch's an fp32 sum in its own order (the header says
    // why); they may differ in the last bits only.
    const float ref_offset = read_f32(c + ".offset")[0];
    EXPECT_LE(ulps(offset, ref_offset), 2) << "offset " << offset << ", bitsandbytes " << ref_offset;
    if (offset == ref_offset) {
      EXPECT_EQ(qabsmax, read_u8(c + ".qabsmax"));
      EXPECT_EQ(bits(absmax2), bits(read_f32(c + ".absmax2")));
    }
    // The second level from bitsandbytes' own offset, every case: the 8-bit quantization bit for bit.
    const std::vector<float> ref_absmax = read_f32(c + ".absmax");
    std::vector<float> centered(s.blocks);
    for (int64_t b = 0; b < s.blocks; ++b) centered[b] = ref_absmax[b] - ref_offset;
    std::vector<uint8_t> q2(s.blocks);
    std::vector<float> a2(s.stat_blocks);
    blockwise8_quantize(centered.data(), s.blocks, kNf4StatsBlock, q2.data(), a2.data());
    EXPECT_EQ(q2, read_u8(c + ".qabsmax"));
    EXPECT_EQ(bits(a2), bits(read_f32(c + ".absmax2")));
  }
}

TEST(Nf4Test, DequantizeEqualsBitsandbytes) {
  for (const char* name : kCases) {
    const std::string c = name;
    if (!fixture().find(c + ".dequant_f32")) continue;  // the bf16 case has none (file size)
    SCOPED_TRACE(name);
    const std::vector<uint8_t> packed = read_u8(c + ".packed"), qabsmax = read_u8(c + ".qabsmax");
    const std::vector<float> absmax2 = read_f32(c + ".absmax2");
    const int64_t n = static_cast<int64_t>(read_f32(c + ".input").size());
    const Nf4Tensor t{n, packed.data(), qabsmax.data(), absmax2.data(), read_f32(c + ".offset")[0]};
    std::vector<float> out(n);
    nf4_dequantize(t, out.data());
    EXPECT_EQ(bits(out), bits(read_f32(c + ".dequant_f32")));
    std::vector<uint16_t> out_bf16(n);
    nf4_dequantize(t, out_bf16.data());
    const std::vector<float> ref_bf16 = read_f32(c + ".dequant_bf16");
    std::vector<uint16_t> ref_bits(n);
    for (int64_t i = 0; i < n; ++i) ref_bits[i] = f32_to_bf16(ref_bf16[i]);  // exact: the values are bf16
    EXPECT_EQ(out_bf16, ref_bits);
  }
}

// The format's own bound on fresh inputs: each element within half the widest NF4 gap (0.304 of its block's
// absmax) plus the absmax's 8-bit error; zeros stay zero; every thread count gives the same bytes.
TEST(Nf4Test, RoundTripWithinTheFormatsBound) {
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t n = 64 * 300 + rng.integer(1, 63);
  std::vector<float> x(n);
  for (float& v : x) v = static_cast<float>(rng.uniform(-1, 1) * std::exp(rng.uniform(-8, 2)));
  std::fill(x.begin() + 640, x.begin() + 704, 0.0f);
  const Nf4Sizes s = nf4_sizes(n);
  std::vector<uint8_t> packed(s.packed_bytes), qabsmax(s.blocks);
  std::vector<float> absmax(s.blocks), absmax2(s.stat_blocks);
  float offset = 0;
  nf4_quantize(x.data(), n, packed.data(), qabsmax.data(), absmax2.data(), &offset, absmax.data(), "x");
  const Nf4Tensor t{n, packed.data(), qabsmax.data(), absmax2.data(), offset};
  std::vector<float> back(n), absmax_back(s.blocks);
  nf4_dequantize(t, back.data());
  nf4_dequantize_absmax(t, absmax_back.data());
  for (int64_t b = 0; b < s.blocks; ++b) {
    // 8-bit dynamic code: relative step <= ~1/127 of the 256-block's absmax (absmax2).
    EXPECT_LE(std::fabs(absmax_back[b] - absmax[b]), absmax2[b / kNf4StatsBlock] / 100.0f + 1e-6f) << "block " << b;
  }
  float max_gap = 0;  // the widest gap between neighbouring codes (-1 to -0.696)
  for (int c = 0; c < 15; ++c) max_gap = std::max(max_gap, nf4_values()[c + 1] - nf4_values()[c]);
  for (int64_t i = 0; i < n; ++i) {
    const float am = absmax[i / kNf4Block], am_back = absmax_back[i / kNf4Block];
    const float bound = am * max_gap / 2 + std::fabs(am_back - am) + 1e-7f;
    ASSERT_LE(std::fabs(back[i] - x[i]), bound) << "element " << i;
  }
  for (int64_t i = 640; i < 704; ++i) ASSERT_EQ(back[i], 0.0f) << i;

  std::vector<uint8_t> packed1(s.packed_bytes), qabsmax1(s.blocks);
  std::vector<float> absmax2_1(s.stat_blocks), scratch(s.blocks);
  float offset1 = 0;
  test::with_omp_threads(1, [&] {
    nf4_quantize(x.data(), n, packed1.data(), qabsmax1.data(), absmax2_1.data(), &offset1, scratch.data(), "x");
  });
  EXPECT_EQ(packed1, packed);
  EXPECT_EQ(qabsmax1, qabsmax);
  EXPECT_EQ(bits(absmax2_1), bits(absmax2));
  EXPECT_EQ(offset1, offset);
}

TEST(Nf4Test, NonFiniteWeightIsAClearError) {
  std::vector<float> x(100, 0.5f);
  x[70] = NAN;
  const Nf4Sizes s = nf4_sizes(100);
  std::vector<uint8_t> packed(s.packed_bytes), q(s.blocks);
  std::vector<float> a2(s.stat_blocks), scratch(s.blocks);
  float offset = 0;
  const std::string e = testing_util::error_of(
      [&] { nf4_quantize(x.data(), 100, packed.data(), q.data(), a2.data(), &offset, scratch.data(), "model.layers.0.mlp.up_proj.weight"); });
  EXPECT_NE(e.find("model.layers.0.mlp.up_proj.weight: element 70 is nan"), std::string::npos) << e;
}

}  // namespace
}  // namespace tuna::cpu
