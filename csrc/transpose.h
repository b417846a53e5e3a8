// Geometry of the block transposer (pack_blocks / unpack_blocks), shared by the
// CPU and CUDA kernels.
//
// A contiguous tensor is viewed as (outer, extent, inner) around the split
// dimension. Chunk p covers indices [start[p], start[p + 1]) of that dimension
// and occupies buffer words [outer * inner * start[p], outer * inner * start[p + 1]),
// row-major as (outer, size[p], inner). Copies move raw words, so every dtype
// (complex included) is handled by one kernel per word width.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace torchpm {

struct BlockLayout {
  int64_t outer = 1;        // product of the sizes before `dim`
  int64_t extent = 0;       // size of `dim` (the sum of the chunk sizes)
  int64_t inner_words = 1;  // product of the sizes after `dim`, in words
  int64_t word_bytes = 1;   // 1, 2, 4, 8 or 16
  std::vector<int64_t> start;  // chunk starts along `dim`, P + 1 entries
  int64_t total_words() const { return outer * extent * inner_words; }
};

// Validates (dim, sizes) against `shape` and returns the layout. `dim` may be
// negative. The word width is the widest that divides the bytes of one inner
// row and the alignment of both data pointers.
BlockLayout make_block_layout(
    const char* op,
    at::IntArrayRef shape,
    int64_t dim,
    at::IntArrayRef sizes,
    int64_t element_bytes,
    const void* tensor_data,
    const void* buffer_data);

// Checks shared by the pack and unpack front ends of every backend.
int64_t wrap_block_dim(const char* op, int64_t dim, int64_t ndim);
void check_unpack_buffer(const char* op, const at::Tensor& buffer, at::IntArrayRef shape);

}  // namespace torchpm
