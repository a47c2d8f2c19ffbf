// LoRA checkpoints in Hugging Face PEFT's format, the base model they name, and base + adapters merged.
//
//   ckpt/step_00000100/   adapter_config.json adapter_model.safetensors    PEFT's two files
//                         optimizer.safetensors (one rank) | rank_*.safetensors (several: weights and moments)
//                         base_model.json base_config.json state.json manifest.json tokenizer files
//
// PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir) reads only PEFT's two files:
// adapter_model.safetensors holds every adapter whole (global shapes, fp32) under PEFT's keys, also when ranks
// wrote rank files (rank 0 assembles it from them after the barrier, a tensor at a time). The base's config.json
// travels as base_config.json, never config.json: a directory with config.json is a model to transformers (and
// AutoModelForCausalLM would look for model weights there), one with adapter_config.json and no config.json is an
// adapter, which transformers with PEFT installed loads onto the base that adapter_config.json names.
//
// The base is named by path and checksum (base_model.json), so that a resume, eval, sample or export finds it
// and refuses one that changed since. The checksum is the XXH3-64 of the base's manifest.json when it has one (a
// tuna checkpoint: the manifest holds every file's XXH3, and tuna verifies a manifested directory's files against
// it whenever it reads them; recording it reads one small file), else the XXH3-64 of its config.json and of every
// tensor's name, dtype, shape and bytes in name order (a Hugging Face download: one sequential read of the weight
// files, at disk speed, when the run starts and when a tool checks the base; the weights' reads that follow come
// from the page cache where it holds them). Per tensor, not per file, so that the same weights resharded into
// other files keep their identity, and file times play no part (a copy on another machine is the same base).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "ckpt/checkpoint.h"  // LoraFiles, WeightReader
#include "ckpt/hf_convert.h"  // ConvertReport
#include "ckpt/safetensors.h"
#include "model/config.h"
#include "model/layout.h"
#include "model/lora.h"
#include "model/lora_shape.h"  // BaseQuant

namespace tuna {

// A directory of adapters: a LoRA checkpoint or a PEFT adapter directory (it has adapter_config.json).
bool is_lora_directory(const std::filesystem::path& dir);

// The base model's identity, as base_model.json records it: {"path", "checksum": {"method", "xxh3_64"}}.
struct BaseIdentity {
  std::string path;    // absolute
  std::string method;  // "manifest" | "tensors"
  uint64_t xxh3 = 0;
  nlohmann::json to_json() const;
};
// Computes it for the model directory `base` (see the header for its cost).
BaseIdentity base_identity(const std::filesystem::path& base);
// What a LoRA run's checkpoints record (the Checkpointer's LoraFiles) for adapters `lora` on `base`, held as `quant`
// (QLoRA: base_model.json's "quantization"; none is not written).
LoraFiles lora_files(const LoraConfig& lora, const std::filesystem::path& base, BaseQuant quant = BaseQuant::None);
// How the adapters of a LoRA checkpoint were trained: on their base quantized as base_model.json's "quantization"
// says (QLoRA: the dequantized weights), or on the base as it is (no such field, or no base_model.json: a PEFT
// adapter from elsewhere). Fails naming the file and the field on a value other than none, nf4 or int8.
BaseQuant lora_base_quant(const std::filesystem::path& lora_dir);

// The base of a LoRA checkpoint: `override_base` (--base) when given, else the path in its base_model.json; checked
// against the recorded checksum (fails naming the recorded path and the one found when they differ, and saying
// --base when the recorded path is gone). Its files are verified against its manifest where it has one.
std::filesystem::path lora_base(const std::filesystem::path& lora_dir, const std::filesystem::path& override_base = {});

// The same, collective over `world`: rank 0 reads the base for its checksum, the others wait and fail with it (a
// resume on 16 ranks reads the base's bytes once for the check, not 16 times).
std::filesystem::path lora_base(const std::filesystem::path& lora_dir, const std::filesystem::path& override_base,
                                Comm& world);

// One rule for every reader of a LoRA checkpoint (--lora_init, --resume, peft-to-tuna, eval, sample, merge-lora,
// tuna-to-gguf): each opens the directory through open_lora_checkpoint, which
//  1. requires adapter_config.json and adapter_model.safetensors (adapter_model.bin is named as unread);
//  2. takes the directory for a tuna LoRA checkpoint when tuna wrote it (manifest.json or state.json), and then
//     requires base_model.json (without it nothing holds the adapters to their base: the error says how to go on);
//     a PEFT adapter directory from elsewhere has neither;
//  3. holds the directory to its manifest where it has one: every listed file's size, nothing unlisted, and the
//     checksums of what the readers use (all but optimizer.safetensors, ModelFiles::Weights). A caller that has just
//     checked the checksums by the same manifest (a resume, eval, sample, the exports) says so, and only sizes and
//     the listing are checked again;
//  4. reads adapter_config.json (a refusal names the file and its key) and base_model.json's quantization (none,
//     nf4 or int8, as every reader takes it);
//  5. finds the base and checks it (lora_base: `base`, else the recorded path held to its checksum, else the base
//     adapter_config.json names);
//  6. checks the configuration against the base (its rank against each target's dimensions) and
//     adapter_model.safetensors to hold exactly the adapters it targets on that base, each of the base's shape: an
//     extra or a missing adapter is refused by every reader alike.
struct LoraCheckpoint {
  std::filesystem::path dir, base;
  LoraConfig lora;                         // adapter_config.json
  BaseQuant quant = BaseQuant::None;       // base_model.json's "quantization"
  LlamaConfig base_config;                 // the base's config.json
  bool tuna = false;                       // a tuna LoRA checkpoint, not a PEFT directory from elsewhere
  bool manifest = false;                   // held to its manifest.json
};
enum class LoraManifest { Verify, ChecksumsVerifiedByCaller };
// base: --base (or --init for --lora_init, the base a new run trains on), or empty.
LoraCheckpoint open_lora_checkpoint(const std::filesystem::path& dir, const std::filesystem::path& base,
                                    LoraManifest manifest = LoraManifest::Verify);
// The same, collective over `world` (train.cu): the ranks share the checksums' reading, rank 0 checks the base, and
// a refusal on any rank is an error on every rank.
LoraCheckpoint open_lora_checkpoint(const std::filesystem::path& dir, const std::filesystem::path& base, Comm& world,
                                    LoraManifest manifest);

// A piece of the weights of some layout, ParamLayout order (engine/engine.h WeightFill is this type).
using LayoutFill = std::function<void(const ParamLayout& layout, const Segment& piece, float* out)>;

// The model's weights for eval, sample and the exports: a model directory as it is, or a LoRA checkpoint's base
// with the adapters merged on load (W + (alpha / r) B A on the targeted projections).
struct ModelSource {
  std::filesystem::path config_dir;  // where config.json is: the directory, or the LoRA checkpoint's base
  std::filesystem::path lora_dir;    // the LoRA checkpoint, or empty
  LayoutFill fill;
};
// override_base: --base (only for a LoRA checkpoint; fails otherwise). The caller verifies dir (verify_model_directory);
// a LoRA checkpoint is then opened by the rule of every reader (open_lora_checkpoint).
ModelSource open_model(const std::filesystem::path& dir, const std::filesystem::path& override_base = {});

// Reads a model's weights (any tp rank's layout) from `base`, a piece at a time, adding (alpha / r) B A to the rows
// of the piece that belong to a targeted projection (its tp block: global rows and columns). A QLoRA checkpoint's base
// (lora_base_quant) is read as its training saw it: each projection quantized and dequantized (model/
// quantized_weights.h dequantized_base_fill), then the adapters added, as PEFT merges onto a 4-bit model's
// dequantized weights.
// The adapters (A, B of one projection at a time) come from lora_dir/adapter_model.safetensors; their shapes must be the base's (fails
// naming the tensor and both shapes), and the file must hold exactly the adapters adapter_config.json targets.
class MergedWeightReader {
 public:
  MergedWeightReader(const std::filesystem::path& base, const std::filesystem::path& lora_dir,
                     const ParamLayout& layout);
  MergedWeightReader(const MergedWeightReader&) = delete;  // base_fill_ reads through this object's base_
  MergedWeightReader& operator=(const MergedWeightReader&) = delete;
  void read(const Segment& piece, float* out);
  BaseQuant base_quant() const { return quant_; }

 private:
  void load_adapter(int64_t layer, LoraTarget t);
  WeightReader base_;
  BaseQuant quant_;
  LayoutFill base_fill_;  // base_, dequantized as quant_ says
  const ParamLayout& layout_;
  LlamaConfig config_;
  LoraConfig lora_;
  std::filesystem::path adapter_path_;
  std::optional<SafetensorsFile> adapter_;
  int64_t cached_layer_ = -1;
  int cached_target_ = -1;
  std::vector<float> a_, b_;  // the cached projection's A [r, in] and B [out, r]
  struct Targeted {
    const ParamTensor* weight;  // W of the projection in layout_
    int64_t layer;
    LoraTarget target;
  };
  std::vector<Targeted> targeted_;  // layout order
};
LayoutFill merged_lora_weights(const std::filesystem::path& base, const std::filesystem::path& lora_dir);

// --base_quant: the base's projections must be stored in bf16 or fp32 (model/quantized_weights.h
// check_base_dtype_for_quant), checked from the files' headers; fails naming the file and the tensor. A tuna rank-file
// checkpoint holds fp32.
void check_quantizable_base(const std::filesystem::path& base, const LlamaConfig& config, BaseQuant quant);

// --lora_init DIR: the adapters' configuration of a PEFT adapter directory (or LoRA checkpoint). A field a user also
// gave as an option must agree (fails naming the option, its value, the file and its value).
struct LoraOptionsGiven {
  std::optional<int64_t> rank;
  std::optional<double> alpha, dropout;
  std::optional<uint32_t> targets;
};
// `continues`: what the run does with the file, for the message ("--lora_init continues that adapter").
LoraConfig lora_init_config(const std::filesystem::path& dir, const LoraOptionsGiven& given,
                            const std::string& continues = "--lora_init continues that adapter");
// The adapters' starting weights from DIR/adapter_model.safetensors for the adapter layout (model/lora.h
// lora_layout, any tp rank): each piece read from the file, converted to fp32 (PEFT saves the model's dtype). Fails
// naming the tensor and both shapes for an adapter of another base, and a tensor the layout lacks. No config.json
// is needed in DIR.
LayoutFill adapter_weights_from_peft(const std::filesystem::path& dir);

// What a LoRA run starts from (train.cu), collective over `world`:
//   --resume from a LoRA checkpoint: its adapter_config.json (options given must agree), its base (lora_base: the
//     recorded path or --base, checksum held), adapters restored by the checkpoint (adapters null);
//   --lora_init DIR: DIR's adapter_config.json (options given must agree: lora_init_config), the base --init names
//     (held to DIR's recorded base checksum when DIR is a tuna LoRA checkpoint), adapters read from DIR;
//   else: `options` (the LoRA options with their defaults), the base --init names, adapters null (PEFT's
//     initialization). `given`: which of the options the user set (only those must agree with a file).
// --base only applies to a resume (a fresh run's base is --init); given with --init it is an error naming both.
struct LoraStart {
  LoraConfig lora;
  BaseQuant base_quant = BaseQuant::None;  // how the base is held: a resume's recorded one, else --base_quant
  std::filesystem::path base;  // the frozen base's model directory
  LayoutFill adapters;         // the adapters' starting weights over their layout; null: initialize or restore
};
// base_quant: --base_quant when given. A resume (or a --lora_init tuna checkpoint) that records another is an error
// naming both; not given, a resume takes the recorded one.
LoraStart lora_start(const LoraConfig& options, const LoraOptionsGiven& given, const std::filesystem::path& lora_init,
                     const std::filesystem::path& init, const std::optional<std::filesystem::path>& resume_from,
                     const std::filesystem::path& override_base, Comm& world,
                     std::optional<BaseQuant> base_quant = std::nullopt);

// build/convert peft-to-tuna: a PEFT adapter directory or LoRA checkpoint (opened by the rule of every reader,
// open_lora_checkpoint: a damaged one is refused, never given a fresh manifest; on `base`, or the base it names) as
// a LoRA checkpoint at step 0 in out_dir: PEFT's files as tuna writes them (fp32), the base's identity and the
// quantization its adapters were trained on (QLoRA), the tokenizer files given, a manifest; no optimizer state (a run continues from it with --lora_init, as from any adapter). The
// adapters pass through host memory whole (fp32; 0.8 GB for r = 16 on every projection of a 70B model). An
// existing out_dir is replaced only with overwrite, and only when it is a LoRA checkpoint.
void import_peft(const std::filesystem::path& peft_dir, const std::filesystem::path& out_dir,
                 const std::filesystem::path& override_base, const std::vector<TokenizerFile>& tokenizer,
                 bool overwrite = false);

// build/convert merge-lora: base + adapters as a Hugging Face model directory (config.json, sharded safetensors and
// index, tokenizer files), streamed a bounded run at a time. dtype: "auto" (the base's torch_dtype), "float32" or
// "bfloat16" (or "float16").
ConvertReport merge_lora(const std::filesystem::path& lora_dir, const std::filesystem::path& out_dir,
                         const std::string& dtype, int64_t max_shard_bytes,
                         const std::filesystem::path& override_base = {}, std::FILE* progress = nullptr,
                         bool overwrite = false);

}  // namespace tuna
