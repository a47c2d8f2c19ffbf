// kernels/cpu/int8_rowwise against bitsandbytes' int8_vectorwise_quant / _dequant bit for bit
// (tests/fixtures/base_quant/int8.safetensors, tools/reference/make_quant_fixtures.py): a row of zeros, an outlier,
// ties that round half to even, rows of scales 1e-4 to 10; and the format's bound on fresh random weights.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "kernels/cpu/int8_rowwise.h"
#include "tests/kernels/op_test_util.h"
#include "tests/test_util.h"

namespace tuna::cpu {
namespace {

const SafetensorsFile& fixture() {
  static const SafetensorsFile file("tests/fixtures/base_quant/int8.safetensors");
  return file;
}

std::vector<uint32_t> f32_bits(const std::string& name, std::vector<int64_t>* shape = nullptr) {
  const TensorInfo* info = fixture().find(name);
  if (!info) throw Error("int8 fixture has no tensor " + name);
  if (shape) *shape = info->shape;
  std::vector<float> v(info->numel);
  fixture().read_f32(name, info->shape, v.data());
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<uint32_t>(v[i]);
  return b;
}

TEST(Int8RowwiseTest, EqualsBitsandbytes) {
  for (const char* name : {"rows_6x50", "ties_1x10", "wide_33x97"}) {
    SCOPED_TRACE(name);
    const std::string c = name;
    std::vector<int64_t> shape;
    const std::vector<uint32_t> input_bits = f32_bits(c + ".input", &shape);
    ASSERT_EQ(shape.size(), 2u);
    const int64_t rows = shape[0], cols = shape[1];
    std::vector<float> w(input_bits.size());
    for (size_t i = 0; i < w.size(); ++i) w[i] = std::bit_cast<float>(input_bits[i]);
    std::vector<int8_t> q(rows * cols);
    std::vector<float> scale(rows), back(rows * cols);
    int8_rowwise_quantize(w.data(), rows, cols, q.data(), scale.data(), name);
    const TensorInfo* qi = fixture().find(c + ".q");
    ASSERT_TRUE(qi && qi->dtype == DType::I8 && qi->numel == rows * cols);
    EXPECT_EQ(std::memcmp(q.data(), fixture().data(*qi), q.size()), 0);
    std::vector<uint32_t> scale_bits(rows), back_bits(rows * cols);
    for (int64_t r = 0; r < rows; ++r) scale_bits[r] = std::bit_cast<uint32_t>(scale[r]);
    EXPECT_EQ(scale_bits, f32_bits(c + ".scale"));
    int8_rowwise_dequantize(q.data(), scale.data(), rows, cols, back.data());
    for (int64_t i = 0; i < rows * cols; ++i) back_bits[i] = std::bit_cast<uint32_t>(back[i]);
    EXPECT_EQ(back_bits, f32_bits(c + ".dequant"));
  }
}

// Each element within half a step (scale / 127 / 2, and a little for the fp32 roundings) of the weight.
TEST(Int8RowwiseTest, RoundTripWithinHalfAStep) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  const int64_t rows = rng.integer(5, 40), cols = rng.integer(1, 300);
  std::vector<float> w(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const double s = std::exp(rng.uniform(-8, 3));
    for (int64_t c = 0; c < cols; ++c) w[r * cols + c] = static_cast<float>(s * rng.uniform(-1, 1));
  }
  std::vector<int8_t> q(rows * cols);
  std::vector<float> scale(rows), back(rows * cols);
  int8_rowwise_quantize(w.data(), rows, cols, q.data(), scale.data(), "w");
  int8_rowwise_dequantize(q.data(), scale.data(), rows, cols, back.data());
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float step = scale[i / cols] / 127.0f;
    ASSERT_LE(std::fabs(back[i] - w[i]), step * 0.5001f) << "element " << i;
    ASSERT_GE(q[i], -127);
  }
  std::vector<uint16_t> back16(rows * cols);
  int8_rowwise_dequantize(q.data(), scale.data(), rows, cols, back16.data());
  for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(back16[i], f32_to_bf16(back[i])) << i;
  w[3] = NAN;
  const std::string e = testing_util::error_of(
      [&] { int8_rowwise_quantize(w.data(), rows, cols, q.data(), scale.data(), "model.layers.2.self_attn.o_proj.weight"); });
  EXPECT_NE(e.find("model.layers.2.self_attn.o_proj.weight: element 3 is nan"), std::string::npos) << e;
}

}  // namespace
}  // namespace tuna::cpu
