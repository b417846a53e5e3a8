// CPU kernels of torchpm::_add_scaled and _add_scaled_ (in place): the kick and drift updates x + y * f of
// the integrator in one pass over memory (torch's mul then add read and write
// the product once more). The rounding is exactly theirs: the factor is
// rounded to the dtype, the product rounded, then the sum; never a fused
// multiply-add (the adjoint and resumed runs rely on the same bits as the
// autograd path, which uses torch's two ops). Products of a block go to a small
// buffer before the sums read them, so no compiler can contract the two.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../torchpm.h"
#include "../updates.h"

namespace torchpm {
namespace {

template <typename scalar_t>
void add_scaled_kernel(const scalar_t* x, const scalar_t* y, scalar_t factor, scalar_t* out, int64_t count) {
  constexpr int64_t kBlock = 512;
  at::parallel_for(0, count, 1 << 15, [&](int64_t begin, int64_t end) {
    scalar_t product[kBlock];
    for (int64_t start = begin; start < end; start += kBlock) {
      add_scaled_block(x + start, y + start, factor, out + start, std::min(kBlock, end - start), product);
    }
  });
}

at::Tensor add_scaled_cpu(const at::Tensor& x_in, const at::Tensor& y_in, double factor) {
  at::Tensor x, y;
  std::tie(x, y) = check_add_scaled_arguments("torchpm._add_scaled", x_in, y_in);
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (out.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "add_scaled_cpu", [&] {
      add_scaled_kernel<scalar_t>(
          x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), static_cast<scalar_t>(factor),
          out.data_ptr<scalar_t>(), out.numel());
    });
  }
  return out;
}

// In place (x contiguous): add_scaled_kernel reads x[i] before it writes out[i].
void add_scaled_in_place_cpu(at::Tensor& x, const at::Tensor& y_in, double factor) {
  at::Tensor y = check_add_scaled_in_place_arguments("torchpm._add_scaled_", x, y_in);
  bump_version(x);
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "add_scaled_in_place_cpu", [&] {
      add_scaled_kernel<scalar_t>(
          x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), static_cast<scalar_t>(factor),
          x.data_ptr<scalar_t>(), x.numel());
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CPU, m) {
  m.impl("_add_scaled", &add_scaled_cpu);
  m.impl("_add_scaled_", &add_scaled_in_place_cpu);
}

}  // namespace torchpm
