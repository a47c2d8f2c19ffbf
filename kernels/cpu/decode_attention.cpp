// Attention of n_new query positions per sequence against a KV cache, CPU twin of kernels/decode_attention.cu.
//
//   q, out: [batch, n_new, n_heads, head_dim];  k_cache, v_cache: [batch, capacity, n_kv_heads, head_dim]
//   query i of sequence b is position t = past + i:
//     s[j] = (q . k_j) / sqrt(head_dim) for j <= t;  p = softmax(s);  out = sum_j p[j] v_j      out: OVERWRITTEN
//
// Generation calls it once for the prompt (n_new = prompt length, past = 0) and once per new token
// (n_new = 1). One query row at a time: the scores in double, as attention_fwd takes them (the softmax
// amplifies a score's absolute error, and scores grow with the vectors' norms), the weights and the weighted
// sum of values in T, every loop vectorized (kernels/cpu/vector_math.h). Rows are independent: parallel over
// (batch, query position, head), each row computed in a fixed order whatever the thread count.
#include "kernels/cpu/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vector_math.h"

namespace tuna::cpu {
namespace {

// One query row against keys 0..last of its kv head. keys/values point at position 0 of that head; rows
// of the cache are `stride` elements apart.
template <typename T>
TUNA_CPU_CLONES void attend_row(T* out, const T* query, const T* keys, const T* values, int64_t last, int64_t stride,
                                int64_t head_dim, double* scores, T* weights, T* acc) {
  const int64_t count = last + 1;
  for (int64_t j = 0; j < count; ++j) {
    const T* key = keys + j * stride;
    double dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < head_dim; ++d) dot += static_cast<double>(query[d]) * key[d];
    scores[j] = dot;
  }
  double max_score = scores[0];
#pragma omp simd reduction(max : max_score)
  for (int64_t j = 0; j < count; ++j) max_score = std::max(max_score, scores[j]);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < count; ++j) {
    weights[j] = exp_lanes(static_cast<T>((scores[j] - max_score) * scale));
    sum += weights[j];
  }
  std::fill(acc, acc + head_dim, T(0));
  for (int64_t j = 0; j < count; ++j) {
    const T weight = weights[j];
    const T* value = values + j * stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += weight * value[d];
  }
  const T inv_sum = T(1) / sum;
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) out[d] = acc[d] * inv_sum;
}

}  // namespace

template <typename T>
void decode_attention_fwd(T* out, const T* q, const T* k_cache, const T* v_cache, int64_t batch, int64_t n_new,
                          int64_t past, int64_t capacity, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim) {
  TUNA_CHECK(batch >= 0 && n_new >= 0 && past >= 0 && n_heads > 0 && n_kv_heads > 0 && head_dim > 0, "batch ",
             batch, ", n_new ", n_new, ", past ", past, ", n_heads ", n_heads, ", n_kv_heads ", n_kv_heads,
             ", head_dim ", head_dim);
  TUNA_CHECK(n_heads % n_kv_heads == 0, "n_heads ", n_heads, " is not a multiple of n_kv_heads ", n_kv_heads);
  TUNA_CHECK(past + n_new <= capacity, "past ", past, " + n_new ", n_new, " exceeds the cache's ", capacity,
             " positions");
  const int64_t group = n_heads / n_kv_heads, stride = n_kv_heads * head_dim;
  const int64_t n_rows = batch * n_new * n_heads;
#pragma omp parallel if (n_rows * (past + n_new) * head_dim >= kMinParallelWork)
  {
    std::vector<double> scores(past + n_new);
    std::vector<T> weights(past + n_new), acc(head_dim);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < n_rows; ++row) {
      const int64_t h = row % n_heads, i = (row / n_heads) % n_new, b = row / (n_heads * n_new);
      const int64_t kv_offset = (b * capacity * n_kv_heads + h / group) * head_dim;
      attend_row(out + row * head_dim, q + row * head_dim, k_cache + kv_offset, v_cache + kv_offset, past + i, stride,
                 head_dim, scores.data(), weights.data(), acc.data());
    }
  }
}

template void decode_attention_fwd<float>(float*, const float*, const float*, const float*, int64_t, int64_t,
                                          int64_t, int64_t, int64_t, int64_t, int64_t);
template void decode_attention_fwd<double>(double*, const double*, const double*, const double*, int64_t, int64_t,
                                           int64_t, int64_t, int64_t, int64_t, int64_t);

}  // namespace tuna::cpu
