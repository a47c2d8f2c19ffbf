// The run directory of build/train (--out_dir): metrics.jsonl and ckpt/. What a new run, a resume and an
// overwrite do with what an earlier run left there, so that no run silently starts over, overwrites another
// run's checkpoints or mixes its log rows with another's; and the checks, at start, that the directory can
// take the run's checkpoints (so a full disk is found before the first hours of training, not at the first
// checkpoint).
//
//   out_dir/metrics.jsonl                              one JSON object per line, each with its "step"
//   out_dir/metrics.before_resume_step_NNNNNNNN.jsonl  the rows a resume dropped (the killed segment's)
//   out_dir/ckpt/step_NNNNNNNN/ ... and ckpt/latest    (ckpt/checkpoint.h)
//
// An "earlier run" is what build/train writes: a non-empty metrics.jsonl or anything under ckpt/. Other files
// in out_dir (a run.toml, the prepared data) are not a run and are never touched.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "model/optimizer.h"  // OptimizerConfig, learning_rate

namespace tuna {

class Comm;  // comm/comm.h

// One run per out_dir: out_dir/run.lock, held by rank 0 for the run's life. A lock file, not flock(), because
// flock does not hold across the nodes of every shared filesystem; it is created by link(2), which is atomic on
// NFS too. It names its holder (host, boot id, pid, the job id of Slurm, PBS, LSF or Flux, the start time) and
// carries a heartbeat (unix seconds) that a thread rewrites every heartbeat_s. A second run is refused naming
// the holder; a stale lock is taken over with a warning: its holder is dead (same host and boot, no such pid),
// or its heartbeat is older than stale_s (compared with this node's clock: nodes are assumed NTP-synced). A
// requeue of the same job finding its previous attempt's fresh lock waits up to stale_s for it to go, since
// the old allocation may still be stopping.
//
// What run.lock may be, and what each is taken for:
//  - a lock tuna wrote: its holder, as above;
//  - anything but a regular file (a symbolic link, even to a lock; a FIFO, a device, a socket, a directory):
//    refused at once naming what it is and saying to remove it; tuna never makes one, and reading it could
//    block (a FIFO), never end (/dev/zero) or follow a link out of out_dir. Opened O_NOFOLLOW | O_NONBLOCK;
//  - an "unreadable lock file": a regular file that is not a lock (empty, not JSON, over 64 KiB, a field missing
//    or of another type, a pid that is not a positive integer that fits pid_t). tuna writes a lock whole before
//    it links it into place, so a live run's lock always reads: an unreadable one is damaged or foreign. The rule:
//    it is refused while it was modified less than stale_s ago, and taken over with a warning once older.
// The lock loop makes a bounded number of attempts within a deadline (a requeue's wait plus a margin), so a lock
// that keeps changing ends in an error, never a hang. At every acquisition the temporary files of holders that
// are gone (.run.lock.<host>.<pid>, .run.lock.heartbeat.*, .run.lock.stale.*: dead on this host, or untouched
// for stale_s) are removed; on every failure this process's own are. A directory it cannot write is an error
// naming the directory and errno.
//
// The heartbeat thread re-reads the lock before each refresh; if another run has taken it (it judged this one
// dead), or it was removed or replaced, the lock is `lost()`: the thread stops and says nothing, and the trainer
// notices at its next safe point (stop_at_safe_point). No thread but the caller's ever ends the process. Released
// (the file removed, if still this holder's) by the destructor.
struct LockHolder {
  std::string host, boot_id, job;
  int64_t pid = 0;
  double started = 0, heartbeat = 0;  // unix seconds
  std::string describe(double now) const;  // "host node7, pid 4242, job 1234, heartbeat 12 s ago"
};
LockHolder this_process_holder();
class RunLock {
 public:
  struct Timing {
    double heartbeat_s = 10, stale_s = 120, poll_s = 2;
  };
  // Acquires out_dir/run.lock (creating out_dir), or fails naming the holder. `warn` gets the take-over.
  RunLock(const std::filesystem::path& out_dir, const std::function<void(const std::string&)>& warn, Timing timing);
  RunLock(const std::filesystem::path& out_dir, const std::function<void(const std::string&)>& warn)
      : RunLock(out_dir, warn, Timing{}) {}
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  const std::filesystem::path& path() const { return path_; }
  // Whether the heartbeat found the lock taken over, removed or replaced; why, naming the new holder.
  bool lost() const { return lost_.load(); }
  std::string lost_reason() const;

 private:
  void acquire(const std::function<void(const std::string&)>& warn);
  void heartbeat_loop();
  std::filesystem::path path_;
  LockHolder me_;
  Timing timing_;
  std::atomic<bool> lost_{false};
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::string lost_reason_;  // guarded by mutex_
  std::thread thread_;
};
inline constexpr const char* kRunLockFile = "run.lock";

// build/train (collective): rank 0 takes the lock, and a refusal there is an error on every rank. Other ranks
// get null. The heartbeat's period comes from TUNA_LOCK_HEARTBEAT_S when set (the tests' way to see a takeover
// within a second; 10 s otherwise).
std::unique_ptr<RunLock> lock_run_dir(const std::filesystem::path& out_dir, Comm& world,
                                      const std::function<void(const std::string&)>& warn);

// Why the trainer stops at a safe point (the end of a step, before a checkpoint), agreed by every rank
// (collective): a stop signal seen by any rank, or the run directory's lock lost on rank 0. A lost lock wins: rank
// 0 prints "error: ..." naming the new holder, and the run ends at once with kLockLostExitCode, writing nothing
// more into out_dir (no checkpoint, no validation, no end row: the directory is another run's now).
enum class StopRequest { None, Signal, LockLost };
StopRequest stop_at_safe_point(Comm& world, bool signal_seen, const RunLock* lock);
// EX_CANTCREAT (sysexits.h): this run can no longer write its output. Not 75 (EX_TEMPFAIL), which asks a job
// script to requeue: another run owns out_dir now.
inline constexpr int kLockLostExitCode = 73;

// --resume: false (a new run), true (continue; fail when there is nothing to continue), auto (continue when
// there is a checkpoint, else a new run: what a job script that is requeued after preemption wants).
enum class ResumeMode { Never, Required, Auto };
ResumeMode parse_resume_mode(const std::string& text);  // "false" | "true" | "auto"

// What an earlier run left in out_dir.
struct PreviousRun {
  int64_t metrics_rows = 0;     // lines of metrics.jsonl
  int64_t checkpoints = 0;      // complete step_* directories under ckpt/
  int64_t newest_step = -1;     // the newest of them; -1: none
  bool ckpt_has_files = false;  // anything under ckpt/ (an unfinished .tmp-step_* counts)
  bool any() const { return metrics_rows > 0 || ckpt_has_files; }
  std::string describe() const;  // "metrics.jsonl with 104 rows, 2 checkpoints up to step 80"
};
PreviousRun inspect_run_dir(const std::filesystem::path& out_dir);

// The checkpoint this run continues from, or none: a new run. Fails with what to do instead when out_dir holds
// an earlier run and neither --resume nor --overwrite was given, when --resume (true) finds no complete
// checkpoint, and when --overwrite is given with --resume. Only reads, so every rank can call it.
std::optional<std::filesystem::path> choose_resume_checkpoint(const std::filesystem::path& out_dir, ResumeMode mode,
                                                              bool overwrite);

// build/train's start on every rank of `world` (collective): the rules of choose_resume_checkpoint applied to
// what every rank saw BEFORE rank 0 changes anything (--overwrite deletes the earlier run, rank 0 creates
// out_dir and, later, metrics.jsonl), so that a slower rank never takes rank 0's new files for an earlier run;
// a refusal on any rank is an error on every rank. Then, when any rank found a checkpoint, the newest one that
// verifies on every rank (resume_checkpoint, ckpt/checkpoint.h). Every rank gets the same answer or an error,
// whatever its view of a shared filesystem. `say` gets what rank 0 did (the deletion), `warn` the checkpoints
// skipped.
std::optional<std::filesystem::path> open_run_dir(const std::filesystem::path& out_dir, ResumeMode mode,
                                                  bool overwrite, Comm& world,
                                                  const std::function<void(const std::string&)>& say,
                                                  const std::function<void(const std::string&)>& warn);

// On resume: what differs between the checkpoint's saved options (state.json's train_config) and this run's,
// one line each (the options --resume and --stop_at_step are expected to differ and are skipped). A change of the
// learning-rate schedule (steps, lr, min_lr, warmup_steps, schedule, decay_fraction) is a "warning:" saying what
// it does at the resumed step (the rate there before and now, and where the schedule now ends); the others are
// "note:" lines.
std::vector<std::string> resume_option_changes(const nlohmann::json& saved, const nlohmann::json& now,
                                               const OptimizerConfig& opt, int64_t step);

// --overwrite (rank 0): deletes what an earlier run wrote (ckpt/, metrics.jsonl and its resume backups);
// returns what was there.
PreviousRun remove_previous_run(const std::filesystem::path& out_dir);

// On resume (rank 0): metrics.jsonl keeps the rows of steps up to the resumed step (all of them, validation
// rows included, when resumed_step > 0; none for a new start at step 0, which logs step 0 again) and drops the
// rest (the rows the killed segment logged after its last checkpoint, and a torn last line). Dropped rows
// are kept in metrics.before_resume_step_NNNNNNNN.jsonl beside it (the whole file before truncation); the new
// file replaces the old by rename, so a crash leaves one or the other whole.
struct MetricsTruncation {
  int64_t kept = 0, dropped = 0;
  std::filesystem::path backup;  // empty when nothing was dropped
};
MetricsTruncation truncate_metrics(const std::filesystem::path& metrics_path, int64_t resumed_step);

// metrics.jsonl as the trainer appends to it: one line per record, flushed, and a failed write (disk full,
// a vanished mount) is an error naming the file instead of a log that silently stops. Closed (on ranks other
// than 0), write() does nothing.
class MetricsLog {
 public:
  MetricsLog() = default;
  void open(const std::filesystem::path& path);  // appends
  void write(const nlohmann::json& record);

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

// How many checkpoints a run from first_step to last_step writes: one every ckpt_every steps (0: none) before
// last_step, and one at the end (a resumed run that has nothing left to do writes none).
int64_t checkpoints_to_write(int64_t first_step, int64_t last_step, int64_t ckpt_every, bool resumed);

// At start (rank 0): proves ckpt_root writable (a probe file written, fsynced and removed) and checks its
// filesystem's free space against the checkpoints this run will have on disk at once: `to_write` more of
// `checkpoint_bytes` each, the oldest pruned beyond keep_last (0 keeps all) after each is written. Fails
// when not even one checkpoint fits; returns a warning (empty: none) when the first fits but the peak does not.
std::string check_checkpoint_space(const std::filesystem::path& ckpt_root, int64_t checkpoint_bytes,
                                   int64_t to_write, int64_t keep_last);

}  // namespace tuna
