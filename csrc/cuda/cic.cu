// CUDA kernels of the cloud-in-cell ops.
//
// Paint scatters with atomic adds, so the order in which a cell receives its
// contributions (and hence float rounding) varies between runs. Under
// torch.use_deterministic_algorithms(True) the op raises, as torch's own
// non-deterministic CUDA ops do; torchpm.ops.cic_paint then takes the
// deterministic pure-torch path instead of calling this kernel.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../cic_stencil.h"
#include "../torchpm.h"

namespace torchpm {
namespace {

constexpr int kThreads = 256;

int64_t blocks_for(int64_t count) {
  return (count + kThreads - 1) / kThreads;
}

template <typename scalar_t>
__global__ void paint_kernel(
    const scalar_t* __restrict__ positions,
    const scalar_t* __restrict__ values,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    CicGeometry g,
    scalar_t* __restrict__ mesh,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  CicStencil<acc_t> s;
  if (!cic_stencil<scalar_t, acc_t>(positions + 3 * p, g, s)) {
    atomicAdd(bad, 1ULL);
    return;
  }
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  scalar_t* m = mesh + (p / per_batch) * channels * channel_stride;
  int64_t idx[8];
  acc_t w[8];
  cic_corners(s, g, idx, w);
  for (int64_t ch = 0; ch < channels; ++ch) {
    const acc_t v = values ? static_cast<acc_t>(values[p * channels + ch]) : acc_t(1);
    scalar_t* mc = m + ch * channel_stride;
#pragma unroll
    for (int corner = 0; corner < 8; ++corner) {
      gpuAtomicAdd(mc + idx[corner], static_cast<scalar_t>(v * w[corner]));
    }
  }
}

template <typename scalar_t>
__global__ void readout_kernel(
    const scalar_t* __restrict__ mesh,
    const scalar_t* __restrict__ positions,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    CicGeometry g,
    scalar_t* __restrict__ out,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  CicStencil<acc_t> s;
  if (!cic_stencil<scalar_t, acc_t>(positions + 3 * p, g, s)) {
    atomicAdd(bad, 1ULL);
    return;
  }
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  const scalar_t* m = mesh + (p / per_batch) * channels * channel_stride;
  int64_t idx[8];
  acc_t w[8];
  cic_corners(s, g, idx, w);
  for (int64_t ch = 0; ch < channels; ++ch) {
    acc_t acc = 0;
#pragma unroll
    for (int corner = 0; corner < 8; ++corner) {
      acc += w[corner] * static_cast<acc_t>(m[ch * channel_stride + idx[corner]]);
    }
    out[p * channels + ch] = static_cast<scalar_t>(acc);
  }
}

template <typename scalar_t>
__global__ void position_gradient_kernel(
    const scalar_t* __restrict__ mesh,
    const scalar_t* __restrict__ positions,
    const scalar_t* __restrict__ values,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    CicGeometry g,
    scalar_t* __restrict__ out,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  CicStencil<acc_t> s;
  if (!cic_stencil<scalar_t, acc_t>(positions + 3 * p, g, s)) {
    atomicAdd(bad, 1ULL);
    return;
  }
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  const scalar_t* m = mesh + (p / per_batch) * channels * channel_stride;
  acc_t grad[3] = {0, 0, 0};
  for (int corner = 0; corner < 8; ++corner) {
    const int a = corner >> 2, b = (corner >> 1) & 1, c = corner & 1;
    acc_t dw[3];
    cic_corner_weight_gradient(s, a, b, c, dw);
    const int64_t idx = cic_corner_index(s, g, a, b, c);
    acc_t sum = 0;
    for (int64_t ch = 0; ch < channels; ++ch) {
      const acc_t v = values ? static_cast<acc_t>(values[p * channels + ch]) : acc_t(1);
      sum += v * static_cast<acc_t>(m[ch * channel_stride + idx]);
    }
    grad[0] += sum * dw[0];
    grad[1] += sum * dw[1];
    grad[2] += sum * dw[2];
  }
  out[3 * p + 0] = static_cast<scalar_t>(grad[0]);
  out[3 * p + 1] = static_cast<scalar_t>(grad[1]);
  out[3 * p + 2] = static_cast<scalar_t>(grad[2]);
}

// Reads the device-side count of rejected particles (one small synchronising
// copy) and raises with a diagnosis when it is not zero.
void raise_if_bad(
    const char* op,
    const at::Tensor& bad,
    const at::Tensor& positions,
    const CicGeometry& g) {
  const int64_t count = bad.item<int64_t>();
  if (count > 0) {
    throw_bad_particles(op, positions, g, count);
  }
}

at::Tensor cic_paint_cuda(
    const at::Tensor& positions_in,
    const std::optional<at::Tensor>& weights_in,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic) {
  const char* op = "torchpm.cic_paint";
  auto positions = check_positions(op, positions_in);
  const CicGeometry g = make_geometry(op, shape, offset, periodic);
  int64_t channels = 1;
  bool has_channel_dim = false;
  at::Tensor weights;
  if (weights_in.has_value()) {
    weights = check_particle_values(
        op, "weights", *weights_in, positions, channels, has_channel_dim);
  }
  at::globalContext().alertNotDeterministic("torchpm::cic_paint (CUDA atomics)");
  const c10::cuda::CUDAGuard guard(positions.device());
  auto mesh = at::zeros(
      {positions.size(0), channels, shape[0], shape[1], shape[2]},
      positions.options());
  const int64_t total = positions.size(0) * positions.size(1);
  if (total > 0) {
    auto bad = at::zeros({1}, positions.options().dtype(at::kLong));
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "cic_paint_cuda", [&] {
      paint_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(
          positions.data_ptr<scalar_t>(),
          weights.defined() ? weights.data_ptr<scalar_t>() : nullptr, channels,
          positions.size(1), total, g, mesh.data_ptr<scalar_t>(),
          reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    raise_if_bad(op, bad, positions, g);
  }
  return has_channel_dim ? mesh : mesh.squeeze(1);
}

at::Tensor cic_readout_cuda(
    const at::Tensor& mesh_in,
    const at::Tensor& positions_in,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic) {
  const char* op = "torchpm.cic_readout";
  auto positions = check_positions(op, positions_in);
  int64_t channels = 1;
  bool has_channel_dim = false;
  auto mesh = check_mesh(op, "mesh", mesh_in, positions, channels, has_channel_dim);
  const CicGeometry g = make_geometry(op, mesh.sizes().slice(2), offset, periodic);
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t total = positions.size(0) * positions.size(1);
  auto out = at::empty({positions.size(0), positions.size(1), channels}, positions.options());
  if (total > 0) {
    auto bad = at::zeros({1}, positions.options().dtype(at::kLong));
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "cic_readout_cuda", [&] {
      readout_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(
          mesh.data_ptr<scalar_t>(), positions.data_ptr<scalar_t>(), channels,
          positions.size(1), total, g, out.data_ptr<scalar_t>(),
          reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    raise_if_bad(op, bad, positions, g);
  }
  return has_channel_dim ? out : out.squeeze(2);
}

at::Tensor cic_position_gradient_cuda(
    const at::Tensor& mesh_in,
    const at::Tensor& positions_in,
    const std::optional<at::Tensor>& values_in,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic) {
  const char* op = "torchpm._cic_position_gradient";
  auto positions = check_positions(op, positions_in);
  int64_t channels = 1;
  bool has_channel_dim = false;
  auto mesh = check_mesh(op, "mesh", mesh_in, positions, channels, has_channel_dim);
  at::Tensor values;
  if (values_in.has_value()) {
    int64_t value_channels = 1;
    bool value_channel_dim = false;
    values = check_particle_values(
        op, "values", *values_in, positions, value_channels, value_channel_dim);
    TORCH_CHECK_VALUE(
        value_channels == channels && value_channel_dim == has_channel_dim, op,
        ": `values` must have one entry per channel of `mesh`.");
  } else {
    TORCH_CHECK_VALUE(channels == 1 && !has_channel_dim, op,
                      ": `values` may be omitted only for a single-channel mesh.");
  }
  const CicGeometry g = make_geometry(op, mesh.sizes().slice(2), offset, periodic);
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t total = positions.size(0) * positions.size(1);
  auto out = at::empty({positions.size(0), positions.size(1), 3}, positions.options());
  if (total > 0) {
    auto bad = at::zeros({1}, positions.options().dtype(at::kLong));
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "cic_position_gradient_cuda", [&] {
      position_gradient_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(
          mesh.data_ptr<scalar_t>(), positions.data_ptr<scalar_t>(),
          values.defined() ? values.data_ptr<scalar_t>() : nullptr, channels,
          positions.size(1), total, g, out.data_ptr<scalar_t>(),
          reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    raise_if_bad(op, bad, positions, g);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CUDA, m) {
  m.impl("cic_paint", &cic_paint_cuda);
  m.impl("cic_readout", &cic_readout_cuda);
  m.impl("_cic_position_gradient", &cic_position_gradient_cuda);
}

}  // namespace torchpm
