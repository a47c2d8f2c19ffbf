// Llama: LlamaForCausalLM's forward and backward on the CPU backend (fp32), over flat parameter and
// gradient buffers laid out by ParamLayout.
//
// Activation memory is planned once for (max_batch, max_seq) and reused: nothing is allocated per step.
// The loss head is chunked over rows (logits for a few thousand rows at a time, turned into dlogits in
// place), so a 128k vocabulary never needs batch x seq x vocab floats.
//
// Loss convention: forward_backward returns the SUM of per-token losses and the count of trained
// tokens, and accumulates the gradient of that sum. The trainer divides by the total count over all
// micro-batches (and ranks) once, before clipping: the mean over every trained token of the step,
// whatever the split into micro-batches.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/layout.h"

namespace tuna {

struct LossSum {
  double sum = 0;     // sum of cross-entropy over trained tokens
  int64_t count = 0;  // tokens whose target is not the ignore index
};

class Llama {
 public:
  Llama(const LlamaConfig& config, int64_t max_batch, int64_t max_seq);

  const LlamaConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  int64_t max_batch() const { return max_batch_; }
  int64_t max_seq() const { return max_seq_; }

  std::vector<float> params;  // ParamLayout order
  std::vector<float> grads;   // same layout; forward_backward accumulates into it

  // HF-style initialization for training from scratch: normal(0, std) for 2-D weights, ones for norms.
  void init_random(uint64_t seed, double std = 0.02);
  void zero_grads();

  // inputs, targets: [batch, seq] token ids; targets may hold kIgnoreIndex. Accumulates into grads.
  LossSum forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq);
  // The same loss without gradients (evaluation).
  LossSum forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq);
  // Full logits [batch, seq, vocab] (tests, generation).
  void forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* logits);

  // Activation bytes planned at construction (for logs and memory planning).
  int64_t activation_bytes() const;

 private:
  struct LayerActs {
    std::vector<float> resid_in, norm1, rstd1, q, k, v, att, lse, resid_mid, norm2, rstd2, gate, up, act;
  };
  void forward(const int32_t* inputs, int64_t batch, int64_t seq);
  // Runs the head over rows in chunks; with targets computes the loss and (if want_grad) writes
  // d(final norm output) into d_final_norm_ and accumulates the head's weight gradient.
  LossSum head(const int32_t* targets, int64_t rows, bool want_grad, float* logits_out);
  void backward(const int32_t* inputs, int64_t batch, int64_t seq);

  LlamaConfig config_;
  ParamLayout layout_;
  int64_t max_batch_, max_seq_, head_chunk_rows_;
  std::vector<double> inv_freq_;
  std::vector<float> rope_cos_, rope_sin_;
  std::vector<LayerActs> acts_;
  std::vector<float> resid_out_, final_norm_out_, final_rstd_, logits_chunk_;
  // backward scratch
  std::vector<float> d_resid_, d_norm_, d_q_, d_k_, d_v_, d_att_, d_gate_, d_up_, d_act_, d_final_norm_;
};

}  // namespace tuna
