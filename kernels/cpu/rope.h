// Rotary position embedding with Hugging Face's rotate-half pairing. CPU twin of kernels/rope.cuh.
#pragma once
#include <cstdint>
#include <string>

namespace tuna::cpu {

// Frequency scaling as in HF's rope_scaling / rope_parameters.
struct RopeScaling {
  std::string type = "default";  // "default" (none) or "llama3"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// inv_freq[i] = theta^(-2i/head_dim) for i < head_dim/2, then llama3 scaling when asked. Host-side; the
// GPU backend uploads the same table.
void rope_inv_freq(double* inv_freq, int64_t head_dim, double theta, const RopeScaling& scaling);

// cos_table[t, i] = cos(t * inv_freq[i]), sin_table likewise; [seq_len, head_dim/2]. Overwrites.
template <typename T>
void rope_table(T* cos_table, T* sin_table, const double* inv_freq, int64_t seq_len, int64_t head_dim);

// x: [batch, seq_len, n_heads, head_dim], position of row (b, t) is positions[b * seq_len + t] (null: t; packed
// documents restart theirs), each below the table's rows. With h = head_dim/2 and c, s the table entries at
// (position, i):  out[i] = x[i] c - x[i+h] s;  out[i+h] = x[i+h] c + x[i] s.
// The n_heads * head_dim values of position (b, t) start at inp + (b seq_len + t) inp_stride and at out +
// (b seq_len + t) out_stride: strides of n_heads * head_dim are plain arrays, wider ones read q or k out of a
// fused q|k|v GEMM output (and write their gradients into one). Each stride >= n_heads * head_dim.
// Overwrites out; out == inp (in place) is allowed with equal strides.
template <typename T>
void rope_fwd(T* out, const T* inp, const T* cos_table, const T* sin_table, int64_t batch, int64_t seq_len,
              int64_t n_heads, int64_t head_dim, int64_t out_stride, int64_t inp_stride,
              const int32_t* positions = nullptr);

// The transpose rotation (positions as rope_fwd's): dinp[i] = dout[i] c + dout[i+h] s;  dinp[i+h] = dout[i+h] c - dout[i] s. Strides as
// rope_fwd's. Overwrites dinp; dinp == dout (in place) is allowed with equal strides.
template <typename T>
void rope_bwd(T* dinp, const T* dout, const T* cos_table, const T* sin_table, int64_t batch, int64_t seq_len,
              int64_t n_heads, int64_t head_dim, int64_t dinp_stride, int64_t dout_stride,
              const int32_t* positions = nullptr);

}  // namespace tuna::cpu
