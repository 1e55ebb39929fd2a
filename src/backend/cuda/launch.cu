// backend/cuda/launch.cu: the per-thread switch of launch.cuh's programmatic dependent launch.
// Per thread because the CUDA runtime's current device is too, and the backend that sets it
// (around its own enqueues) may share the process with callers that launch kernels plainly.
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {
thread_local bool t_pdl = false;
}  // namespace

void set_launch_pdl(bool on) { t_pdl = on; }
bool launch_pdl() { return t_pdl; }

}  // namespace kiln::cuda
