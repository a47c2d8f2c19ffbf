// The tensor reader behind every checkpoint reader of ckpt/ (checkpoint.h's WeightReader and CheckpointReader, the
// optimizer state): global tensors' elements out of a Hugging Face download, a single-file tuna checkpoint or the
// rank files of a sharded one, a piece at a time. Internal to ckpt/: the writer (checkpoint_writer.cpp) reads rank
// files back through it when it assembles an adapter file.
#pragma once

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

namespace tuna::ckpt_files {

namespace fs = std::filesystem;
using nlohmann::json;

// Steps and update counts are bounded far beyond any run, so that sums and products of them never overflow.
inline constexpr int64_t kMaxStep = int64_t{1} << 62;
// ckpt/latest: a relative symlink to the newest step directory, replaced by rename so that a reader always
// finds an old or a new link, never none. A filesystem without symlinks leaves no link; resolve_checkpoint
// stands in for it.
inline constexpr const char* kLatestLink = "latest";

inline std::string rank_file_name(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank_%05d.safetensors", rank);
  return buf;
}

// Each rank's file digest travels to rank 0 (which writes the manifest) in a small file beside it.
inline std::string digest_note_name(int rank) { return "." + rank_file_name(rank) + ".digest"; }

// An integer metadata value of a safetensors file (all digits, in [0, kMaxStep]).
inline int64_t metadata_int(const SafetensorsFile& f, const char* key) {
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
inline std::vector<int64_t> json_dims(const json& piece, const char* key, const std::string& where) {
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

inline int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded by the config's limits (model/config.cpp)
  return n;
}


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

}  // namespace tuna::ckpt_files
