// CUDA kernels of torchpm::_add_scaled and _add_scaled_ (cpu/updates.cpp): x + y * f in one pass,
// with the rounding of torch's mul then add (../updates.h: __fmul_rn / __fadd_rn
// and the double versions, which nvcc never contracts into a fused
// multiply-add, as it would by default). _readout_kick_drift_ on CUDA is in
// mass_assignment.cu, next to the readout.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../torchpm.h"
#include "../updates.h"
#include "launch.cuh"

namespace torchpm {
namespace {

template <typename scalar_t>
__global__ void add_scaled_kernel(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ y, scalar_t factor,
    scalar_t* __restrict__ out, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = rounded_sum(x[i], rounded_product(y[i], factor));
  }
}

// In place: no __restrict__, x is read and written.
template <typename scalar_t>
__global__ void add_scaled_in_place_kernel(scalar_t* x, const scalar_t* y, scalar_t factor, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = rounded_sum(x[i], rounded_product(y[i], factor));
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

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CUDA, m) {
  m.impl("_add_scaled", &add_scaled_cuda);
  m.impl("_add_scaled_", &add_scaled_in_place_cuda);
}

}  // namespace torchpm
