// The stencils of a block of consecutive particles at once, on the host. The
// per-particle make_stencil spends most of its time on the three floors and
// their bounds, one particle after another; here the floors of a block's
// coordinates come from one loop the compiler vectorises (int32 truncation,
// for coordinates below 2^30 in magnitude), and only the rest (nodes, offsets,
// weights) is per particle. Exactly make_stencil's nodes and fractions: any
// coordinate outside the fast range goes through first_node itself.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../stencil.h"

namespace torchpm {

template <typename acc_t, int K>
struct BlockNodes {
  // Particle k's first node along axis d (first_node) at [3 k + d], and its
  // stencil fraction: the positions' own interleaving, so that a block's 3 K
  // coordinates are one contiguous run for the vectorised floors.
  int32_t node[3 * K];
  acc_t t[3 * K];
  bool valid[K];  // accepted (first_node true on every axis)
};

// The lane constants of the blocks' fast path (block_first_nodes), built once
// per call: for lane i (axis i % 3) the shifted coordinates whose floor is a
// node without wrapping, [low, high), and the block's offset. A shifted
// coordinate s >= 0 has floor(s) = trunc(s), so inside [low, high) a lane's
// node is one conversion and one subtraction, and its verdict two compares.
// `usable`: every bound and node exact in acc_t and int32 (below 2^24).
// `accept_low`, `accept_high`: the shifted coordinates first_node accepts
// (cut to +-2^22 on a periodic axis, where it accepts any bounded value), for
// the chunk summary of the plane-ownership paint.
template <typename acc_t, int W, int K>
struct BlockBounds {
  acc_t low[3 * K];
  acc_t high[3 * K];
  acc_t accept_low[3 * K];
  acc_t accept_high[3 * K];
  // The second chance of block_first_nodes: on a periodic axis one period
  // either side of the box, [offset - n, offset + 2 n) (particles that crossed
  // the seam and were not wrapped); on a block axis [low, high) again.
  acc_t wide_low[3 * K];
  acc_t wide_high[3 * K];
  int32_t offset[3 * K];
  int32_t n[3 * K];
  bool usable = true;

  explicit BlockBounds(const StencilGeometry& g) {
    constexpr int64_t kExact = int64_t(1) << 24;
    for (int d = 0; d < 3; ++d) {
      usable = usable && g.offset[d] > -kExact && g.offset[d] < kExact && g.shape[d] < kExact &&
               std::abs(g.offset[d]) + 2 * g.shape[d] < kExact;
    }
    for (int i = 0; i < 3 * K; ++i) {
      const int d = i % 3;
      const int64_t offset = usable ? g.offset[d] : 0;
      // first_node accepts a periodic axis's nodes 0 .. n - 1 (here without
      // wrapping) and a block axis's first nodes 0 .. n - W.
      const int64_t last = g.periodic[d] ? g.shape[d] - 1 : g.shape[d] - W;
      this->offset[i] = static_cast<int32_t>(offset);
      low[i] = static_cast<acc_t>(std::max<int64_t>(offset, 0));
      high[i] = static_cast<acc_t>(std::max<int64_t>(offset + last + 1, 0));
      constexpr int64_t kPeriodicRange = int64_t(1) << 22;
      accept_low[i] = g.periodic[d] ? -static_cast<acc_t>(kPeriodicRange) : low[i];
      accept_high[i] = g.periodic[d] ? static_cast<acc_t>(kPeriodicRange) : high[i];
      const int64_t n_d = usable ? g.shape[d] : 1;
      this->n[i] = static_cast<int32_t>(n_d);
      wide_low[i] = g.periodic[d] ? static_cast<acc_t>(offset - n_d) : low[i];
      wide_high[i] = g.periodic[d] ? static_cast<acc_t>(offset + 2 * n_d) : high[i];
    }
  }
};

// floor(v) as trunc(v) - (trunc(v) > v), exact in int32 below 2^30 in
// magnitude, and the fraction v - floor(v); branch-free so that a loop of it
// vectorises.
template <typename acc_t>
C10_ALWAYS_INLINE int32_t floor_and_fraction(acc_t v, acc_t& t) {
  const int32_t truncated = static_cast<int32_t>(v);
  const int32_t f = truncated - (static_cast<acc_t>(truncated) > v ? 1 : 0);
  t = v - static_cast<acc_t>(f);
  return f;
}

// floor_and_fraction of a shifted coordinate; `in` is false for NaN and large
// values, which are then left to first_node.
template <typename acc_t>
C10_ALWAYS_INLINE int32_t fast_floor(acc_t shifted, acc_t& t, int32_t& in) {
  in = std::abs(shifted) < acc_t(int32_t(1) << 30);
  return floor_and_fraction(in ? shifted : acc_t(0), t);
}

// The fast paths of block_first_nodes over a full block's 3 K coordinates,
// branch-free; true when every lane was accepted (else `out` is partly
// written and the caller goes on). In the box (`kOneWrap` false): a shifted
// coordinate s >= 0 has floor(s) = trunc(s), so a lane is one truncation and
// two compares. Up to one period outside a periodic box (`kOneWrap`:
// particles that crossed the seam and were not wrapped): the floor with its
// correction, then one wrap (a no-op on a block axis, whose nodes are inside
// already).
template <bool kOneWrap, typename scalar_t, typename acc_t, int W, int K>
C10_ALWAYS_INLINE bool block_lanes(
    const scalar_t* positions, const BlockBounds<acc_t, W, K>& bounds, BlockNodes<acc_t, K>& out) {
  const acc_t shift = acc_t(1) - acc_t(W) / acc_t(2);
  const acc_t* low = kOneWrap ? bounds.wide_low : bounds.low;
  const acc_t* high = kOneWrap ? bounds.wide_high : bounds.high;
  int32_t rejected = 0;
  for (int i = 0; i < 3 * K; ++i) {
    const acc_t s = static_cast<acc_t>(positions[i]) + shift;
    const int32_t in = (s >= low[i]) & (s < high[i]);
    const acc_t v = in ? s : acc_t(0);  // NaN and far lanes: no conversion out of range
    if constexpr (kOneWrap) {
      int32_t node = floor_and_fraction(v, out.t[i]) - bounds.offset[i];
      node += node < 0 ? bounds.n[i] : 0;
      node -= node >= bounds.n[i] ? bounds.n[i] : 0;
      out.node[i] = node;
    } else {
      const int32_t f = static_cast<int32_t>(v);  // floor: v >= 0
      out.t[i] = v - static_cast<acc_t>(f);
      out.node[i] = f - bounds.offset[i];
    }
    rejected |= in ^ 1;
  }
  return rejected == 0;
}

// Nodes and fractions of the `count` (<= K) particles at `positions` (3 values
// each, consecutive). A full block whose coordinates all lie inside `bounds`
// (particles in the member's box, or up to a period outside a periodic one: the
// common cases) takes the branch-free loops above; any other block the general
// path below.
template <typename scalar_t, typename acc_t, int W, int K>
C10_ALWAYS_INLINE void block_first_nodes(
    const scalar_t* positions, int count, const StencilGeometry& g, const BlockBounds<acc_t, W, K>& bounds,
    BlockNodes<acc_t, K>& out) {
  if (count == K && bounds.usable &&
      (block_lanes<false>(positions, bounds, out) || block_lanes<true>(positions, bounds, out))) {
    for (int k = 0; k < K; ++k) {
      out.valid[k] = true;
    }
    return;
  }
  // 1 - W/2 is exact in binary floating point (first_node).
  const acc_t shift = acc_t(1) - acc_t(W) / acc_t(2);
  // A short block is padded with zeros (its extra lanes are never read).
  scalar_t padded[3 * K];
  if (count < K) {
    for (int i = 0; i < 3 * K; ++i) {
      padded[i] = i < 3 * count ? positions[i] : scalar_t(0);
    }
    positions = padded;
  }
  constexpr int32_t kFast = int32_t(1) << 30;
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
    // fast_floor per lane; a lane it leaves, or a periodic node more than one
    // period away, goes to first_node.
    if (g.periodic[d]) {
      for (int k = 0; k < K; ++k) {
        int32_t in;
        const int32_t f = fast_floor(static_cast<acc_t>(x[3 * k]) + shift, out.t[3 * k + d], in);
        int32_t node = f - offset;
        node += node < 0 ? n : 0;
        node -= node >= n ? n : 0;
        out.node[3 * k + d] = node;
        scalar[k] = (in & (node >= 0) & (node < n)) ^ 1;
        accepted[k] = 1;
      }
    } else {
      for (int k = 0; k < K; ++k) {
        int32_t in;
        const int32_t f = fast_floor(static_cast<acc_t>(x[3 * k]) + shift, out.t[3 * k + d], in);
        const int32_t node = f - offset;
        out.node[3 * k + d] = node;
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
          out.node[3 * k + d] = static_cast<int32_t>(node);
          out.t[3 * k + d] = fraction;
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

// Calls f(p0, nodes, count) for the blocks of K consecutive particles
// [first, last) (count < K for the last), nodes from block_first_nodes.
template <typename scalar_t, typename acc_t, int W, int K, typename F>
C10_ALWAYS_INLINE void for_each_block(
    const scalar_t* positions, int64_t first, int64_t last, const StencilGeometry& g,
    const BlockBounds<acc_t, W, K>& bounds, const F& f) {
  for (int64_t p0 = first; p0 < last; p0 += K) {
    const int count = static_cast<int>(std::min<int64_t>(K, last - p0));
    BlockNodes<acc_t, K> nodes;
    block_first_nodes<scalar_t, acc_t, W, K>(positions + 3 * p0, count, g, bounds, nodes);
    f(p0, nodes, count);
  }
}

// make_stencil for particle k of a block (valid only).
template <typename acc_t, int W, bool with_derivative, int K>
C10_ALWAYS_INLINE void block_stencil(
    const BlockNodes<acc_t, K>& nodes, int k, const StencilGeometry& g, int64_t node_stride,
    Stencil<acc_t, W>& stencil) {
  const int64_t stride[3] = {g.shape[1] * g.shape[2] * node_stride, g.shape[2] * node_stride, node_stride};
  for (int d = 0; d < 3; ++d) {
    fill_axis<acc_t, W, with_derivative>(d, nodes.node[3 * k + d], nodes.t[3 * k + d], g.shape[d], stride[d], stencil);
  }
}

// The CIC (W = 2) nodes of particle k of a block as element offsets along each
// axis (`node_stride` elements from one z node to the next) and their weights:
// fill_axis's values for W = 2, without the general stencil's arrays.
template <typename acc_t>
struct CicNodes {
  int64_t x[2], y[2], z[2];
  acc_t wx[2], wy[2], wz[2];

  template <int K>
  C10_ALWAYS_INLINE CicNodes(
      const BlockNodes<acc_t, K>& nodes, int k, const StencilGeometry& g, int64_t node_stride) {
    const int64_t y_stride = g.shape[2] * node_stride;
    const int64_t x_stride = g.shape[1] * y_stride;
    const int64_t i0 = nodes.node[3 * k];
    const int64_t j0 = nodes.node[3 * k + 1];
    const int64_t k0 = nodes.node[3 * k + 2];
    x[0] = i0 * x_stride;
    x[1] = (i0 + 1 == g.shape[0] ? 0 : i0 + 1) * x_stride;
    y[0] = j0 * y_stride;
    y[1] = (j0 + 1 == g.shape[1] ? 0 : j0 + 1) * y_stride;
    z[0] = k0 * node_stride;
    z[1] = (k0 + 1 == g.shape[2] ? 0 : k0 + 1) * node_stride;
    const acc_t t[3] = {nodes.t[3 * k], nodes.t[3 * k + 1], nodes.t[3 * k + 2]};
    wx[0] = acc_t(1) - t[0];
    wx[1] = t[0];
    wy[0] = acc_t(1) - t[1];
    wy[1] = t[1];
    wz[0] = acc_t(1) - t[2];
    wz[1] = t[2];
  }
};

}  // namespace torchpm
