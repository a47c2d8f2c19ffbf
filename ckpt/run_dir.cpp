// The run directory: see run_dir.h for the rules.
#include "ckpt/run_dir.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/error.h"
#include "core/progress.h"  // periodic_events_left
#include "comm/comm.h"      // Comm: open_run_dir agrees over the ranks
#include "ckpt/checkpoint.h"  // list_checkpoints, fsync_path, write_text_file

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kMetricsFile = "metrics.jsonl";
constexpr const char* kMetricsBackupPrefix = "metrics.before_resume_";


std::string megabytes(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  return buf;
}

int64_t count_lines(const fs::path& p) {
  std::ifstream in(p);
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

}  // namespace

ResumeMode parse_resume_mode(const std::string& text) {
  if (text == "false") return ResumeMode::Never;
  if (text == "true") return ResumeMode::Required;
  if (text == "auto") return ResumeMode::Auto;
  fail("option 'resume': expected false, true or auto, found '", text, "'");
}

std::string PreviousRun::describe() const {
  std::ostringstream s;
  if (metrics_rows > 0) s << kMetricsFile << " with " << metrics_rows << " rows";
  if (checkpoints > 0)
    s << (metrics_rows > 0 ? ", " : "") << checkpoints << " checkpoint" << (checkpoints > 1 ? "s" : "") << " up to step "
      << newest_step;
  else if (ckpt_has_files)
    s << (metrics_rows > 0 ? ", " : "") << "no complete checkpoint (ckpt/ holds only unfinished files)";
  return s.str();
}

PreviousRun inspect_run_dir(const fs::path& out_dir) {
  PreviousRun r;
  std::error_code ec;
  if (fs::is_regular_file(out_dir / kMetricsFile, ec)) r.metrics_rows = count_lines(out_dir / kMetricsFile);
  const fs::path ckpt = out_dir / "ckpt";
  if (fs::is_directory(ckpt, ec)) {
    r.ckpt_has_files = fs::directory_iterator(ckpt, ec) != fs::directory_iterator();
    const auto all = list_checkpoints(ckpt);
    r.checkpoints = static_cast<int64_t>(all.size());
    if (!all.empty()) r.newest_step = checkpoint_step(all.back());
  }
  return r;
}

std::optional<fs::path> choose_resume_checkpoint(const fs::path& out_dir, ResumeMode mode, bool overwrite) {
  if (overwrite && mode != ResumeMode::Never)
    fail("options 'resume' and 'overwrite' contradict each other: --resume continues the run in ", out_dir.string(),
         ", --overwrite deletes it; give one");
  const PreviousRun previous = inspect_run_dir(out_dir);
  const fs::path ckpt = out_dir / "ckpt";
  if (mode == ResumeMode::Never) {
    if (previous.any() && !overwrite)
      fail(out_dir.string(), " holds an earlier run (", previous.describe(),
           "): --resume to continue it, --overwrite to delete it and start again, or another --out_dir");
    return std::nullopt;
  }
  std::optional<fs::path> newest = latest_checkpoint(ckpt);
  if (!newest && mode == ResumeMode::Required)
    fail("--resume: no complete checkpoint to resume from in ", ckpt.string(),
         previous.any() ? str(" (", out_dir.string(), " holds ", previous.describe(), ")") : std::string(),
         "; without --resume the run starts from --init or from scratch, and --resume auto starts a new run when "
         "there is no checkpoint");
  return newest;
}

std::optional<fs::path> open_run_dir(const fs::path& out_dir, ResumeMode mode, bool overwrite, Comm& world,
                                     const std::function<void(const std::string&)>& say,
                                     const std::function<void(const std::string&)>& warn) {
  std::string refusal;
  std::optional<fs::path> newest;
  try {
    newest = choose_resume_checkpoint(out_dir, mode, overwrite);
  } catch (const Error& e) {
    refusal = e.what();
  }
  // [ranks that refused, ranks that found a checkpoint]: after this, every rank has looked.
  int64_t seen[2] = {refusal.empty() ? 0 : 1, newest ? 1 : 0};
  world.all_reduce_sum(seen, 2, "run directory inspected");
  if (seen[0] > 0)
    fail(refusal.empty() ? str(out_dir.string(), ": refused on ", seen[0], " other rank(s), whose view of the directory "
                                                 "differs from this one's (see their message)")
                         : refusal);
  if (world.rank() == 0) {
    if (overwrite && inspect_run_dir(out_dir).any())
      say(str("--overwrite: deleted the earlier run in ", out_dir.string(), " (", remove_previous_run(out_dir).describe(), ")"));
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    if (ec) fail(out_dir.string(), ": cannot create the run directory: ", ec.message());
  }
  world.barrier("run directory ready");
  if (seen[1] == 0) return std::nullopt;
  return resume_checkpoint(out_dir / "ckpt", world, warn);
}

PreviousRun remove_previous_run(const fs::path& out_dir) {
  const PreviousRun previous = inspect_run_dir(out_dir);
  std::error_code ec;
  fs::remove_all(out_dir / "ckpt", ec);
  if (ec) fail((out_dir / "ckpt").string(), ": cannot delete the earlier run's checkpoints (--overwrite): ", ec.message());
  if (fs::is_directory(out_dir, ec))
    for (const fs::directory_entry& e : fs::directory_iterator(out_dir)) {
      const std::string name = e.path().filename().string();
      if (name == kMetricsFile || (name.rfind(kMetricsBackupPrefix, 0) == 0 && e.path().extension() == ".jsonl")) {
        fs::remove(e.path(), ec);
        if (ec) fail(e.path().string(), ": cannot delete (--overwrite): ", ec.message());
      }
    }
  return previous;
}

MetricsTruncation truncate_metrics(const fs::path& metrics_path, int64_t resumed_step) {
  MetricsTruncation t;
  std::error_code ec;
  if (!fs::exists(metrics_path, ec)) return t;
  if (!fs::is_regular_file(metrics_path, ec)) fail(metrics_path.string(), ": not a regular file");
  std::string kept;
  {
    std::ifstream in(metrics_path, std::ios::binary);
    if (!in) fail(metrics_path.string(), ": cannot open to truncate it to the resumed step");
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      bool keep = false;
      if (resumed_step > 0) {  // a torn or foreign line is dropped with the killed segment
        const json row = json::parse(line, nullptr, /*allow_exceptions=*/false);
        keep = row.is_object() && row.contains("step") && row["step"].is_number_integer() &&
               row["step"].get<int64_t>() <= resumed_step;
      }
      (keep ? t.kept : t.dropped)++;
      if (keep) kept += line + "\n";
    }
  }
  if (t.dropped == 0) return t;
  t.backup = metrics_path.parent_path() / (kMetricsBackupPrefix + step_dir_name(resumed_step) + ".jsonl");
  fs::copy_file(metrics_path, t.backup, fs::copy_options::overwrite_existing, ec);
  if (ec) fail(t.backup.string(), ": cannot back up ", metrics_path.string(), " before truncating it: ", ec.message());
  fsync_path(t.backup, /*directory=*/false);
  const fs::path tmp = metrics_path.string() + ".tmp";
  write_text_file(tmp, kept);
  fs::rename(tmp, metrics_path, ec);
  if (ec) fail(metrics_path.string(), ": cannot replace it with its truncated copy: ", ec.message());
  fsync_path(metrics_path.parent_path().empty() ? fs::path(".") : metrics_path.parent_path(), /*directory=*/true);
  return t;
}

void MetricsLog::open(const fs::path& path) {
  path_ = path;
  out_.open(path, std::ios::app);
  if (!out_) fail(path.string(), ": cannot open for writing");
}

void MetricsLog::write(const json& record) {
  if (!out_.is_open()) return;
  out_ << record.dump() << "\n";
  out_.flush();
  if (!out_) fail(path_.string(), ": write failed (disk full, or the filesystem went away?)");
}

int64_t checkpoints_to_write(int64_t first_step, int64_t last_step, int64_t ckpt_every, bool resumed) {
  // A new run that has no step to take still writes its starting point.
  return periodic_events_left(first_step, last_step, ckpt_every) + (last_step <= first_step && !resumed ? 1 : 0);
}

std::string check_checkpoint_space(const fs::path& ckpt_root, int64_t checkpoint_bytes, int64_t to_write,
                                   int64_t keep_last) {
  if (to_write <= 0) return "";
  std::error_code ec;
  fs::create_directories(ckpt_root, ec);
  if (ec) fail(ckpt_root.string(), ": cannot create the checkpoint directory: ", ec.message());
  const fs::path probe = ckpt_root / ".write-probe";
  write_text_file(probe, "tuna checks at start that checkpoints can be written here\n");
  fs::remove(probe, ec);

  struct statvfs fs_stat {};
  if (::statvfs(ckpt_root.c_str(), &fs_stat) != 0) return "";  // unknown: the writes will tell
  const int64_t free_bytes = static_cast<int64_t>(fs_stat.f_bavail) * static_cast<int64_t>(fs_stat.f_frsize);
  if (free_bytes < checkpoint_bytes)
    fail(ckpt_root.string(), ": ", megabytes(free_bytes), " free on its filesystem, and one checkpoint of this model takes ",
         megabytes(checkpoint_bytes), ": free some space or choose another --out_dir");
  // On disk at once: the existing ones (pruned down to keep_last after each save) plus the one being written.
  const int64_t existing = static_cast<int64_t>(list_checkpoints(ckpt_root).size());
  const int64_t peak = keep_last > 0 ? std::min(existing + to_write - 1, keep_last) + 1 : existing + to_write;
  const int64_t more = std::max<int64_t>(1, peak - existing);
  if (free_bytes >= more * checkpoint_bytes) return "";
  return str(ckpt_root.string(), ": ", megabytes(free_bytes), " free, but this run will need up to ",
             megabytes(more * checkpoint_bytes), " more for its checkpoints (", more, " of ", megabytes(checkpoint_bytes),
             " at once, with ckpt_keep ", keep_last, "): a later checkpoint will fail unless space is freed");
}

}  // namespace tuna
