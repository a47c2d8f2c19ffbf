// The CPU memory plan against what Llama + Zero really allocate, to the byte: shared by the single-rank tests
// (tests/model/test_memory_plan_cpu.cpp) and the multi-rank ones under mpirun (tests/mpi/test_memory_plan.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "dist/zero.h"
#include "model/config.h"
#include "model/llama.h"
#include "model/memory_plan.h"
#include "model/pipeline.h"

namespace tuna::testing_util {

// The llama2_tiny fixture (untied, 4 heads of 16) reshaped: `layers` layers, tied or not, 2 kv heads (so tp 2
// keeps whole groups), an ffn and a vocabulary that tp 2 or 4 and dp 3 split unevenly.
inline LlamaConfig plan_test_config(int layers, bool tied) {
  std::ifstream in("tests/fixtures/llama2_tiny/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j["num_hidden_layers"] = layers;
  j["tie_word_embeddings"] = tied;
  j["num_key_value_heads"] = 2;
  j["intermediate_size"] = 170;
  j["vocab_size"] = 131;
  return LlamaConfig::from_json(j, "plan test config");
}

struct PlannedAndAllocated {
  int64_t planned_activations, planned_state, allocated_activations, allocated_state;
};

// Builds this rank's Llama + Zero for the layout, runs one step (ZeRO-2/3 allocate their unit buffers in the
// backward), and returns the plan's activations and training state beside the allocations. With LoRA adapters
// (layout.lora) Zero trains the adapters and the state adds the frozen base's weights (whole, or at ZeRO-3 its shard and
// gathered units). A pipeline layout (layout.pp) builds stage layout.pp_rank with its activation slots and runs one
// micro-batch through the stage alone (its input and output gradient zeros: the figures, not the values, are what is
// compared).
inline PlannedAndAllocated plan_and_allocate(const LlamaConfig& config, const MemoryLayout& layout, Comm& dp, Comm* tp) {
  const MemoryPlan plan = plan_cpu_memory(config, layout);
  const bool lora = layout.lora.enabled();
  const PipelineStage stage = pipeline_stages(config, layout.pp, layout.seq_len)[layout.pp_rank];
  Llama model(config, layout.micro_batch, layout.seq_len,
              LlamaParallel{tp, /*external_weights=*/layout.zero == 3, /*external_grads=*/layout.zero == 2,
                            /*sequence=*/layout.sp, layout.pp > 1 ? &stage : nullptr, layout.pp - layout.pp_rank,
                            /*external_adapters=*/lora && layout.zero == 3},
              layout.lora);
  std::vector<float> weights(model.layout().total());
  init_random_weights(model.layout(), 7, 0.02, weights.data());
  if (layout.zero < 3) std::copy(weights.begin(), weights.end(), model.params.begin());
  std::unique_ptr<ShardedWeights> frozen;  // LoRA at ZeRO-3: the frozen base's shard
  if (lora && layout.zero == 3) {
    frozen = std::make_unique<ShardedWeights>(model.layout(), dp);
    frozen->fill([&](const Segment& piece, float* out) { std::copy_n(weights.data() + piece.begin, piece.size, out); });
    model.set_weight_store(frozen.get());
  }
  const ParamLayout* adapter_layout = lora ? &model.lora_layout().params : nullptr;
  if (lora && layout.zero < 3)
    init_lora_weights_piece(*adapter_layout, 7, Segment{0, adapter_layout->total()}, model.lora_params.data());
  Zero zero(lora ? lora_parameters(model) : model_parameters(model), OptimizerConfig{}, layout.zero, dp, tp);
  if (layout.zero == 3)
    zero.fill_weights([&](const Segment& piece, float* out) {
      if (lora) init_lora_weights_piece(*adapter_layout, 7, piece, out);
      else std::copy_n(weights.data() + piece.begin, piece.size, out);
    });
  const int64_t n = layout.micro_batch * layout.seq_len;
  std::vector<int32_t> inputs(n), targets(n);
  std::mt19937 rng(3);
  for (int64_t i = 0; i < n; i++)
    inputs[i] = static_cast<int32_t>(rng() % config.vocab_size), targets[i] = static_cast<int32_t>(rng() % config.vocab_size);
  zero.begin_step();
  LossSum loss;
  if (layout.pp > 1) {
    const int64_t hidden = n * config.hidden_size;
    if (!stage.embedding) std::fill_n(model.stage_input(0), hidden, 0.0f);
    loss = model.forward_stage(0, inputs.data(), targets.data(), layout.micro_batch, layout.seq_len, nullptr, true);
    if (!stage.head) std::fill_n(model.stage_output_grad(), hidden, 0.0f);
    model.backward_stage(0, inputs.data(), layout.micro_batch, layout.seq_len, nullptr);
  } else {
    loss = model.forward_backward(inputs.data(), targets.data(), layout.micro_batch, layout.seq_len);
  }
  zero.finish_step(loss, 1e-3);
  const int64_t state = plan.bytes(MemoryKind::Weights) + plan.bytes(MemoryKind::Gradients) +
                        plan.bytes(MemoryKind::Master) + plan.bytes(MemoryKind::Moments) +
                        plan.bytes(MemoryKind::Communication);
  const int64_t base =
      lora ? static_cast<int64_t>(model.params.capacity() * sizeof(float)) + (frozen ? frozen->bytes() : 0) : 0;
  return {plan.bytes(MemoryKind::Activations), state, model.activation_bytes(), zero.state_bytes() + base};
}

}  // namespace tuna::testing_util
