// The device choice and the engine factory (engine/engine.h): which backend a run gets, and the CUDA engine's fit
// check before it allocates. Compiled against the CUDA runtime (the emulator's in the emulated build).
#include "core/error.h"
#include "engine/backends.h"

#if TUNA_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#endif

namespace tuna {

GpuFit plan_gpu_run(const LlamaConfig& config, const EngineOptions& options, const Mesh& mesh, double capacity_gb) {
  int64_t capacity = static_cast<int64_t>(capacity_gb * 1e9);
  if (capacity_gb <= 0) {
#if TUNA_CUDA
    if (resolve_device("cuda") == Device::Cuda) {
      TUNA_CUDA_CHECK(cudaSetDevice(options.gpu.device));
      size_t free_bytes = 0, total_bytes = 0;
      TUNA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      capacity = static_cast<int64_t>(free_bytes);
    }
#else
    fail("option 'gpu_memory_gb': this build has no CUDA, so there is no GPU to measure: give the card's memory in GB "
         "(80 for an H100)");
#endif
  }
  return plan_gpu_fit(config, options, mesh, capacity);
}

Device resolve_device(const std::string& requested) {
  if (requested != "auto" && requested != "cpu" && requested != "cuda")
    fail("option 'device': expected auto, cpu or cuda, found '", requested, "'");
  if (requested == "cpu") return Device::Cpu;
#if TUNA_CUDA
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc == cudaSuccess && count > 0) return Device::Cuda;
  if (requested == "cuda")
    fail("option 'device' is cuda, but no CUDA device is visible (cudaGetDeviceCount: ",
         rc == cudaSuccess ? std::string("0 devices") : std::string(cudaGetErrorString(rc)),
         "); check nvidia-smi and CUDA_VISIBLE_DEVICES, or use --device cpu");
  return Device::Cpu;
#else
  if (requested == "cuda")
    fail("option 'device' is cuda, but this build of tuna has no CUDA (nvcc was not found at build time; "
         "rebuild on a machine with the CUDA toolkit at /usr/local/cuda, or use --device cpu)");
  return Device::Cpu;
#endif
}

std::unique_ptr<Engine> make_engine(const LlamaConfig& config, const EngineOptions& options, Mesh& mesh,
                                    const WeightFill& initial, const DeviceCommFactory& device_comm) {
  // What runs where is the support table's (model/support.h); the layout is placed once, here, for the engine, its
  // model and its memory plan.
  const MemoryLayout run = engine_memory_layout(config, options, mesh);
  require_support(config, run, options.device);
  if (options.lora.enabled() && !initial)
    fail("--lora_rank ", options.lora.rank, ": LoRA trains adapters on a base model, and there are no base weights "
         "(give the base with --init DIR)");
  if (options.device == Device::Cpu) return make_cpu_engine(config, options, run, mesh, initial);
#if TUNA_CUDA
  return make_gpu_engine(config, options, run, mesh, initial, device_comm);
#else
  fail("engine: device cuda is not in this build (resolve_device says so first)");
#endif
}

std::unique_ptr<ForwardModel> make_forward_model(const LlamaConfig& config, Device device, int64_t max_batch,
                                                 int64_t max_seq, const WeightFill& weights,
                                                 const DocumentMode& documents) {
  if (device == Device::Cpu) return make_cpu_forward_model(config, max_batch, max_seq, weights, documents);
#if TUNA_CUDA
  return make_gpu_forward_model(config, max_batch, max_seq, weights, documents);
#else
  fail("forward model: device cuda is not in this build (resolve_device says so first)");
#endif
}

}  // namespace tuna
