// torchpm's C++ API: the mass-assignment ops for LibTorch programs, no Python.
//
// Link the CMake target torchpm::ops (find_package(torchpm)); that library holds
// the op registrations (TORCH_LIBRARY(torchpm, ...)) and the kernels.
//
// Two layers:
//  * torchpm::ops::*: typed calls of the registered ops through the dispatcher,
//    exactly what torch.ops.torchpm.* calls from Python: the same schema, device
//    dispatch and argument checks. They carry no autograd formula in a program
//    without Python (Python registers the ops' autograd with
//    torch.library.register_autograd): do not differentiate through them.
//  * torchpm::cic_paint / torchpm::cic_readout: the same ops wrapped in
//    torch::autograd::Function, whose backwards call the same ops as Python's
//    (readout's mesh gradient is paint, both position gradients are
//    _position_gradient), so torch::autograd::grad gives the gradients
//    Python gives (a NaN or Inf upstream gradient propagates into them
//    unchecked, as in Python; the forwards check as ops::* do). First
//    derivatives only: a second derivative through a position gradient throws
//    (Python has them, through the pure-torch twin).
//    On CUDA under at::globalContext().setDeterministicAlgorithms(true) their
//    paint is computed node by node without atomics (_paint_deterministic), as
//    in Python; ops::cic_paint always calls the atomic kernel (and raises then).
//
// Geometry and shapes as in Python (torchpm/ops/mass_assignment.py): positions (B, N, 3) in
// mesh-cell units, float32 or float64; meshes (B, nx, ny, nz) or
// (B, C, nx, ny, nz); `offset` is the global index of the local mesh's node
// (0, 0, 0); `periodic[d]` says whether axis d wraps (false: a block axis, whose
// particles must lie inside the block).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

// Exported even when a build hides symbols by default (Linux and macOS only:
// torchpm is not built on Windows).
#define TORCHPM_API __attribute__((visibility("default")))

namespace torchpm {

using Periodic = std::array<bool, 3>;

namespace ops {

// torch.ops.torchpm.paint with order 2 (cloud in cell): positions (B, N, 3),
// weights (B, N), (B, N, C) or none (unit mass) -> mesh (B, nx, ny, nz) or
// (B, C, nx, ny, nz). check_finite=false lets NaN/Inf weights through (as
// Python's check_finite=False; positions are always checked).
inline at::Tensor cic_paint(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    Periodic periodic,
    bool check_finite = true) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpm::paint", "")
                       .typed<at::Tensor(
                           const at::Tensor&, const std::optional<at::Tensor>&,
                           at::IntArrayRef, at::IntArrayRef, Periodic, int64_t, bool)>();
  return op.call(positions, weights, shape, offset, periodic, /*order=*/2, check_finite);
}

// torch.ops.torchpm.readout with order 2 (cloud in cell): mesh (B, [C,] nx, ny, nz)
// at positions (B, N, 3) -> (B, N) or (B, N, C). check_finite=false lets the NaN/Inf
// mesh values a particle reads through.
inline at::Tensor cic_readout(
    const at::Tensor& mesh,
    const at::Tensor& positions,
    at::IntArrayRef offset,
    Periodic periodic,
    bool check_finite = true) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpm::readout", "")
                       .typed<at::Tensor(
                           const at::Tensor&, const at::Tensor&, at::IntArrayRef, Periodic, int64_t, bool)>();
  return op.call(mesh, positions, offset, periodic, /*order=*/2, check_finite);
}

// torch.ops.torchpm._position_gradient with order 2: d/dx_p of
// sum_c values[p, c] * readout(mesh)[p, c] (values none: unit values), (B, N, 3).
inline at::Tensor cic_position_gradient(
    const at::Tensor& mesh,
    const at::Tensor& positions,
    const std::optional<at::Tensor>& values,
    at::IntArrayRef offset,
    Periodic periodic) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpm::_position_gradient", "")
                       .typed<at::Tensor(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           at::IntArrayRef, Periodic, int64_t)>();
  return op.call(mesh, positions, values, offset, periodic, /*order=*/2);
}

}  // namespace ops

// Differentiable cloud-in-cell paint (in positions and weights); see ops::cic_paint.
TORCHPM_API at::Tensor cic_paint(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset = {0, 0, 0},
    Periodic periodic = {true, true, true});

// Differentiable cloud-in-cell readout (in mesh and positions); see ops::cic_readout.
TORCHPM_API at::Tensor cic_readout(
    const at::Tensor& mesh,
    const at::Tensor& positions,
    at::IntArrayRef offset = {0, 0, 0},
    Periodic periodic = {true, true, true});

// When bad particles (outside the block, non-finite) are reported, as in Python
// (torchpm/ops/error_checking.py): "auto" (the default: deferred on CUDA,
// immediate on the CPU), "immediate" (inside the call) or "deferred" (by the next
// torchpm op, or by check(), without a host synchronisation per call). Returns
// the previous mode; the environment variable TORCHPM_ERROR_CHECKING sets the
// starting one.
inline std::string set_error_checking(const std::string& mode) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpm::_set_error_checking", "")
                       .typed<std::string(c10::string_view)>();
  return op.call(mode);
}

// Waits for the particle checks of every earlier torchpm call and throws the
// first error (c10::ValueError naming the op and the argument).
inline void check() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpm::check", "")
                       .typed<void()>();
  op.call();
}

// True when this build of the library contains its CUDA kernels
// (torchpm.has_cuda_kernels() in Python).
TORCHPM_API bool has_cuda_kernels();

// Which build of the CPU mass-assignment kernels runs: "avx2" or "baseline"
// (torchpm.cpu_kernels() in Python). The environment variable
// TORCHPM_CPU_KERNELS ("auto", "avx2" or "baseline"), read when the library is
// loaded, picks one; throws c10::ValueError when it asked for what could not be
// given (the baseline build then runs).
TORCHPM_API std::string cpu_kernels();

}  // namespace torchpm
