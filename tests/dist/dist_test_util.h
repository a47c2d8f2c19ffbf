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

// The shards of tests/tools/test_train.cpp (vocab 128): a learnable stream, 62 training windows of 16
// tokens in train-0000{0,1}.bin, 31 in val-00000.bin.
inline void write_test_shards(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  std::mt19937 rng(5);
  for (const char* name : {"train-00000.bin", "train-00001.bin", "val-00000.bin"}) {
    ShardWriter w((dir / name).string(), 128);
    for (int doc = 0; doc < 12; doc++) {
      std::vector<int32_t> tokens{1};
      const int start = rng() % 100;
      for (int i = 0; i < 40; i++) tokens.push_back(3 + (start + i * 7) % 120);
      tokens.push_back(2);
      w.add_document(tokens);
    }
    w.finish();
  }
}

}  // namespace tuna::testing_util
