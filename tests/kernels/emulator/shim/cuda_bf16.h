// Stands in for CUDA's <cuda_bf16.h> in the emulated build only (its include path puts shim/ before
// everything else): the types, intrinsics, execution model and runtime API the kernels and GPU tests use, on
// the host (tests/kernels/emulator/runtime.h).
#pragma once
#include "tests/kernels/emulator/runtime.h"
