// Adapters (LoRA, QLoRA) as one component (torchtitan's components/lora.py): it decides what a run trains, and the
// rest of the run takes that from here instead of asking whether adapters are on.
//
//   options      --lora_rank, --lora_targets, --lora_dropout, --base_quant (build/train and build/plan), and the
//                trainer's --lora_alpha, --lora_init, --base
//   what trains  none (a full fine-tune: every parameter) or adapters, from the options, from --lora_init's PEFT
//                directory, or from the LoRA checkpoint a run resumes (ckpt/peft.h lora_start); the base is then
//                frozen, read from its own directory at every start, and held as --base_quant says
//   the engine   EngineOptions' adapters (their shape, starting values, the base's storage): the engines lay them out
//                (model/lora.h lora_layout: PEFT's names, one unit per layer) and train them as their trainable set
//   the rest     the trainable parameter count, the checkpoint's size, and PEFT adapter checkpoints naming the base
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/options.h"
#include "data/tokenizer.h"  // TokenizerFile
#include "engine/engine.h"   // EngineOptions, WeightFill
#include "model/config.h"
#include "model/lora_shape.h"  // LoraPlan

namespace tuna {

class Checkpointer;

struct AdapterOptions {
  int64_t lora_rank = 0;  // unset: a full fine-tune
  double lora_alpha = 0;  // unset: the rank (a scale of 1)
  double lora_dropout = 0;
  std::string lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
  std::string lora_init;  // a PEFT adapter (or tuna LoRA checkpoint) to continue training
  std::string base;       // --resume of a LoRA run: the base's directory, instead of the recorded one
  std::string base_quant = "none";  // the frozen base held quantized (QLoRA)
};
// The adapters' shape, as build/train and build/plan both read it: lora_rank, lora_targets, lora_dropout, base_quant.
void declare_adapter_shape(Options& o, AdapterOptions& a);
// What only training reads: lora_alpha, lora_init, base.
void declare_adapter_training(Options& o, AdapterOptions& a);
// build/plan's adapters: the shape options parsed (rank 0: a full fine-tune).
LoraPlan adapter_shape(const AdapterOptions& a);

class Adapters {
 public:
  Adapters() = default;  // none: a full fine-tune

  // What a run trains, collective over `world`: adapters when --lora_rank or --lora_init is given or the checkpoint it
  // resumes (resume_from) is a LoRA checkpoint, else none, where an adapter option is an error naming it. init_dir:
  // --init's directory. plan_only: the adapters' shape from the options alone; nothing is read.
  static Adapters open(const AdapterOptions& a, const Options& options, const std::filesystem::path& init_dir,
                       const std::optional<std::filesystem::path>& resume_from, bool plan_only, Comm& world);

  bool enabled() const { return plan_.enabled(); }
  // The frozen base's directory, where the run's model, config and tokenizer come from (the checkpoints hold the
  // adapters alone); empty without adapters, and for a plan.
  const std::filesystem::path& base() const { return base_; }
  // The frozen base's weights, read at every start (a resume's too); null without a base.
  WeightFill base_weights() const;
  // Into the options the run logs and saves: a resume keeps its checkpoint's base quantization.
  void record(AdapterOptions& a) const;
  // The engine's trainable set: the adapters, their starting weights (null: PEFT's initialisation, or a resume restores
  // them) and how the base is held; fails naming the option for adapters the model cannot take, or a base that cannot
  // be quantized.
  void configure(EngineOptions& engine, const LlamaConfig& model) const;

  // The whole model's trainable parameters (every tp rank's and stage's together): all of them, or the adapters'.
  int64_t trainable_parameters(const LlamaConfig& model) const;
  // "trainable parameters: all 1234" or "... 3456 LoRA adapter parameters (0.281% of the 1234567 frozen base's)".
  std::string describe(const LlamaConfig& model) const;
  // The bytes of one checkpoint: the model's, or the adapters' (their weights and moments, and the PEFT file of the
  // adapters beside the rank files).
  int64_t checkpoint_bytes(const LlamaConfig& model, const std::vector<TokenizerFile>& tokenizer_files) const;
  // A LoRA run's checkpoints are PEFT adapter directories naming the base by path and checksum (every rank calls it).
  void attach(Checkpointer& checkpointer) const;

 private:
  LoraPlan plan_;                // the adapters and how the base is held; rank 0: none
  std::filesystem::path base_;   // the frozen base (a run's, not a plan's)
  WeightFill starting_;          // the adapters' starting weights; null: PEFT's initialisation or the resume's
};

}  // namespace tuna
