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

// Elements of global tensors out of a model directory: a Hugging Face download or a tuna checkpoint
// (model.safetensors / optimizer.safetensors, or the pieces of every rank file, see checkpoint.h). Only the
// bytes asked for are read from the mapped files.
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
  // The single-file model (opened on first use).
  const HfCheckpointDir& model_dir() {
    if (!model_) model_.emplace(dir_);
    return *model_;
  }

  // Elements [begin, begin + count) of global tensor prefix + t.name (row-major) into out.
  void read_range(const ParamTensor& t, const std::string& prefix, int64_t begin, int64_t count, float* out) {
    if (count == 0) return;
    if (!sharded()) {
      const std::string name = prefix + t.name;
      const SafetensorsFile* file = nullptr;
      const TensorInfo* info = nullptr;
      if (prefix.empty()) {
        const HfCheckpointDir::Entry e = model_dir().find(name);
        if (!e) fail(dir_.string(), " has no tensor '", name, "'");
        file = e.file, info = e.info;
      } else {
        file = &optimizer_file();
        info = file->find(name);
        if (!info) fail(file->path().string(), " has no tensor '", name, "'");
      }
      if (info->shape != t.global_shape)
        fail("tensor '", name, "' in ", file->path().string(), ": expected shape ", format_shape(t.global_shape),
             ", found ", format_shape(info->shape));
      if (!is_floating(info->dtype))
        fail("tensor '", name, "' in ", file->path().string(), ": expected a floating-point dtype, found ",
             dtype_name(info->dtype));
      convert_to_f32(file->data(*info) + begin * static_cast<int64_t>(dtype_size(info->dtype)), info->dtype, out,
                     count);
      return;
    }
    // Sharded: the elements of every rank file's piece that fall in the range.
    const int64_t end = begin + count;
    int64_t covered = 0;
    for (const RankFile& f : ranks_) {
      if (!f.pieces.contains(t.name)) continue;
      const json& p = f.pieces[t.name];
      const std::vector<int64_t> global_shape = p.at("global_shape").get<std::vector<int64_t>>();
      if (global_shape != t.global_shape)
        fail(f.file.path().string(), ": tensor '", t.name, "' has global shape ", json(global_shape).dump(),
             ", the model's config.json says ", json(t.global_shape).dump());
      const int split_dim = p.at("split_dim").get<int>();
      const int64_t split_begin = p.at("split_begin").get<int64_t>(), piece_begin = p.at("begin").get<int64_t>();
      const std::vector<int64_t> shape = p.at("shape").get<std::vector<int64_t>>();
      const TensorInfo* info = f.file.find(prefix + t.name);
      if (!info || info->dtype != DType::F32 || info->shape.size() != 1)
        fail(f.file.path().string(), ": piece '", prefix + t.name, "' is missing or not a 1-D float32 tensor");
      const int64_t n = info->shape[0];
      const float* src = reinterpret_cast<const float*>(f.file.data(*info));
      const int64_t cols = shape.size() == 2 ? shape[1] : 1, gcols = global_shape.size() == 2 ? global_shape[1] : 1;
      const auto global = [&](int64_t i) {
        const int64_t e = piece_begin + i, row = e / cols, col = e % cols;
        return split_dim < 0 ? e : split_dim == 0 ? (split_begin + row) * cols + col : row * gcols + split_begin + col;
      };
      if (n == 0 || global(n - 1) < begin || global(0) >= end) continue;  // global() grows with i
      for (int64_t i = 0; i < n; i++) {
        const int64_t g = global(i);
        if (g >= begin && g < end) out[g - begin] = src[i], covered++;
      }
    }
    if (covered != count)
      fail(dir_.string(), ": the rank files hold ", covered, " of the ", count, " elements of '", prefix + t.name,
           "' asked for (a rank file is missing or from another run)");
  }

  // Elements [local_begin, local_end) of tensor t's tensor-parallel block (row-major in the block) into out:
  // one contiguous global range per block row for a column split, one range otherwise.
  void read_block_range(const ParamTensor& t, const std::string& prefix, int64_t local_begin, int64_t local_end,
                        float* out) {
    if (t.split_dim < 0) return read_range(t, prefix, local_begin, local_end - local_begin, out);
    const int64_t cols = t.numel / t.shape[0];
    if (t.split_dim == 0)
      return read_range(t, prefix, t.split_begin * cols + local_begin, local_end - local_begin, out);
    const int64_t gcols = t.global_shape[1];
    for (int64_t e = local_begin; e < local_end;) {
      const int64_t row = e / cols, col = e % cols, n = std::min(local_end - e, cols - col);
      read_range(t, prefix, row * gcols + t.split_begin + col, n, out + (e - local_begin));
      e += n;
    }
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

// Calls f(tensor, local_begin, local_end, out_offset) for every intersection of `piece` (a run of the flat layout)
// with a tensor of `layout`: the tensor's block elements [local_begin, local_end) go to out + out_offset.
template <typename F>
void for_each_tensor_of(const ParamLayout& layout, const Segment& piece, F&& f) {
  for (const ParamTensor& t : layout.tensors()) {
    const int64_t begin = std::max(piece.begin, t.offset), end = std::min(piece.begin + piece.size, t.offset + t.numel);
    if (begin < end) f(t, begin - t.offset, end - t.offset, begin - piece.begin);
  }
}

// A sink that checks an export hands its pieces in segment order (the files' bytes follow that order) and gives
// f each piece with its segment.
template <typename F>
StateSink in_segment_order(const std::vector<Segment>& segments, F&& f) {
  return [&segments, f, next = size_t(0)](size_t i, const float* p, const float* m, const float* v) mutable {
    TUNA_CHECK(i == next && i < segments.size(), "checkpoint export handed piece ", i, ", expected piece ", next, " of ",
               segments.size());
    next++;
    f(segments[i], p, m, v);
  };
}

// Runs `export_state` into `append` and checks that it handed out every one of `segments`.
void export_all(const StateExport& export_state, const std::vector<Segment>& segments,
                const std::function<void(const Segment&, const float*, const float*, const float*)>& f) {
  size_t handed = 0;
  export_state(in_segment_order(segments, [&](const Segment& seg, const float* p, const float* m, const float* v) {
    f(seg, p, m, v);
    handed++;
  }));
  TUNA_CHECK(handed == segments.size(), "checkpoint export handed ", handed, " of ", segments.size(), " pieces");
}

}  // namespace

struct WeightReader::Reader {
  explicit Reader(const fs::path& dir) : tensors(dir) {}
  GlobalTensorReader tensors;
};

WeightReader::WeightReader(const fs::path& dir, const ParamLayout& layout)
    : reader_(std::make_unique<Reader>(dir)), layout_(layout) {
  if (!reader_->tensors.sharded()) refuse_foreign_tensors(reader_->tensors.model_dir(), layout);
}

WeightReader::~WeightReader() = default;

void WeightReader::read(const Segment& piece, float* out) {
  TUNA_CHECK(piece.begin >= 0 && piece.size >= 0 && piece.begin + piece.size <= layout_.total(), "piece [",
             piece.begin, ", +", piece.size, ") of a layout of ", layout_.total());
  for_each_tensor_of(layout_, piece, [&](const ParamTensor& t, int64_t lb, int64_t le, int64_t at) {
    reader_->tensors.read_block_range(t, "", lb, le, out + at);
  });
}

bool is_sharded_checkpoint(const fs::path& dir) { return fs::exists(dir / rank_file_name(0)); }

void load_weights(const fs::path& dir, const ParamLayout& layout, float* params) {
  WeightReader(dir, layout).read(Segment{0, layout.total()}, params);
}

void write_checkpoint_shard(const fs::path& tmp_dir, int rank, const ParamLayout& layout, const ShardState& s) {
  TUNA_CHECK(s.segments && s.export_state, "checkpoint shard incomplete");
  SafetensorsWriter w;
  json pieces = json::object();
  const auto tensors_written = [&](const Segment& seg, auto&& f) {
    for_each_tensor_of(layout, seg, [&](const ParamTensor& t, int64_t lb, int64_t le, int64_t at) {
      if (s.write_replicated || t.split_dim >= 0) f(t, lb, le, at);
    });
  };
  for (const Segment& seg : *s.segments)
    tensors_written(seg, [&](const ParamTensor& t, int64_t lb, int64_t le, int64_t) {
      pieces[t.name] = {{"global_shape", t.global_shape}, {"split_dim", t.split_dim}, {"split_begin", t.split_begin},
                        {"shape", t.shape}, {"begin", lb}};
      const int64_t n = le - lb;
      w.add_streamed(t.name, DType::F32, {&n, 1});
      w.add_streamed("exp_avg." + t.name, DType::F32, {&n, 1});
      w.add_streamed("exp_avg_sq." + t.name, DType::F32, {&n, 1});
    });
  w.add_metadata("producer", "tuna");
  w.add_metadata("steps_taken", std::to_string(s.steps_taken));
  w.add_metadata("pieces", pieces.dump());
  w.write_streamed(
      tmp_dir / rank_file_name(rank),
      [&](const SafetensorsWriter::Append& append) {
        export_all(s.export_state, *s.segments, [&](const Segment& seg, const float* p, const float* m, const float* v) {
          tensors_written(seg, [&](const ParamTensor&, int64_t lb, int64_t le, int64_t at) {
            const uint64_t bytes = uint64_t(le - lb) * sizeof(float);
            append(p + at, bytes), append(m + at, bytes), append(v + at, bytes);
          });
        });
      },
      s.progress);
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
  params.assign(total, 0.0f), m.assign(total, 0.0f), v.assign(total, 0.0f);
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
  TUNA_CHECK(c.config_json && (c.params || (c.export_state && c.segments)), "checkpoint contents incomplete");
  // The state a piece at a time: the caller's export, or one piece that is the whole layout.
  const std::vector<Segment> whole{Segment{0, layout.total()}};
  const std::vector<Segment>& segments = c.export_state ? *c.segments : whole;
  const StateExport export_state =
      c.export_state ? c.export_state : [&](const StateSink& sink) { sink(0, c.params, c.optimizer.m, c.optimizer.v); };
  const bool with_optimizer = c.export_state || c.optimizer.m;
  TUNA_CHECK(c.export_state || !c.optimizer.m || c.optimizer.v, "checkpoint moments incomplete");
  // The files hold whole tensors in layout order: the pieces must come in that order, and (for the optimizer's
  // interleaved moments) each tensor within one piece.
  int64_t next = 0;
  const auto tensors_of = [&](const Segment& seg, bool whole_tensors, auto&& f) {
    for_each_tensor_of(layout, seg, [&](const ParamTensor& t, int64_t lb, int64_t le, int64_t at) {
      TUNA_CHECK(t.offset + lb == next, "single-file checkpoint: piece at ", seg.begin, " is out of layout order");
      TUNA_CHECK(!whole_tensors || (lb == 0 && le == t.numel), "single-file checkpoint: tensor '", t.name,
                 "' is split between pieces");
      next = t.offset + le;
      f(at, uint64_t(le - lb) * sizeof(float));
    });
  };
  const fs::path tmp_dir = prepare_sharded_checkpoint(root, step);
  {
    SafetensorsWriter w;
    w.add_metadata("format", "pt");  // transformers checks this key when loading
    w.add_metadata("producer", "tuna");
    for (const ParamTensor& t : layout.tensors()) w.add_streamed(t.name, DType::F32, t.shape);
    next = 0;
    w.write_streamed(
        tmp_dir / "model.safetensors",
        [&](const SafetensorsWriter::Append& append) {
          export_all(export_state, segments, [&](const Segment& seg, const float* p, const float*, const float*) {
            tensors_of(seg, false, [&](int64_t at, uint64_t bytes) { append(p + at, bytes); });
          });
        },
        c.progress);
  }
  if (with_optimizer) {
    SafetensorsWriter w;
    w.add_metadata("producer", "tuna");
    w.add_metadata("steps_taken", std::to_string(c.optimizer.steps_taken));
    for (const ParamTensor& t : layout.tensors()) {
      w.add_streamed("exp_avg." + t.name, DType::F32, t.shape);
      w.add_streamed("exp_avg_sq." + t.name, DType::F32, t.shape);
    }
    next = 0;
    w.write_streamed(
        tmp_dir / "optimizer.safetensors",
        [&](const SafetensorsWriter::Append& append) {
          export_all(export_state, segments, [&](const Segment& seg, const float*, const float* m, const float* v) {
            tensors_of(seg, true, [&](int64_t at, uint64_t bytes) { append(m + at, bytes), append(v + at, bytes); });
          });
        },
        c.progress);
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
