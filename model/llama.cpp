// The decoder, layer by layer, as transformers' LlamaForCausalLM computes it:
//   x = embed(tokens)
//   per layer: h = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))  with n1 = rmsnorm(x)
//              x = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                      with n2 = rmsnorm(h)
//   logits = lm_head(rmsnorm(x))
// Every activation the backward needs is kept (no recompute on the CPU backend); the backward walks
// the same list in reverse.
#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/classifier.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"

namespace tuna {

namespace {
// Rows of logits computed at once: bounded so that [rows, vocab] stays near 16 MB whatever the vocab.
constexpr int64_t kHeadChunkFloats = int64_t(4) << 20;
}  // namespace

Llama::Llama(const LlamaConfig& config, int64_t max_batch, int64_t max_seq)
    : config_(config), layout_(config), max_batch_(max_batch), max_seq_(max_seq) {
  TUNA_CHECK(max_batch > 0 && max_seq > 0, "batch ", max_batch, " seq ", max_seq);
  const LlamaConfig& c = config_;
  const int64_t n = max_batch * max_seq;
  params.assign(layout_.total(), 0.0f);
  grads.assign(layout_.total(), 0.0f);

  inv_freq_.resize(c.head_dim / 2);
  cpu::rope_inv_freq(inv_freq_.data(), c.head_dim, c.rope_theta, c.rope_scaling);
  rope_cos_.resize(max_seq * c.head_dim / 2);
  rope_sin_.resize(max_seq * c.head_dim / 2);
  cpu::rope_table(rope_cos_.data(), rope_sin_.data(), inv_freq_.data(), max_seq, c.head_dim);

  acts_.resize(c.num_hidden_layers);
  for (LayerActs& a : acts_) {
    a.resid_in.resize(n * c.hidden_size);
    a.norm1.resize(n * c.hidden_size);
    a.rstd1.resize(n);
    a.q.resize(n * c.q_dim());
    a.k.resize(n * c.kv_dim());
    a.v.resize(n * c.kv_dim());
    a.att.resize(n * c.q_dim());
    a.lse.resize(n * c.num_attention_heads);
    a.resid_mid.resize(n * c.hidden_size);
    a.norm2.resize(n * c.hidden_size);
    a.rstd2.resize(n);
    a.gate.resize(n * c.intermediate_size);
    a.up.resize(n * c.intermediate_size);
    a.act.resize(n * c.intermediate_size);
  }
  resid_out_.resize(n * c.hidden_size);
  final_norm_out_.resize(n * c.hidden_size);
  final_rstd_.resize(n);
  head_chunk_rows_ = std::clamp<int64_t>(kHeadChunkFloats / c.vocab_size, 1, n);
  logits_chunk_.resize(head_chunk_rows_ * c.vocab_size);

  d_resid_.resize(n * c.hidden_size);
  d_norm_.resize(n * c.hidden_size);
  d_q_.resize(n * c.q_dim());
  d_k_.resize(n * c.kv_dim());
  d_v_.resize(n * c.kv_dim());
  d_att_.resize(n * c.q_dim());
  d_gate_.resize(n * c.intermediate_size);
  d_up_.resize(n * c.intermediate_size);
  d_act_.resize(n * c.intermediate_size);
  d_final_norm_.resize(n * c.hidden_size);
}

int64_t Llama::activation_bytes() const {
  int64_t floats = 0;
  for (const LayerActs& a : acts_)
    for (const std::vector<float>* v : {&a.resid_in, &a.norm1, &a.rstd1, &a.q, &a.k, &a.v, &a.att, &a.lse,
                                        &a.resid_mid, &a.norm2, &a.rstd2, &a.gate, &a.up, &a.act})
      floats += static_cast<int64_t>(v->size());
  for (const std::vector<float>* v :
       {&resid_out_, &final_norm_out_, &final_rstd_, &logits_chunk_, &d_resid_, &d_norm_, &d_q_, &d_k_, &d_v_,
        &d_att_, &d_gate_, &d_up_, &d_act_, &d_final_norm_})
    floats += static_cast<int64_t>(v->size());
  return floats * static_cast<int64_t>(sizeof(float));
}

void Llama::init_random(uint64_t seed, double std) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, std);
  for (const ParamTensor& t : layout_.tensors()) {
    float* p = params.data() + t.offset;
    if (t.shape.size() == 1) {
      std::fill(p, p + t.numel, 1.0f);  // RMSNorm weights start at identity
    } else {
      for (int64_t i = 0; i < t.numel; i++) p[i] = static_cast<float>(normal(rng));
    }
  }
}

void Llama::zero_grads() { std::fill(grads.begin(), grads.end(), 0.0f); }

void Llama::forward(const int32_t* inputs, int64_t batch, int64_t seq) {
  if (batch > max_batch_ || seq > max_seq_)
    fail("batch ", batch, " x seq ", seq, " exceeds the planned ", max_batch_, " x ", max_seq_);
  const LlamaConfig& c = config_;
  const int64_t n = batch * seq, C = c.hidden_size, F = c.intermediate_size;
  const float* w = params.data();

  cpu::embedding_fwd(acts_.empty() ? resid_out_.data() : acts_[0].resid_in.data(), inputs,
                     w + layout_.embed_tokens(), n, c.vocab_size, C);
  for (int64_t l = 0; l < c.num_hidden_layers; l++) {
    LayerActs& a = acts_[l];
    const LayerOffsets& o = layout_.layer(l);
    float* resid_next = l + 1 < c.num_hidden_layers ? acts_[l + 1].resid_in.data() : resid_out_.data();

    cpu::rmsnorm_fwd(a.norm1.data(), a.rstd1.data(), a.resid_in.data(), w + o.input_norm, n, C, c.rms_norm_eps);
    cpu::matmul_fwd(a.q.data(), a.norm1.data(), w + o.q_proj, n, C, c.q_dim());
    cpu::matmul_fwd(a.k.data(), a.norm1.data(), w + o.k_proj, n, C, c.kv_dim());
    cpu::matmul_fwd(a.v.data(), a.norm1.data(), w + o.v_proj, n, C, c.kv_dim());
    cpu::rope_fwd(a.q.data(), a.q.data(), rope_cos_.data(), rope_sin_.data(), batch, seq, c.num_attention_heads,
                  c.head_dim);
    cpu::rope_fwd(a.k.data(), a.k.data(), rope_cos_.data(), rope_sin_.data(), batch, seq,
                  c.num_key_value_heads, c.head_dim);
    cpu::attention_fwd(a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), batch, seq,
                       c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    cpu::matmul_fwd(a.resid_mid.data(), a.att.data(), w + o.o_proj, n, c.q_dim(), C);
    for (int64_t i = 0; i < n * C; i++) a.resid_mid[i] += a.resid_in[i];

    cpu::rmsnorm_fwd(a.norm2.data(), a.rstd2.data(), a.resid_mid.data(), w + o.post_norm, n, C, c.rms_norm_eps);
    cpu::matmul_fwd(a.gate.data(), a.norm2.data(), w + o.gate_proj, n, C, F);
    cpu::matmul_fwd(a.up.data(), a.norm2.data(), w + o.up_proj, n, C, F);
    cpu::swiglu_fwd(a.act.data(), a.gate.data(), a.up.data(), n * F);
    cpu::matmul_fwd(resid_next, a.act.data(), w + o.down_proj, n, F, C);
    for (int64_t i = 0; i < n * C; i++) resid_next[i] += a.resid_mid[i];
  }
  cpu::rmsnorm_fwd(final_norm_out_.data(), final_rstd_.data(), resid_out_.data(), w + layout_.final_norm(), n, C,
                   c.rms_norm_eps);
}

LossSum Llama::head(const int32_t* targets, int64_t rows, bool want_grad, float* logits_out) {
  const int64_t C = config_.hidden_size, V = config_.vocab_size;
  const float* w_head = params.data() + layout_.lm_head();
  LossSum loss;
  for (int64_t r0 = 0; r0 < rows; r0 += head_chunk_rows_) {
    const int64_t nr = std::min(head_chunk_rows_, rows - r0);
    float* logits = logits_out ? logits_out + r0 * V : logits_chunk_.data();
    const float* x = final_norm_out_.data() + r0 * C;
    cpu::matmul_fwd(logits, x, w_head, nr, C, V);
    if (!targets) continue;
    // dloss = 1: the gradient of the summed loss (see llama.h).
    loss.sum += cpu::classifier_fwd_bwd(logits, nullptr, targets + r0, nr, V,
                                        want_grad ? 1.0 : 0.0);
    for (int64_t i = 0; i < nr; i++) loss.count += targets[r0 + i] != cpu::kIgnoreIndex;
    if (want_grad)
      cpu::matmul_bwd(d_final_norm_.data() + r0 * C, grads.data() + layout_.lm_head(), logits, x, w_head, nr, C,
                      V, /*accumulate_dinp=*/false);
  }
  return loss;
}

void Llama::backward(const int32_t* inputs, int64_t batch, int64_t seq) {
  const LlamaConfig& c = config_;
  const int64_t n = batch * seq, C = c.hidden_size, F = c.intermediate_size;
  const float* w = params.data();
  float* g = grads.data();

  // d_resid_ carries the gradient of the residual stream from the top down.
  std::fill(d_resid_.begin(), d_resid_.begin() + n * C, 0.0f);
  cpu::rmsnorm_bwd(d_resid_.data(), g + layout_.final_norm(), d_final_norm_.data(), resid_out_.data(),
                   w + layout_.final_norm(), final_rstd_.data(), n, C);
  for (int64_t l = c.num_hidden_layers - 1; l >= 0; l--) {
    LayerActs& a = acts_[l];
    const LayerOffsets& o = layout_.layer(l);
    // MLP block: x_out = resid_mid + down(act)
    cpu::matmul_bwd(d_act_.data(), g + o.down_proj, d_resid_.data(), a.act.data(), w + o.down_proj, n, F, C,
                    /*accumulate_dinp=*/false);
    cpu::swiglu_bwd(d_gate_.data(), d_up_.data(), d_act_.data(), a.gate.data(), a.up.data(), n * F);
    cpu::matmul_bwd(d_norm_.data(), g + o.gate_proj, d_gate_.data(), a.norm2.data(), w + o.gate_proj, n, C, F,
                    /*accumulate_dinp=*/false);
    cpu::matmul_bwd(d_norm_.data(), g + o.up_proj, d_up_.data(), a.norm2.data(), w + o.up_proj, n, C, F,
                    /*accumulate_dinp=*/true);
    cpu::rmsnorm_bwd(d_resid_.data(), g + o.post_norm, d_norm_.data(), a.resid_mid.data(), w + o.post_norm,
                     a.rstd2.data(), n, C);
    // Attention block: resid_mid = resid_in + o_proj(att)
    cpu::matmul_bwd(d_att_.data(), g + o.o_proj, d_resid_.data(), a.att.data(), w + o.o_proj, n, c.q_dim(), C,
                    /*accumulate_dinp=*/false);
    cpu::attention_bwd(d_q_.data(), d_k_.data(), d_v_.data(), d_att_.data(), a.att.data(), a.lse.data(),
                       a.q.data(), a.k.data(), a.v.data(), batch, seq, c.num_attention_heads,
                       c.num_key_value_heads, c.head_dim);
    cpu::rope_bwd(d_q_.data(), d_q_.data(), rope_cos_.data(), rope_sin_.data(), batch, seq,
                  c.num_attention_heads, c.head_dim);
    cpu::rope_bwd(d_k_.data(), d_k_.data(), rope_cos_.data(), rope_sin_.data(), batch, seq,
                  c.num_key_value_heads, c.head_dim);
    cpu::matmul_bwd(d_norm_.data(), g + o.q_proj, d_q_.data(), a.norm1.data(), w + o.q_proj, n, C, c.q_dim(),
                    /*accumulate_dinp=*/false);
    cpu::matmul_bwd(d_norm_.data(), g + o.k_proj, d_k_.data(), a.norm1.data(), w + o.k_proj, n, C, c.kv_dim(),
                    /*accumulate_dinp=*/true);
    cpu::matmul_bwd(d_norm_.data(), g + o.v_proj, d_v_.data(), a.norm1.data(), w + o.v_proj, n, C, c.kv_dim(),
                    /*accumulate_dinp=*/true);
    cpu::rmsnorm_bwd(d_resid_.data(), g + o.input_norm, d_norm_.data(), a.resid_in.data(), w + o.input_norm,
                     a.rstd1.data(), n, C);
  }
  cpu::embedding_bwd(g + layout_.embed_tokens(), d_resid_.data(), inputs, n, c.vocab_size, C);
}

LossSum Llama::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq) {
  forward(inputs, batch, seq);
  LossSum loss = head(targets, batch * seq, /*want_grad=*/true, nullptr);
  backward(inputs, batch, seq);
  return loss;
}

LossSum Llama::forward_loss(const int32_t* inputs, const int32_t* targets, int64_t batch, int64_t seq) {
  forward(inputs, batch, seq);
  return head(targets, batch * seq, /*want_grad=*/false, nullptr);
}

void Llama::forward_logits(const int32_t* inputs, int64_t batch, int64_t seq, float* logits) {
  forward(inputs, batch, seq);
  head(nullptr, batch * seq, /*want_grad=*/false, logits);
}

}  // namespace tuna
