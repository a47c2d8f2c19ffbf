// Rotary position embedding with Hugging Face's rotate-half pairing. CPU twin of kernels/rope.cuh.
#pragma once
#include <cstdint>
#include <string>

namespace tuna::cpu {

// Frequency scaling as in transformers' rope_scaling / rope_parameters (modeling_rope_utils.py of the pinned
// transformers 4.46, tools/reference/requirements.txt): "default" (none), "llama3", "linear", "dynamic" (NTK-aware)
// or "yarn". Which fields a type reads:
//   llama3:  factor, low_freq_factor, high_freq_factor, original_max_position_embeddings (its own field);
//   linear:  factor;
//   dynamic: factor and original_max_position_embeddings, which transformers takes from config.json's
//            max_position_embeddings (not rope_scaling's field of that name: it ignores that one);
//   yarn:    factor, beta_fast, beta_slow, attention_factor, and original_max_position_embeddings, again the
//            config's max_position_embeddings.
struct RopeScaling {
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  double beta_fast = 32.0, beta_slow = 1.0;  // yarn's defaults
  double attention_factor = 0.0;             // yarn; 0: not given, 0.1 ln(factor) + 1
};

// inv_freq[i] = theta^(-2i/head_dim) for i < head_dim/2, then the scaling's rule. Host-side; the GPU backend
// uploads tables made from the same values. `context` matters to dynamic only: the length of the sequence the
// frequencies are for (the largest position rotated + 1; below original_max_position_embeddings, that).
void rope_inv_freq(double* inv_freq, int64_t head_dim, double theta, const RopeScaling& scaling,
                   int64_t context = 0);

// The factor transformers multiplies cos and sin with (its attention_scaling): yarn's attention_factor, 1 for
// every other type. It scales q.k by its square, as a softmax temperature.
double rope_attention_factor(const RopeScaling& scaling);

// The rows of positions [first, first + rows) of the tables below, for a model with this head_dim, theta and
// scaling, in a forward whose sequence is `context` long (dynamic's length; rope_inv_freq): rope_inv_freq, then
// rope_table with rope_attention_factor. The one place both engines and the samplers make their tables from.
template <typename T>
void rope_tables(T* cos_table, T* sin_table, int64_t first, int64_t rows, int64_t head_dim, double theta,
                 const RopeScaling& scaling, int64_t context);

// cos_table[t, i] = scale cos((first + t) inv_freq[i]), sin_table likewise; [seq_len, head_dim/2]. Overwrites.
template <typename T>
void rope_table(T* cos_table, T* sin_table, const double* inv_freq, int64_t seq_len, int64_t head_dim,
                double scale = 1.0, int64_t first = 0);

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
