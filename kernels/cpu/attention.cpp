// Causal grouped-query self-attention, CPU twin of kernels/attention.cu, with the FlashAttention contract:
// the seq x seq probability matrix is never stored; the forward keeps only each query's logsumexp (lse) and
// the backward recomputes the probabilities from q, k and lse.
//
//   q, out, dq, dout: [batch, seq_len, n_heads, head_dim];  k, v, dk, dv: [batch, seq_len, n_kv_heads, head_dim]
//   lse: [batch, n_heads, seq_len];  query head h reads kv head h / group, group = n_heads / n_kv_heads.
//
//   forward:  s[t, j] = (q_t . k_j) / sqrt(head_dim) for j <= t (causal);  lse_t = log sum_j exp(s[t, j])
//             p[t, j] = exp(s[t, j] - lse_t);  out_t = sum_j p[t, j] v_j                  out, lse: OVERWRITTEN
//   backward: D_t = dout_t . out_t   (= sum_j p[t, j] (dout_t . v_j), so no pass over dp is needed for it)
//             ds[t, j] = p[t, j] (dout_t . v_j - D_t)
//             dq_t = scale sum_j ds[t, j] k_j;   dk_j = scale sum_t ds[t, j] q_t;   dv_j = sum_t p[t, j] dout_t
//             dq, dk, dv: OVERWRITTEN; dk and dv sum over all query heads of their group.
//
// Scores, softmax and every accumulation are in double. The forward parallelizes over (batch, query head);
// the backward over (batch, kv head): one thread owns a kv head and visits its query heads and positions in
// a fixed order, so dk/dv need no atomics and do not depend on the thread count. `omp simd` marks only
// loops over independent outputs (never a reduction), so vectorizing them changes no rounding. Scratch per
// thread: about 6 * seq_len * head_dim doubles (25 MB at seq 4096, head_dim 128), never seq x seq.
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace tuna::cpu {
namespace {

// Shapes and the index arithmetic of the [batch, seq, heads, head_dim] layouts, in one place.
struct AttentionShape {
  int64_t batch;       // independent sequences
  int64_t seq_len;     // positions per sequence
  int64_t n_heads;     // query heads
  int64_t n_kv_heads;  // key/value heads; divides n_heads
  int64_t head_dim;    // features per head

  int64_t group() const { return n_heads / n_kv_heads; }
  // Offset of the head_dim-long row of query head h at position t of sequence b (q, out, dq, dout).
  int64_t q_row(int64_t b, int64_t t, int64_t h) const { return ((b * seq_len + t) * n_heads + h) * head_dim; }
  // Offset of the row of kv head kvh at position t of sequence b (k, v, dk, dv).
  int64_t kv_row(int64_t b, int64_t t, int64_t kvh) const {
    return ((b * seq_len + t) * n_kv_heads + kvh) * head_dim;
  }
  int64_t lse_index(int64_t b, int64_t h, int64_t t) const { return (b * n_heads + h) * seq_len + t; }
};

AttentionShape make_shape(int64_t batch, int64_t seq_len, int64_t n_heads, int64_t n_kv_heads,
                          int64_t head_dim) {
  TUNA_CHECK(batch >= 0 && seq_len >= 0 && n_heads > 0 && n_kv_heads > 0 && head_dim > 0, "batch ", batch,
             ", seq_len ", seq_len, ", n_heads ", n_heads, ", n_kv_heads ", n_kv_heads, ", head_dim ", head_dim);
  TUNA_CHECK(n_heads % n_kv_heads == 0, "n_heads ", n_heads, " is not a multiple of n_kv_heads ", n_kv_heads);
  return {batch, seq_len, n_heads, n_kv_heads, head_dim};
}

// One kv head of one sequence copied to double, in the layouts the inner loops want: every innermost loop
// below runs over independent outputs with unit stride (so the compiler can vectorize it and the CPU can
// overlap its iterations), and each output still sums its terms in the plain sequential order.
struct KvPanel {
  int64_t seq_len = 0, head_dim = 0;
  std::vector<double> keys;             // [seq_len, head_dim]
  std::vector<double> keys_by_dim;      // [head_dim, seq_len], keys transposed
  std::vector<double> values;           // [seq_len, head_dim]
  std::vector<double> values_by_dim;    // [head_dim, seq_len], values transposed

  KvPanel(int64_t seq_len, int64_t head_dim)
      : seq_len(seq_len), head_dim(head_dim), keys(seq_len * head_dim), keys_by_dim(seq_len * head_dim),
        values(seq_len * head_dim), values_by_dim(seq_len * head_dim) {}

  template <typename T>
  void load(const T* k, const T* v, const AttentionShape& shape, int64_t b, int64_t kvh) {
    for (int64_t j = 0; j < seq_len; ++j) {
      const T* k_j = k + shape.kv_row(b, j, kvh);
      const T* v_j = v + shape.kv_row(b, j, kvh);
      for (int64_t d = 0; d < head_dim; ++d) {
        keys[j * head_dim + d] = keys_by_dim[d * seq_len + j] = k_j[d];
        values[j * head_dim + d] = values_by_dim[d * seq_len + j] = v_j[d];
      }
    }
  }

  // scores[j] = scale * (query . key_j) for the causal range j <= t.
  void causal_scores(double* scores, const double* query, int64_t t, double scale) const {
    std::fill(scores, scores + t + 1, 0.0);
    for (int64_t d = 0; d < head_dim; ++d) {
      const double q_d = query[d];
      const double* key_column = keys_by_dim.data() + d * seq_len;
#pragma omp simd
      for (int64_t j = 0; j <= t; ++j) scores[j] += q_d * key_column[j];
    }
#pragma omp simd
    for (int64_t j = 0; j <= t; ++j) scores[j] *= scale;
  }

  // dots[j] = row . value_j for j <= t.
  void causal_value_dots(double* dots, const double* row, int64_t t) const {
    std::fill(dots, dots + t + 1, 0.0);
    for (int64_t d = 0; d < head_dim; ++d) {
      const double r_d = row[d];
      const double* value_column = values_by_dim.data() + d * seq_len;
#pragma omp simd
      for (int64_t j = 0; j <= t; ++j) dots[j] += r_d * value_column[j];
    }
  }
};

template <typename T>
void to_double(double* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

}  // namespace

template <typename T>
void attention_fwd(T* out, T* lse, const T* q, const T* k, const T* v, int64_t batch, int64_t seq_len,
                   int64_t n_heads, int64_t n_kv_heads, int64_t head_dim) {
  const AttentionShape shape = make_shape(batch, seq_len, n_heads, n_kv_heads, head_dim);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const int64_t n_units = batch * n_heads;
#pragma omp parallel
  {
    KvPanel panel(seq_len, head_dim);
    std::vector<double> query(head_dim), scores(seq_len), acc(head_dim);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < n_units; ++unit) {
      const int64_t b = unit / n_heads, h = unit % n_heads;
      panel.load(k, v, shape, b, h / shape.group());
      for (int64_t t = 0; t < seq_len; ++t) {
        to_double(query.data(), q + shape.q_row(b, t, h), head_dim);
        panel.causal_scores(scores.data(), query.data(), t, scale);
        const double max_score = *std::max_element(scores.begin(), scores.begin() + t + 1);
        double sum_exp = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j <= t; ++j) {
          const double weight = std::exp(scores[j] - max_score);
          sum_exp += weight;
          const double* value = panel.values.data() + j * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += weight * value[d];
        }
        T* out_t = out + shape.q_row(b, t, h);
        for (int64_t d = 0; d < head_dim; ++d) out_t[d] = static_cast<T>(acc[d] / sum_exp);
        lse[shape.lse_index(b, h, t)] = static_cast<T>(max_score + std::log(sum_exp));
      }
    }
  }
}

template <typename T>
void attention_bwd(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* lse, const T* q, const T* k,
                   const T* v, int64_t batch, int64_t seq_len, int64_t n_heads, int64_t n_kv_heads,
                   int64_t head_dim) {
  const AttentionShape shape = make_shape(batch, seq_len, n_heads, n_kv_heads, head_dim);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const int64_t n_units = batch * n_kv_heads;
#pragma omp parallel
  {
    KvPanel panel(seq_len, head_dim);
    std::vector<double> query(head_dim), grad_out(head_dim), dq_acc(head_dim);
    std::vector<double> probs(seq_len), dprobs(seq_len);
    // dk (unscaled) and dv of this unit's kv head over all positions, [seq_len, head_dim].
    std::vector<double> dk_acc(seq_len * head_dim), dv_acc(seq_len * head_dim);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < n_units; ++unit) {
      const int64_t b = unit / n_kv_heads, kvh = unit % n_kv_heads;
      panel.load(k, v, shape, b, kvh);
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0);
      for (int64_t h = kvh * shape.group(); h < (kvh + 1) * shape.group(); ++h) {
        for (int64_t t = 0; t < seq_len; ++t) {
          to_double(query.data(), q + shape.q_row(b, t, h), head_dim);
          to_double(grad_out.data(), dout + shape.q_row(b, t, h), head_dim);
          const T* out_t = out + shape.q_row(b, t, h);
          double d_t = 0.0;  // dout_t . out_t
          for (int64_t d = 0; d < head_dim; ++d) d_t += grad_out[d] * out_t[d];
          const double lse_t = lse[shape.lse_index(b, h, t)];

          panel.causal_scores(probs.data(), query.data(), t, scale);
          for (int64_t j = 0; j <= t; ++j) probs[j] = std::exp(probs[j] - lse_t);
          panel.causal_value_dots(dprobs.data(), grad_out.data(), t);
          std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
          for (int64_t j = 0; j <= t; ++j) {
            const double p = probs[j];
            const double ds = p * (dprobs[j] - d_t);
            const double* key = panel.keys.data() + j * head_dim;
            double* dk_j = dk_acc.data() + j * head_dim;
            double* dv_j = dv_acc.data() + j * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) {
              dq_acc[d] += ds * key[d];
              dk_j[d] += ds * query[d];
              dv_j[d] += p * grad_out[d];
            }
          }
          T* dq_t = dq + shape.q_row(b, t, h);
          for (int64_t d = 0; d < head_dim; ++d) dq_t[d] = static_cast<T>(scale * dq_acc[d]);
        }
      }
      for (int64_t j = 0; j < seq_len; ++j) {
        T* dk_j = dk + shape.kv_row(b, j, kvh);
        T* dv_j = dv + shape.kv_row(b, j, kvh);
        for (int64_t d = 0; d < head_dim; ++d) {
          dk_j[d] = static_cast<T>(scale * dk_acc[j * head_dim + d]);
          dv_j[d] = static_cast<T>(dv_acc[j * head_dim + d]);
        }
      }
    }
  }
}

template void attention_fwd<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t,
                                   int64_t, int64_t, int64_t);
template void attention_fwd<double>(double*, double*, const double*, const double*, const double*, int64_t,
                                    int64_t, int64_t, int64_t, int64_t);
template void attention_bwd<float>(float*, float*, float*, const float*, const float*, const float*,
                                   const float*, const float*, const float*, int64_t, int64_t, int64_t,
                                   int64_t, int64_t);
template void attention_bwd<double>(double*, double*, double*, const double*, const double*, const double*,
                                    const double*, const double*, const double*, int64_t, int64_t, int64_t,
                                    int64_t, int64_t);

}  // namespace tuna::cpu
