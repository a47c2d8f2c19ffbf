// Causal grouped-query self-attention, CPU twin of kernels/attention.cu, with the FlashAttention contract:
// the seq x seq probability matrix is never stored; the forward keeps only each query's logsumexp (lse) and
// the backward recomputes the probabilities from q, k and lse.
//
//   q, out, dq, dout: [batch, seq_len, n_heads, head_dim];  k, v, dk, dv: [batch, seq_len, n_kv_heads, head_dim]
//   lse: [batch, n_heads, seq_len];  query head h reads kv head h / group, group = n_heads / n_kv_heads.
//
//   forward:  s[t, j] = (q_t . k_j) / sqrt(head_dim) for doc_start[t] <= j <= t (causal, in t's document);  lse_t = log sum_j exp(s[t, j])
//             p[t, j] = exp(s[t, j] - lse_t);  out_t = sum_j p[t, j] v_j                  out, lse: OVERWRITTEN
//   backward: D_t = dout_t . out_t   (= sum_j p[t, j] (dout_t . v_j), so no pass over dp is needed for it)
//             ds[t, j] = p[t, j] (dout_t . v_j - D_t)
//             dq_t = scale sum_j ds[t, j] k_j;   dk_j = scale sum_t ds[t, j] q_t;   dv_j = sum_t p[t, j] dout_t
//             dq, dk, dv: OVERWRITTEN; dk and dv sum over all query heads of their group.
//
// How. Per (sequence, head) and per block of kBlock queries, the products are small GEMMs (scores = Q K^T,
// out = P V; backward dP = dO V^T, dQ = dS K, dK += dS^T Q, dV += P^T dO) over the causal columns only, done
// by one register-tiled kernel (tile_product: 4 rows x 64 bytes of columns held in vector registers while it
// walks the shared dimension) in functions compiled for the CPU's vector units (TUNA_CPU_CLONES,
// kernels/cpu/vector_math.h), with exp_lanes for the exponentials. Operands are copied into zero-padded
// panels (rows to a multiple of 4, columns to a multiple of 64 bytes), so the kernel never needs a tail.
//
// Numbers. Arithmetic is in T (fp32 for the CPU backend, double for the tests' float64 references), except
// the scores q . k, which are taken in double: the softmax turns a score's absolute error into a relative
// error of its weight, and scores grow with the norms of q and k (at |s| ~ 100 an fp32 score is off by ~1e-5).
// Every output element is one sum in a fixed order (the tile kernel's k loop, then blocks and query heads in
// order), so results do not depend on the thread count. The forward parallelizes over (batch, query head),
// the backward over (batch, kv head): one thread owns a kv head's dk, dv and visits its query heads in order.
// Scratch per thread: O(seq_len x head_dim + kBlock x seq_len), never seq x seq.
//
// Documents. A block of queries [t0, t0 + n) needs keys from doc_start[t0] on (doc_start never decreases), so
// every product of the block starts at that column (rounded down to a panel strip): key blocks wholly before
// the block's first document are never touched, and a window of short documents costs about
// seq_len x document length, not seq_len^2 / 2. Within the block each row's weights outside
// [doc_start[t], t] are exact zeros.
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

// Queries per block: the causal mask wastes at most half a block x block square per block.
constexpr int64_t kBlock = 32;

template <typename E>
constexpr int64_t kLanes = 64 / static_cast<int64_t>(sizeof(E));  // elements in 64 bytes: a tile's width

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// C[r][c] (+)= sum_k A[r * a_row + k * a_k] * B[k * ldb + c] for r < 4, c < kLanes<E>: the tile kept in
// registers while k runs (each sum in k order).
template <typename E>
[[gnu::always_inline]] inline void tile_product(E* C, int64_t ldc, const E* A, int64_t a_row, int64_t a_k, const E* B, int64_t ldb, int64_t K,
                         bool accumulate) {
  constexpr int64_t L = kLanes<E>;
  E acc[4][L] = {};
  for (int64_t k = 0; k < K; ++k) {
    const E* b = B + k * ldb;
    const E* a = A + k * a_k;
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const E a_r = a[r * a_row];
#pragma omp simd
      for (int64_t c = 0; c < L; ++c) acc[r][c] += a_r * b[c];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    E* c_r = C + r * ldc;
    if (accumulate) {
#pragma omp simd
      for (int64_t c = 0; c < L; ++c) c_r[c] += acc[r][c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < L; ++c) c_r[c] = acc[r][c];
    }
  }
}

// C[M x N] (+)= A[M x K] B[K x N] with A's element (r, k) at A[r * a_row + k * a_k], B and C row-major.
// M a multiple of 4, N of kLanes<E>: the callers' panels are padded so.
template <typename E>
[[gnu::always_inline]] inline void panel_product(E* C, int64_t ldc, const E* A, int64_t a_row, int64_t a_k, const E* B, int64_t ldb,
                          int64_t M, int64_t N, int64_t K, bool accumulate) {
  for (int64_t c = 0; c < N; c += kLanes<E>)  // a column strip of B stays in cache across the rows
    for (int64_t r = 0; r < M; r += 4)
      tile_product(C + r * ldc + c, ldc, A + r * a_row, a_row, a_k, B + c, ldb, K, accumulate);
}

// One kv head of one sequence in zero-padded panels: positions padded to `cols` (a multiple of 64 bytes of
// both T and double), features to `dim` (64 bytes of T).
template <typename T>
struct KvPanel {
  int64_t cols, dim;
  std::vector<double> keys_by_dim;  // [head_dim, cols]: K^T for the scores, in double
  std::vector<T> keys;              // [cols, dim]: K for dQ = dS K (backward)
  std::vector<T> values;            // [cols, dim]: V for out = P V
  std::vector<T> values_by_dim;     // [head_dim, cols]: V^T for dP = dO V^T (backward)

  KvPanel(const AttentionShape& shape, bool backward)
      : cols(round_up(shape.seq_len, kLanes<float>)),
        dim(round_up(shape.head_dim, kLanes<T>)),
        keys_by_dim(shape.head_dim * cols),
        keys(backward ? cols * dim : 0),
        values(cols * dim),
        values_by_dim(backward ? shape.head_dim * cols : 0) {}

  void load(const T* k, const T* v, const AttentionShape& shape, int64_t b, int64_t kvh) {
    const int64_t head_dim = shape.head_dim;
    for (int64_t j = 0; j < shape.seq_len; ++j) {
      const T* k_j = k + shape.kv_row(b, j, kvh);
      const T* v_j = v + shape.kv_row(b, j, kvh);
      std::copy(v_j, v_j + head_dim, values.data() + j * dim);
      if (!keys.empty()) std::copy(k_j, k_j + head_dim, keys.data() + j * dim);
      for (int64_t d = 0; d < head_dim; ++d) {
        keys_by_dim[d * cols + j] = k_j[d];
        if (!values_by_dim.empty()) values_by_dim[d * cols + j] = v_j[d];
      }
    }
  }
};

// Per-thread buffers of one block of queries, rows padded to a multiple of 4 (the padding rows stay zero).
template <typename T>
struct BlockScratch {
  int64_t rows, cols, dim;
  std::vector<double> queries;  // [rows, head_dim] in double, for the scores
  std::vector<double> scores;   // [rows, cols]
  std::vector<T> probs;         // [rows, cols]: softmax weights (0 where masked)
  std::vector<T> dprobs;        // [rows, cols]: dP, then dS (backward)
  std::vector<T> queries_t;     // [rows, dim]: Q in T, for dK (backward)
  std::vector<T> grad_out;      // [rows, dim]: dO, for dP and dV (backward)
  std::vector<T> product;       // [rows, dim]: P V (forward) or dS K (backward)
  std::vector<T> sums;          // [rows]: the softmax denominators (forward)

  BlockScratch(const KvPanel<T>& panel, int64_t head_dim, bool backward)
      : rows(round_up(kBlock, 4)),
        cols(panel.cols),
        dim(panel.dim),
        queries(rows * head_dim),
        scores(rows * cols),
        probs(rows * cols),
        dprobs(backward ? rows * cols : 0),
        queries_t(backward ? rows * dim : 0),
        grad_out(backward ? rows * dim : 0),
        product(rows * dim),
        sums(rows) {}
};

// The first key column a block of queries starting at t0 needs: its first row's document start, rounded down
// to a strip of kLanes<float> columns (a multiple of both panel widths). doc_start: this sequence's row.
int64_t first_column(const int32_t* doc_start, int64_t t0) {
  return doc_start ? doc_start[t0] / kLanes<float> * kLanes<float> : 0;
}

// Rows t0 .. t0 + n - 1 of the causal block: their scores against keys c0 .. t0 + n - 1 into scratch.scores
// (columns c0.. of it; c0 a multiple of kLanes<float>).
template <typename T>
[[gnu::always_inline]] inline void block_scores(BlockScratch<T>& s, const T* q, const KvPanel<T>& panel, const AttentionShape& shape,
                         int64_t b, int64_t h, int64_t t0, int64_t n, int64_t c0) {
  const int64_t head_dim = shape.head_dim;
  for (int64_t r = 0; r < n; ++r) {
    const T* q_t = q + shape.q_row(b, t0 + r, h);
    std::copy(q_t, q_t + head_dim, s.queries.data() + r * head_dim);
  }
  std::fill(s.queries.begin() + n * head_dim, s.queries.end(), 0.0);
  panel_product(s.scores.data() + c0, s.cols, s.queries.data(), head_dim, int64_t(1), panel.keys_by_dim.data() + c0,
                panel.cols, round_up(n, 4), round_up(t0 + n, kLanes<double>) - c0, head_dim, /*accumulate=*/false);
}

// One query head h of sequence b, every position: out and lse. doc_start: sequence b's row, or null.
template <typename T>
TUNA_CPU_CLONES void forward_head(T* out, T* lse, const T* q, const KvPanel<T>& panel, BlockScratch<T>& s,
                                  const AttentionShape& shape, const int32_t* doc_start, int64_t b, int64_t h) {
  const int64_t head_dim = shape.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  for (int64_t t0 = 0; t0 < shape.seq_len; t0 += kBlock) {
    const int64_t n = std::min(kBlock, shape.seq_len - t0), end = t0 + n, c0 = first_column(doc_start, t0);
    block_scores(s, q, panel, shape, b, h, t0, n, c0);
    T* sums = s.sums.data();
    for (int64_t r = 0; r < round_up(n, 4); ++r) {
      T* p = s.probs.data() + r * s.cols;
      // Keys first .. last - 1: the row's document up to itself; padding rows none (they stay zero).
      const int64_t first = r < n && doc_start ? doc_start[t0 + r] : c0, last = r < n ? t0 + r + 1 : c0;
      const double* score = s.scores.data() + r * s.cols;
      double max_score = last > first ? score[first] : 0.0;
#pragma omp simd reduction(max : max_score)
      for (int64_t j = first; j < last; ++j) max_score = std::max(max_score, score[j]);
      T sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = first; j < last; ++j) {
        p[j] = exp_lanes(static_cast<T>((score[j] - max_score) * scale));
        sum += p[j];
      }
      std::fill(p + c0, p + first, T(0));
      std::fill(p + last, p + end, T(0));
      if (r < n) {
        sums[r] = sum;
        lse[shape.lse_index(b, h, t0 + r)] = static_cast<T>(max_score * scale + std::log(static_cast<double>(sum)));
      }
    }
    panel_product(s.product.data(), s.dim, s.probs.data() + c0, s.cols, int64_t(1), panel.values.data() + c0 * panel.dim,
                  panel.dim, round_up(n, 4), s.dim, end - c0, /*accumulate=*/false);
    for (int64_t r = 0; r < n; ++r) {
      T* out_t = out + shape.q_row(b, t0 + r, h);
      const T* o = s.product.data() + r * s.dim;
      const T inv_sum = T(1) / sums[r];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) out_t[d] = o[d] * inv_sum;
    }
  }
}

// One kv head kvh of sequence b: dq of its query heads, and dk, dv (summed over them) into dk_acc, dv_acc
// ([cols, dim] panels, overwritten), dk unscaled. doc_start: sequence b's row, or null.
template <typename T>
TUNA_CPU_CLONES void backward_kv_head(T* dq, T* dk_acc, T* dv_acc, const T* dout, const T* out, const T* lse,
                                      const T* q, const KvPanel<T>& panel, BlockScratch<T>& s,
                                      const AttentionShape& shape, const int32_t* doc_start, int64_t b, int64_t kvh) {
  const int64_t head_dim = shape.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const T scale_t = static_cast<T>(scale);
  std::fill(dk_acc, dk_acc + panel.cols * panel.dim, T(0));
  std::fill(dv_acc, dv_acc + panel.cols * panel.dim, T(0));
  for (int64_t h = kvh * shape.group(); h < (kvh + 1) * shape.group(); ++h) {
    for (int64_t t0 = 0; t0 < shape.seq_len; t0 += kBlock) {
      const int64_t n = std::min(kBlock, shape.seq_len - t0), end = t0 + n, rows = round_up(n, 4);
      const int64_t cols = round_up(end, kLanes<float>);  // the causal columns, padded (multiple of both widths)
      const int64_t c0 = first_column(doc_start, t0);    // ... from the block's first document on
      block_scores(s, q, panel, shape, b, h, t0, n, c0);
      std::fill(s.queries_t.begin(), s.queries_t.end(), T(0));
      std::fill(s.grad_out.begin(), s.grad_out.end(), T(0));
      for (int64_t r = 0; r < n; ++r) {
        const T* q_t = q + shape.q_row(b, t0 + r, h);
        const T* g_t = dout + shape.q_row(b, t0 + r, h);
        std::copy(q_t, q_t + head_dim, s.queries_t.data() + r * s.dim);
        std::copy(g_t, g_t + head_dim, s.grad_out.data() + r * s.dim);
      }
      // dP = dO V^T over the block's columns.
      panel_product(s.dprobs.data() + c0, s.cols, s.grad_out.data(), s.dim, int64_t(1),
                    panel.values_by_dim.data() + c0, panel.cols, rows, cols - c0, head_dim, /*accumulate=*/false);
      for (int64_t r = 0; r < rows; ++r) {
        T* p = s.probs.data() + r * s.cols;
        T* ds = s.dprobs.data() + r * s.cols;
        const int64_t first = r < n && doc_start ? doc_start[t0 + r] : c0, last = r < n ? t0 + r + 1 : c0;
        if (r < n) {
          const double* score = s.scores.data() + r * s.cols;
          const double lse_t = lse[shape.lse_index(b, h, t0 + r)];
          const T* g_t = s.grad_out.data() + r * s.dim;
          const T* o_t = out + shape.q_row(b, t0 + r, h);
          T d_t = 0;  // dout_t . out_t
          for (int64_t d = 0; d < head_dim; ++d) d_t += g_t[d] * o_t[d];
#pragma omp simd
          for (int64_t j = first; j < last; ++j) {
            p[j] = exp_lanes(static_cast<T>(score[j] * scale - lse_t));
            ds[j] = p[j] * (ds[j] - d_t);
          }
        }
        // Masked (another document, the future) and padding: no weight, no gradient.
        std::fill(p + c0, p + first, T(0));
        std::fill(ds + c0, ds + first, T(0));
        std::fill(p + last, p + cols, T(0));
        std::fill(ds + last, ds + cols, T(0));
      }
      // dQ = dS K (scaled below); dK += dS^T Q; dV += P^T dO.
      panel_product(s.product.data(), s.dim, s.dprobs.data() + c0, s.cols, int64_t(1), panel.keys.data() + c0 * panel.dim,
                    panel.dim, rows, s.dim, end - c0, /*accumulate=*/false);
      for (int64_t r = 0; r < n; ++r) {
        T* dq_t = dq + shape.q_row(b, t0 + r, h);
        const T* g = s.product.data() + r * s.dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) dq_t[d] = scale_t * g[d];
      }
      const int64_t key_rows = round_up(end, 4) - c0;  // keys c0 .. end, padded
      panel_product(dk_acc + c0 * panel.dim, panel.dim, s.dprobs.data() + c0, int64_t(1), s.cols, s.queries_t.data(),
                    s.dim, key_rows, s.dim, rows, /*accumulate=*/true);
      panel_product(dv_acc + c0 * panel.dim, panel.dim, s.probs.data() + c0, int64_t(1), s.cols, s.grad_out.data(),
                    s.dim, key_rows, s.dim, rows, /*accumulate=*/true);
    }
  }
}

}  // namespace

void check_doc_starts(const int32_t* doc_start, int64_t batch, int64_t seq_len) {
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* row = doc_start + b * seq_len;
    for (int64_t t = 0; t < seq_len; ++t) {
      const bool same = t > 0 && row[t] == row[t - 1];
      if (!same && row[t] != t)
        fail("attention: doc_start[", b, ", ", t, "] is ", row[t], "; expected ",
             t > 0 ? str(row[t - 1], " (the same document as position ", t - 1, ") or ", t, " (a new document)")
                   : std::string("0 (a window's first token starts its first document)"));
    }
  }
}

void doc_starts_from_positions(int32_t* doc_start, const int32_t* positions, int64_t batch, int64_t seq_len) {
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq_len; ++t) {
      const int32_t p = positions[b * seq_len + t];
      if (p < 0) fail("document positions: position [", b, ", ", t, "] is ", p, ", expected >= 0");
      doc_start[b * seq_len + t] = static_cast<int32_t>(t - std::min<int64_t>(p, t));
    }
  check_doc_starts(doc_start, batch, seq_len);
}

template <typename T>
void attention_fwd(T* out, T* lse, const T* q, const T* k, const T* v, int64_t batch, int64_t seq_len,
                   int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, const int32_t* doc_start) {
  const AttentionShape shape = make_shape(batch, seq_len, n_heads, n_kv_heads, head_dim);
  if (doc_start) check_doc_starts(doc_start, batch, seq_len);
  const int64_t n_units = batch * n_heads;
#pragma omp parallel
  {
    KvPanel<T> panel(shape, /*backward=*/false);
    BlockScratch<T> scratch(panel, head_dim, /*backward=*/false);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < n_units; ++unit) {
      const int64_t b = unit / n_heads, h = unit % n_heads;
      panel.load(k, v, shape, b, h / shape.group());
      forward_head(out, lse, q, panel, scratch, shape, doc_start ? doc_start + b * seq_len : nullptr, b, h);
    }
  }
}

template <typename T>
void attention_bwd(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* lse, const T* q, const T* k,
                   const T* v, int64_t batch, int64_t seq_len, int64_t n_heads, int64_t n_kv_heads,
                   int64_t head_dim, const int32_t* doc_start) {
  const AttentionShape shape = make_shape(batch, seq_len, n_heads, n_kv_heads, head_dim);
  if (doc_start) check_doc_starts(doc_start, batch, seq_len);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const int64_t n_units = batch * n_kv_heads;
#pragma omp parallel
  {
    KvPanel<T> panel(shape, /*backward=*/true);
    BlockScratch<T> scratch(panel, head_dim, /*backward=*/true);
    // dk (unscaled) and dv of this unit's kv head over all positions, panels like the keys'.
    std::vector<T> dk_acc(panel.cols * panel.dim), dv_acc(panel.cols * panel.dim);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < n_units; ++unit) {
      const int64_t b = unit / n_kv_heads, kvh = unit % n_kv_heads;
      panel.load(k, v, shape, b, kvh);
      backward_kv_head(dq, dk_acc.data(), dv_acc.data(), dout, out, lse, q, panel, scratch, shape,
                       doc_start ? doc_start + b * seq_len : nullptr, b, kvh);
      for (int64_t j = 0; j < seq_len; ++j) {
        T* dk_j = dk + shape.kv_row(b, j, kvh);
        T* dv_j = dv + shape.kv_row(b, j, kvh);
        for (int64_t d = 0; d < head_dim; ++d) {
          dk_j[d] = scale * dk_acc[j * panel.dim + d];
          dv_j[d] = dv_acc[j * panel.dim + d];
        }
      }
    }
  }
}

template void attention_fwd<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, const int32_t*);
template void attention_fwd<double>(double*, double*, const double*, const double*, const double*, int64_t,
                                    int64_t, int64_t, int64_t, int64_t, const int32_t*);
template void attention_bwd<float>(float*, float*, float*, const float*, const float*, const float*,
                                   const float*, const float*, const float*, int64_t, int64_t, int64_t,
                                   int64_t, int64_t, const int32_t*);
template void attention_bwd<double>(double*, double*, double*, const double*, const double*, const double*,
                                    const double*, const double*, const double*, int64_t, int64_t, int64_t,
                                    int64_t, int64_t, const int32_t*);

}  // namespace tuna::cpu
