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

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;


namespace {

// Steps and update counts are bounded far beyond any run, so that sums and products of them never overflow.
constexpr int64_t kMaxStep = int64_t{1} << 62;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// ckpt/latest: a relative symlink to the newest step directory, replaced by rename so that a reader always
// finds an old or a new link, never none. A filesystem without symlinks leaves no link; resolve_checkpoint
// stands in for it.
constexpr const char* kLatestLink = "latest";
void update_latest_link(const fs::path& root, const fs::path& step_dir) {
  std::error_code ec;
  const fs::path tmp = root / ".latest.tmp";
  fs::remove(tmp, ec);
  fs::create_directory_symlink(step_dir.filename(), tmp, ec);
  if (!ec) fs::rename(tmp, root / kLatestLink, ec);
  if (ec) fs::remove(tmp, ec);
}

}  // namespace

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

void fsync_path(const fs::path& p, bool directory) {
  int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) fail(p.string(), ": cannot open to fsync");
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail(p.string(), ": fsync failed");
}

FileDigest write_text_file(const fs::path& p, const std::string& text) {
  {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    if (!out) fail(p.string(), ": cannot create file");
    out << text;
    out.flush();
    if (!out) fail(p.string(), ": write failed (disk full?)");
  }
  fsync_path(p, /*directory=*/false);
  Checksum sum;
  sum.update(text.data(), text.size());
  return sum.digest();
}

namespace {

std::string rank_file_name(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank_%05d.safetensors", rank);
  return buf;
}

// Each rank's file digest travels to rank 0 (which writes the manifest) in a small file beside it.
std::string digest_note_name(int rank) { return "." + rank_file_name(rank) + ".digest"; }

// An integer metadata value of a safetensors file (all digits, in [0, kMaxStep]).
int64_t metadata_int(const SafetensorsFile& f, const char* key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end()) fail(f.path().string(), ": metadata '", key, "' is missing");
  const std::string& text = it->second;
  int64_t value = -1;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0 || value > kMaxStep)
    fail(f.path().string(), ": metadata '", key, "': expected an integer in [0, 2^62], found '", text, "'");
  return value;
}

// A JSON array of dimensions, each an integer in [1, 2^48] (a 0 would divide by zero in the placement below).
std::vector<int64_t> json_dims(const json& piece, const char* key, const std::string& where) {
  auto it = piece.find(key);
  if (it == piece.end() || !it->is_array() || it->empty() || it->size() > 2)
    fail(where, ": field '", key, "': expected an array of 1 or 2 dimensions, found ",
         it == piece.end() ? std::string("nothing") : it->dump());
  std::vector<int64_t> dims;
  for (size_t d = 0; d < it->size(); d++) {
    json holder = {{"dim", (*it)[d]}};
    dims.push_back(json_int(holder, "dim", str(where, ": field '", key, "' element ", d), 1, int64_t{1} << 48));
  }
  return dims;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded by the config's limits (model/config.cpp)
  return n;
}

// The name of the tensor that holds element i of the shard order of `segments` (for error messages).
std::string tensor_at(const ParamLayout& layout, const std::vector<Segment>& segments, int64_t i) {
  for (const Segment& seg : segments) {
    if (i < seg.size) {
      const int64_t flat = seg.begin + i;
      for (const ParamTensor& t : layout.tensors())
        if (flat >= t.offset && flat < t.offset + t.numel) return str("'", t.name, "' element ", flat - t.offset);
      return str("flat element ", flat);
    }
    i -= seg.size;
  }
  return "?";
}

// A checkpoint written from NaN or inf would be the only one the rotation keeps: refuse to write it.
void require_finite_state(const std::string& checkpoint, const char* what, const float* data, int64_t n,
                          const ParamLayout& layout, const std::vector<Segment>& segments) {
  if (!data) return;
  const int64_t bad = first_non_finite(data, DType::F32, n);
  if (bad >= 0)
    fail("refusing to write ", checkpoint, ": ", what, " ", tensor_at(layout, segments, bad), " is ", data[bad],
         " (the run diverged; the checkpoints already written are kept)");
}

}  // namespace

int64_t checkpoint_step(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (name.size() < 6 || name.rfind("step_", 0) != 0) return -1;
  int64_t step = -1;
  auto [end, ec] = std::from_chars(name.data() + 5, name.data() + name.size(), step);
  if (ec != std::errc() || end != name.data() + name.size() || step < 0 || step > kMaxStep) return -1;
  return name == step_dir_name(step) ? step : -1;
}

std::vector<fs::path> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    const int64_t step = checkpoint_step(p);
    std::error_code kind;
    if (step < 0 || !it->is_directory(kind) || !fs::is_regular_file(p / "state.json", kind)) continue;
    found.emplace_back(step, p);
  }
  if (ec) fail(root.string(), ": cannot list the checkpoints: ", ec.message());
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& [step, p] : found) out.push_back(p);
  return out;
}

json read_config_json(const fs::path& dir) {
  return read_json_file(dir / "config.json", "model config (a model directory needs config.json)");
}

namespace {

// Elements of global tensors out of a model directory: a Hugging Face download or a tuna checkpoint
// (model.safetensors / optimizer.safetensors, or the pieces of every rank file, see checkpoint.h). Only the
// bytes asked for are read from the mapped files, and only they are checked to be finite. Each piece's
// metadata is checked against the model before any of its elements is placed (a piece that would land outside
// its tensor is an error naming the rank file), and the range read must be covered exactly once: an overlap or
// a hole inside it is an error too.
class GlobalTensorReader {
 public:
  explicit GlobalTensorReader(const fs::path& dir) : dir_(dir) {
    if (!is_sharded_checkpoint(dir)) {
      // A LoRA checkpoint or a PEFT adapter directory: the adapters' weights in one file, and no config.json.
      std::error_code ec;
      if (!fs::exists(dir / "model.safetensors", ec) && fs::exists(dir / kAdapterWeightsFile, ec))
        adapter_.emplace(dir / kAdapterWeightsFile);
      return;
    }
    for (int r = 0; fs::exists(dir / rank_file_name(r)); r++) {
      RankFile f{SafetensorsFile(dir / rank_file_name(r)), json()};
      auto it = f.file.metadata().find("pieces");
      if (it == f.file.metadata().end()) fail(f.file.path().string(), ": metadata 'pieces' is missing");
      f.pieces = parse_json(it->second, f.file.path().string() + ": metadata 'pieces'");
      if (!f.pieces.is_object())
        fail(f.file.path().string(), ": metadata 'pieces': expected an object (tensor name -> piece), found ",
             f.pieces.type_name());
      ranks_.push_back(std::move(f));
    }
  }
  bool sharded() const { return !ranks_.empty(); }
  // The single-file adapter weights (adapter_model.safetensors), or null for a model directory.
  const SafetensorsFile* adapter() const { return adapter_ ? &*adapter_ : nullptr; }
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
      if (prefix.empty() && adapter_) {
        file = &*adapter_;
        info = file->find(name);
        if (!info) fail(file->path().string(), " has no tensor '", name, "' (an adapter without this projection)");
      } else if (prefix.empty()) {
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
      const std::byte* src = file->data(*info) + begin * static_cast<int64_t>(dtype_size(info->dtype));
      convert_to_f32(src, info->dtype, out, count);
      file->release(src, uint64_t(count) * dtype_size(info->dtype));  // copied out: not this rank's memory any more
      const int64_t bad = first_non_finite(out, DType::F32, count);
      if (bad >= 0)
        fail("tensor '", name, "' in ", file->path().string(), ": element ", begin + bad, " is ", out[bad],
             " (weights and optimizer state must be finite; the checkpoint is damaged or was saved from a diverged "
             "run)");
      return;
    }
    // Sharded: the elements of every rank file's piece that fall in the range, each placed once.
    const int64_t end = begin + count;
    std::vector<bool> placed(count, false);
    int64_t covered = 0;
    for (const RankFile& f : ranks_) {
      auto entry = f.pieces.find(t.name);
      if (entry == f.pieces.end()) continue;
      const std::string where = str(f.file.path().string(), ": metadata 'pieces' of '", t.name, "'");
      const TensorInfo* info = f.file.find(prefix + t.name);
      if (!info || info->dtype != DType::F32 || info->shape.size() != 1)
        fail(f.file.path().string(), ": piece '", prefix + t.name, "' is missing or not a 1-D float32 tensor");
      const Piece p = parse_piece(*entry, t, where, info->shape[0]);
      const float* src = reinterpret_cast<const float*>(f.file.data(*info));
      const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
      const int64_t gcols = t.global_shape.size() == 2 ? t.global_shape[1] : 1;
      const auto global = [&](int64_t i) {
        const int64_t e = p.begin + i, row = e / cols, col = e % cols;
        return p.split_dim < 0    ? e
               : p.split_dim == 0 ? (p.split_begin + row) * cols + col
                                  : row * gcols + p.split_begin + col;
      };
      if (p.n == 0 || global(p.n - 1) < begin || global(0) >= end) continue;  // global() grows with i
      // So the piece's elements in the range are one run: found by bisection, not by a scan of the piece (a column
      // block is read a row at a time, and a scan per row would be rows x piece at 70B).
      int64_t first = 0;
      for (int64_t hi = p.n; first < hi;) {
        const int64_t mid = first + (hi - first) / 2;
        if (global(mid) < begin) first = mid + 1;
        else hi = mid;
      }
      int64_t i = first;
      for (; i < p.n; i++) {
        const int64_t g = global(i);
        if (g >= end) break;
        if (placed[g - begin])
          fail(where, ": global element ", g, " is also in another piece (the rank files overlap: from different runs?)");
        placed[g - begin] = true;
        float value;
        std::memcpy(&value, src + i, sizeof(float));  // the mapping is only as aligned as its writer made it
        if (!std::isfinite(value))
          fail("tensor '", prefix + t.name, "' in ", f.file.path().string(), ": element ", i, " is ", value,
               " (weights and optimizer state must be finite; the checkpoint is damaged or was saved from a diverged "
               "run)");
        out[g - begin] = value;
        covered++;
      }
      f.file.release(reinterpret_cast<const std::byte*>(src + first), uint64_t(i - first) * sizeof(float));
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

  // AdamW's update count: every rank file must say the same.
  int64_t steps_taken() {
    if (!sharded()) return metadata_int(optimizer_file(), "steps_taken");
    const int64_t steps = metadata_int(ranks_[0].file, "steps_taken");
    for (const RankFile& f : ranks_)
      if (metadata_int(f.file, "steps_taken") != steps)
        fail(f.file.path().string(), ": metadata 'steps_taken' is ", metadata_int(f.file, "steps_taken"), ", ",
             ranks_[0].file.path().string(), " says ", steps, " (rank files of different steps)");
    return steps;
  }

 private:
  // Where a piece of n elements sits: elements [begin, begin + n) of the block `shape` of the global tensor,
  // the block starting at split_begin along split_dim (-1: the block is the whole tensor).
  struct Piece {
    int split_dim;
    int64_t split_begin, begin, n;
    std::vector<int64_t> shape;
  };
  static Piece parse_piece(const json& j, const ParamTensor& t, const std::string& where, int64_t n) {
    if (!j.is_object()) fail(where, ": expected an object, found ", j.type_name());
    const std::vector<int64_t> global_shape = json_dims(j, "global_shape", where);
    if (global_shape != t.global_shape)
      fail(where, ": global shape ", json(global_shape).dump(), ", the model's config.json says ",
           json(t.global_shape).dump());
    const int rank = static_cast<int>(global_shape.size());
    Piece p;
    p.split_dim = static_cast<int>(json_int(j, "split_dim", where, -1, rank - 1));
    p.shape = json_dims(j, "shape", where);
    if (static_cast<int>(p.shape.size()) != rank)
      fail(where, ": shape ", json(p.shape).dump(), " has another rank than the global shape ", json(global_shape).dump());
    for (int d = 0; d < rank; d++)
      if (d == p.split_dim ? p.shape[d] > global_shape[d] : p.shape[d] != global_shape[d])
        fail(where, ": shape ", json(p.shape).dump(), " is not a block of the global shape ", json(global_shape).dump(),
             " split along dimension ", p.split_dim);
    const int64_t room = p.split_dim < 0 ? 0 : global_shape[p.split_dim] - p.shape[p.split_dim];
    p.split_begin = json_int(j, "split_begin", where, 0, room);
    const int64_t block = numel_of(p.shape);
    p.begin = json_int(j, "begin", where, 0, block);
    p.n = n;
    if (n > block - p.begin)
      fail(where, ": ", n, " elements from element ", p.begin, " run past the ", block, "-element block");
    return p;
  }

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
  std::optional<SafetensorsFile> adapter_;
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
    TUNA_CHECK(i == next && i < segments.size(), "checkpoint export handed piece ", i, ", expected piece ", next,
               " of ", segments.size());
    next++;
    f(segments[i], p, m, v);
  };
}

// Runs `export_state` into f and checks that it handed out every one of `segments`, each piece finite (a checkpoint
// written from NaN or inf would be the only one the rotation keeps: `checkpoint` is refused, before its files are
// complete, naming the element).
void export_all(const std::string& checkpoint, const ParamLayout& layout, const StateExport& export_state,
                const std::vector<Segment>& segments,
                const std::function<void(const Segment&, const float*, const float*, const float*)>& f) {
  size_t handed = 0;
  export_state(in_segment_order(segments, [&](const Segment& seg, const float* p, const float* m, const float* v) {
    const std::vector<Segment> piece{seg};
    require_finite_state(checkpoint, "weight", p, seg.size, layout, piece);
    require_finite_state(checkpoint, "AdamW first moment", m, seg.size, layout, piece);
    require_finite_state(checkpoint, "AdamW second moment", v, seg.size, layout, piece);
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

void write_checkpoint_shard(const fs::path& tmp_dir, int rank, const ParamLayout& layout, const ShardState& s) {
  TUNA_CHECK(s.segments && s.export_state, "checkpoint shard incomplete");
  const std::string file = (tmp_dir / rank_file_name(rank)).string();
  SafetensorsWriter w;
  json pieces = json::object();
  const auto tensors_written = [&](const Segment& seg, auto&& f) {
    for_each_tensor_of(layout, seg, [&](const ParamTensor& t, int64_t lb, int64_t le, int64_t at) {
      // A tied lm_head's copy on the last pipeline stage: the first stage writes the table.
      if ((s.write_replicated || t.split_dim >= 0) && !t.copy) f(t, lb, le, at);
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
  const FileDigest d = w.write_streamed(
      tmp_dir / rank_file_name(rank),
      [&](const SafetensorsWriter::Append& append) {
        export_all(file, layout, s.export_state, *s.segments,
                   [&](const Segment& seg, const float* p, const float* m, const float* v) {
                     tensors_written(seg, [&](const ParamTensor&, int64_t lb, int64_t le, int64_t at) {
                       const uint64_t bytes = uint64_t(le - lb) * sizeof(float);
                       append(p + at, bytes), append(m + at, bytes), append(v + at, bytes);
                     });
                   });
      },
      s.progress);
  write_text_file(tmp_dir / digest_note_name(rank), json{{"bytes", d.bytes}, {"xxh3_64", hex64(d.xxh3)}}.dump());
}

StateExport shard_buffers_export(const std::vector<Segment>& segments, const float* params, const float* m,
                                 const float* v) {
  return [&segments, params, m, v](const StateSink& sink) {
    int64_t at = 0;
    for (size_t i = 0; i < segments.size(); i++) {
      sink(i, params + at, m ? m + at : nullptr, v ? v + at : nullptr);
      at += segments[i].size;
    }
  };
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

namespace {

// Adds the rank files' digests (left beside them by write_checkpoint_shard) to the manifest, removing the notes.
void collect_rank_digests(const fs::path& tmp_dir, json& files) {
  for (int r = 0;; r++) {
    const fs::path note = tmp_dir / digest_note_name(r);
    std::error_code ec;
    if (!fs::exists(tmp_dir / rank_file_name(r), ec)) break;
    const json d = read_json_file(note, "digest of a rank file");
    const std::string hash = d.contains("xxh3_64") && d["xxh3_64"].is_string() ? d["xxh3_64"].get<std::string>() : "";
    files[rank_file_name(r)] = {{"bytes", json_int(d, "bytes", note.string(), 0, INT64_MAX)},
                                {"xxh3_64", hex64(parse_hex64(hash, note.string()))}};
    fs::remove(note, ec);
  }
}

// adapter_model.safetensors of a LoRA checkpoint written by several ranks: each adapter tensor whole (global
// shape), read from the pieces of the rank files a tensor at a time (adapters are small, but a rank-0 copy of all
// of them is not needed either). Runs after every rank's file is complete (the caller's barrier).
FileDigest assemble_adapter_file(const fs::path& tmp_dir, const CheckpointContents& c) {
  const LlamaConfig config = LlamaConfig::from_json(*c.config_json, "the base's config.json");
  const LoraLayout global = lora_layout(config, c.lora->lora);  // one tp rank: global shapes
  GlobalTensorReader pieces(tmp_dir);
  SafetensorsWriter w;
  w.add_metadata("format", "pt");
  w.add_metadata("producer", "tuna");
  int64_t largest = 0;
  for (const ParamTensor& t : global.params.tensors()) {
    w.add_streamed(t.name, DType::F32, t.global_shape);
    largest = std::max(largest, t.numel);
  }
  std::vector<float> buf(largest);
  return w.write_streamed(tmp_dir / kAdapterWeightsFile, [&](const SafetensorsWriter::Append& append) {
    for (const ParamTensor& t : global.params.tensors()) {
      pieces.read_range(t, "", 0, t.numel, buf.data());
      append(buf.data(), uint64_t(t.numel) * sizeof(float));
    }
  });
}

FileDigest copy_file_digest(const fs::path& src, const fs::path& dst) {
  std::error_code ec;
  fs::copy_file(src, dst, fs::copy_options::overwrite_existing, ec);
  if (ec) fail(src.string(), ": cannot copy into the checkpoint: ", ec.message());
  fsync_path(dst, /*directory=*/false);
  return digest_file(dst);
}

fs::path finish_checkpoint(const fs::path& root, int64_t step, const CheckpointContents& c, int64_t keep_last,
                           json files) {
  TUNA_CHECK(c.config_json, "checkpoint contents incomplete");
  std::error_code ec;
  const fs::path final_dir = root / step_dir_name(step);
  const fs::path tmp_dir = root / (".tmp-" + step_dir_name(step));
  collect_rank_digests(tmp_dir, files);
  auto entry = [](const FileDigest& d) { return json{{"bytes", d.bytes}, {"xxh3_64", hex64(d.xxh3)}}; };
  if (c.lora) {
    // PEFT's files, and the base's config.json under a name transformers does not take for a model's.
    if (is_sharded_checkpoint(tmp_dir)) files[kAdapterWeightsFile] = entry(assemble_adapter_file(tmp_dir, c));
    const std::string base_path = c.lora->base.value("path", std::string());
    files[kAdapterConfigFile] =
        entry(write_text_file(tmp_dir / kAdapterConfigFile, peft_adapter_config(c.lora->lora, base_path).dump(2) + "\n"));
    files[kBaseModelFile] = entry(write_text_file(tmp_dir / kBaseModelFile, c.lora->base.dump(2) + "\n"));
    files[kBaseConfigFile] = entry(write_text_file(tmp_dir / kBaseConfigFile, c.config_json->dump(2) + "\n"));
  } else {
    files["config.json"] = entry(write_text_file(tmp_dir / "config.json", c.config_json->dump(2) + "\n"));
  }
  for (const TokenizerFile& f : c.tokenizer_files) files[f.name] = entry(copy_file_digest(f.source, tmp_dir / f.name));
  json state = c.state;
  state["step"] = step;
  files["state.json"] = entry(write_text_file(tmp_dir / "state.json", state.dump(2) + "\n"));
  write_text_file(tmp_dir / kManifestFile,
                  json{{"format", "tuna checkpoint manifest"}, {"version", 1}, {"files", files}}.dump(2) + "\n");
  fsync_path(tmp_dir, /*directory=*/true);

  if (fs::exists(final_dir)) remove_checkpoint(final_dir);  // an older run's step of the same number
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) fail(final_dir.string(), ": cannot rename the finished checkpoint into place: ", ec.message());
  update_latest_link(root, final_dir);
  fsync_path(root, /*directory=*/true);
  // Only after the new checkpoint is in place, and never the newest keep_last: the one just written is the
  // newest (resume_checkpoint moved any newer, rejected one aside).
  prune_checkpoints(root, keep_last);
  return final_dir;
}

}  // namespace

void remove_checkpoint(const fs::path& dir) {
  // Renamed first (atomic), deleted after: a kill in between leaves a .deleting-* name that the next start
  // removes, never a step_* directory with half its files gone (which no reader lists, so none would delete).
  const fs::path doomed = dir.parent_path() / (kDeletingPrefix + dir.filename().string());
  std::error_code ec;
  fs::remove_all(doomed, ec);
  fs::rename(dir, doomed, ec);
  if (ec) fail(dir.string(), ": cannot rename for deletion: ", ec.message());
  fsync_path(dir.parent_path(), true);
  fs::remove_all(doomed, ec);
  if (ec) fail(doomed.string(), ": cannot delete (an old checkpoint of the rotation): ", ec.message());
}

void prune_checkpoints(const fs::path& root, int64_t keep_last) {
  if (keep_last <= 0) return;
  const std::vector<fs::path> all = list_checkpoints(root);
  for (size_t i = 0; i + keep_last < all.size(); i++) remove_checkpoint(all[i]);
}

std::vector<std::string> clean_checkpoint_leftovers(const fs::path& root) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return removed;
  std::vector<fs::path> doomed;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kDeletingPrefix, 0) == 0 || name.rfind(".tmp-step_", 0) == 0) doomed.push_back(it->path());
  }
  if (ec) fail(root.string(), ": cannot list: ", ec.message());
  std::sort(doomed.begin(), doomed.end());
  for (const fs::path& p : doomed) {
    fs::remove_all(p, ec);
    if (ec) fail(p.string(), ": cannot delete the leftover of an interrupted checkpoint write or rotation: ", ec.message());
    removed.push_back(p.filename().string());
  }
  return removed;
}

fs::path finish_sharded_checkpoint(const fs::path& root, int64_t step, const CheckpointContents& c, int64_t keep_last) {
  return finish_checkpoint(root, step, c, keep_last, json::object());
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
  const std::string checkpoint = str("the checkpoint of step ", step);
  const fs::path tmp_dir = prepare_sharded_checkpoint(root, step);
  json files = json::object();
  auto entry = [](const FileDigest& d) { return json{{"bytes", d.bytes}, {"xxh3_64", hex64(d.xxh3)}}; };
  // The weights' file (p of each piece) or the moments' (m then v of each whole tensor).
  const auto write_file = [&](const std::string& name, const SafetensorsWriter& w) {
    next = 0;
    files[name] = entry(w.write_streamed(
        tmp_dir / name,
        [&](const SafetensorsWriter::Append& append) {
          export_all(checkpoint, layout, export_state, segments,
                     [&](const Segment& seg, const float* p, const float* m, const float* v) {
                       tensors_of(seg, name == "optimizer.safetensors", [&](int64_t at, uint64_t bytes) {
                         if (name != "optimizer.safetensors") return append(p + at, bytes);
                         append(m + at, bytes), append(v + at, bytes);
                       });
                     });
        },
        c.progress));
  };
  try {
    SafetensorsWriter weights;
    weights.add_metadata("format", "pt");  // transformers checks this key when loading
    weights.add_metadata("producer", "tuna");
    for (const ParamTensor& t : layout.tensors()) weights.add_streamed(t.name, DType::F32, t.shape);
    write_file(c.lora ? kAdapterWeightsFile : "model.safetensors", weights);
    if (with_optimizer) {
      SafetensorsWriter moments;
      moments.add_metadata("producer", "tuna");
      moments.add_metadata("steps_taken", std::to_string(c.optimizer.steps_taken));
      for (const ParamTensor& t : layout.tensors()) {
        moments.add_streamed("exp_avg." + t.name, DType::F32, t.shape);
        moments.add_streamed("exp_avg_sq." + t.name, DType::F32, t.shape);
      }
      write_file("optimizer.safetensors", moments);
    }
  } catch (...) {  // a refused (non-finite) or failed write leaves no temporary directory behind
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
    throw;
  }
  return finish_checkpoint(root, step, c, keep_last, files);
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
  auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

fs::path resolve_checkpoint(const std::string& path) {
  const fs::path p(path);
  if (p.filename() != kLatestLink) return p;
  std::error_code ec;
  if (fs::is_symlink(p, ec)) {
    const fs::path target = fs::read_symlink(p, ec);
    if (!ec && fs::is_directory(p)) return target.is_absolute() ? target : p.parent_path() / target;
  }
  if (fs::is_directory(p) && !fs::is_symlink(p)) return p;  // a directory a user named "latest" themselves
  std::optional<fs::path> newest = latest_checkpoint(p.parent_path());
  if (!newest) fail(path, ": no complete checkpoint (step_* with state.json) in ", p.parent_path().string(), " for 'latest' to name");
  return *newest;
}

int64_t checkpoint_bytes(int64_t n_params, const std::vector<TokenizerFile>& tokenizer_files) {
  int64_t bytes = 12 * n_params + (int64_t(1) << 20);  // + headers, config.json, state.json, manifest.json
  for (const TokenizerFile& f : tokenizer_files) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(f.source, ec);
    if (!ec) bytes += static_cast<int64_t>(size);
  }
  return bytes;
}

json read_state(const fs::path& dir) {
  const fs::path p = dir / "state.json";
  json j = read_json_file(p, "checkpoint state (not a complete tuna checkpoint?)");
  if (!j.is_object()) fail(p.string(), ": expected an object, found ", j.type_name());
  json_int(j, "step", p.string(), 0, kMaxStep);
  return j;
}

TrainingState read_training_state(const fs::path& dir) {
  const fs::path p = dir / "state.json";
  TrainingState s;
  s.state = read_state(dir);
  s.step = s.state["step"].get<int64_t>();
  const int64_t named = checkpoint_step(dir);
  if (named != s.step)
    fail(p.string(), ": step ", s.step, " disagrees with the directory's name ", dir.filename().string(),
         " (a damaged or hand-edited checkpoint)");
  if (s.state.contains("skipped_steps")) s.skipped_steps = json_int(s.state, "skipped_steps", p.string(), 0, s.step);
  auto cursor = s.state.find("data_cursor");
  if (cursor == s.state.end() || !cursor->is_object())
    fail(p.string(), ": field 'data_cursor' is ", cursor == s.state.end() ? "missing" : cursor->dump(),
         ": without it the run would start the data order again instead of continuing it");
  s.data_cursor = *cursor;
  return s;
}

LoaderCursor resume_data_cursor(const TrainingState& s, int64_t dp_size, const fs::path& dir) {
  const std::string where = (dir / "state.json").string();
  LoaderCursor c;
  try {
    c = s.data_cursor.get<LoaderCursor>();
  } catch (const Error& e) {
    fail(where, ": ", e.what());
  }
  if (c.has_segment) {
    // The segment's batch shape is the one its own train_config saved (a segment is one run's life).
    const auto config = s.state.find("train_config");
    if (config == s.state.end() || !config->is_object())
      fail(where, ": field 'train_config' is missing: the data cursor cannot be checked against the step");
    const int64_t micro_batch = json_int(*config, "micro_batch", where + ": train_config", 1, int64_t{1} << 31);
    const int64_t grad_accum = json_int(*config, "grad_accum", where + ": train_config", 1, int64_t{1} << 31);
    check_cursor_progress(c, static_cast<uint64_t>(s.step), static_cast<uint64_t>(micro_batch * grad_accum), where);
  }
  c = reshard_cursor(c, dp_size);
  c.has_segment = true;
  c.segment_step = static_cast<uint64_t>(s.step), c.segment_epoch = c.epoch, c.segment_position = c.position;
  return c;
}

void check_optimizer_steps(const TrainingState& state, int64_t steps_taken, const fs::path& dir) {
  if (steps_taken != state.step - state.skipped_steps)
    fail(dir.string(), ": the optimizer state has taken ", steps_taken, " updates, but state.json says step ",
         state.step, " with ", state.skipped_steps, " skipped (expected ", state.step - state.skipped_steps,
         "): files of different checkpoints?");
}

std::string verify_checkpoint(const fs::path& dir, int part, int parts, bool* unverified) {
  return verify_checkpoint_files(dir, [](const std::string&) { return true; }, part, parts, unverified);
}

std::string verify_checkpoint_files(const fs::path& dir, const std::function<bool(const std::string&)>& reads, int part,
                                    int parts, bool* unverified) {
  if (unverified) *unverified = false;
  const fs::path manifest_path = dir / kManifestFile;
  std::error_code ec;
  if (!fs::exists(manifest_path, ec)) {
    if (unverified) *unverified = true;
    return "";
  }
  try {
    const json manifest = read_json_file(manifest_path, "checkpoint manifest");
    const std::string where = manifest_path.string();
    if (!manifest.is_object() || !manifest.contains("files") || !manifest["files"].is_object())
      fail(where, ": expected an object with 'files'");
    const json& files = manifest["files"];
    std::set<std::string> listed;
    int index = 0;
    for (const auto& [name, entry] : files.items()) {  // nlohmann::json keeps keys sorted: the same order everywhere
      listed.insert(name);
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
        fail(where, ": '", name, "' is not a plain file name");
      const std::string what = str(where, ": file '", name, "'");
      if (!entry.is_object() || !entry.contains("xxh3_64") || !entry["xxh3_64"].is_string())
        fail(what, ": expected {bytes, xxh3_64}");
      const int64_t bytes = json_int(entry, "bytes", what, 0, INT64_MAX);
      const fs::path p = dir / name;
      std::error_code size_ec;
      const uintmax_t size = fs::file_size(p, size_ec);
      if (size_ec) fail(p.string(), ": listed in the manifest, but ", size_ec.message());
      if (size != static_cast<uintmax_t>(bytes))
        fail(p.string(), ": ", size, " bytes, the manifest says ", bytes, " (truncated or replaced)");
      if (!reads(name) || index++ % parts != part) continue;
      const uint64_t expected = parse_hex64(entry["xxh3_64"].get<std::string>(), what);
      const FileDigest d = digest_file(p);
      if (d.xxh3 != expected)
        fail(p.string(), ": checksum ", hex64(d.xxh3), ", the manifest says ", hex64(expected), " (the file is damaged)");
    }
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name != kManifestFile && !listed.count(name))
        fail(it->path().string(), ": not in the manifest (a file of another checkpoint?)");
    }
    if (ec) fail(dir.string(), ": cannot list: ", ec.message());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

namespace {

bool model_file_read(ModelFiles files, const std::string& name) {
  if (files == ModelFiles::Tokenizer) return !ends_with(name, ".safetensors");  // config.json, tokenizer files
  return name != "optimizer.safetensors";  // rank files hold the moments too, and are read whole
}

}  // namespace

bool verify_model_directory(const fs::path& dir, ModelFiles files, int part, int parts) {
  bool unverified = false;
  const std::string problem = verify_checkpoint_files(
      dir, [files](const std::string& name) { return model_file_read(files, name); }, part, parts, &unverified);
  if (!problem.empty())
    fail(dir.string(), ": fails verification against its ", kManifestFile, ", not used: ", problem);
  return !unverified;
}

bool verify_model_directory(const fs::path& dir, ModelFiles files, Comm& world) {
  std::string problem;
  bool verified = false;
  try {
    verified = verify_model_directory(dir, files, world.rank(), world.size());
  } catch (const Error& e) {
    problem = e.what();
  }
  int64_t failed = problem.empty() ? 0 : 1;
  world.all_reduce_sum(&failed, 1, "model directory verification");
  if (failed) fail(problem.empty() ? str(dir.string(), ": fails verification on another rank (see its message)") : problem);
  return verified;
}

std::string unverified_note(const fs::path& dir) {
  return str(dir.string(), " has no ", kManifestFile,
             " (a Hugging Face download, or a checkpoint written before checkpoints carried checksums): its files are "
             "checked for structure only, not against checksums");
}

std::optional<fs::path> resume_checkpoint(const fs::path& root, Comm& world,
                                          const std::function<void(const std::string&)>& warn) {
  const std::vector<fs::path> all = list_checkpoints(root);
  std::vector<fs::path> rejected;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    bool unverified = false;
    const std::string problem = verify_checkpoint(*it, world.rank(), world.size(), &unverified);
    int64_t failed = problem.empty() ? 0 : 1;
    world.all_reduce_sum(&failed, 1, "checkpoint verification");
    if (failed == 0) {
      if (unverified && world.rank() == 0)
        warn(str(it->string(), " has no ", kManifestFile, " (written before checkpoints carried checksums): resuming unverified"));
      if (!rejected.empty() && world.rank() == 0) {
        for (const fs::path& r : rejected) {  // out of the rotation's way, kept for a post-mortem
          std::error_code ec;
          const fs::path aside = r.parent_path() / ("rejected-" + r.filename().string());
          fs::remove_all(aside, ec);
          fs::rename(r, aside, ec);
          if (ec) fail(r.string(), ": cannot move the rejected checkpoint aside: ", ec.message());
        }
        warn(str("resuming from ", it->string(), " instead (rejected checkpoints renamed to rejected-step_*)"));
      }
      world.barrier("rejected checkpoints moved aside");
      return *it;
    }
    if (!problem.empty()) warn(str(it->string(), " fails verification: ", problem));
    else if (world.rank() == 0) warn(str(it->string(), " fails verification on another rank (see its message)"));
    rejected.push_back(*it);
  }
  if (!all.empty())
    fail(root.string(), ": none of the ", all.size(), " checkpoints verifies (see the warnings above); nothing to resume from");
  return std::nullopt;
}

std::optional<int64_t> training_seq_len(const fs::path& dir) {
  if (!fs::exists(dir / "state.json")) return std::nullopt;  // a Hugging Face download
  const json state = read_state(dir);
  const auto config = state.find("train_config");
  if (config == state.end() || !config->is_object() || !config->contains("seq_len") ||
      !(*config)["seq_len"].is_number_integer())
    return std::nullopt;  // an imported base model (build/convert) has not been trained
  return (*config)["seq_len"].get<int64_t>();
}

std::optional<TrainedDocumentMode> training_document_mode(const fs::path& dir) {
  if (!fs::exists(dir / "state.json")) return std::nullopt;
  const json state = read_state(dir);
  const auto config = state.find("train_config");
  if (config == state.end() || !config->is_object() || !config->contains("seq_len")) return std::nullopt;
  TrainedDocumentMode mode{false, false};
  if (config->contains("document_mask")) {
    const json& v = (*config)["document_mask"];
    if (!v.is_boolean())
      fail(dir.string(), "/state.json: field 'train_config.document_mask': expected true or false, found ", v.dump());
    mode.mask = v.get<bool>();
  }
  if (config->contains("document_positions")) {
    const json& v = (*config)["document_positions"];
    if (!v.is_string() || (v != "restart" && v != "continue"))
      fail(dir.string(), "/state.json: field 'train_config.document_positions': expected \"restart\" or \"continue\", "
           "found ", v.dump());
    mode.restart_positions = v == "restart";
  }
  return mode;
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
