// LlamaGpu's bookkeeping of a backward pass's weight-gradient writes, shared by its forward (the head's lm_head
// gradient) and its backward. Internal to model/llama_gpu*.cpp.
#pragma once

#if TUNA_CUDA

#include <algorithm>
#include <initializer_list>
#include <vector>

#include "core/error.h"
#include "model/llama_gpu.h"

namespace tuna {

// The weight-gradient writes of one backward pass, so that which call overwrites is decided in one place. A
// unit's buffer comes from the store, fresh or not (GpuWeightStore::UnitGrads); the first write of each tensor
// into a fresh buffer overwrites it (kernels/cpu/grad_write.h), every other write adds. Within a pass each tensor
// has one writer, except:
//   - the lm_head: a dW GEMM per row chunk (LlamaGpu::head), of which the first overwrites;
//   - the tied embedding: the lm_head's chunks write the whole [vocab, hidden] block first, then the lookup's
//     backward adds its rows;
//   - an untied embedding: the lookup's backward touches only the rows of the batch's tokens, so its first write
//     zeroes the tensor and then adds (LlamaGpu::backward).
// So a pass writes every element of every unit it takes, and a fresh buffer needs no zeroing. Host bookkeeping
// only: a flag per tensor and per unit, cleared per pass.
class LlamaGpu::GradWrites {
 public:
  explicit GradWrites(const ParamLayout& layout) {
    for (int u = 0; u < layout.num_units(); u++)
      for (const ParamTensor& t : layout.tensors())
        if (t.offset >= layout.unit_range(u).first && t.offset < layout.unit_range(u).second)
          tensors_.push_back({t.offset, u});
    std::sort(tensors_.begin(), tensors_.end(), [](const Tensor& a, const Tensor& b) { return a.offset < b.offset; });
    unit_fresh_.resize(layout.num_units());
  }

  void begin_pass(GpuWeightStore& store) {
    store_ = &store;
    for (Tensor& t : tensors_) t.written = false;
    std::fill(unit_fresh_.begin(), unit_fresh_.end(), Unit::NotTaken);
  }
  // The unit's gradient buffer (the store's answer to the pass's first request says whether it is fresh).
  float* unit(int unit) {
    const GpuWeightStore::UnitGrads g = store_->grads(unit);
    unit_fresh_[unit] = g.fresh ? Unit::Fresh : Unit::Holding;
    return g.data;
  }
  // How this write of the tensor at layout offset `offset` goes: Overwrite if it is the pass's first write of the
  // tensor and the unit's buffer is fresh, else Accumulate.
  GradWrite write(int64_t offset) {
    const auto it = std::lower_bound(tensors_.begin(), tensors_.end(), offset,
                                     [](const Tensor& t, int64_t o) { return t.offset < o; });
    TUNA_CHECK(it != tensors_.end() && it->offset == offset, "no parameter tensor starts at offset ", offset);
    TUNA_CHECK(unit_fresh_[it->unit] != Unit::NotTaken, "a gradient write into unit ", it->unit,
               " before its buffer was taken in this pass");
    const bool first = !it->written;
    it->written = true;
    return first && unit_fresh_[it->unit] == Unit::Fresh ? GradWrite::Overwrite : GradWrite::Accumulate;
  }
  // One write of adjacent tensors at once (a fused GEMM's weight-gradient block): their one mode.
  GradWrite write_block(std::initializer_list<int64_t> offsets) {
    const GradWrite mode = write(*offsets.begin());
    for (const int64_t* o = offsets.begin() + 1; o != offsets.end(); o++)
      TUNA_CHECK(write(*o) == mode, "the tensors at offsets ", *offsets.begin(), " and ", *o,
                 " of one fused gradient write disagree on overwriting");
    return mode;
  }

 private:
  struct Tensor {
    int64_t offset;
    int unit;
    bool written = false;
  };
  enum class Unit { NotTaken, Fresh, Holding };
  std::vector<Tensor> tensors_;  // by offset
  std::vector<Unit> unit_fresh_;
  GpuWeightStore* store_ = nullptr;
};

}  // namespace tuna

#endif  // TUNA_CUDA
