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

#include <limits>

#include "../finite_difference.h"
#include "../torchpm.h"

namespace torchpm {
namespace {

constexpr int kThreads = 256;

// Plain-old-data copy of the geometry for the kernels.
struct Geometry {
  int64_t batch;
  int64_t batch_stride;
  int64_t field[3];
  int64_t gradient[3];
  int64_t shift[3];
  bool periodic[3];
};

Geometry geometry_of(const FiniteDifferenceArguments& a) {
  Geometry g;
  g.batch = a.batch;
  g.batch_stride = a.batch_stride;
  for (int d = 0; d < 3; ++d) {
    g.field[d] = a.field[d];
    g.gradient[d] = a.gradient[d];
    g.shift[d] = a.shift[d];
    g.periodic[d] = a.periodic[d];
  }
  return g;
}

// Index `i` along an axis of `n` nodes: wrapped when periodic, -1 outside a
// non-periodic axis.
__device__ __forceinline__ int64_t node(int64_t i, int64_t n, bool periodic) {
  if (periodic) {
    i %= n;
    return i < 0 ? i + n : i;
  }
  return (i >= 0 && i < n) ? i : -1;
}

// The grid-stride loops cover any count with at most 2^31 - 1 blocks.
unsigned int blocks_for(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::min<int64_t>(blocks, std::numeric_limits<int32_t>::max()));
}

template <typename scalar_t>
__global__ void gradient_kernel(const scalar_t* __restrict__ f, const scalar_t* __restrict__ scale, Geometry g,
                                scalar_t* __restrict__ out, int64_t count) {
  const scalar_t s0 = scale[0] / scalar_t(12), s1 = scale[1] / scalar_t(12), s2 = scale[2] / scalar_t(12);
  const int64_t nx = g.field[0], ny = g.field[1], nz = g.field[2];
  const int64_t ox = g.gradient[0], oy = g.gradient[1], oz = g.gradient[2];
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < count;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t jz = t % oz;
    const int64_t jy = (t / oz) % oy;
    const int64_t jx = (t / (oz * oy)) % ox;
    const int64_t b = t / (oz * oy * ox);
    const int64_t ix = jx + g.shift[0], iy = jy + g.shift[1], iz = jz + g.shift[2];
    auto value = [&](int64_t x, int64_t y, int64_t z) {
      return f[b * g.batch_stride + (node(x, nx, g.periodic[0]) * ny + node(y, ny, g.periodic[1])) * nz +
               node(z, nz, g.periodic[2])];
    };
    const int64_t channel = ox * oy * oz;
    scalar_t* o = out + b * 3 * channel + (jx * oy + jy) * oz + jz;
    o[0] = s0 * fd4_difference(value(ix + 1, iy, iz), value(ix - 1, iy, iz), value(ix + 2, iy, iz),
                               value(ix - 2, iy, iz));
    o[channel] = s1 * fd4_difference(value(ix, iy + 1, iz), value(ix, iy - 1, iz), value(ix, iy + 2, iz),
                                     value(ix, iy - 2, iz));
    o[2 * channel] = s2 * fd4_difference(value(ix, iy, iz + 1), value(ix, iy, iz - 1), value(ix, iy, iz + 2),
                                         value(ix, iy, iz - 2));
  }
}

template <typename scalar_t>
__global__ void transpose_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ scale, Geometry g,
                                 scalar_t* __restrict__ out, int64_t count) {
  const scalar_t s0 = scale[0] / scalar_t(12), s1 = scale[1] / scalar_t(12), s2 = scale[2] / scalar_t(12);
  const int64_t nx = g.field[0], ny = g.field[1], nz = g.field[2];
  const int64_t ox = g.gradient[0], oy = g.gradient[1], oz = g.gradient[2];
  const int64_t channel = ox * oy * oz;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < count;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t jz = t % nz;
    const int64_t jy = (t / nz) % ny;
    const int64_t jx = (t / (nz * ny)) % nx;
    const int64_t b = t / (nz * ny * nx);
    const int64_t mx = jx - g.shift[0], my = jy - g.shift[1], mz = jz - g.shift[2];
    // Gradient channel ch at (x, y, z), zero outside a non-periodic axis.
    auto value = [&](int64_t ch, int64_t x, int64_t y, int64_t z) {
      const int64_t i = node(x, ox, g.periodic[0]);
      const int64_t k = node(y, oy, g.periodic[1]);
      const int64_t l = node(z, oz, g.periodic[2]);
      return (i < 0 || k < 0 || l < 0) ? scalar_t(0) : grad[b * g.batch_stride + ch * channel + (i * oy + k) * oz + l];
    };
    out[t] = -(s0 * fd4_difference(value(0, mx + 1, my, mz), value(0, mx - 1, my, mz), value(0, mx + 2, my, mz),
                                   value(0, mx - 2, my, mz)) +
               s1 * fd4_difference(value(1, mx, my + 1, mz), value(1, mx, my - 1, mz), value(1, mx, my + 2, mz),
                                   value(1, mx, my - 2, mz)) +
               s2 * fd4_difference(value(2, mx, my, mz + 1), value(2, mx, my, mz - 1), value(2, mx, my, mz + 2),
                                   value(2, mx, my, mz - 2)));
  }
}

at::Tensor fd4_gradient_cuda(const at::Tensor& field, const at::Tensor& scale, std::array<bool, 3> periodic) {
  const char* op = "torchpm._fd4_gradient";
  const auto a = check_finite_difference_arguments(op, field, scale, periodic, false);
  const c10::cuda::CUDAGuard guard(a.input.device());
  auto out = at::empty({a.batch, 3, a.gradient[0], a.gradient[1], a.gradient[2]}, a.input.options());
  const int64_t count = a.batch * a.gradient[0] * a.gradient[1] * a.gradient[2];
  if (count > 0) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(a.input.scalar_type(), "fd4_gradient_cuda", [&] {
      gradient_kernel<scalar_t><<<blocks_for(count), kThreads, 0, stream>>>(
          a.input.data_ptr<scalar_t>(), a.scale.data_ptr<scalar_t>(), geometry_of(a), out.data_ptr<scalar_t>(),
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
  auto out = at::empty({a.batch, a.field[0], a.field[1], a.field[2]}, a.input.options());
  const int64_t count = out.numel();
  if (count > 0) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(a.input.scalar_type(), "fd4_gradient_transpose_cuda", [&] {
      transpose_kernel<scalar_t><<<blocks_for(count), kThreads, 0, stream>>>(
          a.input.data_ptr<scalar_t>(), a.scale.data_ptr<scalar_t>(), geometry_of(a), out.data_ptr<scalar_t>(),
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
