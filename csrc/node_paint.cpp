// The device-independent steps of the node-by-node paint (node_paint.h) and
// of the tiled paint (tile_paint.h), with ATen on whatever device the particles
// are. The node paint's particles are put in the order of their keys: a stable
// sort (a radix sort on CUDA) has one result for given keys, so this step is
// deterministic as the passes around it are.
#include <ATen/ATen.h>

#include "tile_paint.h"
#include "torchpm.h"

namespace torchpm {

ParticlesByKey sort_particles_by_key(
    const at::Tensor& keys, const at::Tensor& positions, const at::Tensor& values) {
  auto [sorted, order] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  ParticlesByKey out;
  out.keys = sorted;
  out.positions = positions.reshape({-1, 3}).index_select(0, order);
  if (values.defined()) {
    out.values = values.reshape({-1, values.size(-1)}).index_select(0, order);
  }
  return out;
}

TilePrefixSums tile_prefix_sums(const at::Tensor& count) {
  TilePrefixSums out;
  out.start = at::cumsum(count, 0, at::kInt) - count;
  // ceil(count / kTileChunk) as floor((count - 1) / kTileChunk) + 1: no overflow
  // for counts near 2^31, and 0 for an empty tile (floor(-1 / kTileChunk) = -1).
  out.chunk_end = at::cumsum(at::div(count - 1, kTileChunk, "floor") + 1, 0, at::kInt);
  return out;
}

}  // namespace torchpm
