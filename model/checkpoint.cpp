#include "model/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <vector>

#include "core/error.h"
#include "model/optimizer.h"
#include "model/safetensors.h"

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;

const char* const kTokenizerFiles[] = {"tokenizer.model",         "tokenizer.json", "tokenizer_config.json",
                                       "special_tokens_map.json", "generation_config.json", nullptr};

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void fsync_path(const fs::path& p, bool directory) {
  int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) fail(p.string(), ": cannot open to fsync");
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail(p.string(), ": fsync failed");
}

void write_text_file(const fs::path& p, const std::string& text) {
  {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    if (!out) fail(p.string(), ": cannot create file");
    out << text;
    out.flush();
    if (!out) fail(p.string(), ": write failed (disk full?)");
  }
  fsync_path(p, false);
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

// step_* directories under root sorted by step, complete ones only.
std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (!fs::is_directory(root)) return found;
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step_", 0) != 0) continue;
    const std::string digits = name.substr(5);
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    if (!fs::exists(e.path() / "state.json")) continue;
    found.emplace_back(std::stoll(digits), e.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

json read_config_json(const fs::path& dir) {
  const fs::path p = dir / "config.json";
  std::ifstream in(p);
  if (!in) fail(p.string(), ": cannot open (a model directory needs config.json)");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    fail(p.string(), ": not valid JSON: ", e.what());
  }
}

namespace {

std::string rank_file_name(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank_%05d.safetensors", rank);
  return buf;
}

// Whole global tensors out of a tuna checkpoint: from model.safetensors / optimizer.safetensors, or
// assembled from the pieces of every rank file (see checkpoint.h).
class GlobalTensorReader {
 public:
  explicit GlobalTensorReader(const fs::path& dir) : dir_(dir) {
    if (!is_sharded_checkpoint(dir)) return;
    for (int r = 0; fs::exists(dir / rank_file_name(r)); r++) {
      RankFile f{SafetensorsFile(dir / rank_file_name(r)), json()};
      auto it = f.file.metadata().find("pieces");
      if (it == f.file.metadata().end()) fail(f.file.path().string(), ": metadata 'pieces' is missing");
      try {
        f.pieces = json::parse(it->second);
      } catch (const json::parse_error& e) {
        fail(f.file.path().string(), ": metadata 'pieces' is not valid JSON: ", e.what());
      }
      ranks_.push_back(std::move(f));
    }
  }
  bool sharded() const { return !ranks_.empty(); }

  // Global tensor prefix + t.name into out (resized to the global element count).
  void read(const ParamTensor& t, const std::string& prefix, std::vector<float>& out) {
    int64_t numel = 1;
    for (int64_t d : t.global_shape) numel *= d;
    out.resize(numel);
    if (!sharded()) {
      if (prefix.empty()) {
        if (!model_) model_.emplace(dir_);
        model_->read_f32(t.name, t.global_shape, out.data());
      } else {
        optimizer_file().read_f32(prefix + t.name, t.global_shape, out.data());
      }
      return;
    }
    int64_t covered = 0;
    for (const RankFile& f : ranks_) {
      if (!f.pieces.contains(t.name)) continue;
      const json& p = f.pieces[t.name];
      const std::vector<int64_t> global_shape = p.at("global_shape").get<std::vector<int64_t>>();
      if (global_shape != t.global_shape)
        fail(f.file.path().string(), ": tensor '", t.name, "' has global shape ", json(global_shape).dump(),
             ", the model's config.json says ", json(t.global_shape).dump());
      const int split_dim = p.at("split_dim").get<int>();
      const int64_t split_begin = p.at("split_begin").get<int64_t>(), begin = p.at("begin").get<int64_t>();
      const std::vector<int64_t> shape = p.at("shape").get<std::vector<int64_t>>();
      const TensorInfo* info = f.file.find(prefix + t.name);
      if (!info || info->dtype != DType::F32 || info->shape.size() != 1)
        fail(f.file.path().string(), ": piece '", prefix + t.name, "' is missing or not a 1-D float32 tensor");
      const int64_t n = info->shape[0];
      const float* src = reinterpret_cast<const float*>(f.file.data(*info));
      const int64_t cols = shape.size() == 2 ? shape[1] : 1, gcols = global_shape.size() == 2 ? global_shape[1] : 1;
      for (int64_t i = 0; i < n; i++) {
        const int64_t e = begin + i, row = e / cols, col = e % cols;
        const int64_t g = split_dim < 0 ? e : split_dim == 0 ? (split_begin + row) * cols + col : row * gcols + split_begin + col;
        out[g] = src[i];
      }
      covered += n;
    }
    if (covered != numel)
      fail(dir_.string(), ": the rank files hold ", covered, " of the ", numel, " elements of '", prefix + t.name,
           "' (a rank file is missing or from another run)");
  }

  int64_t steps_taken() {
    const SafetensorsFile& f = sharded() ? ranks_[0].file : optimizer_file();
    auto it = f.metadata().find("steps_taken");
    if (it == f.metadata().end()) fail(f.path().string(), ": metadata 'steps_taken' is missing");
    try {
      return std::stoll(it->second);
    } catch (const std::exception&) {
      fail(f.path().string(), ": metadata 'steps_taken': expected an integer, found '", it->second, "'");
    }
  }

 private:
  const SafetensorsFile& optimizer_file() {
    if (!optimizer_) {
      const fs::path p = dir_ / "optimizer.safetensors";
      if (!fs::exists(p)) fail(p.string(), ": missing (a checkpoint to resume from needs the optimizer state)");
      optimizer_.emplace(p);
    }
    return *optimizer_;
  }
  struct RankFile {
    SafetensorsFile file;
    json pieces;
  };
  fs::path dir_;
  std::optional<HfCheckpointDir> model_;
  std::optional<SafetensorsFile> optimizer_;
  std::vector<RankFile> ranks_;
};

}  // namespace

bool is_sharded_checkpoint(const fs::path& dir) { return fs::exists(dir / rank_file_name(0)); }

void load_weights(const fs::path& dir, const ParamLayout& layout, float* params) {
  bool split = false;
  for (const ParamTensor& t : layout.tensors()) split |= t.split_dim >= 0;
  if (!is_sharded_checkpoint(dir) && !split) {  // the common case: straight into place
    HfCheckpointDir ckpt(dir);
    for (const ParamTensor& t : layout.tensors()) ckpt.read_f32(t.name, t.shape, params + t.offset);
    refuse_foreign_tensors(ckpt, layout);
    return;
  }
  if (!is_sharded_checkpoint(dir)) refuse_foreign_tensors(HfCheckpointDir(dir), layout);
  GlobalTensorReader reader(dir);
  std::vector<float> global;
  for (const ParamTensor& t : layout.tensors()) {
    reader.read(t, "", global);
    copy_block(t, global.data(), params + t.offset);
  }
}

void write_checkpoint_shard(const fs::path& tmp_dir, int rank, const ParamLayout& layout, const ShardState& s) {
  SafetensorsWriter w;
  json pieces = json::object();
  int64_t shard_offset = 0;
  for (const Segment& seg : *s.segments) {
    for (const ParamTensor& t : layout.tensors()) {
      if (!s.write_replicated && t.split_dim < 0) continue;
      const int64_t begin = std::max(seg.begin, t.offset), end = std::min(seg.begin + seg.size, t.offset + t.numel);
      if (begin >= end) continue;
      const int64_t at = shard_offset + (begin - seg.begin), n = end - begin;
      pieces[t.name] = {{"global_shape", t.global_shape}, {"split_dim", t.split_dim}, {"split_begin", t.split_begin},
                        {"shape", t.shape}, {"begin", begin - t.offset}};
      w.add(t.name, DType::F32, {n}, s.params + at);
      w.add("exp_avg." + t.name, DType::F32, {n}, s.m + at);
      w.add("exp_avg_sq." + t.name, DType::F32, {n}, s.v + at);
    }
    shard_offset += seg.size;
  }
  w.add_metadata("producer", "tuna");
  w.add_metadata("steps_taken", std::to_string(s.steps_taken));
  w.add_metadata("pieces", pieces.dump());
  w.write(tmp_dir / rank_file_name(rank), s.progress);
}

int64_t load_checkpoint_shard(const fs::path& dir, const ParamLayout& layout, const std::vector<Segment>& segments,
                              std::vector<float>& params, std::vector<float>& m, std::vector<float>& v) {
  int64_t total = 0;
  for (const Segment& seg : segments) total += seg.size;
  params.assign(total, 0.0f), m.assign(total, 0.0f), v.assign(total, 0.0f);
  GlobalTensorReader reader(dir);
  std::vector<float> global, local;
  for (const ParamTensor& t : layout.tensors()) {
    bool needed = false;
    for (const Segment& seg : segments) needed |= std::max(seg.begin, t.offset) < std::min(seg.begin + seg.size, t.offset + t.numel);
    if (!needed) continue;
    for (auto [prefix, out] : {std::pair{"", &params}, {"exp_avg.", &m}, {"exp_avg_sq.", &v}}) {
      reader.read(t, prefix, global);
      local.resize(t.numel);
      copy_block(t, global.data(), local.data());
      int64_t shard_offset = 0;
      for (const Segment& seg : segments) {
        const int64_t begin = std::max(seg.begin, t.offset), end = std::min(seg.begin + seg.size, t.offset + t.numel);
        if (begin < end)
          std::copy(local.begin() + (begin - t.offset), local.begin() + (end - t.offset),
                    out->begin() + shard_offset + (begin - seg.begin));
        shard_offset += seg.size;
      }
    }
  }
  return reader.steps_taken();
}

void refuse_foreign_tensors(const HfCheckpointDir& dir, const ParamLayout& layout) {
  const bool tied = layout.lm_head() == layout.embed_tokens();
  for (const std::string& name : dir.tensor_names()) {
    if (layout.find(name)) continue;
    if (ends_with(name, "rotary_emb.inv_freq")) continue;  // recomputed from config.json
    if (tied && name == "lm_head.weight") continue;       // some exports store the tied copy too
    fail(dir.dir().string(), ": tensor '", name,
         "' is not part of a LlamaForCausalLM with this config.json (another architecture, or a config that "
         "does not match the weights)");
  }
}

fs::path checkpoint_tmp_dir(const fs::path& root, int64_t step) { return root / (".tmp-" + step_dir_name(step)); }

fs::path prepare_sharded_checkpoint(const fs::path& root, int64_t step) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail(root.string(), ": cannot create the checkpoint directory: ", ec.message());
  const fs::path tmp_dir = root / (".tmp-" + step_dir_name(step));
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) fail(tmp_dir.string(), ": cannot create: ", ec.message());
  return tmp_dir;
}

fs::path finish_sharded_checkpoint(const fs::path& root, int64_t step, const CheckpointContents& c, int64_t keep_last) {
  TUNA_CHECK(c.config_json, "checkpoint contents incomplete");
  std::error_code ec;
  const fs::path final_dir = root / step_dir_name(step);
  const fs::path tmp_dir = root / (".tmp-" + step_dir_name(step));
  write_text_file(tmp_dir / "config.json", c.config_json->dump(2) + "\n");
  if (!c.copy_tokenizer_from.empty()) {
    for (const char* const* f = kTokenizerFiles; *f; f++) {
      const fs::path src = c.copy_tokenizer_from / *f;
      if (!fs::exists(src)) continue;
      fs::copy_file(src, tmp_dir / *f, fs::copy_options::overwrite_existing, ec);
      if (ec) fail(src.string(), ": cannot copy into the checkpoint: ", ec.message());
      fsync_path(tmp_dir / *f, false);
    }
  }
  json state = c.state;
  state["step"] = step;
  write_text_file(tmp_dir / "state.json", state.dump(2) + "\n");  // last: its presence marks completeness
  fsync_path(tmp_dir, true);

  if (fs::exists(final_dir)) fs::remove_all(final_dir, ec);  // an older run's step of the same number
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) fail(final_dir.string(), ": cannot rename the finished checkpoint into place: ", ec.message());
  fsync_path(root, true);
  if (keep_last > 0) {
    auto all = list_checkpoints(root);
    for (size_t i = 0; i + keep_last < all.size(); i++) fs::remove_all(all[i].second, ec);
  }
  return final_dir;
}

fs::path save_checkpoint(const fs::path& root, int64_t step, const ParamLayout& layout,
                         const CheckpointContents& c, int64_t keep_last) {
  TUNA_CHECK(c.config_json && c.params, "checkpoint contents incomplete");
  const fs::path tmp_dir = prepare_sharded_checkpoint(root, step);
  {
    SafetensorsWriter w;
    w.add_metadata("format", "pt");  // transformers checks this key when loading
    w.add_metadata("producer", "tuna");
    for (const ParamTensor& t : layout.tensors()) w.add(t.name, DType::F32, t.shape, c.params + t.offset);
    w.write(tmp_dir / "model.safetensors", c.progress);
  }
  if (c.optimizer.m) {
    TUNA_CHECK(c.optimizer.v, "checkpoint moments incomplete");
    SafetensorsWriter w;
    w.add_metadata("producer", "tuna");
    w.add_metadata("steps_taken", std::to_string(c.optimizer.steps_taken));
    for (const ParamTensor& t : layout.tensors()) {
      w.add("exp_avg." + t.name, DType::F32, t.shape, c.optimizer.m + t.offset);
      w.add("exp_avg_sq." + t.name, DType::F32, t.shape, c.optimizer.v + t.offset);
    }
    w.write(tmp_dir / "optimizer.safetensors", c.progress);
  }
  return finish_sharded_checkpoint(root, step, c, keep_last);
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
  auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

json read_state(const fs::path& dir) {
  const fs::path p = dir / "state.json";
  std::ifstream in(p);
  if (!in) fail(p.string(), ": cannot open (not a complete tuna checkpoint)");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    fail(p.string(), ": not valid JSON: ", e.what());
  }
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer())
    fail(p.string(), ": expected an object with an integer 'step'");
  return j;
}

void load_optimizer(const fs::path& dir, const ParamLayout& layout, AdamW& opt) {
  const fs::path p = dir / "optimizer.safetensors";
  if (!fs::exists(p)) fail(p.string(), ": missing (a checkpoint to resume from needs the optimizer state)");
  SafetensorsFile f(p);
  for (const ParamTensor& t : layout.tensors()) {
    f.read_f32("exp_avg." + t.name, t.shape, opt.m.data() + t.offset);
    f.read_f32("exp_avg_sq." + t.name, t.shape, opt.v.data() + t.offset);
  }
  auto it = f.metadata().find("steps_taken");
  if (it == f.metadata().end()) fail(p.string(), ": metadata 'steps_taken' is missing");
  try {
    opt.steps_taken = std::stoll(it->second);
  } catch (const std::exception&) {
    fail(p.string(), ": metadata 'steps_taken': expected an integer, found '", it->second, "'");
  }
}

}  // namespace tuna
