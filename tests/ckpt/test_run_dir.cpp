// The run directory's rules (ckpt/run_dir.h): an earlier run is continued, replaced or refused, never mixed;
// a resume truncates metrics.jsonl to its step and keeps the file as it was; the disk is checked at start.
// (tests/tools/test_train.cpp runs the same rules through build/train.)
#include <gtest/gtest.h>

#include <sys/statvfs.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "core/error.h"
#include "ckpt/run_dir.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::TempDir;

using testing_util::error_of;

// A complete checkpoint directory as list_checkpoints recognizes it (state.json marks completeness).
void fake_checkpoint(const fs::path& out_dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", (long long)step);
  fs::create_directories(out_dir / "ckpt" / name);
  std::ofstream(out_dir / "ckpt" / name / "state.json") << "{\"step\": " << step << "}\n";
}

TEST(RunDir, ResumeModes) {
  EXPECT_EQ(parse_resume_mode("false"), ResumeMode::Never);
  EXPECT_EQ(parse_resume_mode("true"), ResumeMode::Required);
  EXPECT_EQ(parse_resume_mode("auto"), ResumeMode::Auto);
  EXPECT_NE(error_of([] { parse_resume_mode("yes please"); }).find("expected false, true or auto"), std::string::npos);
}

TEST(RunDir, AnEarlierRunIsContinuedReplacedOrRefused) {
  TempDir tmp("rundir");
  const fs::path out = tmp / "run";
  // Nothing there (or only files that are not a run): a new run; --resume has nothing to continue.
  EXPECT_EQ(choose_resume_checkpoint(out, ResumeMode::Never, false), std::nullopt);
  fs::create_directories(out / "data");
  std::ofstream(out / "run.toml") << "steps = 3\n";
  EXPECT_EQ(choose_resume_checkpoint(out, ResumeMode::Never, false), std::nullopt);
  EXPECT_EQ(choose_resume_checkpoint(out, ResumeMode::Auto, false), std::nullopt);
  std::string e = error_of([&] { choose_resume_checkpoint(out, ResumeMode::Required, false); });
  EXPECT_NE(e.find("no complete checkpoint to resume from in " + (out / "ckpt").string()), std::string::npos) << e;
  EXPECT_NE(e.find("--resume auto"), std::string::npos) << e;

  // A run that died before its first checkpoint: rows but no checkpoint.
  std::ofstream(out / "metrics.jsonl") << "{\"step\": 1, \"loss\": 5}\n{\"step\": 2, \"loss\": 4}\n";
  e = error_of([&] { choose_resume_checkpoint(out, ResumeMode::Never, false); });
  EXPECT_NE(e.find("holds an earlier run (metrics.jsonl with 2 rows)"), std::string::npos) << e;
  EXPECT_NE(e.find("--resume"), std::string::npos) << e;
  EXPECT_NE(e.find("--overwrite"), std::string::npos) << e;
  EXPECT_EQ(choose_resume_checkpoint(out, ResumeMode::Auto, false), std::nullopt);
  e = error_of([&] { choose_resume_checkpoint(out, ResumeMode::Required, false); });
  EXPECT_NE(e.find("metrics.jsonl with 2 rows"), std::string::npos) << e;

  // With checkpoints: the newest complete one; an unfinished one is not taken.
  fake_checkpoint(out, 5);
  fake_checkpoint(out, 10);
  fs::create_directories(out / "ckpt" / ".tmp-step_00000015");
  EXPECT_EQ(choose_resume_checkpoint(out, ResumeMode::Required, false), out / "ckpt" / "step_00000010");
  EXPECT_EQ(choose_resume_checkpoint(out, ResumeMode::Auto, false), out / "ckpt" / "step_00000010");
  e = error_of([&] { choose_resume_checkpoint(out, ResumeMode::Never, false); });
  EXPECT_NE(e.find("2 checkpoints up to step 10"), std::string::npos) << e;
  e = error_of([&] { choose_resume_checkpoint(out, ResumeMode::Auto, true); });
  EXPECT_NE(e.find("contradict"), std::string::npos) << e;

  // --overwrite: a new run, after deleting what the earlier one wrote and nothing else.
  EXPECT_EQ(choose_resume_checkpoint(out, ResumeMode::Never, true), std::nullopt);
  std::ofstream(out / "metrics.before_resume_step_00000005.jsonl") << "{}\n";
  const PreviousRun removed = remove_previous_run(out);
  EXPECT_EQ(removed.checkpoints, 2);
  EXPECT_EQ(removed.metrics_rows, 2);
  EXPECT_FALSE(inspect_run_dir(out).any());
  EXPECT_FALSE(fs::exists(out / "ckpt"));
  EXPECT_FALSE(fs::exists(out / "metrics.jsonl"));
  EXPECT_FALSE(fs::exists(out / "metrics.before_resume_step_00000005.jsonl"));
  EXPECT_TRUE(fs::exists(out / "run.toml"));
  EXPECT_TRUE(fs::exists(out / "data"));
}

TEST(RunDir, ResumeTruncatesMetricsToItsStepAndKeepsABackup) {
  TempDir tmp("metrics");
  const fs::path m = tmp / "metrics.jsonl";
  const std::string rows =
      "{\"step\": 0, \"val_loss\": 6}\n{\"step\": 1, \"loss\": 5}\n{\"step\": 2, \"loss\": 4}\n{\"step\": 2, \"val_loss\": 4.5}\n"
      "{\"step\": 3, \"loss\": 3}\n{\"step\": 4, \"loss\": 2}\n{\"step\": 5, \"lo";  // killed mid-write
  std::ofstream(m) << rows;
  MetricsTruncation t = truncate_metrics(m, 2);
  EXPECT_EQ(t.kept, 4);
  EXPECT_EQ(t.dropped, 3);
  EXPECT_EQ(t.backup, tmp / "metrics.before_resume_step_00000002.jsonl");
  EXPECT_EQ(read_file(m), "{\"step\": 0, \"val_loss\": 6}\n{\"step\": 1, \"loss\": 5}\n{\"step\": 2, \"loss\": 4}\n"
                          "{\"step\": 2, \"val_loss\": 4.5}\n");
  EXPECT_EQ(read_file(t.backup), rows);
  EXPECT_FALSE(fs::exists(tmp / "metrics.jsonl.tmp"));

  // Nothing to drop: no backup, the file untouched.
  t = truncate_metrics(m, 2);
  EXPECT_EQ(t.dropped, 0);
  EXPECT_TRUE(t.backup.empty());
  // A new start (step 0) keeps nothing: it logs its step 0 again.
  t = truncate_metrics(m, 0);
  EXPECT_EQ(t.kept, 0);
  EXPECT_EQ(t.dropped, 4);
  EXPECT_EQ(read_file(m), "");
  // No metrics.jsonl yet: nothing to do.
  EXPECT_EQ(truncate_metrics(tmp / "none.jsonl", 3).dropped, 0);
}

TEST(RunDir, MetricsLogFailsWhenAWriteFails) {
  MetricsLog closed;
  closed.write({{"step", 1}});  // ranks other than 0: nothing
  MetricsLog full;
  full.open("/dev/full");  // every write fails with ENOSPC
  const std::string e = error_of([&] { full.write({{"step", 1}, {"loss", 2.0}}); });
  EXPECT_NE(e.find("/dev/full: write failed (disk full"), std::string::npos) << e;
}

TEST(RunDir, CheckpointsToWrite) {
  EXPECT_EQ(checkpoints_to_write(0, 20, 5, false), 4);   // 5, 10, 15 and the end
  EXPECT_EQ(checkpoints_to_write(0, 20, 0, false), 1);   // the end only
  EXPECT_EQ(checkpoints_to_write(7, 20, 5, true), 3);    // 10, 15, 20
  EXPECT_EQ(checkpoints_to_write(20, 20, 5, true), 0);   // a finished run resumed: nothing
  EXPECT_EQ(checkpoints_to_write(0, 0, 5, false), 1);    // steps 0: the starting point
}

TEST(RunDir, DiskIsCheckedAtStart) {
  TempDir tmp("space");
  struct statvfs st {};
  ASSERT_EQ(::statvfs(tmp.path.c_str(), &st), 0);
  const int64_t free_bytes = static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
  // One checkpoint does not fit: an error naming the directory and both sizes.
  std::string e = error_of([&] { check_checkpoint_space(tmp / "ckpt", 4 * free_bytes, 1, 3); });
  EXPECT_NE(e.find((tmp / "ckpt").string()), std::string::npos) << e;
  EXPECT_NE(e.find("free on its filesystem, and one checkpoint of this model takes"), std::string::npos) << e;
  // One fits, the peak (keep 2: 3 on disk at once) does not: a warning.
  const std::string w = check_checkpoint_space(tmp / "ckpt", free_bytes / 2, 10, 2);
  EXPECT_NE(w.find("3 of"), std::string::npos) << w;
  EXPECT_NE(w.find("a later checkpoint will fail"), std::string::npos) << w;
  EXPECT_EQ(check_checkpoint_space(tmp / "ckpt", 1 << 20, 10, 2), "");
  EXPECT_TRUE(fs::is_directory(tmp / "ckpt"));
  EXPECT_TRUE(fs::is_empty(tmp / "ckpt"));  // the probe is gone
  // A checkpoint directory that cannot be created is found now, not at the first checkpoint.
  std::ofstream(tmp / "file") << "x";
  e = error_of([&] { check_checkpoint_space(tmp / "file" / "ckpt", 1 << 20, 1, 2); });
  EXPECT_NE(e.find("cannot create the checkpoint directory"), std::string::npos) << e;
}

}  // namespace
}  // namespace tuna
