// CUDA kernels of the block transposer (see ../transpose.h). One launch moves
// every chunk: thread e handles buffer word e, finds its chunk by binary search
// over the chunk starts (a few entries, cached), and copies one word between
// the buffer and its place in the tensor. Reads and writes are coalesced on the
// buffer side and along inner rows on the tensor side.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../transpose.h"
#include "launch.cuh"

namespace torchpm {
namespace {

template <typename word_t, bool kPack>
__global__ void copy_blocks_kernel(
    word_t* __restrict__ tensor,
    word_t* __restrict__ buffer,
    const int64_t* __restrict__ start,  // chunks + 1 entries
    int64_t chunks,
    int64_t outer,
    int64_t extent,
    int64_t inner,
    int64_t total) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t plane = outer * inner;  // buffer words per unit of chunk size
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += stride) {
    // The chunk p with start[p] <= e / plane < start[p + 1], skipping empty ones.
    const int64_t q = e / plane;
    int64_t lo = 0, hi = chunks;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (start[mid] <= q) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const int64_t first = start[lo];
    const int64_t size = start[lo + 1] - first;
    const int64_t local = e - plane * first;
    const int64_t o = local / (size * inner);
    const int64_t r = local - o * size * inner;
    const int64_t t = (o * extent + first) * inner + r;
    if (kPack) {
      buffer[e] = tensor[t];
    } else {
      tensor[t] = buffer[e];
    }
  }
}

template <bool kPack>
void launch(const BlockLayout& layout, void* tensor, void* buffer, const at::Device& device) {
  const int64_t total = layout.total_words();
  if (total == 0) {
    return;
  }
  const int64_t chunks = static_cast<int64_t>(layout.start.size()) - 1;
  // The chunk starts travel through pinned memory with an asynchronous copy on the
  // current stream, so a pack/unpack never stalls the host (the caching host
  // allocator keeps the pinned block alive until the copy has run).
  auto host_start = at::empty(
      {chunks + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(layout.start.begin(), layout.start.end(), host_start.data_ptr<int64_t>());
  auto start = host_start.to(device, /*non_blocking=*/true);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535 * 8);
  const int64_t* s = start.data_ptr<int64_t>();
  switch (layout.word_bytes) {
#define TORCHPM_COPY_CASE(BYTES, TYPE)                                             \
  case BYTES:                                                                      \
    copy_blocks_kernel<TYPE, kPack><<<blocks, kThreads, 0, stream>>>(              \
        static_cast<TYPE*>(tensor), static_cast<TYPE*>(buffer), s, chunks,          \
        layout.outer, layout.extent, layout.inner_words, total);                    \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                \
    break;
    TORCHPM_COPY_CASE(1, uint8_t)
    TORCHPM_COPY_CASE(2, uint16_t)
    TORCHPM_COPY_CASE(4, uint32_t)
    TORCHPM_COPY_CASE(8, uint64_t)
    TORCHPM_COPY_CASE(16, uint4)
#undef TORCHPM_COPY_CASE
    default:
      TORCH_CHECK(false, "torchpm block transposer: unexpected word width ", layout.word_bytes);
  }
}

at::Tensor pack_blocks_cuda(const at::Tensor& input, int64_t dim, at::IntArrayRef sizes) {
  const char* op = "torchpm.pack_blocks";
  wrap_block_dim(op, dim, input.dim());
  const c10::cuda::CUDAGuard guard(input.device());
  auto in = input.contiguous();
  auto out = at::empty({in.numel()}, in.options());
  const BlockLayout layout = make_block_layout(
      op, in.sizes(), dim, sizes, in.element_size(), in.data_ptr(), out.data_ptr());
  launch<true>(layout, in.data_ptr(), out.data_ptr(), in.device());
  return out;
}

at::Tensor unpack_blocks_cuda(
    const at::Tensor& buffer,
    at::IntArrayRef shape,
    int64_t dim,
    at::IntArrayRef sizes) {
  const char* op = "torchpm.unpack_blocks";
  check_unpack_buffer(op, buffer, shape);
  wrap_block_dim(op, dim, static_cast<int64_t>(shape.size()));
  const c10::cuda::CUDAGuard guard(buffer.device());
  auto in = buffer.contiguous();
  auto out = at::empty(shape, in.options());
  const BlockLayout layout = make_block_layout(
      op, shape, dim, sizes, in.element_size(), out.data_ptr(), in.data_ptr());
  launch<false>(layout, out.data_ptr(), in.data_ptr(), in.device());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CUDA, m) {
  m.impl("pack_blocks", &pack_blocks_cuda);
  m.impl("unpack_blocks", &unpack_blocks_cuda);
}

}  // namespace torchpm
