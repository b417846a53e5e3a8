// Compiled only into builds without CUDA kernels: a CUDA tensor reaching a
// torchpm op then gets an error that says how to rebuild, instead of the
// dispatcher's generic "could not run with arguments from the CUDA backend".
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

[[noreturn]] void no_cuda_kernels(const char* op) {
  TORCH_CHECK(
      false, op,
      ": got CUDA tensors, but this torchpm build has no CUDA kernels "
      "(torchpm.has_cuda_kernels() is False). Rebuild on a machine whose torch has "
      "CUDA and where nvcc is found: `pip install --no-build-isolation -e .` "
      "(set TORCHPM_FORCE_CUDA=1 to insist, CUDA_HOME to point at the toolkit).");
}

at::Tensor paint_missing(
    const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
    at::IntArrayRef, std::array<bool, 3>, int64_t, bool) {
  no_cuda_kernels("torchpm.paint");
}

at::Tensor paint_deterministic_missing(
    const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
    at::IntArrayRef, std::array<bool, 3>, int64_t, bool) {
  no_cuda_kernels("torchpm._paint_deterministic");
}

at::Tensor paint_tiled_missing(
    const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
    at::IntArrayRef, std::array<bool, 3>, int64_t, bool) {
  no_cuda_kernels("torchpm._paint_tiled");
}

at::Tensor readout_missing(
    const at::Tensor&, const at::Tensor&, at::IntArrayRef, std::array<bool, 3>,
    int64_t, bool) {
  no_cuda_kernels("torchpm.readout");
}

at::Tensor position_gradient_missing(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    at::IntArrayRef, std::array<bool, 3>, int64_t) {
  no_cuda_kernels("torchpm._position_gradient");
}

std::tuple<at::Tensor, at::Tensor> readout_and_position_gradient_missing(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
    at::IntArrayRef, std::array<bool, 3>, int64_t) {
  no_cuda_kernels("torchpm._readout_and_position_gradient");
}

at::Tensor fd4_gradient_missing(const at::Tensor&, const at::Tensor&, std::array<bool, 3>) {
  no_cuda_kernels("torchpm._fd4_gradient");
}

at::Tensor fd4_gradient_transpose_missing(const at::Tensor&, const at::Tensor&, std::array<bool, 3>) {
  no_cuda_kernels("torchpm._fd4_gradient_transpose");
}

at::Tensor add_scaled_missing(const at::Tensor&, const at::Tensor&, double) {
  no_cuda_kernels("torchpm._add_scaled");
}

void add_scaled_in_place_missing(at::Tensor&, const at::Tensor&, double) {
  no_cuda_kernels("torchpm._add_scaled_");
}

void readout_kick_drift_missing(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef, std::array<bool, 3>, int64_t,
    at::ArrayRef<double>, std::optional<double>, bool) {
  no_cuda_kernels("torchpm._readout_kick_drift_");
}

at::Tensor pack_blocks_missing(const at::Tensor&, int64_t, at::IntArrayRef) {
  no_cuda_kernels("torchpm.pack_blocks");
}

at::Tensor unpack_blocks_missing(
    const at::Tensor&, at::IntArrayRef, int64_t, at::IntArrayRef) {
  no_cuda_kernels("torchpm.unpack_blocks");
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CUDA, m) {
  m.impl("paint", &paint_missing);
  m.impl("_paint_deterministic", &paint_deterministic_missing);
  m.impl("_paint_tiled", &paint_tiled_missing);
  m.impl("readout", &readout_missing);
  m.impl("_position_gradient", &position_gradient_missing);
  m.impl("_readout_and_position_gradient", &readout_and_position_gradient_missing);
  m.impl("_fd4_gradient", &fd4_gradient_missing);
  m.impl("_fd4_gradient_transpose", &fd4_gradient_transpose_missing);
  m.impl("_add_scaled", &add_scaled_missing);
  m.impl("_add_scaled_", &add_scaled_in_place_missing);
  m.impl("_readout_kick_drift_", &readout_kick_drift_missing);
  m.impl("pack_blocks", &pack_blocks_missing);
  m.impl("unpack_blocks", &unpack_blocks_missing);
}
