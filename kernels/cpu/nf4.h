// 4-bit NormalFloat (NF4) with double-quantized absmax: QLoRA's storage of a frozen weight, in bitsandbytes'
// layout (quantize_4bit(blocksize=64, quant_type="nf4", compress_statistics=True)). CPU twin of kernels/nf4.cuh.
//
// A tensor of n elements, flattened row-major, is cut into blocks of 64 (the last may be shorter):
//   absmax[b] = max |x| over block b; code[i] = the NF4 value nearest to x[i] / absmax[b] (a 4-bit index);
//   packed[j] = code[2j] << 4 | code[2j + 1] (an odd n pads one code 7, the value 0, in the last low nibble).
// The fp32 absmax are then quantized themselves: offset = their mean; absmax - offset in blocks of 256,
// each to the nearest value of bitsandbytes' 8-bit signed dynamic map scaled by that block's own absmax
// (absmax2). Dequantized: absmax[b] = map[qabsmax[b]] * absmax2[b / 256] + offset, x[i] = nf4[code[i]] * absmax[b],
// each product and sum rounded to fp32 on its own (no fused multiply-add), as bitsandbytes computes them.
// Bytes: n/2 + n/64 + 4 n/16384 + 4 = 0.5 + 1/64 + ... per element (4.127 bits).
//
// Bit for bit what bitsandbytes' CPU path computes (tests/fixtures/nf4 checks it), with one exception: the
// offset is the correctly rounded mean (summed in double); torch sums fp32 in an order that depends on the
// CPU's vector width and thread count, so its mean may differ from it in the last bit for large tensors.
#pragma once
#include <array>
#include <cstdint>

namespace tuna::cpu {

constexpr int64_t kNf4Block = 64;         // elements per absmax
constexpr int64_t kNf4StatsBlock = 256;   // absmax per second-level absmax (double quantization)

// The 16 NF4 values (QLoRA's quantiles of N(0, 1), normalized to [-1, 1]), ascending; index 7 is 0.
const std::array<float, 16>& nf4_values();
// bitsandbytes' signed 8-bit dynamic map (create_dynamic_map(signed=True)), 256 values ascending in [-1, 1]:
// the code of the double-quantized absmax. Computed as bitsandbytes computes it, once.
const std::array<float, 256>& dynamic_map();

// Sizes of one tensor's NF4 state.
struct Nf4Sizes {
  int64_t packed_bytes = 0;  // ceil(n / 2)
  int64_t blocks = 0;        // ceil(n / 64): qabsmax bytes
  int64_t stat_blocks = 0;   // ceil(blocks / 256): absmax2 floats
  int64_t bytes() const { return packed_bytes + blocks + 4 * stat_blocks + 4; }  // + the offset
};
Nf4Sizes nf4_sizes(int64_t n);

// One tensor's NF4 state (pointers into storage that the caller owns).
struct Nf4Tensor {
  int64_t n = 0;                    // elements
  const uint8_t* packed = nullptr;  // [ceil(n/2)]
  const uint8_t* qabsmax = nullptr; // [blocks]: dynamic_map() indices
  const float* absmax2 = nullptr;   // [stat_blocks]
  float offset = 0;                 // mean of the fp32 absmax
};

// First level alone (compress_statistics=False): packed nibbles and fp32 absmax of x[0, n). x must be finite
// (an internal check: callers check their weights and name them, see nf4_quantize). OVERWRITES packed, absmax.
void nf4_quantize_blocks(const float* x, int64_t n, uint8_t* packed, float* absmax);
// bitsandbytes' 8-bit blockwise quantization of its CPU path (quantize_blockwise with the dynamic map): per block
// of `blocksize`, absmax = max |x| and each x / absmax to a map index through its 65536-entry table of [-1, 1]
// (what bitsandbytes' CPU library does, not an exact nearest search). OVERWRITES q, absmax.
void blockwise8_quantize(const float* x, int64_t n, int64_t blocksize, uint8_t* q, float* absmax);
// Second level: offset = mean(absmax), then blockwise8_quantize(absmax - offset, 256). OVERWRITES qabsmax, absmax2.
void nf4_double_quantize(const float* absmax, int64_t blocks, uint8_t* qabsmax, float* absmax2, float* offset);
// Both levels: fails (tuna::Error) when an element of x is NaN or infinite, naming `what` and the index.
// `scratch_absmax` holds ceil(n/64) floats (the first level's absmax before their quantization). OVERWRITES all.
void nf4_quantize(const float* x, int64_t n, uint8_t* packed, uint8_t* qabsmax, float* absmax2, float* offset,
                  float* scratch_absmax, const char* what);

// The fp32 absmax of the double-quantized ones: absmax[b] = map[qabsmax[b]] * absmax2[b / 256] + offset.
void nf4_dequantize_absmax(const Nf4Tensor& t, float* absmax);
// x[i] = nf4[code[i]] * absmax[i / 64], i < t.n, in fp32 (out float) or rounded to bf16 (out: bf16 bits).
// OVERWRITES out.
void nf4_dequantize(const Nf4Tensor& t, float* out);
void nf4_dequantize(const Nf4Tensor& t, uint16_t* out_bf16);

}  // namespace tuna::cpu
