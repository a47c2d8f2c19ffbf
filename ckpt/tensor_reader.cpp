// Reading checkpoints (ckpt/checkpoint.h): model weights, a run's weights and moments a piece at a time, and the
// check that a model directory holds no tensor foreign to the model.
#include "ckpt/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/file.h"
#include "core/json.h"
#include "core/memory.h"
#include "comm/comm.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/optimizer.h"
#include "ckpt/safetensors.h"
#include "ckpt/tensor_reader.h"

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace ckpt_files;

struct WeightReader::Reader {
  explicit Reader(const fs::path& dir) : tensors(dir) {}
  GlobalTensorReader tensors;
};

WeightReader::WeightReader(const fs::path& dir, const ParamLayout& layout)
    : reader_(std::make_unique<Reader>(dir)), layout_(layout) {
  if (const SafetensorsFile* adapter = reader_->tensors.adapter()) {
    // A pipeline stage's adapter layout holds its layers' only (model/lora.h): another stage's layer, an empty unit
    // (unit l is layer l), is not foreign.
    const auto other_stage = [&](const std::string& name) {
      const std::string prefix = "base_model.model.model.layers.";
      if (name.rfind(prefix, 0) != 0) return false;
      const int64_t l = std::atoll(name.c_str() + prefix.size());
      if (l < 0 || l >= layout.num_units()) return false;
      const auto [begin, end] = layout.unit_range(static_cast<int>(l));
      return begin == end && layout.total() > 0;
    };
    for (const TensorInfo& t : adapter->tensors())
      if (!layout.find(t.name) && !other_stage(t.name))
        fail(adapter->path().string(), ": tensor '", t.name, "' is not one of the adapters expected (",
             layout.tensors().size(), " tensors: another rank of layers, targets or base model?)");
  } else if (!reader_->tensors.sharded()) {
    refuse_foreign_tensors(reader_->tensors.model_dir(), layout);
  }
}

WeightReader::~WeightReader() = default;

void WeightReader::read(const Segment& piece, float* out) {
  TUNA_CHECK(piece.begin >= 0 && piece.size >= 0 && piece.begin + piece.size <= layout_.total(), "piece [",
             piece.begin, ", +", piece.size, ") of a layout of ", layout_.total());
  for_each_tensor_of(layout_, piece, [&](const ParamTensor& t, int64_t lb, int64_t le, int64_t at) {
    reader_->tensors.read_block_range(t, "", lb, le, out + at);
  });
}

bool is_sharded_checkpoint(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / rank_file_name(0), ec);
}

void load_weights(const fs::path& dir, const ParamLayout& layout, float* params) {
  WeightReader(dir, layout).read(Segment{0, layout.total()}, params);
}

int64_t load_checkpoint_state(const fs::path& dir, const ParamLayout& layout, const std::vector<Segment>& segments,
                              const StateImport& import_state) {
  CheckpointReader reader(dir, layout);
  size_t next = 0;
  import_state([&](size_t i, float* p, float* m, float* v) {
    TUNA_CHECK(i < segments.size(), "restore asked for piece ", i, " of ", segments.size());
    reader.read(segments[i], p, m, v);
    next++;
  });
  TUNA_CHECK(next == segments.size(), "restore read ", next, " of ", segments.size(), " pieces");
  return reader.steps_taken();
}

int64_t load_checkpoint_shard(const fs::path& dir, const ParamLayout& layout, const std::vector<Segment>& segments,
                              std::vector<float>& params, std::vector<float>& m, std::vector<float>& v) {
  std::vector<int64_t> at;
  int64_t total = 0;
  for (const Segment& seg : segments) at.push_back(total), total += seg.size;
  allocate_host(str("this rank's share of ", dir.string(), " (weights and two AdamW moments)"), 3 * total * sizeof(float),
                [&] { params.assign(total, 0.0f), m.assign(total, 0.0f), v.assign(total, 0.0f); });
  return load_checkpoint_state(dir, layout, segments, [&](const StateSource& source) {
    for (size_t i = 0; i < segments.size(); i++) source(i, params.data() + at[i], m.data() + at[i], v.data() + at[i]);
  });
}

struct CheckpointReader::Reader {
  explicit Reader(const fs::path& dir) : tensors(dir) {}
  GlobalTensorReader tensors;
};

CheckpointReader::CheckpointReader(const fs::path& dir, const ParamLayout& layout)
    : reader_(std::make_unique<Reader>(dir)), layout_(layout) {}

CheckpointReader::~CheckpointReader() = default;

void CheckpointReader::read(const Segment& piece, float* params, float* m, float* v) {
  TUNA_CHECK(piece.begin >= 0 && piece.size >= 0 && piece.begin + piece.size <= layout_.total(), "piece [",
             piece.begin, ", +", piece.size, ") of a layout of ", layout_.total());
  for_each_tensor_of(layout_, piece, [&](const ParamTensor& t, int64_t lb, int64_t le, int64_t at) {
    reader_->tensors.read_block_range(t, "", lb, le, params + at);
    reader_->tensors.read_block_range(t, "exp_avg.", lb, le, m + at);
    reader_->tensors.read_block_range(t, "exp_avg_sq.", lb, le, v + at);
  });
}

int64_t CheckpointReader::steps_taken() { return reader_->tensors.steps_taken(); }

void refuse_foreign_tensors(const HfCheckpointDir& dir, const ParamLayout& layout) {
  // A pipeline stage's layout (--pp) holds a part of the model: the other stages' tensors are not foreign (each stage
  // checks its own, by name and shape). The last stage of a tied model holds a copy of the table as its lm_head.
  const bool tied = layout.has_head() && (layout.tied_copy() ||
                                          (layout.has_embedding() && layout.lm_head() == layout.embed_tokens()));
  const auto other_stage = [&](const std::string& name) {
    if (name == "model.embed_tokens.weight") return !layout.has_embedding();
    if (name == "model.norm.weight" || name == "lm_head.weight") return !layout.has_head();
    const std::string prefix = "model.layers.";
    if (name.rfind(prefix, 0) != 0) return false;
    const int64_t l = std::atoll(name.c_str() + prefix.size());
    if (l < 0 || l >= layout.num_layers() || layout.has_layer(l)) return false;
    // Another stage's layer: a tensor the layers of this stage have too (a stage always holds at least one layer).
    const size_t dot = name.find('.', prefix.size());
    return dot != std::string::npos && layout.find(str(prefix, layout.layer_begin(), name.substr(dot))) != nullptr;
  };
  for (const std::string& name : dir.tensor_names()) {
    if (layout.find(name) || other_stage(name)) continue;
    if (name.ends_with("rotary_emb.inv_freq")) continue;  // recomputed from config.json
    if (tied && name == "lm_head.weight") continue;       // some exports store the tied copy too
    fail(dir.dir().string(), ": tensor '", name,
         "' is not part of a LlamaForCausalLM with this config.json (another architecture, or a config that "
         "does not match the weights)");
  }
}

void load_optimizer(const fs::path& dir, const ParamLayout& layout, AdamW& opt) {
  const fs::path p = dir / "optimizer.safetensors";
  if (!fs::exists(p)) fail(p.string(), ": missing (a checkpoint to resume from needs the optimizer state)");
  SafetensorsFile f(p);
  for (const ParamTensor& t : layout.tensors()) {
    f.read_f32("exp_avg." + t.name, t.shape, opt.m.data() + t.offset);
    f.read_f32("exp_avg_sq." + t.name, t.shape, opt.v.data() + t.offset);
  }
  opt.steps_taken = metadata_int(f, "steps_taken");
}

}  // namespace tuna
