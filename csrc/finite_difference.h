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
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace torchpm {

// Planes the stencil reaches on each side.
constexpr int64_t kFiniteDifferenceReach = 2;

// 8 (p1 - m1) - (p2 - m2): 12 times the derivative from the values at +1, -1,
// +2 and -2 (the factor 1/12 is folded into the per-axis scale).
template <typename T>
C10_HOST_DEVICE C10_ALWAYS_INLINE T fd4_difference(T p1, T m1, T p2, T m2) {
  return T(8) * (p1 - m1) - (p2 - m2);
}

}  // namespace torchpm
