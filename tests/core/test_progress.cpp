// core/progress.h: the trainer's ETA counts the validations and checkpoints still to come.
#include <gtest/gtest.h>

#include <cmath>

#include "core/progress.h"

namespace tuna {
namespace {

TEST(Progress, FormatDuration) {
  EXPECT_EQ(format_duration(0), "0m00s");
  EXPECT_EQ(format_duration(125.9), "2m05s");
  EXPECT_EQ(format_duration(3 * 3600 + 7 * 60 + 5), "3h07m");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_duration(NAN), "?");
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
