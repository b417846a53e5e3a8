// CPU kernels of torchpm::_fd4_gradient and torchpm::_fd4_gradient_transpose
// (finite_difference.h): the three scaled 4-point derivatives of a field, and
// the transpose of that map. One task per (batch member, x, y) row of the
// output; along z the interior is a plain loop the compiler vectorises, and
// the two planes at each end (where the stencil wraps or leaves the array)
// take the general path. Small fields go node by node through the functions
// the CUDA kernels are made of. Both round alike (same expression, same order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../finite_difference.h"
#include "../torchpm.h"

namespace torchpm {
namespace {

constexpr int64_t R = kFiniteDifferenceReach;

// Fields of fewer output nodes than this go node by node through the CUDA
// kernel's own function (finite_difference.h): the tests' small fields run it.
constexpr int64_t kPointwiseNodes = 4096;

template <typename scalar_t>
void gradient_kernel(const FiniteDifferenceArguments& a, at::Tensor& out) {
  const FiniteDifferenceGeometry& geometry = a.geometry;
  const scalar_t* f = a.input.data_ptr<scalar_t>();
  const Fd4Factors<scalar_t> factors(a.scale.data_ptr<scalar_t>());
  const scalar_t* s = factors.s;
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t nx = geometry.field[0], ny = geometry.field[1], nz = geometry.field[2];
  const int64_t ox = geometry.gradient[0], oy = geometry.gradient[1], oz = geometry.gradient[2];
  const int64_t tz = geometry.shift[2];
  // Output z with every z stencil node inside the row without wrapping.
  const int64_t inner_lo = std::min(oz, geometry.periodic[2] ? R : int64_t(0));
  const int64_t inner_hi = std::max(inner_lo, geometry.periodic[2] ? nz - R : oz);
  const int64_t nodes = a.batch * ox * oy * oz;
  if (nodes < kPointwiseNodes) {
    for (int64_t t = 0; t < nodes; ++t) {
      fd4_gradient_at(f, s, geometry, t, o);
    }
    return;
  }
  const int64_t rows = a.batch * ox * oy;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    // A row's three components, each formed by a contiguous loop that vectorises,
    // then interleaved by one loop whose stores are contiguous.
    std::vector<scalar_t> components(3 * oz);
    scalar_t* gx = components.data();
    scalar_t* gy = gx + oz;
    scalar_t* gz = gy + oz;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (ox * oy);
      const int64_t jx = (row / oy) % ox;
      const int64_t jy = row % oy;
      const int64_t ix = jx + geometry.shift[0];
      const int64_t iy = jy + geometry.shift[1];
      auto line = [&](int64_t x, int64_t y) {
        return f + b * geometry.batch_stride +
               (fd4_node(x, nx, geometry.periodic[0]) * ny + fd4_node(y, ny, geometry.periodic[1])) * nz + tz;
      };
      const scalar_t* xp1 = line(ix + 1, iy);
      const scalar_t* xm1 = line(ix - 1, iy);
      const scalar_t* xp2 = line(ix + 2, iy);
      const scalar_t* xm2 = line(ix - 2, iy);
      const scalar_t* yp1 = line(ix, iy + 1);
      const scalar_t* ym1 = line(ix, iy - 1);
      const scalar_t* yp2 = line(ix, iy + 2);
      const scalar_t* ym2 = line(ix, iy - 2);
      const scalar_t* c = line(ix, iy);  // c[k] is the node of output z = k
      for (int64_t k = 0; k < oz; ++k) {
        gx[k] = s[0] * fd4_difference(xp1[k], xm1[k], xp2[k], xm2[k]);
      }
      for (int64_t k = 0; k < oz; ++k) {
        gy[k] = s[1] * fd4_difference(yp1[k], ym1[k], yp2[k], ym2[k]);
      }
      for (int64_t k = inner_lo; k < inner_hi; ++k) {
        gz[k] = s[2] * fd4_difference(c[k + 1], c[k - 1], c[k + 2], c[k - 2]);
      }
      // Wrapped ends (periodic z only; otherwise the inner loop covers all).
      const scalar_t* row0 = c - tz;
      auto value = [&](int64_t k) { return row0[fd4_node(k, nz, true)]; };
      for (int64_t k = 0; k < oz; ++k) {
        if (k == inner_lo) {
          k = inner_hi;
          if (k >= oz) {
            break;
          }
        }
        gz[k] = s[2] * fd4_difference(value(k + 1), value(k - 1), value(k + 2), value(k - 2));
      }
      // Interleaved output: channel ch of output z = k at g[3 k + ch].
      scalar_t* g = o + 3 * row * oz;
      for (int64_t k = 0; k < oz; ++k) {
        g[3 * k] = gx[k];
        g[3 * k + 1] = gy[k];
        g[3 * k + 2] = gz[k];
      }
    }
  });
}

// The transpose (fd4_transpose_at in finite_difference.h), row by row.
template <typename scalar_t>
void transpose_kernel(const FiniteDifferenceArguments& a, at::Tensor& out) {
  const FiniteDifferenceGeometry& geometry = a.geometry;
  const scalar_t* g = a.input.data_ptr<scalar_t>();
  const Fd4Factors<scalar_t> factors(a.scale.data_ptr<scalar_t>());
  const scalar_t* s = factors.s;
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t nx = geometry.field[0], ny = geometry.field[1], nz = geometry.field[2];
  const int64_t ox = geometry.gradient[0], oy = geometry.gradient[1], oz = geometry.gradient[2];
  const int64_t tz = geometry.shift[2];
  const int64_t channel = ox * oy * oz;
  // Field z (j) whose gradient nodes j - tz - 2 .. j - tz + 2 all lie in the row
  // without wrapping.
  const int64_t inner_lo = std::min(nz, tz + R);
  const int64_t inner_hi = std::max(inner_lo, tz + oz - R);
  const int64_t rows = a.batch * nx * ny;
  if (rows * nz < kPointwiseNodes) {
    for (int64_t t = 0; t < rows * nz; ++t) {
      o[t] = fd4_transpose_at(g, s, geometry, t);
    }
    return;
  }
  const std::vector<scalar_t> zeros(oz, scalar_t(0));
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (nx * ny);
      const int64_t jx = (row / ny) % nx;
      const int64_t jy = row % ny;
      const int64_t mx = jx - geometry.shift[0];
      const int64_t my = jy - geometry.shift[1];
      // Row (x, y) of gradient channel `ch`, the zero row outside the array.
      auto line = [&](int64_t ch, int64_t x, int64_t y) {
        const int64_t i = fd4_node(x, ox, geometry.periodic[0]);
        const int64_t k = fd4_node(y, oy, geometry.periodic[1]);
        if (i < 0 || k < 0) {
          return zeros.data();
        }
        return g + b * geometry.batch_stride + ch * channel + (i * oy + k) * oz;
      };
      const scalar_t* xp1 = line(0, mx + 1, my);
      const scalar_t* xm1 = line(0, mx - 1, my);
      const scalar_t* xp2 = line(0, mx + 2, my);
      const scalar_t* xm2 = line(0, mx - 2, my);
      const scalar_t* yp1 = line(1, mx, my + 1);
      const scalar_t* ym1 = line(1, mx, my - 1);
      const scalar_t* yp2 = line(1, mx, my + 2);
      const scalar_t* ym2 = line(1, mx, my - 2);
      const scalar_t* c = line(2, mx, my);
      scalar_t* f = o + row * nz;
      // Field z = j reads gradient z = j - tz (+ the stencil along z).
      for (int64_t j = inner_lo; j < inner_hi; ++j) {
        const int64_t k = j - tz;
        f[j] = -(s[0] * fd4_difference(xp1[k], xm1[k], xp2[k], xm2[k]) +
                 s[1] * fd4_difference(yp1[k], ym1[k], yp2[k], ym2[k]) +
                 s[2] * fd4_difference(c[k + 1], c[k - 1], c[k + 2], c[k - 2]));
      }
      auto value = [&](const scalar_t* r, int64_t k) {
        const int64_t i = fd4_node(k, oz, geometry.periodic[2]);
        return i < 0 ? scalar_t(0) : r[i];
      };
      for (int64_t j = 0; j < nz; ++j) {
        if (j == inner_lo) {
          j = inner_hi;
          if (j >= nz) {
            break;
          }
        }
        const int64_t k = j - tz;
        f[j] = -(s[0] * fd4_difference(value(xp1, k), value(xm1, k), value(xp2, k), value(xm2, k)) +
                 s[1] * fd4_difference(value(yp1, k), value(ym1, k), value(yp2, k), value(ym2, k)) +
                 s[2] * fd4_difference(value(c, k + 1), value(c, k - 1), value(c, k + 2), value(c, k - 2)));
      }
    }
  });
}

at::Tensor fd4_gradient_cpu(const at::Tensor& field, const at::Tensor& scale, std::array<bool, 3> periodic) {
  const auto a = check_finite_difference_arguments("torchpm._fd4_gradient", field, scale, periodic, false);
  const int64_t* shape = a.geometry.gradient;
  auto out = at::empty({a.batch, 3, shape[0], shape[1], shape[2]},
                       a.input.options().memory_format(at::MemoryFormat::ChannelsLast3d));
  if (out.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(a.input.scalar_type(), "fd4_gradient_cpu", [&] { gradient_kernel<scalar_t>(a, out); });
  }
  return out;
}

at::Tensor fd4_gradient_transpose_cpu(
    const at::Tensor& grad, const at::Tensor& scale, std::array<bool, 3> periodic) {
  const auto a = check_finite_difference_arguments("torchpm._fd4_gradient_transpose", grad, scale, periodic, true);
  const int64_t* shape = a.geometry.field;
  auto out = at::empty({a.batch, shape[0], shape[1], shape[2]}, a.input.options());
  if (out.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(
        a.input.scalar_type(), "fd4_gradient_transpose_cpu", [&] { transpose_kernel<scalar_t>(a, out); });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CPU, m) {
  m.impl("_fd4_gradient", &fd4_gradient_cpu);
  m.impl("_fd4_gradient_transpose", &fd4_gradient_transpose_cpu);
}

}  // namespace torchpm
