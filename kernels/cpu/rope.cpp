// Rotary position embedding (HF rotate-half pairing), CPU twin of kernels/rope.cu.
//
//   inv_freq[i] = 1 / theta^(2i / head_dim), i < head_dim/2, then the rope_scaling rule (llama3 below).
//   tables:   cos_table[t, i] = cos(t * inv_freq[i]), sin_table likewise      [seq_len, head_dim/2], OVERWRITTEN
//   forward:  with h = head_dim/2 and (c, s) the table entries at (t, i), for each row x at position t:
//             out[i] = x[i] c - x[i+h] s;   out[i+h] = x[i+h] c + x[i] s              OVERWRITTEN, may alias inp
//   backward: the transpose (inverse) rotation:
//             dinp[i] = g[i] c + g[i+h] s;  dinp[i+h] = g[i+h] c - g[i] s            OVERWRITTEN, may alias dout
//   q, k layout: [batch, seq_len, n_heads, head_dim]; the position of sequence row t is positions[b, t] (t when
//   null: packed documents restart their positions, and the table is indexed by them); each position's
//   n_heads * head_dim values start a row stride apart (in and out each their own: a fused q|k|v buffer's row).
//
// Each pair (i, i+h) is read completely before either element is written, which is what makes in-place safe.
#include "kernels/cpu/rope.h"

#include <cmath>
#include <numbers>

#include "core/error.h"
#include "kernels/cpu/parallel.h"

namespace tuna::cpu {
namespace {

// Llama 3.1's frequency-dependent scaling, the same rule as transformers' _compute_llama3_parameters:
// wavelengths longer than the original context are stretched by `factor`, wavelengths shorter than
// original/high_freq_factor are kept, and the band in between is blended linearly in original/wavelen.
double llama3_scaled(double inv_freq, const RopeScaling& scaling) {
  const double original = static_cast<double>(scaling.original_max_position_embeddings);
  const double low_freq_wavelen = original / scaling.low_freq_factor;
  const double high_freq_wavelen = original / scaling.high_freq_factor;
  const double wavelen = 2.0 * std::numbers::pi / inv_freq;
  if (wavelen > low_freq_wavelen) return inv_freq / scaling.factor;
  if (wavelen < high_freq_wavelen) return inv_freq;
  const double smooth = (original / wavelen - scaling.low_freq_factor) /
                        (scaling.high_freq_factor - scaling.low_freq_factor);
  return (1.0 - smooth) * inv_freq / scaling.factor + smooth * inv_freq;
}

// The scaling fields come from a model's config.json, so bad values are user errors, named by field.
void check_llama3(const RopeScaling& scaling) {
  if (!(scaling.factor > 0.0))
    fail("rope_scaling (llama3): field 'factor': expected a positive number, found ", scaling.factor);
  if (!(scaling.low_freq_factor > 0.0))
    fail("rope_scaling (llama3): field 'low_freq_factor': expected a positive number, found ",
         scaling.low_freq_factor);
  if (!(scaling.high_freq_factor > scaling.low_freq_factor))
    fail("rope_scaling (llama3): field 'high_freq_factor': expected more than low_freq_factor (",
         scaling.low_freq_factor, "), found ", scaling.high_freq_factor);
  if (scaling.original_max_position_embeddings <= 0)
    fail("rope_scaling (llama3): field 'original_max_position_embeddings': expected a positive integer, found ",
         scaling.original_max_position_embeddings);
}

// Rotates every head row by its position's angles; sign = +1 is the forward rotation, -1 its transpose.
template <typename T>
void rotate_rows(T* out, const T* inp, const T* cos_table, const T* sin_table, int64_t batch, int64_t seq_len,
                 int64_t n_heads, int64_t head_dim, int64_t out_stride, int64_t inp_stride, T sign,
                 const int32_t* positions) {
  TUNA_CHECK(batch >= 0 && seq_len >= 0 && n_heads > 0 && head_dim > 0 && head_dim % 2 == 0 &&
                 out_stride >= n_heads * head_dim && inp_stride >= n_heads * head_dim,
             "batch ", batch, ", seq_len ", seq_len, ", n_heads ", n_heads, ", head_dim ", head_dim, ", out_stride ",
             out_stride, ", inp_stride ", inp_stride);
  const int64_t half = head_dim / 2;
  const int64_t n_rows = batch * seq_len * n_heads;
#pragma omp parallel for schedule(static) if (n_rows * head_dim >= kMinParallelWork)
  for (int64_t row = 0; row < n_rows; ++row) {
    const int64_t position = row / n_heads, head = row % n_heads;
    const int64_t t = positions ? positions[position] : position % seq_len;
    const T* c = cos_table + t * half;
    const T* s = sin_table + t * half;
    const T* x = inp + position * inp_stride + head * head_dim;
    T* y = out + position * out_stride + head * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const T first = x[i];
      const T second = x[i + half];
      const T signed_sin = sign * s[i];
      y[i] = first * c[i] - second * signed_sin;
      y[i + half] = second * c[i] + first * signed_sin;
    }
  }
}

}  // namespace

void rope_inv_freq(double* inv_freq, int64_t head_dim, double theta, const RopeScaling& scaling) {
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail("rope: head_dim must be a positive even number, found ", head_dim);
  if (!(theta > 0.0)) fail("rope: field 'rope_theta': expected a positive number, found ", theta);
  const bool llama3 = scaling.type == "llama3";
  if (!llama3 && scaling.type != "default")
    fail("rope_scaling: field 'rope_type': expected \"default\" or \"llama3\", found \"", scaling.type, "\"");
  if (llama3) check_llama3(scaling);

  for (int64_t i = 0; i < head_dim / 2; ++i) {
    // Written as HF writes it (1 / base^(2i/d)) rather than base^(-2i/d), so the two round alike.
    const double unscaled = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    inv_freq[i] = llama3 ? llama3_scaled(unscaled, scaling) : unscaled;
  }
}

template <typename T>
void rope_table(T* cos_table, T* sin_table, const double* inv_freq, int64_t seq_len, int64_t head_dim) {
  TUNA_CHECK(seq_len >= 0 && head_dim > 0 && head_dim % 2 == 0, "seq_len ", seq_len, ", head_dim ", head_dim);
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < seq_len; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[i];
      cos_table[t * half + i] = static_cast<T>(std::cos(angle));
      sin_table[t * half + i] = static_cast<T>(std::sin(angle));
    }
  }
}

template <typename T>
void rope_fwd(T* out, const T* inp, const T* cos_table, const T* sin_table, int64_t batch, int64_t seq_len,
              int64_t n_heads, int64_t head_dim, int64_t out_stride, int64_t inp_stride, const int32_t* positions) {
  rotate_rows(out, inp, cos_table, sin_table, batch, seq_len, n_heads, head_dim, out_stride, inp_stride, T(1),
              positions);
}

template <typename T>
void rope_bwd(T* dinp, const T* dout, const T* cos_table, const T* sin_table, int64_t batch, int64_t seq_len,
              int64_t n_heads, int64_t head_dim, int64_t dinp_stride, int64_t dout_stride, const int32_t* positions) {
  // The transpose of a rotation by angle a is the rotation by -a: cos stays, sin flips sign.
  rotate_rows(dinp, dout, cos_table, sin_table, batch, seq_len, n_heads, head_dim, dinp_stride, dout_stride, T(-1),
              positions);
}

template void rope_table<float>(float*, float*, const double*, int64_t, int64_t);
template void rope_table<double>(double*, double*, const double*, int64_t, int64_t);
template void rope_fwd<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, const int32_t*);
template void rope_fwd<double>(double*, const double*, const double*, const double*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, int64_t, const int32_t*);
template void rope_bwd<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, const int32_t*);
template void rope_bwd<double>(double*, const double*, const double*, const double*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, int64_t, const int32_t*);

}  // namespace tuna::cpu
