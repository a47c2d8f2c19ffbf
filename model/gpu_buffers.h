// The CUDA model's device buffers as the rows of one table (llm.c's fill_in_activation_sizes and
// malloc_and_point_activations): plan_gpu_buffers lists every buffer of one rank, in the order of its device arena,
// each with its size and the model pointer it fills (or none: the engine's, which dist/zero_gpu.h takes by name). The
// memory plan (plan_gpu_memory) is the table's names and sizes; LlamaGpu's construction lays its arena out from the
// same table and points each of its buffers at its row (LlamaGpu::point). So what is planned and what is allocated are
// one list, and a buffer's size is written once. Plain C++, in every build (build/plan prices GPUs on any machine).
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/memory_plan.h"

namespace tuna {

// Which of LlamaGpu's pointers a row fills.
enum class GpuBuffer : uint8_t {
  Engine,  // not the model's: ZeRO's shard and its buffers (dist/zero_gpu.h), NCCL's scratch
  // Weights, gradients and optimizer state (a full fine-tune's; with adapters the frozen base and the adapters').
  Master, Weights, Gradients, MomentM, MomentV, SegmentStarts, SegmentDecays, NormScratch, NormTotal, ReplicatedNorms,
  Nf4Base, PlainBase, Dequant, LoraWeights, LoraMaster, LoraGradients,
  // Activations and their gradients (Activation: one field of a layer's, GpuBufferRow::field).
  RopeCos, RopeSin, Activation, LoraDropoutInput, LoraDt, Qkv, Gathered, ResidOut, FinalNorm, FinalRstd, LogitsChunk,
  Losses, ClassifierStats, ClassifierMax, DResid, DNorm, DFinalNorm, DQ, DAtt, DK, DV, DAct,
  // Workspace, pipeline and inputs.
  RmsnormScratch, SpNormGrads, AttentionScratch, TiedPeerGrad, LossTotal, Tokens, Targets, GroupPositions,
  GroupTokens, GroupOffsets, DocStarts, RopePositions, AttentionTileCounter, MatmulWorkspace,
  // --fp8 tensorwise (model/fp8_gpu.h): the layers' weight codes and their scales, the activations' amaxes kept for
  // the backward, and one projection group's operand codes and scales at a time (with --fp8_weight_codes forward also
  // its weight's transposed codes).
  Fp8WeightCodes, Fp8WeightScales, Fp8ActivationAmax, Fp8InputCodes, Fp8GradCodes, Fp8GradCodesT, Fp8OperandScales,
  Fp8GradAmax, Fp8WeightCodesT,
};

// A decoder layer's activations (LlamaGpu::LayerActs), in forward order: the fields gpu_keeps_activation names.
enum class GpuActivation : uint8_t {
  ResidIn, Norm1, Rstd1, Q, K, V, Att, Lse, ResidMid, Norm2, Rstd2, GateUp, Act, LoraAx
};
inline constexpr const char* kGpuActivationNames[] = {"resid_in", "norm1", "rstd1",     "q",     "k",
                                                      "v",        "att",   "lse",       "resid_mid", "norm2",
                                                      "rstd2",    "gate_up", "act",     "lora_ax"};

struct GpuBufferRow {
  GpuBuffer buffer = GpuBuffer::Engine;
  int64_t elements = 0, element_bytes = 0;  // what the model uses (its plan item rounds the bytes up: arena bytes)
  // GpuBuffer::Activation: the field (LoraAx: of adapter `target`, a LoraTarget), and the activation slot and layer it
  // belongs to; layer -1: the working copy that every slot and layer share (the recompute mode does not keep it).
  GpuActivation field = GpuActivation::ResidIn;
  int target = -1;
  int64_t slot = 0, layer = -1;
};

struct GpuBufferTable {
  MemoryPlan plan;                 // the buffers' names, kinds and bytes, in arena order
  std::vector<GpuBufferRow> rows;  // rows[i] is plan.items[i]'s
};

// One rank's buffers for `layout` (model/memory_plan_gpu.cpp); plan_gpu_memory is its plan.
GpuBufferTable plan_gpu_buffers(const LlamaConfig& config, const MemoryLayout& layout);

}  // namespace tuna
