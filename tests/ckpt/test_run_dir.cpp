// The run directory's rules (ckpt/run_dir.h): an earlier run is continued, replaced or refused, never mixed;
// a resume truncates metrics.jsonl to its step and keeps the file as it was; the disk is checked at start.
// (tests/tools/test_train.cpp runs the same rules through build/train.)
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "ckpt/run_dir.h"
#include "comm/comm.h"  // make_single_comm: stop_at_safe_point
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::ScopedEnv;
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

// A resume with other options: the schedule's are a warning saying what changes at the resumed step.
TEST(RunDir, ChangedScheduleAtResumeIsAWarningThatSaysWhatChanges) {
  OptimizerConfig opt;
  opt.lr = 1e-3, opt.min_lr = 0, opt.warmup_steps = 0, opt.schedule = "cosine";
  const nlohmann::json saved = {{"steps", 100}, {"lr", 1e-3}, {"seed", 1}, {"resume", "false"}, {"threads", 2}};
  const nlohmann::json now = {{"steps", 200}, {"lr", 1e-3}, {"seed", 1}, {"resume", "true"}, {"threads", 4}};
  const std::vector<std::string> lines = resume_option_changes(saved, now, opt, 50);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], "note: option threads was 2 in the checkpoint, now 4");
  // Cosine at step 50: half way (5.000e-04) of 100 steps, a quarter (8.536e-04) of 200.
  EXPECT_NE(lines[1].find("warning: the learning-rate schedule changed at resume (steps 100 -> 200)"), std::string::npos)
      << lines[1];
  EXPECT_NE(lines[1].find("the rate at step 50 is 5.000e-04 before, 8.536e-04 now"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("now ends at step 200 instead of 100"), std::string::npos) << lines[1];
  EXPECT_TRUE(resume_option_changes(now, now, opt, 50).empty());
}

// A lock file as another holder would have left it.
void write_lock(const fs::path& out_dir, const LockHolder& h) {
  fs::create_directories(out_dir);
  std::ofstream(out_dir / kRunLockFile) << nlohmann::json{{"host", h.host}, {"boot_id", h.boot_id}, {"pid", h.pid},
                                                          {"job", h.job}, {"started", h.started},
                                                          {"heartbeat", h.heartbeat}}
                                               .dump();
}

int64_t dead_pid() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

double now_s() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

// These tests are not a requeued job, whatever launched them (the job ids come back at the test's end).
struct NoJobId : ScopedEnv {
  NoJobId() {
    for (const char* var : {"SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID"}) unset(var);
  }
};

// The names in a directory, sorted.
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(RunLock, ASecondRunIsRefusedNamingTheHolder) {
  const NoJobId no_job_id;
  TempDir tmp("runlock");
  const fs::path out = tmp / "run";
  std::vector<std::string> warnings;
  const auto warn = [&](const std::string& m) { warnings.push_back(m); };
  {
    RunLock first(out, warn);
    ASSERT_TRUE(fs::exists(out / kRunLockFile));
    const std::string e = error_of([&] { RunLock second(out, warn); });
    const LockHolder me = this_process_holder();
    EXPECT_NE(e.find(out.string() + " is in use by another run (host " + me.host + ", pid " + std::to_string(me.pid)),
              std::string::npos) << e;
    EXPECT_NE(e.find("choose another --out_dir"), std::string::npos) << e;
    EXPECT_TRUE(fs::exists(out / kRunLockFile));  // the refused one leaves the holder's lock alone
    EXPECT_FALSE(first.lost());
  }
  EXPECT_FALSE(fs::exists(out / kRunLockFile));  // released at the end of the run
  EXPECT_TRUE(warnings.empty());
  // Only the lock file remains in out_dir after a run: no temporary names.
  RunLock again(out, warn);
  EXPECT_EQ(names_in(out), std::vector<std::string>{kRunLockFile});
}

TEST(RunLock, AStaleLockIsTakenOverWithAWarning) {
  const NoJobId no_job_id;
  TempDir tmp("runlockstale");
  const fs::path out = tmp / "run";
  std::vector<std::string> warnings;
  const auto warn = [&](const std::string& m) { warnings.push_back(m); };
  // A dead holder on this host (kill -9 leaves its lock behind): taken over at once, fresh heartbeat or not.
  LockHolder dead = this_process_holder();
  dead.pid = dead_pid();
  write_lock(out, dead);
  { RunLock lock(out, warn); }
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("took over the lock of a run that is gone (host " + dead.host + ", pid " +
                             std::to_string(dead.pid)),
            std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("no such process on this host"), std::string::npos) << warnings[0];

  // Another host: alive as far as this one can tell while its heartbeat is fresh, taken over once it is old.
  LockHolder other = dead;
  other.host = "node-elsewhere", other.pid = 4242, other.job = "777", other.heartbeat = now_s() - 5;
  write_lock(out, other);
  const std::string e = error_of([&] { RunLock lock(out, warn, RunLock::Timing{10, 60, 0.05}); });
  EXPECT_NE(e.find("host node-elsewhere, pid 4242, job 777"), std::string::npos) << e;
  EXPECT_NE(e.find("heartbeat 5 s ago"), std::string::npos) << e;
  other.heartbeat = now_s() - 61;
  write_lock(out, other);
  { RunLock lock(out, warn, RunLock::Timing{10, 60, 0.05}); }
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[1].find("no heartbeat for more than 60 s"), std::string::npos) << warnings[1];
}

// A lock file that is not a lock (damaged, or not tuna's) says so, and follows its rule: refused while it was
// modified less than stale_s ago, taken over with a warning once older. A pid that is not a positive integer that
// fits pid_t makes a lock unreadable too (a float or 2^64 - 1 is no process; converting it would be undefined).
TEST(RunLock, AnUnreadableLockIsNamedAndFollowsItsRule) {
  const NoJobId no_job_id;
  TempDir tmp("runlockdamaged");
  const fs::path out = tmp / "run";
  fs::create_directories(out);
  std::vector<std::string> warnings;
  const auto warn = [&](const std::string& m) { warnings.push_back(m); };
  const LockHolder me = this_process_holder();
  const auto lock_with_pid = [&](const std::string& pid) {
    return "{\"format\": \"tuna run lock\", \"host\": \"" + me.host + "\", \"boot_id\": \"" + me.boot_id +
           "\", \"pid\": " + pid + ", \"job\": \"\", \"started\": " + std::to_string(now_s()) +
           ", \"heartbeat\": " + std::to_string(now_s()) + "}";
  };
  const std::vector<std::pair<std::string, std::string>> damaged = {
      {"", "empty"},
      {"{not json", "its content"},
      {"{}", "field 'host'"},
      {"[1, 2]", "expected a JSON object"},
      {std::string(70000, ' ') + "{}", "more than 65536 bytes"},
      {lock_with_pid("1e30"), "field 'pid'"},
      {lock_with_pid("-1e30"), "field 'pid'"},
      {lock_with_pid("9.3e18"), "field 'pid'"},
      {lock_with_pid("4.7"), "field 'pid'"},
      {lock_with_pid("0"), "field 'pid'"},
      {lock_with_pid("-1"), "field 'pid'"},
      {lock_with_pid("18446744073709551615"), "field 'pid'"},
      {lock_with_pid("4294967297"), "field 'pid'"},
      {lock_with_pid("\"42\""), "field 'pid'"},
  };
  for (const auto& [content, why] : damaged) {
    std::ofstream(out / kRunLockFile, std::ios::trunc) << content;
    const std::string e = error_of([&] { RunLock lock(out, warn, RunLock::Timing{10, 60, 0.05}); });
    EXPECT_EQ(e.rfind("unreadable lock file: " + (out / kRunLockFile).string() + ": ", 0), 0u) << e;
    EXPECT_NE(e.find(why), std::string::npos) << why << ": " << e;
    EXPECT_NE(e.find("taken over once it is older than 60 s"), std::string::npos) << e;
    EXPECT_NE(e.find("remove it and start again"), std::string::npos) << e;
    EXPECT_EQ(e.find("host unknown"), std::string::npos) << e;
    EXPECT_EQ(names_in(out), std::vector<std::string>{kRunLockFile}) << why;  // nothing of the refused run left
  }
  EXPECT_TRUE(warnings.empty());
  // Untouched for longer than stale_s: taken over, saying what it was.
  std::ofstream(out / kRunLockFile, std::ios::trunc) << lock_with_pid("4.7");
  fs::last_write_time(out / kRunLockFile, fs::file_time_type::clock::now() - std::chrono::seconds(61));
  { RunLock lock(out, warn, RunLock::Timing{10, 60, 0.05}); }
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0].rfind("took over an unreadable lock file: " + (out / kRunLockFile).string(), 0), 0u) << warnings[0];
  EXPECT_TRUE(names_in(out).empty());
}

// run.lock as something no run writes: refused at once, saying what it is and what to do, with nothing left behind
// (a dangling link once retried forever, a FIFO blocked the open, a link to /dev/zero was read without end).
TEST(RunLock, ALockThatIsNotARegularFileIsRefusedAtOnce) {
  const NoJobId no_job_id;
  TempDir tmp("runlockkinds");
  const fs::path out = tmp / "run";
  const fs::path lock = out / kRunLockFile;
  struct Kind {
    std::string name, says;
    std::function<void()> make;
  };
  const std::vector<Kind> kinds = {
      {"dangling symbolic link", "a symbolic link to '" + (tmp / "nowhere").string() + "'",
       [&] { fs::create_symlink(tmp / "nowhere", lock); }},
      {"symbolic link to a lock", "a symbolic link", [&] {
         write_lock(tmp / "elsewhere", this_process_holder());
         fs::create_symlink(tmp / "elsewhere" / kRunLockFile, lock);
       }},
      {"FIFO", "a FIFO (named pipe)", [&] { ASSERT_EQ(::mkfifo(lock.c_str(), 0644), 0); }},
      {"link to /dev/zero", "a symbolic link to '/dev/zero'", [&] { fs::create_symlink("/dev/zero", lock); }},
      {"directory", "a directory", [&] {
         fs::create_directories(lock);
         std::ofstream(lock / "inside") << "x";
       }},
  };
  for (const Kind& k : kinds) {
    SCOPED_TRACE(k.name);
    fs::remove_all(out);
    fs::create_directories(out);
    k.make();
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = error_of([&] { RunLock held(out, [](const std::string&) {}); });
    EXPECT_LT(seconds_since(t0), 5.0);
    EXPECT_EQ(e.rfind(lock.string() + " is " + k.says, 0), 0u) << e;
    EXPECT_NE(e.find("not a lock file"), std::string::npos) << e;
    EXPECT_NE(e.find("If no run uses " + out.string() + ", remove it and start again"), std::string::npos) << e;
    EXPECT_EQ(names_in(out), std::vector<std::string>{kRunLockFile});  // no .run.lock.* left, the thing untouched
  }
}

// A directory the run cannot write: named, with errno, not the hidden file the lock is first written to.
TEST(RunLock, AnUnwritableDirectoryIsNamedWithErrno) {
  TempDir tmp("runlockreadonly");
  const fs::path out = tmp / "run";
  fs::create_directories(out);
  fs::permissions(tmp.path, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  fs::permissions(out, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read | fs::perms::group_exec |
                           fs::perms::others_read | fs::perms::others_exec);
  // Root writes anywhere: the attempt runs in a child as an unprivileged user then.
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t child = fork();
  if (child == 0) {
    ::close(pipe_fds[0]);
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) _exit(2);
    const std::string e = error_of([&] { RunLock lock(out, [](const std::string&) {}); });
    (void)!::write(pipe_fds[1], e.data(), e.size());
    _exit(0);
  }
  ::close(pipe_fds[1]);
  std::string e;
  char buf[512];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) e.append(buf, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(e.rfind(out.string() + ": cannot write the run's lock file there: Permission denied (errno 13)", 0), 0u) << e;
  EXPECT_EQ(e.find(".run.lock"), std::string::npos) << e;
  EXPECT_TRUE(names_in(out).empty());
  fs::permissions(out, fs::perms::owner_all);
}

// The temporary lock files of holders that are gone are removed when the lock is taken; a live writer's are kept.
TEST(RunLock, LeftoversOfHoldersThatAreGoneAreRemoved) {
  const NoJobId no_job_id;
  TempDir tmp("runlockleftovers");
  const fs::path out = tmp / "run";
  fs::create_directories(out);
  const LockHolder me = this_process_holder();
  const std::string gone = std::to_string(dead_pid());
  const auto old = fs::file_time_type::clock::now() - std::chrono::seconds(3600);
  for (const std::string& name : std::vector<std::string>{".run.lock." + me.host + "." + gone,
                                                          ".run.lock.heartbeat." + me.host + "." + gone,
                                                          ".run.lock.stale.node-elsewhere.77",
                                                          ".run.lock.node-elsewhere.78", ".run.lock.node-elsewhere.79"}) {
    std::ofstream(out / name) << "{}";
    if (name.ends_with(".77") || name.ends_with(".78")) fs::last_write_time(out / name, old);
  }
  fs::create_directories(out / (".run.lock.stale." + me.host + "." + gone));  // a stale lock that was a directory
  LockHolder dead = me;
  dead.pid = std::stoll(gone);
  write_lock(out, dead);
  {
    RunLock lock(out, [](const std::string&) {});
    // Kept: another host's fresh file (a run taking the lock right now); everything of the dead holders is gone.
    EXPECT_EQ(names_in(out), (std::vector<std::string>{".run.lock.node-elsewhere.79", kRunLockFile}));
  }
}

TEST(RunLock, ARequeueOfTheSameJobWaitsForItsPreviousAttempt) {
  TempDir tmp("runlockrequeue");
  const fs::path out = tmp / "run";
  NoJobId job;
  job.set("SLURM_JOB_ID", "31337");
  std::vector<std::string> warnings;
  const auto warn = [&](const std::string& m) { warnings.push_back(m); };
  LockHolder previous = this_process_holder();
  ASSERT_EQ(previous.job, "31337");
  previous.host = "node-before-requeue", previous.heartbeat = now_s();
  write_lock(out, previous);
  const auto t0 = std::chrono::steady_clock::now();
  { RunLock lock(out, warn, RunLock::Timing{10, 1.0, 0.05}); }  // its heartbeat stops: taken over
  EXPECT_GE(seconds_since(t0), 0.9);
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find("held by an earlier attempt of job 31337"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[1].find("took over"), std::string::npos) << warnings[1];
}

// The heartbeat notices a takeover (or a removal, or a replacement) and only records it: the process goes on, and
// the trainer's next safe point stops the run (no thread but the caller's ends the process).
TEST(RunLock, TheHeartbeatRefreshesAndNoticesATakeOver) {
  const NoJobId no_job_id;
  TempDir tmp("runlockbeat");
  const fs::path out = tmp / "run";
  std::unique_ptr<Comm> world = make_single_comm();
  // The change made again until noticed: a refresh that read the lock just before it may rename its own over it.
  const auto wait_lost = [](const RunLock& lock, const std::function<void()>& change) {
    for (int i = 0; i < 1000 && !lock.lost(); i++) {
      if (i % 10 == 0) change();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return lock.lost();
  };
  {
    RunLock lock(out, [](const std::string&) {}, RunLock::Timing{0.05, 60, 0.05});
    const double first = nlohmann::json::parse(read_file(out / kRunLockFile))["heartbeat"].get<double>();
    double later = first;
    for (int i = 0; i < 500 && later == first; i++) {  // a loaded machine may run the thread late
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      later = nlohmann::json::parse(read_file(out / kRunLockFile))["heartbeat"].get<double>();
    }
    EXPECT_GT(later, first);
    EXPECT_EQ(stop_at_safe_point(*world, false, &lock), StopRequest::None);
    EXPECT_EQ(stop_at_safe_point(*world, true, &lock), StopRequest::Signal);
    LockHolder thief = this_process_holder();
    thief.host = "node-thief", thief.pid = 99;
    ASSERT_TRUE(wait_lost(lock, [&] { write_lock(out, thief); }));
    EXPECT_NE(lock.lost_reason().find("taken over by another run (host node-thief, pid 99"), std::string::npos)
        << lock.lost_reason();
    EXPECT_EQ(stop_at_safe_point(*world, true, &lock), StopRequest::LockLost);  // a lost lock wins over a signal
  }
  EXPECT_TRUE(fs::exists(out / kRunLockFile));  // the thief's lock is not removed by the run it displaced
  fs::remove(out / kRunLockFile);
  for (const bool fifo : {false, true}) {
    RunLock lock(out, [](const std::string&) {}, RunLock::Timing{0.05, 60, 0.05});
    ASSERT_TRUE(wait_lost(lock, [&] {
      fs::remove(out / kRunLockFile);
      if (fifo) ::mkfifo((out / kRunLockFile).c_str(), 0644);
    }));
    EXPECT_NE(lock.lost_reason().find(fifo ? "replaced by a FIFO" : "this run's lock was removed"), std::string::npos)
        << lock.lost_reason();
  }
  EXPECT_EQ(names_in(out), std::vector<std::string>{kRunLockFile});  // the FIFO, left as it was found
}

}  // namespace
}  // namespace tuna
