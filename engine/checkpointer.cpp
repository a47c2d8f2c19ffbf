// Checkpointer (engine/checkpointer.h).
#include "engine/checkpointer.h"

#include <chrono>
#include <cstdio>

#include "ckpt/peft.h"  // lora_files
#include "core/error.h"
#include "core/progress.h"  // ProgressLine
#include "core/run_report.h"  // refresh_run_report

namespace tuna {

namespace fs = std::filesystem;

Checkpointer::Checkpointer(fs::path root, int64_t every, int64_t keep, Comm& world, const Mesh& mesh,
                           nlohmann::json config_json, std::vector<TokenizerFile> tokenizer_files)
    : root_(std::move(root)),
      every_(every),
      keep_(keep),
      world_(world),
      mesh_(mesh),
      config_json_(std::move(config_json)),
      tokenizer_files_(std::move(tokenizer_files)) {}

void Checkpointer::set_lora(const LoraConfig& lora, const fs::path& base, BaseQuant base_quant) {
  lora_ = world_.rank() == 0 ? lora_files(lora, base, base_quant) : LoraFiles{lora, {}};
}

double Checkpointer::save(Engine& engine, int64_t step, const nlohmann::json& state) {
  const auto started = std::chrono::steady_clock::now();
  const ParamLayout& layout = engine.layout();
  // The engine hands its weights and moments a piece at a time straight into the files (no host copy).
  const StateExport export_state = [&](const StateSink& sink) { engine.export_state(sink); };
  int64_t shard_elements = 0;
  for (const Segment& s : engine.segments()) shard_elements += s.size;
  fs::path p;
  if (world_.size() == 1) {  // one rank: the single-file format (also a Hugging Face model directory)
    TUNA_CHECK(shard_elements == layout.total(), "one rank's shard is not the whole model");
    ProgressLine progress(str("checkpoint step ", step), 12.0 * double(shard_elements), ProgressLine::Unit::Bytes,
                          stdout);
    CheckpointContents contents{&config_json_, nullptr, {nullptr, nullptr, engine.steps_taken()}, state,
                                tokenizer_files_, &progress, &engine.segments(), export_state,
                                lora_ ? &*lora_ : nullptr};
    p = save_checkpoint(root_, step, layout, contents, keep_);
    progress.finish();
  } else {  // one file per rank, written in parallel (ckpt/checkpoint.h)
    if (world_.rank() == 0) prepare_sharded_checkpoint(root_, step);
    world_.barrier("checkpoint directory created");
    // Rank 0's file (ranks write theirs in parallel, of about the same size).
    ProgressLine progress(str("checkpoint step ", step, ", rank 0's file"), 12.0 * double(shard_elements),
                          ProgressLine::Unit::Bytes, world_.rank() == 0 ? stdout : nullptr);
    write_checkpoint_shard(checkpoint_tmp_dir(root_, step), world_.rank(), layout,
                           ShardState{&engine.segments(), export_state, engine.steps_taken(),
                                      /*write_replicated=*/mesh_.tp_rank == 0, &progress});
    progress.finish();
    CheckpointContents contents{&config_json_, nullptr, {}, state, tokenizer_files_};
    contents.lora = lora_ ? &*lora_ : nullptr;
    world_.barrier("checkpoint shards written");
    if (world_.rank() == 0) p = finish_sharded_checkpoint(root_, step, contents, keep_);
    world_.barrier("checkpoint renamed");
  }
  if (world_.rank() == 0) refresh_run_report(root_.parent_path());  // its checkpoint table lists this one now
  std::printf("checkpoint %s\n", p.c_str());
  std::fflush(stdout);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

TrainingState Checkpointer::restore(Engine& engine, const fs::path& dir) {
  TrainingState resumed = read_training_state(dir);  // step, cursor and counts checked
  const int64_t steps_taken = load_checkpoint_state(dir, engine.layout(), engine.segments(),
                                                    [&](const StateSource& source) { engine.import_state(source); });
  check_optimizer_steps(resumed, steps_taken, dir);
  engine.set_steps_taken(steps_taken);
  return resumed;
}

}  // namespace tuna
