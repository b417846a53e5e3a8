// CUDA kernels of torchpm::_fd4_gradient and torchpm::_fd4_gradient_transpose
// (finite_difference.h), one thread per output node (all three channels for
// the gradient, the sum over them for the transpose). Neighbouring threads
// read neighbouring z nodes, so the loads coalesce; the 12 reads per node hit
// the same few lines and are served from L1/L2. No atomics: deterministic.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "../finite_difference.h"
#include "launch.cuh"
#include "../torchpm.h"

namespace torchpm {
namespace {

template <typename scalar_t>
__global__ void gradient_kernel(const scalar_t* __restrict__ f, const scalar_t* __restrict__ scale,
                                FiniteDifferenceGeometry g, scalar_t* __restrict__ out, int64_t count) {
  const Fd4Factors<scalar_t> factors(scale);
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < count;
       t += int64_t(gridDim.x) * blockDim.x) {
    fd4_gradient_at(f, factors.s, g, t, out);
  }
}

template <typename scalar_t>
__global__ void transpose_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ scale,
                                 FiniteDifferenceGeometry g, scalar_t* __restrict__ out, int64_t count) {
  const Fd4Factors<scalar_t> factors(scale);
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < count;
       t += int64_t(gridDim.x) * blockDim.x) {
    out[t] = fd4_transpose_at(grad, factors.s, g, t);
  }
}

at::Tensor fd4_gradient_cuda(const at::Tensor& field, const at::Tensor& scale, std::array<bool, 3> periodic) {
  const char* op = "torchpm._fd4_gradient";
  const auto a = check_finite_difference_arguments(op, field, scale, periodic, false);
  const c10::cuda::CUDAGuard guard(a.input.device());
  const int64_t* shape = a.geometry.gradient;
  auto out = at::empty({a.batch, 3, shape[0], shape[1], shape[2]},
                       a.input.options().memory_format(at::MemoryFormat::ChannelsLast3d));
  const int64_t count = a.batch * shape[0] * shape[1] * shape[2];
  if (count > 0) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(a.input.scalar_type(), "fd4_gradient_cuda", [&] {
      gradient_kernel<scalar_t><<<grid_stride_blocks(count), kThreads, 0, stream>>>(
          a.input.data_ptr<scalar_t>(), a.scale.data_ptr<scalar_t>(), a.geometry, out.data_ptr<scalar_t>(),
          count);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return out;
}

at::Tensor fd4_gradient_transpose_cuda(
    const at::Tensor& grad, const at::Tensor& scale, std::array<bool, 3> periodic) {
  const char* op = "torchpm._fd4_gradient_transpose";
  const auto a = check_finite_difference_arguments(op, grad, scale, periodic, true);
  const c10::cuda::CUDAGuard guard(a.input.device());
  const int64_t* shape = a.geometry.field;
  auto out = at::empty({a.batch, shape[0], shape[1], shape[2]}, a.input.options());
  const int64_t count = out.numel();
  if (count > 0) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(a.input.scalar_type(), "fd4_gradient_transpose_cuda", [&] {
      transpose_kernel<scalar_t><<<grid_stride_blocks(count), kThreads, 0, stream>>>(
          a.input.data_ptr<scalar_t>(), a.scale.data_ptr<scalar_t>(), a.geometry, out.data_ptr<scalar_t>(),
          count);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CUDA, m) {
  m.impl("_fd4_gradient", &fd4_gradient_cuda);
  m.impl("_fd4_gradient_transpose", &fd4_gradient_transpose_cuda);
}

}  // namespace torchpm
