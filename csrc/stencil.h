// The mass-assignment stencil of one particle (NGP, CIC, TSC, PCS), shared by
// the CPU and CUDA kernels so that both backends compute exactly the same
// weights and indices. One template over the stencil width W (nodes per axis,
// equal to the assignment order p); no per-order copies.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "torchpm.h"

// Unrolls a loop of compile-time length in device code; host compilers that do
// not know the pragma would warn, and unroll constant trip counts themselves.
#ifdef __CUDACC__
#define TORCHPM_UNROLL _Pragma("unroll")
#else
#define TORCHPM_UNROLL
#endif

namespace torchpm {

// Node j of the global mesh sits at x = j. Along each axis a particle at x
// touches the W nodes first, ..., first + W - 1 with
//
//     first = floor(x + 1 - W/2),   t = x + 1 - W/2 - first  in [0, 1),
//
// i.e. NGP the nearest node round-half-up(x), CIC floor(x) and floor(x) + 1,
// TSC the nearest node and its two neighbours, PCS floor(x) - 1 .. floor(x) + 2.
// The weights are the uniform B-spline of degree W - 1 (the top hat convolved
// with itself W - 1 times) evaluated at the node distances, written in t.
// Their sum is 1 for every t, so mass is conserved exactly up to rounding.
template <int W, typename acc_t>
C10_HOST_DEVICE inline void bspline_weights(acc_t t, acc_t* weight, acc_t* derivative) {
  static_assert(W >= 1 && W <= 4, "stencil width must be 1 (NGP) to 4 (PCS)");
  const acc_t one = acc_t(1);
  const acc_t u = one - t;
  if constexpr (W == 1) {
    weight[0] = one;
    derivative[0] = acc_t(0);  // piecewise constant: zero almost everywhere
  } else if constexpr (W == 2) {
    weight[0] = u;
    weight[1] = t;
    derivative[0] = -one;
    derivative[1] = one;
  } else if constexpr (W == 3) {
    const acc_t half = acc_t(0.5);
    weight[0] = half * u * u;
    weight[1] = acc_t(0.75) - (t - half) * (t - half);
    weight[2] = half * t * t;
    derivative[0] = -u;
    derivative[1] = one - acc_t(2) * t;
    derivative[2] = t;
  } else {
    const acc_t sixth = one / acc_t(6);
    weight[0] = sixth * u * u * u;
    weight[1] = sixth * (acc_t(4) - acc_t(6) * t * t + acc_t(3) * t * t * t);
    weight[2] = sixth * (acc_t(4) - acc_t(6) * u * u + acc_t(3) * u * u * u);
    weight[3] = sixth * t * t * t;
    derivative[0] = -acc_t(0.5) * u * u;
    derivative[1] = t * (acc_t(1.5) * t - acc_t(2));
    derivative[2] = u * (acc_t(2) - acc_t(1.5) * u);
    derivative[3] = acc_t(0.5) * t * t;
  }
}

// Indices and separable weights of the W x W x W nodes a particle touches.
// offset[d][k] is node k's contribution to the element index inside one
// channel (local index * element stride of axis d, make_stencil's node stride
// included), weight[d][k] its weight along axis d and derivative[d][k] that
// weight's derivative with respect to x_d.
template <typename acc_t, int W>
struct Stencil {
  static constexpr int width = W;
  bool z_contiguous;  // the z nodes are adjacent in memory (planar, no periodic wrap)
  int64_t offset[3][W];
  acc_t weight[3][W];
  acc_t derivative[3][W];
};

// floor(x) for |x| < kMaxAbsPosition, exactly (the truncation and its integer
// value are exact below 2^62). Host compilers without SSE4.1 turn ::floor into a
// library call per axis and particle, the largest single cost of the CPU
// stencil; CUDA has a floor instruction.
template <typename acc_t>
C10_HOST_DEVICE C10_ALWAYS_INLINE acc_t floor_of_bounded(acc_t x) {
#ifdef __CUDA_ARCH__
  return ::floor(x);
#else
  const acc_t truncated = static_cast<acc_t>(static_cast<int64_t>(x));
  return truncated > x ? truncated - acc_t(1) : truncated;
#endif
}

// Whether a value is finite, on the host and the device.
template <typename acc_t>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool finite_value(acc_t v) {
#ifdef __CUDA_ARCH__
  return ::isfinite(v);
#else
  return std::isfinite(v);
#endif
}

// Whether the `count` values at `v` are all finite (the paints' check_finite).
template <typename scalar_t>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool finite_values(const scalar_t* v, int64_t count) {
  bool finite = true;
  for (int64_t i = 0; i < count; ++i) {
    finite = finite && finite_value(v[i]);
  }
  return finite;
}

// Wraps i into [0, n); the common case (already inside) costs one comparison.
C10_HOST_DEVICE inline int64_t wrap_index(int64_t i, int64_t n) {
  if (i >= 0 && i < n) {
    return i;
  }
  i %= n;
  return i < 0 ? i + n : i;
}

// The first of the W nodes along axis d (local index, wrapped on a periodic
// axis) of a coordinate whose shifted floor (first_node) is floor_x; false when
// on a block axis the stencil leaves the block.
template <int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool node_of_floor(
    int64_t floor_x, int d, const StencilGeometry& g, int64_t& node) {
  const int64_t first = floor_x - g.offset[d];
  const int64_t n = g.shape[d];
  if (g.periodic[d]) {
    node = wrap_index(first, n);
    return true;
  }
  node = first;
  return first >= 0 && first + W <= n;
}

// The first of the W nodes a particle at coordinate x touches along axis d
// (local index, wrapped on a periodic axis) and its stencil fraction t; false
// when x is not finite, absurdly far out, or (on a block axis) the stencil
// leaves the block.
template <typename acc_t, int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool first_node(
    acc_t x, int d, const StencilGeometry& g, int64_t& node, acc_t& t) {
  // !(|x| < bound) is also true for NaN.
  if (!(x < static_cast<acc_t>(kMaxAbsPosition) && x > -static_cast<acc_t>(kMaxAbsPosition))) {
    return false;
  }
  // 1 - W/2 is exact in binary floating point (0.5, 0, -0.5, -1).
  const acc_t shifted = x + (acc_t(1) - acc_t(W) / acc_t(2));
  const acc_t floor_x = floor_of_bounded(shifted);
  t = shifted - floor_x;
  return node_of_floor<W>(static_cast<int64_t>(floor_x), d, g, node);
}

// The first node (local index) and the weights along each axis of a particle
// that an earlier pass accepted (the node-by-node and tiled paints' last pass).
template <typename scalar_t, typename acc_t, int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE void accepted_stencil(
    const scalar_t* position, const StencilGeometry& g, int64_t first[3], acc_t weight[3][W]) {
  acc_t unused[W];
  TORCHPM_UNROLL
  for (int d = 0; d < 3; ++d) {
    acc_t t = acc_t(0);
    first[d] = 0;
    first_node<acc_t, W>(static_cast<acc_t>(position[d]), d, g, first[d], t);
    bspline_weights<W, acc_t>(t, weight[d], unused);
  }
}

// Whether a particle is accepted, and the local index of its first node along
// each axis (first_node; 0 where it is rejected), without the weights and
// offsets of make_stencil: what the paints bin or key particles by.
template <typename scalar_t, typename acc_t, int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool locate(
    const scalar_t* position, const StencilGeometry& g, int64_t node[3]) {
  bool valid = true;
  for (int d = 0; d < 3; ++d) {
    node[d] = 0;
    acc_t t;
    valid = first_node<acc_t, W>(static_cast<acc_t>(position[d]), d, g, node[d], t) && valid;
  }
  return valid;
}

// Fills axis d of `stencil` from the first node (first_node) and the stencil
// fraction t along it; `stride`: elements from one node to the next along d.
template <typename acc_t, int W, bool with_derivative>
C10_HOST_DEVICE C10_ALWAYS_INLINE void fill_axis(
    int d, int64_t node, acc_t t, int64_t n, int64_t stride, Stencil<acc_t, W>& stencil) {
  TORCHPM_UNROLL
  for (int k = 0; k < W; ++k) {
    stencil.offset[d][k] = node * stride;
    // Only a periodic axis can step past its last node (first_node keeps a
    // block axis's stencil inside).
    node = (node + 1 == n) ? 0 : node + 1;
  }
  if (d == 2) {
    stencil.z_contiguous = stencil.offset[2][W - 1] - stencil.offset[2][0] == W - 1;
  }
  acc_t unused[W];
  bspline_weights<W, acc_t>(t, stencil.weight[d], with_derivative ? stencil.derivative[d] : unused);
}

// Fills `stencil` for a particle at (x0, x1, x2) and returns false when it is
// rejected (first_node). `with_derivative` skips the derivatives when not needed.
// `node_stride`: elements from one node to the next along z (MeshLayout; paints
// write planar meshes, 1).
template <typename scalar_t, typename acc_t, int W, bool with_derivative = false>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool make_stencil(
    const scalar_t* position,
    const StencilGeometry& g,
    Stencil<acc_t, W>& stencil,
    int64_t node_stride = 1) {
  const int64_t stride[3] = {g.shape[1] * g.shape[2] * node_stride, g.shape[2] * node_stride, node_stride};
  for (int d = 0; d < 3; ++d) {
    int64_t node;
    acc_t t;
    if (!first_node<acc_t, W>(static_cast<acc_t>(position[d]), d, g, node, t)) {
      return false;
    }
    fill_axis<acc_t, W, with_derivative>(d, node, t, g.shape[d], stride[d], stencil);
  }
  return true;
}

// The readouts below are shared by the CPU and CUDA kernels, so that the CPU
// tests run CUDA's arithmetic and both backends give the same bits.

// Stencil-weighted sum of channel `mc` around one particle. Separable: the z
// dot product first, then the (x, y) weights, W^2 (W + 1) multiplications
// instead of 2 W^3. Adjacent z nodes (planar, no wrap) are read as one run,
// which host compilers vectorise.
template <typename scalar_t, typename acc_t, int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE acc_t interpolate(const scalar_t* mc, const Stencil<acc_t, W>& s) {
  acc_t acc = 0;
  TORCHPM_UNROLL
  for (int a = 0; a < W; ++a) {
    TORCHPM_UNROLL
    for (int b = 0; b < W; ++b) {
      const scalar_t* row = mc + s.offset[0][a] + s.offset[1][b];
      acc_t along_z = 0;
      if (s.z_contiguous) {
        const scalar_t* z = row + s.offset[2][0];
        TORCHPM_UNROLL
        for (int c = 0; c < W; ++c) {
          along_z += s.weight[2][c] * static_cast<acc_t>(z[c]);
        }
      } else {
        TORCHPM_UNROLL
        for (int c = 0; c < W; ++c) {
          along_z += s.weight[2][c] * static_cast<acc_t>(row[s.offset[2][c]]);
        }
      }
      acc += (s.weight[0][a] * s.weight[1][b]) * along_z;
    }
  }
  return acc;
}

// Reads `count` channels (channel_stride apart, from `m`) around one particle
// into out[0 .. count); false when one of them is not finite.
template <typename scalar_t, typename acc_t, int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool read_channels(
    const scalar_t* m, int64_t channel_stride, int64_t count, const Stencil<acc_t, W>& s,
    scalar_t* out) {
  bool finite = true;
  for (int64_t ch = 0; ch < count; ++ch) {
    const acc_t acc = interpolate<scalar_t, acc_t, W>(m + ch * channel_stride, s);
    out[ch] = static_cast<scalar_t>(acc);
    finite = finite && finite_value(acc);
  }
  return finite;
}

// Channels 0 .. K - 1 of an interleaved mesh (MeshLayout: channel stride 1, the
// node stride in the stencil's offsets) around one particle into out[0 .. K),
// a node's K values read together (one cache line or sector); false when one
// is not finite. Per channel the products and sums of interpolate, in the same
// order, so both layouts give the same bits.
template <typename scalar_t, typename acc_t, int W, int K>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool read_interleaved(
    const scalar_t* m, const Stencil<acc_t, W>& s, scalar_t* out) {
  acc_t acc[K];
  TORCHPM_UNROLL
  for (int ch = 0; ch < K; ++ch) {
    acc[ch] = acc_t(0);
  }
  TORCHPM_UNROLL
  for (int a = 0; a < W; ++a) {
    TORCHPM_UNROLL
    for (int b = 0; b < W; ++b) {
      const scalar_t* row = m + s.offset[0][a] + s.offset[1][b];
      acc_t along_z[K];
      TORCHPM_UNROLL
      for (int ch = 0; ch < K; ++ch) {
        along_z[ch] = acc_t(0);
      }
      TORCHPM_UNROLL
      for (int c = 0; c < W; ++c) {
        const scalar_t* node = row + s.offset[2][c];
        TORCHPM_UNROLL
        for (int ch = 0; ch < K; ++ch) {
          along_z[ch] += s.weight[2][c] * static_cast<acc_t>(node[ch]);
        }
      }
      const acc_t wab = s.weight[0][a] * s.weight[1][b];
      TORCHPM_UNROLL
      for (int ch = 0; ch < K; ++ch) {
        acc[ch] += wab * along_z[ch];
      }
    }
  }
  bool finite = true;
  TORCHPM_UNROLL
  for (int ch = 0; ch < K; ++ch) {
    out[ch] = static_cast<scalar_t>(acc[ch]);
    finite = finite && finite_value(acc[ch]);
  }
  return finite;
}

// Channels 0 .. count - 1 around one particle from a mesh in either layout
// (MeshLayout): 3 or 4 channels of an interleaved mesh (the forces; the
// adjoint's forces and density) node by node, any other read channel by
// channel. The readout and the fused readout + position gradient both read
// through it, so they agree bit for bit.
template <typename scalar_t, typename acc_t, int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool read_mesh(
    const scalar_t* m, const MeshLayout& layout, int64_t count, const Stencil<acc_t, W>& s, scalar_t* out) {
  if (layout.node_stride > 1 && count == 3) {
    return read_interleaved<scalar_t, acc_t, W, 3>(m, s, out);
  }
  if (layout.node_stride > 1 && count == 4) {
    return read_interleaved<scalar_t, acc_t, W, 4>(m, s, out);
  }
  return read_channels<scalar_t, acc_t, W>(m, layout.channel, count, s, out);
}

// d/dx of sum_ch value(ch) * interpolate(m + ch * channel_stride) at a stencil
// made with derivatives, into grad[3]. Separable: per (x, y) node pair the z sums
// with the weights and with their derivatives, then the (x, y) factors. The CPU
// and CUDA position gradients are both this function. C > 0: the channel count
// known at compile time, else `channels`.
template <typename scalar_t, typename acc_t, int W, int C, typename Value>
C10_HOST_DEVICE C10_ALWAYS_INLINE void position_gradient_at(
    const scalar_t* m, int64_t channel_stride, int64_t channels, const Stencil<acc_t, W>& s,
    const Value& value, acc_t grad[3]) {
  const int64_t nc = C > 0 ? C : channels;
  grad[0] = grad[1] = grad[2] = acc_t(0);
  TORCHPM_UNROLL
  for (int a = 0; a < W; ++a) {
    TORCHPM_UNROLL
    for (int b = 0; b < W; ++b) {
      const int64_t row = s.offset[0][a] + s.offset[1][b];
      acc_t along_z = 0;
      acc_t along_z_derivative = 0;
      TORCHPM_UNROLL
      for (int c = 0; c < W; ++c) {
        const int64_t idx = row + s.offset[2][c];
        acc_t sum = 0;
        for (int64_t ch = 0; ch < nc; ++ch) {
          sum += value(ch) * static_cast<acc_t>(m[ch * channel_stride + idx]);
        }
        along_z += s.weight[2][c] * sum;
        along_z_derivative += s.derivative[2][c] * sum;
      }
      grad[0] += s.derivative[0][a] * s.weight[1][b] * along_z;
      grad[1] += s.weight[0][a] * s.derivative[1][b] * along_z;
      grad[2] += s.weight[0][a] * s.weight[1][b] * along_z_derivative;
    }
  }
}

}  // namespace torchpm
