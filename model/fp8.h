// FP8 training (--fp8 tensorwise): what it changes, decided here once. The seven projections of every decoder layer
// run their three GEMMs (forward, input gradient, weight gradient) with FP8 operands: e4m3 activations and weights,
// e5m2 output gradients, one dynamic scale per tensor from its amax (torchao's tensorwise recipe, kernels/cpu/fp8.h),
// fp32 accumulation. The lm_head, attention, the norms, the embedding and the optimizer stay as they are, and so do
// the adapters (their skinny products gain nothing; the frozen base's GEMMs are the FP8 ones).
//
// A GEMM group is one operand set: the fused q|k|v and gate|up weight blocks are one GEMM each on the GPU, so each has
// one weight scale (the amax over the block), as do o_proj and down_proj. Under tensor parallelism every amax that
// covers a split tensor is the maximum over the tp group, so each rank casts with the scale one rank would: the
// weights (always split), the row-parallel GEMMs' inputs (attention output, SwiGLU output) and the column-parallel
// GEMMs' output gradients. The replicated ones (the normed inputs of q|k|v and gate|up, the residual gradient) need
// no collective.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/fp8.h"

namespace tuna {

class Comm;

enum class Fp8Mode { Off, Tensorwise };

const char* fp8_mode_name(Fp8Mode mode);  // "off", "tensorwise"
// "off" | "tensorwise"; anything else fails naming `what` (the option or the TOML key) and the accepted values.
// "rowwise" (torchao's per-row recipe) is refused as not implemented.
Fp8Mode parse_fp8_mode(const std::string& value, const std::string& what);
// --fp8_weight_codes (the CUDA engine's FP8 weight codes): "both" (every layer's weights cast into both layouts the
// GEMMs read, once per update: 2 bytes a projection weight) -> false; "forward" (the forward layout's kept, 1 byte a
// weight, and the transposed codes the input gradient reads cast again from the bf16 weights before each backward use:
// half the codes' memory for a cast a micro-batch) -> true. The same codes either way, so the same numbers. Anything
// else fails naming `what` and the accepted values.
bool parse_fp8_forward_codes(const std::string& value, const std::string& what);
const char* fp8_weight_codes_name(bool forward_codes);  // "both", "forward"

// The CPU twin of one FP8 GEMM group (the CPU model's projections under --fp8 tensorwise): a group's weight is
// `parts` blocks of rows (q, k, v; gate, up; or one), [out_i, in] each, sharing one scale; the input x [n, in] is
// shared by the parts. Each call casts what it multiplies (kernels/cpu/fp8.h): the same codes as a cast cached once
// per step, as the weights do not change within one, at O(parameters) beside the GEMMs' O(parameters x tokens).
// tp: the group to take each amax's maximum over for the operands split across it (see the top of this file);
// null or size 1: none. Scratch buffers grow to the largest group and stay.
class Fp8GroupCpu {
 public:
  struct Part {
    const float* weight;  // [out, in]
    int64_t out;
  };
  // out_i[n, out_i] = x @ W_i^T through FP8 (OVERWRITES each out_i). x_split: x is split over tp (the row-parallel
  // GEMMs' inputs).
  void forward(const std::vector<Part>& parts, const std::vector<float*>& outs, const float* x, int64_t n, int64_t in,
               bool x_split, Comm* tp);
  // dx[n, in] (= or +=, by accumulate_dx) sum_i dy_i @ W_i; dW_i[out_i, in] += dy_i^T @ x (dweights null, or a null
  // entry: not computed, a frozen base). dy_split: the output gradients are split over tp (column-parallel groups).
  // Takes the scratch a group of n rows, inputs up to `in` wide and outputs up to `rows` wide needs, ahead of use.
  void reserve(int64_t n, int64_t in, int64_t rows);
  void backward(const std::vector<Part>& parts, const std::vector<const float*>& dys, const std::vector<float*>& dweights,
                float* dx, bool accumulate_dx, const float* x, int64_t n, int64_t in, bool x_split, bool dy_split,
                Comm* tp);

 private:
  float amax_of(const std::vector<std::pair<const float*, int64_t>>& tensors, int64_t cols, bool split, Comm* tp);
  std::vector<uint8_t> x_codes_, w_codes_, w_t_codes_, dy_codes_, dy_t_codes_;
};

}  // namespace tuna
