// The engines behind make_engine and make_forward_model (engine/device.cpp), one per backend. Internal to engine/:
// callers choose a device and go through the factory.
#pragma once

#include <memory>
#include <string>

#include "engine/engine.h"

namespace tuna {

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
