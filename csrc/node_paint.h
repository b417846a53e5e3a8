// Paint computed node by node ("gather" form): the deterministic paint of
// torch.ops.torchpm._paint_deterministic, the path CUDA takes under
// torch.use_deterministic_algorithms(True).
//
// The scatter paint (cpu/mass_assignment.cpp, cuda/mass_assignment.cu) adds
// each particle's W^3 contributions to the mesh; on CUDA with atomics, so a
// node's sum is formed in an order that changes from run to run. Here the
// particles are first ordered by the cell of their first stencil node (a
// stable sort: within a cell, by particle index), and each node then sums, in
// a fixed order, the contributions of the particles of the W^3 cells whose
// stencil covers it. No atomics and no shared accumulator: the result depends
// on the input alone, not on the device, the launch or the number of threads.
//
// Three passes, each a host/device function below that the CPU runs in a loop
// and CUDA runs one thread per item:
//  1. cell_key, per particle: its key b (cells + 1) + cell (b the batch member,
//     cell the linear index of its first stencil node in the local mesh), or
//     b (cells + 1) + cells when the particle is rejected (stencil.h first_node).
//  2. (ATen: a stable sort of the keys, and the particles gathered in that order.)
//     first_of_key, per key: where its particles start in the sorted order.
//  3. paint_node, per mesh node: the sum.
// A rejected particle of batch member b (its key is that member's last) makes
// node (0, 0, 0) of b NaN in every channel, as the scatter paint does, so that a
// mesh used before a deferred report (error_checking.h) cannot look valid.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>
#include <limits>

#include "stencil.h"
#include "torchpm.h"

namespace torchpm {

// The key of a particle of batch member `member` at `position` (pass 1); false
// when the particle is rejected (its key is then the member's last).
template <typename scalar_t, typename acc_t, int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool cell_key(
    const scalar_t* position, const StencilGeometry& g, int64_t member, int64_t& key) {
  const int64_t cells = g.shape[0] * g.shape[1] * g.shape[2];
  int64_t node[3];
  const bool valid = locate<scalar_t, acc_t, W>(position, g, node);
  key = member * (cells + 1) + (valid ? (node[0] * g.shape[1] + node[1]) * g.shape[2] + node[2] : cells);
  return valid;
}

// The first index in sorted[0 .. count) whose key is not below `key` (pass 2):
// the particles of key k are sorted[first_of_key(k) .. first_of_key(k + 1)).
C10_HOST_DEVICE inline int64_t first_of_key(const int64_t* sorted, int64_t count, int64_t key) {
  int64_t low = 0;
  int64_t high = count;
  while (low < high) {
    const int64_t middle = low + (high - low) / 2;
    if (sorted[middle] < key) {
      low = middle + 1;
    } else {
      high = middle;
    }
  }
  return low;
}

// The first stencil node along axis d of the particles that reach node `node`
// at stencil position a (node = first + a), i.e. the cell index to look up;
// false when no accepted particle can have it (a block axis whose stencil would
// leave the block). On a periodic axis shorter than W several a give the same
// cell, and a particle there adds its weight for each of them, as the scatter
// paint adds each of its wrapped stencil nodes.
C10_HOST_DEVICE C10_ALWAYS_INLINE bool source_cell(
    int64_t node, int a, int d, int W, const StencilGeometry& g, int64_t& first) {
  const int64_t n = g.shape[d];
  first = node - a;
  if (g.periodic[d]) {
    first = wrap_index(first, n);
    return true;
  }
  return first >= 0 && first + W <= n;
}

// The sorted particles of one call (pass 3's inputs).
template <typename scalar_t>
struct SortedParticles {
  const scalar_t* positions;  // (B N, 3), sorted by key
  const scalar_t* values;     // (B N, channels), sorted by key, or nullptr (unit weights)
  const int64_t* start;       // (B (cells + 1) + 1,): first_of_key of every key
  int64_t channels;
};

// Pass 3: channels channel0 .. channel0 + C - 1 of node (i, j, k) of batch
// member b, into out[ch * channel_stride] (out: that node in channel channel0
// of member b). The sum runs over the stencil positions (a, b, c) in order and,
// for each, over the particles of its source cell in sorted order; every
// contribution is (value * w_x * w_y) * w_z, as in the scatter kernels.
template <typename scalar_t, typename acc_t, int W, int C>
C10_HOST_DEVICE C10_ALWAYS_INLINE void paint_node(
    const SortedParticles<scalar_t>& particles, const StencilGeometry& g, int64_t member,
    int64_t i, int64_t j, int64_t k, int64_t channel0, int64_t channel_stride, scalar_t* out) {
  const int64_t cells = g.shape[0] * g.shape[1] * g.shape[2];
  const int64_t base = member * (cells + 1);
  acc_t sum[C];
  TORCHPM_UNROLL
  for (int ch = 0; ch < C; ++ch) {
    sum[ch] = acc_t(0);
  }
  TORCHPM_UNROLL
  for (int a = 0; a < W; ++a) {
    int64_t sx;
    if (!source_cell(i, a, 0, W, g, sx)) {
      continue;
    }
    TORCHPM_UNROLL
    for (int b = 0; b < W; ++b) {
      int64_t sy;
      if (!source_cell(j, b, 1, W, g, sy)) {
        continue;
      }
      TORCHPM_UNROLL
      for (int c = 0; c < W; ++c) {
        int64_t sz;
        if (!source_cell(k, c, 2, W, g, sz)) {
          continue;
        }
        const int64_t key = base + (sx * g.shape[1] + sy) * g.shape[2] + sz;
        const int64_t stop = particles.start[key + 1];
        for (int64_t q = particles.start[key]; q < stop; ++q) {
          int64_t first[3];
          acc_t weight[3][W];
          accepted_stencil<scalar_t, acc_t, W>(particles.positions + 3 * q, g, first, weight);  // keyed
          const scalar_t* v = particles.values ? particles.values + q * particles.channels + channel0 : nullptr;
          TORCHPM_UNROLL
          for (int ch = 0; ch < C; ++ch) {
            const acc_t value = v ? static_cast<acc_t>(v[ch]) : acc_t(1);
            sum[ch] += (value * weight[0][a] * weight[1][b]) * weight[2][c];
          }
        }
      }
    }
  }
  if (i == 0 && j == 0 && k == 0 && particles.start[base + cells + 1] > particles.start[base + cells]) {
    TORCHPM_UNROLL
    for (int ch = 0; ch < C; ++ch) {
      sum[ch] += std::numeric_limits<acc_t>::quiet_NaN();
    }
  }
  TORCHPM_UNROLL
  for (int ch = 0; ch < C; ++ch) {
    out[ch * channel_stride] = static_cast<scalar_t>(sum[ch]);
  }
}

// Pass 3 for node `index` (the linear index of (member, i, j, k) in a
// (B, nx, ny, nz) mesh) and every channel of the (B, channels, nx, ny, nz)
// `mesh`: the channel counts the simulation uses (1, 3, 4) in one sweep, any
// other one channel at a time.
template <typename scalar_t, typename acc_t, int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE void paint_node_at(
    const SortedParticles<scalar_t>& particles, const StencilGeometry& g, int64_t index,
    scalar_t* mesh) {
  const int64_t cells = g.shape[0] * g.shape[1] * g.shape[2];
  const int64_t member = index / cells;
  const int64_t cell = index - member * cells;
  const int64_t k = cell % g.shape[2];
  const int64_t j = (cell / g.shape[2]) % g.shape[1];
  const int64_t i = cell / (g.shape[1] * g.shape[2]);
  const int64_t channels = particles.channels;
  scalar_t* out = mesh + member * channels * cells + cell;
  switch (channels) {
    case 1:
      paint_node<scalar_t, acc_t, W, 1>(particles, g, member, i, j, k, 0, cells, out);
      break;
    case 3:
      paint_node<scalar_t, acc_t, W, 3>(particles, g, member, i, j, k, 0, cells, out);
      break;
    case 4:
      paint_node<scalar_t, acc_t, W, 4>(particles, g, member, i, j, k, 0, cells, out);
      break;
    default:
      for (int64_t ch = 0; ch < channels; ++ch) {
        paint_node<scalar_t, acc_t, W, 1>(particles, g, member, i, j, k, ch, cells, out + ch * cells);
      }
  }
}

}  // namespace torchpm
