// The CPU model's per-token log-probs and its KV cache (model/llama.h): the preference objectives' passes (the
// policy's and the reference's log-probs, the backward weighted per token), multiple-choice scoring (each target's
// log-prob and greedy flag, only the rows with a target through the head), and the cache that generation and a shared
// context fill. The layers' forward and backward they run are model/llama.cpp's.
#include <algorithm>

#include "core/error.h"
#include "comm/comm.h"
#include "kernels/cpu/classifier.h"
#include "kernels/cpu/matmul.h"
#include "model/llama.h"

namespace tuna {

// ---- per-token log-probs ----

void Llama::forward_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                          const int32_t* positions, float* logps, bool backward_follows, bool adapters_off,
                          uint8_t* greedy) {
  TUNA_CHECK(!(adapters_off && backward_follows), "the base alone is the reference: no backward follows it");
  // A pipeline stage runs in slot 0: the last stage holds one micro-batch at a time (1F1B runs each of its forwards
  // just before that micro-batch's backward), and the passes without a backward run outside a step's slots.
  select_slot(0);
  adapters_off_ = adapters_off && lora_.enabled();
  try {
    forward(inputs, batch, seq, backward_follows, nullptr, positions);
  } catch (...) {
    adapters_off_ = false;
    throw;
  }
  adapters_off_ = false;
  if (stage_.head) head_logps(targets, batch * seq, logps, backward_follows, greedy);
}

void Llama::forward_target_logps(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq,
                                 const int32_t* positions, float* logps, uint8_t* greedy) {
  const DocumentMode mode = documents_;
  documents_ = DocumentMode{true, true};
  try {
    forward_logps(inputs, targets, batch, seq, positions, logps, /*backward_follows=*/false, /*adapters_off=*/false,
                  greedy);
  } catch (...) {
    documents_ = mode;
    throw;
  }
  documents_ = mode;
}

void Llama::backward_weighted(const int32_t* inputs, const int32_t* targets, const float* weights, int64_t batch,
                              int64_t seq) {
  TUNA_CHECK(stage_.head, "backward_weighted of a pipeline stage before the last (backward_stage takes the next "
             "stage's input gradient)");
  select_slot(0);
  head_weighted_bwd(targets, weights, batch * seq);
  backward(inputs, batch, seq);
}

void Llama::greedy_targets(const float* logits, const int32_t* targets, int64_t rows, uint8_t* greedy) {
  TUNA_CHECK(tp_, "greedy_targets is the vocab-parallel test (one rank: cpu::classifier_target_logps)");
  const TpDims& d = layout_.tp();
  const int64_t V = d.vocab;
  std::vector<float> row_max(rows), first(rows);
  for (int64_t i = 0; i < rows; i++) row_max[i] = *std::max_element(logits + i * V, logits + (i + 1) * V);
  tp_->all_reduce_max(row_max.data(), rows, "tp greedy max");
  // The first index holding the maximum, as -index so that a max-reduction over tp finds the smallest (indices are
  // below 2^24: exact in fp32).
  for (int64_t i = 0; i < rows; i++) {
    const float* row = logits + i * V;
    const float* at = std::find(row, row + V, row_max[i]);
    first[i] = at == row + V ? -static_cast<float>(config_.vocab_size) : -static_cast<float>(d.vocab_begin + (at - row));
  }
  tp_->all_reduce_max(first.data(), rows, "tp greedy argmax");
  for (int64_t i = 0; i < rows; i++)
    greedy[i] = targets[i] != cpu::kIgnoreIndex && static_cast<float>(-targets[i]) == first[i];
}

void Llama::head_logps(const int32_t* targets, int64_t rows, float* logps, bool keep_head, uint8_t* greedy) {
  const int64_t C = config_.hidden_size, V = layout_.tp().vocab;
  const int H = layout_.head_unit(), lm_unit = layout_.lm_head_unit();
  const int64_t lm_offset = layout_.lm_head() - layout_.unit_range(lm_unit).first;
  const float* w_head = (lm_unit == H ? head_base_ : store_->acquire(lm_unit)) + lm_offset;
  const float* normed = sp_ ? sp_gather(final_norm_out_.data(), "sp lm_head input") : final_norm_out_.data();
  // Scoring (greedy wanted) sends only the rows with a target through the head, gathered a chunk at a time: a
  // multiple-choice request's context rows have none, and the head is the widest GEMM of a small model. Every tp rank
  // has the same targets, so the vocab-parallel collectives below stay in step.
  std::vector<int64_t> picked;
  if (greedy) {
    for (int64_t i = 0; i < rows; i++)
      if (targets[i] != cpu::kIgnoreIndex) picked.push_back(i);
    std::fill(logps, logps + rows, 0.0f);
    std::fill(greedy, greedy + rows, uint8_t{0});
  }
  const int64_t n = greedy ? static_cast<int64_t>(picked.size()) : rows;
  std::vector<float> x_chunk, lp_chunk;
  std::vector<int32_t> t_chunk;
  std::vector<uint8_t> g_chunk;
  for (int64_t r0 = 0; r0 < n; r0 += head_chunk_rows_) {
    const int64_t nr = std::min(head_chunk_rows_, n - r0);
    const float* x = normed + r0 * C;
    const int32_t* t = targets + r0;
    float* lp = logps + r0;
    uint8_t* g = nullptr;
    if (greedy) {
      x_chunk.resize(nr * C), t_chunk.resize(nr), lp_chunk.resize(nr), g_chunk.resize(nr);
      for (int64_t i = 0; i < nr; i++) {
        std::copy_n(normed + picked[r0 + i] * C, C, x_chunk.data() + i * C);
        t_chunk[i] = targets[picked[r0 + i]];
      }
      x = x_chunk.data(), t = t_chunk.data(), lp = lp_chunk.data(), g = g_chunk.data();
    }
    float* logits = logits_chunk_.data();
    cpu::matmul_fwd(logits, x, w_head, nr, C, V);
    if (g && !tp_) {
      cpu::classifier_target_logps(logits, t, nr, V, lp, g);
    } else {
      if (g) greedy_targets(logits, t, nr, g);
      // Losses with dloss 0: the logits stay as they are, nothing of a gradient is formed.
      if (tp_)
        parallel_cross_entropy(logits, t, nr, /*want_grad=*/false, nullptr, lp);
      else
        cpu::classifier_fwd_bwd(logits, lp, t, nr, V, 0.0);
      for (int64_t i = 0; i < nr; i++) lp[i] = -lp[i];
    }
    if (greedy)
      for (int64_t i = 0; i < nr; i++) logps[picked[r0 + i]] = lp[i], greedy[picked[r0 + i]] = g[i];
  }
  if (lm_unit != H) store_->release(lm_unit);
  if (!keep_head) store_->release(H);  // no backward: the pass ends here
}

void Llama::head_weighted_bwd(const int32_t* targets, const float* weights, int64_t rows) {
  const int64_t C = config_.hidden_size, V = layout_.tp().vocab;
  const int H = layout_.head_unit(), lm_unit = layout_.lm_head_unit();
  const int64_t lm_offset = layout_.lm_head() - layout_.unit_range(lm_unit).first;
  const float* w_head = (lm_unit == H ? head_base_ : store_->acquire(lm_unit)) + lm_offset;
  float* g_head = !lora_.enabled() ? store_->grads(lm_unit) + lm_offset : nullptr;
  const float* normed = sp_ ? sp_gather(final_norm_out_.data(), "sp lm_head input") : final_norm_out_.data();
  float* d_normed = sp_ ? d_norm_.data() : d_final_norm_.data();
  for (int64_t r0 = 0; r0 < rows; r0 += head_chunk_rows_) {
    const int64_t nr = std::min(head_chunk_rows_, rows - r0);
    float* logits = logits_chunk_.data();
    const float* x = normed + r0 * C;
    cpu::matmul_fwd(logits, x, w_head, nr, C, V);
    if (tp_)
      parallel_cross_entropy(logits, targets + r0, nr, /*want_grad=*/true, weights + r0, nullptr);
    else
      cpu::classifier_weighted_bwd(logits, targets + r0, weights + r0, nr, V);
    cpu::matmul_bwd(d_normed + r0 * C, g_head, logits, x, w_head, nr, C, V, /*accumulate_dinp=*/false,
                    GradWrite::Accumulate);
  }
  sp_reduce(d_normed, d_final_norm_.data(), rows, "tp lm_head input grad");
  if (lm_unit != H) store_->release(lm_unit);
}

// ---- the KV cache ----

KvCache Llama::make_kv_cache(int64_t batch, int64_t capacity) const {
  if (batch < 1 || batch > max_batch_ || capacity < 1 || capacity > max_seq_)
    fail("KV cache of ", batch, " x ", capacity, " positions: expected 1..", max_batch_, " sequences of 1..", max_seq_,
         " positions (the model's planned batch and sequence length)");
  KvCache cache;
  cache.batch = batch, cache.capacity = capacity;
  const int64_t floats = batch * capacity * layout_.tp().kv_dim;
  cache.keys.assign(config_.num_hidden_layers, std::vector<float>(floats));
  cache.values.assign(config_.num_hidden_layers, std::vector<float>(floats));
  return cache;
}

void Llama::prefill_cache(const int32_t* tokens, int64_t batch, int64_t n, KvCache& cache) {
  cached_forward(tokens, batch, n, cache);
  store_->release(layout_.head_unit());  // no head: the pass ends here
}

void Llama::cached_forward(const int32_t* tokens, int64_t batch, int64_t n, KvCache& cache) {
  TUNA_CHECK(!tp_, "a KV cache is not kept with tensor parallelism");
  TUNA_CHECK(static_cast<int64_t>(cache.keys.size()) == config_.num_hidden_layers, "a KV cache of another model");
  TUNA_CHECK(layout_.whole(), "forward_cached of a pipeline stage");
  select_slot(0);
  if (batch != cache.batch) fail("forward_cached: ", batch, " sequences, but the KV cache holds ", cache.batch);
  if (n < 1 || cache.length + n > cache.capacity)
    fail("forward_cached: ", n, " new positions after ", cache.length, " do not fit the KV cache's ", cache.capacity);
  forward(tokens, batch, n, /*backward_follows=*/false, &cache);
  cache.length += n;
}

KvCache Llama::repeat_kv_cache(const KvCache& cache, int64_t batch, int64_t capacity) const {
  TUNA_CHECK(cache.batch >= 1 && capacity >= cache.length, "repeat_kv_cache: ", cache.length, " positions into ", capacity);
  KvCache out = make_kv_cache(batch, capacity);
  out.length = cache.length;
  const int64_t kv = layout_.tp().kv_dim, filled = cache.length * kv;
  for (size_t l = 0; l < cache.keys.size(); l++)
    for (int64_t b = 0; b < batch; b++) {
      std::copy_n(cache.keys[l].begin(), filled, out.keys[l].begin() + b * capacity * kv);
      std::copy_n(cache.values[l].begin(), filled, out.values[l].begin() + b * capacity * kv);
    }
  return out;
}

void Llama::forward_cached_logps(const int32_t* tokens, int64_t batch, int64_t n, KvCache& cache, const int32_t* targets,
                                 float* logps, uint8_t* greedy) {
  cached_forward(tokens, batch, n, cache);
  head_logps(targets, batch * n, logps, /*keep_head=*/false, greedy);
}

void Llama::forward_cached(const int32_t* tokens, int64_t batch, int64_t n, KvCache& cache, float* last_logits) {
  TUNA_CHECK(!tp_, "forward_cached returns whole-vocabulary logits: not with tensor parallelism");
  cached_forward(tokens, batch, n, cache);
  // The head reads only each sequence's last position: rows b * n + n - 1 move up to row b (never onto a
  // row still to be read, since b <= b * n + n - 1).
  const int64_t C = config_.hidden_size;
  for (int64_t b = 0; b < batch; b++)
    if (b * n + n - 1 != b) std::copy_n(final_norm_out_.begin() + (b * n + n - 1) * C, C, final_norm_out_.begin() + b * C);
  head(nullptr, batch, /*want_grad=*/false, last_logits);
}

}  // namespace tuna
