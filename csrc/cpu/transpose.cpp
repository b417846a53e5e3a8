// CPU kernels of the block transposer: pack_blocks gathers the chunks of a
// tensor into one contiguous block per peer, unpack_blocks scatters them back.
// Each (chunk, outer index) pair is one contiguous row on both sides, so the
// copy is a memcpy per row, rows spread over threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "../transpose.h"

namespace torchpm {
namespace {

enum class Direction { kPack, kUnpack };

void copy_blocks(
    const BlockLayout& layout,
    char* tensor,
    char* buffer,
    Direction direction) {
  const int64_t chunks = static_cast<int64_t>(layout.start.size()) - 1;
  const int64_t rows = chunks * layout.outer;
  const int64_t word = layout.word_bytes;
  const int64_t inner = layout.inner_words;
  // About 64 KiB per task keeps threads busy without paying for tiny tasks.
  const int64_t row_bytes_estimate =
      std::max<int64_t>(1, layout.extent / std::max<int64_t>(chunks, 1) * inner * word);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / row_bytes_estimate);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t p = row / layout.outer;
      const int64_t o = row % layout.outer;
      const int64_t size = layout.start[p + 1] - layout.start[p];
      const int64_t bytes = size * inner * word;
      if (bytes == 0) {
        continue;
      }
      char* t = tensor + ((o * layout.extent + layout.start[p]) * inner) * word;
      char* b = buffer + (layout.outer * layout.start[p] + o * size) * inner * word;
      if (direction == Direction::kPack) {
        std::memcpy(b, t, bytes);
      } else {
        std::memcpy(t, b, bytes);
      }
    }
  });
}

at::Tensor pack_blocks_cpu(const at::Tensor& input, int64_t dim, at::IntArrayRef sizes) {
  const char* op = "torchpm.pack_blocks";
  wrap_block_dim(op, dim, input.dim());
  auto in = input.contiguous();
  auto out = at::empty({in.numel()}, in.options());
  const BlockLayout layout = make_block_layout(
      op, in.sizes(), dim, sizes, in.element_size(), in.data_ptr(), out.data_ptr());
  if (in.numel() > 0) {
    copy_blocks(
        layout, static_cast<char*>(in.data_ptr()), static_cast<char*>(out.data_ptr()),
        Direction::kPack);
  }
  return out;
}

at::Tensor unpack_blocks_cpu(
    const at::Tensor& buffer,
    at::IntArrayRef shape,
    int64_t dim,
    at::IntArrayRef sizes) {
  const char* op = "torchpm.unpack_blocks";
  check_unpack_buffer(op, buffer, shape);
  wrap_block_dim(op, dim, static_cast<int64_t>(shape.size()));
  auto in = buffer.contiguous();
  auto out = at::empty(shape, in.options());
  const BlockLayout layout = make_block_layout(
      op, shape, dim, sizes, in.element_size(), out.data_ptr(), in.data_ptr());
  if (in.numel() > 0) {
    copy_blocks(
        layout, static_cast<char*>(out.data_ptr()), static_cast<char*>(in.data_ptr()),
        Direction::kUnpack);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CPU, m) {
  m.impl("pack_blocks", &pack_blocks_cpu);
  m.impl("unpack_blocks", &unpack_blocks_cpu);
}

}  // namespace torchpm
