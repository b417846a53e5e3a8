// Paint accumulated tile by tile: torch.ops.torchpm._paint_tiled, a CUDA paint
// for clustered particles (the shared-memory method of non-uniform FFT codes).
//
// The scatter paint (cuda/mass_assignment.cu) sends every one of a particle's
// W^3 contributions to global memory with an atomic add; where many particles
// share cells (late times, halos) those atomics serialise on the same
// addresses. Here the mesh is cut into tiles of kTile^3 nodes (by the first
// stencil node of a particle), the particles are binned by tile, and a block
// adds one tile's particles into a shared-memory copy of the tile and its halo
// ((kTile + W - 1)^3 nodes), then adds that copy to the mesh, one atomic per
// nonzero node. The mesh gets a few atomics per node instead of W^3 per
// particle, whatever the clustering.
//
// Passes, each a host/device function below that the CPU runs in a loop (so the
// CPU tests check the GPU's index arithmetic) and CUDA runs per thread or block:
//  1. tile_of, per particle: its tile (rejected particles: none); CUDA counts
//     the particles of each tile and gives each its rank among them.
//  2. (ATen: where each tile's particles start, and how many chunks of at most
//     kTileChunk particles each tile has.) Then per particle: its place in the
//     tile order.
//  3. per chunk (a CUDA block): chunk_of_block finds its tile and particles,
//     add_to_tile adds each particle to the tile copy, tile_node maps the copy's
//     nodes to the mesh.
// The sums are formed in an order that depends on the atomics (CUDA), so this
// is not the deterministic paint (node_paint.h); it equals the scatter paint up
// to rounding.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "stencil.h"
#include "torchpm.h"

namespace torchpm {

// Nodes per tile along each axis, and the most particles one block takes (a
// tile with more is split into several chunks, each its own block).
constexpr int64_t kTile = 8;
constexpr int64_t kTileChunk = 1024;

// Nodes per axis of a tile's copy: the tile and the W - 1 nodes its particles'
// stencils reach beyond it.
template <int W>
constexpr int64_t tile_span() {
  return kTile + W - 1;
}

// The largest tile copy (float64, 4 channels, PCS) must fit the 48 kB of
// shared memory a block gets without opting in.
static_assert(4 * tile_span<4>() * tile_span<4>() * tile_span<4>() * sizeof(double) <= 48 * 1024,
              "the tile copy of the tiled paint outgrows 48 kB of shared memory");

// The tiles of one call's mesh: per axis ceil(n / kTile), and their count per
// batch member.
struct TileGrid {
  int64_t tiles[3];
  int64_t per_member;
};

inline TileGrid make_tile_grid(const StencilGeometry& g) {
  TileGrid grid{};
  grid.per_member = 1;
  for (int d = 0; d < 3; ++d) {
    grid.tiles[d] = (g.shape[d] + kTile - 1) / kTile;
    grid.per_member *= grid.tiles[d];
  }
  return grid;
}

// Refuses calls whose particle or tile counts do not fit the int32 counts,
// ranks and orders of the passes (2^31: 24 GB of float32 positions).
inline void check_tile_sizes(const char* op, int64_t particles, int64_t tiles) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(
      particles <= kMax && tiles + particles / kTileChunk + 1 <= kMax, op,
      ": the tiled paint takes fewer than 2^31 particles (B * N) and tiles of ", kTile, "^3 "
      "nodes per call, got ", particles, " particles and ", tiles, " tiles; paint in parts.");
}

// The blocks of pass 3's launch: an upper bound on the number of chunks (every
// tile has at most one chunk that is not full).
inline int64_t tile_chunk_bound(int64_t tiles, int64_t particles) {
  return tiles + (particles + kTileChunk - 1) / kTileChunk;
}

// Calls f(std::integral_constant<int, C>{}, channel0) for the channel groups the
// tile copy holds at once: the channel counts the simulation uses (1, 3, 4) in
// one group, any other one channel at a time.
template <typename F>
inline void for_channel_groups(int64_t channels, const F& f) {
  switch (channels) {
    case 1:
      f(std::integral_constant<int, 1>{}, int64_t(0));
      break;
    case 3:
      f(std::integral_constant<int, 3>{}, int64_t(0));
      break;
    case 4:
      f(std::integral_constant<int, 4>{}, int64_t(0));
      break;
    default:
      for (int64_t ch = 0; ch < channels; ++ch) {
        f(std::integral_constant<int, 1>{}, ch);
      }
  }
}

// Pass 1: the tile (index over the batch: member * per_member + tile in the
// member) of a particle of batch member `member`; false when the particle is
// rejected (stencil.h first_node).
template <typename scalar_t, typename acc_t, int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool tile_of(
    const scalar_t* position, const StencilGeometry& g, const TileGrid& grid, int64_t member,
    int64_t& tile) {
  int64_t node[3];
  const bool valid = locate<scalar_t, acc_t, W>(position, g, node);
  tile = member * grid.per_member +
         ((node[0] / kTile) * grid.tiles[1] + node[1] / kTile) * grid.tiles[2] + node[2] / kTile;
  return valid;
}

// Pass 3, which chunk block `block` paints: chunk_end[t] is the number of chunks
// of tiles 0 .. t (inclusive prefix sum over `tiles` tiles). Sets the tile and
// the chunk's index within it; false for a block past the last chunk (the grid
// is launched for an upper bound on the chunk count, known without reading the
// counts back).
C10_HOST_DEVICE inline bool chunk_of_block(
    const int32_t* chunk_end, int64_t tiles, int64_t block, int64_t& tile, int64_t& chunk) {
  // The first tile whose chunk_end exceeds `block` (binary search).
  int64_t low = 0;
  int64_t high = tiles;
  while (low < high) {
    const int64_t middle = low + (high - low) / 2;
    if (chunk_end[middle] <= block) {
      low = middle + 1;
    } else {
      high = middle;
    }
  }
  if (low == tiles) {
    return false;
  }
  tile = low;
  chunk = block - (low == 0 ? 0 : chunk_end[low - 1]);
  return true;
}

// The first node (local mesh indices) of tile `tile` of a member.
C10_HOST_DEVICE inline void tile_origin(int64_t tile, const TileGrid& grid, int64_t origin[3]) {
  const int64_t in_member = tile % grid.per_member;
  origin[2] = (in_member % grid.tiles[2]) * kTile;
  origin[1] = ((in_member / grid.tiles[2]) % grid.tiles[1]) * kTile;
  origin[0] = (in_member / (grid.tiles[1] * grid.tiles[2])) * kTile;
}

// Pass 3, per particle: channels channel0 .. channel0 + C - 1 of its
// contributions added into the tile copy `copy` ((C, S, S, S), S =
// tile_span<W>()) with add(pointer, value). The particle is an accepted one of
// the tile whose first node is `origin`. Every contribution is
// (value * w_x * w_y) * w_z, as in the scatter kernels.
template <typename scalar_t, typename acc_t, int W, int C, typename Add>
C10_HOST_DEVICE C10_ALWAYS_INLINE void add_to_tile(
    const scalar_t* position, const scalar_t* values, int64_t channel0, const StencilGeometry& g,
    const int64_t origin[3], scalar_t* copy, const Add& add) {
  constexpr int64_t S = tile_span<W>();
  int64_t local[3];
  acc_t weight[3][W];
  accepted_stencil<scalar_t, acc_t, W>(position, g, local, weight);  // binned
  TORCHPM_UNROLL
  for (int d = 0; d < 3; ++d) {
    local[d] -= origin[d];
  }
  TORCHPM_UNROLL
  for (int ch = 0; ch < C; ++ch) {
    const acc_t value = values ? static_cast<acc_t>(values[channel0 + ch]) : acc_t(1);
    scalar_t* channel = copy + ch * S * S * S;
    TORCHPM_UNROLL
    for (int a = 0; a < W; ++a) {
      TORCHPM_UNROLL
      for (int b = 0; b < W; ++b) {
        scalar_t* row = channel + ((local[0] + a) * S + local[1] + b) * S + local[2];
        const acc_t vab = value * weight[0][a] * weight[1][b];
        TORCHPM_UNROLL
        for (int c = 0; c < W; ++c) {
          add(row + c, static_cast<scalar_t>(vab * weight[2][c]));
        }
      }
    }
  }
}

// Pass 3, flushing: node `index` (linear in (S, S, S)) of the copy of the tile
// at `origin` is mesh node `node` (linear in one channel of the local mesh),
// wrapped on periodic axes; false when it lies outside a block axis (only ever
// holds zeros: an accepted particle's stencil stays in the block).
template <int W>
C10_HOST_DEVICE C10_ALWAYS_INLINE bool tile_node(
    int64_t index, const int64_t origin[3], const StencilGeometry& g, int64_t& node) {
  constexpr int64_t S = tile_span<W>();
  const int64_t local[3] = {index / (S * S), (index / S) % S, index % S};
  node = 0;
  for (int d = 0; d < 3; ++d) {
    int64_t i = origin[d] + local[d];
    if (g.periodic[d]) {
      i = wrap_index(i, g.shape[d]);
    } else if (i >= g.shape[d]) {
      return false;
    }
    node = node * g.shape[d] + i;
  }
  return true;
}

}  // namespace torchpm
