// Writing checkpoints (ckpt/checkpoint.h): each rank's shard, then one rank's manifest, rename and rotation; a
// write is a temporary directory made whole, fsynced and renamed, so a kill leaves the previous checkpoint in place.
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



namespace {

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

}  // namespace tuna
