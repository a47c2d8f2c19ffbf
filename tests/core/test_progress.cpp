// ProgressLine: periodic lines into a file (a batch job's log), the share and ETA while going, the total time at
// the end; the human formats of sizes and durations. The safetensors writer moves a line by the bytes written.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <thread>
#include <vector>

#include "core/progress.h"
#include "ckpt/safetensors.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  return out;
}

TEST(Progress, HumanSizesAndDurations) {
  EXPECT_EQ(human_bytes(512), "512 B");
  EXPECT_EQ(human_bytes(1536), "1.5 KB");
  EXPECT_EQ(human_bytes(140e9), "140.0 GB");
  EXPECT_EQ(human_duration(4.25), "4.2s");
  EXPECT_EQ(human_duration(75), "1m15s");
  EXPECT_EQ(human_duration(7300), "2h01m");
  EXPECT_EQ(human_duration(200000), "2d07h");
  EXPECT_EQ(human_duration(-1), "?");
}

TEST(Progress, PeriodicLinesIntoAFileThenTheClosingLine) {
  std::FILE* f = std::tmpfile();
  ASSERT_TRUE(f);
  {
    ProgressLine line("convert: writing model.safetensors", 4e9, ProgressLine::Unit::Bytes, f, /*period_s=*/0.0);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    line.update(1e9);
    const std::string going = line.text(false);
    EXPECT_NE(going.find("1.0 GB / 4.0 GB"), std::string::npos) << going;
    EXPECT_NE(going.find("25%"), std::string::npos) << going;
    EXPECT_NE(going.find("ETA "), std::string::npos) << going;
    line.add(3e9);
    line.finish();
    line.finish();  // once
  }
  const std::string out = contents(f);
  std::fclose(f);
  // Not a terminal: whole lines, no carriage returns.
  EXPECT_EQ(out.find('\r'), std::string::npos) << out;
  EXPECT_NE(out.find("convert: writing model.safetensors: 1.0 GB / 4.0 GB"), std::string::npos) << out;
  EXPECT_NE(out.find("4.0 GB / 4.0 GB ("), std::string::npos) << out;
  EXPECT_NE(out.find(" in "), std::string::npos) << out;
  size_t lines = 0;
  for (char c : out) lines += c == '\n';
  EXPECT_EQ(lines, 3u) << out;  // two updates and the closing line
}

TEST(Progress, AQuietPeriodPrintsOnlyTheClosingLine) {
  std::FILE* f = std::tmpfile();
  ASSERT_TRUE(f);
  {
    ProgressLine line("checkpoint step 10", 100, ProgressLine::Unit::Items, f, /*period_s=*/3600, "tensors");
    for (int i = 1; i <= 100; i++) line.update(i);
    line.finish();
  }
  const std::string out = contents(f);
  std::fclose(f);
  EXPECT_EQ(out.rfind("checkpoint step 10: 100 / 100 tensors (", 0), 0u) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
}

TEST(Progress, TheSafetensorsWriterMovesItByTheBytesWritten) {
  testing_util::TempDir tmp("progress");
  std::vector<float> a(1000, 1.0f), b(24, 2.0f);
  SafetensorsWriter w;
  w.add("a", DType::F32, {1000}, a.data());
  w.add("b", DType::F32, {4, 6}, b.data());
  ProgressLine line("writing", 4096, ProgressLine::Unit::Bytes, nullptr);
  w.write(tmp / "x.safetensors", &line);
  EXPECT_EQ(line.done(), 4096.0);
}

// The trainer's ETA counts the validations and checkpoints still to come.
// A terminal is live (the line rewritten in place) only outside an MPI launcher: Open MPI hands every rank a
// pseudo-terminal that it forwards into mpirun's output, a log file as often as not.
TEST(Progress, ARanksPseudoTerminalUnderALauncherIsNotLive) {
  const int master = posix_openpt(O_RDWR | O_NOCTTY);
  ASSERT_GE(master, 0);
  ASSERT_EQ(grantpt(master), 0);
  ASSERT_EQ(unlockpt(master), 0);
  std::FILE* pty = std::fopen(ptsname(master), "w");
  ASSERT_NE(pty, nullptr);
  std::FILE* file = std::tmpfile();
  const char* launchers[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID"};
  testing_util::ScopedEnv env;
  for (const char* v : launchers) env.unset(v);
  EXPECT_TRUE(is_live_terminal(pty));
  EXPECT_FALSE(is_live_terminal(file));
  EXPECT_FALSE(is_live_terminal(nullptr));
  for (const char* v : launchers) {
    testing_util::ScopedEnv launched;
    launched.set(v, "0");
    EXPECT_FALSE(is_live_terminal(pty)) << v;
  }
  std::fclose(file);
  std::fclose(pty);
  close(master);
}

TEST(Progress, ASlowRateKeepsItsDigits) {
  ProgressLine line("eval", 100, ProgressLine::Unit::Items, nullptr, 10.0, "batches");
  line.update(0.05);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string text = line.text(false);
  EXPECT_EQ(text.find("(0 batches/s)"), std::string::npos) << text;
  EXPECT_NE(text.find(" batches/s)"), std::string::npos) << text;
  EXPECT_NE(text.find("(0."), std::string::npos) << text;  // 0.05 batches in 0.2 s or more
}

TEST(Progress, PeriodicEventsLeft) {
  EXPECT_EQ(periodic_events_left(0, 100, 25), 4);   // 25, 50, 75 and the end (100)
  EXPECT_EQ(periodic_events_left(25, 100, 25), 3);  // 50, 75, 100
  EXPECT_EQ(periodic_events_left(99, 100, 25), 1);  // the end
  EXPECT_EQ(periodic_events_left(10, 100, 0), 1);   // the end only
  EXPECT_EQ(periodic_events_left(100, 100, 25), 0);
  EXPECT_EQ(periodic_events_left(0, 101, 25), 5);   // 25, 50, 75, 100, 101
}

TEST(Progress, TrainingEtaCountsValidationsAndCheckpoints) {
  TrainingEta eta(/*micro_batches_per_step=*/2, /*batches_per_validation=*/12);
  EXPECT_TRUE(std::isnan(eta.seconds_left(10, 1, 1)));  // nothing measured yet
  eta.step_done(1.0);
  eta.step_done(3.0);  // mean 2 s
  // No validation measured: 12 forward-only batches at a third of a micro-batch's 1 s each.
  EXPECT_DOUBLE_EQ(eta.seconds_left(10, 2, 3), 10 * 2.0 + 2 * 4.0);
  eta.validation_done(7.0);
  eta.checkpoint_done(5.0);
  EXPECT_DOUBLE_EQ(eta.seconds_left(10, 2, 3), 10 * 2.0 + 2 * 7.0 + 3 * 5.0);
  EXPECT_DOUBLE_EQ(eta.seconds_left(0, 0, 0), 0.0);
}

}  // namespace
}  // namespace tuna
