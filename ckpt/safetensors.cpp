// ckpt/safetensors.cpp — safetensors reader (mmap + full header validation), atomic writer, and
// Hugging Face checkpoint directories.
#include "ckpt/safetensors.h"

#include "ckpt/tensor_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "core/checksum.h"
#include "core/error.h"
#include "core/file.h"
#include "core/json.h"
#include "core/progress.h"

namespace tuna {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

namespace {

constexpr std::string_view kMetadataKey = "__metadata__";

std::string errno_text(int err) { return std::strerror(err); }

// The header or the index as a JSON object: depth-limited, a repeated key refused (core/json.h): in a header
// a repeat would hide a tensor, in an index a shard assignment.
ordered_json parse_json_object(std::string_view text, const std::string& what) {
  ordered_json json = parse_ordered_json(text, what);
  if (!json.is_object()) fail(what, " is not a JSON object (found ", json.type_name(), ")");
  return json;
}

// The safetensors format's own limit on the header (the reference implementation refuses larger ones).
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

// A JSON integer that fits in int64 (nlohmann stores big positives as unsigned, fractions as float).
bool as_int64(const ordered_json& value, int64_t* out) {
  if (value.is_number_unsigned()) {
    uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (value.is_number_integer()) {
    *out = value.get<int64_t>();
    return true;
  }
  return false;
}

std::string dtype_list() {
  std::string list;
  for (DType d : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32, DType::I16,
                  DType::I8, DType::U8, DType::BOOL}) {
    if (!list.empty()) list += ", ";
    list += dtype_name(d);
  }
  return list;
}

// Validates one header entry; `prefix` is "FILE: tensor 'NAME'".
TensorInfo parse_entry(const std::string& prefix, const std::string& name, const ordered_json& entry,
                       uint64_t data_size) {
  if (!entry.is_object())
    fail(prefix, ": expected an object with dtype, shape and data_offsets, found ", entry.type_name());
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(field)) fail(prefix, ": missing field '", field, "'");

  TensorInfo info;
  info.name = name;

  const ordered_json& dtype = entry["dtype"];
  if (!dtype.is_string()) fail(prefix, ": field 'dtype': expected a string, found ", dtype.type_name());
  std::optional<DType> parsed = parse_dtype(dtype.get_ref<const std::string&>());
  if (!parsed)
    fail(prefix, ": unknown dtype '", dtype.get_ref<const std::string&>(), "' (tuna reads ", dtype_list(),
         ")");
  info.dtype = *parsed;

  const ordered_json& shape = entry["shape"];
  if (!shape.is_array())
    fail(prefix, ": field 'shape': expected an array of integers, found ", shape.type_name());
  // numel * dtype size is compared with the byte range below; saturating it at "too big" avoids
  // overflow on absurd shapes, which then fail that comparison with their true description.
  bool too_big = false;
  int64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t dim = 0;
    if (!as_int64(shape[i], &dim))
      fail(prefix, ": field 'shape': element ", i, " is not an integer (found ", shape[i].dump(), ")");
    if (dim < 0) fail(prefix, ": field 'shape': negative dimension ", dim, " at index ", i);
    info.shape.push_back(dim);
    if (__builtin_mul_overflow(numel, dim, &numel)) too_big = true;
  }
  info.numel = too_big ? -1 : numel;

  const ordered_json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2)
    fail(prefix, ": field 'data_offsets': expected [begin, end], found ", offsets.dump());
  int64_t begin = 0, end = 0;
  if (!as_int64(offsets[0], &begin) || !as_int64(offsets[1], &end) || begin < 0 || end < 0)
    fail(prefix, ": field 'data_offsets': expected two non-negative integers, found ", offsets.dump());
  if (begin > end)
    fail(prefix, ": field 'data_offsets': begin ", begin, " is greater than end ", end);
  info.begin = static_cast<uint64_t>(begin);
  info.end = static_cast<uint64_t>(end);
  if (info.end > data_size)
    fail(prefix, ": data_offsets [", begin, ", ", end, "] run past the end of the data section (",
         data_size, " bytes): the file is truncated or its header is wrong");

  uint64_t needed = 0;
  if (!too_big)
    too_big = __builtin_mul_overflow(static_cast<uint64_t>(numel), dtype_size(info.dtype), &needed);
  if (too_big || needed != info.nbytes())
    fail(prefix, ": data_offsets [", begin, ", ", end, "] hold ", info.nbytes(), " bytes, but shape ",
         format_shape(info.shape), " of ", dtype_name(info.dtype), " needs ",
         too_big ? std::string("more than 2^64") : std::to_string(needed), " bytes");
  return info;
}


}  // namespace

std::string format_shape(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

// ---------------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::SafetensorsFile(const fs::path& path) : path_(path) {
  const std::string name = path.string();
  uint64_t file_size = 0;
  const int fd = open_regular_file(path, "safetensors file", &file_size);  // a FIFO or device is refused by name
  if (file_size < 8) {
    ::close(fd);
    fail(name, ": file is ", file_size,
         " bytes, shorter than the 8-byte header length that starts a safetensors file");
  }
  void* addr = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (addr == MAP_FAILED) fail("cannot mmap ", name, ": ", errno_text(map_err));
  map_ = static_cast<const std::byte*>(addr);
  map_size_ = file_size;

  try {
    // The header length is little-endian; assemble it bytewise so the reader is endian-neutral.
    uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | std::to_integer<uint64_t>(map_[i]);
    if (header_size > file_size - 8)
      fail(name, ": header length ", header_size, " runs past the end of the file (", file_size,
           " bytes, so at most ", file_size - 8, " bytes of header)");
    if (header_size > kMaxHeaderBytes)
      fail(name, ": header length ", header_size, " is more than the format's limit of ", kMaxHeaderBytes, " bytes");
    const uint64_t data_size = file_size - 8 - header_size;
    data_section_ = map_ + 8 + header_size;

    std::string_view text(reinterpret_cast<const char*>(map_ + 8), header_size);
    ordered_json header = parse_json_object(text, name + ": header");

    for (const auto& [key, value] : header.items()) {
      if (key == kMetadataKey) {
        if (!value.is_object())
          fail(name, ": __metadata__: expected an object of strings, found ", value.type_name());
        for (const auto& [mkey, mvalue] : value.items()) {
          if (!mvalue.is_string())
            fail(name, ": __metadata__ entry '", mkey, "': expected a string, found ",
                 mvalue.type_name());
          metadata_[mkey] = mvalue.get<std::string>();
        }
        continue;
      }
      tensors_.push_back(parse_entry(name + ": tensor '" + key + "'", key, value, data_size));
    }

    // File order is data order. stable_sort keeps header order among tensors at the same offset
    // (zero-byte tensors), so listing is deterministic.
    std::stable_sort(tensors_.begin(), tensors_.end(),
                     [](const TensorInfo& a, const TensorInfo& b) { return a.begin < b.begin; });
    // The format's rule: the tensors cover the data section exactly, each starting where the previous ends,
    // with no hole and no trailing byte (zero-byte tensors aside). Bytes that belong to no tensor are how a damaged or tampered file
    // shows (an insertion shifts every later tensor, which would then load as garbage), so they are refused.
    uint64_t covered = 0;
    const TensorInfo* previous = nullptr;
    for (const TensorInfo& t : tensors_) {
      if (t.nbytes() == 0) continue;  // holds no byte, hides none: accepted wherever it points inside the data
      if (t.begin > covered)
        fail(name, ": bytes [", covered, ", ", t.begin, ") of the data section belong to no tensor (before '", t.name,
             "'): a safetensors file has no holes; the file is damaged");
      if (t.begin < covered)
        fail(name, ": tensors '", previous->name, "' (bytes [", previous->begin, ", ", previous->end, ")) and '",
             t.name, "' (bytes [", t.begin, ", ", t.end, ")) overlap");
      covered = t.end;
      previous = &t;
    }
    if (covered != data_size)
      fail(name, ": the tensors end at byte ", covered, " of the ", data_size, "-byte data section: ",
           data_size - covered, " trailing bytes belong to no tensor; the file is damaged");
    for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  } catch (...) {
    release();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { release(); }

void SafetensorsFile::release() noexcept {
  if (map_) ::munmap(const_cast<std::byte*>(map_), map_size_);
  map_ = nullptr;
  map_size_ = 0;
  data_section_ = nullptr;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      data_section_(std::exchange(other.data_section_, nullptr)),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    data_section_ = std::exchange(other.data_section_, nullptr);
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const std::byte* SafetensorsFile::data(const TensorInfo& info) const {
  TUNA_CHECK(!tensors_.empty() && &info >= tensors_.data() && &info < tensors_.data() + tensors_.size(),
             "TensorInfo '", info.name, "' does not belong to ", path_.string());
  return data_section_ + info.begin;
}

void SafetensorsFile::release(const std::byte* p, uint64_t bytes) const {
  if (bytes == 0) return;
  TUNA_CHECK(p >= map_ && bytes <= map_size_ && uint64_t(p - map_) <= map_size_ - bytes, "release of ", bytes,
             " bytes outside the mapping of ", path_.string());
  // The mapping's whole 2 MiB blocks around the range, not its pages: a read fault maps the page cache's
  // neighbouring pages too (fault-around, large folios), which belong to tensors read and released before when the
  // file's order is not the reading order, and nothing would drop them again (a sizeable share of a base would stay
  // resident). The pages were never written (PROT_READ), so none is lost: a neighbour still to be read faults back in.
  constexpr uint64_t kBlock = uint64_t{2} << 20;
  const uint64_t begin = uint64_t(p - map_) / kBlock * kBlock;
  const uint64_t end = std::min(map_size_, (uint64_t(p - map_) + bytes + kBlock - 1) / kBlock * kBlock);
  ::madvise(const_cast<std::byte*>(map_) + begin, end - begin, MADV_DONTNEED);  // advice: a refusal changes nothing
}

const TensorInfo& SafetensorsFile::require(std::string_view name,
                                           std::span<const int64_t> expected_shape) const {
  const TensorInfo* info = find(name);
  if (!info) fail("file ", path_.string(), " has no tensor '", name, "'");
  if (!std::equal(info->shape.begin(), info->shape.end(), expected_shape.begin(), expected_shape.end()))
    fail("tensor '", name, "' in ", path_.string(), ": expected shape ", format_shape(expected_shape),
         ", found ", format_shape(info->shape));
  return *info;
}

void SafetensorsFile::require_finite(const TensorInfo& info) const {
  const int64_t bad = first_non_finite(data(info), info.dtype, info.numel);
  if (bad >= 0)
    fail("tensor '", info.name, "' in ", path_.string(), ": element ", bad, " is ",
         element_as_double(data(info), info.dtype, bad),
         " (weights and optimizer state must be finite; the checkpoint is damaged or was saved from a diverged run)");
}

void SafetensorsFile::read_f32(std::string_view name, std::span<const int64_t> expected_shape,
                               float* dst) const {
  const TensorInfo& info = require(name, expected_shape);
  if (!is_floating(info.dtype))
    fail("tensor '", name, "' in ", path_.string(), ": dtype ", dtype_name(info.dtype),
         " cannot be read as float (expected F32, BF16, F16 or F64)");
  require_finite(info);
  convert_to_f32(data(info), info.dtype, dst, info.numel);
}

void SafetensorsFile::read_f64(std::string_view name, std::span<const int64_t> expected_shape,
                               double* dst) const {
  const TensorInfo& info = require(name, expected_shape);
  const std::byte* src = data(info);
  if (is_floating(info.dtype)) require_finite(info);
  switch (info.dtype) {
    case DType::F64:
      if (info.numel > 0) std::memcpy(dst, src, info.nbytes());
      return;
    case DType::F32:
      for (int64_t i = 0; i < info.numel; ++i) {
        float v;
        std::memcpy(&v, src + i * 4, 4);
        dst[i] = v;
      }
      return;
    case DType::F16:
    case DType::BF16:
      for (int64_t i = 0; i < info.numel; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + i * 2, 2);
        dst[i] = info.dtype == DType::F16 ? f16_to_f32(bits) : bf16_to_f32(bits);
      }
      return;
    default:
      fail("tensor '", name, "' in ", path_.string(), ": dtype ", dtype_name(info.dtype),
           " cannot be read as double (expected F64, F32, BF16 or F16)");
  }
}

void SafetensorsFile::read_i32(std::string_view name, std::span<const int64_t> expected_shape,
                               int32_t* dst) const {
  const TensorInfo& info = require(name, expected_shape);
  const std::byte* src = data(info);
  switch (info.dtype) {
    case DType::I32:
      if (info.numel > 0) std::memcpy(dst, src, info.nbytes());
      return;
    case DType::I64:
      for (int64_t i = 0; i < info.numel; ++i) {
        int64_t v;
        std::memcpy(&v, src + i * 8, 8);
        if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
          fail("tensor '", name, "' in ", path_.string(), ": element ", i, " = ", v,
               " does not fit in int32");
        dst[i] = static_cast<int32_t>(v);
      }
      return;
    default:
      fail("tensor '", name, "' in ", path_.string(), ": dtype ", dtype_name(info.dtype),
           " cannot be read as int32 (expected I32 or I64)");
  }
}

// ---------------------------------------------------------------------------------------------------
// SafetensorsWriter

void SafetensorsWriter::add(std::string name, DType dtype, std::span<const int64_t> shape,
                            const void* data) {
  if (name.empty()) fail("safetensors writer: tensor name is empty");
  if (name == kMetadataKey) fail("safetensors writer: '", name, "' is reserved for metadata");
  if (names_.contains(name)) fail("safetensors writer: tensor '", name, "' added twice");
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) fail("safetensors writer: tensor '", name, "': negative dimension in ", format_shape(shape));
    numel *= static_cast<uint64_t>(d);
  }
  uint64_t nbytes = numel * dtype_size(dtype);
  if (nbytes > 0 && data == nullptr) fail("safetensors writer: tensor '", name, "': data is null");
  names_.insert(name);
  tensors_.push_back(Pending{std::move(name), dtype, {shape.begin(), shape.end()}, data, nbytes});
}

void SafetensorsWriter::add_streamed(std::string name, DType dtype, std::span<const int64_t> shape) {
  static const char kNoData = 0;  // a non-null marker; write_streamed never reads it
  add(std::move(name), dtype, shape, &kNoData);
  tensors_.back().data = nullptr;
}

void SafetensorsWriter::add_metadata(std::string key, std::string value) {
  for (const auto& [k, v] : metadata_)
    if (k == key) fail("safetensors writer: metadata key '", key, "' added twice");
  metadata_.emplace_back(std::move(key), std::move(value));
}

FileDigest SafetensorsWriter::write(const fs::path& path, ProgressLine* progress) const {
  for (const Pending& t : tensors_)
    TUNA_CHECK(t.data != nullptr || t.nbytes == 0, "tensor '", t.name, "' was added for streaming: write_streamed");
  return write_streamed(
      path,
      [&](const Append& append) {
        for (const Pending& t : tensors_) append(t.data, t.nbytes);
      },
      progress);
}

FileDigest SafetensorsWriter::write_streamed(const fs::path& path,
                                             const std::function<void(const Append& append)>& produce,
                                             ProgressLine* progress) const {
  const std::string target = path.string();

  ordered_json header = ordered_json::object();
  if (!metadata_.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    header[std::string(kMetadataKey)] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const Pending& t : tensors_) {
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // names or metadata that are not valid UTF-8
    fail("cannot write ", target, ": header is not valid JSON: ", e.what());
  }
  // Spaces after the JSON are allowed by the spec; they put the data section on an 8-byte boundary so
  // that F64/I64 tensors in the mapping are naturally aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>(uint64_t{text.size()} >> (8 * i));
  head += text;
  std::vector<TensorFileEntry> entries;
  for (const Pending& t : tensors_) entries.push_back({t.name, t.nbytes});
  return write_tensor_file(path, head, entries, /*alignment=*/1, produce, progress);
}

// ---------------------------------------------------------------------------------------------------
// HfCheckpointDir

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// How surely a file name means pickle model weights: 0 transformers' pytorch_model*.bin (and its index),
// 1 Meta's consolidated.NN.pth, 2 any other .pth/.pt (could also be a Trainer's optimizer.pt or
// rng_state.pth); -1 not pickle weights. The error names the surest one found.
int pickle_rank(const std::string& file) {
  if (file.starts_with("pytorch_model") && (file.ends_with(".bin") || file.ends_with(".bin.index.json")))
    return 0;
  if (file.starts_with("consolidated.") && file.ends_with(".pth")) return 1;
  if (file.ends_with(".pth") || file.ends_with(".pt")) return 2;
  return -1;
}

}  // namespace

HfCheckpointDir::HfCheckpointDir(const fs::path& dir) : dir_(dir) {
  const std::string where = dir.string();
  std::error_code ec;
  if (!fs::exists(dir, ec)) fail(where, ": no such directory (expected a Hugging Face model directory)");
  if (!fs::is_directory(dir, ec))
    fail(where, ": not a directory (expected a Hugging Face model directory)");

  if (fs::is_regular_file(dir / kSingleFile, ec)) {
    shard_paths_.push_back(dir / kSingleFile);
    shards_.push_back(std::make_unique<SafetensorsFile>(shard_paths_[0]));
    for (const TensorInfo& t : shards_[0]->tensors()) {
      names_.push_back(t.name);
      shard_of_.emplace(t.name, 0);
    }
    return;
  }

  if (fs::is_regular_file(dir / kIndexFile, ec)) {
    index_path_ = dir / kIndexFile;
    const std::string index_name = index_path_.string();
    ordered_json index = parse_json_object(read_regular_file(index_path_, "safetensors index", kMaxJsonFileBytes), index_name);
    if (!index.contains("weight_map"))
      fail(index_name, ": missing field 'weight_map' (tensor name -> shard file)");
    const ordered_json& weight_map = index["weight_map"];
    if (!weight_map.is_object())
      fail(index_name, ": field 'weight_map': expected an object, found ", weight_map.type_name());
    if (weight_map.empty()) fail(index_name, ": field 'weight_map' is empty");
    std::map<std::string, size_t, std::less<>> shard_number;
    for (const auto& [tensor, file] : weight_map.items()) {
      if (!file.is_string())
        fail(index_name, ": weight_map entry '", tensor, "': expected a shard file name, found ",
             file.type_name());
      const std::string& shard_file = file.get_ref<const std::string&>();
      // A plain file name inside this directory: "../x", "/etc/x" or "sub/x" would read outside the model.
      if (shard_file.empty() || shard_file == "." || shard_file == ".." ||
          shard_file.find_first_of(std::string("/\\\0", 3)) != std::string::npos)
        fail(index_name, ": weight_map entry '", tensor, "': shard '", shard_file,
             "' is not a plain file name (a shard must sit in the model directory itself)");
      auto [it, inserted] = shard_number.emplace(shard_file, shard_paths_.size());
      if (inserted) {
        fs::path shard_path = dir / shard_file;
        if (!fs::is_regular_file(shard_path, ec))
          fail(index_name, ": tensor '", tensor, "' is in shard '", shard_file, "', but ",
               shard_path.string(), " does not exist");
        shard_paths_.push_back(shard_path);
      }
      names_.push_back(tensor);
      shard_of_.emplace(tensor, it->second);
    }
    shards_.resize(shard_paths_.size());
    return;
  }

  // No safetensors checkpoint: say what is there instead, the common case being pickle weights.
  std::vector<std::pair<int, std::string>> pickles;  // (rank, name): sorted, the surest comes first
  std::vector<std::string> other_safetensors;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    std::string file = e.path().filename().string();
    if (int rank = pickle_rank(file); rank >= 0) pickles.emplace_back(rank, file);
    if (file.ends_with(".safetensors")) other_safetensors.push_back(file);
  }
  std::sort(pickles.begin(), pickles.end());
  std::sort(other_safetensors.begin(), other_safetensors.end());
  if (!pickles.empty()) {
    const std::string& found = pickles.front().second;
    const bool meta_format = found.ends_with(".pth");  // Meta's original consolidated.NN.pth release
    fail(where, " holds PyTorch pickle weights (", found,
         "); tuna reads only safetensors: convert them first, ",
         meta_format ? "e.g. with transformers' models/llama/convert_llama_weights_to_hf.py"
                     : "e.g. with transformers: model.save_pretrained(out_dir, safe_serialization=True)");
  }
  std::string others;
  for (const std::string& f : other_safetensors) others += (others.empty() ? "" : ", ") + f;
  fail(where, ": no model weights found: looked for ", kSingleFile, " and ", kIndexFile,
       " (safetensors), and pytorch_model.bin, pytorch_model.bin.index.json, *.pth, *.pt (PyTorch pickle)",
       others.empty() ? std::string() : "; other safetensors files here: " + others);
}

const SafetensorsFile& HfCheckpointDir::shard(size_t i) const {
  std::lock_guard<std::mutex> lock(*mutex_);
  if (!shards_[i]) shards_[i] = std::make_unique<SafetensorsFile>(shard_paths_[i]);
  return *shards_[i];
}

HfCheckpointDir::Entry HfCheckpointDir::find(std::string_view name) const {
  auto it = shard_of_.find(name);
  if (it == shard_of_.end()) return {};
  const SafetensorsFile& file = shard(it->second);
  const TensorInfo* info = file.find(name);
  if (!info)
    fail(index_path_.string(), ": tensor '", name, "' is in shard ", file.path().string(),
         ", but that file has no such tensor");
  return {&file, info};
}

void HfCheckpointDir::read_f32(std::string_view name, std::span<const int64_t> expected_shape,
                               float* dst) const {
  Entry entry = find(name);
  if (!entry) fail(dir_.string(), " has no tensor '", name, "'");
  entry.file->read_f32(name, expected_shape, dst);
}

void HfCheckpointDir::verify() const {
  for (const std::string& name : names_) find(name);
}

}  // namespace tuna
