// LlamaGpu's quantized base (QLoRA, model/llama_gpu.h): the decoder's Linear weights in NF4 (bitsandbytes' layout,
// quantized on the host as kernels/cpu/nf4.h does), the embedding, norms and lm_head in bf16; each layer dequantized
// into one reused bf16 buffer whenever it is acquired.
#if TUNA_CUDA

#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/nf4.h"
#include "kernels/nf4.cuh"
#include "model/llama_gpu.h"

namespace tuna {

// QLoRA's store of the frozen base: the embedding and head units in place (bf16), a decoder layer dequantized from
// NF4 into the one layer buffer with its norm weights copied beside, so the GEMMs read it at the unit's own offsets.
// One layer is acquired at a time (the model's pass order), so one buffer serves every layer. A frozen base has
// no gradient: asking for one is an error.
class LlamaGpu::QuantizedBase final : public GpuWeightStore {
 public:
  explicit QuantizedBase(LlamaGpu& model) : m_(model) {}
  const __nv_bfloat16* acquire(int unit) override {
    const ParamLayout& layout = m_.layout_;
    const int64_t begin = layout.unit_range(unit).first;
    if (unit == 0 || unit == layout.head_unit()) return m_.plain_at_.at(begin);
    const int64_t l = unit - 1;
    std::vector<cuda::Nf4Dequant> batch;
    for (const Nf4Slot& t : m_.nf4_[l])
      batch.push_back({m_.dequant_ + (t.offset - begin), t.packed, t.qabsmax, t.absmax2, t.mean_value, t.n});
    cuda::nf4_dequantize(batch.data(), static_cast<int>(batch.size()), m_.stream_);
    for (const ParamTensor& t : layout.tensors())
      if (t.layer == l && !base_tensor_quantized(t))
        TUNA_CUDA_CHECK(cudaMemcpyAsync(m_.dequant_ + (t.offset - begin), m_.plain_at_.at(t.offset),
                                        t.numel * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, m_.stream_));
    return m_.dequant_;
  }
  void release(int) override {}
  UnitGrads grads(int unit) override { fail("the quantized base is frozen: no gradient of unit ", unit); }
  void grads_done(int unit) override { fail("the quantized base is frozen: no gradient of unit ", unit); }

 private:
  LlamaGpu& m_;
};

// The NF4 state of every projection in one byte buffer (the plan's row): all codes (8-byte aligned for the kernel's
// vector path when the sizes allow), then the fp32 scales and means, then the 8-bit absmax: no padding, so the bytes
// are the plan's. Then the bf16 values of the unquantized tensors: the embedding unit, the head unit (each whole, in
// layout order, so that a pointer to its first tensor is the unit), then every norm weight.
void LlamaGpu::lay_out_quantized_base() {
  int64_t packed = 0, stats = 0, blocks = 0, plain = 0;
  for (const ParamTensor& t : layout_.tensors()) {
    if (!base_tensor_quantized(t)) {
      plain += t.numel;
      continue;
    }
    const cpu::Nf4Sizes z = cpu::nf4_sizes(t.numel);
    packed += z.packed_bytes, stats += z.stat_blocks + 1, blocks += z.blocks;
  }
  TUNA_CHECK(packed % 4 == 0, "NF4 codes of ", packed, " bytes (the support table refuses them first)");
  const int64_t plain_bytes = plain * static_cast<int64_t>(sizeof(__nv_bfloat16));
  TUNA_CHECK(packed + 4 * stats + blocks == nf4_bytes_ && plain_bytes == plain_bytes_, "the quantized base takes ",
             packed + 4 * stats + blocks, " NF4 bytes and ", plain_bytes, " bf16 bytes; the memory plan has ",
             nf4_bytes_, " and ", plain_bytes_);
  uint8_t* at_packed = nf4_state_;
  float* at_stats = reinterpret_cast<float*>(nf4_state_ + packed);
  uint8_t* at_blocks = nf4_state_ + packed + 4 * stats;
  __nv_bfloat16* at_plain = plain_;
  const int H = layout_.head_unit();
  for (int u : {0, H})
    for (const ParamTensor& t : layout_.tensors())
      if (t.offset >= layout_.unit_range(u).first && t.offset < layout_.unit_range(u).second)
        plain_at_[t.offset] = at_plain, at_plain += t.numel;
  nf4_.resize(config_.num_hidden_layers);
  for (const ParamTensor& t : layout_.tensors()) {
    if (t.layer < 0) continue;
    if (!base_tensor_quantized(t)) {
      plain_at_[t.offset] = at_plain, at_plain += t.numel;
      continue;
    }
    const cpu::Nf4Sizes z = cpu::nf4_sizes(t.numel);
    Nf4Slot slot;
    slot.offset = t.offset, slot.n = t.numel;
    slot.packed = at_packed, at_packed += z.packed_bytes;
    slot.absmax2 = at_stats, slot.mean = at_stats + z.stat_blocks, at_stats += z.stat_blocks + 1;
    slot.qabsmax = at_blocks, at_blocks += z.blocks;
    nf4_[t.layer].push_back(slot);
  }
  TUNA_CHECK(at_plain == plain_ + plain, "the quantized base's bf16 tensors do not fill their buffer");
}

std::unique_ptr<GpuWeightStore> LlamaGpu::make_quantized_base() { return std::make_unique<QuantizedBase>(*this); }

void LlamaGpu::set_quantized_unit(int u, const float* host) {
  const int64_t begin = layout_.unit_range(u).first;
  std::vector<uint16_t> bits;
  std::vector<uint8_t> packed, qabsmax;
  std::vector<float> absmax2, scratch;
  for (const ParamTensor& t : layout_.tensors()) {
    if (t.offset < begin || t.offset >= layout_.unit_range(u).second) continue;
    const float* x = host + (t.offset - begin);
    if (!base_tensor_quantized(t)) {  // bf16, rounded to nearest on the host as f32_to_bf16
      bits.resize(t.numel);
      convert_from_f32(x, DType::BF16, bits.data(), t.numel);
      TUNA_CUDA_CHECK(cudaMemcpyAsync(plain_at_.at(t.offset), bits.data(), t.numel * sizeof(uint16_t),
                                      cudaMemcpyHostToDevice, stream_));
      TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));
      continue;
    }
    Nf4Slot* slot = nullptr;
    for (Nf4Slot& s : nf4_[t.layer]) slot = s.offset == t.offset ? &s : slot;
    TUNA_CHECK(slot != nullptr, "no NF4 slot for ", t.name);
    const cpu::Nf4Sizes z = cpu::nf4_sizes(t.numel);
    packed.resize(z.packed_bytes), qabsmax.resize(z.blocks), absmax2.resize(z.stat_blocks), scratch.resize(z.blocks);
    cpu::nf4_quantize(x, t.numel, packed.data(), qabsmax.data(), absmax2.data(), &slot->mean_value, scratch.data(),
                      t.name.c_str());
    TUNA_CUDA_CHECK(cudaMemcpyAsync(slot->packed, packed.data(), packed.size(), cudaMemcpyHostToDevice, stream_));
    TUNA_CUDA_CHECK(cudaMemcpyAsync(slot->qabsmax, qabsmax.data(), qabsmax.size(), cudaMemcpyHostToDevice, stream_));
    TUNA_CUDA_CHECK(cudaMemcpyAsync(slot->absmax2, absmax2.data(), absmax2.size() * sizeof(float),
                                    cudaMemcpyHostToDevice, stream_));
    TUNA_CUDA_CHECK(cudaMemcpyAsync(slot->mean, &slot->mean_value, sizeof(float), cudaMemcpyHostToDevice, stream_));
    TUNA_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host buffers are refilled next
  }
}

}  // namespace tuna

#endif  // TUNA_CUDA
