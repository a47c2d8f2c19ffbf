#include "model/quantized_weights.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "core/memory.h"
#include "kernels/cpu/int8_rowwise.h"
#include "kernels/cpu/parallel.h"  // kMinParallelWork

namespace tuna {
namespace {

// A decoder layer's Linear weights: its 2-D tensors (the norms are 1-D).
int64_t largest_layer(const ParamLayout& layout) {
  int64_t largest = 0;
  for (int64_t l = 0; l < layout.num_layers(); ++l)
    largest = std::max(largest, layout.layer_range(l).second - layout.layer_range(l).first);
  return largest;
}

// A tensor's tp block as runs of the whole tensor's flat (row-major) order: run k holds the block's elements
// [k len, (k + 1) len) and the whole tensor's [first + k stride, first + k stride + len). A row-parallel block (split
// columns) is a run per row; a column-parallel one (split rows), or a whole tensor, is one run.
struct Runs {
  int64_t count, len, stride, first;
};
Runs block_runs(const ParamTensor& t) {
  if (t.split_dim == 1) return {t.shape[0], t.shape[1], t.global_shape[1], t.split_begin};
  return {1, t.numel, 0, t.split_dim == 0 ? t.split_begin * (t.numel / t.shape[0]) : 0};
}
int64_t whole_numel(const ParamTensor& t) {
  int64_t n = 1;
  for (int64_t d : t.global_shape) n *= d;
  return n;
}
// A tp rank's block of a larger tensor.
bool is_block(const ParamTensor& t) { return whole_numel(t) != t.numel; }
// The whole tensor's 64-element blocks that whole elements [g0, g0 + len) fall in.
int64_t run_blocks(int64_t g0, int64_t len) {
  return len == 0 ? 0 : (g0 + len - 1) / cpu::kNf4Block - g0 / cpu::kNf4Block + 1;
}

}  // namespace

int64_t quantized_block_bytes(const ParamTensor& t, BaseQuant quant) {
  if (quant != BaseQuant::Nf4 || !is_block(t)) return base_tensor_bytes(t.numel, t.shape[0], quant);
  const Runs r = block_runs(t);
  int64_t blocks = 0;
  for (int64_t k = 0; k < r.count; ++k) blocks += run_blocks(r.first + k * r.stride, r.len);
  return (t.numel + 1) / 2 + blocks + 4 * cpu::nf4_sizes(whole_numel(t)).stat_blocks + 4;
}

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
      b.quantized += quantized_block_bytes(t, quant);
      if (is_block(t)) {  // read whole and quantized whole (kernels/cpu: codes, scales and their scratch)
        const int64_t n = whole_numel(t);
        const cpu::Nf4Sizes z = cpu::nf4_sizes(n);
        b.fill_buffer = std::max(b.fill_buffer, 4 * n + (quant == BaseQuant::Nf4 ? z.packed_bytes + 5 * z.blocks
                                                                                 : n + 4 * t.global_shape[0]));
      }
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

QuantizedWeights::QuantizedWeights(const ParamLayout& layout, BaseQuant quant, const BaseFill& fill,
                                   const ParamLayout* whole)
    : layout_(layout), whole_(whole ? *whole : layout), quant_(quant), bytes_(quantized_base_bytes(layout_, quant)) {
  const bool split = layout_.tp().tp_size > 1;
  TUNA_CHECK(!split || (whole && whole->tp().tp_size == 1), "a tp rank's quantized base needs the layout at tp 1");
  allocate_host(str("the quantized base (", bytes_.quantized_params, " parameters in ", base_quant_name(quant), ", ",
                    bytes_.fp32_params, " in fp32)"),
                static_cast<uint64_t>(bytes_.total()), [&] {
                  buffer_.resize(bytes_.buffer / 4);
                  const auto [e0, e1] = layout_.unit_range(0);
                  embedding_.resize(e1 - e0);
                  const auto [h0, h1] = layout_.unit_range(layout_.head_unit());
                  head_.resize(h1 - h0);
                });
  layers_.resize(layout_.num_layers());
  if (split) {
    fill_blocks(fill);
    return;
  }
  fill(layout_, Segment{layout_.unit_range(0).first, static_cast<int64_t>(embedding_.size())}, embedding_.data());
  fill(layout_, Segment{layout_.unit_range(layout_.head_unit()).first, static_cast<int64_t>(head_.size())},
       head_.data());
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

void QuantizedWeights::fill_blocks(const BaseFill& fill) {
  // The embedding and head units, and each layer's norms: this rank's blocks; each projection read whole (one at a
  // time, through one buffer), quantized whole, its block kept.
  for (int u : {0, layout_.head_unit()}) {
    const auto [begin, end] = layout_.unit_range(u);
    float* unit = u == 0 ? embedding_.data() : head_.data();
    for (const ParamTensor& t : layout_.tensors())
      if (t.offset >= begin && t.offset < end) read_block(fill, t, unit + (t.offset - begin));
  }
  std::vector<float> values;
  int64_t largest = 0;
  for (const ParamTensor& t : layout_.tensors())
    if (base_tensor_quantized(t)) largest = std::max(largest, whole_numel(t));
  // The whole projection and, in quantize_block, its quantized state: checked together, the values taken here.
  allocate_host("a projection read whole to quantize this rank's block of it", static_cast<uint64_t>(bytes_.fill_buffer),
                [&] { values.reserve(largest); });
  for (const ParamTensor& t : layout_.tensors()) {
    if (t.layer < 0) continue;
    Layer& layer = layers_[t.layer];
    if (!base_tensor_quantized(t)) {
      layer.kept.push_back(&t);
      layer.kept_values.emplace_back(t.numel);
      read_block(fill, t, layer.kept_values.back().data());
      continue;
    }
    const ParamTensor* w = whole_.find(t.name);
    TUNA_CHECK(w != nullptr, "no tensor ", t.name, " in the whole layout");
    values.resize(w->numel);
    fill(whole_, Segment{w->offset, w->numel}, values.data());
    layer.projections.push_back(quantize_block(t, values.data(), w->numel));
  }
}

void QuantizedWeights::read_block(const BaseFill& fill, const ParamTensor& t, float* out) const {
  const ParamTensor* w = whole_.find(t.name);
  TUNA_CHECK(w != nullptr, "no tensor ", t.name, " in the whole layout");
  const Runs r = block_runs(t);
  for (int64_t k = 0; k < r.count; ++k) fill(whole_, Segment{w->offset + r.first + k * r.stride, r.len}, out + k * r.len);
}

QuantizedWeights::Projection QuantizedWeights::quantize_block(const ParamTensor& t, const float* x, int64_t n) const {
  Projection p;
  p.tensor = &t;
  const Runs r = block_runs(t);
  if (quant_ == BaseQuant::Int8) {
    const int64_t rows = t.global_shape[0], cols = t.global_shape[1];
    std::vector<int8_t> q(n);
    std::vector<float> scale(rows);
    cpu::int8_rowwise_quantize(x, rows, cols, q.data(), scale.data(), t.name.c_str());
    p.q8.resize(t.numel), p.row_scale.resize(t.shape[0]);
    for (int64_t k = 0; k < r.count; ++k)
      std::copy_n(q.data() + r.first + k * r.stride, r.len, p.q8.data() + k * r.len);
    // A column-parallel block holds rows [split_begin, + rows); a row-parallel one every row, scaled by the whole row.
    const int64_t first_row = t.split_dim == 0 ? t.split_begin : 0;
    std::copy_n(scale.data() + first_row, t.shape[0], p.row_scale.data());
    return p;
  }
  const cpu::Nf4Sizes z = cpu::nf4_sizes(n);
  std::vector<uint8_t> packed(z.packed_bytes), qabsmax(z.blocks);
  std::vector<float> scratch(z.blocks);
  p.absmax2.resize(z.stat_blocks);
  cpu::nf4_quantize(x, n, packed.data(), qabsmax.data(), p.absmax2.data(), &p.offset, scratch.data(), t.name.c_str());
  p.block = true;
  p.packed.assign((t.numel + 1) / 2, 0);
  for (int64_t k = 0; k < r.count; ++k) {
    const int64_t g0 = r.first + k * r.stride;
    for (int64_t j = 0; j < r.len; ++j) {
      const int64_t g = g0 + j, i = k * r.len + j;
      const uint8_t code = g % 2 == 0 ? packed[g / 2] >> 4 : packed[g / 2] & 15;
      p.packed[i / 2] |= static_cast<uint8_t>(i % 2 == 0 ? code << 4 : code);
    }
    const int64_t first = g0 / cpu::kNf4Block;
    p.qabsmax.insert(p.qabsmax.end(), qabsmax.begin() + first, qabsmax.begin() + first + run_blocks(g0, r.len));
  }
  if (t.numel % 2 != 0) p.packed.back() |= 7;  // the padding code (the value 0), as nf4_quantize_blocks pads
  return p;
}

void QuantizedWeights::dequantize(const Projection& p, float* out) const {
  const ParamTensor& t = *p.tensor;
  if (quant_ == BaseQuant::Int8)
    return cpu::int8_rowwise_dequantize(p.q8.data(), p.row_scale.data(), t.shape[0], t.shape[1], out);
  if (!p.block) return cpu::nf4_dequantize(p.view(), out);
  // Each element with its whole-tensor block's absmax, in kernels/cpu/nf4.cpp's fp32 operations and order.
  const std::array<float, 16>& nf4 = cpu::nf4_values();
  const std::array<float, 256>& map = cpu::dynamic_map();
  const Runs r = block_runs(t);
  std::vector<int64_t> at(r.count + 1, 0);  // each run's first absmax in p.qabsmax
  for (int64_t k = 0; k < r.count; ++k) at[k + 1] = at[k] + run_blocks(r.first + k * r.stride, r.len);
  // Pieces of at most kPiece elements: a run per row-parallel row, pieces of the one run otherwise.
  constexpr int64_t kPiece = 16384;
  const int64_t per_run = (r.len + kPiece - 1) / kPiece, pieces = r.count * per_run;
#pragma omp parallel for if (t.numel >= cpu::kMinParallelWork)
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const int64_t k = piece / per_run, j0 = (piece % per_run) * kPiece, j1 = std::min(r.len, j0 + kPiece);
    const int64_t g0 = r.first + k * r.stride, first = g0 / cpu::kNf4Block;
    int64_t held = -1;
    float absmax = 0;
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t b = (g0 + j) / cpu::kNf4Block, i = k * r.len + j;
      if (b != held) {
        const float scaled = map[p.qabsmax[at[k] + b - first]] * p.absmax2[b / cpu::kNf4StatsBlock];
        absmax = scaled + p.offset;
        held = b;
      }
      const uint8_t byte = p.packed[i / 2];
      out[i] = nf4[i % 2 == 0 ? byte >> 4 : byte & 15] * absmax;
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
  for (const Projection& p : layer.projections) dequantize(p, buffer_.data() + (p.tensor->offset - begin));
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

cpu::Nf4Tensor QuantizedWeights::nf4(const std::string& name) const {
  const Projection& p = projection(name, BaseQuant::Nf4);
  if (p.block) fail("quantized base: '", name, "' is a tp block of a tensor quantized whole, not an NF4 tensor of its own");
  return p.view();
}

QuantizedWeights::Int8View QuantizedWeights::int8(const std::string& name) const {
  const Projection& p = projection(name, BaseQuant::Int8);
  return {p.q8.data(), p.row_scale.data(), p.tensor->shape[0], p.tensor->shape[1]};
}

}  // namespace tuna
