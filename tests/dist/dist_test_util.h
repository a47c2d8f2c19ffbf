// Launching build/mpi_tests and build/train under mpirun from the ordinary test binary.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
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

// A run's metrics.jsonl rows that have `key`, by step: "loss" (training rows), "val_loss" (validation rows).
inline std::map<int64_t, nlohmann::json> metrics_rows(const std::filesystem::path& metrics, const char* key) {
  std::map<int64_t, nlohmann::json> out;
  std::istringstream in(read_file(metrics));
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains(key)) out[j["step"].get<int64_t>()] = j;
  }
  return out;
}

}  // namespace tuna::testing_util
