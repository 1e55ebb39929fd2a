// backend/cuda/act.cuh: the FFN activation functions as device functions, shared by the
// elementwise kernel and the kernels that fuse an activation into their input (the int8
// matmul's activation quantization), so a fused path computes the same expression and has the
// same bits as the op it replaces (CudaOps.SwigluMatmulEqualsTheTwoOps).
#pragma once

#include <cuda_runtime.h>

namespace kiln::cuda {

// silu(g) * u, the reference's form.
__device__ __forceinline__ float swiglu_one(float g, float u) { return g / (1.0f + expf(-g)) * u; }

}  // namespace kiln::cuda
