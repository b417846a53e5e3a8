// CPU kernels of the cloud-in-cell ops.
//
// Paint is a scatter. To parallelise it without atomics or per-thread meshes,
// particles are binned (stable counting sort) by the x plane of their lower
// stencil node. A particle in plane i writes planes i and i + 1 only, so all
// even planes can be painted concurrently, then all odd planes. Every mesh cell
// then receives its contributions in an order fixed by the input alone, so the
// result does not depend on the number of threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "../cic_stencil.h"
#include "../torchpm.h"

namespace torchpm {
namespace {

// Below this many particles the binning costs more than it saves.
constexpr int64_t kSerialPaintLimit = 1 << 15;

template <typename scalar_t>
void deposit(
    const scalar_t* position,
    const scalar_t* values,  // C entries, or nullptr for unit weight
    int64_t channels,
    int64_t channel_stride,
    const CicGeometry& g,
    scalar_t* mesh) {
  using acc_t = at::opmath_type<scalar_t>;
  CicStencil<acc_t> s;
  cic_stencil<scalar_t, acc_t>(position, g, s);
  int64_t idx[8];
  acc_t w[8];
  cic_corners(s, g, idx, w);
  for (int64_t ch = 0; ch < channels; ++ch) {
    const acc_t v = values ? static_cast<acc_t>(values[ch]) : acc_t(1);
    scalar_t* m = mesh + ch * channel_stride;
    for (int corner = 0; corner < 8; ++corner) {
      m[idx[corner]] += static_cast<scalar_t>(v * w[corner]);
    }
  }
}

inline void prefetch(const void* address) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(address);
#else
  (void)address;
#endif
}

// Visits particles [begin, end) in chunks: first computes the chunk's stencils
// and prefetches every mesh line they touch, then calls visit(p, stencil) for
// each valid particle. In random particle order each gather is a cache miss;
// issuing a chunk's loads ahead lets the memory system serve them in parallel
// instead of one after another. Returns the number of rejected particles.
template <typename scalar_t, typename acc_t, typename Visit>
int64_t gather_particles(
    const scalar_t* positions,
    int64_t begin,
    int64_t end,
    const CicGeometry& g,
    const scalar_t* field,
    int64_t batch,
    int64_t per_batch,
    int64_t channels,
    const Visit& visit) {
  constexpr int kChunk = 16;
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  CicStencil<acc_t> stencil[kChunk];
  bool valid[kChunk];
  int64_t bad = 0;
  for (int64_t first = begin; first < end; first += kChunk) {
    const int count = static_cast<int>(std::min<int64_t>(kChunk, end - first));
    for (int i = 0; i < count; ++i) {
      const int64_t p = first + i;
      CicStencil<acc_t>& s = stencil[i];
      valid[i] = cic_stencil<scalar_t, acc_t>(positions + 3 * p, g, s);
      if (!valid[i]) {
        continue;
      }
      const scalar_t* m = field + (batch == 1 ? 0 : p / per_batch) * channels * channel_stride;
      for (int64_t ch = 0; ch < channels; ++ch) {
        for (int a = 0; a < 2; ++a) {
          for (int b = 0; b < 2; ++b) {
            const scalar_t* row = m + ch * channel_stride + s.offset[0][a] + s.offset[1][b];
            prefetch(row + s.offset[2][0]);
            prefetch(row + s.offset[2][1]);
          }
        }
      }
    }
    for (int i = 0; i < count; ++i) {
      if (valid[i]) {
        visit(first + i, stencil[i]);
      } else {
        ++bad;
      }
    }
  }
  return bad;
}

// Checks every particle; returns the number rejected and fills `plane` (the x
// index of each particle's lower stencil node) when it is not null.
template <typename scalar_t>
int64_t check_and_bin(
    const scalar_t* positions,
    int64_t count,
    const CicGeometry& g,
    int64_t* plane) {
  using acc_t = at::opmath_type<scalar_t>;
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, count, 4096, [&](int64_t begin, int64_t end) {
    int64_t local_bad = 0;
    CicStencil<acc_t> s;
    for (int64_t p = begin; p < end; ++p) {
      const bool ok = cic_stencil<scalar_t, acc_t>(positions + 3 * p, g, s);
      local_bad += ok ? 0 : 1;
      if (plane) {
        plane[p] = ok ? s.lower_x : 0;
      }
    }
    bad += local_bad;
  });
  return bad.load();
}

template <typename scalar_t>
void paint_kernel(
    const at::Tensor& positions,  // (B, N, 3) contiguous
    const scalar_t* values,       // (B, N, C) contiguous or nullptr
    int64_t channels,
    const CicGeometry& g,
    at::Tensor& mesh) {  // (B, C, nx, ny, nz) contiguous zeros
  const int64_t batch = positions.size(0);
  const int64_t n = positions.size(1);
  const int64_t nx = g.shape[0];
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  const scalar_t* pos = positions.data_ptr<scalar_t>();
  scalar_t* out = mesh.data_ptr<scalar_t>();
  const int64_t total = batch * n;

  const bool serial = total < kSerialPaintLimit || at::get_num_threads() == 1;
  std::vector<int64_t> plane(serial ? 0 : total);
  const int64_t bad = check_and_bin(pos, total, g, serial ? nullptr : plane.data());
  if (bad > 0) {
    throw_bad_particles("torchpm.cic_paint", positions, g, bad);
  }
  auto paint_one = [&](int64_t p) {
    const int64_t b = batch == 1 ? 0 : p / n;
    deposit<scalar_t>(
        pos + 3 * p, values ? values + channels * p : nullptr, channels,
        channel_stride, g, out + b * channels * channel_stride);
  };
  if (serial) {
    for (int64_t p = 0; p < total; ++p) {
      paint_one(p);
    }
    return;
  }

  // Stable counting sort of particles into bins (batch, plane).
  const int64_t bins = batch * nx;
  std::vector<int64_t> start(bins + 1, 0);
  for (int64_t b = 0, p = 0; b < batch; ++b) {
    for (int64_t i = 0; i < n; ++i, ++p) {
      ++start[b * nx + plane[p] + 1];
    }
  }
  for (int64_t i = 0; i < bins; ++i) {
    start[i + 1] += start[i];
  }
  std::vector<int64_t> order(total);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t b = 0, p = 0; b < batch; ++b) {
      for (int64_t i = 0; i < n; ++i, ++p) {
        order[fill[b * nx + plane[p]]++] = p;
      }
    }
  }
  // Plane nx - 1 of a periodic axis writes plane 0 too; when nx is odd it has
  // the parity of plane 0 and goes in a phase of its own.
  const bool last_alone = g.periodic[0] && (nx % 2 == 1) && nx > 1;
  auto paint_bin = [&](int64_t bin) {
    // Binned order reads positions out of order: fetch a few particles ahead.
    constexpr int64_t kAhead = 8;
    const int64_t stop = start[bin + 1];
    for (int64_t k = start[bin]; k < stop; ++k) {
      if (k + kAhead < stop) {
        const int64_t ahead = order[k + kAhead];
        prefetch(pos + 3 * ahead);
        if (values) {
          prefetch(values + channels * ahead);
        }
      }
      paint_one(order[k]);
    }
  };
  for (int parity = 0; parity < 2; ++parity) {
    const int64_t planes_in_phase = (nx - parity + 1) / 2;
    const int64_t tasks = batch * planes_in_phase;
    // Planes hold very different particle counts once structure forms, so
    // threads take planes from a shared counter (dynamic scheduling) on torch's
    // own thread pool.
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks);
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      for (int64_t t = next++; t < tasks; t = next++) {
        const int64_t b = t / planes_in_phase;
        const int64_t i = 2 * (t % planes_in_phase) + parity;
        if (last_alone && i == nx - 1) {
          continue;
        }
        paint_bin(b * nx + i);
      }
    });
  }
  if (last_alone) {
    for (int64_t b = 0; b < batch; ++b) {
      paint_bin(b * nx + nx - 1);
    }
  }
}

at::Tensor cic_paint_cpu(
    const at::Tensor& positions_in,
    const std::optional<at::Tensor>& weights_in,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic) {
  const char* op = "torchpm.cic_paint";
  auto positions = check_positions(op, positions_in);
  const CicGeometry g = make_geometry(op, shape, offset, periodic);
  int64_t channels = 1;
  bool has_channel_dim = false;
  at::Tensor weights;
  if (weights_in.has_value()) {
    weights = check_particle_values(
        op, "weights", *weights_in, positions, channels, has_channel_dim);
  }
  auto mesh = at::zeros(
      {positions.size(0), channels, shape[0], shape[1], shape[2]},
      positions.options());
  if (positions.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "cic_paint_cpu", [&] {
      paint_kernel<scalar_t>(
          positions, weights.defined() ? weights.data_ptr<scalar_t>() : nullptr,
          channels, g, mesh);
    });
  }
  return has_channel_dim ? mesh : mesh.squeeze(1);
}

at::Tensor cic_readout_cpu(
    const at::Tensor& mesh_in,
    const at::Tensor& positions_in,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic) {
  const char* op = "torchpm.cic_readout";
  auto positions = check_positions(op, positions_in);
  int64_t channels = 1;
  bool has_channel_dim = false;
  auto mesh = check_mesh(op, "mesh", mesh_in, positions, channels, has_channel_dim);
  const CicGeometry g = make_geometry(
      op, mesh.sizes().slice(2), offset, periodic);
  const int64_t batch = positions.size(0);
  const int64_t n = positions.size(1);
  auto out = at::empty({batch, n, channels}, positions.options());
  if (out.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "cic_readout_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* pos = positions.data_ptr<scalar_t>();
      const scalar_t* field = mesh.data_ptr<scalar_t>();
      scalar_t* result = out.data_ptr<scalar_t>();
      const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
      std::atomic<int64_t> bad{0};
      at::parallel_for(0, batch * n, 2048, [&](int64_t begin, int64_t end) {
        bad += gather_particles<scalar_t, acc_t>(
            pos, begin, end, g, field, batch, n, channels,
            [&](int64_t p, const CicStencil<acc_t>& s) {
              const scalar_t* m = field + (batch == 1 ? 0 : p / n) * channels * channel_stride;
              int64_t idx[8];
              acc_t w[8];
              cic_corners(s, g, idx, w);
              for (int64_t ch = 0; ch < channels; ++ch) {
                const scalar_t* mc = m + ch * channel_stride;
                acc_t acc = 0;
                for (int corner = 0; corner < 8; ++corner) {
                  acc += w[corner] * static_cast<acc_t>(mc[idx[corner]]);
                }
                result[p * channels + ch] = static_cast<scalar_t>(acc);
              }
            });
      });
      if (bad.load() > 0) {
        throw_bad_particles(op, positions, g, bad.load());
      }
    });
  }
  return has_channel_dim ? out : out.squeeze(2);
}

at::Tensor cic_position_gradient_cpu(
    const at::Tensor& mesh_in,
    const at::Tensor& positions_in,
    const std::optional<at::Tensor>& values_in,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic) {
  const char* op = "torchpm._cic_position_gradient";
  auto positions = check_positions(op, positions_in);
  int64_t channels = 1;
  bool has_channel_dim = false;
  auto mesh = check_mesh(op, "mesh", mesh_in, positions, channels, has_channel_dim);
  at::Tensor values;
  if (values_in.has_value()) {
    int64_t value_channels = 1;
    bool value_channel_dim = false;
    values = check_particle_values(
        op, "values", *values_in, positions, value_channels, value_channel_dim);
    TORCH_CHECK_VALUE(
        value_channels == channels && value_channel_dim == has_channel_dim, op,
        ": `values` must have one entry per channel of `mesh`.");
  } else {
    TORCH_CHECK_VALUE(channels == 1 && !has_channel_dim, op,
                      ": `values` may be omitted only for a single-channel mesh.");
  }
  const CicGeometry g = make_geometry(
      op, mesh.sizes().slice(2), offset, periodic);
  const int64_t batch = positions.size(0);
  const int64_t n = positions.size(1);
  auto out = at::empty({batch, n, 3}, positions.options());
  if (out.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "cic_position_gradient_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* pos = positions.data_ptr<scalar_t>();
      const scalar_t* field = mesh.data_ptr<scalar_t>();
      const scalar_t* val = values.defined() ? values.data_ptr<scalar_t>() : nullptr;
      scalar_t* result = out.data_ptr<scalar_t>();
      const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
      std::atomic<int64_t> bad{0};
      at::parallel_for(0, batch * n, 2048, [&](int64_t begin, int64_t end) {
        bad += gather_particles<scalar_t, acc_t>(
            pos, begin, end, g, field, batch, n, channels,
            [&](int64_t p, const CicStencil<acc_t>& s) {
              const scalar_t* m = field + (batch == 1 ? 0 : p / n) * channels * channel_stride;
              acc_t grad[3] = {0, 0, 0};
              for (int corner = 0; corner < 8; ++corner) {
                const int a = corner >> 2, b = (corner >> 1) & 1, c = corner & 1;
                const int64_t idx = cic_corner_index(s, g, a, b, c);
                acc_t sum = 0;
                for (int64_t ch = 0; ch < channels; ++ch) {
                  const acc_t v = val ? static_cast<acc_t>(val[p * channels + ch]) : acc_t(1);
                  sum += v * static_cast<acc_t>(m[ch * channel_stride + idx]);
                }
                acc_t dw[3];
                cic_corner_weight_gradient(s, a, b, c, dw);
                grad[0] += sum * dw[0];
                grad[1] += sum * dw[1];
                grad[2] += sum * dw[2];
              }
              for (int d = 0; d < 3; ++d) {
                result[3 * p + d] = static_cast<scalar_t>(grad[d]);
              }
            });
      });
      if (bad.load() > 0) {
        throw_bad_particles(op, positions, g, bad.load());
      }
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CPU, m) {
  m.impl("cic_paint", &cic_paint_cpu);
  m.impl("cic_readout", &cic_readout_cpu);
  m.impl("_cic_position_gradient", &cic_position_gradient_cpu);
}

}  // namespace torchpm
