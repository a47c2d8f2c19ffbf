// plan_cpu_memory on several ranks (tests/dist/test_memory_plan.cpp launches this at 2 and 4): every rank's
// activations and training state are at most the plan's, and rank 0's (the largest pieces of an uneven split)
// are exactly the plan's, for every ZeRO stage over dp and tp 1/2 (with and without sequence parallelism), tied
// and untied.
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
    for (const bool sp : {false, true}) {
      if (sp && tp == 1) continue;
      for (bool tied : {false, true})
        for (int zero = 0; zero <= 3; zero++) {
          MemoryLayout m;
          // With sp 3 x 9 = 27 rows: 14 on tp rank 0, 13 on rank 1 (rank 0's plan, the larger, is exact).
          m.dp = mesh.dp_size, m.tp = mesh.tp_size, m.zero = zero, m.sp = sp;
          m.micro_batch = sp ? 3 : 2, m.seq_len = sp ? 9 : 10;
          const auto r = plan_and_allocate(plan_test_config(3, tied), m, *mesh.dp, mesh.tp.get());
          const std::string where = str("rank ", world.rank(), " of dp ", m.dp, " x tp ", m.tp, sp ? " (sp)" : "",
                                        ", ZeRO-", zero, tied ? ", tied" : ", untied");
          EXPECT_LE(r.allocated_activations, r.planned_activations) << where;
          EXPECT_LE(r.allocated_state, r.planned_state) << where;
          if (world.rank() == 0) {
            EXPECT_EQ(r.allocated_activations, r.planned_activations) << where;
            EXPECT_EQ(r.allocated_state, r.planned_state) << where;
          }
        }
    }
  }
}

}  // namespace
}  // namespace tuna
