// tests/kernels/emulator/matmul_host.cpp — a TEST DOUBLE of cuBLASLt for the emulated build: the contract of
// kernels/matmul.cuh (matmul_fwd, matmul_bwd, MatmulContext) in plain host loops, linked into
// build/emulated_gpu_tests in place of kernels/matmul.cu, so that the GPU model (model/llama_gpu.cpp,
// engine/engine_gpu.cpp) runs there with every other op on the real launchers and kernels.
//
// It checks nothing about kernels/matmul.cu, which calls cuBLASLt (a closed library that cannot be emulated
// faithfully): that file is tested only on a GPU, by tests/kernels/test_matmul_gpu.cpp against the CPU twin.
// That test is left out of the emulated build, where it would compare this double with the twin and prove
// nothing.
//
// What the double reproduces, because the model tests depend on it: bf16 operands widened to fp32, products
// summed in fp32 (in index order; cuBLASLt's order differs, which only moves the last bits), one rounding to
// bf16 (round to nearest even) of each bf16 output after the epilogue (out = acc + residual, dinp = acc + dinp
// when accumulating: cuBLASLt's D = alpha AB + beta C with beta = 1), and the fp32 weight gradient accumulated
// (dweight += acc) or overwritten (dweight = acc), by dweight_write. As with beta = 0 in cuBLASLt, an output that
// is overwritten is never read, so a NaN there (fresh emulated memory reads as NaN) does not leak in. Every
// operand must lie inside one device allocation, a check the emulated runtime adds (a wrong offset into the
// model's arena fails here instead of reading a neighbouring buffer).
//
// The FP8 products (matmul_fp8_*) the same way: the codes' values (kernels/cpu/fp8.h's decoding, exact), their
// products summed in fp32 in index order, the sum times (inverse scale of A * inverse scale of B) (one fp32 rounding
// for the scales' product, one for the multiplication: the order kernels/cpu/fp8.h's fp8_gemm documents), then C
// added (beta = 1) and one rounding of a bf16 output. The forward's fast accumulation (a reduced-precision
// accumulator on the GPU) is not modelled: its error shows only on a GPU, in tests/kernels/test_matmul_gpu.cpp. The
// shape and alignment refusals are the real launchers' (n, ic, oc multiples of 16, 16-byte aligned operands).
//
// Plain loops on one thread, as everything in this binary runs (emulator/main.cpp); the model tests' shapes are
// tiny. Queued on the call's stream as a kernel is (runtime.h enqueue): with concurrent streams they run when the
// stream gets there, and read what the stream's earlier work wrote. MatmulContext::gemm (the raw cuBLASLt call) is not provided: nothing in the emulated build calls it outside
// matmul.cu, and a new caller fails to link rather than run on a guess.
#include <algorithm>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/cpu/fp8.h"
#include "kernels/matmul.cuh"

namespace tuna::cuda {

namespace {

float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

void check_operand(const void* p, int64_t elements, int64_t element_bytes, const char* what) {
  TUNA_CHECK(tuna::emulator::in_device_allocation(p, static_cast<size_t>(elements * element_bytes)), "matmul: ", what,
             " (", elements, " elements at ", p, ") is not inside one device allocation");
}

// Both forwards: with a residual, it is added in fp32 before the one rounding, as the GEMM's epilogue does.
// Rows of out (and residual) are ld apart.
void matmul_fwd_host(__nv_bfloat16* out, const __nv_bfloat16* inp, const __nv_bfloat16* weight,
                     const __nv_bfloat16* residual, int64_t n, int64_t ic, int64_t oc, int64_t ld, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && ic > 0 && oc > 0 && ld >= oc, "n ", n, ", ic ", ic, ", oc ", oc, ", ld ", ld);
  if (n == 0) return;
  check_operand(out, (n - 1) * ld + oc, 2, "out");
  check_operand(inp, n * ic, 2, "inp");
  check_operand(weight, oc * ic, 2, "weight");
  if (residual != nullptr) check_operand(residual, (n - 1) * ld + oc, 2, "residual");
  tuna::emulator::enqueue(stream, [=] {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = 0; o < oc; ++o) {
        float acc = 0.0f;
        for (int64_t i = 0; i < ic; ++i) acc += widen(inp[r * ic + i]) * widen(weight[o * ic + i]);
        if (residual != nullptr) acc += widen(residual[r * ld + o]);  // read before the write: out may be residual
        out[r * ld + o] = __float2bfloat16_rn(acc);
      }
  });
}

// D[i * ldd + j] (= or +=) (inv_a * inv_b) * sum_k A[i, k] B[j, k] for i < m, j < n: both operands K-major codes.
// Out is bf16 (rounded once after the add) or fp32.
template <typename Out>
void fp8_product(Out* d, int64_t ldd, const uint8_t* a, cpu::Fp8Format a_format, const float* a_inv_scale,
                 const uint8_t* b, cpu::Fp8Format b_format, const float* b_inv_scale, int64_t m, int64_t n, int64_t k,
                 bool accumulate) {
  check_operand(d, (m - 1) * ldd + n, sizeof(Out), "fp8 output");
  check_operand(a, m * k, 1, "fp8 operand A");
  check_operand(b, n * k, 1, "fp8 operand B");
  check_operand(a_inv_scale, 1, 4, "fp8 scale of A");
  check_operand(b_inv_scale, 1, 4, "fp8 scale of B");
  const float alpha = *a_inv_scale * *b_inv_scale;
  std::vector<float> a_values(m * k), b_values(n * k);
  for (int64_t i = 0; i < m * k; ++i) a_values[i] = cpu::fp8_to_float(a[i], a_format);
  for (int64_t i = 0; i < n * k; ++i) b_values[i] = cpu::fp8_to_float(b[i], b_format);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t p = 0; p < k; ++p) acc += a_values[i * k + p] * b_values[j * k + p];
      float value = alpha * acc;
      if constexpr (std::is_same_v<Out, float>) {
        d[i * ldd + j] = accumulate ? value + d[i * ldd + j] : value;
      } else {
        if (accumulate) value += widen(d[i * ldd + j]);
        d[i * ldd + j] = __float2bfloat16_rn(value);
      }
    }
}

void matmul_fp8_fwd_host(__nv_bfloat16* out, Fp8Operand inp, Fp8Operand weight, const __nv_bfloat16* residual,
                         int64_t n, int64_t ic, int64_t oc) {
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  if (n == 0) return;
  if (residual != nullptr && residual != out) {  // out = residual + product: start from a copy of the residual
    check_operand(residual, n * oc, 2, "residual");
    check_operand(out, n * oc, 2, "out");
    std::copy(residual, residual + n * oc, out);
  }
  fp8_product(out, oc, inp.codes, cpu::Fp8Format::E4M3, inp.inv_scale, weight.codes, cpu::Fp8Format::E4M3,
              weight.inv_scale, n, oc, ic, /*accumulate=*/residual != nullptr);
}

}  // namespace

// The real context holds a cuBLASLt handle and a device workspace; the double allocates the same workspace
// (so the device memory the engine reports is the real one's) and no handle.
MatmulContext::MatmulContext(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  if (workspace_bytes_ > 0) TUNA_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

MatmulContext::MatmulContext(void* workspace, size_t workspace_bytes)
    : workspace_(workspace), workspace_bytes_(workspace_bytes), owns_workspace_(false) {}

MatmulContext::~MatmulContext() {
  if (workspace_ != nullptr && owns_workspace_) cudaFree(workspace_);
}

// The double has one way to multiply, so nothing to time: the count is checked as the real one checks it (the
// GEMM bench, built on the emulator for gpu-check's emulated mode, sets it).
void MatmulContext::set_timed_candidates(int candidates) {
  TUNA_CHECK(candidates >= 1 && candidates <= kMaxTimedCandidates, "timed candidates ", candidates, ", expected 1 to ",
             kMaxTimedCandidates);
  timed_candidates_ = candidates;
}

void matmul_fwd(MatmulContext&, __nv_bfloat16* out, const __nv_bfloat16* inp, const __nv_bfloat16* weight, int64_t n,
                int64_t ic, int64_t oc, cudaStream_t stream) {
  matmul_fwd_host(out, inp, weight, nullptr, n, ic, oc, oc, stream);
}

void matmul_residual_fwd(MatmulContext&, __nv_bfloat16* out, const __nv_bfloat16* inp, const __nv_bfloat16* weight,
                         const __nv_bfloat16* residual, int64_t n, int64_t ic, int64_t oc, cudaStream_t stream) {
  TUNA_CHECK(residual != nullptr, "matmul_residual_fwd: no residual (matmul_fwd is the product alone)");
  matmul_fwd_host(out, inp, weight, residual, n, ic, oc, oc, stream);
}

void matmul_add_fwd(MatmulContext&, __nv_bfloat16* out, int64_t ld_out, const __nv_bfloat16* inp,
                    const __nv_bfloat16* weight, int64_t n, int64_t ic, int64_t oc, cudaStream_t stream) {
  matmul_fwd_host(out, inp, weight, out, n, ic, oc, ld_out, stream);
}

void matmul_bwd(MatmulContext& ctx, __nv_bfloat16* dinp, float* dweight, const __nv_bfloat16* dout,
                const __nv_bfloat16* inp, const __nv_bfloat16* weight, int64_t n, int64_t ic, int64_t oc,
                bool accumulate_dinp, GradWrite dweight_write, cudaStream_t stream) {
  matmul_bwd_strided(ctx, dinp, dweight, dout, oc, inp, weight, n, ic, oc, accumulate_dinp, dweight_write, stream);
}

void matmul_bwd_strided(MatmulContext&, __nv_bfloat16* dinp, float* dweight, const __nv_bfloat16* dout,
                        int64_t ld_dout, const __nv_bfloat16* inp, const __nv_bfloat16* weight, int64_t n, int64_t ic,
                        int64_t oc, bool accumulate_dinp, GradWrite dweight_write, cudaStream_t stream) {
  TUNA_CHECK(n >= 0 && ic > 0 && oc > 0 && ld_dout >= oc, "n ", n, ", ic ", ic, ", oc ", oc, ", ld_dout ", ld_dout);
  const bool overwrite_dweight = dweight_write == GradWrite::Overwrite;
  if (n == 0) {  // a sum over no rows: an overwritten gradient is zero
    if (dweight != nullptr && overwrite_dweight) {
      check_operand(dweight, oc * ic, 4, "dweight");
      tuna::emulator::enqueue(stream, [=] { std::fill(dweight, dweight + oc * ic, 0.0f); });
    }
    return;
  }
  check_operand(dout, (n - 1) * ld_dout + oc, 2, "dout");
  if (dinp != nullptr) {
    check_operand(dinp, n * ic, 2, "dinp");
    check_operand(weight, oc * ic, 2, "weight");
    tuna::emulator::enqueue(stream, [=] {
      std::vector<float> acc(ic);
      for (int64_t r = 0; r < n; ++r) {  // dinp[r, :] (=|+=) sum over o of dout[r, o] weight[o, :]
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t o = 0; o < oc; ++o) {
          const float d = widen(dout[r * ld_dout + o]);
          for (int64_t i = 0; i < ic; ++i) acc[i] += d * widen(weight[o * ic + i]);
        }
        for (int64_t i = 0; i < ic; ++i)
          dinp[r * ic + i] = __float2bfloat16_rn(accumulate_dinp ? acc[i] + widen(dinp[r * ic + i]) : acc[i]);
      }
    });
  }
  if (dweight != nullptr) {
    check_operand(dweight, oc * ic, 4, "dweight");
    check_operand(inp, n * ic, 2, "inp");
    tuna::emulator::enqueue(stream, [=] {
      std::vector<float> acc(ic);
      for (int64_t o = 0; o < oc; ++o) {  // dweight[o, :] (=|+=) sum over r of dout[r, o] inp[r, :]
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t r = 0; r < n; ++r) {
          const float d = widen(dout[r * ld_dout + o]);
          for (int64_t i = 0; i < ic; ++i) acc[i] += d * widen(inp[r * ic + i]);
        }
        for (int64_t i = 0; i < ic; ++i) dweight[o * ic + i] = overwrite_dweight ? acc[i] : dweight[o * ic + i] + acc[i];
      }
    });
  }
}

void matmul_fp8_fwd(MatmulContext&, __nv_bfloat16* out, Fp8Operand inp, Fp8Operand weight, int64_t n, int64_t ic,
                    int64_t oc, cudaStream_t) {
  check_fp8_shape("matmul_fp8_fwd", n, ic, oc,
                  {{"out", out}, {"inp", inp.codes}, {"weight", weight.codes}, {"inp's scale", inp.inv_scale},
                   {"weight's scale", weight.inv_scale}});
  matmul_fp8_fwd_host(out, inp, weight, nullptr, n, ic, oc);
}

void matmul_fp8_residual_fwd(MatmulContext&, __nv_bfloat16* out, Fp8Operand inp, Fp8Operand weight,
                             const __nv_bfloat16* residual, int64_t n, int64_t ic, int64_t oc, cudaStream_t) {
  TUNA_CHECK(residual != nullptr, "matmul_fp8_residual_fwd: no residual (matmul_fp8_fwd is the product alone)");
  check_fp8_shape("matmul_fp8_residual_fwd", n, ic, oc,
                  {{"out", out}, {"inp", inp.codes}, {"weight", weight.codes}, {"residual", residual},
                   {"inp's scale", inp.inv_scale}, {"weight's scale", weight.inv_scale}});
  matmul_fp8_fwd_host(out, inp, weight, residual, n, ic, oc);
}

void matmul_fp8_bwd(MatmulContext&, __nv_bfloat16* dinp, float* dweight, Fp8Operand dout, Fp8Operand dout_t,
                    Fp8Operand inp_t, Fp8Operand weight_t, int64_t n, int64_t ic, int64_t oc, bool accumulate_dinp,
                    GradWrite dweight_write, cudaStream_t) {
  check_fp8_shape("matmul_fp8_bwd", n, ic, oc,
                  {{"dinp", dinp}, {"dweight", dweight}, {"dout", dinp ? dout.codes : nullptr},
                   {"dout_t", dweight ? dout_t.codes : nullptr}, {"inp_t", dweight ? inp_t.codes : nullptr},
                   {"weight_t", dinp ? weight_t.codes : nullptr}, {"dout's scale", dinp ? dout.inv_scale : nullptr},
                   {"dout_t's scale", dweight ? dout_t.inv_scale : nullptr},
                   {"inp_t's scale", dweight ? inp_t.inv_scale : nullptr},
                   {"weight_t's scale", dinp ? weight_t.inv_scale : nullptr}});
  tuna::emulator::ApiGuard guard(tuna::emulator::api_lock());
  const bool overwrite_dweight = dweight_write == GradWrite::Overwrite;
  if (n == 0) {  // a sum over no rows: an overwritten gradient is zero
    if (dweight != nullptr && overwrite_dweight) {
      check_operand(dweight, oc * ic, 4, "dweight");
      std::fill(dweight, dweight + oc * ic, 0.0f);
    }
    return;
  }
  if (dinp != nullptr)
    fp8_product(dinp, ic, dout.codes, cpu::Fp8Format::E5M2, dout.inv_scale, weight_t.codes, cpu::Fp8Format::E4M3,
                weight_t.inv_scale, n, ic, oc, accumulate_dinp);
  if (dweight != nullptr)
    fp8_product(dweight, ic, dout_t.codes, cpu::Fp8Format::E5M2, dout_t.inv_scale, inp_t.codes, cpu::Fp8Format::E4M3,
                inp_t.inv_scale, oc, ic, n, !overwrite_dweight);
}

}  // namespace tuna::cuda
