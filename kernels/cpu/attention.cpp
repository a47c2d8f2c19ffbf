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
// Arithmetic is in T: fp32 for the CPU backend, double for the tests' float64 references. Every loop over
// positions or features is a unit-stride loop over independent outputs (`omp simd`), in functions compiled
// for the CPU's vector units (TUNA_CPU_CLONES, kernels/cpu/vector_math.h), with an exp that vectorizes
// (exp_lanes). The two reductions of a query row (the max and the sum of its weights) are vectorized too:
// their order is fixed by the code, not by the thread count. The forward parallelizes over (batch, query
// head); the backward over (batch, kv head): one thread owns a kv head and visits its query heads and
// positions in a fixed order, so dk/dv need no atomics and do not depend on the thread count. Scratch per
// thread: about 6 * seq_len * head_dim values of T (12 MB in fp32 at seq 4096, head_dim 128), never
// seq x seq.
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/vector_math.h"

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

// One kv head of one sequence, in the layouts the inner loops want: every innermost loop below runs over
// independent outputs with unit stride, and each output still sums its terms in the plain sequential order.
template <typename T>
struct KvPanel {
  int64_t seq_len = 0, head_dim = 0;
  std::vector<T> keys;                // [seq_len, head_dim]
  std::vector<double> keys_by_dim;    // [head_dim, seq_len], keys transposed, for the scores (double: below)
  std::vector<T> values;         // [seq_len, head_dim]
  std::vector<T> values_by_dim;  // [head_dim, seq_len], values transposed

  KvPanel(int64_t seq_len, int64_t head_dim)
      : seq_len(seq_len), head_dim(head_dim), keys(seq_len * head_dim), keys_by_dim(seq_len * head_dim),
        values(seq_len * head_dim), values_by_dim(seq_len * head_dim) {}

  void load(const T* k, const T* v, const AttentionShape& shape, int64_t b, int64_t kvh) {
    for (int64_t j = 0; j < seq_len; ++j) {
      const T* k_j = k + shape.kv_row(b, j, kvh);
      const T* v_j = v + shape.kv_row(b, j, kvh);
      std::copy(k_j, k_j + head_dim, keys.data() + j * head_dim);
      std::copy(v_j, v_j + head_dim, values.data() + j * head_dim);
      for (int64_t d = 0; d < head_dim; ++d) {
        keys_by_dim[d * seq_len + j] = k_j[d];
        values_by_dim[d * seq_len + j] = v_j[d];
      }
    }
  }
};

// Per-thread buffers of one query row: its scores (double), weights and their gradients over positions, and
// accumulators over features.
template <typename T>
struct RowScratch {
  std::vector<double> scores;
  std::vector<T> weights, dweights, acc;
  RowScratch(int64_t seq_len, int64_t head_dim)
      : scores(seq_len), weights(seq_len), dweights(seq_len), acc(head_dim) {}
};

// dots[j] = row . columns[:, j] for j < count, columns [head_dim, stride] (a transposed panel): head_dim
// passes of axpy over positions.
template <typename T, typename R>
inline void dots_by_position(T* dots, const R* row, const T* columns, int64_t head_dim, int64_t stride,
                             int64_t count) {
#pragma omp simd
  for (int64_t j = 0; j < count; ++j) dots[j] = row[0] * columns[j];
  for (int64_t d = 1; d < head_dim; ++d) {
    const T r_d = static_cast<T>(row[d]);
    const T* column = columns + d * stride;
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) dots[j] += r_d * column[j];
  }
}

// One query head h of sequence b, every position: out and lse.
template <typename T>
TUNA_CPU_CLONES void forward_head(T* out, T* lse, const T* q, const KvPanel<T>& panel, RowScratch<T>& row,
                                  const AttentionShape& shape, int64_t b, int64_t h) {
  const int64_t seq_len = shape.seq_len, head_dim = shape.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  double* scores = row.scores.data();
  T* weights = row.weights.data();
  T* acc = row.acc.data();
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t count = t + 1;  // causal: keys 0..t
    dots_by_position(scores, q + shape.q_row(b, t, h), panel.keys_by_dim.data(), head_dim, seq_len, count);
    double max_score = scores[0];
#pragma omp simd reduction(max : max_score)
    for (int64_t j = 0; j < count; ++j) max_score = std::max(max_score, scores[j]);
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < count; ++j) {
      weights[j] = exp_lanes(static_cast<T>((scores[j] - max_score) * scale));
      sum += weights[j];
    }
    std::fill(acc, acc + head_dim, T(0));
    for (int64_t j = 0; j < count; ++j) {
      const T weight = weights[j];
      const T* value = panel.values.data() + j * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += weight * value[d];
    }
    T* out_t = out + shape.q_row(b, t, h);
    const T inv_sum = T(1) / sum;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) out_t[d] = acc[d] * inv_sum;
    lse[shape.lse_index(b, h, t)] = static_cast<T>(max_score * scale + std::log(static_cast<double>(sum)));
  }
}

// One kv head kvh of sequence b: dq of its query heads, and dk, dv (summed over them) into dk_acc, dv_acc
// ([seq_len, head_dim], overwritten), unscaled dk.
template <typename T>
TUNA_CPU_CLONES void backward_kv_head(T* dq, T* dk_acc, T* dv_acc, const T* dout, const T* out, const T* lse,
                                      const T* q, const KvPanel<T>& panel, RowScratch<T>& row,
                                      const AttentionShape& shape, int64_t b, int64_t kvh) {
  const int64_t seq_len = shape.seq_len, head_dim = shape.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  double* scores = row.scores.data();
  T* probs = row.weights.data();
  T* dprobs = row.dweights.data();
  T* dq_acc = row.acc.data();
  std::fill(dk_acc, dk_acc + seq_len * head_dim, T(0));
  std::fill(dv_acc, dv_acc + seq_len * head_dim, T(0));
  for (int64_t h = kvh * shape.group(); h < (kvh + 1) * shape.group(); ++h) {
    for (int64_t t = 0; t < seq_len; ++t) {
      const int64_t count = t + 1;
      const T* query = q + shape.q_row(b, t, h);
      const T* grad_out = dout + shape.q_row(b, t, h);
      const T* out_t = out + shape.q_row(b, t, h);
      T d_t = 0;  // dout_t . out_t
      for (int64_t d = 0; d < head_dim; ++d) d_t += grad_out[d] * out_t[d];
      const double lse_t = lse[shape.lse_index(b, h, t)];

      dots_by_position(scores, query, panel.keys_by_dim.data(), head_dim, seq_len, count);
#pragma omp simd
      for (int64_t j = 0; j < count; ++j) probs[j] = exp_lanes(static_cast<T>(scores[j] * scale - lse_t));
      dots_by_position(dprobs, grad_out, panel.values_by_dim.data(), head_dim, seq_len, count);
      // dprobs becomes ds = p (dp - D).
#pragma omp simd
      for (int64_t j = 0; j < count; ++j) dprobs[j] = probs[j] * (dprobs[j] - d_t);
      std::fill(dq_acc, dq_acc + head_dim, T(0));
      for (int64_t j = 0; j < count; ++j) {
        const T p = probs[j], ds = dprobs[j];
        const T* key = panel.keys.data() + j * head_dim;
        T* dk_j = dk_acc + j * head_dim;
        T* dv_j = dv_acc + j * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) {
          dq_acc[d] += ds * key[d];
          dk_j[d] += ds * query[d];
          dv_j[d] += p * grad_out[d];
        }
      }
      T* dq_t = dq + shape.q_row(b, t, h);
      const T scale_t = static_cast<T>(scale);
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) dq_t[d] = scale_t * dq_acc[d];
    }
  }
}

}  // namespace

template <typename T>
void attention_fwd(T* out, T* lse, const T* q, const T* k, const T* v, int64_t batch, int64_t seq_len,
                   int64_t n_heads, int64_t n_kv_heads, int64_t head_dim) {
  const AttentionShape shape = make_shape(batch, seq_len, n_heads, n_kv_heads, head_dim);
  const int64_t n_units = batch * n_heads;
#pragma omp parallel
  {
    KvPanel<T> panel(seq_len, head_dim);
    RowScratch<T> row(seq_len, head_dim);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < n_units; ++unit) {
      const int64_t b = unit / n_heads, h = unit % n_heads;
      panel.load(k, v, shape, b, h / shape.group());
      forward_head(out, lse, q, panel, row, shape, b, h);
    }
  }
}

template <typename T>
void attention_bwd(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* lse, const T* q, const T* k,
                   const T* v, int64_t batch, int64_t seq_len, int64_t n_heads, int64_t n_kv_heads,
                   int64_t head_dim) {
  const AttentionShape shape = make_shape(batch, seq_len, n_heads, n_kv_heads, head_dim);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const int64_t n_units = batch * n_kv_heads;
#pragma omp parallel
  {
    KvPanel<T> panel(seq_len, head_dim);
    RowScratch<T> row(seq_len, head_dim);
    // dk (unscaled) and dv of this unit's kv head over all positions, [seq_len, head_dim].
    std::vector<T> dk_acc(seq_len * head_dim), dv_acc(seq_len * head_dim);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < n_units; ++unit) {
      const int64_t b = unit / n_kv_heads, kvh = unit % n_kv_heads;
      panel.load(k, v, shape, b, kvh);
      backward_kv_head(dq, dk_acc.data(), dv_acc.data(), dout, out, lse, q, panel, row, shape, b, kvh);
      for (int64_t j = 0; j < seq_len; ++j) {
        T* dk_j = dk + shape.kv_row(b, j, kvh);
        T* dv_j = dv + shape.kv_row(b, j, kvh);
        for (int64_t d = 0; d < head_dim; ++d) {
          dk_j[d] = scale * dk_acc[j * head_dim + d];
          dv_j[d] = dv_acc[j * head_dim + d];
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
