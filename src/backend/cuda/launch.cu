// backend/cuda/launch.cu: the per-thread switches of launch.cuh's programmatic dependent launch
// and of the Q4_K/Q6_K tensor-core kernel's form (kernels.h).
// Per thread because the CUDA runtime's current device is too, and the backend that sets it
// (around its own enqueues) may share the process with callers that launch kernels plainly.
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {
thread_local bool t_pdl = false;
thread_local int t_mma_stages = kMmaStagesDefault;
thread_local int t_mma_warps = kMmaWarpsDefault;
}  // namespace

void set_launch_pdl(bool on) { t_pdl = on; }
bool launch_pdl() { return t_pdl; }
void set_mma_stages(int stages) { t_mma_stages = stages; }
int mma_stages() { return t_mma_stages; }
void set_mma_warps(int warps) { t_mma_warps = warps; }
int mma_warps() { return t_mma_warps; }

}  // namespace kiln::cuda
