// Helpers of the engine tests (tests/model/test_engine.cpp on the CPU, test_engine_gpu.cpp on a GPU): a
// single-rank mesh, engine options and starting weights from a transformers fixture, and one training step.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "dist/comm.h"
#include "model/checkpoint.h"
#include "model/engine.h"
#include "tests/model/fixture.h"

namespace tuna::testing_util {

// One rank: the world, and the mesh over it (dp = tp = 1).
struct SingleRank {
  std::unique_ptr<Comm> world = make_single_comm();
  Mesh mesh = make_mesh(*world, 1);
};

// The fixture's batch and optimizer on `device`, ZeRO stage `zero`.
inline EngineOptions engine_options(const Fixture& f, const std::string& device, int zero = 0) {
  EngineOptions o;
  o.device = device;
  o.micro_batch = f.batch, o.seq_len = f.seq, o.opt = f.optimizer(), o.zero = zero;
  return o;
}

// The fixture's weights (the transformers model it was made from).
inline WeightFill fixture_weights(const Fixture& f) {
  return [&f](const ParamLayout& layout, float* out) { load_weights(f.dir, layout, out); };
}

// Step s of `steps` on the fixture's batch, at the schedule's learning rate.
inline StepResult train_step(Engine& e, const Fixture& f, int64_t s, int64_t steps) {
  e.begin_step();
  return e.finish_step(e.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq),
                       learning_rate(f.optimizer(), s, steps));
}

// Ranks as threads of this process (dist/comm_local.cpp): body(world) on `ranks` threads, each with its own
// world comm of one group. A rank's exception becomes a test failure naming the rank (the others then stop at
// their next collective within `timeout_s`).
inline void run_thread_ranks(int ranks, const std::function<void(Comm& world)>& body, double timeout_s = 120) {
  std::vector<std::unique_ptr<Comm>> worlds = make_local_comms(ranks, timeout_s);
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; r++)
    threads.emplace_back([&, r] {
      try {
        body(*worlds[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; r++)
    if (!errors[r].empty()) ADD_FAILURE() << "rank " << r << ": " << errors[r];
}

}  // namespace tuna::testing_util
