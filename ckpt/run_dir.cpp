// The run directory: see run_dir.h for the rules.
#include "ckpt/run_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <limits>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sstream>

#include "core/error.h"
#include "core/file.h"      // file_type_name
#include "core/json.h"      // parse_json
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

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string utc_time(double unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(std::clamp(unix_seconds, 0.0, 1e11));  // a damaged file's value too
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

json holder_json(const LockHolder& h) {
  return {{"format", "tuna run lock"}, {"host", h.host}, {"boot_id", h.boot_id}, {"pid", h.pid},
          {"job", h.job},              {"started", h.started}, {"heartbeat", h.heartbeat}};
}

// tuna's locks are about 250 bytes: a bound that no lock reaches, and that no file makes this reader exceed.
constexpr int64_t kLockBytes = 64 << 10;
// Lock attempts that do not wait (the lock released, taken over or put back in between): a lock that keeps
// changing this often is a fault, not a race between runs.
constexpr int kLockAttempts = 100;

std::string errno_text(int err) { return str(std::strerror(err), " (errno ", err, ")"); }

// What run.lock is, as read without following a symbolic link, without blocking, and at most kLockBytes.
struct LockRead {
  bool exists = false;
  std::optional<LockHolder> holder;  // a lock tuna can read
  std::string kind;                  // not a regular file: "a FIFO (named pipe)", "a symbolic link to 'x'", ...
  std::string problem;               // a regular file that is not a lock: why ("unreadable lock file: ...")
  double modified = 0;               // the file's modification time, unix seconds
};

std::string link_target(const fs::path& p) {
  std::error_code ec;
  const fs::path target = fs::read_symlink(p, ec);
  return ec ? std::string("a symbolic link") : str("a symbolic link to '", target.string(), "'");
}

// The holder a lock's JSON names: every field present with its type, and a pid that is a positive integer that
// fits pid_t (a float, a negative number or 2^64 - 1 is no process: converting it would be undefined).
LockHolder parse_holder(const std::string& text) {
  const json j = parse_json(text, "its content");
  if (!j.is_object()) fail("expected a JSON object, found ", j.type_name());
  LockHolder h;
  const auto text_field = [&](const char* key, std::string& out) {
    if (!j.contains(key) || !j[key].is_string()) fail("field '", key, "': expected a string, found ", j.contains(key) ? j[key].dump() : "nothing");
    out = j[key].get<std::string>();
  };
  const auto time_field = [&](const char* key, double& out) {
    if (!j.contains(key) || !j[key].is_number() || !std::isfinite(j[key].get<double>()))
      fail("field '", key, "': expected unix seconds, found ", j.contains(key) ? j[key].dump() : "nothing");
    out = j[key].get<double>();
  };
  text_field("host", h.host);
  text_field("boot_id", h.boot_id);
  text_field("job", h.job);
  if (h.host.empty()) fail("field 'host' is empty");
  const json pid = j.value("pid", json());
  constexpr int64_t kMaxPid = std::numeric_limits<pid_t>::max();
  const bool valid_pid = pid.is_number_unsigned()  ? pid.get<uint64_t>() >= 1 && pid.get<uint64_t>() <= uint64_t(kMaxPid)
                         : pid.is_number_integer() ? pid.get<int64_t>() >= 1 && pid.get<int64_t>() <= kMaxPid
                                                   : false;
  if (!valid_pid) fail("field 'pid': expected a process id (an integer in [1, ", kMaxPid, "]), found ", pid.dump());
  h.pid = pid.get<int64_t>();
  time_field("started", h.started);
  time_field("heartbeat", h.heartbeat);
  return h;
}

LockRead read_lock(const fs::path& p) {
  LockRead r;
  // O_NOFOLLOW: a symbolic link is never followed (out of out_dir, to /dev/zero); O_NONBLOCK: a FIFO's open
  // returns at once instead of waiting for a writer.
  const int fd = ::open(p.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return r;
    struct stat st {};
    if (::lstat(p.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {  // ELOOP: a link; ENXIO: a socket
      r.exists = true;
      r.kind = S_ISLNK(st.st_mode) ? link_target(p) : file_type_name(st.st_mode);
      return r;
    }
    fail(p.string(), ": cannot open the run's lock file: ", errno_text(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(p.string(), ": cannot stat the run's lock file: ", errno_text(err));
  }
  r.exists = true;
  r.modified = static_cast<double>(st.st_mtim.tv_sec) + 1e-9 * static_cast<double>(st.st_mtim.tv_nsec);
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    r.kind = file_type_name(st.st_mode);
    return r;
  }
  // Read to the end, whatever the size says, but never past the bound: a file that grows is cut off there.
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail(p.string(), ": cannot read the run's lock file: ", errno_text(err));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (static_cast<int64_t>(text.size()) > kLockBytes) break;
  }
  ::close(fd);
  try {
    if (static_cast<int64_t>(text.size()) > kLockBytes) fail("more than ", kLockBytes, " bytes (a lock is a few hundred)");
    if (text.empty()) fail("empty");
    r.holder = parse_holder(text);
  } catch (const Error& e) {
    r.problem = str("unreadable lock file: ", p.string(), ": ", e.what());
  }
  return r;
}

bool same_holder(const LockHolder& a, const LockHolder& b) {
  return a.host == b.host && a.boot_id == b.boot_id && a.pid == b.pid && a.started == b.started;
}

bool pid_is_gone(int64_t pid) { return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }

// Provably dead: on this host since its last boot, and no process has its pid.
bool holder_is_dead(const LockHolder& h, const LockHolder& me) {
  if (h.host != me.host || h.boot_id != me.boot_id || h.boot_id.empty()) return false;
  return pid_is_gone(h.pid);
}

// The whole file written beside the lock (created here: an existing one is this host and pid's, so a dead
// process's), then moved or linked into place: a reader never sees it half written. A directory that refuses the
// file is named with errno, not the hidden file's name.
void write_lock_file(const fs::path& p, const LockHolder& h) {
  const std::string text = holder_json(h).dump() + "\n";
  int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EEXIST && ::unlink(p.c_str()) == 0)
    fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    fail(p.parent_path().string(), ": cannot write the run's lock file there: ", errno_text(err),
         err == EACCES || err == EPERM || err == EROFS
             ? ": the run directory (--out_dir) must be writable by this user, on a writable filesystem"
             : "");
  }
  size_t done = 0;
  int err = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : ENOSPC;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  ::close(fd);
  if (err != 0) {
    ::unlink(p.c_str());
    fail(p.parent_path().string(), ": cannot write the run's lock file there: ", errno_text(err));
  }
}

// The temporary lock files (.run.lock.<host>.<pid>, .run.lock.heartbeat.<host>.<pid>, .run.lock.stale.<host>.<pid>)
// that holders which are gone left behind: a pid gone on this host, or a file untouched for stale_s (each lives for
// milliseconds while its holder writes a lock). This process's own are kept.
void remove_lock_leftovers(const fs::path& out_dir, const LockHolder& me, double stale_s, double now) {
  std::error_code ec;
  for (fs::directory_iterator it(out_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::string rest;
    for (const char* prefix : {".run.lock.heartbeat.", ".run.lock.stale.", ".run.lock."})
      if (name.rfind(prefix, 0) == 0) {
        rest = name.substr(std::strlen(prefix));
        break;
      }
    const size_t dot = rest.rfind('.');
    if (rest.empty() || dot == std::string::npos || dot == 0) continue;
    const std::string host = rest.substr(0, dot), digits = rest.substr(dot + 1);
    int64_t pid = 0;
    const auto [end_ptr, parse_ec] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
    if (parse_ec != std::errc() || end_ptr != digits.data() + digits.size() || pid <= 0) continue;
    if (host == me.host && pid == me.pid) continue;
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0) continue;
    const bool old = now - static_cast<double>(st.st_mtime) > stale_s;
    if (!old && !(host == me.host && pid_is_gone(pid))) continue;
    std::error_code rm_ec;
    fs::remove_all(it->path(), rm_ec);
  }
}

}  // namespace

std::string LockHolder::describe(double now) const {
  std::ostringstream s;
  s << "host " << host << ", pid " << pid;
  if (!job.empty()) s << ", job " << job;
  if (started > 0) s << ", started " << utc_time(started);
  s << ", heartbeat " << static_cast<int64_t>(std::clamp(std::round(now - heartbeat), 0.0, 1e12)) << " s ago";
  return s.str();
}

LockHolder this_process_holder() {
  LockHolder h;
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) == 0) h.host = host;
  if (h.host.empty()) h.host = "localhost";
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::getline(boot, h.boot_id);
  h.pid = static_cast<int64_t>(::getpid());
  for (const char* var : {"SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID"})
    if (const char* v = std::getenv(var); v && *v) {
      h.job = v;
      break;
    }
  h.started = h.heartbeat = unix_now();
  return h;
}

RunLock::RunLock(const fs::path& out_dir, const std::function<void(const std::string&)>& warn, Timing timing)
    : path_(out_dir / kRunLockFile), me_(this_process_holder()), timing_(timing) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) fail(out_dir.string(), ": cannot create the run directory: ", ec.message());
  const fs::path mine = out_dir / (".run.lock." + str(me_.host, ".", me_.pid));
  write_lock_file(mine, me_);
  try {
    acquire(warn);
  } catch (...) {
    fs::remove(mine, ec);  // nothing of this process stays behind a refusal
    throw;
  }
  fs::remove(mine, ec);
  remove_lock_leftovers(out_dir, me_, timing_.stale_s, unix_now());
  fsync_path(out_dir, true);
  thread_ = std::thread([this] { heartbeat_loop(); });
}

void RunLock::acquire(const std::function<void(const std::string&)>& warn) {
  const fs::path out_dir = path_.parent_path();
  const std::string unique = str(me_.host, ".", me_.pid);
  const fs::path mine = out_dir / (".run.lock." + unique);
  std::error_code ec;
  // A requeue's wait (stale_s, plus a beat for its last refresh) and a margin for the attempts that do not wait.
  const double first_try = unix_now(), deadline = first_try + timing_.stale_s + timing_.heartbeat_s + 30;
  bool said_waiting = false;
  int attempts = 0;
  for (;;) {
    if (++attempts > kLockAttempts || unix_now() > deadline)
      fail(path_.string(), ": could not take the run's lock in ", attempts - 1, " attempts over ",
           static_cast<int64_t>(unix_now() - first_try), " s: it kept changing under this run (runs starting on ",
           out_dir.string(), " in a loop?); stop the others, or choose another --out_dir");
    if (::link(mine.c_str(), path_.c_str()) == 0) return;
    int err = errno;
    if (err == EPERM || err == ENOTSUP || err == EOPNOTSUPP || err == ENOSYS) {
      // A filesystem without hard links: an exclusive create instead (atomic on NFSv3 and later).
      const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ::close(fd);
        std::error_code rename_ec;
        fs::rename(mine, path_, rename_ec);  // the whole content replaces the empty file at once
        if (!rename_ec) return;
      }
      err = fd >= 0 ? EIO : errno;
    }
    if (err != EEXIST)
      fail(out_dir.string(), ": cannot create the run's lock file ", kRunLockFile, " there: ", errno_text(err));
    const LockRead lock = read_lock(path_);
    if (!lock.exists) continue;  // released in between: try again
    if (!lock.kind.empty())
      fail(path_.string(), " is ", lock.kind, ", not a lock file: tuna writes ", kRunLockFile,
           " as a regular file, and does not read, follow or replace anything else there. If no run uses ",
           out_dir.string(), ", remove it and start again");
    const double now = unix_now();
    if (!lock.holder) {
      // Unreadable: the file's age stands for its heartbeat (see run_dir.h for the rule).
      const double age = now - lock.modified;
      if (age <= timing_.stale_s)
        fail(lock.problem, ". A run's lock always reads (tuna writes it whole), so this one is damaged or not tuna's; "
             "it was modified ", static_cast<int64_t>(std::max(0.0, std::round(age))), " s ago and is taken over once "
             "it is older than ", timing_.stale_s, " s. If no run uses ", out_dir.string(), ", remove it and start again");
      const fs::path aside = out_dir / (".run.lock.stale." + unique);
      if (::rename(path_.c_str(), aside.c_str()) == 0) {
        fs::remove(aside, ec);
        warn(str("took over an ", lock.problem, " (not modified for ", static_cast<int64_t>(age), " s)"));
      }
      continue;
    }
    const LockHolder& holder = *lock.holder;
    const bool dead = holder_is_dead(holder, me_);
    // A heartbeat a day ahead of this clock is no clock skew: a damaged file.
    if (dead || now - holder.heartbeat > timing_.stale_s || holder.heartbeat - now > 86400) {
      // Moved aside under this process's own name first: of two runs taking over at once, only one gets this
      // holder's file; the other then finds the winner's fresh lock and is refused.
      const fs::path aside = out_dir / (".run.lock.stale." + unique);
      if (::rename(path_.c_str(), aside.c_str()) == 0) {
        const LockRead moved = read_lock(aside);
        if (moved.holder && !same_holder(*moved.holder, holder) && !holder_is_dead(*moved.holder, me_) &&
            unix_now() - moved.holder->heartbeat <= timing_.stale_s) {
          // A live lock, taken between our read and the rename: put it back (link fails if yet another exists).
          if (::link(aside.c_str(), path_.c_str()) != 0) {}
          fs::remove(aside, ec);
          continue;
        }
        fs::remove_all(aside, ec);
        warn(str(path_.string(), ": took over the lock of a run that is gone (", holder.describe(now), "; ",
                 dead ? "no such process on this host" : str("no heartbeat for more than ", timing_.stale_s, " s"),
                 ")"));
      }
      continue;
    }
    if (!me_.job.empty() && holder.job == me_.job && now - first_try < timing_.stale_s + timing_.heartbeat_s) {
      // The previous attempt of this very job (a requeue): its allocation may still be shutting down.
      if (!said_waiting)
        warn(str(path_.string(), " is held by an earlier attempt of job ", me_.job, " (", holder.describe(now),
                 "): waiting for it to stop, at most ", timing_.stale_s, " s"));
      said_waiting = true;
      attempts--;  // a wait, bounded by the deadline
      std::this_thread::sleep_for(std::chrono::duration<double>(timing_.poll_s));
      continue;
    }
    fail(out_dir.string(), " is in use by another run (", holder.describe(now), "; lock file ", path_.string(),
         "). Two runs in one out_dir would write into the same checkpoints and metrics: wait for it to end, stop "
         "it, or choose another --out_dir. A lock whose holder died is taken over at once on the same host, and "
         "from any host once its heartbeat is older than ", timing_.stale_s, " s");
  }
}

std::string RunLock::lost_reason() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return lost_reason_;
}

void RunLock::heartbeat_loop() {
  const fs::path fresh = path_.parent_path() / (".run.lock.heartbeat." + str(me_.host, ".", me_.pid));
  std::unique_lock<std::mutex> guard(mutex_);
  while (!wake_.wait_for(guard, std::chrono::duration<double>(timing_.heartbeat_s), [&] { return stop_; })) {
    try {
      // Another run took the lock only if it judged this one dead: say so rather than write beside it. This
      // thread only records it: the trainer stops at its next safe point (a thread that ended the process would
      // tear it down under the main thread's computation).
      const LockRead lock = read_lock(path_);
      if (!lock.holder || !same_holder(*lock.holder, me_)) {
        const std::string what = lock.holder   ? str("taken over by another run (", lock.holder->describe(unix_now()), ")")
                                 : !lock.exists ? std::string("removed")
                                 : !lock.kind.empty() ? str("replaced by ", lock.kind)
                                                      : str("replaced by an ", lock.problem);
        lost_reason_ = str(path_.string(), ": this run's lock was ", what,
                           "; stopping without writing anything more, since two runs would write into the same "
                           "checkpoints");
        lost_ = true;
        return;
      }
      me_.heartbeat = unix_now();
      write_lock_file(fresh, me_);
      std::error_code ec;
      fs::rename(fresh, path_, ec);
      if (ec) fs::remove(fresh, ec);
    } catch (const std::exception&) {
      // A failed refresh (a full disk) is retried at the next beat; the lock goes stale only if they all fail.
    }
  }
}

RunLock::~RunLock() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  try {
    const LockRead lock = read_lock(path_);
    std::error_code ec;
    if (lock.holder && same_holder(*lock.holder, me_)) fs::remove(path_, ec);
  } catch (const std::exception&) {  // unreadable now: not this run's to remove
  }
}

std::unique_ptr<RunLock> lock_run_dir(const fs::path& out_dir, Comm& world,
                                      const std::function<void(const std::string&)>& warn) {
  RunLock::Timing timing;
  if (const char* beat = std::getenv("TUNA_LOCK_HEARTBEAT_S"); beat && *beat) {
    char* end = nullptr;
    const double s = std::strtod(beat, &end);
    if (*end != '\0' || !std::isfinite(s) || s < 0.01 || s > timing.stale_s / 2)
      fail("TUNA_LOCK_HEARTBEAT_S: expected seconds in [0.01, ", timing.stale_s / 2, "], found '", beat, "'");
    timing.heartbeat_s = s;
  }
  std::unique_ptr<RunLock> lock;
  std::string refusal;
  if (world.rank() == 0) {
    try {
      lock = std::make_unique<RunLock>(out_dir, warn, timing);
    } catch (const Error& e) {
      refusal = e.what();
    }
  }
  int64_t refused = refusal.empty() ? 0 : 1;
  world.all_reduce_sum(&refused, 1, "run directory lock");
  if (refused) fail(refusal.empty() ? str(out_dir.string(), ": in use by another run (see rank 0's message)") : refusal);
  return lock;
}

StopRequest stop_at_safe_point(Comm& world, bool signal_seen, const RunLock* lock) {
  int64_t seen[2] = {signal_seen ? 1 : 0, lock && lock->lost() ? 1 : 0};
  if (world.size() > 1) world.all_reduce_sum(seen, 2, "stop request");
  if (seen[1] > 0) {
    if (lock) {
      std::fprintf(stderr, "error: %s (exit code %d)\n", lock->lost_reason().c_str(), kLockLostExitCode);
      std::fflush(stderr);
    }
    return StopRequest::LockLost;
  }
  return seen[0] > 0 ? StopRequest::Signal : StopRequest::None;
}

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
    const std::vector<std::string> leftovers = clean_checkpoint_leftovers(out_dir / "ckpt");
    std::string names;
    for (const std::string& n : leftovers) names += (names.empty() ? "" : ", ") + n;
    if (!leftovers.empty()) say(str("removed what an interrupted run left in ", (out_dir / "ckpt").string(), ": ", names));
  }
  world.barrier("run directory ready");
  if (seen[1] == 0) return std::nullopt;
  return resume_checkpoint(out_dir / "ckpt", world, warn);
}

std::vector<std::string> resume_option_changes(const json& saved, const json& now, const OptimizerConfig& opt,
                                               int64_t step) {
  std::vector<std::string> lines;
  if (!saved.is_object() || !now.is_object()) return lines;
  // The schedule the checkpoint was following: this run's, with the saved values of the schedule's options.
  OptimizerConfig before = opt;
  int64_t steps_before = now.contains("steps") && now["steps"].is_number_integer() ? now["steps"].get<int64_t>() : 0;
  const int64_t steps_now = steps_before;
  bool schedule_changed = false;
  std::string changed;
  for (const auto& [key, value] : now.items()) {
    if (!saved.contains(key) || saved[key] == value || key == "resume" || key == "stop_at_step") continue;
    const json& old = saved[key];
    const bool schedule = key == "steps" || key == "lr" || key == "min_lr" || key == "warmup_steps" ||
                          key == "schedule" || key == "decay_fraction";
    if (!schedule) {
      lines.push_back(str("note: option ", key, " was ", old.dump(), " in the checkpoint, now ", value.dump()));
      continue;
    }
    schedule_changed = true;
    changed += str(changed.empty() ? "" : ", ", key, " ", old.dump(), " -> ", value.dump());
    if (key == "steps" && old.is_number_integer()) steps_before = old.get<int64_t>();
    if (key == "lr" && old.is_number()) before.lr = old.get<double>();
    if (key == "min_lr" && old.is_number()) before.min_lr = old.get<double>();
    if (key == "warmup_steps" && old.is_number_integer()) before.warmup_steps = old.get<int64_t>();
    if (key == "schedule" && old.is_string()) before.schedule = old.get<std::string>();
    if (key == "decay_fraction" && old.is_number()) before.decay_fraction = old.get<double>();
  }
  if (schedule_changed) {
    char rates[96] = "";
    try {
      std::snprintf(rates, sizeof rates, "%.3e before, %.3e now", learning_rate(before, step, steps_before),
                    learning_rate(opt, step, steps_now));
    } catch (const Error&) {  // a saved schedule name this build does not know: say the change only
    }
    lines.push_back(str("warning: the learning-rate schedule changed at resume (", changed,
                        "): it is reshaped from here, not continued: the rate at step ", step, " is ",
                        rates[0] ? rates : "different", ", and the schedule now ends at step ", steps_now,
                        steps_before != steps_now ? str(" instead of ", steps_before) : std::string()));
  }
  return lines;
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
