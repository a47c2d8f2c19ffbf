// ParamLayout: where every parameter lives in one flat buffer.
//
// Layer-major (embedding | layer 0 | layer 1 | ... | final norm | lm_head) so that one layer is one
// contiguous range: one collective gathers a layer's weights or reduce-scatters its gradients (ZeRO-3),
// and one AdamW pass runs over the whole buffer. Names are Hugging Face's, so checkpoints, gradients
// in test fixtures and exported models all speak the same language. With tied embeddings there is no
// lm_head tensor: the head reads the embedding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"  // shard_range
#include "model/config.h"
#include "model/pipeline.h"  // PipelineStage

namespace tuna {

struct ParamTensor {
  std::string name;            // e.g. "model.layers.3.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // as in transformers: Linear weights are [out_features, in_features]
  int64_t offset = 0;          // in elements, into the flat buffer
  int64_t numel = 0;
  int layer = -1;              // -1 for embedding, final norm and lm_head
  bool decays = false;         // AdamW weight decay applies (2-D weights; not norm weights)
  // A copy of a tensor another pipeline stage holds: the last stage's lm_head when the embeddings are tied (Megatron's
  // layout: the first stage keeps the table, the last a copy, and the two gradients are summed between them, so the
  // copies stay equal). Not written to checkpoints (the first stage's is), and its gradient not counted in the norm.
  bool copy = false;
  // Tensor parallel: this tensor is global.narrow(split_dim, split_begin, shape[split_dim]);
  // split_dim -1: the whole tensor (replicated on every tp rank).
  std::vector<int64_t> global_shape;
  int split_dim = -1;
  // The tensor's index in the whole model's layout (a pipeline stage's layout holds a part of it): its random
  // stream (tensor_stream_seed), so that every split starts from the same model. (Placed to fill padding: the
  // tensor list is part of every rank's heap, which tests hold against the state it reports.)
  int stream = 0;
  int64_t split_begin = 0;
};

// This rank's share of the model's dimensions under tensor parallelism (everything when tp_size is 1).
struct TpDims {
  int tp_rank = 0, tp_size = 1;
  int64_t heads = 0, kv_heads = 0;    // attention heads this rank computes
  int64_t q_dim = 0, kv_dim = 0;      // heads * head_dim, kv_heads * head_dim
  int64_t ffn = 0, ffn_begin = 0;     // intermediate columns [ffn_begin, ffn_begin + ffn)
  int64_t vocab = 0, vocab_begin = 0; // embedding / lm_head rows [vocab_begin, vocab_begin + vocab)
};

// Offsets of one decoder layer's tensors, in forward order.
struct LayerOffsets {
  int64_t input_norm, q_proj, k_proj, v_proj, o_proj, post_norm, gate_proj, up_proj, down_proj;
};

class ParamLayout {
 public:
  // Fails with a message naming the option when tp does not divide the kv heads.
  explicit ParamLayout(const LlamaConfig& config, int tp_rank = 0, int tp_size = 1);
  // One pipeline stage's share (--pp): only the stage's tensors (embedding on the first, final norm and lm_head on
  // the last), under their global names, laid end to end. The units keep the whole model's numbering (0 the
  // embedding, 1 + l layer l, the head last), those of other stages empty, so that everything that walks units
  // (Zero, AdamW, checkpoints, the model's store) takes a stage as it takes the whole model. Tied embeddings across
  // stages: the last stage holds a copy of the table as its lm_head (ParamTensor::copy, tied_copy()).
  ParamLayout(const LlamaConfig& config, int tp_rank, int tp_size, const PipelineStage& stage);
  // A layout of other trainable tensors (LoRA adapters, model/lora.h): the tensors, laid end to end in the given
  // order (their offsets are set here), in units of [begin, end) ranges that cover the buffer in order. It has
  // no embedding, layers or head: the accessors of the model's own structure refuse it (is_model() false), and
  // everything that works on units and tensors (AdamW, ZeRO's pieces, checkpoints) takes it as it is. The tensors'
  // random streams are their places in the list, or with keep_streams the streams they carry (a part of a larger
  // list: one pipeline stage's adapters keep the whole model's streams).
  ParamLayout(const TpDims& tp, std::vector<ParamTensor> tensors, std::vector<std::pair<int64_t, int64_t>> units,
              bool keep_streams = false);
  bool is_model() const { return is_model_; }

  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  const ParamTensor* find(const std::string& name) const;  // nullptr when absent
  int64_t total() const { return total_; }
  const TpDims& tp() const { return tp_; }

  int num_units() const { return static_cast<int>(unit_ranges_.size()); }
  std::pair<int64_t, int64_t> unit_range(int unit) const { return unit_ranges_[unit]; }
  int head_unit() const { model_only("head_unit"); return num_units() - 1; }
  int lm_head_unit() const { model_only("lm_head_unit"); return tied_ && has_embedding_ ? 0 : head_unit(); }
  // The last stage's copy of a tied embedding (ParamTensor::copy), or null.
  const ParamTensor* tied_copy() const;
  // The units a forward pass uses, in order (embedding, layers, head, the tied embedding again for lm_head),
  // then the layers backwards when a backward follows: the order ZeRO-3 gathers (and prefetches) them in.
  std::vector<int> unit_pass_order(bool backward_follows) const;

  int64_t embed_tokens() const { owned("embed_tokens", has_embedding_); return embed_tokens_; }
  int64_t final_norm() const { owned("final_norm", has_head_); return final_norm_; }
  int64_t lm_head() const { owned("lm_head", has_head_); return lm_head_; }  // == embed_tokens() when tied
  const LayerOffsets& layer(int64_t l) const { owned("layer", has_layer(l)); return layers_[l]; }
  // The model's decoder layers (all of them, a stage's layout too; a stage holds [layer_begin, layer_end)).
  int64_t num_layers() const { model_only("num_layers"); return static_cast<int64_t>(layers_.size()); }
  // [begin, end) of layer l in the flat buffer (empty for another stage's layer).
  std::pair<int64_t, int64_t> layer_range(int64_t l) const { model_only("layer_range"); return layer_ranges_[l]; }
  // What this layout holds: everything, or one pipeline stage's part.
  bool has_embedding() const { return has_embedding_; }
  bool has_head() const { return has_head_; }
  int64_t layer_begin() const { return layer_begin_; }
  int64_t layer_end() const { return layer_end_; }
  bool has_layer(int64_t l) const { return l >= layer_begin_ && l < layer_end_; }
  bool whole() const { return has_embedding_ && has_head_ && layer_begin_ == 0 && layer_end_ == num_layers(); }

 private:
  void model_only(const char* what) const;  // fails unless is_model()
  void owned(const char* what, bool held) const;  // fails unless is_model() and this stage holds it
  void build(const LlamaConfig& config, int tp_rank, int tp_size, const PipelineStage& stage);
  int64_t add(const std::string& name, std::vector<int64_t> global_shape, int layer, bool decays, int split_dim = -1,
              int64_t split_begin = 0, int64_t split_size = 0);

  std::vector<ParamTensor> tensors_;
  std::vector<LayerOffsets> layers_;
  std::vector<std::pair<int64_t, int64_t>> layer_ranges_, unit_ranges_;
  TpDims tp_;
  bool is_model_ = true, tied_ = false, has_embedding_ = false, has_head_ = false;
  int64_t layer_begin_ = 0, layer_end_ = 0;
  int64_t total_ = 0, embed_tokens_ = 0, final_norm_ = 0, lm_head_ = 0;
  int64_t streams_ = 0;  // tensors of the whole model so far, held here or not (ParamTensor::stream)
};

// Tensor-parallel blocks: local = t's block of the global tensor (copy_block), and back (place_block).
void copy_block(const ParamTensor& t, const float* global, float* local);
void place_block(const ParamTensor& t, const float* local, float* global);

// Elements [begin, begin + size) of `layout`'s flat buffer, held in out, a tensor at a time: fn(stream, t, lb, le, p)
// for each tensor the range overlaps (stream: t.stream), its local elements [lb, le) being at p.
template <typename Fn>
void for_each_tensor_piece(const ParamLayout& layout, int64_t begin, int64_t size, float* out, Fn&& fn) {
  const std::vector<ParamTensor>& tensors = layout.tensors();
  for (size_t index = 0; index < tensors.size(); index++) {
    const ParamTensor& t = tensors[index];
    const int64_t lb = std::max(begin, t.offset) - t.offset;
    const int64_t le = std::min(begin + size, t.offset + t.numel) - t.offset;
    if (lb < le) fn(static_cast<size_t>(t.stream), t, lb, le, out + (t.offset + lb - begin));
  }
}

// The seed of tensor `index`'s own random stream, so that a piece needs no draws of other tensors.
inline uint64_t tensor_stream_seed(uint64_t seed, size_t index) { return seed + 0x9E3779B97F4A7C15ull * (index + 1); }

// Random initialization a piece at a time: draws the global tensor's values in row-major order, one next() per
// element up to the last one the piece needs, and keeps those of local elements [lb, le) of t's block in
// p[0, le - lb). The values then depend on neither the tp split nor the pieces a rank asks for.
template <typename Next>
void draw_block_piece(const ParamTensor& t, int64_t lb, int64_t le, float* p, Next&& next) {
  const int64_t rows = t.shape[0], cols = t.shape[1], gcols = t.global_shape[1];
  const auto global_of = [&](int64_t local) {
    const int64_t row = local / cols, col = local % cols;
    return t.split_dim == 0 ? (t.split_begin + row) * gcols + col
         : t.split_dim == 1 ? row * gcols + t.split_begin + col
                            : local;
  };
  const int64_t last = global_of(le - 1);
  for (int64_t g = 0; g <= last; g++) {
    const float x = next();
    const int64_t row = g / gcols, col = g % gcols;
    int64_t local = -1;
    if (t.split_dim == 0 && row >= t.split_begin && row < t.split_begin + rows) local = (row - t.split_begin) * cols + col;
    else if (t.split_dim == 1 && col >= t.split_begin && col < t.split_begin + cols) local = row * cols + col - t.split_begin;
    else if (t.split_dim < 0) local = g;
    if (local >= lb && local < le) p[local - lb] = x;
  }
}

}  // namespace tuna
