// Argument checks and error diagnostics shared by every backend.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <sstream>

#include "finite_difference.h"
#include "torchpm.h"

namespace torchpm {

namespace {

void check_floating(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(
      t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
      op, ": expected `", name, "` to be float32 or float64, got ",
      t.scalar_type(), ".");
}

// check_positions without the contiguous copy: for arguments that must already
// be contiguous, or whose copy is not needed.
void check_positions_shape(const char* op, const at::Tensor& positions) {
  TORCH_CHECK_VALUE(
      positions.dim() == 3 && positions.size(2) == 3, op,
      ": expected `positions` of shape (B, N, 3), got ",
      format_list(positions.sizes()), ".");
  check_floating(op, "positions", positions);
}

// check_add_scaled_arguments without the contiguous copies.
void check_add_scaled_shapes(const char* op, const at::Tensor& x, const at::Tensor& y) {
  TORCH_CHECK_VALUE(x.defined() && y.defined(), op, ": `x` and `y` must be defined.");
  check_floating(op, "x", x);
  TORCH_CHECK_VALUE(
      x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() && x.device() == y.device(), op,
      ": expected `y` of the shape, dtype and device of `x` ", format_list(x.sizes()), ", ", x.scalar_type(),
      ", ", x.device(), "; got ", format_list(y.sizes()), ", ", y.scalar_type(), ", ", y.device(), ".");
}

// `written` is updated in place while `read` is read: they must not share memory.
void check_apart(const char* op, const at::Tensor& read, const char* read_name, const at::Tensor& written,
                 const char* written_name) {
  TORCH_CHECK_VALUE(
      !read.storage().is_alias_of(written.storage()) ||
          at::get_overlap_status(read, written) == at::MemOverlapStatus::No,
      op, ": `", read_name, "` and `", written_name, "` share memory; expected separate tensors (`", written_name,
      "` is updated in place).");
}

}  // namespace

std::string format_list(at::IntArrayRef values, const char* open, const char* close) {
  std::ostringstream out;
  out << open;
  for (size_t i = 0; i < values.size(); ++i) {
    out << (i ? ", " : "") << values[i];
  }
  out << close;
  return out.str();
}

StencilGeometry make_geometry(
    const char* op,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order) {
  TORCH_CHECK_VALUE(
      order >= 1 && order <= 4, op,
      ": expected `order` 1 (NGP), 2 (CIC), 3 (TSC) or 4 (PCS), got ", order, ".");
  TORCH_CHECK_VALUE(
      shape.size() == 3, op, ": expected `shape` to have 3 entries (nx, ny, nz), got ",
      shape.size(), ".");
  TORCH_CHECK_VALUE(
      offset.size() == 3, op, ": expected `offset` to have 3 entries, got ",
      offset.size(), ".");
  TORCH_CHECK_VALUE(
      periodic.size() == 3, op, ": expected `periodic` to have 3 entries, got ",
      periodic.size(), ".");
  StencilGeometry g;
  g.order = order;
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(
        shape[d] > 0, op, ": expected every entry of `shape` to be positive, got ",
        format_list(shape), ".");
    TORCH_CHECK_VALUE(
        shape[d] <= kMaxAxisSize, op, ": every entry of `shape` must be below 2^31, got ",
        format_list(shape), ".");
    TORCH_CHECK_VALUE(
        offset[d] > -(int64_t(1) << 40) && offset[d] < (int64_t(1) << 40), op,
        ": `offset` ", format_list(offset), " is out of range.");
    g.shape[d] = shape[d];
    g.offset[d] = offset[d];
    g.periodic[d] = periodic[d];
  }
  return g;
}

void check_mesh_size(
    const char* op, int64_t batch, int64_t channels, const StencilGeometry& g,
    at::ScalarType dtype) {
  // In floating point: the exact product may overflow int64 itself.
  const double bytes = static_cast<double>(batch) * static_cast<double>(channels) *
      static_cast<double>(g.shape[0]) * static_cast<double>(g.shape[1]) *
      static_cast<double>(g.shape[2]) * static_cast<double>(c10::elementSize(dtype));
  TORCH_CHECK_VALUE(
      bytes < 9.0e18, op, ": a mesh of shape (", batch, ", ", channels, ", ",
      g.shape[0], ", ", g.shape[1], ", ", g.shape[2], ") would need ", bytes,
      " bytes, beyond what can be addressed; paint onto a smaller mesh or block.");
}

at::Tensor check_positions(const char* op, const at::Tensor& positions) {
  check_positions_shape(op, positions);
  return positions.contiguous();
}

at::Tensor check_particle_ids(const char* op, const at::Tensor& ids, const at::Tensor& positions) {
  TORCH_CHECK_VALUE(
      ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == positions.size(0) &&
          ids.size(1) == positions.size(1),
      op, ": expected int64 `ids` of shape (", positions.size(0), ", ", positions.size(1),
      ") like `positions`, got ", ids.scalar_type(), " ", format_list(ids.sizes()), ".");
  return ids.contiguous();
}

at::Tensor check_particle_values(
    const char* op,
    const char* name,
    const at::Tensor& values,
    const at::Tensor& positions,
    int64_t& channels,
    bool& has_channel_dim) {
  TORCH_CHECK_VALUE(
      (values.dim() == 2 || values.dim() == 3) &&
          values.size(0) == positions.size(0) &&
          values.size(1) == positions.size(1),
      op, ": expected `", name, "` of shape (B, N) or (B, N, C) with (B, N) = (",
      positions.size(0), ", ", positions.size(1), ") from `positions`, got ",
      format_list(values.sizes()), ".");
  TORCH_CHECK_VALUE(
      values.scalar_type() == positions.scalar_type(), op, ": expected `", name,
      "` to have the dtype of `positions` (", positions.scalar_type(), "), got ",
      values.scalar_type(), ".");
  TORCH_CHECK(
      values.device() == positions.device(), op, ": expected `", name,
      "` on the device of `positions` (", positions.device(), "), got ",
      values.device(), ".");
  has_channel_dim = values.dim() == 3;
  channels = has_channel_dim ? values.size(2) : 1;
  TORCH_CHECK_VALUE(channels > 0, op, ": `", name, "` has zero channels.");
  auto out = values.contiguous();
  return has_channel_dim ? out : out.unsqueeze(2);
}

at::Tensor check_gradient_values(
    const char* op,
    const std::optional<at::Tensor>& values_in,
    const at::Tensor& positions,
    int64_t channels,
    bool has_channel_dim) {
  if (!values_in.has_value()) {
    TORCH_CHECK_VALUE(channels == 1 && !has_channel_dim, op,
                      ": `values` may be omitted only for a single-channel mesh.");
    return at::Tensor();
  }
  int64_t value_channels = 1;
  bool value_channel_dim = false;
  auto values = check_particle_values(
      op, "values", *values_in, positions, value_channels, value_channel_dim);
  TORCH_CHECK_VALUE(
      value_channels == channels && value_channel_dim == has_channel_dim, op,
      ": `values` must have one entry per channel of `mesh`.");
  return values;
}

at::Tensor check_mesh(
    const char* op,
    const char* name,
    const at::Tensor& mesh,
    const at::Tensor& positions,
    int64_t& channels,
    bool& has_channel_dim,
    MeshLayout& layout) {
  TORCH_CHECK_VALUE(
      (mesh.dim() == 4 || mesh.dim() == 5) && mesh.size(0) == positions.size(0),
      op, ": expected `", name, "` of shape (B, nx, ny, nz) or (B, C, nx, ny, nz) "
      "with B = ", positions.size(0), " from `positions`, got ",
      format_list(mesh.sizes()), ".");
  TORCH_CHECK_VALUE(
      mesh.scalar_type() == positions.scalar_type(), op, ": expected `", name,
      "` to have the dtype of `positions` (", positions.scalar_type(), "), got ",
      mesh.scalar_type(), ".");
  TORCH_CHECK(
      mesh.device() == positions.device(), op, ": expected `", name,
      "` on the device of `positions` (", positions.device(), "), got ",
      mesh.device(), ".");
  has_channel_dim = mesh.dim() == 5;
  channels = has_channel_dim ? mesh.size(1) : 1;
  TORCH_CHECK_VALUE(channels > 0, op, ": `", name, "` has zero channels.");
  for (int64_t d = mesh.dim() - 3; d < mesh.dim(); ++d) {
    TORCH_CHECK_VALUE(
        mesh.size(d) > 0, op, ": expected every mesh size of `", name,
        "` to be positive, got ", format_list(mesh.sizes()), ".");
  }
  auto out = has_channel_dim ? mesh : mesh.unsqueeze(1);
  const int64_t cells = out.size(2) * out.size(3) * out.size(4);
  // With one channel, or one node, both layouts are the same.
  if (!out.is_contiguous() && out.suggest_memory_format() == at::MemoryFormat::ChannelsLast3d) {
    out = out.contiguous(at::MemoryFormat::ChannelsLast3d);
    layout = {channels * cells, 1, channels};
  } else {
    out = out.contiguous();
    layout = {channels * cells, cells, 1};
  }
  return out;
}

void throw_bad_particles(
    const char* op,
    const at::Tensor& positions,
    const StencilGeometry& g,
    int64_t bad,
    const std::string& late) {
  auto x = positions.detach().to(at::kCPU, at::kDouble).reshape({-1, 3});
  const int64_t total = x.size(0);
  const int64_t per_batch = positions.size(1);
  auto finite = at::isfinite(x).all(1);
  auto nonfinite = at::logical_not(finite);
  const int64_t n_nonfinite = nonfinite.sum().item<int64_t>();
  std::ostringstream msg;
  // (a readout and the paint's position gradient read a mesh, a paint deposits)
  const std::string name(op);
  const bool reads = name.find("readout") != std::string::npos || name.find("gradient") != std::string::npos;
  msg << op << ": " << bad << " of " << total << " particles cannot be "
      << (reads ? "read" : "deposited") << "; "
      << (late.empty() ? "nothing was painted or read. "
                       : "the call returned NaN in place of their contributions. ");
  if (n_nonfinite > 0) {
    const int64_t first = nonfinite.nonzero().index({0, 0}).item<int64_t>();
    msg << n_nonfinite << " have non-finite (NaN or Inf) `positions`, the first is "
        << "particle " << first % per_batch << " of batch " << first / per_batch
        << ". Check the inputs that produced the positions." << (late.empty() ? "" : " ")
        << late;
    throw c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                          msg.str());
  }
  // Distance outside the allowed range [offset + p/2 - 1, offset + n - p/2) on
  // block axes (p the order), and beyond +-2^40 on any axis.
  auto excess = at::zeros({total}, x.options());
  std::ostringstream ranges;
  for (int d = 0; d < 3; ++d) {
    auto xd = x.select(1, d);
    auto far = (xd.abs() - kMaxAbsPosition).clamp_min(0);
    excess = at::maximum(excess, far);
    if (!g.periodic[d]) {
      const double half = 0.5 * static_cast<double>(g.order);
      const double lo = static_cast<double>(g.offset[d]) + half - 1.0;
      const double hi = static_cast<double>(g.offset[d] + g.shape[d]) - half;
      // The upper bound is exclusive: a particle at x = hi would need one more node.
      auto below = (lo - xd).clamp_min(0);
      auto above = (xd - hi).clamp_min(0);
      auto at_hi = (xd >= hi).to(x.scalar_type()) * 1e-300;
      excess = at::maximum(excess, at::maximum(below, above + at_hi));
      ranges << " axis " << d << ": [" << lo << ", " << hi << ")";
    }
  }
  const int64_t worst = excess.argmax().item<int64_t>();
  auto p = x[worst];
  msg << "Worst is particle " << worst % per_batch << " of batch "
      << worst / per_batch << " at position (" << p[0].item<double>() << ", "
      << p[1].item<double>() << ", " << p[2].item<double>() << ")";
  if (ranges.str().empty()) {
    msg << ", beyond +-2^40 cells.";
  } else {
    msg << "; the block (shape " << g.shape[0] << "x" << g.shape[1] << "x"
        << g.shape[2] << ", offset " << g.offset[0] << "," << g.offset[1] << ","
        << g.offset[2] << ") accepts positions in" << ranges.str()
        << " for order " << g.order
        << ". Enlarge the block (halo, see torchpm.ops.halo_widths) or move the particles "
           "to the rank that owns them.";
  }
  msg << (late.empty() ? "" : " ") << late;
  throw c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                        msg.str());
}

void throw_non_finite(
    const char* op,
    const char* name,
    const at::Tensor& per_particle,
    int64_t count,
    const std::string& late) {
  // per_particle: (B, N, C) values of the particles (weights, or readout results).
  auto x = per_particle.detach().to(at::kCPU, at::kDouble);
  const int64_t per_batch = x.size(1);
  auto bad = at::logical_not(at::isfinite(x.reshape({x.size(0) * x.size(1), -1})).all(1));
  std::ostringstream msg;
  msg << op << ": `" << name << "` contains NaN or Inf values";
  const int64_t found = bad.sum().item<int64_t>();
  if (found > 0) {
    const int64_t first = bad.nonzero().index({0, 0}).item<int64_t>();
    msg << " for " << found << " particles, the first is particle " << first % per_batch
        << " of batch " << first / per_batch;
  } else {
    msg << " (" << count << " particles)";
  }
  msg << (late.empty() ? "; nothing was returned. " : "; the call returned them. ")
      << "Check the inputs that produced `" << name
      << "` (pass check_finite=False to skip this check and propagate them)."
      << (late.empty() ? "" : " ") << late;
  throw c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                        msg.str());
}

PositionGradientArguments check_position_gradient_arguments(
    const char* op,
    const at::Tensor& mesh_in,
    const at::Tensor& positions_in,
    const std::optional<at::Tensor>& values_in,
    int64_t readout_channels,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order) {
  PositionGradientArguments args;
  args.positions = check_positions(op, positions_in);
  bool has_channel_dim = false;
  args.channels = 1;
  args.mesh = check_mesh(op, "mesh", mesh_in, args.positions, args.channels, has_channel_dim, args.layout);
  TORCH_CHECK_VALUE(
      readout_channels >= 0 && readout_channels <= args.channels, op,
      ": expected `readout_channels` between 0 and the ", args.channels,
      " channels of `mesh`, got ", readout_channels, ".");
  args.values = check_gradient_values(op, values_in, args.positions, args.channels, has_channel_dim);
  args.geometry = make_geometry(op, args.mesh.sizes().slice(2), offset, periodic, order);
  return args;
}

PaintArguments check_paint_arguments(
    const char* op,
    const at::Tensor& positions_in,
    const std::optional<at::Tensor>& weights_in,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order) {
  PaintArguments args;
  args.positions = check_positions(op, positions_in);
  args.geometry = make_geometry(op, shape, offset, periodic, order);
  if (weights_in.has_value()) {
    args.weights = check_particle_values(
        op, "weights", *weights_in, args.positions, args.channels, args.has_channel_dim);
  }
  check_mesh_size(op, args.positions.size(0), args.channels, args.geometry, args.positions.scalar_type());
  return args;
}

FiniteDifferenceArguments check_finite_difference_arguments(
    const char* op,
    const at::Tensor& input,
    const at::Tensor& scale,
    std::array<bool, 3> periodic,
    bool transpose) {
  const char* name = transpose ? "grad" : "field";
  TORCH_CHECK_VALUE(input.defined(), op, ": `", name, "` is undefined.");
  check_floating(op, name, input);
  if (transpose) {
    TORCH_CHECK_VALUE(
        input.dim() == 5 && input.size(1) == 3, op, ": expected `grad` of shape (B, 3, ox, oy, oz), got ",
        format_list(input.sizes()), ".");
  } else {
    TORCH_CHECK_VALUE(
        input.dim() == 4, op, ": expected `field` of shape (B, nx, ny, nz), got ",
        format_list(input.sizes()), ".");
  }
  FiniteDifferenceArguments args;
  FiniteDifferenceGeometry& g = args.geometry;
  args.batch = input.size(0);
  const int64_t first = transpose ? 2 : 1;
  for (int d = 0; d < 3; ++d) {
    const int64_t size = input.size(first + d);
    const int64_t cut = periodic[d] ? 0 : 2 * kFiniteDifferenceReach;
    g.periodic[d] = periodic[d];
    g.shift[d] = periodic[d] ? 0 : kFiniteDifferenceReach;
    if (transpose) {
      TORCH_CHECK_VALUE(
          size >= 1, op, ": expected `grad` to have at least 1 node along axis ", d, ", got shape ",
          format_list(input.sizes()), ".");
      g.gradient[d] = size;
      g.field[d] = size + cut;
    } else {
      TORCH_CHECK_VALUE(
          size >= 1 + cut, op, ": expected `field` to have at least ", 1 + cut, " nodes along axis ", d,
          periodic[d] ? "" : " (not periodic: the stencil reaches 2 nodes to each side)",
          ", got shape ", format_list(input.sizes()), ".");
      g.field[d] = size;
      g.gradient[d] = size - cut;
    }
    TORCH_CHECK_VALUE(
        g.field[d] <= kMaxAxisSize, op, ": axis ", d, " of ", g.field[d], " nodes exceeds the largest ",
        "supported size ", kMaxAxisSize, ".");
  }
  // 3 * batch * the larger of the two meshes must stay addressable.
  double elements = 3.0 * static_cast<double>(args.batch);
  for (int d = 0; d < 3; ++d) {
    elements *= static_cast<double>(g.field[d]);
  }
  TORCH_CHECK_VALUE(
      elements * static_cast<double>(input.element_size()) < 9.0e18, op, ": a gradient of ", elements,
      " elements of ", input.scalar_type(), " would not be addressable.");
  TORCH_CHECK_VALUE(scale.defined(), op, ": `scale` is undefined.");
  TORCH_CHECK_VALUE(
      scale.dim() == 1 && scale.size(0) == 3 && scale.scalar_type() == input.scalar_type() &&
          scale.device() == input.device(),
      op, ": expected `scale` to be a (3,) tensor of `", name, "`'s dtype and device (", input.scalar_type(),
      ", ", input.device(), "), got shape ", format_list(scale.sizes()), ", ", scale.scalar_type(), ", ",
      scale.device(), ".");
  // Read in place when everything after the batch dimension is contiguous (for
  // example channels 1..3 of a 4-channel paint); copied otherwise.
  bool inner_contiguous = true;
  int64_t expected = 1;
  for (int64_t d = input.dim() - 1; d >= 1; --d) {
    if (input.size(d) != 1 && input.stride(d) != expected) {
      inner_contiguous = false;
    }
    expected *= input.size(d);
  }
  args.input = inner_contiguous ? input : input.contiguous();
  g.batch_stride = args.batch > 1 ? args.input.stride(0) : expected;
  args.scale = scale.contiguous();
  return args;
}

std::tuple<at::Tensor, at::Tensor> check_add_scaled_arguments(
    const char* op, const at::Tensor& x, const at::Tensor& y) {
  check_add_scaled_shapes(op, x, y);
  return {x.contiguous(), y.contiguous()};
}

at::Tensor check_add_scaled_in_place_arguments(const char* op, const at::Tensor& x, const at::Tensor& y_in) {
  check_add_scaled_shapes(op, x, y_in);
  TORCH_CHECK_VALUE(x.is_contiguous(), op, ": expected `x` contiguous (it is updated in place); got strides ",
                    format_list(x.strides()), ".");
  // A strided y is copied here, so only a contiguous one can still share x's
  // memory: the same elements (y is x) are fine, each is read before it is
  // written; a shifted overlap would read entries already written (in an order
  // that depends on the kernel's blocking or, on CUDA, on its threads).
  at::Tensor y = y_in.contiguous();
  TORCH_CHECK_VALUE(
      at::get_overlap_status(x, y) != at::MemOverlapStatus::Partial, op,
      ": `y` partially overlaps `x`, which is updated in place; pass `x` itself or a separate tensor "
      "(for example `y.clone()`).");
  return y;
}

ReadoutUpdateArguments check_readout_update_arguments(
    const char* op, const at::Tensor& mesh, const at::Tensor& positions, const at::Tensor& momenta,
    at::IntArrayRef offset, std::array<bool, 3> periodic, int64_t order, at::ArrayRef<double> kicks) {
  TORCH_CHECK_VALUE(mesh.defined() && positions.defined() && momenta.defined(), op,
                    ": `mesh`, `positions` and `momenta` must be defined.");
  check_positions_shape(op, positions);
  TORCH_CHECK_VALUE(
      momenta.sizes() == positions.sizes() && momenta.scalar_type() == positions.scalar_type() &&
          momenta.device() == positions.device(),
      op, ": expected `momenta` of the shape, dtype and device of `positions` ", format_list(positions.sizes()),
      ", ", positions.scalar_type(), ", ", positions.device(), "; got ", format_list(momenta.sizes()), ", ",
      momenta.scalar_type(), ", ", momenta.device(), ".");
  TORCH_CHECK_VALUE(positions.is_contiguous() && momenta.is_contiguous(), op,
                    ": expected `positions` and `momenta` contiguous (they are updated in place); got strides ",
                    format_list(positions.strides()), " and ", format_list(momenta.strides()), ".");
  TORCH_CHECK_VALUE(kicks.size() == 1 || kicks.size() == 2, op, ": expected one or two `kicks`, got ",
                    kicks.size(), ".");
  // Before check_mesh, which may copy the mesh.
  TORCH_CHECK_VALUE(mesh.dim() == 5 && mesh.size(1) == 3, op,
                    ": expected `mesh` of shape (B, 3, nx, ny, nz) (the three force components), got ",
                    format_list(mesh.sizes()), ".");
  ReadoutUpdateArguments args;
  int64_t channels = 1;
  bool has_channel_dim = false;
  args.mesh = check_mesh(op, "mesh", mesh, positions, channels, has_channel_dim, args.layout);
  // The updates write positions and momenta while the readout reads the mesh
  // (as checked: a copy of it shares nothing) and positions.
  check_apart(op, positions, "positions", momenta, "momenta");
  check_apart(op, args.mesh, "mesh", positions, "positions");
  check_apart(op, args.mesh, "mesh", momenta, "momenta");
  args.geometry = make_geometry(op, args.mesh.sizes().slice(2), offset, periodic, order);
  return args;
}

}  // namespace torchpm
