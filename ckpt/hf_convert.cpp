#include "ckpt/hf_convert.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/progress.h"
#include "ckpt/checkpoint.h"
#include "model/config.h"
#include "model/layout.h"
#include "ckpt/safetensors.h"

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

DType dtype_from_torch_name(const std::string& name, const std::string& what) {
  if (name == "float32") return DType::F32;
  if (name == "bfloat16") return DType::BF16;
  if (name == "float16") return DType::F16;
  fail(what, ": expected float32, bfloat16 or float16, found '", name, "'");
}

std::string torch_name(DType d) {
  switch (d) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    default: return std::string(dtype_name(d));
  }
}

void write_json(const fs::path& p, const json& j) {
  std::ofstream out(p, std::ios::trunc);
  if (!out) fail(p.string(), ": cannot create file");
  out << j.dump(2) << "\n";
  out.flush();
  if (!out) fail(p.string(), ": write failed (disk full?)");
}

// The model directory's tokenizer files as they are (data/tokenizer.h: kTokenizerFileNames). Which tokenizer
// they hold is read by the tools, which also write what an export lacks (tools/convert.cpp).
void copy_tokenizer_files(const fs::path& from, const fs::path& to) {
  for (const char* name : kTokenizerFileNames) {
    std::error_code ec;
    if (!fs::is_regular_file(from / name, ec)) continue;
    fs::copy_file(from / name, to / name, fs::copy_options::overwrite_existing, ec);
    if (ec) fail((from / name).string(), ": cannot copy to ", to.string(), ": ", ec.message());
  }
}

// A new or empty directory to write into. An earlier model directory there is deleted with overwrite only;
// a directory holding anything else is never deleted (a mistyped path must not cost a user their files).
void make_out_dir(const fs::path& out, const fs::path& src, bool overwrite) {
  std::error_code ec;
  if (fs::exists(out) && fs::equivalent(out, src, ec)) fail(out.string(), ": output directory is the input directory");
  if (fs::exists(out) && !fs::is_directory(out)) fail(out.string(), ": exists and is not a directory");
  if (fs::is_directory(out) && !fs::is_empty(out)) {
    if (!fs::exists(out / "config.json"))
      fail(out.string(), ": exists and is not empty, and it is not a model directory (no config.json): not writing "
           "into it; choose a new output directory");
    if (!overwrite)
      fail(out.string(), ": already holds a model (config.json): --overwrite to replace it, or choose a new output "
           "directory");
    fs::path out_abs = fs::weakly_canonical(out), src_abs = fs::weakly_canonical(src);
    if (out_abs.filename().empty()) out_abs = out_abs.parent_path();  // "out/"
    if (std::distance(out_abs.begin(), out_abs.end()) <= std::distance(src_abs.begin(), src_abs.end()) &&
        std::equal(out_abs.begin(), out_abs.end(), src_abs.begin()))
      fail(out.string(), ": the input ", src.string(), " is inside it; not deleting it");
    fs::remove_all(out, ec);
    if (ec) fail(out.string(), ": cannot delete the earlier model directory (--overwrite): ", ec.message());
  }
  fs::create_directories(out, ec);
  if (ec) fail(out.string(), ": cannot create the output directory: ", ec.message());
}

// Every tensor the layout needs, checked for shape and a floating dtype; tensors of another model refused.
struct SourceTensor {
  const ParamTensor* param;
  HfCheckpointDir::Entry entry;
};

std::vector<SourceTensor> collect(const HfCheckpointDir& src, const ParamLayout& layout) {
  std::vector<SourceTensor> out;
  for (const ParamTensor& t : layout.tensors()) {
    HfCheckpointDir::Entry e = src.find(t.name);
    if (!e) fail(src.dir().string(), ": has no tensor '", t.name, "' (expected shape ", format_shape(t.shape), ")");
    if (e.info->shape != t.shape)
      fail(src.dir().string(), ": tensor '", t.name, "': expected shape ", format_shape(t.shape), " from config.json, found ",
           format_shape(e.info->shape));
    if (e.info->dtype != DType::F32 && e.info->dtype != DType::BF16 && e.info->dtype != DType::F16)
      fail(src.dir().string(), ": tensor '", t.name, "': expected dtype F32, BF16 or F16, found ", dtype_name(e.info->dtype));
    e.file->require_finite(*e.info);  // a NaN passed through conversion would train (or ship) as NaN
    e.file->release(e.file->data(*e.info), e.info->nbytes());  // the scan does not keep the model resident
    out.push_back({&t, e});
  }
  refuse_foreign_tensors(src, layout);
  return out;
}

// Writes tensors into a streamed safetensors file in another dtype, a bounded run of elements at a time, through
// two host buffers reused for every run: a conversion never holds a whole tensor, let alone the model.
class RunConverter {
 public:
  // Elements a tensor is converted by at most at a time (256 MB in fp32): the buffers stay bounded whatever the
  // model, and each write is large enough to stream at disk speed.
  static constexpr int64_t kRun = int64_t(64) << 20;

  // Appends `numel` elements in `target`; read(at, n, out) gives elements [at, at + n) in fp32.
  void append(const SafetensorsWriter::Append& append, int64_t numel, DType target,
              const std::function<void(int64_t at, int64_t n, float* out)>& read) {
    for (int64_t at = 0; at < numel; at += kRun) {
      const int64_t n = std::min(kRun, numel - at);
      if (static_cast<int64_t>(f32_.size()) < n) f32_ = std::vector<float>(n);  // exactly: no growth slack
      read(at, n, f32_.data());
      if (target == DType::F32) {
        append(f32_.data(), uint64_t(n) * sizeof(float));
        continue;
      }
      if (converted_.size() < n * dtype_size(target)) converted_ = std::vector<std::byte>(n * dtype_size(target));
      convert_from_f32(f32_.data(), target, converted_.data(), n);
      append(converted_.data(), uint64_t(n) * dtype_size(target));
    }
  }
  // Tensor `info` of a mapped file into `target`: its bytes as they are when the dtypes agree. Each run's mapped
  // pages are released once written (the page cache keeps them), so the file is not counted in this process.
  void append(const SafetensorsWriter::Append& append, const SafetensorsFile& file, const TensorInfo& info,
              DType target) {
    const std::byte* data = file.data(info);
    const int64_t size = int64_t(dtype_size(info.dtype));
    if (info.dtype == target) {
      for (int64_t at = 0; at < info.numel; at += kRun) {
        const int64_t n = std::min(kRun, info.numel - at);
        append(data + at * size, uint64_t(n * size));
        file.release(data + at * size, uint64_t(n * size));
      }
      return;
    }
    this->append(append, info.numel, target, [&](int64_t at, int64_t n, float* out) {
      convert_to_f32(data + at * size, info.dtype, out, n);
      file.release(data + at * size, uint64_t(n * size));
    });
  }
  int64_t staging_bytes() const { return int64_t(f32_.capacity() * sizeof(float) + converted_.capacity()); }

 private:
  std::vector<float> f32_;            // one run in fp32
  std::vector<std::byte> converted_;  // the same run in the target dtype
};

}  // namespace

ConvertReport import_hf(const fs::path& hf_dir, const fs::path& out_dir, const std::string& dtype, std::FILE* progress,
                        bool overwrite) {
  json config_json = read_config_json(hf_dir);
  LlamaConfig config = LlamaConfig::from_json(config_json, (hf_dir / "config.json").string());
  ParamLayout layout(config);
  HfCheckpointDir src(hf_dir);
  src.verify();
  std::vector<SourceTensor> tensors = collect(src, layout);
  make_out_dir(out_dir, hf_dir, overwrite);

  const bool keep = dtype == "keep";
  const DType target = keep ? DType::F32 : dtype_from_torch_name(dtype, "option --dtype");
  SafetensorsWriter w;
  w.add_metadata("format", "pt");
  w.add_metadata("producer", "tuna");
  ConvertReport r;
  std::set<DType> written;
  for (const SourceTensor& s : tensors) {
    const DType out_dtype = keep ? s.entry.info->dtype : target;
    w.add_streamed(s.param->name, out_dtype, s.param->shape);
    written.insert(out_dtype);
    r.tensors++;
    r.parameters += s.entry.info->numel;
    r.bytes_written += s.entry.info->numel * static_cast<int64_t>(dtype_size(out_dtype));
  }
  ProgressLine writing("convert: writing " + (out_dir / "model.safetensors").string(), double(r.bytes_written),
                       ProgressLine::Unit::Bytes, progress);
  RunConverter runs;  // tensors whose dtype changes go through it a run at a time
  w.write_streamed(
      out_dir / "model.safetensors",
      [&](const SafetensorsWriter::Append& append) {
        for (const SourceTensor& s : tensors) {
          const TensorInfo& info = *s.entry.info;
          runs.append(append, *s.entry.file, info, keep ? info.dtype : target);
        }
      },
      &writing);
  writing.finish();
  r.host_staging_bytes = runs.staging_bytes();
  write_json(out_dir / "config.json", config_json);
  copy_tokenizer_files(hf_dir, out_dir);
  write_json(out_dir / "state.json", json{{"step", 0}, {"source", fs::absolute(hf_dir).string()}, {"producer", "tuna convert"}});
  r.dtype = written.size() == 1 ? torch_name(*written.begin()) : "mixed";
  return r;
}

namespace {

// A tensor to export: straight from a mapped file, or read through `read` a bounded run at a time.
struct ExportSource {
  const ParamTensor* param;
  const SafetensorsFile* file;  // null: read through the export's piece reader
  const TensorInfo* info;
  int64_t numel;
};

// Writes `tensors` as a Hugging Face model directory into out_dir (made by the caller): shards of at most
// max_shard_bytes, an index past one shard, config.json with torch_dtype set, tokenizer files of tokenizer_dir.
ConvertReport write_hf_files(json config_json, const std::vector<ExportSource>& tensors,
                             const std::function<void(const Segment&, float*)>& read_piece, DType target,
                             int64_t max_shard_bytes, const fs::path& tokenizer_dir, const fs::path& out_dir,
                             std::FILE* progress) {
  using Source = ExportSource;

  // Group tensors into shards of at most max_shard_bytes (a single tensor larger than that gets its own).
  std::vector<std::vector<const Source*>> shards(1);
  int64_t shard_bytes = 0;
  for (const Source& s : tensors) {
    const int64_t bytes = s.numel * static_cast<int64_t>(dtype_size(target));
    if (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes) shards.emplace_back(), shard_bytes = 0;
    shards.back().push_back(&s);
    shard_bytes += bytes;
  }
  ConvertReport r;
  r.dtype = torch_name(target);
  r.shards = static_cast<int64_t>(shards.size());
  json weight_map = json::object();
  int64_t total_bytes = 0;
  for (const Source& s : tensors) total_bytes += s.numel * static_cast<int64_t>(dtype_size(target));
  ProgressLine writing(str("convert: writing ", shards.size(), " file(s) to ", out_dir.string()), double(total_bytes),
                       ProgressLine::Unit::Bytes, progress);
  RunConverter runs;
  for (size_t i = 0; i < shards.size(); i++) {
    const std::string file = shards.size() == 1
                                 ? std::string("model.safetensors")
                                 : str("model-", std::string(5 - std::to_string(i + 1).size(), '0'), i + 1, "-of-",
                                       std::string(5 - std::to_string(shards.size()).size(), '0'), shards.size(),
                                       ".safetensors");
    SafetensorsWriter w;
    w.add_metadata("format", "pt");
    for (const Source* s : shards[i]) {
      w.add_streamed(s->param->name, target, s->param->shape);
      weight_map[s->param->name] = file;
      r.tensors++;
      r.parameters += s->numel;
      r.bytes_written += s->numel * static_cast<int64_t>(dtype_size(target));
    }
    w.write_streamed(
        out_dir / file,
        [&](const SafetensorsWriter::Append& append) {
          for (const Source* s : shards[i]) {
            if (s->file) {
              runs.append(append, *s->file, *s->info, target);
              continue;
            }
            runs.append(append, s->numel, target, [&](int64_t at, int64_t n, float* out) {
              read_piece(Segment{s->param->offset + at, n}, out);
            });
          }
        },
        &writing);
  }
  r.host_staging_bytes = runs.staging_bytes();
  writing.finish();
  if (shards.size() > 1)
    write_json(out_dir / "model.safetensors.index.json",
               json{{"metadata", {{"total_size", r.bytes_written}}}, {"weight_map", weight_map}});
  config_json["torch_dtype"] = r.dtype;
  write_json(out_dir / "config.json", config_json);
  copy_tokenizer_files(tokenizer_dir, out_dir);
  return r;
}

}  // namespace

static DType hf_export_dtype(const std::string& dtype, const std::string& torch_dtype, const std::string& config_path) {
  return dtype == "auto" ? dtype_from_torch_name(torch_dtype, config_path + ": field 'torch_dtype'")
                         : dtype_from_torch_name(dtype, "option --dtype");
}

ConvertReport export_hf(const fs::path& ckpt_dir, const fs::path& out_dir, const std::string& dtype,
                        int64_t max_shard_bytes, std::FILE* progress, bool overwrite) {
  if (max_shard_bytes <= 0) fail("option --max-shard-bytes: expected > 0, found ", max_shard_bytes);
  // What ships must be what training wrote: every file against the checkpoint's manifest first.
  if (const std::string problem = verify_checkpoint(ckpt_dir); !problem.empty())
    fail(ckpt_dir.string(), ": fails verification, nothing exported: ", problem);
  if (fs::exists(ckpt_dir / kAdapterConfigFile))
    fail(ckpt_dir.string(), ": is a LoRA checkpoint (adapters, no model weights): export base + adapters with "
         "`build/convert merge-lora`");
  json config_json = read_config_json(ckpt_dir);
  LlamaConfig config = LlamaConfig::from_json(config_json, (ckpt_dir / "config.json").string());
  ParamLayout layout(config);
  // The weights to export: straight from the mapped model.safetensors, or read from the rank files of a checkpoint
  // written by several ranks (ckpt/checkpoint.h), a bounded run of elements at a time: no copy of the model is
  // ever held on the host (a 70B model is 280 GB in fp32).
  std::vector<ExportSource> tensors;
  std::optional<HfCheckpointDir> src;
  std::optional<WeightReader> pieces;
  if (is_sharded_checkpoint(ckpt_dir)) {
    pieces.emplace(ckpt_dir, layout);
    for (const ParamTensor& t : layout.tensors()) tensors.push_back({&t, nullptr, nullptr, t.numel});
  } else {
    src.emplace(ckpt_dir);
    for (const SourceTensor& s : collect(*src, layout))
      tensors.push_back({s.param, s.entry.file, s.entry.info, s.entry.info->numel});
  }
  const DType target = hf_export_dtype(dtype, config.torch_dtype, (ckpt_dir / "config.json").string());
  make_out_dir(out_dir, ckpt_dir, overwrite);
  return write_hf_files(std::move(config_json), tensors,
                        [&](const Segment& piece, float* out) { pieces->read(piece, out); }, target, max_shard_bytes,
                        ckpt_dir, out_dir, progress);
}

ConvertReport export_hf_pieces(const json& config_json, const ParamLayout& layout,
                               const std::function<void(const Segment&, float*)>& read, const std::string& dtype,
                               int64_t max_shard_bytes, const fs::path& src_dir, const fs::path& tokenizer_dir,
                               const fs::path& out_dir, std::FILE* progress, bool overwrite) {
  if (max_shard_bytes <= 0) fail("option --max-shard-bytes: expected > 0, found ", max_shard_bytes);
  const LlamaConfig config = LlamaConfig::from_json(config_json, (src_dir / "config.json").string());
  const DType target = hf_export_dtype(dtype, config.torch_dtype, (src_dir / "config.json").string());
  make_out_dir(out_dir, src_dir, overwrite);
  std::vector<ExportSource> tensors;
  for (const ParamTensor& t : layout.tensors()) tensors.push_back({&t, nullptr, nullptr, t.numel});
  return write_hf_files(config_json, tensors, read, target, max_shard_bytes, tokenizer_dir, out_dir, progress);
}

}  // namespace tuna
