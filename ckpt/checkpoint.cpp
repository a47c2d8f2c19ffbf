// Finding, verifying and resuming checkpoints (ckpt/checkpoint.h): the step directories of a run, their state.json,
// the manifest check every reader of a checkpoint or model directory makes, and what a resume restores besides the
// tensors. Reading the tensors: tensor_reader.cpp; writing: checkpoint_writer.cpp.
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
#include "ckpt/tensor_reader.h"  // kMaxStep

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;
using ckpt_files::kLatestLink;
using ckpt_files::kMaxStep;

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
  if (files == ModelFiles::Tokenizer) return !name.ends_with(".safetensors");  // config.json, tokenizer files
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

}  // namespace tuna
