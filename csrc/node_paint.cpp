// The device-independent step of the node-by-node paint (node_paint.h): the
// particles put in the order of their keys with ATen, on whatever device they
// are. A stable sort (a radix sort on CUDA) has one result for given keys, so
// this step is deterministic as the passes around it are.
#include <ATen/ATen.h>

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

}  // namespace torchpm
