// ckpt/safetensors.h — reading and writing safetensors files, and Hugging Face checkpoint directories.
//
// Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes
// of JSON, then the data section. The JSON maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end]} (offsets relative to the data section), plus an optional "__metadata__" map of strings.
//
// SafetensorsFile maps a file read-only and validates the whole header when it opens, so every later
// accessor can trust it: a bad or truncated file fails at open with a message naming the file and the
// tensor. Tensor bytes are never copied until asked for; they are paged in from the mapping.
// SafetensorsWriter writes tuna's checkpoints and converted models atomically (path.tmp, fsync, rename),
// with the data section 8-byte aligned so that mapped tensors can be used in place.
// HfCheckpointDir resolves tensor names across a Hugging Face model directory (model.safetensors or a
// sharded model.safetensors.index.json) and refuses pickle checkpoints with a way out.
//
// All bad input raises tuna::Error (core/error.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/checksum.h"  // FileDigest
#include "core/dtype.h"

namespace tuna {

class ProgressLine;  // core/progress.h

// One tensor of a safetensors file, as its header describes it (already validated).
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // empty for a scalar
  int64_t numel = 0;           // product of shape; 1 for a scalar
  uint64_t begin = 0;          // byte range [begin, end) within the data section
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
};

// "[64, 128]"; "[]" for a scalar. The spelling every shape error in tuna uses.
std::string format_shape(std::span<const int64_t> shape);

class SafetensorsFile {
 public:
  // Maps and validates the file. Fails (naming the file, and the tensor where there is one) when the
  // file cannot be opened, is shorter than 8 bytes, its header length runs past the end, the header is
  // not a JSON object, an entry lacks dtype/shape/data_offsets or has the wrong JSON types, a dtype is
  // unknown, a dimension is negative, data_offsets is not [begin, end] with begin <= end, a tensor runs
  // past the end of the data section (truncated file), a byte size differs from numel * dtype size,
  // two tensors overlap, the tensors leave a hole or trailing bytes in the data section (the format requires
  // them to cover it exactly), a name repeats, or __metadata__ is not a map of strings; a FIFO or device is
  // refused by name (core/file.h), a header nested too deep or over 100 MB too (core/json.h).
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Every tensor in file order (ascending data offset; header order among zero-byte tensors).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr when the file has no tensor of that name.
  const TensorInfo* find(std::string_view name) const;
  // First byte of the tensor inside the mapping; info must come from this file's tensors()/find().
  // Aligned only as the writer aligned it: tuna's writer puts the data section on 8 bytes, and offsets
  // are whatever the writer chose, so read through memcpy or convert_to_f32 unless you know the file.
  const std::byte* data(const TensorInfo& info) const;
  // Drops the mapping's pages that hold bytes [p, p + bytes) from this process's resident memory: the page cache
  // keeps them (shared by the ranks of a node) and a later read faults them back in. Readers of pieces call it once
  // a piece is copied out, so that a rank reading its share of a 140 GB model is not counted as holding the file.
  void release(const std::byte* p, uint64_t bytes) const;
  // The "__metadata__" map; empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Copies tensor `name`, converted to float, into dst (expected_shape's numel elements). Fails when
  // the tensor is missing ("file X has no tensor 'name'"), its shape differs ("tensor 'name' in X:
  // expected shape [64, 128], found [64, 127]"), its dtype is not F32, BF16, F16 or F64, or an element is
  // NaN or infinite (require_finite).
  void read_f32(std::string_view name, std::span<const int64_t> expected_shape, float* dst) const;
  // Fails naming the file, the tensor, the index of its first non-finite element and its value, for a
  // floating tensor holding a NaN or an infinity.
  void require_finite(const TensorInfo& info) const;
  // As read_f32, into double: F64 exactly, F32/BF16/F16 widened exactly (test fixtures are F64).
  void read_f64(std::string_view name, std::span<const int64_t> expected_shape, double* dst) const;
  // As read_f32, into int32: I32 exactly, I64 when every element fits in int32 (else fails naming it).
  void read_i32(std::string_view name, std::span<const int64_t> expected_shape, int32_t* dst) const;

  // Braced shapes read naturally at call sites: file.read_f32("w", {64, 128}, dst).
  void read_f32(std::string_view name, std::initializer_list<int64_t> expected_shape, float* dst) const {
    read_f32(name, std::span<const int64_t>(expected_shape.begin(), expected_shape.size()), dst);
  }
  void read_f64(std::string_view name, std::initializer_list<int64_t> expected_shape, double* dst) const {
    read_f64(name, std::span<const int64_t>(expected_shape.begin(), expected_shape.size()), dst);
  }
  void read_i32(std::string_view name, std::initializer_list<int64_t> expected_shape,
                int32_t* dst) const {
    read_i32(name, std::span<const int64_t>(expected_shape.begin(), expected_shape.size()), dst);
  }

 private:
  // The tensor, after the missing-tensor and shape checks that every read_* starts with.
  const TensorInfo& require(std::string_view name, std::span<const int64_t> expected_shape) const;
  void release() noexcept;

  std::filesystem::path path_;
  const std::byte* map_ = nullptr;  // the whole file, read-only
  size_t map_size_ = 0;
  const std::byte* data_section_ = nullptr;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

class SafetensorsWriter {
 public:
  // Registers a tensor: keeps the data pointer (which must stay valid until write() returns) and
  // copies nothing. Tensors are written in the order added, contiguously. Fails on a repeated name,
  // the reserved name "__metadata__", an empty name, a negative dimension, or null data with bytes.
  void add(std::string name, DType dtype, std::span<const int64_t> shape, const void* data);
  void add(std::string name, DType dtype, std::initializer_list<int64_t> shape, const void* data) {
    add(std::move(name), dtype, std::span<const int64_t>(shape.begin(), shape.size()), data);
  }
  // One "__metadata__" entry; a repeated key fails.
  void add_metadata(std::string key, std::string value);

  // Writes path atomically: header JSON padded with spaces so the data section starts at a multiple of
  // 8 bytes, then the tensors; into path + ".tmp", fsync, rename over path, fsync the directory. On any
  // failure (unwritable directory, disk full: every write is checked) the message names path, the
  // temporary file is removed, and an existing file at path is left as it was. Returns the file's size and
  // XXH3-64, computed from the bytes as they are written (for a checkpoint's manifest).
  // `progress`, when given, advances by the bytes of every piece written (a 140 GB file shows it moving).
  FileDigest write(const std::filesystem::path& path, ProgressLine* progress = nullptr) const;

  // Streaming: tensors registered with add_streamed() carry no data; write_streamed() writes the header, then
  // calls produce(append), which must append exactly the bytes of every tensor, in the order added (checked),
  // so that no caller holds the whole file's data at once. Then fsync and rename as write().
  void add_streamed(std::string name, DType dtype, std::span<const int64_t> shape);
  using Append = std::function<void(const void* data, uint64_t bytes)>;
  FileDigest write_streamed(const std::filesystem::path& path, const std::function<void(const Append& append)>& produce,
                            ProgressLine* progress = nullptr) const;

 private:
  struct Pending {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;
    uint64_t nbytes;
  };
  std::vector<Pending> tensors_;
  std::set<std::string, std::less<>> names_;  // for the repeated-name check
  std::vector<std::pair<std::string, std::string>> metadata_;
};

// A Hugging Face model directory. Looks for, in this order (as transformers does):
//   model.safetensors                 one file, opened at construction;
//   model.safetensors.index.json      {"weight_map": {tensor: shard file}}; every shard must exist
//                                     (checked at construction), each is opened on first use.
// A directory with only PyTorch pickle weights (pytorch_model.bin, pytorch_model.bin.index.json,
// *.pth such as consolidated.00.pth, *.pt) is refused with a message saying how to convert it; a
// directory with neither fails listing what was looked for.
// Thread-safe: find() may be called from several threads. Movable, not copyable.
class HfCheckpointDir {
 public:
  explicit HfCheckpointDir(const std::filesystem::path& dir);

  struct Entry {
    const SafetensorsFile* file = nullptr;  // the file (shard) holding the tensor
    const TensorInfo* info = nullptr;       // its description within that file
    explicit operator bool() const { return info != nullptr; }
  };

  const std::filesystem::path& dir() const { return dir_; }
  // Every tensor name: file order for a single file, the index's order for a sharded checkpoint.
  const std::vector<std::string>& tensor_names() const { return names_; }
  // The safetensors files, in order of first appearance (one entry for a single-file checkpoint).
  const std::vector<std::filesystem::path>& shard_paths() const { return shard_paths_; }
  // Empty {} when the checkpoint has no such tensor. Opens the tensor's shard if needed; fails when
  // the index names a tensor that its shard does not contain (naming the index, tensor and shard).
  Entry find(std::string_view name) const;
  // As SafetensorsFile::read_f32, with "DIR has no tensor 'name'" when absent.
  void read_f32(std::string_view name, std::span<const int64_t> expected_shape, float* dst) const;
  void read_f32(std::string_view name, std::initializer_list<int64_t> expected_shape, float* dst) const {
    read_f32(name, std::span<const int64_t>(expected_shape.begin(), expected_shape.size()), dst);
  }
  // Opens every shard and checks that each indexed tensor is where the index says: a whole-checkpoint
  // check for tools (convert) that want every error before any work.
  void verify() const;

 private:
  const SafetensorsFile& shard(size_t i) const;

  std::filesystem::path dir_;
  std::filesystem::path index_path_;  // empty for a single-file checkpoint
  std::vector<std::string> names_;
  std::map<std::string, size_t, std::less<>> shard_of_;  // tensor name -> index into shard_paths_
  std::vector<std::filesystem::path> shard_paths_;
  mutable std::vector<std::unique_ptr<SafetensorsFile>> shards_;  // opened lazily, parallel to paths
  // Guards shards_. Held by pointer so that the directory object stays movable.
  std::unique_ptr<std::mutex> mutex_ = std::make_unique<std::mutex>();
};

}  // namespace tuna
