// The stencils of a block of consecutive particles at once, on the host. The
// per-particle make_stencil spends most of its time on the three floors and
// their bounds, one particle after another; here the floors of a block's
// coordinates come from one loop the compiler vectorises (int32 truncation,
// for coordinates below 2^30 in magnitude), and only the rest (nodes, offsets,
// weights) is per particle. Exactly make_stencil's nodes and fractions: any
// coordinate outside the fast range goes through first_node itself.
#pragma once

#include <cmath>
#include <cstdint>

#include "../stencil.h"

namespace torchpm {

template <typename acc_t, int K>
struct BlockNodes {
  int32_t node[3][K];  // first node along each axis (first_node), valid particles only
  acc_t t[3][K];       // stencil fraction along each axis
  bool valid[K];       // accepted (first_node true on every axis)
};

// Nodes and fractions of the `count` (<= K) particles at `positions` (3 values
// each, consecutive).
template <typename scalar_t, typename acc_t, int W, int K>
C10_ALWAYS_INLINE void block_first_nodes(
    const scalar_t* positions, int count, const StencilGeometry& g, BlockNodes<acc_t, K>& out) {
  // A short block is padded with zeros (its extra lanes are never read).
  scalar_t padded[3 * K];
  if (count < K) {
    for (int i = 0; i < 3 * K; ++i) {
      padded[i] = i < 3 * count ? positions[i] : scalar_t(0);
    }
    positions = padded;
  }
  // 1 - W/2 is exact in binary floating point (first_node).
  const acc_t shift = acc_t(1) - acc_t(W) / acc_t(2);
  constexpr int32_t kFast = int32_t(1) << 30;
  const acc_t fast_bound = acc_t(kFast);
  int32_t valid[K];
  for (int k = 0; k < K; ++k) {
    valid[k] = 1;
  }
  for (int d = 0; d < 3; ++d) {
    // Read in the loops below (strided loads there vectorise as shuffles; a
    // copy into an array first would stall on store forwarding).
    const scalar_t* x = positions + d;
    // The int32 lanes hold every node when the block's offset and the axis
    // are below 2^30: floor - offset then stays inside int32.
    const bool narrow = g.offset[d] > -kFast && g.offset[d] < kFast && g.shape[d] < kFast;
    const int32_t offset = narrow ? static_cast<int32_t>(g.offset[d]) : 0;
    const int32_t n = narrow ? static_cast<int32_t>(g.shape[d]) : 1;
    int32_t scalar[K];  // lanes left to first_node
    int32_t accepted[K];  // this axis's verdict
    // Branch-free, so that it vectorises: floor(v) = trunc(v) - (trunc(v) > v),
    // with trunc exact in int32 below 2^30; NaN and large values leave the lane
    // to first_node, as does a periodic node more than one period away.
    if (g.periodic[d]) {
      for (int k = 0; k < K; ++k) {
        const acc_t shifted = static_cast<acc_t>(x[3 * k]) + shift;
        const int32_t in = std::abs(shifted) < fast_bound;
        const acc_t v = in ? shifted : acc_t(0);
        const int32_t truncated = static_cast<int32_t>(v);
        const int32_t f = truncated - (static_cast<acc_t>(truncated) > v ? 1 : 0);
        out.t[d][k] = v - static_cast<acc_t>(f);
        int32_t node = f - offset;
        node += node < 0 ? n : 0;
        node -= node >= n ? n : 0;
        out.node[d][k] = node;
        scalar[k] = (in & (node >= 0) & (node < n)) ^ 1;
        accepted[k] = 1;
      }
    } else {
      for (int k = 0; k < K; ++k) {
        const acc_t shifted = static_cast<acc_t>(x[3 * k]) + shift;
        const int32_t in = std::abs(shifted) < fast_bound;
        const acc_t v = in ? shifted : acc_t(0);
        const int32_t truncated = static_cast<int32_t>(v);
        const int32_t f = truncated - (static_cast<acc_t>(truncated) > v ? 1 : 0);
        out.t[d][k] = v - static_cast<acc_t>(f);
        const int32_t node = f - offset;
        out.node[d][k] = node;
        // first_node's block test, first >= 0 and first + W <= n (a lane
        // left to first_node is decided there)
        accepted[k] = (node >= 0) & (node <= n - W);
        scalar[k] = in ^ 1;
      }
    }
    int32_t any = narrow ? 0 : 1;
    for (int k = 0; k < K; ++k) {
      any |= scalar[k];
    }
    if (any) {
      for (int k = 0; k < count; ++k) {
        if (scalar[k] || !narrow) {
          int64_t node = 0;
          acc_t fraction = acc_t(0);
          const bool ok = first_node<acc_t, W>(static_cast<acc_t>(x[3 * k]), d, g, node, fraction);
          out.node[d][k] = static_cast<int32_t>(node);
          out.t[d][k] = fraction;
          accepted[k] = ok ? 1 : 0;
        }
      }
    }
    for (int k = 0; k < K; ++k) {
      valid[k] &= accepted[k];
    }
  }
  for (int k = 0; k < K; ++k) {
    out.valid[k] = k < count && valid[k];
  }
}

// make_stencil for particle k of a block (valid only).
template <typename acc_t, int W, bool with_derivative, int K>
C10_ALWAYS_INLINE void block_stencil(
    const BlockNodes<acc_t, K>& nodes, int k, const StencilGeometry& g, int64_t node_stride,
    Stencil<acc_t, W>& stencil) {
  const int64_t stride[3] = {g.shape[1] * g.shape[2] * node_stride, g.shape[2] * node_stride, node_stride};
  for (int d = 0; d < 3; ++d) {
    fill_axis<acc_t, W, with_derivative>(d, nodes.node[d][k], nodes.t[d][k], g.shape[d], stride[d], stencil);
  }
}

}  // namespace torchpm
