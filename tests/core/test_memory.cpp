// host_memory: the trainer's memory figures move with what the process really touches.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/memory.h"

namespace tuna {
namespace {

TEST(HostMemory, ResidentAndPeakFollowTouchedMemory) {
  const HostMemory before = host_memory();
  EXPECT_GT(before.resident_mb, 0);
  EXPECT_GE(before.peak_mb, before.resident_mb);
  std::vector<char> block(64 << 20);
  std::memset(block.data(), 1, block.size());  // touch every page so it becomes resident
  const HostMemory during = host_memory();
  EXPECT_GE(during.resident_mb, before.resident_mb + 60);
  EXPECT_GE(during.peak_mb, during.resident_mb);
  EXPECT_EQ(block[block.size() - 1], 1);
}

}  // namespace
}  // namespace tuna
