// Launch shape shared by the CUDA kernels: threads per block, and the block
// count of a grid-stride loop.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace torchpm {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over `count` items: one item per thread up to
// the CUDA limit of 2^31 - 1 blocks, beyond which each thread takes several.
inline unsigned int grid_stride_blocks(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::min<int64_t>(blocks, std::numeric_limits<int32_t>::max()));
}

}  // namespace torchpm
