// Checkpointer: when a run writes a checkpoint, and how an engine's state gets into one and back. It owns the
// every / keep / last policy, so the trainer's loop only asks `due` and calls `save`; the files and their rules
// are ckpt/checkpoint.h's (one file on one rank, one per rank otherwise, atomic, rotated, manifested).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "ckpt/checkpoint.h"  // TrainingState
#include "comm/comm.h"        // Comm, Mesh
#include "data/tokenizer.h"   // TokenizerFile
#include "engine/engine.h"

namespace tuna {

class Checkpointer {
 public:
  // root: out_dir/ckpt. every: a checkpoint each `every` steps (0: at the end only); keep: the newest kept (0: all).
  // config_json and tokenizer_files travel in every checkpoint (a checkpoint is a model directory of its own).
  Checkpointer(std::filesystem::path root, int64_t every, int64_t keep, Comm& world, const Mesh& mesh,
               nlohmann::json config_json, std::vector<TokenizerFile> tokenizer_files);

  // A periodic checkpoint after `step` (the last step's is the end's, written once by the trainer).
  bool due(int64_t step, int64_t last_step) const { return every_ > 0 && step % every_ == 0 && step != last_step; }
  // Writes the engine's state at `step` with `state` as state.json (every rank calls it); prints the path and
  // returns the seconds it took.
  double save(Engine& engine, int64_t step, const nlohmann::json& state);
  // Restores the engine from checkpoint `dir` a piece at a time (no rank holds its shard on the host) and returns
  // its state.json, checked against the step and the optimizer's update count.
  static TrainingState restore(Engine& engine, const std::filesystem::path& dir);

  // A LoRA run: its checkpoints are PEFT adapter directories naming `base` by path and checksum (ckpt/peft.h);
  // config_json is then the base's, and the engine's layout the adapters'. Rank 0, which writes those files, reads
  // the base once here for its checksum (every rank calls it). base_quant: how the run holds the base (QLoRA), recorded
  // in base_model.json for the resume and the tools.
  void set_lora(const LoraConfig& lora, const std::filesystem::path& base, BaseQuant base_quant = BaseQuant::None);

  const std::filesystem::path& root() const { return root_; }
  int64_t every() const { return every_; }
  int64_t keep() const { return keep_; }

 private:
  std::filesystem::path root_;
  int64_t every_, keep_;
  Comm& world_;
  const Mesh& mesh_;
  nlohmann::json config_json_;
  std::vector<TokenizerFile> tokenizer_files_;
  std::optional<LoraFiles> lora_;
};

}  // namespace tuna
