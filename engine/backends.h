// The engines behind make_engine and make_forward_model (engine/device.cpp), one per backend. Internal to engine/:
// callers choose a device and go through the factory.
#pragma once

#include <memory>
#include <string>

#include "engine/engine.h"

namespace tuna {

// What a pipeline stage (--pp) of either engine needs to talk to its neighbours: the labels of its sends and receives,
// which a timeout names ("recv 'stage 1: activations from stage 0' (n elements from rank r)"), and with tied embeddings
// the tensor whose gradient the first and last stages exchange after the step's backwards (the table on the first
// stage, its copy on the last) and the stage holding the other one. No tensor when the table is not tied, sits on
// neither end, or is frozen (adapters train, so it has no gradient).
struct PipelineLinks {
  std::string recv_activations, send_activations, recv_gradient, send_gradient, tied_exchange;
  const ParamTensor* tied = nullptr;
  int tied_peer = -1;
};
PipelineLinks pipeline_links(const ParamLayout& stage_layout, bool tie_word_embeddings, bool frozen, int stage,
                             int stages);

// The engines take the run's placed layout (engine_memory_layout), which the factory has held to the support table.
// engine/engine_cpu.cpp: Llama + Zero.
std::unique_ptr<Engine> make_cpu_engine(const LlamaConfig& config, const EngineOptions& options, const MemoryLayout& run,
                                        Mesh& mesh, const WeightFill& initial);
std::unique_ptr<ForwardModel> make_cpu_forward_model(const LlamaConfig& config, int64_t max_batch, int64_t max_seq,
                                                     const WeightFill& weights, const DocumentMode& documents);

#if TUNA_CUDA
// engine/engine_gpu.cpp: LlamaGpu with the GPU ZeRO. The factory has checked that the plan fits the device.
std::unique_ptr<Engine> make_gpu_engine(const LlamaConfig& config, const EngineOptions& options, const MemoryLayout& run,
                                        Mesh& mesh, const WeightFill& initial, const DeviceCommFactory& device_comm);
std::unique_ptr<ForwardModel> make_gpu_forward_model(const LlamaConfig& config, int64_t max_batch, int64_t max_seq,
                                                     const WeightFill& weights, const DocumentMode& documents);
#endif

}  // namespace tuna
