// Stands in for CUDA's <cuda_bf16.h> in the attention emulator's build only (its include path puts
// shim/ before everything else): the types, intrinsics and execution model the kernels use, on the host.
#pragma once
#include "tests/kernels/attention_emulator/emulator.h"
