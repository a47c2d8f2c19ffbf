#include "model/quantized_weights.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "core/memory.h"
#include "kernels/cpu/int8_rowwise.h"

namespace tuna {
namespace {

// A decoder layer's Linear weights: its 2-D tensors (the norms are 1-D).
int64_t largest_layer(const ParamLayout& layout) {
  int64_t largest = 0;
  for (int64_t l = 0; l < layout.num_layers(); ++l)
    largest = std::max(largest, layout.layer_range(l).second - layout.layer_range(l).first);
  return largest;
}

}  // namespace

void check_base_dtype_for_quant(BaseQuant quant, DType dtype, const std::string& source) {
  if (quant == BaseQuant::None || dtype == DType::BF16 || dtype == DType::F32) return;
  fail(source, ": --base_quant ", base_quant_name(quant), " quantizes a base stored in BF16 or F32, found ",
       dtype_name(dtype), " (QLoRA quantizes bf16/fp32 weights; convert the base to bf16 first, or train "
       "with --base_quant none)");
}

QuantizedBaseBytes quantized_base_bytes(const ParamLayout& layout, BaseQuant quant) {
  TUNA_CHECK(quant != BaseQuant::None, "quantized_base_bytes without a quantization");
  QuantizedBaseBytes b;
  for (const ParamTensor& t : layout.tensors()) {
    if (base_tensor_quantized(t)) {
      b.quantized_params += t.numel;
      b.quantized += base_tensor_bytes(t.numel, t.shape[0], quant);
    } else {
      b.fp32_params += t.numel;
    }
  }
  b.buffer = 4 * largest_layer(layout);
  return b;
}

void dequantize_quantized(const ParamTensor& t, BaseQuant quant, float* values) {
  if (quant == BaseQuant::None || !base_tensor_quantized(t)) return;
  if (quant == BaseQuant::Nf4) {
    const cpu::Nf4Sizes s = cpu::nf4_sizes(t.numel);
    std::vector<uint8_t> packed(s.packed_bytes), qabsmax(s.blocks);
    std::vector<float> absmax2(s.stat_blocks), scratch(s.blocks);
    float offset = 0;
    cpu::nf4_quantize(values, t.numel, packed.data(), qabsmax.data(), absmax2.data(), &offset, scratch.data(),
                      t.name.c_str());
    cpu::nf4_dequantize(cpu::Nf4Tensor{t.numel, packed.data(), qabsmax.data(), absmax2.data(), offset}, values);
  } else {
    std::vector<int8_t> q(t.numel);
    std::vector<float> scale(t.shape[0]);
    cpu::int8_rowwise_quantize(values, t.shape[0], t.shape[1], q.data(), scale.data(), t.name.c_str());
    cpu::int8_rowwise_dequantize(q.data(), scale.data(), t.shape[0], t.shape[1], values);
  }
}

BaseFill dequantized_base_fill(BaseFill fill, BaseQuant quant) {
  if (quant == BaseQuant::None) return fill;
  // The last tensor read whole for a partial piece, kept for the next pieces of it (a streamed export reads a large
  // tensor in several).
  struct Whole {
    const ParamLayout* layout = nullptr;
    int64_t offset = -1;
    std::vector<float> values;
  };
  auto whole = std::make_shared<Whole>();
  return [fill = std::move(fill), quant, whole](const ParamLayout& layout, const Segment& piece, float* out) {
    fill(layout, piece, out);
    for (const ParamTensor& t : layout.tensors()) {
      if (!base_tensor_quantized(t)) continue;
      const int64_t begin = std::max(t.offset, piece.begin), end = std::min(t.offset + t.numel, piece.begin + piece.size);
      if (begin >= end) continue;
      if (begin == t.offset && end == t.offset + t.numel) {
        dequantize_quantized(t, quant, out + (t.offset - piece.begin));
        continue;
      }
      if (whole->layout != &layout || whole->offset != t.offset) {
        whole->values.resize(t.numel);
        fill(layout, Segment{t.offset, t.numel}, whole->values.data());
        dequantize_quantized(t, quant, whole->values.data());
        whole->layout = &layout, whole->offset = t.offset;
      }
      std::copy(whole->values.begin() + (begin - t.offset), whole->values.begin() + (end - t.offset),
                out + (begin - piece.begin));
    }
  };
}

QuantizedWeights::QuantizedWeights(const ParamLayout& layout, BaseQuant quant, const BaseFill& fill)
    : layout_(layout), quant_(quant), bytes_(quantized_base_bytes(layout_, quant)) {
  allocate_host(str("the quantized base (", bytes_.quantized_params, " parameters in ", base_quant_name(quant), ", ",
                    bytes_.fp32_params, " in fp32)"),
                static_cast<uint64_t>(bytes_.total()), [&] {
                  buffer_.resize(bytes_.buffer / 4);
                  const auto [e0, e1] = layout_.unit_range(0);
                  embedding_.resize(e1 - e0);
                  const auto [h0, h1] = layout_.unit_range(layout_.head_unit());
                  head_.resize(h1 - h0);
                });
  fill(layout_, Segment{layout_.unit_range(0).first, static_cast<int64_t>(embedding_.size())}, embedding_.data());
  fill(layout_, Segment{layout_.unit_range(layout_.head_unit()).first, static_cast<int64_t>(head_.size())},
       head_.data());
  layers_.resize(layout_.num_layers());
  std::vector<float> scratch_absmax;
  for (int64_t l = 0; l < layout_.num_layers(); ++l) {
    const auto [begin, end] = layout_.layer_range(l);
    fill(layout_, Segment{begin, end - begin}, buffer_.data());
    Layer& layer = layers_[l];
    for (const ParamTensor& t : layout_.tensors()) {
      if (t.layer != l) continue;
      const float* values = buffer_.data() + (t.offset - begin);
      if (!base_tensor_quantized(t)) {
        layer.kept.push_back(&t);
        layer.kept_values.emplace_back(values, values + t.numel);
        continue;
      }
      Projection p;
      p.tensor = &t;
      if (quant_ == BaseQuant::Nf4) {
        const cpu::Nf4Sizes s = cpu::nf4_sizes(t.numel);
        p.packed.resize(s.packed_bytes), p.qabsmax.resize(s.blocks), p.absmax2.resize(s.stat_blocks);
        scratch_absmax.resize(s.blocks);
        cpu::nf4_quantize(values, t.numel, p.packed.data(), p.qabsmax.data(), p.absmax2.data(), &p.offset,
                          scratch_absmax.data(), t.name.c_str());
      } else {
        p.q8.resize(t.numel), p.row_scale.resize(t.shape[0]);
        cpu::int8_rowwise_quantize(values, t.shape[0], t.shape[1], p.q8.data(), p.row_scale.data(), t.name.c_str());
      }
      layer.projections.push_back(std::move(p));
    }
  }
}

const float* QuantizedWeights::acquire(int unit) {
  TUNA_CHECK(unit >= 0 && unit < layout_.num_units(), "unit ", unit);
  if (unit == 0) return embedding_.data();
  if (unit == layout_.head_unit()) return head_.data();
  TUNA_CHECK(held_unit_ < 0, "quantized base: unit ", unit, " acquired while unit ", held_unit_,
             " still holds the layer buffer");
  held_unit_ = unit;
  if (buffer_unit_ == unit) return buffer_.data();  // still there (the last layer: forward, then backward)
  const int64_t l = unit - 1;
  const int64_t begin = layout_.layer_range(l).first;
  const Layer& layer = layers_[l];
  for (size_t k = 0; k < layer.kept.size(); ++k)
    std::copy(layer.kept_values[k].begin(), layer.kept_values[k].end(), buffer_.data() + (layer.kept[k]->offset - begin));
  for (const Projection& p : layer.projections) {
    float* out = buffer_.data() + (p.tensor->offset - begin);
    if (quant_ == BaseQuant::Nf4)
      cpu::nf4_dequantize(p.view(), out);
    else
      cpu::int8_rowwise_dequantize(p.q8.data(), p.row_scale.data(), p.tensor->shape[0], p.tensor->shape[1], out);
  }
  buffer_unit_ = unit;
  return buffer_.data();
}

void QuantizedWeights::release(int unit) {
  if (unit == held_unit_) held_unit_ = -1;
}

float* QuantizedWeights::grads(int unit) {
  fail("the base is frozen and quantized (--base_quant ", base_quant_name(quant_), "): it has no gradient; unit ", unit,
       " was asked for one (a quantized base trains adapters only)");
}

void QuantizedWeights::grads_done(int unit) { grads(unit); }

const QuantizedWeights::Projection& QuantizedWeights::projection(const std::string& name, BaseQuant format) const {
  TUNA_CHECK(format == quant_, "the quantized base holds ", base_quant_name(quant_), ", asked for ",
             base_quant_name(format));
  for (const Layer& layer : layers_)
    for (const Projection& p : layer.projections)
      if (p.tensor->name == name) return p;
  fail("quantized base: no quantized tensor '", name, "'");
}

cpu::Nf4Tensor QuantizedWeights::nf4(const std::string& name) const { return projection(name, BaseQuant::Nf4).view(); }

QuantizedWeights::Int8View QuantizedWeights::int8(const std::string& name) const {
  const Projection& p = projection(name, BaseQuant::Int8);
  return {p.q8.data(), p.row_scale.data(), p.tensor->shape[0], p.tensor->shape[1]};
}

}  // namespace tuna
