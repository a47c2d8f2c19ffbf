// FP8 training's decisions (model/fp8.h) and the CPU twin of its GEMM groups. Every product goes through
// kernels/cpu/fp8.h's casts and simulated GEMM with K-major operands, as the CUDA engine's cuBLASLt calls take them:
//   forward      out_i = x (e4m3, [n, in]) . W_i (e4m3, [out_i, in])^T
//   input grad   dx = sum_i dy_i (e5m2, [n, out_i]) . W_i^T (e4m3, [in, out_i])^T
//   weight grad  dW_i += dy_i^T (e5m2, [out_i, n]) . x^T (e4m3, [in, n])^T
// The group's parts share one scale each for x, for W (the block's amax) and for dy (the group's output gradient is
// one tensor on the GPU: d_q|d_k|d_v, d_gate|d_up). The GPU sums the input gradient over the whole block in one
// GEMM; here part by part, so the two differ in the order of fp32 sums only.
#include "model/fp8.h"

#include <algorithm>

#include "comm/comm.h"
#include "core/error.h"

namespace tuna {

const char* fp8_mode_name(Fp8Mode mode) { return mode == Fp8Mode::Tensorwise ? "tensorwise" : "off"; }

Fp8Mode parse_fp8_mode(const std::string& value, const std::string& what) {
  if (value == "off") return Fp8Mode::Off;
  if (value == "tensorwise") return Fp8Mode::Tensorwise;
  if (value == "rowwise")
    fail(what, ": rowwise FP8 (torchao's per-row scales) is not implemented; tensorwise is (one scale per tensor)");
  fail(what, ": expected off or tensorwise, found '", value, "'");
}

bool parse_fp8_forward_codes(const std::string& value, const std::string& what) {
  if (value == "both") return false;
  if (value == "forward") return true;
  fail(what, ": expected both or forward, found '", value, "'");
}

const char* fp8_weight_codes_name(bool forward_codes) { return forward_codes ? "forward" : "both"; }

float Fp8GroupCpu::amax_of(const std::vector<std::pair<const float*, int64_t>>& tensors, int64_t cols, bool split,
                           Comm* tp) {
  float amax = 0.0f;
  for (const auto& [data, rows] : tensors) cpu::fp8_amax(&amax, data, rows, cols, cols);
  if (split && tp != nullptr && tp->size() > 1) tp->all_reduce(&amax, 1, CommType::F32, ReduceOp::Max, "fp8 amax");
  return amax;
}

void Fp8GroupCpu::reserve(int64_t n, int64_t in, int64_t rows) {
  x_codes_.reserve(static_cast<size_t>(n * in));
  w_codes_.reserve(static_cast<size_t>(rows * in));
  w_t_codes_.reserve(static_cast<size_t>(rows * in));
  dy_codes_.reserve(static_cast<size_t>(n * rows));
  dy_t_codes_.reserve(static_cast<size_t>(n * rows));
}

void Fp8GroupCpu::forward(const std::vector<Part>& parts, const std::vector<float*>& outs, const float* x, int64_t n,
                          int64_t in, bool x_split, Comm* tp) {
  TUNA_CHECK(parts.size() == outs.size() && !parts.empty(), "fp8 forward of ", parts.size(), " parts into ",
             outs.size(), " outputs");
  using cpu::Fp8Format;
  float inv_x = 0, inv_w = 0;
  x_codes_.resize(static_cast<size_t>(n * in));
  cpu::fp8_cast(x_codes_.data(), &inv_x, x, n, in, in, amax_of({{x, n}}, in, x_split, tp), Fp8Format::E4M3);
  std::vector<std::pair<const float*, int64_t>> weights;
  int64_t rows = 0;
  for (const Part& p : parts) weights.emplace_back(p.weight, p.out), rows += p.out;
  const float amax_w = amax_of(weights, in, /*split=*/true, tp);
  w_codes_.resize(static_cast<size_t>(rows * in));
  int64_t row = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    uint8_t* codes = w_codes_.data() + row * in;
    cpu::fp8_cast(codes, &inv_w, parts[i].weight, parts[i].out, in, in, amax_w, Fp8Format::E4M3);
    cpu::fp8_gemm(outs[i], parts[i].out, x_codes_.data(), Fp8Format::E4M3, inv_x, codes, Fp8Format::E4M3, inv_w, n,
                  parts[i].out, in, /*accumulate=*/false);
    row += parts[i].out;
  }
}

void Fp8GroupCpu::backward(const std::vector<Part>& parts, const std::vector<const float*>& dys,
                           const std::vector<float*>& dweights, float* dx, bool accumulate_dx, const float* x,
                           int64_t n, int64_t in, bool x_split, bool dy_split, Comm* tp) {
  TUNA_CHECK(parts.size() == dys.size() && !parts.empty() && (dweights.empty() || dweights.size() == parts.size()),
             "fp8 backward of ", parts.size(), " parts, ", dys.size(), " output gradients, ", dweights.size(),
             " weight gradients");
  using cpu::Fp8Format;
  // The output gradient: one scale for the group's parts, both layouts.
  int64_t rows = 0;
  std::vector<std::pair<const float*, int64_t>> weights;
  for (const Part& p : parts) weights.emplace_back(p.weight, p.out), rows += p.out;
  float amax_dy = 0.0f;  // the parts' widths differ: folded one by one
  for (size_t i = 0; i < parts.size(); ++i) cpu::fp8_amax(&amax_dy, dys[i], n, parts[i].out, parts[i].out);
  if (dy_split && tp != nullptr && tp->size() > 1)
    tp->all_reduce(&amax_dy, 1, CommType::F32, ReduceOp::Max, "fp8 amax");
  const bool want_dw = std::any_of(dweights.begin(), dweights.end(), [](float* p) { return p != nullptr; });
  float inv_x = 0;
  if (want_dw) {
    x_codes_.resize(static_cast<size_t>(n * in));  // x^T: [in, n]
    cpu::fp8_cast_transpose(nullptr, x_codes_.data(), &inv_x, x, n, in, in, amax_of({{x, n}}, in, x_split, tp),
                            Fp8Format::E4M3);
  }
  const float amax_w = amax_of(weights, in, /*split=*/true, tp);
  dy_codes_.resize(static_cast<size_t>(n * rows));
  dy_t_codes_.resize(static_cast<size_t>(n * rows));
  w_t_codes_.resize(static_cast<size_t>(rows * in));
  int64_t row = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t out = parts[i].out;
    uint8_t *g = dy_codes_.data() + row * n, *g_t = dy_t_codes_.data() + row * n, *w_t = w_t_codes_.data() + row * in;
    float inv_dy = 0, inv_w = 0;
    cpu::fp8_cast_transpose(g, g_t, &inv_dy, dys[i], n, out, out, amax_dy, Fp8Format::E5M2);
    if (dx != nullptr) {
      cpu::fp8_cast_transpose(nullptr, w_t, &inv_w, parts[i].weight, out, in, in, amax_w, Fp8Format::E4M3);
      cpu::fp8_gemm(dx, in, g, Fp8Format::E5M2, inv_dy, w_t, Fp8Format::E4M3, inv_w, n, in, out,
                    /*accumulate=*/accumulate_dx || i > 0);
    }
    if (want_dw && dweights[i] != nullptr)
      cpu::fp8_gemm(dweights[i], in, g_t, Fp8Format::E5M2, inv_dy, x_codes_.data(), Fp8Format::E4M3, inv_x, out, in,
                    n, /*accumulate=*/true);
    row += out;
  }
}

}  // namespace tuna
