// Rotary position embedding (HF rotate-half pairing), CPU twin of kernels/rope.cu.
//
//   inv_freq[i] = 1 / theta^(2i / head_dim), i < head_dim/2, then the rope_scaling rule (below).
//   tables:   cos_table[t, i] = a cos(t * inv_freq[i]), sin_table likewise    [seq_len, head_dim/2], OVERWRITTEN
//             (a: the scaling's attention factor, yarn's; 1 otherwise)
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

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

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
void check_scaling(const RopeScaling& scaling, int64_t head_dim) {
  const std::string& type = scaling.type;
  if (type == "default") return;
  if (type != "llama3" && type != "linear" && type != "dynamic" && type != "yarn")
    fail("rope_scaling: field 'rope_type': expected \"default\", \"llama3\", \"linear\", \"dynamic\" or \"yarn\", found \"",
         type, "\"");
  // transformers only warns below 1; a factor below 1 would shorten the context, which none of these means.
  if (!(scaling.factor >= 1.0))
    fail("rope_scaling (", type, "): field 'factor': expected a number >= 1, found ", scaling.factor);
  if (type == "llama3") {
    if (!(scaling.low_freq_factor > 0.0))
      fail("rope_scaling (llama3): field 'low_freq_factor': expected a positive number, found ",
           scaling.low_freq_factor);
    if (!(scaling.high_freq_factor > scaling.low_freq_factor))
      fail("rope_scaling (llama3): field 'high_freq_factor': expected more than low_freq_factor (",
           scaling.low_freq_factor, "), found ", scaling.high_freq_factor);
  }
  if (type != "linear" && scaling.original_max_position_embeddings <= 0)
    fail("rope_scaling (", type, "): field 'original_max_position_embeddings': expected a positive integer, found ",
         scaling.original_max_position_embeddings);
  if (type == "dynamic" && head_dim <= 2)
    fail("rope_scaling (dynamic): head_dim ", head_dim, ": the NTK exponent head_dim / (head_dim - 2) needs more than 2");
  if (type == "yarn") {
    if (!(scaling.beta_fast > scaling.beta_slow && scaling.beta_slow > 0.0))
      fail("rope_scaling (yarn): fields 'beta_fast' and 'beta_slow': expected beta_fast > beta_slow > 0, found ",
           scaling.beta_fast, " and ", scaling.beta_slow);
    if (scaling.attention_factor < 0.0)
      fail("rope_scaling (yarn): field 'attention_factor': expected a positive number, found ",
           scaling.attention_factor);
  }
}

// YaRN (transformers' _compute_yarn_parameters): frequencies that turn fewer than beta_slow times over the
// original context are interpolated (divided by factor), those that turn more than beta_fast times are kept
// (extrapolated), and the dimensions in between are blended by a linear ramp over the dimension index. The
// correction range is computed from the original context, in whole dimensions (floor / ceil), as transformers does.
void yarn_inv_freq(double* inv_freq, int64_t head_dim, double theta, const RopeScaling& scaling) {
  const double dim = static_cast<double>(head_dim);
  const double original = static_cast<double>(scaling.original_max_position_embeddings);
  auto correction_dim = [&](double rotations) {
    return dim * std::log(original / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(theta));
  };
  const double low = std::max(std::floor(correction_dim(scaling.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(scaling.beta_slow)), dim - 1.0);
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const double pos_freq = std::pow(theta, static_cast<double>(2 * i) / dim);
    const double extrapolation = 1.0 / pos_freq, interpolation = 1.0 / (scaling.factor * pos_freq);
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_factor = 1.0 - ramp;
    inv_freq[i] = interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
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

void rope_inv_freq(double* inv_freq, int64_t head_dim, double theta, const RopeScaling& scaling, int64_t context) {
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail("rope: head_dim must be a positive even number, found ", head_dim);
  if (!(theta > 0.0)) fail("rope: field 'rope_theta': expected a positive number, found ", theta);
  check_scaling(scaling, head_dim);
  const std::string& type = scaling.type;
  if (type == "yarn") return yarn_inv_freq(inv_freq, head_dim, theta, scaling);

  double base = theta;
  if (type == "dynamic") {
    // Dynamic NTK (transformers' _compute_dynamic_ntk_parameters): up to the original context the frequencies are
    // the default ones; beyond it the base grows with the sequence's length L as
    //   base' = theta (factor L / original - (factor - 1))^(d / (d - 2)).
    // So the frequencies depend on the forward's length: transformers recomputes them in each forward whose
    // largest position + 1 exceeds what it last computed them for (rotary_emb._dynamic_frequency_update). When
    // training (no cache) every position of the batch is rotated with the frequencies of that batch's length; when
    // generating with a KV cache each new position is rotated with the frequencies of the length at the time it
    // was appended, and the cached keys keep the rotation they were cached with.
    const double original = static_cast<double>(scaling.original_max_position_embeddings);
    const double length = std::max(static_cast<double>(context), original);
    const double d = static_cast<double>(head_dim);
    base = theta * std::pow(scaling.factor * length / original - (scaling.factor - 1.0), d / (d - 2.0));
  }
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    // Written as HF writes it (1 / base^(2i/d)) rather than base^(-2i/d), so the two round alike.
    const double unscaled = 1.0 / std::pow(base, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    if (type == "llama3") inv_freq[i] = llama3_scaled(unscaled, scaling);
    else if (type == "linear") inv_freq[i] = unscaled / scaling.factor;  // positions divided by factor
    else inv_freq[i] = unscaled;
  }
}

double rope_attention_factor(const RopeScaling& scaling) {
  if (scaling.type != "yarn") return 1.0;
  // transformers' default (the YaRN paper's sqrt(1/t) = 0.1 ln(s) + 1), unless config.json gives one.
  return scaling.attention_factor > 0.0 ? scaling.attention_factor : 0.1 * std::log(scaling.factor) + 1.0;
}

template <typename T>
void rope_table(T* cos_table, T* sin_table, const double* inv_freq, int64_t seq_len, int64_t head_dim, double scale,
                int64_t first) {
  TUNA_CHECK(seq_len >= 0 && head_dim > 0 && head_dim % 2 == 0 && first >= 0, "seq_len ", seq_len, ", head_dim ",
             head_dim, ", first ", first);
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < seq_len; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(first + t) * inv_freq[i];
      cos_table[t * half + i] = static_cast<T>(scale * std::cos(angle));
      sin_table[t * half + i] = static_cast<T>(scale * std::sin(angle));
    }
  }
}

template <typename T>
void rope_tables(T* cos_table, T* sin_table, int64_t first, int64_t rows, int64_t head_dim, double theta,
                 const RopeScaling& scaling, int64_t context) {
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail("rope: head_dim must be a positive even number, found ", head_dim);
  std::vector<double> inv_freq(head_dim / 2);
  rope_inv_freq(inv_freq.data(), head_dim, theta, scaling, context);
  rope_table(cos_table, sin_table, inv_freq.data(), rows, head_dim, rope_attention_factor(scaling), first);
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

template void rope_table<float>(float*, float*, const double*, int64_t, int64_t, double, int64_t);
template void rope_table<double>(double*, double*, const double*, int64_t, int64_t, double, int64_t);
template void rope_tables<float>(float*, float*, int64_t, int64_t, int64_t, double, const RopeScaling&, int64_t);
template void rope_tables<double>(double*, double*, int64_t, int64_t, int64_t, double, const RopeScaling&, int64_t);
template void rope_fwd<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, const int32_t*);
template void rope_fwd<double>(double*, const double*, const double*, const double*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, int64_t, const int32_t*);
template void rope_bwd<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, const int32_t*);
template void rope_bwd<double>(double*, const double*, const double*, const double*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, int64_t, const int32_t*);

}  // namespace tuna::cpu
