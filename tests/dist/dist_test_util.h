// Launching build/mpi_tests and build/train under mpirun from the ordinary test binary.
#pragma once

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "data/shard.h"
#include "tests/test_util.h"

namespace tuna::testing_util {

// `mpirun -np N` as CI can run it: as root (containers), more ranks than cores (--oversubscribe), one
// OpenMP/BLAS thread per rank so 4 ranks on 2 cores do not fight, no core binding, and the shared-memory
// transport without the single-copy mechanism (CMA needs ptrace rights that containers often lack).
inline std::string mpirun(int np) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "
         "OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1 "
         "mpirun --bind-to none -np " + std::to_string(np) + " ";
}

}  // namespace tuna::testing_util
