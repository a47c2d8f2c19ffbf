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
  if (options.lora.enabled()) {
    // LoRA trains on both engines with ZeRO 0-3 over dp and tp (a quantized base is not sharded: each engine refuses
    // it at ZeRO-3 by name).
    if (!initial)
      fail("--lora_rank ", options.lora.rank, ": LoRA trains adapters on a base model, and there are no base weights "
           "(give the base with --init DIR)");
  }
  if (mesh.pp_size > 1) {
    // What pipeline parallelism covers so far: the CPU engine with ZeRO 0-2 over dp (each stage's own parameters; 0-1
    // with tied embeddings, engine_cpu.cpp), LoRA adapters included; the CUDA engine with ZeRO 0-1 (engine_gpu.cpp),
    // adapters on a bf16 or nf4 base included.
    if (options.device == Device::Cuda && options.zero >= 2)
      fail("option 'pp' ", mesh.pp_size, " with --device cuda and --zero ", options.zero, ": the CUDA engine runs "
           "pipeline stages with ZeRO 0 and 1; use --zero 0 or 1, or --device cpu");
    if (options.zero == 3)
      fail("option 'pp' ", mesh.pp_size, " with --zero 3: sharding a stage's parameters over dp (ZeRO-3 with pipeline "
           "parallelism) is not implemented; use --zero 0, 1 or 2");
  }
  if (options.device == Device::Cpu && options.recompute != Recompute::None)
    fail("--recompute ", recompute_name(options.recompute), " with --device cpu: activation recompute is a CUDA "
         "engine feature (GPU memory is what it saves); the CPU backend keeps every activation: use --recompute none");
  if (options.device == Device::Cpu) {
    if (options.attention != AttentionPath::kDefault)
      fail("--attention ", attention_path_option(options.attention), " with --device cpu: the attention kernels are "
           "the CUDA engine's (the CPU backend has one attention): use --attention auto");
    return make_cpu_engine(config, options, mesh, initial);
  }
#if TUNA_CUDA
  return make_gpu_engine(config, options, mesh, initial, device_comm);
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
