// Causal grouped-query attention, FlashAttention-2 style: the launchers. The twin of kernels/cpu/attention.cpp.
//
//   forward:  s[t, j] = (q_t . k_j) / sqrt(d), j <= t;  lse_t = log sum_j exp s[t, j];  out_t = sum_j p[t, j] v_j
//                                                                       out (bf16), lse (fp32): OVERWRITTEN
//   backward: D_t = dout_t . out_t;  ds = p (dout_t . v_j - D_t);  dq = scale ds k;  dk = scale ds^T q;  dv = p^T dout
//                                                                       dq, dk, dv (bf16): OVERWRITTEN
// The kernels (attention_kernels.cuh) are instantiated per head dim in attention_{fwd,bwd}_hd{64,128}.cu;
// head dims 8, 16, 32 (tiny test models) take the plain fp32 kernels of attention_small.cu.
// Precision: scores and softmax in fp32; P and dS are rounded to bf16 as the A operand of the second product
// of each pair (as in FlashAttention-2); every product accumulates in fp32.
#include "kernels/attention.cuh"

#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/attention_params.cuh"
#include "kernels/common.cuh"  // aligned16
#include "kernels/rope.cuh"
#include "kernels/scratch.h"

namespace tuna::cuda {

namespace {

AttentionParams make_params(int64_t batch, int64_t seq_len, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim) {
  TUNA_CHECK(batch >= 0 && seq_len >= 0 && n_heads > 0 && n_kv_heads > 0, "batch ", batch, ", seq_len ", seq_len,
             ", n_heads ", n_heads, ", n_kv_heads ", n_kv_heads);
  TUNA_CHECK(n_heads % n_kv_heads == 0, "n_heads ", n_heads, " is not a multiple of n_kv_heads ", n_kv_heads);
  TUNA_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 8 || head_dim == 16 || head_dim == 32,
             "attention supports head_dim 64 and 128 (and 8, 16, 32 for tiny models), not ", head_dim);
  TUNA_CHECK(seq_len < (int64_t(1) << 30) && batch < 65536 && n_heads < 65536, "shape too large");
  AttentionParams p{};
  p.batch = static_cast<int>(batch);
  p.seq_len = static_cast<int>(seq_len);
  p.n_heads = static_cast<int>(n_heads);
  p.n_kv_heads = static_cast<int>(n_kv_heads);
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  p.scale_log2 = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)) * 1.4426950408889634);
  return p;
}

}  // namespace

bool attention_hopper_available() {
  int device = 0, major = 0, minor = 0;
  TUNA_CUDA_CHECK(cudaGetDevice(&device));
  TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TUNA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0 && attention_sm90_image_present();
}

AttentionPath resolve_attention_path(AttentionPath path) {
  if (path != AttentionPath::kDefault) return path;
  static const bool hopper = kHopperByDefault && attention_hopper_available();
  return hopper ? AttentionPath::kHopper : AttentionPath::kMma;
}

const char* attention_path_name(AttentionPath path) {
  switch (path) {
    case AttentionPath::kDefault: return "default";
    case AttentionPath::kMma: return "mma";
    case AttentionPath::kHopper: return "hopper";
  }
  return "unknown";
}

void attention_fwd(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                   const __nv_bfloat16* v, int64_t batch, int64_t seq_len, int64_t n_heads, int64_t n_kv_heads,
                   int64_t head_dim, const int32_t* doc_start, cudaStream_t stream, AttentionPath path,
                   int* tile_counter) {
  AttentionParams p = make_params(batch, seq_len, n_heads, n_kv_heads, head_dim);
  if (batch == 0 || seq_len == 0) return;
  p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse, p.doc_start = doc_start, p.tile_counter = tile_counter;
  const bool hopper = resolve_attention_path(path) == AttentionPath::kHopper && (head_dim == 64 || head_dim == 128);
  if (head_dim == 64) hopper ? attention_sm90_fwd_hd64(p, stream) : attention_fwd_hd64(p, stream);
  else if (head_dim == 128) hopper ? attention_sm90_fwd_hd128(p, stream) : attention_fwd_hd128(p, stream);
  else attention_small(p, static_cast<int>(head_dim), /*backward=*/false, stream);
}

int64_t attention_bwd_scratch_floats(int64_t batch, int64_t seq_len, int64_t n_heads, int64_t head_dim,
                                     AttentionPath path) {
  return gpu_scratch::attention_bwd_floats(batch, seq_len, n_heads, head_dim, path);
}

void attention_bwd(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                   const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                   const __nv_bfloat16* v, float* scratch, int64_t batch, int64_t seq_len, int64_t n_heads,
                   int64_t n_kv_heads, int64_t head_dim, const int32_t* doc_start, cudaStream_t stream,
                   AttentionPath path, AttentionRope rope) {
  AttentionParams p = make_params(batch, seq_len, n_heads, n_kv_heads, head_dim);
  if (batch == 0 || seq_len == 0) return;
  p.q = q, p.k = k, p.v = v, p.dout = dout, p.dq = dq, p.dk = dk, p.dv = dv, p.delta = scratch;
  p.doc_start = doc_start;
  // The kernels only read out and lse in the backward; the params struct is shared with the forward.
  p.out = const_cast<__nv_bfloat16*>(out);
  p.lse = const_cast<float*>(lse);
  TUNA_CHECK((rope.cos_table == nullptr) == (rope.sin_table == nullptr), "attention_bwd: RoPE needs both tables");
  // The hopper dQ finish reads the tables 16 bytes at a time, and so does rope.cu's vector kernel, which the mma
  // path's rope_bwd picks by the rows' alignment alone.
  TUNA_CHECK(rope.cos_table == nullptr || (aligned16(rope.cos_table) && aligned16(rope.sin_table)),
             "attention_bwd: the RoPE tables must be 16-byte aligned; found cos_table at ",
             static_cast<const void*>(rope.cos_table), ", sin_table at ", static_cast<const void*>(rope.sin_table));
  const bool hopper = resolve_attention_path(path) == AttentionPath::kHopper && (head_dim == 64 || head_dim == 128);
  if (hopper) {
    (head_dim == 64 ? attention_sm90_bwd_hd64 : attention_sm90_bwd_hd128)(p, scratch, rope.cos_table, rope.sin_table,
                                                                          rope.positions, stream);
    return;
  }
  if (head_dim == 64) attention_bwd_hd64(p, stream);
  else if (head_dim == 128) attention_bwd_hd128(p, stream);
  else attention_small(p, static_cast<int>(head_dim), /*backward=*/true, stream);
  if (rope.cos_table != nullptr) {
    rope_bwd(dq, dq, rope.cos_table, rope.sin_table, batch, seq_len, n_heads, head_dim, n_heads * head_dim,
             n_heads * head_dim, rope.positions, stream);
    rope_bwd(dk, dk, rope.cos_table, rope.sin_table, batch, seq_len, n_kv_heads, head_dim, n_kv_heads * head_dim,
             n_kv_heads * head_dim, rope.positions, stream);
  }
}

}  // namespace tuna::cuda
