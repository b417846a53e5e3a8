// The torchpm operator library: every schema is declared here, once. Each
// backend file (cpu/*.cpp, cuda/*.cu) adds its kernels with TORCH_LIBRARY_IMPL;
// fake kernels and autograd for Python callers live in Python (torchpm/ops/),
// the C++ API's autograd in api.cpp.
//
// Nothing in libtorchpm_ops uses Python: a LibTorch program links it (CMake
// target torchpm::ops) and the Python package loads the same sources, built by
// setup.py, with torch.ops.load_library.
#include <torch/library.h>

#include <string>

#include "cpu/kernel_variant.h"
#include "error_checking.h"

namespace {

bool cuda_kernels_built() {
#ifdef TORCHPM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string get_error_checking() {
  return torchpm::error_checking_name(torchpm::error_checking());
}

std::string set_error_checking(c10::string_view mode) {
  const auto next = torchpm::parse_error_checking(std::string(mode), "`mode`");
  return torchpm::error_checking_name(torchpm::set_error_checking(next));
}

}  // namespace

TORCH_LIBRARY(torchpm, m) {
  // Mass assignment of order 1 (NGP), 2 (CIC), 3 (TSC) or 4 (PCS); the stencil
  // convention and the block geometry are described in torchpm.h / stencil.h.
  // Paint: positions (B, N, 3), weights (B, N) or (B, N, C) or None (unit
  // weights) -> mesh (B, nx, ny, nz) or (B, C, nx, ny, nz). check_finite: raise
  // on NaN/Inf weights.
  m.def(
      "paint(Tensor positions, Tensor? weights, int[] shape, int[] offset, "
      "bool[3] periodic, int order=2, bool check_finite=True) -> Tensor");
  // The same paint computed node by node (node_paint.h): every node sums its
  // contributions in an order fixed by the input, without atomics, so the
  // result is the same on every run and device. torchpm.ops.paint takes it on
  // CUDA under torch.use_deterministic_algorithms(True), where `paint` adds
  // with atomics; on the CPU `paint` is deterministic already.
  m.def(
      "_paint_deterministic(Tensor positions, Tensor? weights, int[] shape, int[] offset, "
      "bool[3] periodic, int order=2, bool check_finite=True) -> Tensor");
  // The same paint accumulated tile by tile (tile_paint.h): the particles binned
  // by tiles of 8^3 nodes, each tile summed in shared memory and added to the
  // mesh once. On CUDA it trades the scatter's W^3 global atomics per particle
  // for a few per node, for clustered particles; torchpm.ops.set_paint_method
  // chooses it. On the CPU it runs the CUDA passes in order (for the tests).
  m.def(
      "_paint_tiled(Tensor positions, Tensor? weights, int[] shape, int[] offset, "
      "bool[3] periodic, int order=2, bool check_finite=True) -> Tensor");
  // Readout: mesh (B, nx, ny, nz) or (B, C, nx, ny, nz) at positions (B, N, 3)
  // -> values (B, N) or (B, N, C). check_finite: raise when a particle reads a
  // NaN/Inf mesh value.
  m.def(
      "readout(Tensor mesh, Tensor positions, int[] offset, bool[3] periodic, "
      "int order=2, bool check_finite=True) -> Tensor");
  // d/dx_p of sum_c values[p, c] * readout(mesh)[p, c]: the position gradient of
  // both readout (values = upstream gradient) and paint (mesh = upstream
  // gradient, values = weights). Returns (B, N, 3) (zero for order 1).
  m.def(
      "_position_gradient(Tensor mesh, Tensor positions, Tensor? values, "
      "int[] offset, bool[3] periodic, int order=2) -> Tensor");
  // The readout of mesh channels 0 .. readout_channels-1 (B, N, K), equal bit
  // for bit to `readout`, and the _position_gradient of all channels (B, N, 3),
  // in one pass over the particles: the adjoint's reverse step needs both at the
  // same positions (torchpm/adjoint.py). Not differentiable.
  m.def(
      "_readout_and_position_gradient(Tensor mesh, Tensor positions, Tensor? values, "
      "int readout_channels, int[] offset, bool[3] periodic, int order=2) -> (Tensor, Tensor)");
  // The force field from the potential in real space (finite_difference.h):
  // field (B, nx, ny, nz) -> (B, 3, ox, oy, oz), channel i = scale[i] * D_i
  // field with D the 4-point finite difference (Fourier multiplier i (8 sin w -
  // sin 2w) / 6, unit node spacing). Along a periodic axis the stencil wraps and
  // o = n; along the others it stays inside the field and o = n - 4 (a block
  // whose halo of 2 is filled). scale: (3,), the field's dtype and device.
  // _fd4_gradient_transpose is the transpose of that map (grad (B, 3, ox, oy,
  // oz) -> (B, nx, ny, nz)), its backward with respect to the field.
  m.def("_fd4_gradient(Tensor field, Tensor scale, bool[3] periodic) -> Tensor");
  m.def("_fd4_gradient_transpose(Tensor grad, Tensor scale, bool[3] periodic) -> Tensor");
  // x + y * factor (factor rounded to x's dtype first), with the rounding of
  // torch.mul then torch.add (no fused multiply-add) in one pass: the kick and
  // drift updates of the integrator (torchpm/pm.py add_scaled). x and y of one
  // shape, dtype and device.
  m.def("_add_scaled(Tensor x, Tensor y, float factor) -> Tensor");
  // The same update written into x (contiguous): the integrator's steps on
  // particle arrays it owns, without a new buffer (and its first-touch page
  // faults) per update.
  m.def("_add_scaled_(Tensor(a!) x, Tensor y, float factor) -> ()");
  // The integrator's updates fused into the readout of the force (B, 3, nx, ny,
  // nz) at positions (B, N, 3): F = readout(mesh, positions), then momenta +=
  // F * k for each of the one or two `kicks`, then, with `drift`, positions +=
  // momenta * drift, every update rounded as _add_scaled_ does, so the result is
  // that composition bit for bit, without writing F. torchpm/pm.py
  // (readout_kick_drift_) takes it for the second kick of a step and the first
  // kick and drift of the next. Not differentiable (arrays the integrator owns,
  // outside any graph).
  m.def(
      "_readout_kick_drift_(Tensor mesh, Tensor(a!) positions, Tensor(b!) momenta, int[] offset, "
      "bool[3] periodic, int order, float[] kicks, float? drift, bool check_finite=True) -> ()");
  // Spatial order of particles (torchpm/ordering.py): the permutation (B, N)
  // int64 that sorts each batch member's particles by the (x, y) row of the
  // block (shape, offset; coordinates wrapped with period) they lie in, and by
  // id within a row; empty slots (id < 0) and non-finite positions last.
  m.def(
      "_spatial_order(Tensor positions, Tensor ids, int[] shape, int[] offset, "
      "int[] period) -> Tensor");
  // The slots a migration stage frees (torchpm/distributed/particles.py): flat
  // indices, increasing, of the empty slots (id < 0) and of the occupied ones
  // whose coordinate `axis` is outside [low, high) (NaN stays); and, as a 0-d
  // int64, the number of occupied slots with a non-finite coordinate or one
  // at or beyond +-2^40 cells.
  m.def("_migration_holes(Tensor positions, Tensor ids, int axis, float low, float high) -> (Tensor, Tensor)");
  // Permutation of per-particle rows: _gather_rows: out[b, k, ...] = input[b,
  // order[b, k], ...]; _scatter_rows: out[b, order[b, k], ...] = input[b, k, ...]
  // (for a permutation, each is the inverse and the adjoint of the other).
  m.def("_gather_rows(Tensor input, Tensor order) -> Tensor");
  m.def("_scatter_rows(Tensor input, Tensor order) -> Tensor");
  // Block transposer. pack_blocks splits `input` along `dim` into consecutive
  // chunks of `sizes` (summing to input.size(dim)) and lays them out one after
  // another as a 1-D buffer, chunk p being input.narrow(dim, sum(sizes[:p]),
  // sizes[p]) in row-major order, so an all-to-all moves one contiguous block
  // per peer. unpack_blocks is its inverse (and adjoint): it takes such a buffer
  // and returns the tensor of `shape` whose `dim` is the concatenation of the
  // chunks. Any dtype (complex included), any number of dimensions.
  m.def("pack_blocks(Tensor input, int dim, int[] sizes) -> Tensor");
  m.def("unpack_blocks(Tensor buffer, int[] shape, int dim, int[] sizes) -> Tensor");
  // All-to-all of a 1-D buffer over the c10d ProcessGroup registered under
  // `group_name`: chunk p of `input` (input_split_sizes[p] elements) goes to
  // group rank p; chunk q of the result comes from group rank q
  // (output_split_sizes[q] elements). Blocks until the collective completes on
  // CPU (gloo); on CUDA (NCCL) the current stream waits for it.
  m.def(
      "_all_to_all(Tensor input, int[] input_split_sizes, int[] output_split_sizes, "
      "str group_name) -> Tensor");
  m.def("_cuda_kernels_built() -> bool", &cuda_kernels_built);
  // Which build of the CPU mass-assignment kernels is registered: "avx2" or
  // "baseline" (cpu/kernel_variant.h; raises on a bad TORCHPM_CPU_KERNELS).
  m.def("_cpu_kernels() -> str", &torchpm::cpu_kernel_variant);
  // When the mass-assignment ops report bad particles (error_checking.h):
  // "auto" (deferred on CUDA, immediate on the CPU), "immediate" or "deferred".
  // _set_error_checking returns the previous mode; check() raises the first
  // error left by earlier calls, after waiting for every pending count.
  m.def("_error_checking() -> str", &get_error_checking);
  m.def("_set_error_checking(str mode) -> str", &set_error_checking);
  m.def("check() -> ()", &torchpm::check_errors);
}
