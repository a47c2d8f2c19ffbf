// What only the CUDA model needs beyond the run's layout (model/memory_plan.h MemoryLayout): where it runs and how
// it rounds. Plain C++, so that the engine's options (engine/engine.h) hold it in every build.
#pragma once

#include <cstdint>

namespace tuna {

struct GpuOptions {
  int device = 0;                    // the CUDA device index this rank uses (its local rank on the node)
  bool stochastic_rounding = false;  // bf16 weights (and bf16 moments) written with stochastic rounding
  uint32_t seed = 0;                 // stochastic rounding's random stream
};

}  // namespace tuna
