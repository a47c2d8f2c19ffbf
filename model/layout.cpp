#include "model/layout.h"

#include "core/error.h"

namespace tuna {

int64_t ParamLayout::add(const std::string& name, std::vector<int64_t> shape, int layer, bool decays) {
  ParamTensor t;
  t.name = name;
  t.numel = 1;
  for (int64_t d : shape) t.numel *= d;
  t.shape = std::move(shape);
  t.offset = total_;
  t.layer = layer;
  t.decays = decays;
  total_ += t.numel;
  tensors_.push_back(std::move(t));
  return tensors_.back().offset;
}

ParamLayout::ParamLayout(const LlamaConfig& c) {
  const int64_t hidden = c.hidden_size, ffn = c.intermediate_size;
  embed_tokens_ = add("model.embed_tokens.weight", {c.vocab_size, hidden}, -1, true);
  for (int64_t l = 0; l < c.num_hidden_layers; l++) {
    const std::string p = str("model.layers.", l, ".");
    const int li = static_cast<int>(l);
    const int64_t begin = total_;
    LayerOffsets o;
    o.input_norm = add(p + "input_layernorm.weight", {hidden}, li, false);
    o.q_proj = add(p + "self_attn.q_proj.weight", {c.q_dim(), hidden}, li, true);
    o.k_proj = add(p + "self_attn.k_proj.weight", {c.kv_dim(), hidden}, li, true);
    o.v_proj = add(p + "self_attn.v_proj.weight", {c.kv_dim(), hidden}, li, true);
    o.o_proj = add(p + "self_attn.o_proj.weight", {hidden, c.q_dim()}, li, true);
    o.post_norm = add(p + "post_attention_layernorm.weight", {hidden}, li, false);
    o.gate_proj = add(p + "mlp.gate_proj.weight", {ffn, hidden}, li, true);
    o.up_proj = add(p + "mlp.up_proj.weight", {ffn, hidden}, li, true);
    o.down_proj = add(p + "mlp.down_proj.weight", {hidden, ffn}, li, true);
    layers_.push_back(o);
    layer_ranges_.emplace_back(begin, total_);
  }
  final_norm_ = add("model.norm.weight", {hidden}, -1, false);
  lm_head_ = c.tie_word_embeddings ? embed_tokens_ : add("lm_head.weight", {c.vocab_size, hidden}, -1, true);
  TUNA_CHECK(total_ == c.n_params(), "layout holds ", total_, " parameters, config says ", c.n_params());
}

const ParamTensor* ParamLayout::find(const std::string& name) const {
  for (const ParamTensor& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

}  // namespace tuna
