// Checks of torchpm's C++ API (<torchpm/ops.h>) that the PM example does not
// reach, run by tests/test_cpp.py against Python:
//  * the gradients of paint with weights and of multi-channel readout, through
//    the C++ autograd Functions: L = sum(paint(x, w) * f) + sum(readout(f, x)^2)
//    with x (1, N, 3), w (1, N, 2), f (1, 2, n, n, n); writes dL/dx, dL/dw, dL/df;
//  * that the dispatcher-level calls (torchpm::ops::*) give the same values;
//  * that op argument errors reach a C++ caller as c10::Error with the op's
//    message, and that a second derivative throws instead of being wrong;
//  * that a NaN/Inf upstream gradient propagates through the backwards (as in
//    Python) and that undefined tensors are named.
//
// Usage: api_checks MESH_SIZE INPUT OUTPUT
//   INPUT: raw float64 x, then w, then f (N from the size); OUTPUT: raw float64
//   dL/dx, dL/dw, dL/df. Prints one line per check; exit status 1 on a failure.
#include <torch/torch.h>
#include <torchpm/ops.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::cout << (ok ? "ok: " : "FAILED: ") << what << "\n";
  failures += ok ? 0 : 1;
}

// Runs `body`, expecting a c10::Error whose message contains `expected`.
template <typename Body>
void check_throws(Body body, const std::string& expected, const std::string& what) {
  try {
    body();
  } catch (const c10::Error& error) {
    const std::string message = error.what_without_backtrace();
    check(message.find(expected) != std::string::npos, what + " (message: " + message.substr(0, 160) + ")");
    return;
  }
  check(false, what + " (nothing thrown)");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: " << argv[0] << " MESH_SIZE INPUT OUTPUT\n";
    return 2;
  }
  const int64_t n = std::stoll(argv[1]);
  std::ifstream input(argv[2], std::ios::binary | std::ios::ate);
  const int64_t values = static_cast<int64_t>(input.tellg()) / static_cast<int64_t>(sizeof(double));
  const int64_t count = (values - 2 * n * n * n) / 5;
  if (!input || count <= 0 || 5 * count + 2 * n * n * n != values) {
    std::cerr << "api_checks: " << argv[2] << " is not x (N, 3), w (N, 2), f (2, n, n, n) in float64\n";
    return 2;
  }
  std::vector<double> data(static_cast<size_t>(values));
  input.seekg(0);
  input.read(reinterpret_cast<char*>(data.data()), values * static_cast<int64_t>(sizeof(double)));
  const at::Tensor all = torch::from_blob(data.data(), {values}, torch::kFloat64).clone();
  const at::Tensor x = all.narrow(0, 0, 3 * count).view({1, count, 3}).requires_grad_(true);
  const at::Tensor w = all.narrow(0, 3 * count, 2 * count).view({1, count, 2}).requires_grad_(true);
  const at::Tensor f = all.narrow(0, 5 * count, 2 * n * n * n).view({1, 2, n, n, n}).requires_grad_(true);
  const std::vector<int64_t> shape = {n, n, n};

  const at::Tensor painted = torchpm::cic_paint(x, w, shape);
  const at::Tensor read = torchpm::cic_readout(f, x);
  const at::Tensor loss = (painted * f).sum() + (read * read).sum();
  const auto grads = torch::autograd::grad({loss}, {x, w, f});
  {
    std::ofstream output(argv[3], std::ios::binary);
    for (const auto& grad : grads) {
      const at::Tensor host = grad.contiguous();
      output.write(reinterpret_cast<const char*>(host.data_ptr<double>()),
                   host.numel() * static_cast<std::streamsize>(sizeof(double)));
    }
  }

  {
    torch::NoGradGuard no_grad;
    check(torch::equal(torchpm::ops::cic_paint(x, w, shape, {0, 0, 0}, {true, true, true}), painted),
          "torchpm::ops::cic_paint equals torchpm::cic_paint");
    check(torch::equal(torchpm::ops::cic_readout(f, x, {0, 0, 0}, {true, true, true}), read),
          "torchpm::ops::cic_readout equals torchpm::cic_readout");
  }
  check(painted.requires_grad() && read.requires_grad(), "torchpm::cic_paint / cic_readout are differentiable");
  {
    // check_finite: NaN mesh values a particle reads raise by default, and pass with false
    torch::NoGradGuard no_grad;
    const at::Tensor nan_mesh = torch::full_like(f, NAN);
    check_throws([&] { torchpm::ops::cic_readout(nan_mesh, x, {0, 0, 0}, {true, true, true}); },
                 "NaN", "ops::cic_readout of a NaN mesh raises");
    check(torchpm::ops::cic_readout(nan_mesh, x, {0, 0, 0}, {true, true, true}, /*check_finite=*/false)
              .isnan().all().item<bool>(),
          "ops::cic_readout with check_finite=false propagates NaN");
  }

  check_throws([&] { torchpm::cic_paint(x.narrow(2, 0, 2), std::nullopt, shape); },
               "positions", "paint of (B, N, 2) positions is rejected");
  check_throws([&] { torchpm::cic_readout(f, x, {0, 0, 0}, {false, false, false}); },
               "torchpm", "readout of particles outside a non-periodic block is rejected");
  check_throws(
      [&] {
        const at::Tensor value = torchpm::cic_readout(f, x).sum();
        const at::Tensor grad_x = torch::autograd::grad({value}, {x}, {}, true, true)[0];
        torch::autograd::grad({grad_x.sum()}, {x});
      },
      "second derivatives", "a second derivative through a position gradient throws");
  {
    // A NaN/Inf upstream gradient propagates through the backwards, as in Python
    // (whose backwards pass check_finite=False), instead of being reported as a
    // bad `mesh` or `weights` the caller never passed.
    const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
    const at::Tensor x1 = torch::tensor({1.3, 2.2, 0.7}, f64).view({1, 1, 3}).requires_grad_(true);
    const at::Tensor w1 = torch::ones({1, 1}, f64).requires_grad_(true);
    const at::Tensor m1 = torch::ones({1, n, n, n}, f64).requires_grad_(true);
    bool propagated = false;
    try {
      const at::Tensor grad_mesh = torch::full({1, n, n, n}, INFINITY, f64);
      const auto paint_grads = torch::autograd::grad({torchpm::cic_paint(x1, w1, shape)}, {w1}, {grad_mesh});
      const auto readout_grads =
          torch::autograd::grad({torchpm::cic_readout(m1, x1)}, {m1}, {torch::full({1, 1}, NAN, f64)});
      propagated = std::isinf(paint_grads[0].item<double>()) && readout_grads[0].isnan().any().item<bool>();
    } catch (const c10::Error& error) {
      std::cout << "  (" << std::string(error.what_without_backtrace()).substr(0, 160) << ")\n";
    }
    check(propagated, "a NaN/Inf upstream gradient propagates through paint's and readout's backwards");
  }
  check_throws([&] { torchpm::cic_paint(at::Tensor(), std::nullopt, shape); },
               "`positions` is undefined", "paint of undefined positions names them");
  check_throws([&] { torchpm::cic_readout(at::Tensor(), x); }, "`mesh` is undefined",
               "readout of an undefined mesh names it");
  return failures == 0 ? 0 : 1;
}
