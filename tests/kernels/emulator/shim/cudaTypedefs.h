// Stands in for CUDA's <cudaTypedefs.h> in the emulated build only: the driver function-pointer type the
// Hopper attention launchers fetch cuTensorMapEncodeTiled through.
#pragma once
#include <cuda.h>

typedef CUresult (*PFN_cuTensorMapEncodeTiled_v12000)(
    CUtensorMap* tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank, void* globalAddress,
    const cuuint64_t* globalDim, const cuuint64_t* globalStrides, const cuuint32_t* boxDim,
    const cuuint32_t* elementStrides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill);
