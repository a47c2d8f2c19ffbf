// Moving models between Hugging Face directories and tuna checkpoints.
//
// import: HF directory (config.json + model.safetensors or a sharded index) -> tuna checkpoint directory
// (config.json verbatim, model.safetensors in tuna's layout order, state.json at step 0, tokenizer files).
// The weights keep their dtype unless asked otherwise: the trainer converts to fp32 master weights when
// it loads, and a 70B bf16 base model does not double on disk.
// export: tuna checkpoint -> HF directory that transformers loads: weights in the dtype of config.json's
// torch_dtype (or the one asked for), sharded with model.safetensors.index.json past max_shard_bytes.
// bf16 -> f32 -> bf16 and every same-dtype copy are exact, so import then export returns the same bytes.
// Both write into a new or empty out_dir; an existing model directory (one with config.json) is replaced only
// with overwrite (deleted once the source has been checked), and anything else in the way is refused.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>

#include "model/layout.h"
#include "model/optimizer.h"  // Segment

namespace tuna {

struct ConvertReport {
  int64_t tensors = 0;
  int64_t parameters = 0;
  int64_t bytes_written = 0;
  std::string dtype;  // what was written
  int64_t shards = 1;
  int64_t host_staging_bytes = 0;  // the host buffers the weights went through (bounded by a run, not the model)
};

// dtype: "keep" (each tensor as found), "float32", "bfloat16" or "float16".
// `progress`: where progress lines go (converted and written bytes, rate, ETA); null: nowhere.
ConvertReport import_hf(const std::filesystem::path& hf_dir, const std::filesystem::path& out_dir,
                        const std::string& dtype, std::FILE* progress = nullptr, bool overwrite = false);

// dtype: "auto" (config.json's torch_dtype), "float32", "bfloat16" or "float16".
ConvertReport export_hf(const std::filesystem::path& ckpt_dir, const std::filesystem::path& out_dir,
                        const std::string& dtype, int64_t max_shard_bytes, std::FILE* progress = nullptr,
                        bool overwrite = false);

// The same export for weights read through `read` (fp32 pieces of `layout`, a tp-1 model of config_json), a bounded
// run of one tensor at a time: base + adapters merged (ckpt/peft.h). dtype as export_hf's, "auto" being
// config_json's torch_dtype. src_dir: the directory the weights come from (out_dir must not be it or hold it);
// tokenizer_dir: where the tokenizer files are copied from.
ConvertReport export_hf_pieces(const nlohmann::json& config_json, const ParamLayout& layout,
                               const std::function<void(const Segment&, float*)>& read, const std::string& dtype,
                               int64_t max_shard_bytes, const std::filesystem::path& src_dir,
                               const std::filesystem::path& tokenizer_dir, const std::filesystem::path& out_dir,
                               std::FILE* progress = nullptr, bool overwrite = false);

}  // namespace tuna
