// ggml's block quantizations, for GGUF export (ckpt/gguf.h): rows of fp32 into blocks of 32 values that
// llama.cpp reads directly.
//
//   q8_0: 34 bytes per block: d (f16) = max|x| / 127, then 32 int8 q = round(x / d) (half away from zero).
//   q4_0: 18 bytes per block: d (f16) = x_m / -8 where x_m is the value of largest magnitude (the first such,
//         sign kept), then 16 bytes of 4-bit q = min(15, trunc(x / d + 8.5)): element j in the low nibble of
//         byte j, element j + 16 in the high nibble.
//
// Both multiply by the reciprocal 1/d in fp32 rather than divide, as ggml's reference quantizers
// (quantize_row_q8_0_ref, quantize_row_q4_0_ref) and the gguf Python package do: the blocks are then the same
// bytes as theirs, not merely as close (tests/ckpt/test_quantize.cpp, tools/reference/check_gguf.py).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tuna {

enum class BlockQuant : uint8_t { q8_0, q4_0 };

inline constexpr int64_t kQuantBlock = 32;  // values per block, both formats
// Bytes of one block: 34 (q8_0), 18 (q4_0).
size_t quant_block_bytes(BlockQuant type);
const char* quant_name(BlockQuant type);  // "q8_0", "q4_0"

// Quantizes n values (a multiple of kQuantBlock; consecutive whole rows) into n / 32 blocks at out. Runs on the
// OpenMP threads for large n; every block is computed alone, so the bytes do not depend on the thread count.
void quantize_blocks(BlockQuant type, const float* x, int64_t n, std::byte* out);

// The inverse (tests, and reading a quantized tensor back): n values into y.
void dequantize_blocks(BlockQuant type, const std::byte* blocks, int64_t n, float* y);

}  // namespace tuna
