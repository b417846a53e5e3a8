// CUDA kernels of torchpm::_add_scaled and _add_scaled_ (cpu/updates.cpp): x + y * f in one pass,
// with the rounding of torch's mul then add. __fmul_rn / __fadd_rn (and the
// double versions) are never contracted into a fused multiply-add, which nvcc
// would otherwise do by default.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../torchpm.h"
#include "launch.cuh"

namespace torchpm {
namespace {

__device__ __forceinline__ float multiply(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double multiply(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }

template <typename scalar_t>
__global__ void add_scaled_kernel(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ y, scalar_t factor,
    scalar_t* __restrict__ out, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = add(x[i], multiply(y[i], factor));
  }
}

// In place: no __restrict__, x is read and written.
template <typename scalar_t>
__global__ void add_scaled_in_place_kernel(scalar_t* x, const scalar_t* y, scalar_t factor, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = add(x[i], multiply(y[i], factor));
  }
}

at::Tensor add_scaled_cuda(const at::Tensor& x_in, const at::Tensor& y_in, double factor) {
  at::Tensor x, y;
  std::tie(x, y) = check_add_scaled_arguments("torchpm._add_scaled", x_in, y_in);
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t count = out.numel();
  if (count > 0) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "add_scaled_cuda", [&] {
      add_scaled_kernel<scalar_t><<<grid_stride_blocks(count), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), static_cast<scalar_t>(factor),
          out.data_ptr<scalar_t>(), count);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return out;
}

void add_scaled_in_place_cuda(at::Tensor& x, const at::Tensor& y_in, double factor) {
  at::Tensor y = check_add_scaled_in_place_arguments("torchpm._add_scaled_", x, y_in);
  bump_version(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t count = x.numel();
  if (count > 0) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "add_scaled_in_place_cuda", [&] {
      add_scaled_in_place_kernel<scalar_t><<<grid_stride_blocks(count), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), static_cast<scalar_t>(factor), count);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

// torchpm::_readout_kick_drift_ on CUDA is its composition: the readout
// kernel (its error reporting included), then the in-place updates. The same
// bits as on the CPU; the force is written once and read back. A particle the
// readout rejects gets its NaN force in momentum and position (the CPU kernel
// leaves its position as read).
void readout_kick_drift_cuda(
    const at::Tensor& mesh, const at::Tensor& positions, const at::Tensor& momenta, at::IntArrayRef offset,
    std::array<bool, 3> periodic, int64_t order, at::ArrayRef<double> kicks, std::optional<double> drift,
    bool check_finite) {
  const char* op = "torchpm._readout_kick_drift_";
  check_readout_update_arguments(op, mesh, positions, momenta, offset, periodic, order, kicks);
  static const auto readout =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchpm::readout", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::IntArrayRef, std::array<bool, 3>, int64_t,
                            bool)>();
  const at::Tensor force = readout.call(mesh, positions, offset, periodic, order, check_finite);
  at::Tensor v = momenta;
  for (const double kick : kicks) {
    add_scaled_in_place_cuda(v, force, kick);
  }
  if (drift.has_value()) {
    at::Tensor x = positions;
    add_scaled_in_place_cuda(x, momenta, *drift);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CUDA, m) {
  m.impl("_add_scaled", &add_scaled_cuda);
  m.impl("_add_scaled_", &add_scaled_in_place_cuda);
  m.impl("_readout_kick_drift_", &readout_kick_drift_cuda);
}

}  // namespace torchpm
