// Checkpoints: loading model weights from a Hugging Face or tuna directory, and tuna's training
// checkpoints (model + optimizer + state) written atomically.
//
// A tuna checkpoint directory is also a Hugging Face model directory: config.json and model.safetensors
// with HF tensor names (fp32 master weights, or the source dtype for a converted base model). Training
// adds optimizer.safetensors (AdamW moments "exp_avg.<name>" / "exp_avg_sq.<name>") and state.json (step,
// effective train config, data cursor, RNG, world layout). Tokenizer files travel along so that a
// checkpoint exports and samples on its own.
//
//   ckpt/step_00001000/   config.json model.safetensors optimizer.safetensors state.json tokenizer.model ...
//
// A checkpoint is written into ckpt/.tmp-step_00001000, every file fsynced, then renamed: a directory
// named step_* is always complete. Only the newest keep_last are kept. ckpt/latest is a symlink to the newest
// (replaced atomically after each rename), so `runs/X/ckpt/latest` names a checkpoint for any tool; where the
// filesystem has no symlinks, resolve_checkpoint gives the same answer to tuna's own tools.
//
// Checkpoints check themselves. manifest.json lists every file of the directory with its size and XXH3-64
// (taken as the bytes are written, so it costs no second read); verify_checkpoint compares the directory
// against it, and resume_checkpoint (the trainer's --resume) takes the newest checkpoint that verifies on
// every rank, saying why it skipped any newer one and renaming those to rejected-step_* so that the
// rotation of later checkpoints cannot delete the good one it resumed from. state.json must agree with its
// directory's step and with the optimizer's update count (read_training_state, check_optimizer_steps).
// Weights and moments are never written when one of them is NaN or infinite (the save fails naming the
// tensor), and never loaded either (every reader refuses them, naming the tensor and the index).
//
// Several ranks (data / tensor parallel, ZeRO) write one file per rank instead of model.safetensors and
// optimizer.safetensors, each rank its own piece of the state, in parallel:
//
//   ckpt/step_00001000/   config.json state.json rank_00000.safetensors ... rank_00003.safetensors tokenizer...
//
// A rank file holds, for every tensor it has a piece of, three 1-D tensors "<name>", "exp_avg.<name>",
// "exp_avg_sq.<name>": elements [begin, begin + n) of this rank's tensor-parallel block of the global
// tensor (row-major), with the block and begin in the metadata "pieces" (JSON: name -> {global_shape,
// split_dim, split_begin, shape, begin}). Pieces are placed in global coordinates, so a checkpoint is
// read back by any world size, tensor-parallel degree and ZeRO stage (resharding on load): a reader asks for
// the ranges of global elements the new rank owns and reads only the parts of the pieces that cover them.
// There is no merged model.safetensors (rank 0 would need the whole model in memory): load_weights (eval,
// sample, --init) and `build/convert tuna-to-hf` read rank files directly.
//
// A LoRA run's checkpoint (LoraFiles) is a PEFT adapter directory instead of a model directory: the adapters'
// weights as adapter_model.safetensors, beside the same optimizer, state, manifest and tokenizer files, and the
// base named by path and checksum (ckpt/peft.h has the format and the reasons).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "data/loader.h"     // LoaderCursor (a plain struct, and its checks)
#include "data/tokenizer.h"  // TokenizerFile (a plain struct: model/ calls nothing of data/)
#include "core/checksum.h"    // FileDigest
#include "model/layout.h"
#include "model/lora.h"       // LoraConfig
#include "model/optimizer.h"  // Segment

namespace tuna {

class Comm;
class ProgressLine;  // core/progress.h

class AdamW;
class HfCheckpointDir;

// Durable writes: fsync of a file or a directory, and a whole small file written and fsynced (returning its
// size and XXH3, for a manifest); failures (a full disk, a read-only filesystem) are errors naming the path.
void fsync_path(const std::filesystem::path& p, bool directory);
FileDigest write_text_file(const std::filesystem::path& p, const std::string& text);

// Reads pieces of a model's weights for `layout` (any tensor-parallel rank's) from a directory holding
// config.json + safetensors (a Hugging Face download, single file or sharded with an index, or a tuna checkpoint,
// single file or rank files), converting bf16/f16 to fp32. The files are mapped and only the bytes of each piece
// are read: a rank that asks for its shard reads its shard, never the whole model (sharded init at scale). Fails
// naming the directory and tensor for a missing tensor, a wrong shape or dtype, and (at construction) for tensors
// the model does not have (another architecture); rotary inv_freq buffers and a duplicate lm_head of a tied model
// are skipped.
class WeightReader {
 public:
  WeightReader(const std::filesystem::path& dir, const ParamLayout& layout);
  ~WeightReader();
  // Elements [piece.begin, piece.begin + piece.size) of the flat layout into out.
  void read(const Segment& piece, float* out);

 private:
  struct Reader;
  std::unique_ptr<Reader> reader_;
  const ParamLayout& layout_;
};

// Every parameter of `layout` into params (ParamLayout order): WeightReader over the whole layout.
void load_weights(const std::filesystem::path& dir, const ParamLayout& layout, float* params);

// Fails on a tensor of `dir` that is not in `layout` (another architecture, or a config.json that does not
// match the weights); rotary inv_freq buffers and the duplicate lm_head of a tied model are allowed.
void refuse_foreign_tensors(const HfCheckpointDir& dir, const ParamLayout& layout);

// The HF config.json object of a model directory, verbatim (to carry unknown fields through export).
nlohmann::json read_config_json(const std::filesystem::path& dir);

// What makes a checkpoint a LoRA checkpoint (ckpt/peft.h): the adapters' configuration and the frozen base's
// identity. The checkpoint then holds adapter_model.safetensors (PEFT's names, global shapes, fp32) instead of
// model.safetensors, adapter_config.json, base_model.json (`base`) and the base's config.json as base_config.json.
inline constexpr const char* kAdapterConfigFile = "adapter_config.json";
inline constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";
inline constexpr const char* kBaseModelFile = "base_model.json";
inline constexpr const char* kBaseConfigFile = "base_config.json";
struct LoraFiles {
  LoraConfig lora;
  nlohmann::json base;  // {"path", "checksum"}: ckpt/peft.h base_identity
};

// AdamW's state for a single-file checkpoint: moments in ParamLayout order; m null: weights only.
struct MomentsView {
  const float* m = nullptr;
  const float* v = nullptr;
  int64_t steps_taken = 0;
};

struct CheckpointContents {
  const nlohmann::json* config_json;  // HF config.json to write
  const float* params;                // ParamLayout order, fp32 (or null with `state`)
  MomentsView optimizer;              // optimizer.m null: weights only (convert)
  nlohmann::json state;               // written as state.json; "step" must be set
  std::vector<TokenizerFile> tokenizer_files;  // copied into the checkpoint (data/tokenizer.h)
  ProgressLine* progress = nullptr;           // advanced by the bytes of the weight files written, when given
  // Instead of params and optimizer: the whole model's weights and moments a piece at a time (one rank's
  // Engine::export_state, whose `segments` cover the layout in order), AdamW's steps in optimizer.steps_taken.
  // The files are the same bytes; no copy of the model is made on the host.
  const std::vector<Segment>* segments = nullptr;
  StateExport export_state = nullptr;
  // A LoRA checkpoint: config_json is the base's and the layout the adapters' (model/lora.h lora_layout). With
  // rank files, rank 0 also assembles adapter_model.safetensors from them, a tensor at a time.
  const LoraFiles* lora = nullptr;
};

// Writes root/step_<step> atomically (with its manifest) and deletes the oldest step_* beyond keep_last (0
// keeps all). Fails, writing nothing, when a weight or moment is not finite.
std::filesystem::path save_checkpoint(const std::filesystem::path& root, int64_t step, const ParamLayout& layout,
                                      const CheckpointContents& contents, int64_t keep_last);

// Deleting a checkpoint (the rotation, a step written again): renamed to .deleting-step_* first, then deleted,
// so that a kill in between never leaves a half-deleted step_* directory.
inline constexpr const char* kDeletingPrefix = ".deleting-";
void remove_checkpoint(const std::filesystem::path& dir);
// The rotation: deletes the oldest step_* under root beyond the newest keep_last (0 keeps all).
void prune_checkpoints(const std::filesystem::path& root, int64_t keep_last);
// At the start of a run (out_dir locked, so no other writer): removes what a killed run left under root, the
// .deleting-* of an interrupted rotation and the .tmp-step_* of an interrupted write. Returns their names.
std::vector<std::string> clean_checkpoint_leftovers(const std::filesystem::path& root);

// A checkpoint directory's name for a step (1000 -> step_00001000), also in the names of files that refer to one.
std::string step_dir_name(int64_t step);
// The step in a checkpoint directory's name (step_00001000 -> 1000); -1 when the name is not exactly one that
// save_checkpoint writes (a name of 20 digits, or "step_12", is not a checkpoint of tuna's).
int64_t checkpoint_step(const std::filesystem::path& dir);

// The complete step_* directories under root (those with a state.json), oldest first.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& root);

// The newest complete step_* directory under root, if any (not verified: see resume_checkpoint).
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);

// The checkpoint a path given by a user names: the path itself, or for ".../latest" the step directory it
// stands for (the symlink's target, or the newest complete checkpoint beside it where there is no symlink).
// Fails when ".../latest" has no checkpoint to stand for.
std::filesystem::path resolve_checkpoint(const std::string& path);

// Bytes of one training checkpoint of a model with n_params parameters on disk: fp32 weights and two fp32
// AdamW moments (12 bytes per parameter, summed over rank files) plus config, state, manifest and the tokenizer
// files it carries.
int64_t checkpoint_bytes(int64_t n_params, const std::vector<TokenizerFile>& tokenizer_files);

// Reads state.json of a checkpoint directory (fails naming the file when missing or malformed, or when
// 'step' is not an integer in [0, 2^62]).
nlohmann::json read_state(const std::filesystem::path& dir);
// The seq_len a training checkpoint was trained with (state.json's train_config), if dir is one.
std::optional<int64_t> training_seq_len(const std::filesystem::path& dir);
// How the run that wrote a checkpoint treated packed documents (its train_config's document_mask and
// document_positions), so that build/eval scores windows as validation did: nullopt for a model tuna did not
// train (a Hugging Face download, an import); a tuna run from before these options had neither, so
// {mask false, positions continue}, what it trained with.
struct TrainedDocumentMode {
  bool mask = true;
  bool restart_positions = true;
};
std::optional<TrainedDocumentMode> training_document_mode(const std::filesystem::path& dir);

// A training checkpoint's state.json, checked for a resume: 'step' equals the step in the directory's name
// (state.json of step_00000010 saying 417 is a damaged checkpoint, not a finished run), 'data_cursor' is an
// object (without it the data order would silently restart), 'skipped_steps' (steps whose loss or gradient
// was not finite, so AdamW did not count them) lies in [0, step].
struct TrainingState {
  int64_t step = 0;
  int64_t skipped_steps = 0;
  nlohmann::json data_cursor;  // the loader's cursor (data/loader.h)
  nlohmann::json state;        // the whole state.json (train_config, world, ...)
};
TrainingState read_training_state(const std::filesystem::path& dir);
// The data cursor a resume continues from, for dp_size ranks: checked against the step (the windows the
// checkpoint's segment took at its train_config's micro_batch x grad_accum per step, data/loader.h
// check_cursor_progress), resharded, and marked as the start of the new segment at this step.
LoaderCursor resume_data_cursor(const TrainingState& state, int64_t dp_size, const std::filesystem::path& dir);
// AdamW's update count, as the checkpoint's optimizer state holds it, must be step - skipped_steps.
void check_optimizer_steps(const TrainingState& state, int64_t steps_taken, const std::filesystem::path& dir);

// manifest.json of a checkpoint: file name -> size and XXH3-64.
inline constexpr const char* kManifestFile = "manifest.json";
// Compares dir with its manifest: every listed file present with its size, no file of the directory left out,
// and the checksum of files part, part + parts, ... of the list (in name order), so that `parts` ranks share
// the reading. Returns what is wrong, naming the file; empty when it verifies. A directory written before
// checkpoints carried a manifest verifies with *unverified set (sizes and checksums unknown).
std::string verify_checkpoint(const std::filesystem::path& dir, int part = 0, int parts = 1, bool* unverified = nullptr);

// The same for the files `reads` selects (the others are checked for presence and size only).
std::string verify_checkpoint_files(const std::filesystem::path& dir,
                                    const std::function<bool(const std::string&)>& reads, int part = 0, int parts = 1,
                                    bool* unverified = nullptr);

// One rule for every tool that reads a model directory: where it has a manifest, the files the tool reads are
// checked against their checksums before use, and every listed file for its size (--resume and `convert
// tuna-to-hf` read all of them: verify_checkpoint). Weights: what eval, sample and --init read (all but
// optimizer.safetensors; a rank file, which holds the moments too, is read whole). Tokenizer: what prepare and
// the tokenizer checks read (config.json, tokenizer files). Fails naming the file and what is wrong; returns
// false when the directory has no manifest (a Hugging Face download): unverified_note says so. The Comm
// overload shares the reading among the ranks (collective).
enum class ModelFiles { Weights, Tokenizer };
bool verify_model_directory(const std::filesystem::path& dir, ModelFiles files, int part = 0, int parts = 1);
bool verify_model_directory(const std::filesystem::path& dir, ModelFiles files, Comm& world);
std::string unverified_note(const std::filesystem::path& dir);

// --resume: the newest checkpoint under root that verifies on every rank of `world` (each checks its share of
// the files, then all agree), or none when root holds none. A newer one that fails is reported through
// `warn` (what failed, and which step the run falls back to) and renamed to rejected-step_* by rank 0. Fails
// when checkpoints exist but none verifies. Collective over world.
std::optional<std::filesystem::path> resume_checkpoint(const std::filesystem::path& root, Comm& world,
                                                       const std::function<void(const std::string&)>& warn);

// Restores AdamW moments and step count from dir/optimizer.safetensors.
void load_optimizer(const std::filesystem::path& dir, const ParamLayout& layout, AdamW& optimizer);

// True when dir holds rank_*.safetensors (a checkpoint written by several ranks).
bool is_sharded_checkpoint(const std::filesystem::path& dir);

// One rank's piece of a checkpoint: its `segments` (runs of the layout's flat buffer), handed out a piece at a
// time by export_state (Engine::export_state), which the writer streams into the rank file.
struct ShardState {
  const std::vector<Segment>* segments;
  StateExport export_state = nullptr;
  int64_t steps_taken = 0;
  bool write_replicated = true;  // false on tp ranks > 0: tensors every tp rank holds are written once
  ProgressLine* progress = nullptr;  // advanced by the bytes written, when given
};

// The export of a state held whole in shard order (params, m and v each the concatenation of `segments`): for
// tests and small models; the pointers must outlive the export.
StateExport shard_buffers_export(const std::vector<Segment>& segments, const float* params, const float* m,
                                 const float* v);

// Sharded writing, in three phases separated by barriers (train.cu): rank 0 prepares the temporary
// directory, every rank writes its file, rank 0 adds config, state and tokenizer and renames.
std::filesystem::path checkpoint_tmp_dir(const std::filesystem::path& root, int64_t step);
std::filesystem::path prepare_sharded_checkpoint(const std::filesystem::path& root, int64_t step);  // rank 0
void write_checkpoint_shard(const std::filesystem::path& tmp_dir, int rank, const ParamLayout& layout,
                            const ShardState& shard);
std::filesystem::path finish_sharded_checkpoint(const std::filesystem::path& root, int64_t step,
                                                const CheckpointContents& contents, int64_t keep_last);  // rank 0

// Pieces of the weights and AdamW moments of any tuna training checkpoint (single-file or sharded, any world
// layout) for a model laid out by `layout` (any tp rank): only each piece's bytes are read, so a rank restores its
// shard a unit at a time without holding it whole.
class CheckpointReader {
 public:
  CheckpointReader(const std::filesystem::path& dir, const ParamLayout& layout);
  ~CheckpointReader();
  // Elements [piece.begin, piece.begin + piece.size) of the flat layout: weights, exp_avg, exp_avg_sq.
  void read(const Segment& piece, float* params, float* m, float* v);
  int64_t steps_taken();  // AdamW's, from the checkpoint's metadata

 private:
  struct Reader;
  std::unique_ptr<Reader> reader_;
  const ParamLayout& layout_;
};

// Restores a rank's weights and AdamW moments from any tuna training checkpoint (single-file or sharded, any world
// layout) for a model laid out by `layout` (any tp rank): import_state (Engine::import_state) asks for each of
// `segments` in turn and gets only that piece's bytes read. Returns AdamW's steps_taken.
int64_t load_checkpoint_state(const std::filesystem::path& dir, const ParamLayout& layout,
                              const std::vector<Segment>& segments, const StateImport& import_state);

// The same into whole-shard vectors, in shard order of `segments` (tests, small models).
int64_t load_checkpoint_shard(const std::filesystem::path& dir, const ParamLayout& layout,
                              const std::vector<Segment>& segments, std::vector<float>& params,
                              std::vector<float>& m, std::vector<float>& v);

}  // namespace tuna
