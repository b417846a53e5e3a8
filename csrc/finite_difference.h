// The 4-point finite-difference derivative of torchpm::_fd4_gradient and its
// transpose, shared by the CPU and CUDA kernels so both round alike.
//
// On a mesh of unit spacing the derivative along an axis is
//
//   D f(i) = (8 (f(i+1) - f(i-1)) - (f(i+2) - f(i-2))) / 12,
//
// whose Fourier multiplier is i (8 sin w - sin 2w) / 6: FastPM's "fd4"
// gradient kernel (torchpm/fourier.py). Applied in real space to the potential
// it gives the three force components from one inverse FFT instead of three.
//
// fd4_gradient_at / fd4_transpose_at compute one output node from its linear
// index: the whole CUDA kernel, and the CPU kernel's path for small fields, so
// the CPU tests run the GPU's index arithmetic too (the CPU's row kernel for
// larger fields is checked against the same oracles).
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <array>
#include <cstdint>

#include "stencil.h"

namespace torchpm {

// Planes the stencil reaches on each side.
constexpr int64_t kFiniteDifferenceReach = 2;

// 8 (p1 - m1) - (p2 - m2): 12 times the derivative from the values at +1, -1,
// +2 and -2 (the factor 1/12 is folded into the per-axis scale).
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T fd4_difference(T p1, T m1, T p2, T m2) {
  return T(8) * (p1 - m1) - (p2 - m2);
}

// Plain-old-data geometry of one call, passed to the CUDA kernels by value: the
// field (nx, ny, nz) and gradient (ox, oy, oz) shapes (along a periodic axis the
// gradient has the field's size and the stencil wraps; along the others it has
// 2 * kFiniteDifferenceReach planes fewer and stays inside the field), the field
// index of gradient index 0 per axis (0 periodic, kFiniteDifferenceReach
// otherwise), and the input's batch stride (a channel slice of a larger mesh is
// read in place).
struct FiniteDifferenceGeometry {
  int64_t batch_stride;
  int64_t field[3];
  int64_t gradient[3];
  int64_t shift[3];
  bool periodic[3];
};

// The checked arguments of _fd4_gradient (transpose false: `input` is the field
// (B, nx, ny, nz)) and of _fd4_gradient_transpose (transpose true: `input` is a
// gradient (B, 3, ox, oy, oz)). Validated in checks.cpp.
struct FiniteDifferenceArguments {
  at::Tensor input;  // contiguous after the batch dimension
  at::Tensor scale;  // (3,) contiguous, the input's dtype and device
  int64_t batch;
  FiniteDifferenceGeometry geometry;
};

FiniteDifferenceArguments check_finite_difference_arguments(
    const char* op,
    const at::Tensor& input,
    const at::Tensor& scale,
    std::array<bool, 3> periodic,
    bool transpose);

// The per-axis factors the kernels multiply by: scale / 12 (fd4_difference
// leaves out the 1/12).
template <typename T>
struct Fd4Factors {
  T s[3];
  C10_HOST_DEVICE explicit Fd4Factors(const T* scale) : s{scale[0] / T(12), scale[1] / T(12), scale[2] / T(12)} {}
};

// Index `i` along an axis of `n` nodes: wrapped when periodic (wrap_index), -1
// outside a non-periodic axis.
C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t fd4_node(int64_t i, int64_t n, bool periodic) {
  if (periodic) {
    return wrap_index(i, n);
  }
  return (i >= 0 && i < n) ? i : -1;
}

// Gradient node `t` (linear index into (B, ox, oy, oz)) of field `f`; writes its
// three channels into `out` (B, 3, ox, oy, oz), interleaved (channels_last_3d:
// channel ch of node t at 3 t + ch; MeshLayout), the layout the readout reads
// fastest. `s`: the scale / 12.
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE void fd4_gradient_at(
    const T* f, const T s[3], const FiniteDifferenceGeometry& g, int64_t t, T* out) {
  const int64_t nx = g.field[0], ny = g.field[1], nz = g.field[2];
  const int64_t ox = g.gradient[0], oy = g.gradient[1], oz = g.gradient[2];
  const int64_t jz = t % oz;
  const int64_t jy = (t / oz) % oy;
  const int64_t jx = (t / (oz * oy)) % ox;
  const int64_t b = t / (oz * oy * ox);
  const int64_t ix = jx + g.shift[0], iy = jy + g.shift[1], iz = jz + g.shift[2];
  auto value = [&](int64_t x, int64_t y, int64_t z) {
    return f[b * g.batch_stride + (fd4_node(x, nx, g.periodic[0]) * ny + fd4_node(y, ny, g.periodic[1])) * nz +
             fd4_node(z, nz, g.periodic[2])];
  };
  T* o = out + 3 * t;
  o[0] = s[0] * fd4_difference(value(ix + 1, iy, iz), value(ix - 1, iy, iz), value(ix + 2, iy, iz),
                               value(ix - 2, iy, iz));
  o[1] = s[1] * fd4_difference(value(ix, iy + 1, iz), value(ix, iy - 1, iz), value(ix, iy + 2, iz),
                               value(ix, iy - 2, iz));
  o[2] = s[2] * fd4_difference(value(ix, iy, iz + 1), value(ix, iy, iz - 1), value(ix, iy, iz + 2),
                               value(ix, iy, iz - 2));
}

// Field node `t` (linear index into (B, nx, ny, nz)) of the transpose applied to
// `grad` (B, 3, ox, oy, oz), planar (contiguous): -sum_i s_i (D_i grad_i)[t - shift], grad taken as
// zero outside a non-periodic axis (the stencil is antisymmetric, so its
// transpose is its negative on the shifted nodes). `s`: the scale / 12.
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T fd4_transpose_at(
    const T* grad, const T s[3], const FiniteDifferenceGeometry& g, int64_t t) {
  const int64_t nx = g.field[0], ny = g.field[1], nz = g.field[2];
  const int64_t ox = g.gradient[0], oy = g.gradient[1], oz = g.gradient[2];
  const int64_t channel = ox * oy * oz;
  const int64_t jz = t % nz;
  const int64_t jy = (t / nz) % ny;
  const int64_t jx = (t / (nz * ny)) % nx;
  const int64_t b = t / (nz * ny * nx);
  const int64_t mx = jx - g.shift[0], my = jy - g.shift[1], mz = jz - g.shift[2];
  auto value = [&](int64_t ch, int64_t x, int64_t y, int64_t z) {
    const int64_t i = fd4_node(x, ox, g.periodic[0]);
    const int64_t k = fd4_node(y, oy, g.periodic[1]);
    const int64_t l = fd4_node(z, oz, g.periodic[2]);
    return (i < 0 || k < 0 || l < 0) ? T(0) : grad[b * g.batch_stride + ch * channel + (i * oy + k) * oz + l];
  };
  return -(s[0] * fd4_difference(value(0, mx + 1, my, mz), value(0, mx - 1, my, mz), value(0, mx + 2, my, mz),
                                 value(0, mx - 2, my, mz)) +
           s[1] * fd4_difference(value(1, mx, my + 1, mz), value(1, mx, my - 1, mz), value(1, mx, my + 2, mz),
                                 value(1, mx, my - 2, mz)) +
           s[2] * fd4_difference(value(2, mx, my, mz + 1), value(2, mx, my, mz - 1), value(2, mx, my, mz + 2),
                                 value(2, mx, my, mz - 2)));
}

}  // namespace torchpm
