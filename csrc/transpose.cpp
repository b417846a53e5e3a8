// Argument checks and layout of the block transposer (see transpose.h).
#include "transpose.h"
#include "torchpm.h"

#include <sstream>

namespace torchpm {


int64_t wrap_block_dim(const char* op, int64_t dim, int64_t ndim) {
  TORCH_CHECK_VALUE(
      ndim >= 1, op, ": expected a tensor with at least one dimension, got a scalar.");
  TORCH_CHECK_VALUE(
      dim >= -ndim && dim < ndim, op, ": `dim` = ", dim,
      " is out of range for a tensor with ", ndim, " dimensions.");
  return dim < 0 ? dim + ndim : dim;
}

void check_unpack_buffer(const char* op, const at::Tensor& buffer, at::IntArrayRef shape) {
  int64_t numel = 1;
  for (auto s : shape) {
    TORCH_CHECK_VALUE(s >= 0, op, ": `shape` ", format_list(shape, "[", "]"), " has a negative size.");
    numel *= s;
  }
  TORCH_CHECK_VALUE(
      buffer.dim() == 1 && buffer.numel() == numel, op,
      ": expected `buffer` to be 1-D with prod(shape) = ", numel, " elements for shape ",
      format_list(shape, "[", "]"), ", got a tensor of shape ", format_list(buffer.sizes(), "[", "]"), ".");
}

BlockLayout make_block_layout(
    const char* op,
    at::IntArrayRef shape,
    int64_t dim,
    at::IntArrayRef sizes,
    int64_t element_bytes,
    const void* tensor_data,
    const void* buffer_data) {
  const int64_t ndim = static_cast<int64_t>(shape.size());
  dim = wrap_block_dim(op, dim, ndim);
  TORCH_CHECK_VALUE(
      !sizes.empty(), op, ": expected `sizes` to have one entry per peer, got none.");
  BlockLayout layout;
  layout.start.reserve(sizes.size() + 1);
  layout.start.push_back(0);
  for (auto s : sizes) {
    TORCH_CHECK_VALUE(
        s >= 0, op, ": expected non-negative chunk `sizes`, got ", format_list(sizes, "[", "]"), ".");
    layout.start.push_back(layout.start.back() + s);
  }
  TORCH_CHECK_VALUE(
      layout.start.back() == shape[dim], op, ": `sizes` ", format_list(sizes, "[", "]"), " sum to ",
      layout.start.back(), " but dimension ", dim, " of shape ", format_list(shape, "[", "]"),
      " has size ", shape[dim], ".");
  int64_t inner = 1;
  for (int64_t d = 0; d < dim; ++d) {
    layout.outer *= shape[d];
  }
  for (int64_t d = dim + 1; d < ndim; ++d) {
    inner *= shape[d];
  }
  layout.extent = shape[dim];
  // Widest word that tiles one inner row and keeps both pointers aligned: a
  // complex64 row of even length moves as 16-byte words.
  const int64_t row_bytes = inner * element_bytes;
  const auto a = reinterpret_cast<std::uintptr_t>(tensor_data);
  const auto b = reinterpret_cast<std::uintptr_t>(buffer_data);
  int64_t word = 16;
  while (word > 1 &&
         (row_bytes % word != 0 || a % word != 0 || b % word != 0)) {
    word /= 2;
  }
  layout.word_bytes = word;
  layout.inner_words = row_bytes / word;
  return layout;
}

}  // namespace torchpm
