// CUDA kernels of the mass-assignment ops (NGP, CIC, TSC, PCS), one template
// over the stencil width W (stencil.h), one thread per particle.
//
// Paint scatters with atomic adds, so the order in which a cell receives its
// contributions (and hence float rounding) varies between runs. Under
// torch.use_deterministic_algorithms(True) the op raises, as torch's own
// non-deterministic CUDA ops do; torchpm.ops.paint then takes the
// deterministic pure-torch path instead of calling this kernel.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../stencil.h"
#include "../torchpm.h"

namespace torchpm {
namespace {

constexpr int kThreads = 256;

int64_t blocks_for(int64_t count) {
  return (count + kThreads - 1) / kThreads;
}

// Counters of one launch: rejected positions, non-finite values.
constexpr int kBadPositions = 0;
constexpr int kBadValues = 1;

// Adds the number of threads of the warp with `flag` set to *counter with one
// atomic per warp (when many particles are bad, per-thread atomics on one
// address serialise). Every thread of the warp that is still running must call
// it; threads that returned early are excluded by __activemask().
__device__ inline void count_in_warp(bool flag, unsigned long long* counter) {
  const unsigned active = __activemask();
  const unsigned flagged = __ballot_sync(active, flag);
  if (flagged != 0 && (threadIdx.x & 31) == static_cast<unsigned>(__ffs(active) - 1)) {
    atomicAdd(counter, static_cast<unsigned long long>(__popc(flagged)));
  }
}

template <typename scalar_t, int W>
__global__ void paint_kernel(
    const scalar_t* __restrict__ positions,
    const scalar_t* __restrict__ values,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    StencilGeometry g,
    bool check_finite,
    scalar_t* __restrict__ mesh,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  Stencil<acc_t, W> s;
  const bool valid = make_stencil<scalar_t, acc_t, W>(positions + 3 * p, g, s);
  count_in_warp(!valid, bad + kBadPositions);
  if (!valid) {
    return;
  }
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  scalar_t* m = mesh + (p / per_batch) * channels * channel_stride;
  for (int64_t ch = 0; ch < channels; ++ch) {
    // Each weight is loaded once.
    const acc_t v = values ? static_cast<acc_t>(values[p * channels + ch]) : acc_t(1);
    if (check_finite && !::isfinite(v)) {
      atomicAdd(bad + kBadValues, 1ULL);
      return;
    }
    scalar_t* mc = m + ch * channel_stride;
#pragma unroll
    for (int a = 0; a < W; ++a) {
#pragma unroll
      for (int b = 0; b < W; ++b) {
        scalar_t* row = mc + s.offset[0][a] + s.offset[1][b];
        const acc_t vab = v * s.weight[0][a] * s.weight[1][b];
#pragma unroll
        for (int c = 0; c < W; ++c) {
          gpuAtomicAdd(row + s.offset[2][c], static_cast<scalar_t>(vab * s.weight[2][c]));
        }
      }
    }
  }
}

template <typename scalar_t, int W>
__global__ void readout_kernel(
    const scalar_t* __restrict__ mesh,
    const scalar_t* __restrict__ positions,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    StencilGeometry g,
    bool check_finite,
    scalar_t* __restrict__ out,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  Stencil<acc_t, W> s;
  const bool valid = make_stencil<scalar_t, acc_t, W>(positions + 3 * p, g, s);
  count_in_warp(!valid, bad + kBadPositions);
  if (!valid) {
    return;
  }
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  const scalar_t* m = mesh + (p / per_batch) * channels * channel_stride;
  bool finite = true;
  for (int64_t ch = 0; ch < channels; ++ch) {
    const scalar_t* mc = m + ch * channel_stride;
    // Separable sum, as on the CPU: the z dot product, then the (x, y) weights.
    acc_t acc = 0;
#pragma unroll
    for (int a = 0; a < W; ++a) {
#pragma unroll
      for (int b = 0; b < W; ++b) {
        const scalar_t* row = mc + s.offset[0][a] + s.offset[1][b];
        acc_t along_z = 0;
#pragma unroll
        for (int c = 0; c < W; ++c) {
          along_z += s.weight[2][c] * static_cast<acc_t>(row[s.offset[2][c]]);
        }
        acc += (s.weight[0][a] * s.weight[1][b]) * along_z;
      }
    }
    out[p * channels + ch] = static_cast<scalar_t>(acc);
    finite = finite && ::isfinite(acc);
  }
  if (check_finite) {
    count_in_warp(!finite, bad + kBadValues);
  }
}

template <typename scalar_t, int W>
__global__ void position_gradient_kernel(
    const scalar_t* __restrict__ mesh,
    const scalar_t* __restrict__ positions,
    const scalar_t* __restrict__ values,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    StencilGeometry g,
    scalar_t* __restrict__ out,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  Stencil<acc_t, W> s;
  const bool valid = make_stencil<scalar_t, acc_t, W, true>(positions + 3 * p, g, s);
  count_in_warp(!valid, bad + kBadPositions);
  if (!valid) {
    return;
  }
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  const scalar_t* m = mesh + (p / per_batch) * channels * channel_stride;
  acc_t grad[3] = {0, 0, 0};
#pragma unroll
  for (int a = 0; a < W; ++a) {
#pragma unroll
    for (int b = 0; b < W; ++b) {
      const int64_t row = s.offset[0][a] + s.offset[1][b];
      acc_t along_z = 0;
      acc_t along_z_derivative = 0;
#pragma unroll
      for (int c = 0; c < W; ++c) {
        const int64_t idx = row + s.offset[2][c];
        acc_t sum = 0;
        for (int64_t ch = 0; ch < channels; ++ch) {
          const acc_t v = values ? static_cast<acc_t>(values[p * channels + ch]) : acc_t(1);
          sum += v * static_cast<acc_t>(m[ch * channel_stride + idx]);
        }
        along_z += s.weight[2][c] * sum;
        along_z_derivative += s.derivative[2][c] * sum;
      }
      grad[0] += s.derivative[0][a] * s.weight[1][b] * along_z;
      grad[1] += s.weight[0][a] * s.derivative[1][b] * along_z;
      grad[2] += s.weight[0][a] * s.weight[1][b] * along_z_derivative;
    }
  }
  out[3 * p + 0] = static_cast<scalar_t>(grad[0]);
  out[3 * p + 1] = static_cast<scalar_t>(grad[1]);
  out[3 * p + 2] = static_cast<scalar_t>(grad[2]);
}

// Reads the device-side counts (one small synchronising copy) and raises with
// a diagnosis when one is not zero.
void raise_if_bad(
    const char* op,
    const at::Tensor& bad,
    const at::Tensor& positions,
    const StencilGeometry& g,
    const char* value_name,
    const at::Tensor& per_particle_values) {
  const auto counts = bad.cpu();
  const int64_t bad_positions = counts[kBadPositions].item<int64_t>();
  if (bad_positions > 0) {
    throw_bad_particles(op, positions, g, bad_positions);
  }
  const int64_t bad_values = counts[kBadValues].item<int64_t>();
  if (bad_values > 0) {
    throw_non_finite(op, value_name, per_particle_values, bad_values);
  }
}

at::Tensor paint_cuda(
    const at::Tensor& positions_in,
    const std::optional<at::Tensor>& weights_in,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool check_finite) {
  const char* op = "torchpm.paint";
  auto positions = check_positions(op, positions_in);
  const StencilGeometry g = make_geometry(op, shape, offset, periodic, order);
  int64_t channels = 1;
  bool has_channel_dim = false;
  at::Tensor weights;
  if (weights_in.has_value()) {
    weights = check_particle_values(
        op, "weights", *weights_in, positions, channels, has_channel_dim);
  }
  check_mesh_size(op, positions.size(0), channels, g, positions.scalar_type());
  at::globalContext().alertNotDeterministic("torchpm::paint (CUDA atomics)");
  const c10::cuda::CUDAGuard guard(positions.device());
  auto mesh = at::zeros(
      {positions.size(0), channels, shape[0], shape[1], shape[2]},
      positions.options());
  const int64_t total = positions.size(0) * positions.size(1);
  if (total > 0) {
    auto bad = at::zeros({2}, positions.options().dtype(at::kLong));
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "paint_cuda", [&] {
      dispatch_order(op, order, [&](auto width) {
        paint_kernel<scalar_t, decltype(width)::value>
            <<<blocks_for(total), kThreads, 0, stream>>>(
                positions.data_ptr<scalar_t>(),
                weights.defined() ? weights.data_ptr<scalar_t>() : nullptr, channels,
                positions.size(1), total, g, check_finite && weights.defined(),
                mesh.data_ptr<scalar_t>(),
                reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    raise_if_bad(op, bad, positions, g, "weights", weights);
  }
  return has_channel_dim ? mesh : mesh.squeeze(1);
}

at::Tensor readout_cuda(
    const at::Tensor& mesh_in,
    const at::Tensor& positions_in,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool check_finite) {
  const char* op = "torchpm.readout";
  auto positions = check_positions(op, positions_in);
  int64_t channels = 1;
  bool has_channel_dim = false;
  auto mesh = check_mesh(op, "mesh", mesh_in, positions, channels, has_channel_dim);
  const StencilGeometry g = make_geometry(op, mesh.sizes().slice(2), offset, periodic, order);
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t total = positions.size(0) * positions.size(1);
  auto out = at::empty({positions.size(0), positions.size(1), channels}, positions.options());
  if (total > 0) {
    auto bad = at::zeros({2}, positions.options().dtype(at::kLong));
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "readout_cuda", [&] {
      dispatch_order(op, order, [&](auto width) {
        readout_kernel<scalar_t, decltype(width)::value>
            <<<blocks_for(total), kThreads, 0, stream>>>(
                mesh.data_ptr<scalar_t>(), positions.data_ptr<scalar_t>(), channels,
                positions.size(1), total, g, check_finite, out.data_ptr<scalar_t>(),
                reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    raise_if_bad(op, bad, positions, g, "mesh", out);
  }
  return has_channel_dim ? out : out.squeeze(2);
}

at::Tensor position_gradient_cuda(
    const at::Tensor& mesh_in,
    const at::Tensor& positions_in,
    const std::optional<at::Tensor>& values_in,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order) {
  const char* op = "torchpm._position_gradient";
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
  const StencilGeometry g = make_geometry(op, mesh.sizes().slice(2), offset, periodic, order);
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t total = positions.size(0) * positions.size(1);
  auto out = at::empty({positions.size(0), positions.size(1), 3}, positions.options());
  if (total > 0) {
    auto bad = at::zeros({2}, positions.options().dtype(at::kLong));
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "position_gradient_cuda", [&] {
      dispatch_order(op, order, [&](auto width) {
        position_gradient_kernel<scalar_t, decltype(width)::value>
            <<<blocks_for(total), kThreads, 0, stream>>>(
                mesh.data_ptr<scalar_t>(), positions.data_ptr<scalar_t>(),
                values.defined() ? values.data_ptr<scalar_t>() : nullptr, channels,
                positions.size(1), total, g, out.data_ptr<scalar_t>(),
                reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    raise_if_bad(op, bad, positions, g, "values", out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CUDA, m) {
  m.impl("paint", &paint_cuda);
  m.impl("readout", &readout_cuda);
  m.impl("_position_gradient", &position_gradient_cuda);
}

}  // namespace torchpm
