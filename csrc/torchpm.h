// Shared declarations of the torchpm extension: the geometry of a painted mesh,
// argument checks used by every backend, and the diagnostics that turn a
// failed particle check into an error a user can act on.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

namespace torchpm {

// Positions whose magnitude exceeds this many cells are rejected: beyond it the
// fractional part of a float is meaningless and the cell index would overflow.
constexpr double kMaxAbsPosition = 1099511627776.0;  // 2^40

// Largest accepted mesh size along one axis (indices stay far from int64
// overflow and every axis fits an int32 grid dimension).
constexpr int64_t kMaxAxisSize = (int64_t(1) << 31) - 1;

// Where a (B, [C,] nx, ny, nz) mesh sits in the global mesh, and the order of
// the mass assignment (1 NGP, 2 CIC, 3 TSC, 4 PCS: nodes per axis).
//
// For each axis d, a particle at global coordinate x (mesh-cell units, node j of
// the global mesh sits at x = j) touches the global nodes first .. first + order
// - 1 with first = floor(x + 1 - order/2) (stencil.h). They map to the local
// indices (node - offset[d]). On a periodic axis the local index is taken modulo
// shape[d]; on a block axis all indices must lie in [0, shape[d]) or the particle
// is rejected: the block accepts x in [offset + order/2 - 1, offset + shape -
// order/2).
struct StencilGeometry {
  int64_t shape[3];
  int64_t offset[3];
  bool periodic[3];
  int64_t order;
};

// "(a, b, c)" (or with other brackets), for error messages.
std::string format_list(at::IntArrayRef values, const char* open = "(", const char* close = ")");

// Builds and validates the geometry from the op arguments.
StencilGeometry make_geometry(
    const char* op,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order);

// Raises when a mesh of batch x channels x shape elements of `dtype` would not
// be addressable (its byte count overflows int64).
void check_mesh_size(
    const char* op, int64_t batch, int64_t channels, const StencilGeometry& g,
    at::ScalarType dtype);

// Validates positions (B, N, 3) and returns a contiguous copy or view.
at::Tensor check_positions(const char* op, const at::Tensor& positions);
// int64 `ids` (B, N) like the (B, N, 3) `positions` (already checked); returned
// contiguous.
at::Tensor check_particle_ids(const char* op, const at::Tensor& ids, const at::Tensor& positions);

// Validates per-particle values (B, N) or (B, N, C) against positions, returns
// a contiguous (B, N, C) view and sets channels / squeeze accordingly.
at::Tensor check_particle_values(
    const char* op,
    const char* name,
    const at::Tensor& values,
    const at::Tensor& positions,
    int64_t& channels,
    bool& has_channel_dim);

// The checked arguments of a paint (the scatter op and the node-by-node one).
struct PaintArguments {
  at::Tensor positions;  // (B, N, 3) contiguous
  at::Tensor weights;    // (B, N, C) contiguous, or undefined (unit weights)
  int64_t channels = 1;
  bool has_channel_dim = false;  // weights were (B, N, C): the mesh keeps its C axis
  StencilGeometry geometry{};
};

PaintArguments check_paint_arguments(
    const char* op,
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order);

// Calls f(std::integral_constant<int, V>{}) for the V of Values equal to
// `value` and returns true, or returns false when none is: a runtime count
// turned into a template argument (dispatch_order, the CPU's dispatch_channels).
template <int... Values, typename F>
inline bool dispatch_constant(int64_t value, const F& f) {
  return ((value == Values ? (f(std::integral_constant<int, Values>{}), true) : false) || ...);
}

// Calls f(std::integral_constant<int, W>{}) with W = order (1 NGP .. 4 PCS), so
// a kernel written once as a template over W is instantiated for every order.
template <typename F>
inline void dispatch_order(const char* op, int64_t order, const F& f) {
  TORCH_CHECK_VALUE(
      (dispatch_constant<1, 2, 3, 4>(order, f)), op,
      ": expected `order` 1 (NGP), 2 (CIC), 3 (TSC) or 4 (PCS), got ", order, ".");
}

// The scalar type of a dispatched kernel, as a value: `typename
// decltype(dtype)::type` in a generic lambda.
template <typename T>
struct Dtype {
  using type = T;
};

// The frame of a backend's paint op: the errors earlier calls left are reported
// (error_checking.h), the arguments checked, the (B, C, nx, ny, nz) mesh
// allocated, `paint(args, mesh, Dtype<scalar_t>{}, std::integral_constant<int,
// W>{})` run for the positions' dtype and the order's width when there are
// particles, and the channel axis dropped again for (B, N) or no weights.
// `accumulates`: the kernel adds into the mesh, which starts as zeros;
// otherwise it writes every node itself (no zero-filling pass), and only a call
// without particles gets zeros.
void report_earlier_errors(const char* caller);

template <typename Paint>
at::Tensor paint_op(
    const char* op,
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool accumulates,
    const Paint& paint) {
  report_earlier_errors(op);
  const auto args = check_paint_arguments(op, positions, weights, shape, offset, periodic, order);
  const bool painted = args.positions.numel() > 0;
  const std::array<int64_t, 5> size{args.positions.size(0), args.channels, shape[0], shape[1], shape[2]};
  auto mesh = accumulates || !painted ? at::zeros(size, args.positions.options())
                                      : at::empty(size, args.positions.options());
  if (painted) {
    AT_DISPATCH_FLOATING_TYPES(args.positions.scalar_type(), "torchpm_paint", [&] {
      dispatch_order(op, order, [&](auto width) { paint(args, mesh, Dtype<scalar_t>{}, width); });
    });
  }
  return args.has_channel_dim ? mesh : mesh.squeeze(1);
}

// The particles of a node-by-node paint (node_paint.h) in the order of their
// keys (B N,) int64: a stable sort, so particles of one key keep their order.
// `values` (B, N, C) may be undefined (unit weights), and so is its sorted copy.
struct ParticlesByKey {
  at::Tensor keys;       // (B N,) sorted
  at::Tensor positions;  // (B N, 3)
  at::Tensor values;     // (B N, C) or undefined
};

ParticlesByKey sort_particles_by_key(
    const at::Tensor& keys, const at::Tensor& positions, const at::Tensor& values);

// The tiled paint's pass 2 (tile_paint.h) from its per-tile particle counts
// (int32, on any device): where each tile's particles start in tile order, and
// chunk_end, the number of chunks of at most kTileChunk particles of the tiles up
// to and including each (inclusive prefix sum). ATen ops, so that the CPU tests
// run the arithmetic CUDA runs.
struct TilePrefixSums {
  at::Tensor start;      // (tiles,) int32
  at::Tensor chunk_end;  // (tiles,) int32
};

TilePrefixSums tile_prefix_sums(const at::Tensor& count);

// Where element (b, c, node) of a checked mesh (B, C, nx, ny, nz) lies, node =
// (x ny + y) nz + z: at b * member + c * channel + node * node_stride. Planar
// (torch's contiguous format): one channel after another (channel = cells,
// node_stride = 1). Interleaved (channels_last_3d, components last): the C values
// of a node side by side (channel = 1, node_stride = C), so the readout finds a
// particle's force components in one cache line or sector instead of C.
struct MeshLayout {
  int64_t member;
  int64_t channel;
  int64_t node_stride;
};

// Validates a mesh (B, nx, ny, nz) or (B, C, nx, ny, nz) against positions and
// returns it as (B, C, nx, ny, nz), in place when it is planar or interleaved
// (MeshLayout), else copied: into the interleaved layout when its strides are
// channels-last ones (a slice of an interleaved mesh), else planar.
at::Tensor check_mesh(
    const char* op,
    const char* name,
    const at::Tensor& mesh,
    const at::Tensor& positions,
    int64_t& channels,
    bool& has_channel_dim,
    MeshLayout& layout);

// Validates the optional per-particle `values` of a position gradient against a
// mesh of `channels` channels (one value per channel); absent values are allowed
// only for a single-channel mesh. Returns the contiguous (B, N, C) view, or an
// undefined tensor when absent.
at::Tensor check_gradient_values(
    const char* op,
    const std::optional<at::Tensor>& values,
    const at::Tensor& positions,
    int64_t channels,
    bool has_channel_dim);

// The checked arguments of a position gradient, or of the fused readout and
// position gradient (`readout_channels` K: 0 .. the channels of the mesh).
struct PositionGradientArguments {
  at::Tensor positions;  // (B, N, 3) contiguous
  at::Tensor mesh;       // (B, C, nx, ny, nz), planar or interleaved
  at::Tensor values;     // (B, N, C) contiguous, or undefined
  int64_t channels;
  MeshLayout layout;
  StencilGeometry geometry;
};

PositionGradientArguments check_position_gradient_arguments(
    const char* op,
    const at::Tensor& mesh,
    const at::Tensor& positions,
    const std::optional<at::Tensor>& values,
    int64_t readout_channels,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order);

// The registered `_position_gradient` and `_readout_and_position_gradient` of a
// backend, from its `impl(op, mesh, positions, values, K, offset, periodic,
// order) -> (gradient (B, N, 3), readout (B, N, K))`.
using PositionGradientImpl = std::tuple<at::Tensor, at::Tensor> (*)(
    const char*, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    int64_t, at::IntArrayRef, std::array<bool, 3>, int64_t);

template <PositionGradientImpl impl>
at::Tensor position_gradient_op(
    const at::Tensor& mesh, const at::Tensor& positions, const std::optional<at::Tensor>& values,
    at::IntArrayRef offset, std::array<bool, 3> periodic, int64_t order) {
  return std::get<0>(
      impl("torchpm._position_gradient", mesh, positions, values, 0, offset, periodic, order));
}

template <PositionGradientImpl impl>
std::tuple<at::Tensor, at::Tensor> readout_and_position_gradient_op(
    const at::Tensor& mesh, const at::Tensor& positions, const std::optional<at::Tensor>& values,
    int64_t readout_channels, at::IntArrayRef offset, std::array<bool, 3> periodic,
    int64_t order) {
  auto [gradient, read] = impl(
      "torchpm._readout_and_position_gradient", mesh, positions, values, readout_channels,
      offset, periodic, order);
  return {read, gradient};
}

// The checked (x, y) of _add_scaled: float32 or float64 tensors of one shape,
// dtype and device, returned contiguous.
std::tuple<at::Tensor, at::Tensor> check_add_scaled_arguments(
    const char* op, const at::Tensor& x, const at::Tensor& y);
// _add_scaled_'s checks (those of _add_scaled, `x` contiguous, written in
// place, and `y` not partially overlapping it; `y` may be `x`): returns y
// contiguous.
at::Tensor check_add_scaled_in_place_arguments(const char* op, const at::Tensor& x, const at::Tensor& y);

// Called by an op that writes `t` in place, after its checks and before its
// kernel: bumps the version counter, as torch's in-place ops do (the
// dispatcher does not for an op defined in C++ with a `Tensor(a!)` argument),
// so that autograd and the deferred error checks (error_checking.h) see the
// write. An inference tensor outside inference mode is refused, untouched.
inline void bump_version(const at::Tensor& t) {
  t.unsafeGetTensorImpl()->bump_version();
}

// The checked arguments of _readout_kick_drift_ (both backends): `positions`
// (B, N, 3) float32 or float64 and `momenta` of its shape, dtype and device,
// both contiguous (updated in place); one or two `kicks`; a (B, 3, nx, ny, nz)
// `mesh` (check_mesh); no two of them sharing memory.
struct ReadoutUpdateArguments {
  at::Tensor mesh;  // (B, 3, nx, ny, nz), planar or interleaved
  MeshLayout layout;
  StencilGeometry geometry;
};

ReadoutUpdateArguments check_readout_update_arguments(
    const char* op, const at::Tensor& mesh, const at::Tensor& positions, const at::Tensor& momenta,
    at::IntArrayRef offset, std::array<bool, 3> periodic, int64_t order, at::ArrayRef<double> kicks);

// Called by a backend when its fused check found `bad` rejected particles: finds
// the worst offender with ATen ops (slow, only on the error path) and throws.
// `late`: empty when raised inside the call (nothing was returned); otherwise
// the note of a deferred report (error_checking.h), and the message says that
// the call returned NaN in place of the rejected particles.
[[noreturn]] void throw_bad_particles(
    const char* op,
    const at::Tensor& positions,
    const StencilGeometry& geometry,
    int64_t bad,
    const std::string& late = "");

// Called by a backend when its fused check found `count` particles whose value
// (`weights` for paint; for readout the mesh values at the particle's stencil)
// is NaN or Inf: names the first such particle and throws.
[[noreturn]] void throw_non_finite(
    const char* op,
    const char* name,
    const at::Tensor& per_particle,
    int64_t count,
    const std::string& late = "");

}  // namespace torchpm
