// CPU kernels of the mass-assignment ops (NGP, CIC, TSC, PCS), written once as
// templates over the stencil width W (stencil.h) and instantiated per order.
//
// Paint is a scatter. To parallelise it without atomics or per-thread meshes,
// particles are binned (stable counting sort) by the x plane of their first
// stencil node. A particle in plane i writes planes i .. i + W - 1 only, so all
// planes i with the same i mod W can be painted concurrently, one residue after
// another (W phases). Every mesh cell then receives its contributions in an
// order fixed by the input alone, so the result does not depend on the number
// of threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../error_checking.h"
#include "../node_paint.h"
#include "../stencil.h"
#include "stencil_block.h"
#include "../tile_paint.h"
#include "../torchpm.h"
#include "../updates.h"
#include "kernel_variant.h"

// Everything above was compiled for the baseline; what follows is compiled a
// second time for AVX2 by mass_assignment_avx2.cpp. It is all internal to this
// file but the registration, so the two builds share no symbol of their own
// and every inline function of the headers above stays baseline code.
#ifdef TORCHPM_MASS_ASSIGNMENT_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,bmi,bmi2,lzcnt,popcnt")
#endif

namespace torchpm {
namespace {

// Below this many particles the binning costs more than it saves.
constexpr int64_t kSerialPaintLimit = 1 << 15;

// Calls f(std::integral_constant<int, C>{}) with C = channels for the counts the
// simulation uses (1: density, 3: force, 4: force and density adjoint), else
// C = 0 (a runtime count). With C and W known the per-particle loops unroll
// fully and the stencil stays in registers; that, not memory, bounds the
// kernels when particles are in spatial or Lagrangian order.
template <typename F>
inline void dispatch_channels(int64_t channels, const F& f) {
  if (!dispatch_constant<1, 3, 4>(channels, f)) {
    f(std::integral_constant<int, 0>{});
  }
}

// Whether the W nodes a stencil touches along each axis are distinct mesh
// nodes: always on a block axis (first_node keeps the stencil inside), and on a
// periodic axis of at least W nodes (a smaller one wraps a node twice).
template <int W>
bool nodes_distinct(const StencilGeometry& g) {
  for (int d = 0; d < 3; ++d) {
    if (g.periodic[d] && g.shape[d] < W) {
      return false;
    }
  }
  return true;
}

// Deposits one particle; C > 0: the channel count known at compile time (see
// dispatch_channels), C = 0: `channels`. `distinct` (nodes_distinct): every
// node of a channel is read before any is written back. Node (i, y, z) and
// (i + 1, y, z) lie a plane apart, often a multiple of 4 KiB: a load issued
// after a store to the plane before (read-add-write node by node) waits on
// that store as if it overlapped (the core tells addresses apart by their low
// 12 bits first), and that, not arithmetic or memory, bounded the deposit
// (twice as fast for CIC in Lagrangian order). Each node still receives
// exactly one rounded addition per particle, in particle order: the same bits.
template <typename scalar_t, int W, int C, typename acc_t>
C10_ALWAYS_INLINE void deposit_stencil(
    const Stencil<acc_t, W>& s,
    const scalar_t* values,  // C entries, or nullptr for unit weight
    int64_t channels,
    int64_t channel_stride,
    bool distinct,
    scalar_t* mesh,
    int64_t rows_begin = 0,
    int64_t rows_end = std::numeric_limits<int64_t>::max()) {
  // The x planes this call may write (element offsets rows_begin <= offset <
  // rows_end; all by default): a particle on the edge of a slab of the
  // plane-ownership paint writes only its planes inside the slab.
  unsigned inside = 0;
  for (int a = 0; a < W; ++a) {
    inside |= (s.offset[0][a] >= rows_begin && s.offset[0][a] < rows_end) ? 1u << a : 0u;
  }
  if (inside == 0) {
    return;
  }
  const bool all_rows = inside == (1u << W) - 1;
  const int64_t nc = C > 0 ? C : channels;
  for (int64_t ch = 0; ch < nc; ++ch) {
    const acc_t v = values ? static_cast<acc_t>(values[ch]) : acc_t(1);
    scalar_t* m = mesh + ch * channel_stride;
    if (distinct && all_rows) {
      constexpr int kNodes = W * W * W;
      int64_t node[kNodes];
      scalar_t sum[kNodes];
#pragma GCC unroll 64
      for (int i = 0; i < kNodes; ++i) {
        node[i] = s.offset[0][i / (W * W)] + s.offset[1][(i / W) % W] + s.offset[2][i % W];
      }
#pragma GCC unroll 64
      for (int i = 0; i < kNodes; ++i) {
        sum[i] = m[node[i]];
      }
#pragma GCC unroll 64
      for (int i = 0; i < kNodes; ++i) {
        const acc_t wab = s.weight[0][i / (W * W)] * s.weight[1][(i / W) % W];
        sum[i] += static_cast<scalar_t>(v * (wab * s.weight[2][i % W]));
      }
#pragma GCC unroll 64
      for (int i = 0; i < kNodes; ++i) {
        m[node[i]] = sum[i];
      }
      continue;
    }
    for (int a = 0; a < W; ++a) {
      if (!(inside & (1u << a))) {
        continue;
      }
      for (int b = 0; b < W; ++b) {
        scalar_t* row = m + s.offset[0][a] + s.offset[1][b];
        const acc_t wab = s.weight[0][a] * s.weight[1][b];
        for (int c = 0; c < W; ++c) {
          row[s.offset[2][c]] += static_cast<scalar_t>(v * (wab * s.weight[2][c]));
        }
      }
    }
  }
}

// deposit_stencil for particle k of a block, CIC (W = 2) with distinct nodes:
// the 8 nodes and weights straight from the block's first nodes and fractions,
// without the general stencil's arrays (which cost more than the deposit
// itself). The same products and sums as deposit_stencil, so the same bits
// (`kUnit`: no values, unit weight, whose product 1 * w = w is left out).
// `kClip`: the particle may have planes outside [rows_begin, rows_end), and
// then returns false (the caller takes deposit_stencil); without it every
// plane is inside.
template <typename scalar_t, int C, bool kUnit, bool kClip, typename acc_t, int K>
C10_ALWAYS_INLINE bool deposit_cic(
    const BlockNodes<acc_t, K>& nodes, int k, const StencilGeometry& g, const scalar_t* values,
    int64_t channel_stride, scalar_t* mesh, int64_t rows_begin, int64_t rows_end) {
  static_assert(C > 0, "deposit_cic: channel count known at compile time");
  const CicNodes<acc_t> cic(nodes, k, g, 1);
  if (kClip && !(cic.x[0] >= rows_begin && cic.x[0] < rows_end && cic.x[1] >= rows_begin && cic.x[1] < rows_end)) {
    return false;
  }
  const acc_t* wx = cic.wx;
  const acc_t* wy = cic.wy;
  const acc_t* wz = cic.wz;
  const int64_t z0 = cic.z[0];
  const int64_t z1 = cic.z[1];
  const int64_t row[4] = {cic.x[0] + cic.y[0], cic.x[0] + cic.y[1], cic.x[1] + cic.y[0], cic.x[1] + cic.y[1]};
  for (int ch = 0; ch < C; ++ch) {
    scalar_t* m = mesh + ch * channel_stride;
    scalar_t sum[8];
    for (int r = 0; r < 4; ++r) {
      sum[2 * r] = m[row[r] + z0];
      sum[2 * r + 1] = m[row[r] + z1];
    }
    for (int r = 0; r < 4; ++r) {
      const acc_t wab = wx[r >> 1] * wy[r & 1];
      if constexpr (kUnit) {
        sum[2 * r] += static_cast<scalar_t>(wab * wz[0]);
        sum[2 * r + 1] += static_cast<scalar_t>(wab * wz[1]);
      } else {
        const acc_t v = static_cast<acc_t>(values[ch]);
        sum[2 * r] += static_cast<scalar_t>(v * (wab * wz[0]));
        sum[2 * r + 1] += static_cast<scalar_t>(v * (wab * wz[1]));
      }
    }
    for (int r = 0; r < 4; ++r) {
      m[row[r] + z0] = sum[2 * r];
      m[row[r] + z1] = sum[2 * r + 1];
    }
  }
  return true;
}

// make_stencil and deposit_stencil: one particle, on the paths that visit
// particles out of order.
template <typename scalar_t, int W, int C>
C10_ALWAYS_INLINE void deposit(
    const scalar_t* position, const scalar_t* values, int64_t channels, int64_t channel_stride,
    const StencilGeometry& g, bool distinct, scalar_t* mesh) {
  using acc_t = at::opmath_type<scalar_t>;
  Stencil<acc_t, W> s;
  if (make_stencil<scalar_t, acc_t, W>(position, g, s)) {
    deposit_stencil<scalar_t, W, C>(s, values, channels, channel_stride, distinct, mesh);
  }
  // else rejected: reported, and poisoned by poison_rejected
}

inline void prefetch(const void* address) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(address);
#else
  (void)address;
#endif
}

// Four lanes of T (the GCC and Clang vector extension): the 3 or 4 channels
// of an interleaved node in one load and one multiply-add per node.
template <typename T>
struct Lanes4 {
  typedef T type __attribute__((vector_size(4 * sizeof(T))));
};

// (By reference: a 32-byte vector passed by value would change the ABI
// without AVX.)
template <typename T>
C10_ALWAYS_INLINE void load_lanes(const T* p, typename Lanes4<T>::type& v) {
  std::memcpy(&v, p, sizeof(v));
}

// CIC readout of particle k of a block straight from its nodes and fractions
// (no general stencil, whose arrays cost more than the reads): the 3 or 4
// channels of an interleaved mesh (read_interleaved) or `count` planar ones
// (interpolate), with exactly their products and sums, so the same bits.
// `readable_end`: one past the last element that may be loaded (the mesh's
// storage); interleaved channels are read four lanes at a time, a 3-channel
// node's fourth lane being the next node's first value (computed, never
// stored), except where that would load past readable_end.
// (The readout checks finiteness on the values written, all_finite.)
template <typename scalar_t, typename acc_t, int K, int C>
C10_ALWAYS_INLINE void read_cic(
    const BlockNodes<acc_t, K>& nodes, int k, const StencilGeometry& g, const MeshLayout& layout,
    int64_t count, const scalar_t* m, const scalar_t* readable_end, scalar_t* out) {
  const CicNodes<acc_t> cic(nodes, k, g, layout.node_stride);
  const int64_t* x = cic.x;
  const int64_t* y = cic.y;
  const int64_t* z = cic.z;
  const acc_t* wx = cic.wx;
  const acc_t* wy = cic.wy;
  const acc_t* wz = cic.wz;
  if constexpr ((C == 3 || C == 4) && std::is_same<scalar_t, acc_t>::value) {
    const int64_t top = std::max(x[0], x[1]) + std::max(y[0], y[1]) + std::max(z[0], z[1]);
    if (C == 4 || readable_end - m >= top + 4) {
      using V = typename Lanes4<acc_t>::type;
      V acc = {};
      for (int a = 0; a < 2; ++a) {
        for (int b = 0; b < 2; ++b) {
          const scalar_t* row = m + x[a] + y[b];
          V node0;
          V node1;
          load_lanes(row + z[0], node0);
          load_lanes(row + z[1], node1);
          V along_z = {};
          along_z += wz[0] * node0;
          along_z += wz[1] * node1;
          const acc_t wab = wx[a] * wy[b];
          acc += wab * along_z;
        }
      }
      for (int ch = 0; ch < C; ++ch) {
        out[ch] = acc[ch];
      }
      return;
    }
  }
  constexpr int kRead = C > 0 ? C : 1;
  const int64_t channels = C > 0 ? C : count;
  for (int64_t ch0 = 0; ch0 < channels; ch0 += kRead) {
    // C > 0: all C channels of a node together (interleaved); else one planar
    // channel at a time.
    const scalar_t* mc = m + (C > 0 ? 0 : ch0 * layout.channel);
    acc_t acc[kRead];
    for (int ch = 0; ch < kRead; ++ch) {
      acc[ch] = acc_t(0);
    }
    for (int a = 0; a < 2; ++a) {
      for (int b = 0; b < 2; ++b) {
        const scalar_t* row = mc + x[a] + y[b];
        acc_t along_z[kRead];
        for (int ch = 0; ch < kRead; ++ch) {
          along_z[ch] = acc_t(0);
        }
        for (int c = 0; c < 2; ++c) {
          const scalar_t* node = row + z[c];
          for (int ch = 0; ch < kRead; ++ch) {
            along_z[ch] += wz[c] * static_cast<acc_t>(node[ch]);
          }
        }
        const acc_t wab = wx[a] * wy[b];
        for (int ch = 0; ch < kRead; ++ch) {
          acc[ch] += wab * along_z[ch];
        }
      }
    }
    for (int ch = 0; ch < kRead; ++ch) {
      out[ch0 + ch] = static_cast<scalar_t>(acc[ch]);
    }
  }
}

// Whether the `count` values at v are all finite, from their exponent bits: a
// loop with no branch and no floating-point dependency, which vectorises.
template <typename scalar_t>
C10_ALWAYS_INLINE bool all_finite(const scalar_t* v, int64_t count) {
  using bits_t = typename std::conditional<sizeof(scalar_t) == 4, uint32_t, uint64_t>::type;
  constexpr bits_t exponent = sizeof(scalar_t) == 4 ? bits_t(0x7f800000u) : bits_t(0x7ff0000000000000ull);
  bits_t any = 0;
  for (int64_t i = 0; i < count; ++i) {
    bits_t bits;
    std::memcpy(&bits, v + i, sizeof(bits));
    any |= (bits & exponent) == exponent ? 1 : 0;
  }
  return any == 0;
}

// Visits particles [begin, end) in chunks, calling visit(p, stencil) for each
// valid particle; returns the number of rejected ones. A chunk whose first and
// last particles lie within a few cells of each other in x and y (spatial or
// Lagrangian order: the chunk walks along z through the same mesh rows, which
// stay in cache) is visited directly. Any other chunk first computes its
// stencils and prefetches every mesh line they touch, then visits: in random
// order each gather is a cache miss, and issuing a chunk's loads ahead lets the
// memory system serve them in parallel instead of one after another. (Storing
// and prefetching the stencils costs about a third of the kernel when the lines
// are in cache already, hence the two paths.)
struct NoBlockVisit {
  template <typename Nodes>
  bool operator()(int64_t, const Nodes&, int) const {
    return false;
  }
};

// Particles per chunk of gather_particles: fewer for wide stencils, whose
// prefetches fill the line-fill buffers sooner. Its block bounds (built once
// per call by the caller, shared by the threads):
template <int W>
constexpr int kGatherChunk = W <= 2 ? 16 : 4;
template <typename acc_t, int W>
using GatherBounds = BlockBounds<acc_t, W, kGatherChunk<W>>;

template <typename scalar_t, typename acc_t, int W, bool with_derivative, typename Visit,
          typename VisitBlock = NoBlockVisit>
int64_t gather_particles(
    const scalar_t* positions,
    int64_t begin,
    int64_t end,
    const StencilGeometry& g,
    const GatherBounds<acc_t, W>& bounds,
    const scalar_t* field,
    const MeshLayout& layout,
    int64_t batch,
    int64_t per_batch,
    int64_t channels,
    const Visit& visit,
    const VisitBlock& visit_block = VisitBlock()) {
  constexpr int kChunk = kGatherChunk<W>;
  // Cells in x and y within which a chunk counts as coherent.
  const acc_t near = acc_t(6);
  // Interleaved: a node's channels share its cache line.
  const int64_t prefetched = layout.node_stride == 1 ? channels : 1;
  Stencil<acc_t, W> stencil[kChunk];
  bool valid[kChunk];
  int64_t bad = 0;
  for (int64_t first = begin; first < end; first += kChunk) {
    const int count = static_cast<int>(std::min<int64_t>(kChunk, end - first));
    const scalar_t* head = positions + 3 * first;
    const scalar_t* tail = positions + 3 * (first + count - 1);
    // NaN compares false: such a chunk takes the general path.
    const bool coherent =
        std::abs(static_cast<acc_t>(head[0]) - static_cast<acc_t>(tail[0])) <= near &&
        std::abs(static_cast<acc_t>(head[1]) - static_cast<acc_t>(tail[1])) <= near;
    if (coherent) {
      BlockNodes<acc_t, kChunk> nodes;
      block_first_nodes<scalar_t, acc_t, W, kChunk>(head, count, g, bounds, nodes);
      for (int i = 0; i < count; ++i) {
        if (nodes.valid[i]) {
          // visit_block: a lean path straight from the block's nodes, when it has one
          if (visit_block(first + i, nodes, i)) {
            continue;
          }
          block_stencil<acc_t, W, with_derivative, kChunk>(nodes, i, g, layout.node_stride, stencil[0]);
          visit(first + i, stencil[0]);
        } else {
          ++bad;
        }
      }
      continue;
    }
    for (int i = 0; i < count; ++i) {
      const int64_t p = first + i;
      Stencil<acc_t, W>& s = stencil[i];
      valid[i] = make_stencil<scalar_t, acc_t, W, with_derivative>(positions + 3 * p, g, s, layout.node_stride);
      if (!valid[i]) {
        continue;
      }
      const scalar_t* m = field + (batch == 1 ? 0 : p / per_batch) * layout.member;
      for (int64_t ch = 0; ch < prefetched; ++ch) {
        for (int a = 0; a < W; ++a) {
          for (int b = 0; b < W; ++b) {
            const scalar_t* row = m + ch * layout.channel + s.offset[0][a] + s.offset[1][b];
            // The z nodes of one row are adjacent except across a periodic wrap.
            prefetch(row + s.offset[2][0]);
            prefetch(row + s.offset[2][W - 1]);
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

struct CheckResult {
  int64_t bad_positions = 0;
  int64_t bad_values = 0;
};

// Contiguous ranges of particles, one per thread, for the counting sort.
struct Ranges {
  int64_t count;   // particles
  int64_t ranges;  // number of ranges
  int64_t begin(int64_t r) const { return r * count / ranges; }
};

inline Ranges split_for_threads(int64_t count) {
  return {count, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count / (1 << 14)))};
}

// Checks every particle (position, and its values when `values` is not null).
// When `bin` is not null also fills it with (batch member) * nx + the x index
// of the particle's first stencil node (0 for a rejected particle), and counts
// the particles of every bin in each of the ranges: counts[r * bins + bin].
template <typename scalar_t, int W>
CheckResult check_and_bin(
    const scalar_t* positions,
    const scalar_t* values,
    int64_t channels,
    const Ranges& split,
    int64_t per_batch,
    const StencilGeometry& g,
    int64_t* bin,
    int64_t* counts) {
  using acc_t = at::opmath_type<scalar_t>;
  std::atomic<int64_t> bad{0};
  std::atomic<int64_t> bad_values{0};
  const int64_t nx = g.shape[0];
  const int64_t bins = (split.count / per_batch) * nx;
  at::parallel_for(0, split.ranges, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const int64_t begin = split.begin(r);
      const int64_t end = split.begin(r + 1);
      int64_t* range_counts = bin ? counts + r * bins : nullptr;
      int64_t local_bad = 0;
      int64_t local_bad_values = 0;
      // The batch member's first bin, stepped at member boundaries (no
      // division per particle).
      int64_t member = begin / per_batch;
      int64_t member_end = (member + 1) * per_batch;
      for (int64_t p = begin; p < end; ++p) {
        if (p == member_end) {
          ++member;
          member_end += per_batch;
        }
        int64_t first[3];
        const bool ok = locate<scalar_t, acc_t, W>(positions + 3 * p, g, first);
        local_bad += ok ? 0 : 1;
        if (bin) {
          const int64_t b = member * nx + (ok ? first[0] : 0);
          bin[p] = b;
          ++range_counts[b];
        }
        if (values) {
          local_bad_values += finite_values(values + p * channels, channels) ? 0 : 1;
        }
      }
      bad += local_bad;
      bad_values += local_bad_values;
    }
  });
  return {bad.load(), bad_values.load()};
}

// Stable counting sort by bin (0 .. bins-1) from the per-range counts of
// check_and_bin (overwritten): fills `order` (the particles bin by bin, each
// bin in particle order) and `start` (bins + 1 offsets). Each thread places one
// range; stability makes the result the same for any number of ranges.
void sort_by_bin(
    const int64_t* bin, const Ranges& split, int64_t bins, std::vector<int64_t>& counts,
    std::vector<int64_t>& start, int64_t* order) {
  start.assign(bins + 1, 0);
  int64_t running = 0;
  for (int64_t k = 0; k < bins; ++k) {
    start[k] = running;
    for (int64_t r = 0; r < split.ranges; ++r) {
      const int64_t c = counts[r * bins + k];
      counts[r * bins + k] = running;
      running += c;
    }
  }
  start[bins] = running;
  at::parallel_for(0, split.ranges, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      int64_t* next = counts.data() + r * bins;
      for (int64_t p = split.begin(r), stop = split.begin(r + 1); p < stop; ++p) {
        order[next[bin[p]]++] = p;
      }
    }
  });
}

// Deferred error checking (error_checking.h) lets a call with rejected particles
// return. Its result must not look valid: a rejected particle's entries of a
// readout or position gradient become NaN (`width` values per particle), and
// paint adds NaN to node (0, 0, 0) of every channel of the particle's batch.
// Only on the error path, hence a second pass.
template <typename scalar_t, int W>
void fill_rejected(
    const scalar_t* positions, int64_t count, const StencilGeometry& g, int64_t width,
    scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  Stencil<acc_t, W> s;
  for (int64_t p = 0; p < count; ++p) {
    if (!make_stencil<scalar_t, acc_t, W>(positions + 3 * p, g, s)) {
      std::fill(out + p * width, out + (p + 1) * width, std::numeric_limits<scalar_t>::quiet_NaN());
    }
  }
}

template <typename scalar_t, int W>
void poison_rejected(
    const scalar_t* positions, int64_t batch, int64_t n, int64_t channels,
    const StencilGeometry& g, scalar_t* mesh) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  Stencil<acc_t, W> s;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      if (!make_stencil<scalar_t, acc_t, W>(positions + 3 * (b * n + i), g, s)) {
        for (int64_t ch = 0; ch < channels; ++ch) {
          mesh[(b * channels + ch) * channel_stride] = std::numeric_limits<scalar_t>::quiet_NaN();
        }
        break;
      }
    }
  }
}

// Calls f(t) for t in [0, tasks) on torch's thread pool, threads taking tasks
// from a shared counter (dynamic scheduling: slabs and planes hold very
// different particle counts once structure forms).
template <typename F>
void run_tasks(int64_t tasks, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < tasks; t = next++) {
      f(t);
    }
  });
}

// Plane-ownership paint, the path for particles in spatial or Lagrangian
// order (the simulation keeps them so). Particles are summarised in chunks of
// kChunk: the circular range of x planes the chunk's stencils write. The
// member's planes are cut into slabs holding similar particle counts; a task
// owns one slab and walks, in particle order, the chunks whose range meets
// it, depositing each particle's planes inside the slab. Every node is then
// written by one task only, and receives its contributions in particle order:
// the serial loop's order, whatever the thread and slab counts, with no sort.
// Particles in scattered order make every chunk wide; they take the counting
// sort by plane instead (paint_kernel).
constexpr int64_t kOwnershipChunk = 128;

struct ChunkPlanes {
  int64_t start = 0;   // first plane (wrapped into [0, nx) on a periodic axis)
  int64_t length = 0;  // planes written, start .. start + length - 1 (circular); 0: none
  int64_t count = 0;   // particles
};

struct ChunkSummary {
  std::vector<ChunkPlanes> chunks;  // per member, chunks_per_member each
  int64_t chunks_per_member = 0;
  CheckResult check;
};

// The planes of chunk [first, last) from its x coordinates alone: when the
// chunk is whole blocks whose coordinates first_node accepts without doubt
// (`bounds.accept_*`: on a block axis inside the block, on a periodic axis
// below 2^22 in magnitude), its first x nodes are floor(s) - offset (wrapped
// on a periodic axis), monotone in s: its planes run from the node of the
// smallest shifted x to that of the largest. A chunk half a box wide or more
// (it may cross a periodic seam, and be narrow seen from the other side)
// returns false, as does any other: summarise_chunks then visits its
// particles one by one.
template <typename scalar_t, typename acc_t, int W, int K>
C10_ALWAYS_INLINE bool fast_chunk_planes(
    const scalar_t* positions, int64_t first, int64_t last, const StencilGeometry& g,
    const BlockBounds<acc_t, W, K>& bounds, ChunkPlanes& planes) {
  if (!bounds.usable || (last - first) % K != 0) {
    return false;
  }
  const acc_t shift = acc_t(1) - acc_t(W) / acc_t(2);
  acc_t low[3 * K];
  acc_t high[3 * K];
  for (int i = 0; i < 3 * K; ++i) {
    low[i] = std::numeric_limits<acc_t>::infinity();
    high[i] = -std::numeric_limits<acc_t>::infinity();
  }
  int32_t rejected = 0;
  for (int64_t p0 = first; p0 < last; p0 += K) {
    const scalar_t* x = positions + 3 * p0;
    for (int i = 0; i < 3 * K; ++i) {
      const acc_t s = static_cast<acc_t>(x[i]) + shift;
      rejected |= ((s >= bounds.accept_low[i]) & (s < bounds.accept_high[i])) ^ 1;
      low[i] = s < low[i] ? s : low[i];
      high[i] = s > high[i] ? s : high[i];
    }
  }
  if (rejected != 0) {
    return false;
  }
  acc_t smallest = low[0];
  acc_t largest = high[0];
  for (int k = 1; k < K; ++k) {
    smallest = std::min(smallest, low[3 * k]);
    largest = std::max(largest, high[3 * k]);
  }
  const int64_t start = static_cast<int64_t>(floor_of_bounded(smallest)) - g.offset[0];
  const int64_t stop = static_cast<int64_t>(floor_of_bounded(largest)) - g.offset[0];
  if (g.periodic[0]) {
    if (stop - start >= g.shape[0] / 2) {
      return false;
    }
    planes.start = wrap_index(start, g.shape[0]);
  } else {
    planes.start = start;
  }
  planes.length = std::min(stop - start + W, g.shape[0]);
  return true;
}

// One pass over the particles: the chunk ranges and the rejected particles
// (and non-finite values when `values` is not null).
template <typename scalar_t, int W>
ChunkSummary summarise_chunks(
    const scalar_t* positions, const scalar_t* values, int64_t channels, int64_t batch, int64_t n,
    const StencilGeometry& g) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int K = 16;
  ChunkSummary summary;
  summary.chunks_per_member = (n + kOwnershipChunk - 1) / kOwnershipChunk;
  summary.chunks.resize(batch * summary.chunks_per_member);
  const int64_t nx = g.shape[0];
  const int64_t half = nx / 2;
  const BlockBounds<acc_t, W, K> bounds(g);
  std::atomic<int64_t> bad{0};
  std::atomic<int64_t> bad_values{0};
  at::parallel_for(0, batch * summary.chunks_per_member, 64, [&](int64_t begin, int64_t end) {
    int64_t local_bad = 0;
    int64_t local_bad_values = 0;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t member = c / summary.chunks_per_member;
      const int64_t first = member * n + (c % summary.chunks_per_member) * kOwnershipChunk;
      const int64_t last = std::min(first + kOwnershipChunk, (member + 1) * n);
      ChunkPlanes& planes = summary.chunks[c];
      planes.count = last - first;
      if (values) {
        for (int64_t p = first; p < last; ++p) {
          local_bad_values += finite_values(values + p * channels, channels) ? 0 : 1;
        }
      }
      if (fast_chunk_planes<scalar_t, acc_t, W, K>(positions, first, last, g, bounds, planes)) {
        continue;
      }
      int64_t low = nx, high = -1, shifted_low = nx, shifted_high = -1;
      for_each_block<scalar_t, acc_t, W, K>(positions, first, last, g, bounds, [&](int64_t, const auto& nodes, int count) {
        for (int k = 0; k < count; ++k) {
          if (!nodes.valid[k]) {
            ++local_bad;
            continue;
          }
          const int64_t node = nodes.node[3 * k];
          low = std::min(low, node);
          high = std::max(high, node);
          // The same planes seen from half a box away: a chunk across the
          // periodic seam is narrow there.
          const int64_t shifted = node >= half ? node - half : node + (nx - half);
          shifted_low = std::min(shifted_low, shifted);
          shifted_high = std::max(shifted_high, shifted);
        }
      });
      if (high < 0) {
        continue;  // no accepted particle
      }
      if (g.periodic[0] && shifted_high - shifted_low < high - low) {
        planes.start = shifted_low + half;
        planes.start -= planes.start >= nx ? nx : 0;
        planes.length = shifted_high - shifted_low + W;
      } else {
        planes.start = low;
        planes.length = high - low + W;
      }
      planes.length = std::min(planes.length, nx);
    }
    bad += local_bad;
    bad_values += local_bad_values;
  });
  summary.check = {bad.load(), bad_values.load()};
  return summary;
}

// Whether planes [begin, end) meet the chunk's circular range.
inline bool chunk_meets(const ChunkPlanes& planes, int64_t begin, int64_t end, int64_t nx) {
  if (planes.length == 0) {
    return false;
  }
  const int64_t stop = planes.start + planes.length;
  return (planes.start < end && begin < stop) || (stop > nx && begin < stop - nx);
}

// Slab boundaries (slabs + 1 plane indices) that split the member's particles
// into similar counts, each chunk counted at its first plane.
inline std::vector<int64_t> balanced_slabs(
    const ChunkPlanes* chunks, int64_t count, int64_t nx, int64_t slabs) {
  std::vector<int64_t> per_plane(nx, 0);
  int64_t total = 0;
  for (int64_t c = 0; c < count; ++c) {
    if (chunks[c].length > 0) {
      per_plane[chunks[c].start] += chunks[c].count;
      total += chunks[c].count;
    }
  }
  std::vector<int64_t> bounds{0};
  int64_t running = 0;
  for (int64_t i = 0; i < nx && static_cast<int64_t>(bounds.size()) < slabs; ++i) {
    running += per_plane[i];
    if (running * slabs >= total * static_cast<int64_t>(bounds.size()) && i + 1 < nx) {
      bounds.push_back(i + 1);
    }
  }
  bounds.push_back(nx);
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  return bounds;
}

template <typename scalar_t, int W>
void paint_kernel(
    const char* op,
    const at::Tensor& positions,   // (B, N, 3) contiguous
    const at::Tensor& weights,     // (B, N, C) contiguous or undefined
    int64_t channels,
    const StencilGeometry& g,
    bool check_finite,
    at::Tensor& mesh) {  // (B, C, nx, ny, nz) contiguous zeros
  const int64_t batch = positions.size(0);
  const int64_t n = positions.size(1);
  const int64_t nx = g.shape[0];
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  const scalar_t* pos = positions.data_ptr<scalar_t>();
  const scalar_t* values = weights.defined() ? weights.data_ptr<scalar_t>() : nullptr;
  scalar_t* out = mesh.data_ptr<scalar_t>();
  const int64_t total = batch * n;

  // Decided by the particle count alone, never by the thread count: the
  // ownership and counting-sort paths give every cell its contributions in an
  // order fixed by the input; the serial loop and the ownership path the same
  // (particle) order.
  const bool serial = total < kSerialPaintLimit;
  const bool distinct = nodes_distinct<W>(g);
  if (!serial && distinct) {
    const ChunkSummary summary = summarise_chunks<scalar_t, W>(
        pos, check_finite ? values : nullptr, channels, batch, n, g);
    // Raises here in immediate mode; in deferred mode the valid particles are
    // painted and the mesh poisoned (NaN weights poison it by themselves).
    report_bad_particles(
        kPaintOp, {summary.check.bad_positions, summary.check.bad_values},
        CallDiagnosis(positions, weights, g));
    if (summary.check.bad_positions > 0) {
      poison_rejected<scalar_t, W>(pos, batch, n, channels, g, out);
    }
    // Which path, from the particles alone (never the thread count, which would
    // change the summation order): plane ownership while the chunks are narrow,
    // on average at most max(2 W + 2, nx / 8) planes, else the counting sort.
    // In a thin block (a rank's slab, nx ~ 33) particles late in a run span a
    // few planes per chunk and plane ownership still paints them 1.5-2x faster
    // than the counting sort (the first term; nx / 8 alone sent them to the sort).
    int64_t weighted_planes = 0;
    for (const ChunkPlanes& planes : summary.chunks) {
      weighted_planes += planes.count * (planes.length > 0 ? planes.length : 1);
    }
    const bool narrow = weighted_planes <= total * std::max<int64_t>(2 * W + 2, nx / 8);
    // Slabs: a few per thread for balance, at least 2 W planes wide (a chunk
    // meeting two slabs costs its stencils twice).
    const int64_t slabs = std::max<int64_t>(1, std::min<int64_t>(4 * at::get_num_threads(), nx / (2 * W)));
    std::vector<std::vector<int64_t>> bounds(batch);
    for (int64_t b = 0; b < batch; ++b) {
      bounds[b] = balanced_slabs(summary.chunks.data() + b * summary.chunks_per_member,
                                 summary.chunks_per_member, nx, slabs);
    }
    if (narrow) {
      std::vector<std::pair<int64_t, int64_t>> tasks;  // (member, slab)
      for (int64_t b = 0; b < batch; ++b) {
        for (size_t k = 0; k + 1 < bounds[b].size(); ++k) {
          tasks.emplace_back(b, static_cast<int64_t>(k));
        }
      }
      const int64_t plane = g.shape[1] * g.shape[2];
      using acc_t = at::opmath_type<scalar_t>;
      constexpr int kBlock = 16;
      dispatch_channels(channels, [&](auto channel_count) {
        constexpr int C = decltype(channel_count)::value;
        run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
            const int64_t b = tasks[t].first;
            const int64_t begin = bounds[b][tasks[t].second];
            const int64_t end = bounds[b][tasks[t].second + 1];
            const ChunkPlanes* chunks = summary.chunks.data() + b * summary.chunks_per_member;
            scalar_t* member_mesh = out + b * channels * channel_stride;
            const BlockBounds<acc_t, W, kBlock> block_bounds(g);
            for (int64_t c = 0; c < summary.chunks_per_member; ++c) {
              if (!chunk_meets(chunks[c], begin, end, nx)) {
                continue;
              }
              const int64_t first = b * n + c * kOwnershipChunk;
              const int64_t last = std::min(first + kOwnershipChunk, (b + 1) * n);
              // The chunk's particles, with the CIC deposit's variant fixed for
              // the chunk: unit weight or values, and whether a particle may
              // have planes outside the slab (a chunk whose planes all lie in
              // it needs no test per particle).
              auto deposit_chunk = [&](auto unit, auto clip) {
                constexpr bool kUnit = decltype(unit)::value;
                constexpr bool kClip = decltype(clip)::value;
                for_each_block<scalar_t, acc_t, W, kBlock>(pos, first, last, g, block_bounds, [&](int64_t p0, const auto& nodes, int count) {
                  for (int k = 0; k < count; ++k) {
                    if (!nodes.valid[k]) {
                      continue;  // rejected: reported, and poisoned by poison_rejected
                    }
                    const int64_t p = p0 + k;
                    const scalar_t* v = values ? values + channels * p : nullptr;
                    if constexpr (W == 2 && C > 0) {
                      if (deposit_cic<scalar_t, C, kUnit, kClip>(
                              nodes, k, g, v, channel_stride, member_mesh, begin * plane, end * plane)) {
                        continue;
                      }
                    }
                    Stencil<acc_t, W> s;
                    block_stencil<acc_t, W, false, kBlock>(nodes, k, g, 1, s);
                    deposit_stencil<scalar_t, W, C>(
                        s, v, channels, channel_stride, true, member_mesh, begin * plane, end * plane);
                  }
                });
              };
              const bool whole = chunks[c].start >= begin && chunks[c].start + chunks[c].length <= end;
              using Yes = std::true_type;
              using No = std::false_type;
              if (whole) {
                values ? deposit_chunk(No(), No()) : deposit_chunk(Yes(), No());
              } else {
                values ? deposit_chunk(No(), Yes()) : deposit_chunk(Yes(), Yes());
              }
            }
        });
      });
      return;
    }
  }
  const Ranges split = split_for_threads(total);
  // Per-particle scratch, written in full before it is read: not zeroed (a
  // std::vector would write it once more).
  std::unique_ptr<int64_t[]> particle_bin(serial ? nullptr : new int64_t[total]);
  std::vector<int64_t> counts(serial ? 0 : split.ranges * batch * nx, 0);
  // After the summary pass (ownership declined) the particles are reported
  // already: bin them without checking the values again.
  const bool reported = !serial && distinct;
  const CheckResult check = check_and_bin<scalar_t, W>(
      pos, check_finite && !reported ? values : nullptr, channels, split, n, g,
      particle_bin.get(), counts.data());
  if (!reported) {
    report_bad_particles(
        kPaintOp, {check.bad_positions, check.bad_values}, CallDiagnosis(positions, weights, g));
    if (check.bad_positions > 0) {
      poison_rejected<scalar_t, W>(pos, batch, n, channels, g, out);
    }
  }
  // Particles by bin (batch, plane).
  std::vector<int64_t> start;
  std::unique_ptr<int64_t[]> order(serial ? nullptr : new int64_t[total]);
  if (!serial) {
    sort_by_bin(particle_bin.get(), split, batch * nx, counts, start, order.get());
    particle_bin.reset();
    counts = std::vector<int64_t>();
  }
  dispatch_channels(channels, [&](auto channel_count) {
    constexpr int C = decltype(channel_count)::value;
    auto paint_one = [&](int64_t p) {
      const int64_t b = batch == 1 ? 0 : p / n;
      deposit<scalar_t, W, C>(
          pos + 3 * p, values ? values + channels * p : nullptr, channels,
          channel_stride, g, distinct, out + b * channels * channel_stride);
    };
    if (serial) {
      for (int64_t p = 0; p < total; ++p) {
        paint_one(p);
      }
      return;
    }

    // On a periodic axis, planes at or past the last multiple of W wrap into
    // planes 0 .. W - 2 and may collide with bins of their own residue: they are
    // painted one by one after the phases. Bins below that limit of one residue
    // are at least W apart and, wrapped, still do not overlap.
    const int64_t phased = g.periodic[0] ? nx - nx % W : nx;
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
    for (int residue = 0; residue < W; ++residue) {
      const int64_t planes_in_phase = phased > residue ? (phased - residue + W - 1) / W : 0;
      const int64_t tasks = batch * planes_in_phase;
      if (tasks == 0) {
        continue;
      }
      run_tasks(tasks, [&](int64_t t) {
        const int64_t b = t / planes_in_phase;
        const int64_t i = W * (t % planes_in_phase) + residue;
        paint_bin(b * nx + i);
      });
    }
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = phased; i < nx; ++i) {
        paint_bin(b * nx + i);
      }
    }
  });
}

at::Tensor paint_cpu(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool check_finite) {
  const char* op = "torchpm.paint";
  return paint_op(op, positions, weights, shape, offset, periodic, order, /*accumulates=*/true,
                  [&](const PaintArguments& args, at::Tensor& mesh, auto dtype, auto width) {
    paint_kernel<typename decltype(dtype)::type, decltype(width)::value>(
        op, args.positions, args.weights, args.channels, args.geometry, check_finite, mesh);
  });
}

// The node-by-node paint (node_paint.h): the same passes as on CUDA, each a
// parallel loop over the function CUDA runs per thread, so the CPU tests check
// the GPU's arithmetic. (The scatter paint above is the CPU's fast path; it is
// deterministic already.)
template <typename scalar_t, int W>
void paint_by_node(const PaintArguments& args, bool check_finite, at::Tensor& mesh) {
  using acc_t = at::opmath_type<scalar_t>;
  const StencilGeometry& g = args.geometry;
  const int64_t batch = args.positions.size(0);
  const int64_t n = args.positions.size(1);
  const int64_t total = batch * n;
  const int64_t channels = args.channels;
  const scalar_t* pos = args.positions.data_ptr<scalar_t>();
  const scalar_t* values = args.weights.defined() ? args.weights.data_ptr<scalar_t>() : nullptr;

  auto keys = at::empty({total}, args.positions.options().dtype(at::kLong));
  int64_t* key = keys.data_ptr<int64_t>();
  std::atomic<int64_t> bad{0};
  std::atomic<int64_t> bad_values{0};
  at::parallel_for(0, total, 1 << 12, [&](int64_t begin, int64_t end) {
    int64_t local_bad = 0;
    int64_t local_bad_values = 0;
    for (int64_t p = begin; p < end; ++p) {
      local_bad += cell_key<scalar_t, acc_t, W>(pos + 3 * p, g, p / n, key[p]) ? 0 : 1;
      if (check_finite && values) {
        local_bad_values += finite_values(values + p * channels, channels) ? 0 : 1;
      }
    }
    bad += local_bad;
    bad_values += local_bad_values;
  });
  // Raises here in immediate mode; in deferred mode the mesh is painted and
  // poisoned (paint_node).
  report_bad_particles(
      kPaintOp, {bad.load(), bad_values.load()}, CallDiagnosis(args.positions, args.weights, g));

  const auto sorted = sort_particles_by_key(keys, args.positions, args.weights);
  const int64_t cells = g.shape[0] * g.shape[1] * g.shape[2];
  const int64_t key_count = batch * (cells + 1);
  auto start = at::empty({key_count + 1}, keys.options());
  int64_t* first = start.data_ptr<int64_t>();
  const int64_t* sorted_keys = sorted.keys.data_ptr<int64_t>();
  at::parallel_for(0, key_count + 1, 1 << 12, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      first[k] = first_of_key(sorted_keys, total, k);
    }
  });

  const SortedParticles<scalar_t> particles{
      sorted.positions.data_ptr<scalar_t>(),
      sorted.values.defined() ? sorted.values.data_ptr<scalar_t>() : nullptr, first, channels};
  scalar_t* out = mesh.data_ptr<scalar_t>();
  at::parallel_for(0, batch * cells, 1 << 10, [&](int64_t begin, int64_t end) {
    for (int64_t node = begin; node < end; ++node) {
      paint_node_at<scalar_t, acc_t, W>(particles, g, node, out);
    }
  });
}

at::Tensor paint_deterministic_cpu(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool check_finite) {
  // Errors name the paint the user called (torchpm.paint takes this op).
  const char* op = "torchpm.paint";
  return paint_op(op, positions, weights, shape, offset, periodic, order, /*accumulates=*/false,
                  [&](const PaintArguments& args, at::Tensor& mesh, auto dtype, auto width) {
    paint_by_node<typename decltype(dtype)::type, decltype(width)::value>(args, check_finite, mesh);
  });
}

// The tiled paint (tile_paint.h): the passes CUDA runs, here in order on one
// thread (the ranks CUDA's atomics hand out are then the particle order), so
// the CPU tests check the GPU's binning, chunking and flushing. Not a fast path:
// the CPU's scatter paint above already works plane by plane in cache.
template <typename scalar_t, int W>
void paint_by_tile(const PaintArguments& args, bool check_finite, at::Tensor& mesh) {
  using acc_t = at::opmath_type<scalar_t>;
  const char* op = "torchpm.paint";
  const StencilGeometry& g = args.geometry;
  const TileGrid grid = make_tile_grid(g);
  const int64_t batch = args.positions.size(0);
  const int64_t n = args.positions.size(1);
  const int64_t total = batch * n;
  const int64_t channels = args.channels;
  const int64_t cells = g.shape[0] * g.shape[1] * g.shape[2];
  const int64_t tiles = batch * grid.per_member;
  check_tile_sizes(op, total, tiles);
  const scalar_t* pos = args.positions.data_ptr<scalar_t>();
  const scalar_t* values = args.weights.defined() ? args.weights.data_ptr<scalar_t>() : nullptr;
  scalar_t* out = mesh.data_ptr<scalar_t>();

  // Pass 1: tiles, counts and ranks. A rejected particle poisons node (0, 0, 0)
  // of its member, as the scatter paint does.
  std::vector<int32_t> bin(total);
  std::vector<int32_t> rank(total);
  auto counts = at::zeros({tiles}, args.positions.options().dtype(at::kInt));
  int32_t* count = counts.data_ptr<int32_t>();
  int64_t bad = 0;
  int64_t bad_values = 0;
  for (int64_t p = 0; p < total; ++p) {
    int64_t tile;
    if (!tile_of<scalar_t, acc_t, W>(pos + 3 * p, g, grid, p / n, tile)) {
      ++bad;
      bin[p] = -1;
      for (int64_t ch = 0; ch < channels; ++ch) {
        out[(p / n) * channels * cells + ch * cells] += std::numeric_limits<scalar_t>::quiet_NaN();
      }
      continue;
    }
    if (check_finite && values && !finite_values(values + p * channels, channels)) {
      ++bad_values;
    }
    bin[p] = static_cast<int32_t>(tile);
    rank[p] = count[tile]++;
  }
  report_bad_particles(kPaintOp, {bad, bad_values}, CallDiagnosis(args.positions, args.weights, g));

  // Pass 2: each tile's first place and chunk count (the prefix sums CUDA
  // takes), then the particles in tile order.
  const auto sums = tile_prefix_sums(counts);
  const int32_t* start = sums.start.data_ptr<int32_t>();
  const int32_t* chunk_end = sums.chunk_end.data_ptr<int32_t>();
  std::vector<int32_t> order(total);
  for (int64_t p = 0; p < total; ++p) {
    if (bin[p] >= 0) {
      order[start[bin[p]] + rank[p]] = static_cast<int32_t>(p);
    }
  }

  // Pass 3: the blocks of the CUDA launch, one after another.
  constexpr int64_t S = tile_span<W>();
  const int64_t blocks = tile_chunk_bound(tiles, total);
  for_channel_groups(channels, [&](auto group, int64_t channel0) {
    constexpr int C = decltype(group)::value;
    std::vector<scalar_t> copy(C * S * S * S);
    for (int64_t block = 0; block < blocks; ++block) {
      int64_t tile;
      int64_t chunk;
      if (!chunk_of_block(chunk_end, tiles, block, tile, chunk)) {
        continue;
      }
      int64_t origin[3];
      tile_origin(tile, grid, origin);
      const int64_t begin = start[tile] + chunk * kTileChunk;
      const int64_t end = std::min<int64_t>(begin + kTileChunk, start[tile] + count[tile]);
      std::fill(copy.begin(), copy.end(), scalar_t(0));
      for (int64_t q = begin; q < end; ++q) {
        const int64_t p = order[q];
        add_to_tile<scalar_t, acc_t, W, C>(
            pos + 3 * p, values ? values + p * channels : nullptr, channel0, g, origin, copy.data(),
            [](scalar_t* target, scalar_t v) { *target += v; });
      }
      scalar_t* m = out + (tile / grid.per_member) * channels * cells + channel0 * cells;
      for (int64_t index = 0; index < S * S * S; ++index) {
        int64_t node;
        if (!tile_node<W>(index, origin, g, node)) {
          continue;
        }
        for (int ch = 0; ch < C; ++ch) {
          const scalar_t v = copy[ch * S * S * S + index];
          if (v != scalar_t(0)) {  // NaN too
            m[ch * cells + node] += v;
          }
        }
      }
    }
  });
}

at::Tensor paint_tiled_cpu(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool check_finite) {
  // Errors name the paint the user called (torchpm.paint takes this op).
  const char* op = "torchpm.paint";
  return paint_op(op, positions, weights, shape, offset, periodic, order, /*accumulates=*/true,
                  [&](const PaintArguments& args, at::Tensor& mesh, auto dtype, auto width) {
    paint_by_tile<typename decltype(dtype)::type, decltype(width)::value>(args, check_finite, mesh);
  });
}

// What a readout of one call reads: the particles, the mesh (C channels,
// interleaved or planar) and the block, with the gather's block bounds.
template <typename scalar_t, int W>
struct ReadoutPlan {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* pos;
  const scalar_t* field;
  const scalar_t* readable_end;  // the end of the mesh's storage (read_cic)
  MeshLayout layout;
  StencilGeometry g;
  GatherBounds<acc_t, W> bounds;
  int64_t batch;
  int64_t n;
  int64_t channels;

  ReadoutPlan(const at::Tensor& positions, const at::Tensor& mesh, const MeshLayout& layout_,
              const StencilGeometry& g_, int64_t channels_)
      : pos(positions.data_ptr<scalar_t>()),
        field(mesh.data_ptr<scalar_t>()),
        readable_end(field + (static_cast<int64_t>(mesh.storage().nbytes()) / static_cast<int64_t>(sizeof(scalar_t)) -
                              mesh.storage_offset())),
        layout(layout_),
        g(g_),
        bounds(g_),
        batch(positions.size(0)),
        n(positions.size(1)),
        channels(channels_) {}
};

// Particles a readout takes at a time: their values are checked for
// finiteness (and, fused, used) while in cache.
constexpr int64_t kReadoutRun = 1024;

// The readout of particles [run, run_end) into out (row p - run, `channels`
// values; C: dispatch_channels). Returns the number of rejected particles,
// whose rows are left unwritten.
template <typename scalar_t, int W, int C>
int64_t readout_run(const ReadoutPlan<scalar_t, W>& plan, int64_t run, int64_t run_end, scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t nc = C > 0 ? C : plan.channels;
  const MeshLayout& layout = plan.layout;
  const StencilGeometry& g = plan.g;
  return gather_particles<scalar_t, acc_t, W, false>(
      plan.pos, run, run_end, g, plan.bounds, plan.field, layout, plan.batch, plan.n, nc,
      [&](int64_t p, const Stencil<acc_t, W>& s) {
        const scalar_t* m = plan.field + (plan.batch == 1 ? 0 : p / plan.n) * layout.member;
        read_mesh<scalar_t, acc_t, W>(m, layout, nc, s, out + (p - run) * nc);
      },
      [&](int64_t p, const auto& nodes, int k) {
        if constexpr (W == 2) {
          const scalar_t* m = plan.field + (plan.batch == 1 ? 0 : p / plan.n) * layout.member;
          scalar_t* row = out + (p - run) * nc;
          // read_mesh's choice: 3 or 4 channels of an interleaved mesh node by node
          if (layout.node_stride > 1 && nc == 3) {
            read_cic<scalar_t, acc_t, kGatherChunk<2>, 3>(nodes, k, g, layout, nc, m, plan.readable_end, row);
          } else if (layout.node_stride > 1 && nc == 4) {
            read_cic<scalar_t, acc_t, kGatherChunk<2>, 4>(nodes, k, g, layout, nc, m, plan.readable_end, row);
          } else {
            read_cic<scalar_t, acc_t, kGatherChunk<2>, 0>(nodes, k, g, layout, nc, m, plan.readable_end, row);
          }
          return true;
        } else {
          return false;
        }
      });
}

// Whether particle p of a run was accepted (its row written); `run_bad`: the
// run's rejected count (0: all were).
template <typename scalar_t, int W>
C10_ALWAYS_INLINE bool accepted_in_run(const ReadoutPlan<scalar_t, W>& plan, int64_t p, int64_t run_bad) {
  int64_t node[3];
  return run_bad == 0 || locate<scalar_t, at::opmath_type<scalar_t>, W>(plan.pos + 3 * p, plan.g, node);
}

at::Tensor readout_cpu(
    const at::Tensor& mesh_in,
    const at::Tensor& positions_in,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool check_finite) {
  const char* op = "torchpm.readout";
  report_earlier_errors(op);
  auto positions = check_positions(op, positions_in);
  int64_t channels = 1;
  bool has_channel_dim = false;
  MeshLayout layout;
  auto mesh = check_mesh(op, "mesh", mesh_in, positions, channels, has_channel_dim, layout);
  const StencilGeometry g = make_geometry(op, mesh.sizes().slice(2), offset, periodic, order);
  const int64_t batch = positions.size(0);
  const int64_t n = positions.size(1);
  auto out = at::empty({batch, n, channels}, positions.options());
  if (out.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "readout_cpu", [&] {
      dispatch_order(op, order, [&](auto width) {
        constexpr int W = decltype(width)::value;
        const ReadoutPlan<scalar_t, W> plan(positions, mesh, layout, g, channels);
        scalar_t* result = out.data_ptr<scalar_t>();
        std::atomic<int64_t> bad{0};
        std::atomic<int64_t> non_finite{0};
        dispatch_channels(channels, [&](auto channel_count) {
          constexpr int C = decltype(channel_count)::value;
          const int64_t nc = C > 0 ? C : channels;
          at::parallel_for(0, batch * n, 2048, [&](int64_t begin, int64_t end) {
            int64_t local_bad = 0;
            int64_t local_non_finite = 0;
            // Finiteness is checked on the values written, a run of particles
            // at a time while they are in cache: one pass over bits that
            // vectorises, instead of a test per particle and channel.
            for (int64_t run = begin; run < end; run += kReadoutRun) {
              const int64_t run_end = std::min(run + kReadoutRun, end);
              scalar_t* rows = result + run * nc;
              const int64_t run_bad = readout_run<scalar_t, W, C>(plan, run, run_end, rows);
              local_bad += run_bad;
              if (check_finite && !all_finite(rows, (run_end - run) * nc)) {
                // Rare: count the accepted particles that read a non-finite value
                // (a rejected particle's entries are not written yet).
                for (int64_t p = run; p < run_end; ++p) {
                  if (!finite_values(rows + (p - run) * nc, nc) && accepted_in_run(plan, p, run_bad)) {
                    ++local_non_finite;
                  }
                }
              }
            }
            bad += local_bad;
            non_finite += local_non_finite;
          });
        });
        if (bad.load() > 0) {
          fill_rejected<scalar_t, W>(plan.pos, batch * n, g, channels, result);
        }
        report_bad_particles(
            kReadoutOp, {bad.load(), check_finite ? non_finite.load() : 0},
            CallDiagnosis(positions, out, g));
      });
    });
  }
  return has_channel_dim ? out : out.squeeze(2);
}

// torchpm::_readout_kick_drift_: the 3-channel readout F of `mesh` at the
// particles, then momenta += F * k for each k of `kicks`, then (with `drift`)
// positions += momenta * drift, a run of particles at a time while its forces
// are in cache: the integrator's second kick and the next step's first kick
// and drift in the readout's pass, with no force array written or read back.
// Each update has exactly the rounding of _add_scaled_, so the result is the
// composition readout, _add_scaled_, ..., bit for bit.
//
// A particle the readout rejects (non-finite or outside the block), or one
// that reads a NaN/Inf (check_finite), is not updated: its momentum becomes
// NaN and its position stays where it was read, so the error names it there
// (updates.h, leave_out). The others are updated. The error, in the readout's
// slot but naming this op, is raised when the op returns (immediate mode) or
// reported later (deferred mode). The CUDA kernel (../cuda/mass_assignment.cu)
// applies the same rule per particle.
void readout_kick_drift_cpu(
    const at::Tensor& mesh_in,
    const at::Tensor& positions,
    const at::Tensor& momenta,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    at::ArrayRef<double> kicks,
    std::optional<double> drift,
    bool check_finite) {
  const char* op = "torchpm._readout_kick_drift_";
  report_earlier_errors(op);
  const auto args = check_readout_update_arguments(op, mesh_in, positions, momenta, offset, periodic, order, kicks);
  const at::Tensor& mesh = args.mesh;
  const MeshLayout& layout = args.layout;
  const StencilGeometry& g = args.geometry;
  bump_version(positions);
  bump_version(momenta);
  const int64_t batch = positions.size(0);
  const int64_t n = positions.size(1);
  if (batch * n == 0) {
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "readout_kick_drift_cpu", [&] {
    dispatch_order(op, order, [&](auto width) {
      constexpr int W = decltype(width)::value;
      constexpr int C = 3;
      const ReadoutPlan<scalar_t, W> plan(positions, mesh, layout, g, C);
      scalar_t* x = positions.data_ptr<scalar_t>();
      scalar_t* v = momenta.data_ptr<scalar_t>();
      const KickDrift<scalar_t> factors = make_kick_drift<scalar_t>(kicks, drift);
      std::atomic<int64_t> bad{0};
      std::atomic<int64_t> non_finite{0};
      // The particles left out (rare): index, position as read, values read.
      std::mutex left_out_mutex;
      std::vector<int64_t> left_out;
      std::vector<scalar_t> left_out_rows;
      at::parallel_for(0, batch * n, 2048, [&](int64_t begin, int64_t end) {
        std::vector<scalar_t> buffer(2 * C * kReadoutRun);
        scalar_t* force = buffer.data();
        scalar_t* product = force + C * kReadoutRun;
        int64_t local_bad = 0;
        int64_t local_non_finite = 0;
        for (int64_t run = begin; run < end; run += kReadoutRun) {
          const int64_t run_end = std::min(run + kReadoutRun, end);
          const int64_t count = (run_end - run) * C;
          const int64_t run_bad = readout_run<scalar_t, W, C>(plan, run, run_end, force);
          local_bad += run_bad;
          const bool clean = run_bad == 0 && (!check_finite || all_finite(force, count));
          // Rare: the particles to leave out, with their positions as read.
          std::vector<int64_t> skipped;
          std::vector<scalar_t> kept;
          if (!clean) {
            for (int64_t p = run; p < run_end; ++p) {
              scalar_t* row = force + (p - run) * C;
              const bool accepted = accepted_in_run(plan, p, run_bad);
              if (!accepted) {
                std::fill(row, row + C, std::numeric_limits<scalar_t>::quiet_NaN());
              } else if (!check_finite || finite_values(row, C)) {
                continue;
              } else {
                ++local_non_finite;
              }
              skipped.push_back(p);
              kept.insert(kept.end(), x + 3 * p, x + 3 * p + 3);
              kept.insert(kept.end(), row, row + C);
            }
          }
          kick_drift_block(x + run * 3, v + run * C, force, count, factors, product);
          for (size_t i = 0; i < skipped.size(); ++i) {
            const int64_t p = skipped[i];
            std::copy(kept.begin() + 6 * i, kept.begin() + 6 * i + 3, x + 3 * p);
            leave_out(v + 3 * p);
          }
          if (!skipped.empty()) {
            std::lock_guard<std::mutex> lock(left_out_mutex);
            left_out.insert(left_out.end(), skipped.begin(), skipped.end());
            left_out_rows.insert(left_out_rows.end(), kept.begin(), kept.end());
          }
        }
        bad += local_bad;
        non_finite += local_non_finite;
      });
      const BadCounts counts{bad.load(), non_finite.load()};
      if (!counts.any()) {
        return;
      }
      // What the error can name: the left-out particles where they were read
      // and the values they read; every other particle at the block's centre
      // (accepted) reading zeros.
      auto where = at::empty({batch, n, 3}, positions.options());
      auto read = at::zeros({batch, n, C}, positions.options());
      for (int d = 0; d < 3; ++d) {
        where.select(2, d).fill_(static_cast<double>(g.offset[d]) + 0.5 * static_cast<double>(g.shape[d]));
      }
      scalar_t* w = where.data_ptr<scalar_t>();
      scalar_t* r = read.data_ptr<scalar_t>();
      for (size_t i = 0; i < left_out.size(); ++i) {
        std::copy(left_out_rows.begin() + 6 * i, left_out_rows.begin() + 6 * i + 3, w + 3 * left_out[i]);
        std::copy(left_out_rows.begin() + 6 * i + 3, left_out_rows.begin() + 6 * i + 6, r + C * left_out[i]);
      }
      report_bad_particles(kReadoutOp, counts, CallDiagnosis(where, read, g, op, kLeftOutNote));
    });
  });
}

// d/dx_p sum_c values[p, c] readout(mesh)[p, c] (B, N, 3) and, when
// readout_channels K > 0, in the same pass over the particles the readout of
// mesh channels 0 .. K-1 (B, N, K), computed exactly as readout_cpu computes it
// (the same `read_mesh`), so it equals that op's result bit for bit.
std::tuple<at::Tensor, at::Tensor> position_gradient_impl(
    const char* op,
    const at::Tensor& mesh_in,
    const at::Tensor& positions_in,
    const std::optional<at::Tensor>& values_in,
    int64_t readout_channels,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order) {
  report_earlier_errors(op);
  const auto args = check_position_gradient_arguments(
      op, mesh_in, positions_in, values_in, readout_channels, offset, periodic, order);
  const at::Tensor& positions = args.positions;
  const at::Tensor& mesh = args.mesh;
  const at::Tensor& values = args.values;
  const int64_t channels = args.channels;
  const MeshLayout& layout = args.layout;
  const StencilGeometry& g = args.geometry;
  const int64_t batch = positions.size(0);
  const int64_t n = positions.size(1);
  auto out = at::empty({batch, n, 3}, positions.options());
  auto read = at::empty({batch, n, readout_channels}, positions.options());
  if (out.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "position_gradient_cpu", [&] {
      dispatch_order(op, order, [&](auto width) {
        constexpr int W = decltype(width)::value;
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* pos = positions.data_ptr<scalar_t>();
        const scalar_t* field = mesh.data_ptr<scalar_t>();
        const scalar_t* val = values.defined() ? values.data_ptr<scalar_t>() : nullptr;
        scalar_t* result = out.data_ptr<scalar_t>();
        scalar_t* read_out = read.data_ptr<scalar_t>();
        const GatherBounds<acc_t, W> bounds(g);
        std::atomic<int64_t> bad{0};
        std::atomic<int64_t> non_finite{0};
        dispatch_channels(channels, [&](auto channel_count) {
          constexpr int C = decltype(channel_count)::value;
          const int64_t nc = C > 0 ? C : channels;
          at::parallel_for(0, batch * n, 2048, [&](int64_t begin, int64_t end) {
            int64_t local_non_finite = 0;
            bad += gather_particles<scalar_t, acc_t, W, true>(
                pos, begin, end, g, bounds, field, layout, batch, n, nc,
                [&](int64_t p, const Stencil<acc_t, W>& s) {
                  const scalar_t* m = field + (batch == 1 ? 0 : p / n) * layout.member;
                  local_non_finite += read_mesh<scalar_t, acc_t, W>(
                      m, layout, readout_channels, s, read_out + p * readout_channels) ? 0 : 1;
                  acc_t v[C > 0 ? C : 1];
                  if constexpr (C > 0) {
                    for (int ch = 0; ch < C; ++ch) {
                      v[ch] = val ? static_cast<acc_t>(val[p * C + ch]) : acc_t(1);
                    }
                  }
                  acc_t grad[3];
                  position_gradient_at<scalar_t, acc_t, W, C>(
                      m, layout.channel, nc, s,
                      [&](int64_t ch) {
                        if constexpr (C > 0) {
                          return v[ch];
                        } else {
                          return val ? static_cast<acc_t>(val[p * nc + ch]) : acc_t(1);
                        }
                      },
                      grad);
                  for (int d = 0; d < 3; ++d) {
                    result[3 * p + d] = static_cast<scalar_t>(grad[d]);
                  }
                });
            non_finite += local_non_finite;
          });
        });
        if (bad.load() > 0) {
          fill_rejected<scalar_t, W>(pos, batch * n, g, 3, result);
          if (readout_channels > 0) {
            fill_rejected<scalar_t, W>(pos, batch * n, g, readout_channels, read_out);
          }
        }
        report_bad_particles(kPositionGradientOp, {bad.load(), 0}, CallDiagnosis(positions, {}, g));
        if (readout_channels > 0) {
          report_bad_particles(kReadoutOp, {0, non_finite.load()}, CallDiagnosis(positions, read, g));
        }
      });
    });
  }
  return {out, read};
}

void register_kernels(torch::Library& m) {
  m.impl("paint", &paint_cpu);
  m.impl("_paint_deterministic", &paint_deterministic_cpu);
  m.impl("_paint_tiled", &paint_tiled_cpu);
  m.impl("readout", &readout_cpu);
  m.impl("_readout_kick_drift_", &readout_kick_drift_cpu);
  m.impl("_position_gradient", &position_gradient_op<position_gradient_impl>);
  m.impl("_readout_and_position_gradient", &readout_and_position_gradient_op<position_gradient_impl>);
}

}  // namespace

#ifdef TORCHPM_MASS_ASSIGNMENT_AVX2

namespace cpu_avx2 {
void register_mass_assignment_kernels(torch::Library& m) {
  register_kernels(m);
}
}  // namespace cpu_avx2

}  // namespace torchpm

#pragma GCC pop_options

#else  // the baseline build, which registers one of the two

namespace {

struct KernelChoice {
  bool avx2 = false;
  std::string error;  // why the environment's request was not met
};

KernelChoice choose_kernels() {
  KernelChoice choice;
#ifdef TORCHPM_CPU_AVX2_KERNELS
  __builtin_cpu_init();
  // Every extension of the target pragma above (LZCNT, unlike the others, would
  // not fault where missing: it would run as BSR and give other results).
  const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
      __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("lzcnt") &&
      __builtin_cpu_supports("popcnt");
#else
  const bool supported = false;
#endif
  const char* value = std::getenv("TORCHPM_CPU_KERNELS");
  const std::string requested = value == nullptr ? "" : value;
  if (requested.empty() || requested == "auto") {
    choice.avx2 = supported;
  } else if (requested == "avx2") {
    choice.avx2 = supported;
    if (!supported) {
      choice.error = "the environment variable TORCHPM_CPU_KERNELS asks for \"avx2\", but this CPU "
          "has no AVX2 (or this build has no AVX2 kernels); unset it, or set it to \"auto\" or "
          "\"baseline\"";
    }
  } else if (requested != "baseline") {
    choice.error = "the environment variable TORCHPM_CPU_KERNELS must be \"auto\", \"avx2\" or "
        "\"baseline\", got \"" + requested + "\"";
  }
  return choice;
}

// Read once, when the library registers its kernels.
const KernelChoice& kernel_choice() {
  static const KernelChoice choice = choose_kernels();
  return choice;
}

}  // namespace

std::string cpu_kernel_variant() {
  const KernelChoice& choice = kernel_choice();
  TORCH_CHECK_VALUE(choice.error.empty(), "torchpm: ", choice.error, " (the baseline kernels are registered)");
  return choice.avx2 ? "avx2" : "baseline";
}

TORCH_LIBRARY_IMPL(torchpm, CPU, m) {
#ifdef TORCHPM_CPU_AVX2_KERNELS
  if (kernel_choice().avx2) {
    cpu_avx2::register_mass_assignment_kernels(m);
    return;
  }
#endif
  register_kernels(m);
}

}  // namespace torchpm

#endif
