// ParamLayout: where every parameter lives in one flat buffer.
//
// Layer-major (embedding | layer 0 | layer 1 | ... | final norm | lm_head) so that one layer is one
// contiguous range: one collective gathers a layer's weights or reduce-scatters its gradients (ZeRO-3),
// and one AdamW pass runs over the whole buffer. Names are Hugging Face's, so checkpoints, gradients
// in test fixtures and exported models all speak the same language. With tied embeddings there is no
// lm_head tensor: the head reads the embedding.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"

namespace tuna {

struct ParamTensor {
  std::string name;            // e.g. "model.layers.3.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // as in transformers: Linear weights are [out_features, in_features]
  int64_t offset = 0;          // in elements, into the flat buffer
  int64_t numel = 0;
  int layer = -1;              // -1 for embedding, final norm and lm_head
  bool decays = false;         // AdamW weight decay applies (2-D weights; not norm weights)
};

// Offsets of one decoder layer's tensors, in forward order.
struct LayerOffsets {
  int64_t input_norm, q_proj, k_proj, v_proj, o_proj, post_norm, gate_proj, up_proj, down_proj;
};

class ParamLayout {
 public:
  explicit ParamLayout(const LlamaConfig& config);

  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  const ParamTensor* find(const std::string& name) const;  // nullptr when absent
  int64_t total() const { return total_; }

  int64_t embed_tokens() const { return embed_tokens_; }
  int64_t final_norm() const { return final_norm_; }
  int64_t lm_head() const { return lm_head_; }  // == embed_tokens() when tied
  const LayerOffsets& layer(int64_t l) const { return layers_[l]; }
  // [begin, end) of layer l in the flat buffer.
  std::pair<int64_t, int64_t> layer_range(int64_t l) const { return layer_ranges_[l]; }

 private:
  int64_t add(const std::string& name, std::vector<int64_t> shape, int layer, bool decays);

  std::vector<ParamTensor> tensors_;
  std::vector<LayerOffsets> layers_;
  std::vector<std::pair<int64_t, int64_t>> layer_ranges_;
  int64_t total_ = 0, embed_tokens_ = 0, final_norm_ = 0, lm_head_ = 0;
};

}  // namespace tuna
