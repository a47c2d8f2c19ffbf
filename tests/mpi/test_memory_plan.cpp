// plan_cpu_memory on several ranks (tests/dist/test_memory_plan.cpp launches this at 2 and 4): every rank's
// activations and training state are at most the plan's, and rank 0's (the largest pieces of an uneven split)
// are exactly the plan's, for every ZeRO stage over dp and tp 1/2, tied and untied.
#include <gtest/gtest.h>

#include "core/error.h"
#include "comm/comm.h"
#include "tests/model/memory_plan_test_util.h"
#include "tests/mpi/mpi_test_util.h"

namespace tuna {
namespace {

using testing_util::plan_and_allocate;
using testing_util::plan_test_config;

TEST(MemoryPlan, EveryRanksAllocationsAtEveryLayout) {
  Comm& world = test::world();
  for (int64_t tp : {1, 2}) {
    if (world.size() % tp != 0) continue;
    Mesh mesh = make_mesh(world, tp);
    for (bool tied : {false, true})
      for (int zero = 0; zero <= 3; zero++) {
        MemoryLayout m;
        m.dp = mesh.dp_size, m.tp = mesh.tp_size, m.zero = zero, m.micro_batch = 2, m.seq_len = 10;
        const auto r = plan_and_allocate(plan_test_config(3, tied), m, *mesh.dp, mesh.tp.get());
        const std::string where = str("rank ", world.rank(), " of dp ", m.dp, " x tp ", m.tp, ", ZeRO-", zero,
                                      tied ? ", tied" : ", untied");
        EXPECT_LE(r.allocated_activations, r.planned_activations) << where;
        EXPECT_LE(r.allocated_state, r.planned_state) << where;
        if (world.rank() == 0) {
          EXPECT_EQ(r.allocated_activations, r.planned_activations) << where;
          EXPECT_EQ(r.allocated_state, r.planned_state) << where;
        }
      }
  }
}

}  // namespace
}  // namespace tuna
