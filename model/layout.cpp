#include "model/layout.h"

#include <algorithm>

#include "core/error.h"

namespace tuna {

int64_t ParamLayout::add(const std::string& name, std::vector<int64_t> global_shape, int layer, bool decays,
                         int split_dim, int64_t split_begin, int64_t split_size) {
  ParamTensor t;
  t.name = name;
  t.shape = global_shape;
  if (split_dim >= 0) t.shape[split_dim] = split_size;
  t.numel = 1;
  for (int64_t d : t.shape) t.numel *= d;
  t.global_shape = std::move(global_shape);
  t.split_dim = split_dim;
  t.split_begin = split_begin;
  t.offset = total_;
  t.layer = layer;
  t.decays = decays;
  t.stream = static_cast<int>(streams_++);
  total_ += t.numel;
  tensors_.push_back(std::move(t));
  return tensors_.back().offset;
}

ParamLayout::ParamLayout(const LlamaConfig& c, int tp_rank, int tp_size) {
  PipelineStage whole;
  whole.layer_end = c.num_hidden_layers, whole.embedding = whole.head = true;
  build(c, tp_rank, tp_size, whole);
  if (tp_size == 1)
    TUNA_CHECK(total_ == c.n_params(), "layout holds ", total_, " parameters, config says ", c.n_params());
}

ParamLayout::ParamLayout(const LlamaConfig& c, int tp_rank, int tp_size, const PipelineStage& stage) {
  TUNA_CHECK(stage.layer_begin >= 0 && stage.layer_begin <= stage.layer_end && stage.layer_end <= c.num_hidden_layers,
             "pipeline stage of layers [", stage.layer_begin, ", ", stage.layer_end, ") of ", c.num_hidden_layers);
  build(c, tp_rank, tp_size, stage);
}

void ParamLayout::build(const LlamaConfig& c, int tp_rank, int tp_size, const PipelineStage& stage) {
  TUNA_CHECK(tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size, "tp rank ", tp_rank, " of ", tp_size);
  if (c.num_key_value_heads % tp_size != 0)
    fail("option 'tp': ", tp_size, " does not divide num_key_value_heads = ", c.num_key_value_heads,
         " of the model's config.json; each tensor-parallel rank must hold whole groups of kv heads, so tp must "
         "divide ", c.num_key_value_heads);
  TpDims& d = tp_;
  d.tp_rank = tp_rank, d.tp_size = tp_size;
  d.kv_heads = c.num_key_value_heads / tp_size;
  d.heads = c.num_attention_heads / tp_size;  // num_attention_heads is a multiple of the kv heads
  d.q_dim = d.heads * c.head_dim, d.kv_dim = d.kv_heads * c.head_dim;
  const Range ffn = shard_range(c.intermediate_size, tp_rank, tp_size), vocab = shard_range(c.vocab_size, tp_rank, tp_size);
  d.ffn = ffn.size(), d.ffn_begin = ffn.begin;
  d.vocab = vocab.size(), d.vocab_begin = vocab.begin;
  if (d.ffn == 0 || d.vocab == 0)
    fail("option 'tp': ", tp_size, " ranks leave rank ", tp_rank, " no ffn columns or vocabulary rows (intermediate_size ",
         c.intermediate_size, ", vocab_size ", c.vocab_size, ")");
  const int64_t hidden = c.hidden_size, ffn_all = c.intermediate_size;
  // Norm weights do not decay; a matrix is split over tp by rows (column-parallel) or by columns (row-parallel).
  constexpr bool kDecays = true, kNoDecay = false;
  constexpr int kByRows = 0, kByColumns = 1;
  const int64_t q_begin = tp_rank * d.q_dim, kv_begin = tp_rank * d.kv_dim;

  tied_ = c.tie_word_embeddings;
  has_embedding_ = stage.embedding, has_head_ = stage.head;
  layer_begin_ = stage.layer_begin, layer_end_ = stage.layer_end;
  // Another stage's units stay in the numbering, empty (the constructor's comment).
  // The tensors of other stages count in the streams all the same (ParamTensor::stream).
  constexpr int64_t kLayerTensors = 9;
  if (has_embedding_)
    embed_tokens_ =
        add("model.embed_tokens.weight", {c.vocab_size, hidden}, -1, kDecays, kByRows, d.vocab_begin, d.vocab);
  else
    streams_++;
  unit_ranges_.emplace_back(0, total_);
  for (int64_t l = 0; l < c.num_hidden_layers; l++) {
    if (!has_layer(l)) {
      streams_ += kLayerTensors;
      layers_.push_back(LayerOffsets{});
      layer_ranges_.emplace_back(total_, total_);
      unit_ranges_.emplace_back(total_, total_);
      continue;
    }
    const std::string p = str("model.layers.", l, ".");
    const int li = static_cast<int>(l);
    const int64_t begin = total_;
    LayerOffsets o;
    o.input_norm = add(p + "input_layernorm.weight", {hidden}, li, kNoDecay);
    o.q_proj = add(p + "self_attn.q_proj.weight", {c.q_dim(), hidden}, li, kDecays, kByRows, q_begin, d.q_dim);
    o.k_proj = add(p + "self_attn.k_proj.weight", {c.kv_dim(), hidden}, li, kDecays, kByRows, kv_begin, d.kv_dim);
    o.v_proj = add(p + "self_attn.v_proj.weight", {c.kv_dim(), hidden}, li, kDecays, kByRows, kv_begin, d.kv_dim);
    o.o_proj = add(p + "self_attn.o_proj.weight", {hidden, c.q_dim()}, li, kDecays, kByColumns, q_begin, d.q_dim);
    o.post_norm = add(p + "post_attention_layernorm.weight", {hidden}, li, kNoDecay);
    o.gate_proj = add(p + "mlp.gate_proj.weight", {ffn_all, hidden}, li, kDecays, kByRows, d.ffn_begin, d.ffn);
    o.up_proj = add(p + "mlp.up_proj.weight", {ffn_all, hidden}, li, kDecays, kByRows, d.ffn_begin, d.ffn);
    o.down_proj = add(p + "mlp.down_proj.weight", {hidden, ffn_all}, li, kDecays, kByColumns, d.ffn_begin, d.ffn);
    TUNA_CHECK(streams_ == 1 + (l + 1) * kLayerTensors, "a decoder layer of ", kLayerTensors, " tensors");
    layers_.push_back(o);
    layer_ranges_.emplace_back(begin, total_);
    unit_ranges_.emplace_back(begin, total_);
  }
  const int64_t head_begin = total_;
  if (has_head_) {
    final_norm_ = add("model.norm.weight", {hidden}, -1, kNoDecay);
    if (!c.tie_word_embeddings) {
      lm_head_ = add("lm_head.weight", {c.vocab_size, hidden}, -1, kDecays, kByRows, d.vocab_begin, d.vocab);
    } else if (has_embedding_) {
      lm_head_ = embed_tokens_;
    } else {  // a later stage than the table's: a copy of it (ParamTensor::copy), drawn from the table's stream
      lm_head_ = add("model.embed_tokens.weight", {c.vocab_size, hidden}, -1, kDecays, kByRows, d.vocab_begin, d.vocab);
      streams_--;
      tensors_.back().stream = 0;
      tensors_.back().copy = true;
    }
  }
  unit_ranges_.emplace_back(head_begin, total_);
}

ParamLayout::ParamLayout(const TpDims& tp, std::vector<ParamTensor> tensors,
                         std::vector<std::pair<int64_t, int64_t>> units, bool keep_streams)
    : tensors_(std::move(tensors)), unit_ranges_(std::move(units)), tp_(tp), is_model_(false) {
  for (ParamTensor& t : tensors_) {
    if (!keep_streams) t.stream = static_cast<int>(streams_);
    streams_++;
    t.numel = 1;
    for (int64_t d : t.shape) t.numel *= d;
    t.offset = total_;
    total_ += t.numel;
  }
  int64_t at = 0;
  for (const auto& [begin, end] : unit_ranges_) {
    TUNA_CHECK(begin == at && end >= begin, "units must cover the layout in order: [", begin, ", ", end, ") after ", at);
    at = end;
  }
  TUNA_CHECK(at == total_, "units cover ", at, " of ", total_, " elements");
}

void ParamLayout::model_only(const char* what) const {
  TUNA_CHECK(is_model_, "ParamLayout::", what, " of a layout that is not a model's (adapters)");
}

const ParamTensor* ParamLayout::tied_copy() const {
  for (const ParamTensor& t : tensors_)
    if (t.copy) return &t;
  return nullptr;
}

void ParamLayout::owned(const char* what, bool held) const {
  model_only(what);
  TUNA_CHECK(held, "ParamLayout::", what, " of a pipeline stage that does not hold it");
}

const ParamTensor* ParamLayout::find(const std::string& name) const {
  for (const ParamTensor& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

void copy_block(const ParamTensor& t, const float* global, float* local) {
  if (t.split_dim < 0) {
    std::copy(global, global + t.numel, local);
  } else if (t.split_dim == 0) {
    const int64_t cols = t.numel / t.shape[0];
    std::copy(global + t.split_begin * cols, global + (t.split_begin + t.shape[0]) * cols, local);
  } else {
    const int64_t rows = t.shape[0], cols = t.shape[1], gcols = t.global_shape[1];
    for (int64_t r = 0; r < rows; r++)
      std::copy(global + r * gcols + t.split_begin, global + r * gcols + t.split_begin + cols, local + r * cols);
  }
}

void place_block(const ParamTensor& t, const float* local, float* global) {
  if (t.split_dim < 0) {
    std::copy(local, local + t.numel, global);
  } else if (t.split_dim == 0) {
    const int64_t cols = t.numel / t.shape[0];
    std::copy(local, local + t.numel, global + t.split_begin * cols);
  } else {
    const int64_t rows = t.shape[0], cols = t.shape[1], gcols = t.global_shape[1];
    for (int64_t r = 0; r < rows; r++)
      std::copy(local + r * cols, local + (r + 1) * cols, global + r * gcols + t.split_begin);
  }
}

std::vector<int> ParamLayout::unit_pass_order(bool backward_follows) const {
  model_only("unit_pass_order");
  const int begin = static_cast<int>(layer_begin_), end = static_cast<int>(layer_end_);
  std::vector<int> order;
  if (has_embedding_) order.push_back(0);
  for (int l = begin; l < end; l++) order.push_back(1 + l);
  if (has_head_) order.push_back(head_unit());
  if (has_head_ && lm_head_unit() == 0) order.push_back(0);
  if (backward_follows)
    for (int l = end - 1; l >= begin; l--) order.push_back(1 + l);
  return order;
}

}  // namespace tuna
