// NF4 with double-quantized absmax, the CPU twin (contract: kernels/cpu/nf4.h).
//
// Every rounding follows bitsandbytes' CPU path step by step, because bit equality is the contract:
// - full 64-blocks scale by the fp32 reciprocal of their absmax (torch's `x * (1 / absmax)`), the last, shorter
//   block divides by its absmax (torch's `x / am`), and that block's stored absmax is at least fp32(1e-38);
// - the nearest NF4 value is the count of midpoints strictly below the scaled value (torch.bucketize), so a
//   value exactly on a midpoint takes the lower code;
// - the 8-bit absmax code goes through bitsandbytes' 65536-entry table of [-1, 1], indexed by
//   fma((v + 1) / 2, 65535, 0.5) truncated (its library is built with FMA contraction there);
// - the dynamic map's linspace is torch's: start + step * i with one rounding (fma) below the halfway point,
//   end - step * (steps - 1 - i) above it.
// Products and sums are separate fp32 roundings: this file must not be built with FMA contraction
// (-march=native with -ffp-contract=fast would fuse map * absmax2 + offset); the fixture test would say so.
#include "kernels/cpu/nf4.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/parallel.h"

namespace tuna::cpu {
namespace {

constexpr int kLutSize = 65536;

// fp32(a + b * c) with one rounding, as an fma computes it: b * c and the sum are exact in double for the
// operands used here (24-bit mantissas, c < 2^16, exponents a few binades apart).
float fused(float a, float b, double c) { return static_cast<float>(static_cast<double>(a) + static_cast<double>(b) * c); }

// torch.linspace(start, end, steps) in fp32 on the CPU.
std::vector<float> linspace(float start, float end, int64_t steps) {
  const float step = (end - start) / static_cast<float>(steps - 1);
  const int64_t halfway = steps / 2;
  std::vector<float> v(steps);
  for (int64_t i = 0; i < steps; ++i)
    v[i] = i < halfway ? fused(start, step, static_cast<double>(i)) : fused(end, -step, static_cast<double>(steps - i - 1));
  return v;
}

std::array<float, 256> make_dynamic_map() {
  // Signed, 7 exponent bits, 8 bits in all: for exponent i (0..6) the midpoints of 2^i + 1 points spread over
  // [0.1, 1], scaled by 10^(i - 6), with both signs; then 0 and 1: 2 * 127 + 2 = 256 values.
  std::vector<float> values;
  for (int i = 0; i < 7; ++i) {
    const std::vector<float> bounds = linspace(0.1f, 1.0f, (int64_t{1} << i) + 1);
    const float scale = static_cast<float>(std::pow(10.0, i - 6));  // a Python float, cast to the tensor's fp32
    for (size_t j = 0; j + 1 < bounds.size(); ++j) {
      const float mean = (bounds[j] + bounds[j + 1]) / 2.0f;
      values.push_back(scale * mean);
      values.push_back(-(scale * mean));
    }
  }
  values.push_back(0.0f);
  values.push_back(1.0f);
  TUNA_CHECK(values.size() == 256, "dynamic map of ", values.size(), " values");
  std::sort(values.begin(), values.end());
  std::array<float, 256> map{};
  std::copy(values.begin(), values.end(), map.begin());
  return map;
}

// bitsandbytes' CPU table: entry i is the map index for the values near -1 + 2 i / 65535.
std::vector<uint8_t> make_lut(const std::array<float, 256>& map) {
  std::array<float, 255> midpoints{};
  for (int i = 0; i < 255; ++i) midpoints[i] = 0.5f * (map[i] + map[i + 1]);
  std::vector<uint8_t> lut(kLutSize);
  int index = 0;
  for (int i = 0; i < kLutSize; ++i) {
    const float value = (static_cast<float>(i) + static_cast<float>(i)) / 65535.0f - 1.0f;
    while (index < 255 && midpoints[index] < value) ++index;
    lut[i] = static_cast<uint8_t>(index);
  }
  return lut;
}

const std::vector<uint8_t>& dynamic_lut() {
  static const std::vector<uint8_t> lut = make_lut(dynamic_map());
  return lut;
}

int lut_index(float scaled) {
  const float v = std::clamp(scaled, -1.0f, 1.0f);
  const float half = (v + 1.0f) * 0.5f;
  return static_cast<uint16_t>(static_cast<int>(fused(0.5f, half, 65535.0)));
}

// The NF4 index of a scaled value in [-1, 1]: how many midpoints lie strictly below it.
uint8_t nf4_code(float scaled, const std::array<float, 15>& midpoints) {
  uint8_t code = 0;
  for (float m : midpoints) code += m < scaled;
  return code;
}

const std::array<float, 15>& nf4_midpoints() {
  static const std::array<float, 15> m = [] {
    std::array<float, 15> out{};
    for (int i = 0; i < 15; ++i) out[i] = (nf4_values()[i] + nf4_values()[i + 1]) / 2.0f;
    return out;
  }();
  return m;
}

template <typename Out>
void dequantize_impl(const Nf4Tensor& t, Out* out) {
  // Each block's absmax where it is used: nothing is allocated (the quantized base dequantizes every step).
  const Nf4Sizes s = nf4_sizes(t.n);
  const std::array<float, 16>& nf4 = nf4_values();
  const std::array<float, 256>& map = dynamic_map();
#pragma omp parallel for if (t.n >= kMinParallelWork)
  for (int64_t b = 0; b < s.blocks; ++b) {
    const float scaled = map[t.qabsmax[b]] * t.absmax2[b / kNf4StatsBlock];
    const float absmax = scaled + t.offset;
    const int64_t end = std::min(t.n, (b + 1) * kNf4Block);
    for (int64_t i = b * kNf4Block; i < end; ++i) {
      const uint8_t byte = t.packed[i / 2];
      const float x = nf4[i % 2 == 0 ? byte >> 4 : byte & 15] * absmax;
      if constexpr (std::is_same_v<Out, float>)
        out[i] = x;
      else
        out[i] = f32_to_bf16(x);
    }
  }
}

}  // namespace

const std::array<float, 16>& nf4_values() {
  // The NF4 data type of the QLoRA paper (Dettmers et al. 2023, appendix E), as bitsandbytes spells it.
  static const std::array<float, 16> values = {
      -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
      -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
      0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
      0.7229568362236023f, 1.0f};
  return values;
}

const std::array<float, 256>& dynamic_map() {
  static const std::array<float, 256> map = make_dynamic_map();
  return map;
}

Nf4Sizes nf4_sizes(int64_t n) {
  TUNA_CHECK(n >= 0, "nf4 of ", n, " elements");
  Nf4Sizes s;
  s.packed_bytes = (n + 1) / 2;
  s.blocks = (n + kNf4Block - 1) / kNf4Block;
  s.stat_blocks = (s.blocks + kNf4StatsBlock - 1) / kNf4StatsBlock;
  return s;
}

void nf4_quantize_blocks(const float* x, int64_t n, uint8_t* packed, float* absmax) {
  const Nf4Sizes s = nf4_sizes(n);
  const std::array<float, 15>& mid = nf4_midpoints();
  const float tiny = static_cast<float>(1e-38);  // torch's clamp(min=1e-38), a subnormal fp32
  const int64_t full_blocks = n / kNf4Block;
#pragma omp parallel for if (n >= kMinParallelWork)
  for (int64_t b = 0; b < s.blocks; ++b) {
    const int64_t begin = b * kNf4Block, end = std::min(n, begin + kNf4Block);
    float am = 0.0f;
    for (int64_t i = begin; i < end; ++i) am = std::max(am, std::fabs(x[i]));
    const bool full = b < full_blocks;
    if (!full) am = std::max(am, tiny);
    absmax[b] = am;
    const float reciprocal = 1.0f / std::max(am, tiny);
    // Blocks are 64 elements, an even number: a byte never straddles two blocks; the odd tail pads code 7.
    for (int64_t i = begin; i < end; i += 2) {
      uint8_t pair = 0;
      for (int64_t k = 0; k < 2; ++k) {
        uint8_t code = 7;  // the padding: scaled value 0
        if (i + k < end) {
          const float scaled = full ? x[i + k] * reciprocal : x[i + k] / am;
          code = nf4_code(std::clamp(scaled, -1.0f, 1.0f), mid);
        }
        pair = static_cast<uint8_t>(pair << 4 | code);
      }
      packed[i / 2] = pair;
    }
  }
}

void blockwise8_quantize(const float* x, int64_t n, int64_t blocksize, uint8_t* q, float* absmax) {
  TUNA_CHECK(blocksize > 0 && n >= 0, "blockwise8_quantize: n ", n, ", blocksize ", blocksize);
  const std::vector<uint8_t>& lut = dynamic_lut();
  const int64_t blocks = (n + blocksize - 1) / blocksize;
#pragma omp parallel for if (n >= kMinParallelWork)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * blocksize, end = std::min(n, begin + blocksize);
    float am = 0.0f;
    for (int64_t i = begin; i < end; ++i) am = std::max(am, std::fabs(x[i]));
    absmax[b] = am;
    if (am == 0.0f) {
      std::fill(q + begin, q + end, uint8_t{0});
      continue;
    }
    const float reciprocal = 1.0f / am;
    for (int64_t i = begin; i < end; ++i) q[i] = lut[lut_index(x[i] * reciprocal)];
  }
}

void nf4_double_quantize(const float* absmax, int64_t blocks, uint8_t* qabsmax, float* absmax2, float* offset) {
  double sum = 0;
  for (int64_t b = 0; b < blocks; ++b) sum += absmax[b];
  const float mean = blocks > 0 ? static_cast<float>(sum / static_cast<double>(blocks)) : 0.0f;
  std::vector<float> centered(blocks);
  for (int64_t b = 0; b < blocks; ++b) centered[b] = absmax[b] - mean;
  blockwise8_quantize(centered.data(), blocks, kNf4StatsBlock, qabsmax, absmax2);
  *offset = mean;
}

void nf4_quantize(const float* x, int64_t n, uint8_t* packed, uint8_t* qabsmax, float* absmax2, float* offset,
                  float* scratch_absmax, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]))
      fail(what, ": element ", i, " is ", x[i], "; NF4 quantization needs finite weights");
  nf4_quantize_blocks(x, n, packed, scratch_absmax);
  nf4_double_quantize(scratch_absmax, nf4_sizes(n).blocks, qabsmax, absmax2, offset);
}

void nf4_dequantize_absmax(const Nf4Tensor& t, float* absmax) {
  const Nf4Sizes s = nf4_sizes(t.n);
  const std::array<float, 256>& map = dynamic_map();
  for (int64_t b = 0; b < s.blocks; ++b) {
    const float scaled = map[t.qabsmax[b]] * t.absmax2[b / kNf4StatsBlock];
    absmax[b] = scaled + t.offset;
  }
}

void nf4_dequantize(const Nf4Tensor& t, float* out) { dequantize_impl(t, out); }
void nf4_dequantize(const Nf4Tensor& t, uint16_t* out_bf16) { dequantize_impl(t, out_bf16); }

}  // namespace tuna::cpu
