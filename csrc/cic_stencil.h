// The cloud-in-cell stencil of one particle, shared by the CPU and CUDA kernels
// so that both backends compute exactly the same weights and indices.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "torchpm.h"

namespace torchpm {

// Indices and linear weights of the 2x2x2 nodes a particle touches.
// offset[d][0/1] is the lower / upper node's contribution to the linear index
// inside one channel (index * stride of axis d), weight[d][0/1] its linear
// weight along axis d; lo[d] and frac[d] are kept for diagnostics.
template <typename acc_t>
struct CicStencil {
  int64_t lower_x;  // local x index of the lower node (binning by plane)
  int64_t offset[3][2];
  acc_t weight[3][2];
};

// Wraps i into [0, n); the common case (already inside) costs one comparison.
C10_HOST_DEVICE inline int64_t wrap_index(int64_t i, int64_t n) {
  if (i >= 0 && i < n) {
    return i;
  }
  i %= n;
  return i < 0 ? i + n : i;
}

// Fills `stencil` for a particle at (x0, x1, x2) and returns false when the
// particle is not finite, absurdly far out, or (on a block axis) touches a node
// outside the block.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline bool cic_stencil(
    const scalar_t* position,
    const CicGeometry& g,
    CicStencil<acc_t>& stencil) {
  const int64_t stride[3] = {g.shape[1] * g.shape[2], g.shape[2], 1};
  for (int d = 0; d < 3; ++d) {
    const acc_t x = static_cast<acc_t>(position[d]);
    // !(|x| < bound) is also true for NaN.
    if (!(x < static_cast<acc_t>(kMaxAbsPosition) &&
          x > -static_cast<acc_t>(kMaxAbsPosition))) {
      return false;
    }
    const acc_t floor_x = ::floor(x);
    const acc_t frac = x - floor_x;
    int64_t lo = static_cast<int64_t>(floor_x) - g.offset[d];
    int64_t hi;
    const int64_t n = g.shape[d];
    if (g.periodic[d]) {
      lo = wrap_index(lo, n);
      hi = (lo + 1 == n) ? 0 : lo + 1;
    } else {
      if (lo < 0 || lo + 1 >= n) {
        return false;
      }
      hi = lo + 1;
    }
    if (d == 0) {
      stencil.lower_x = lo;
    }
    stencil.offset[d][0] = lo * stride[d];
    stencil.offset[d][1] = hi * stride[d];
    stencil.weight[d][0] = acc_t(1) - frac;
    stencil.weight[d][1] = frac;
  }
  return true;
}

// Linear index of corner (a, b, c) in {0,1}^3 inside one channel of the mesh.
template <typename acc_t>
C10_HOST_DEVICE inline int64_t cic_corner_index(
    const CicStencil<acc_t>& s,
    const CicGeometry&,
    int a,
    int b,
    int c) {
  return s.offset[0][a] + s.offset[1][b] + s.offset[2][c];
}

// Weight of corner (a, b, c).
template <typename acc_t>
C10_HOST_DEVICE inline acc_t cic_corner_weight(
    const CicStencil<acc_t>& s,
    int a,
    int b,
    int c) {
  return s.weight[0][a] * s.weight[1][b] * s.weight[2][c];
}

// Linear indices and weights of all 8 corners, corner = 4a + 2b + c.
template <typename acc_t>
C10_HOST_DEVICE inline void cic_corners(
    const CicStencil<acc_t>& s,
    const CicGeometry& g,
    int64_t* index,
    acc_t* weight) {
#pragma unroll
  for (int corner = 0; corner < 8; ++corner) {
    const int a = corner >> 2, b = (corner >> 1) & 1, c = corner & 1;
    index[corner] = cic_corner_index(s, g, a, b, c);
    weight[corner] = cic_corner_weight(s, a, b, c);
  }
}

// Gradient of corner (a, b, c)'s weight with respect to the position.
template <typename acc_t>
C10_HOST_DEVICE inline void cic_corner_weight_gradient(
    const CicStencil<acc_t>& s,
    int a,
    int b,
    int c,
    acc_t* gradient) {
  const acc_t dx = a ? acc_t(1) : acc_t(-1);
  const acc_t dy = b ? acc_t(1) : acc_t(-1);
  const acc_t dz = c ? acc_t(1) : acc_t(-1);
  gradient[0] = dx * s.weight[1][b] * s.weight[2][c];
  gradient[1] = s.weight[0][a] * dy * s.weight[2][c];
  gradient[2] = s.weight[0][a] * s.weight[1][b] * dz;
}

}  // namespace torchpm
