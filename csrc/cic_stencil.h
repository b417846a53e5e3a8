// The cloud-in-cell stencil of one particle, shared by the CPU and CUDA kernels
// so that both backends compute exactly the same weights and indices.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "torchpm.h"

namespace torchpm {

// Indices and linear weights of the 2x2x2 nodes a particle touches.
// lo[d] / hi[d] are the local indices of the lower / upper node along axis d,
// frac[d] the distance from the lower node (the upper node's weight).
template <typename acc_t>
struct CicStencil {
  int64_t lo[3];
  int64_t hi[3];
  acc_t frac[3];
};

// Fills `stencil` for a particle at (x0, x1, x2) and returns false when the
// particle is not finite, absurdly far out, or (on a block axis) touches a node
// outside the block.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline bool cic_stencil(
    const scalar_t* position,
    const CicGeometry& g,
    CicStencil<acc_t>& stencil) {
  for (int d = 0; d < 3; ++d) {
    const acc_t x = static_cast<acc_t>(position[d]);
    // !(|x| < bound) is also true for NaN.
    if (!(x < static_cast<acc_t>(kMaxAbsPosition) &&
          x > -static_cast<acc_t>(kMaxAbsPosition))) {
      return false;
    }
    const acc_t floor_x = ::floor(x);
    stencil.frac[d] = x - floor_x;
    int64_t lo = static_cast<int64_t>(floor_x) - g.offset[d];
    const int64_t n = g.shape[d];
    if (g.periodic[d]) {
      lo %= n;
      if (lo < 0) {
        lo += n;
      }
      stencil.lo[d] = lo;
      stencil.hi[d] = (lo + 1 == n) ? 0 : lo + 1;
    } else {
      if (lo < 0 || lo + 1 >= n) {
        return false;
      }
      stencil.lo[d] = lo;
      stencil.hi[d] = lo + 1;
    }
  }
  return true;
}

// Linear index of corner (a, b, c) in {0,1}^3 inside one channel of the mesh.
template <typename acc_t>
C10_HOST_DEVICE inline int64_t cic_corner_index(
    const CicStencil<acc_t>& s,
    const CicGeometry& g,
    int a,
    int b,
    int c) {
  const int64_t i = a ? s.hi[0] : s.lo[0];
  const int64_t j = b ? s.hi[1] : s.lo[1];
  const int64_t k = c ? s.hi[2] : s.lo[2];
  return (i * g.shape[1] + j) * g.shape[2] + k;
}

// Weight of corner (a, b, c).
template <typename acc_t>
C10_HOST_DEVICE inline acc_t cic_corner_weight(
    const CicStencil<acc_t>& s,
    int a,
    int b,
    int c) {
  const acc_t wx = a ? s.frac[0] : acc_t(1) - s.frac[0];
  const acc_t wy = b ? s.frac[1] : acc_t(1) - s.frac[1];
  const acc_t wz = c ? s.frac[2] : acc_t(1) - s.frac[2];
  return wx * wy * wz;
}

// Gradient of corner (a, b, c)'s weight with respect to the position.
template <typename acc_t>
C10_HOST_DEVICE inline void cic_corner_weight_gradient(
    const CicStencil<acc_t>& s,
    int a,
    int b,
    int c,
    acc_t* gradient) {
  const acc_t wx = a ? s.frac[0] : acc_t(1) - s.frac[0];
  const acc_t wy = b ? s.frac[1] : acc_t(1) - s.frac[1];
  const acc_t wz = c ? s.frac[2] : acc_t(1) - s.frac[2];
  const acc_t dx = a ? acc_t(1) : acc_t(-1);
  const acc_t dy = b ? acc_t(1) : acc_t(-1);
  const acc_t dz = c ? acc_t(1) : acc_t(-1);
  gradient[0] = dx * wy * wz;
  gradient[1] = wx * dy * wz;
  gradient[2] = wx * wy * dz;
}

}  // namespace torchpm
