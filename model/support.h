// What runs where, said once: does this device run this layout (dp, tp, pp, sp) with these adapters, this quantized
// base and this ZeRO stage, and if not, why. The trainer, both engines, the memory plans and build/plan ask here, so
// that each rule is written once and a refused combination reads the same wherever it is met (torchtitan's
// ParallelDims validation, llm.c's set_zero_configs).
//
// Two kinds of no. An invalid layout cannot be (sp without tp, a ZeRO stage 4, more pipeline stages than layers, a
// quantized base without adapters): nothing plans or runs it. A layout the device's engine does not implement yet
// (the CUDA engine's pipeline at ZeRO-2, an int8 base on cuda) has a design: the memory plan prices it, build/plan
// and --plan_only show it AS DESIGNED, and the engines refuse it with the reason.
//
// The table sits beside MemoryLayout, which it judges, because its readers sit on both sides of it: the memory plans
// (model/), build/plan (plan/), the engines and the trainer (engine/, train.cu).
#pragma once

#include <string>

#include "model/config.h"
#include "model/memory_plan.h"  // MemoryLayout

namespace tuna {

enum class Device { Cpu, Cuda };
const char* device_name(Device device);  // "cpu" | "cuda"

struct Support {
  enum class Verdict { Runs, NotImplemented, Invalid };
  Verdict verdict = Verdict::Runs;
  std::string reason;  // why not: the options, the values, and what to use instead; empty when it runs
  bool runs() const { return verdict == Verdict::Runs; }
};

// The verdict for one rank's layout of `config` on `device` (the layout need not be placed).
Support support(const LlamaConfig& config, const MemoryLayout& layout, Device device);
// Fails with the reason unless the device runs the layout: the engines' and the trainer's question.
void require_support(const LlamaConfig& config, const MemoryLayout& layout, Device device);
// Fails with the reason when the layout is invalid on `device`; a layout that is only not implemented passes (its
// memory plan is the design): the memory plans' and --plan_only's question.
void require_valid(const LlamaConfig& config, const MemoryLayout& layout, Device device);

struct ObjectiveConfig;  // model/objective.h

// Whether `device` runs the training objective on this layout: SFT runs wherever the layout does; a preference objective
// (DPO, SimPO, ORPO) runs where its passes (the log-probs forward, the backward with per-token weights, the reference)
// are wired, and is refused elsewhere as not implemented, naming what is.
Support objective_support(const ObjectiveConfig& objective, const MemoryLayout& layout, Device device);
// Fails with the reason unless the device runs the objective on the layout (the trainer's question).
void require_objective_support(const ObjectiveConfig& objective, const MemoryLayout& layout, Device device);
// Whether the training engine scores --eval_tasks (engine/mc_eval.h) on this layout: the CPU engine's, every layout
// it trains (dp, tp, sp, pp, ZeRO); the CUDA engine's, dp and ZeRO 0-3 (tp and pp are refused as not implemented,
// naming build/eval --tasks, which scores a checkpoint on either device).
Support eval_tasks_support(const MemoryLayout& layout, Device device);

// A quantized base is frozen: only adapters train around it. `option_given`: the --base_quant option was given, which
// a run without adapters refuses whatever its value (the layout's own rule, in support, refuses nf4 and int8).
Support base_quant_support(const LoraPlan& lora, bool option_given = false);

// The layout with what follows from it filled in (MemoryLayout::stages: the pipeline split), once. Fails naming the
// option when the layout itself is invalid (on any device). A placed layout comes back as it is.
MemoryLayout place_layout(const LlamaConfig& config, MemoryLayout layout);

}  // namespace tuna
