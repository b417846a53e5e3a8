// The differentiable C++ entry points of include/torchpm/ops.h.
//
// Why autograd Functions here rather than an Autograd kernel registered with
// the dispatcher: Python registers the ops' autograd with
// torch.library.register_autograd (torchpm/ops/mass_assignment.py), and a second, C++
// Autograd kernel for the same ops would override it. These Functions exist
// only in the C++ API; torch.ops.torchpm.* from Python is unchanged. Their
// forwards run below the Autograd key and their backwards call the same ops as
// Python's, so the gradients agree to the last bit.
#include <torch/autograd.h>

#include <torchpm/ops.h>

namespace torchpm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// The geometry travels in saved_data as two lists; std::array<bool, 3> has no
// IValue of its own.
void save_geometry(AutogradContext* ctx, at::IntArrayRef offset, Periodic periodic) {
  ctx->saved_data["offset"] = offset.vec();
  ctx->saved_data["periodic"] = std::vector<bool>(periodic.begin(), periodic.end());
}

std::vector<int64_t> saved_offset(AutogradContext* ctx) {
  return ctx->saved_data["offset"].toIntVector();
}

Periodic saved_periodic(AutogradContext* ctx) {
  auto list = ctx->saved_data["periodic"].toBoolList();
  return {list.get(0), list.get(1), list.get(2)};
}

// CUDA paint adds with atomics. Under torch::globalContext deterministic
// algorithms the C++ API paints node by node instead (_paint_deterministic,
// node_paint.h), as Python does. check_finite is false in the backwards (a
// NaN/Inf upstream gradient propagates, as in Python's backwards).
at::Tensor paint_for_autograd(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    Periodic periodic,
    bool check_finite) {
  if (positions.is_cuda() && at::globalContext().deterministicAlgorithms()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchpm::_paint_deterministic", "")
                         .typed<at::Tensor(
                             const at::Tensor&, const std::optional<at::Tensor>&,
                             at::IntArrayRef, at::IntArrayRef, Periodic, int64_t, bool)>();
    return op.call(positions, weights, shape, offset, periodic, /*order=*/2, check_finite);
  }
  return ops::cic_paint(positions, weights, shape, offset, periodic, check_finite);
}

struct PositionGradient : torch::autograd::Function<PositionGradient> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& mesh,
      const at::Tensor& positions,
      const std::optional<at::Tensor>& values,
      at::IntArrayRef offset,
      Periodic periodic) {
    return ops::cic_position_gradient(mesh, positions, values, offset, periodic);
  }

  static tensor_list backward(AutogradContext*, tensor_list) {
    TORCH_CHECK(
        false,
        "torchpm C++ API: second derivatives through a CIC position gradient are "
        "not available from C++ (the first derivative is). Take them in Python, "
        "where torchpm differentiates its pure-torch twin, or differentiate once.");
  }
};

at::Tensor position_gradient(
    const at::Tensor& mesh,
    const at::Tensor& positions,
    const std::optional<at::Tensor>& values,
    at::IntArrayRef offset,
    Periodic periodic) {
  return PositionGradient::apply(mesh, positions, values, offset, periodic);
}

struct Readout : torch::autograd::Function<Readout> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& mesh,
      const at::Tensor& positions,
      at::IntArrayRef offset,
      Periodic periodic,
      bool check_finite);
  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs);
};

struct Paint : torch::autograd::Function<Paint> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& positions,
      const std::optional<at::Tensor>& weights,
      at::IntArrayRef shape,
      at::IntArrayRef offset,
      Periodic periodic,
      bool check_finite) {
    ctx->save_for_backward({positions, weights.value_or(at::Tensor())});
    save_geometry(ctx, offset, periodic);
    return paint_for_autograd(positions, weights, shape, offset, periodic, check_finite);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& positions = saved[0];
    std::optional<at::Tensor> weights;
    if (saved[1].defined()) {
      weights = saved[1];
    }
    const auto offset = saved_offset(ctx);
    const auto periodic = saved_periodic(ctx);
    const at::Tensor& grad_mesh = grad_outputs[0];
    at::Tensor grad_positions, grad_weights;
    if (ctx->needs_input_grad(0)) {
      grad_positions = position_gradient(grad_mesh, positions, weights, offset, periodic);
    }
    if (weights && ctx->needs_input_grad(1)) {
      grad_weights = Readout::apply(grad_mesh, positions, offset, periodic, /*check_finite=*/false);
    }
    return {grad_positions, grad_weights, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor Readout::forward(
    AutogradContext* ctx,
    const at::Tensor& mesh,
    const at::Tensor& positions,
    at::IntArrayRef offset,
    Periodic periodic,
    bool check_finite) {
  ctx->save_for_backward({mesh, positions});
  save_geometry(ctx, offset, periodic);
  return ops::cic_readout(mesh, positions, offset, periodic, check_finite);
}

tensor_list Readout::backward(AutogradContext* ctx, tensor_list grad_outputs) {
  auto saved = ctx->get_saved_variables();
  const at::Tensor& mesh = saved[0];
  const at::Tensor& positions = saved[1];
  const auto offset = saved_offset(ctx);
  const auto periodic = saved_periodic(ctx);
  const at::Tensor& grad_values = grad_outputs[0];
  at::Tensor grad_mesh, grad_positions;
  if (ctx->needs_input_grad(0)) {
    grad_mesh = Paint::apply(
        positions, grad_values, mesh.sizes().slice(mesh.dim() - 3), offset, periodic, /*check_finite=*/false);
  }
  if (ctx->needs_input_grad(1)) {
    grad_positions = position_gradient(mesh, positions, grad_values, offset, periodic);
  }
  return {grad_mesh, grad_positions, at::Tensor(), at::Tensor(), at::Tensor()};
}

}  // namespace

at::Tensor cic_paint(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    Periodic periodic) {
  TORCH_CHECK_VALUE(positions.defined(), "torchpm::cic_paint: `positions` is undefined; expected a (B, N, 3) "
                    "float32 or float64 tensor.");
  return Paint::apply(positions, weights, shape, offset, periodic, /*check_finite=*/true);
}

at::Tensor cic_readout(
    const at::Tensor& mesh,
    const at::Tensor& positions,
    at::IntArrayRef offset,
    Periodic periodic) {
  TORCH_CHECK_VALUE(mesh.defined(), "torchpm::cic_readout: `mesh` is undefined; expected a (B, nx, ny, nz) or "
                    "(B, C, nx, ny, nz) tensor.");
  TORCH_CHECK_VALUE(positions.defined(), "torchpm::cic_readout: `positions` is undefined; expected a (B, N, 3) "
                    "float32 or float64 tensor.");
  return Readout::apply(mesh, positions, offset, periodic, /*check_finite=*/true);
}

bool has_cuda_kernels() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpm::_cuda_kernels_built", "")
                       .typed<bool()>();
  return op.call();
}

std::string cpu_kernels() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchpm::_cpu_kernels", "")
                       .typed<std::string()>();
  return op.call();
}

}  // namespace torchpm
