// The shapes and the naive same-precision reference of the attention GPU test (test_attention_gpu.cpp, on a
// GPU and on the host emulator), which holds the kernels to the rule of gpu_test_util.h against it:
// err <= 2 x naive bf16 err + floor.
//
// The naive version computes scores and softmax in fp32 and rounds to bf16 where the kernels do: P before
// P V (forward), P and dS before the dV, dK, dQ products, and each output.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/kernels/op_test_util.h"

namespace tuna::test {

struct AttentionShape {
  int64_t batch, seq, heads, kv_heads, dim;
  int64_t q_count() const { return batch * seq * heads * dim; }
  int64_t kv_count() const { return batch * seq * kv_heads * dim; }
  int64_t q_row(int64_t b, int64_t t, int64_t h) const { return ((b * seq + t) * heads + h) * dim; }
  int64_t kv_row(int64_t b, int64_t t, int64_t h) const { return ((b * seq + t) * kv_heads + h) * dim; }
  std::string describe() const {
    return "batch " + std::to_string(batch) + " seq " + std::to_string(seq) + " heads " + std::to_string(heads) + "/" +
           std::to_string(kv_heads) + " head_dim " + std::to_string(dim);
  }
};

struct NaiveAttention {
  std::vector<double> out, lse, dq, dk, dv;
};

// The naive bf16 attention (forward and backward), using the given out (bf16 values) and lse for the backward;
// doc_start as the kernels take it (null: one document per row).
inline NaiveAttention naive_attention(const AttentionShape& s, const std::vector<double>& q,
                                      const std::vector<double>& k, const std::vector<double>& v,
                                      const std::vector<double>& dout, const std::vector<double>& out_in,
                                      const std::vector<double>& lse_in, const int32_t* doc_start = nullptr) {
  NaiveAttention r;
  r.out.assign(s.q_count(), 0), r.lse.assign(s.batch * s.heads * s.seq, 0);
  r.dq.assign(s.q_count(), 0), r.dk.assign(s.kv_count(), 0), r.dv.assign(s.kv_count(), 0);
  std::vector<double> dk_acc(s.kv_count(), 0), dv_acc(s.kv_count(), 0);  // fp32 values, summed per kv head
  const float scale = 1.0f / std::sqrt(float(s.dim));
  const int64_t group = s.heads / s.kv_heads;
  std::vector<float> sc(s.seq), p(s.seq), acc(s.dim);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t t = 0; t < s.seq; ++t) {
        const int64_t first = doc_start ? doc_start[b * s.seq + t] : 0;  // the query's document's first key
        const double* qt = &q[s.q_row(b, t, h)];
        float mx = -INFINITY;
        for (int64_t j = first; j <= t; ++j) {
          float dot = 0;
          for (int64_t d = 0; d < s.dim; ++d) dot += float(qt[d]) * float(k[s.kv_row(b, j, kvh) + d]);
          sc[j] = dot * scale;
          mx = std::max(mx, sc[j]);
        }
        float sum = 0;
        for (int64_t j = first; j <= t; ++j) p[j] = std::exp(sc[j] - mx), sum += p[j];
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = first; j <= t; ++j)
          for (int64_t d = 0; d < s.dim; ++d) acc[d] += round_bf16(p[j]) * float(v[s.kv_row(b, j, kvh) + d]);
        for (int64_t d = 0; d < s.dim; ++d) r.out[s.q_row(b, t, h) + d] = round_bf16(acc[d] / sum);
        r.lse[(b * s.heads + h) * s.seq + t] = mx + std::log(sum);

        // backward of this query row, with the given out and lse
        const float lse_t = float(lse_in[(b * s.heads + h) * s.seq + t]);
        const double* gt = &dout[s.q_row(b, t, h)];
        float delta = 0;
        for (int64_t d = 0; d < s.dim; ++d) delta += float(gt[d]) * float(out_in[s.q_row(b, t, h) + d]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = first; j <= t; ++j) {
          const float pj = std::exp(sc[j] - lse_t);
          float dp = 0;
          for (int64_t d = 0; d < s.dim; ++d) dp += float(gt[d]) * float(v[s.kv_row(b, j, kvh) + d]);
          const float ds = round_bf16(pj * (dp - delta)), pb = round_bf16(pj);
          for (int64_t d = 0; d < s.dim; ++d) {
            acc[d] += ds * float(k[s.kv_row(b, j, kvh) + d]);
            dk_acc[s.kv_row(b, j, kvh) + d] = float(dk_acc[s.kv_row(b, j, kvh) + d]) + ds * float(qt[d]);
            dv_acc[s.kv_row(b, j, kvh) + d] = float(dv_acc[s.kv_row(b, j, kvh) + d]) + pb * float(gt[d]);
          }
        }
        for (int64_t d = 0; d < s.dim; ++d) r.dq[s.q_row(b, t, h) + d] = round_bf16(acc[d] * scale);
      }
    }
  for (int64_t i = 0; i < s.kv_count(); ++i) r.dk[i] = round_bf16(dk_acc[i] * scale), r.dv[i] = round_bf16(dv_acc[i]);
  return r;
}

}  // namespace tuna::test
