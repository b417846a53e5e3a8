// One particle-mesh force evaluation from C++, through torchpm's op library,
// with no Python in the process, and the gradient of a scalar of the forces
// with respect to the positions.
//
//   rho   = paint(x)                                  (CIC, unit masses)
//   F_i   = s m readout( IDFT[ (i g_i) / |w|^2 DFT(rho) ] )(x)
//
// with w = 2 pi fftfreq(n) per axis (radians per cell), g = (8 sin w - sin 2w)/6
// the 4-point gradient, 1/|w|^2 set to 0 at w = 0, m = n^3 / N cells per particle
// (the painted density then has mean 1) and s the force scale (1.5 Omega_m):
// torchpm.pm.compute_forces with FourierKernels(gradient="fd4",
// laplacian="exact") on a cubic mesh of unit cells. Then
//
//   L = sum_p,i F_i(x_p)^2,   dL/dx  by torch::autograd::grad.
//
// Usage: pm_forces MESH_SIZE FORCE_SCALE POSITIONS OUTPUT [cpu|cuda]
//   POSITIONS: raw little-endian float64, (B, N, 3) with B = 1 (N from the size);
//   OUTPUT: raw float64, the forces (1, N, 3) then dL/dx (1, N, 3).
#include <torch/torch.h>
#include <torchpm/ops.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

at::Tensor read_positions(const std::string& path) {
  std::ifstream file(path, std::ios::binary | std::ios::ate);
  if (!file) {
    throw std::runtime_error("cannot open positions file " + path);
  }
  const std::streamsize bytes = file.tellg();
  const auto per_particle = static_cast<std::streamsize>(3 * sizeof(double));
  if (bytes <= 0 || bytes % per_particle != 0) {
    throw std::runtime_error(
        path + ": expected raw float64 positions, 3 per particle; got " +
        std::to_string(bytes) + " bytes");
  }
  const int64_t count = bytes / per_particle;
  std::vector<double> values(static_cast<size_t>(count * 3));
  file.seekg(0);
  file.read(reinterpret_cast<char*>(values.data()), bytes);
  return torch::from_blob(values.data(), {1, count, 3}, torch::kFloat64).clone();
}

void write_tensors(const std::string& path, const std::vector<at::Tensor>& tensors) {
  std::ofstream file(path, std::ios::binary);
  for (const auto& tensor : tensors) {
    const at::Tensor host = tensor.detach().to(torch::kCPU, torch::kFloat64).contiguous();
    file.write(reinterpret_cast<const char*>(host.data_ptr<double>()),
               static_cast<std::streamsize>(host.numel() * sizeof(double)));
  }
  if (!file) {
    throw std::runtime_error("cannot write " + path);
  }
}

// The Fourier kernels of an n^3 mesh of unit cells, built in float64 the way
// torchpm.fourier.FourierKernels builds them: the three 1-d gradient kernels
// i g(w) (complex, broadcasting against the (n, n, n/2+1) block) and 1/|w|^2,
// repeated on a last axis of 2 to multiply the real view of the complex field.
struct Kernels {
  std::vector<at::Tensor> gradient;
  at::Tensor inverse_laplacian_pair;
};

Kernels make_kernels(int64_t n, double force_scale, double particle_mass, const torch::Device& device) {
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const double two_pi = 2.0 * M_PI;
  const std::vector<at::Tensor> w = {
      (torch::fft::fftfreq(n, 1.0, f64) * two_pi).view({n, 1, 1}),
      (torch::fft::fftfreq(n, 1.0, f64) * two_pi).view({1, n, 1}),
      (torch::fft::rfftfreq(n, 1.0, f64) * two_pi).view({1, 1, n / 2 + 1}),
  };
  Kernels kernels;
  at::Tensor k_squared;
  for (const auto& wi : w) {
    const at::Tensor g = (8.0 * torch::sin(wi) - torch::sin(2.0 * wi)) / 6.0;
    // i g times the force scale and the mean-1 normalisation, folded into the
    // 1-d kernels as torchpm.pm.compute_forces does.
    kernels.gradient.push_back(
        (torch::complex(torch::zeros_like(g), g) * (force_scale * particle_mass)).to(device));
    const at::Tensor term = torch::pow(wi, 2);
    k_squared = k_squared.defined() ? k_squared + term : term;
  }
  const at::Tensor positive = k_squared > 0;
  const at::Tensor inverse = torch::where(
      positive, 1.0 / torch::where(positive, k_squared, torch::ones_like(k_squared)),
      torch::zeros_like(k_squared));
  kernels.inverse_laplacian_pair =
      inverse.unsqueeze(-1).expand({n, n, n / 2 + 1, 2}).contiguous().to(device);
  return kernels;
}

// F (B, N, 3) at `positions` (B, N, 3), differentiable in the positions.
at::Tensor compute_forces(const at::Tensor& positions, const Kernels& kernels, int64_t n) {
  const std::vector<int64_t> shape = {n, n, n};
  const at::Tensor density = torchpm::cic_paint(positions, std::nullopt, shape);
  const at::Tensor density_k = torch::fft::rfftn(density, std::nullopt, std::vector<int64_t>{-3, -2, -1});
  const at::Tensor potential_k =
      torch::view_as_complex(torch::view_as_real(density_k) * kernels.inverse_laplacian_pair);
  // -d_i grad^-2 = -(i g_i)(-1/|w|^2) = (i g_i) / |w|^2
  std::vector<at::Tensor> components;
  for (const auto& g : kernels.gradient) {
    components.push_back(potential_k * g);
  }
  const at::Tensor field = torch::fft::irfftn(
      torch::stack(components, 1), shape, std::vector<int64_t>{-3, -2, -1});
  return torchpm::cic_readout(field, positions);  // (B, N, 3): 3 channels, one pass
}

// A whole command-line number, or an error naming the argument and what it must
// be (std::stoll alone accepts "12abc" and reports "abc" only as "stoll").
template <typename Number, typename Parse>
Number number_argument(const char* text, const char* name, const char* what, Parse parse) {
  size_t used = 0;
  Number value{};
  try {
    value = parse(std::string(text), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || text[used] != '\0' || !std::isfinite(static_cast<double>(value))) {
    throw std::runtime_error(std::string(name) + " must be " + what + ", got '" + text + "'");
  }
  return value;
}

int64_t integer_argument(const char* text, const char* name) {
  return number_argument<int64_t>(text, name, "an integer",
                                  [](const std::string& s, size_t* used) { return std::stoll(s, used); });
}

double real_argument(const char* text, const char* name) {
  return number_argument<double>(text, name, "a finite number",
                                 [](const std::string& s, size_t* used) { return std::stod(s, used); });
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5 || argc > 6) {
    std::cerr << "usage: " << argv[0]
              << " MESH_SIZE FORCE_SCALE POSITIONS OUTPUT [cpu|cuda]\n"
                 "  POSITIONS: raw float64 (1, N, 3) in mesh-cell units; OUTPUT: raw\n"
                 "  float64 forces (1, N, 3) then d(sum F^2)/dx (1, N, 3).\n";
    return 2;
  }
  try {
    const int64_t n = integer_argument(argv[1], "MESH_SIZE");
    const double force_scale = real_argument(argv[2], "FORCE_SCALE");
    const torch::Device device(argc == 6 ? argv[5] : "cpu");
    if (n < 2) {
      throw std::runtime_error("MESH_SIZE must be at least 2, got " + std::string(argv[1]));
    }
    if (device.is_cuda() && !torchpm::has_cuda_kernels()) {
      throw std::runtime_error("device cuda asked for, but this torchpm build has no CUDA kernels");
    }
    const at::Tensor positions = read_positions(argv[3]).to(device).requires_grad_(true);
    const double particle_mass =
        static_cast<double>(n * n * n) / static_cast<double>(positions.size(1));
    const Kernels kernels = make_kernels(n, force_scale, particle_mass, device);

    const at::Tensor forces = compute_forces(positions, kernels, n);
    const at::Tensor loss = (forces * forces).sum();
    const at::Tensor gradient = torch::autograd::grad({loss}, {positions})[0];

    write_tensors(argv[4], {forces, gradient});
    std::cout << "pm_forces: " << positions.size(1) << " particles, mesh " << n << "^3 on "
              << device << "; |F| max " << forces.abs().max().item<double>() << ", sum F^2 "
              << loss.item<double>() << "; torchpm CUDA kernels "
              << (torchpm::has_cuda_kernels() ? "yes" : "no") << ", CPU kernels "
              << torchpm::cpu_kernels() << "\n";
  } catch (const std::exception& error) {
    std::cerr << "pm_forces: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
