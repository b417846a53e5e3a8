// Shared declarations of the torchpm extension: the geometry of a CIC mesh,
// argument checks used by every backend, and the diagnostics that turn a
// failed particle check into an error a user can act on.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <array>
#include <cstdint>
#include <string>

namespace torchpm {

// Positions whose magnitude exceeds this many cells are rejected: beyond it the
// fractional part of a float is meaningless and the cell index would overflow.
constexpr double kMaxAbsPosition = 1099511627776.0;  // 2^40

// Where a (B, [C,] nx, ny, nz) mesh sits in the global mesh.
//
// For each axis d, a particle at global coordinate x (mesh-cell units, node j of
// the global mesh sits at x = j) touches the global nodes floor(x) and
// floor(x) + 1. They map to the local indices floor(x) - offset[d] and that plus
// one. On a periodic axis the local index is taken modulo shape[d]; on a block
// axis both indices must lie in [0, shape[d]) or the particle is rejected.
struct CicGeometry {
  int64_t shape[3];
  int64_t offset[3];
  bool periodic[3];
};

// "(a, b, c)" (or with other brackets), for error messages.
std::string format_list(at::IntArrayRef values, const char* open = "(", const char* close = ")");

// Builds and validates the geometry from the op arguments.
CicGeometry make_geometry(
    const char* op,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic);

// Validates positions (B, N, 3) and returns a contiguous copy or view.
at::Tensor check_positions(const char* op, const at::Tensor& positions);

// Validates per-particle values (B, N) or (B, N, C) against positions, returns
// a contiguous (B, N, C) view and sets channels / squeeze accordingly.
at::Tensor check_particle_values(
    const char* op,
    const char* name,
    const at::Tensor& values,
    const at::Tensor& positions,
    int64_t& channels,
    bool& has_channel_dim);

// Validates a mesh (B, nx, ny, nz) or (B, C, nx, ny, nz) against positions and
// returns a contiguous (B, C, nx, ny, nz) view.
at::Tensor check_mesh(
    const char* op,
    const char* name,
    const at::Tensor& mesh,
    const at::Tensor& positions,
    int64_t& channels,
    bool& has_channel_dim);

// Called by a backend when its fused check found `bad` rejected particles: finds
// the worst offender with ATen ops (slow, only on the error path) and throws.
[[noreturn]] void throw_bad_particles(
    const char* op,
    const at::Tensor& positions,
    const CicGeometry& geometry,
    int64_t bad);

}  // namespace torchpm
