// QuantizedWeights: a frozen base held quantized (QLoRA), as a WeightStore (llama.h) for the CPU model.
//
// What is quantized is what bitsandbytes quantizes in a QLoRA model: the Linear layers inside the decoder, i.e.
// each layer's seven projection matrices (q, k, v, o, gate, up, down): in NF4 with double-quantized absmax
// (kernels/cpu/nf4.h, bit for bit bitsandbytes' quantize_4bit; 0.52 bytes a parameter), or in int8 with an
// absmax per row (kernels/cpu/int8_rowwise.h, LLM.int8()'s weight format; 1 byte a parameter). The norm weights, the embedding and lm_head stay
// fp32. The store is filled a unit at a time (the same callback as engine.h's WeightFill), through one fp32
// buffer of the largest decoder layer: the whole fp32 model is never in memory. acquire(layer) dequantizes that
// layer into the same buffer (one layer unit is held at a time, as the CPU model acquires them); the embedding
// and head units are returned in place. A frozen base has no gradient: grads() is an error that says so.
//
// Under tensor parallelism the layout is one rank's, and what it dequantizes does not depend on tp: each rank reads
// every projection whole (the fill is then asked for the whole model's layout only), quantizes it as one rank does
// and keeps its block. int8: the block's codes and the scales of its rows (a row-parallel block's scale is its whole
// row's). NF4: the block's codes, the double-quantized absmax of every 64-element block of the whole tensor that its
// elements fall in, and the whole tensor's second-level statistics (4 bytes a 16384 elements); a tp split need not
// align with the 64-element blocks (a row-parallel block of 80 columns shares blocks with its neighbours: both
// ranks keep that block's absmax), so each element is dequantized with its own whole-tensor block's absmax, the same
// fp32 operations as one rank's: bit for bit its values.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/nf4.h"
#include "model/layout.h"
#include "model/llama.h"      // WeightStore
#include "model/lora_shape.h"  // BaseQuant (--base_quant)
#include "model/optimizer.h"  // Segment

namespace tuna {

// A quantized base quantizes a base stored in bf16 or fp32 only (a base in fp16 or fp64 would be quantized from values
// that a bf16 LLaMA never had): fails naming `source` (a file, a tensor), the dtype found and the option.
void check_base_dtype_for_quant(BaseQuant quant, DType dtype, const std::string& source);

// Fills out with elements [piece.begin, piece.begin + piece.size) of `layout`'s flat buffer (engine.h's WeightFill).
using BaseFill = std::function<void(const ParamLayout& layout, const Segment& piece, float* out)>;

// Host bytes of a quantized base (the memory plan's figures).
struct QuantizedBaseBytes {
  int64_t quantized_params = 0;  // elements held quantized (the projections)
  int64_t quantized = 0;         // their packed nibbles and statistics
  int64_t fp32_params = 0;       // elements kept fp32 (embedding, norms, lm_head)
  int64_t buffer = 0;            // the fp32 buffer of one decoder layer (fill and acquire)
  // tp > 1, at construction only (freed after): the largest projection read whole and its quantized state.
  int64_t fill_buffer = 0;
  int64_t total() const { return quantized + 4 * fp32_params + buffer; }
};
// The figures for a layout without building the store.
QuantizedBaseBytes quantized_base_bytes(const ParamLayout& layout, BaseQuant quant);
// Bytes of one tensor's quantized state in the store: its tp block's (the layout's tensor; the whole tensor at tp 1).
int64_t quantized_block_bytes(const ParamTensor& t, BaseQuant quant);

// values (tensor t's numel elements) replaced by what a QuantizedWeights holding them gives back: quantized as `quant`
// and dequantized, bit for bit the store's (the same kernels on the same whole tensor). Tensors the store keeps fp32
// (base_tensor_quantized false) are left as they are. Fails naming the tensor on a non-finite value.
void dequantize_quantized(const ParamTensor& t, BaseQuant quant, float* values);
// `fill` with every quantized tensor replaced as above: the weights a QLoRA run computes with, a piece at a time, for
// whoever reads its base without the store (eval, sample, merge, export). A piece that holds part of a quantized
// tensor reads that tensor whole (its quantization depends on all of it: the absmax statistics).
BaseFill dequantized_base_fill(BaseFill fill, BaseQuant quant);

class QuantizedWeights final : public WeightStore {
 public:
  // Quantizes every projection of `layout` from `fill`, a unit at a time. Fails (naming the tensor) on a
  // non-finite weight; quant must not be kNone. A tp rank's layout needs `whole`: the same model's (or pipeline
  // stage's) layout at tp 1, the only layout fill is then asked for (whole tensors, and the blocks of the others).
  QuantizedWeights(const ParamLayout& layout, BaseQuant quant, const BaseFill& fill, const ParamLayout* whole = nullptr);
  QuantizedWeights(const QuantizedWeights&) = delete;  // projections point into its own copy of the layout
  QuantizedWeights& operator=(const QuantizedWeights&) = delete;

  const float* acquire(int unit) override;
  void release(int unit) override;
  float* grads(int unit) override;        // an error: the base is frozen
  void grads_done(int unit) override;     // an error too

  const QuantizedBaseBytes& bytes() const { return bytes_; }
  // The state of a projection, by its layout name (tests; the GPU model uploads these). Fails when the tensor
  // is not a quantized projection or the store holds the other format; nf4() fails too for a tp block (its absmax
  // are its whole-tensor blocks', not an Nf4Tensor's).
  cpu::Nf4Tensor nf4(const std::string& name) const;
  struct Int8View {
    const int8_t* q;
    const float* scale;
    int64_t rows, cols;
  };
  Int8View int8(const std::string& name) const;

 private:
  struct Projection {
    const ParamTensor* tensor = nullptr;
    std::vector<uint8_t> packed, qabsmax;  // NF4
    std::vector<float> absmax2;
    float offset = 0;
    bool block = false;                    // NF4 of a tp block: qabsmax are its whole-tensor blocks' (see the top)
    std::vector<int8_t> q8;                // int8
    std::vector<float> row_scale;
    cpu::Nf4Tensor view() const { return {tensor->numel, packed.data(), qabsmax.data(), absmax2.data(), offset}; }
  };
  struct Layer {
    std::vector<Projection> projections;
    std::vector<const ParamTensor*> kept;  // norm weights, fp32 in kept_values
    std::vector<std::vector<float>> kept_values;
  };

  const ParamLayout layout_;
  const ParamLayout whole_;  // tp > 1: the layout at tp 1 (the fill's); else a copy of layout_
  BaseQuant quant_;
  std::vector<float> embedding_, head_;  // units 0 and head_unit(), fp32
  std::vector<Layer> layers_;
  std::vector<float> buffer_;            // one decoder layer, fp32
  int buffer_unit_ = -1;                 // the layer unit the buffer holds, -1 none
  int held_unit_ = -1;                   // the layer unit acquired and not yet released
  QuantizedBaseBytes bytes_;

  const Projection& projection(const std::string& name, BaseQuant format) const;
  // tp > 1: every unit's blocks from `fill` over whole_ (the constructor's work).
  void fill_blocks(const BaseFill& fill);
  // tp > 1: projection t (this rank's block) from the whole tensor's values.
  Projection quantize_block(const ParamTensor& t, const float* whole_values, int64_t whole_numel) const;
  // tp > 1: tensor t's block of `whole_` into out, read as pieces of the whole layout.
  void read_block(const BaseFill& fill, const ParamTensor& t, float* out) const;
  void dequantize(const Projection& p, float* out) const;
};

}  // namespace tuna
