// Helpers of the engine tests (tests/model/test_engine.cpp on the CPU, test_engine_gpu.cpp on a GPU): a
// single-rank mesh, engine options and starting weights from a transformers fixture, and one training step.
#pragma once

#include <memory>
#include <string>

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

}  // namespace tuna::testing_util
