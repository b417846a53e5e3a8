// CUDA kernels of the mass-assignment ops (NGP, CIC, TSC, PCS), one template
// over the stencil width W (stencil.h), one thread per particle.
//
// Paint scatters with atomic adds, so the order in which a cell receives its
// contributions (and hence float rounding) varies between runs. Under
// torch.use_deterministic_algorithms(True) the op raises, as torch's own
// non-deterministic CUDA ops do; torchpm.ops.paint then calls
// _paint_deterministic instead, the same paint computed node by node without
// atomics (node_paint.h, kernels below). Readout and the position gradient
// gather without atomics and are deterministic.
//
// float32 atomicAdd on the GPU flushes denormal operands and results to zero
// (as --ftz=true arithmetic does): painted contributions below ~1.2e-38 are
// lost. float64 atomics keep denormals.
//
// Bad particles are counted into per-device counters that are never reset and
// reported without a per-call synchronisation (error_checking.h).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#include "../error_checking.h"
#include "../node_paint.h"
#include "../stencil.h"
#include "../tile_paint.h"
#include "../torchpm.h"
#include "../updates.h"
#include "launch.cuh"

namespace torchpm {
namespace {

// The grid of a one-thread-per-particle launch. gridDim.x is an unsigned int
// limited to 2^31 - 1 blocks: refuse rather than let the count narrow.
unsigned int blocks_for(const char* op, int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  constexpr int64_t kMaxBlocks = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(
      blocks <= kMaxBlocks, op, ": ", count, " particles (B * N) need ", blocks,
      " blocks of ", kThreads, " threads, more than the CUDA grid limit of 2^31 - 1; "
      "call the op on at most ", kMaxBlocks * kThreads, " particles at a time.");
  return static_cast<unsigned int>(blocks);
}

// Each op has two counters in its slot: rejected positions, non-finite values.
constexpr int kBadPositions = 0;
constexpr int kBadValues = 1;
constexpr int kCounters = 2 * kOpSlots;

// Per device: the bad-particle counters every kernel adds to, never reset (a
// CUDA graph replays its kernels with the same pointer), and on the host what
// earlier checks already reported. Created by the first op on the device,
// outside graph capture; never destroyed (see error_checking.cpp).
struct DeviceCounters {
  at::Tensor counts;  // (kCounters,) int64 on the device
  std::array<int64_t, kCounters> reported{};
};

std::mutex counters_mutex;

std::map<c10::DeviceIndex, DeviceCounters*>& all_counters() {
  static auto* counters = new std::map<c10::DeviceIndex, DeviceCounters*>();
  return *counters;
}

// Whether the current stream is capturing a CUDA graph (without creating a
// context on a device nobody used).
bool capturing() {
  if (!c10::cuda::hasPrimaryContext(c10::cuda::current_device())) {
    return false;
  }
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// A CUDA event without timing (the cheapest kind), destroyed with its last
// owner. (ATen's CUDAEvent would pull in the cuSPARSE/cuBLAS headers.)
class Event {
 public:
  explicit Event(c10::cuda::CUDAStream stream) : device_(stream.device_index()) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event_, stream.stream()));
  }
  ~Event() {
    const c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK_WARN(cudaEventDestroy(event_));
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  bool query() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it
      return false;
    }
    C10_CUDA_CHECK(status);
    return true;
  }
  void synchronize() const {
    C10_CUDA_CHECK(cudaEventSynchronize(event_));
  }

 private:
  c10::DeviceIndex device_;
  cudaEvent_t event_ = nullptr;
};

DeviceCounters& counters_for(const char* op, const at::Device& device) {
  std::lock_guard<std::mutex> lock(counters_mutex);
  auto& counters = all_counters();
  auto found = counters.find(device.index());
  if (found != counters.end()) {
    return *found->second;
  }
  TORCH_CHECK(
      !capturing(), op, ": the first torchpm op on ", device, " is being captured in a CUDA "
      "graph, where its error counters cannot be created. Run the ops once before capturing "
      "(the warm-up torch.cuda.graph asks for anyway).");
  auto* created = new DeviceCounters();
  created->counts = at::zeros({kCounters}, at::TensorOptions().dtype(at::kLong).device(device));
  // Kernels on other streams must see the zeros.
  c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
  counters.emplace(device.index(), created);
  return *created;
}

unsigned long long* slot_pointer(DeviceCounters& counters, OpSlot op) {
  return reinterpret_cast<unsigned long long*>(counters.counts.data_ptr<int64_t>()) + 2 * op;
}

// Queues the counters' values after the current stream's work: an
// asynchronous copy to pinned memory and an event, nothing that waits.
PendingCheck snapshot(DeviceCounters& counters, int op, CallDiagnosis diagnosis) {
  const auto stream = c10::cuda::getCurrentCUDAStream(counters.counts.device().index());
  auto host = at::empty(
      {kCounters}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  host.copy_(counters.counts, /*non_blocking=*/true);
  auto event = std::make_shared<Event>(stream);
  PendingCheck check;
  check.op = op;
  check.diagnosis = std::move(diagnosis);
  check.ready = [event] { return event->query(); };
  check.wait = [event] { event->synchronize(); };
  DeviceCounters* target = &counters;
  check.take = [host, target] {
    // Cumulative counts: what is new since the checks taken before. (A check
    // from another stream may complete out of order, hence the max.)
    const int64_t* seen = host.data_ptr<int64_t>();
    SlotCounts fresh{};
    for (int op = 0; op < kOpSlots; ++op) {
      int64_t added[2];
      for (int k = 0; k < 2; ++k) {
        const int i = 2 * op + k;
        added[k] = std::max<int64_t>(0, seen[i] - target->reported[i]);
        target->reported[i] = std::max(target->reported[i], seen[i]);
      }
      fresh[op] = {added[kBadPositions], added[kBadValues]};
    }
    return fresh;
  };
  return check;
}

// After a kernel: queue its check (raising at once in immediate mode). Inside
// graph capture nothing is queued: the counts stay on the device until the
// next snapshot.
void report_after_launch(
    OpSlot op, DeviceCounters& counters, bool in_capture, CallDiagnosis diagnosis) {
  if (in_capture) {
    return;
  }
  submit_check(
      snapshot(counters, op, std::move(diagnosis)),
      !errors_deferred(c10::DeviceType::CUDA));
}

void snapshot_every_device() {
  std::vector<DeviceCounters*> devices;
  {
    std::lock_guard<std::mutex> lock(counters_mutex);
    for (auto& entry : all_counters()) {
      devices.push_back(entry.second);
    }
  }
  for (DeviceCounters* counters : devices) {
    const c10::cuda::CUDAGuard guard(counters->counts.device());
    submit_check(snapshot(*counters, -1, CallDiagnosis()), false);
  }
}

// The hook of torchpm.check() and of the deferred reports: false before any
// torchpm op ran on a GPU, without touching CUDA, so that a CUDA build works on
// a machine without a GPU or driver (CPU tensors only).
bool capturing_after_first_use() {
  {
    std::lock_guard<std::mutex> lock(counters_mutex);
    if (all_counters().empty()) {
      return false;
    }
  }
  return capturing();
}

const bool hooks_registered = [] {
  DeviceHooks hooks;
  hooks.capturing = &capturing_after_first_use;
  hooks.snapshot_counters = &snapshot_every_device;
  set_device_hooks(hooks);
  return true;
}();

// Adds the number of threads of the warp with `flag` set to *counter with one
// atomic per warp (when many particles are bad, per-thread atomics on one
// address serialise). Every thread of the warp that is still running must call
// it; threads that returned early are excluded by __activemask().
__device__ inline void count_in_warp(bool flag, unsigned long long* counter) {
  const unsigned active = __activemask();
  const unsigned flagged = __ballot_sync(active, flag);
  if (flagged != 0 && (threadIdx.x & 31) == static_cast<unsigned>(__ffs(active) - 1)) {
    atomicAdd(counter, static_cast<unsigned long long>(__popc(flagged)));
  }
}

// A rejected particle's results: NaN, so that a result used before a deferred
// report (error_checking.h) cannot look valid.
template <typename scalar_t>
__device__ inline void fill_rejected(scalar_t* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    out[i] = static_cast<scalar_t>(NAN);
  }
}

template <typename scalar_t, int W>
__global__ void paint_kernel(
    const scalar_t* __restrict__ positions,
    const scalar_t* __restrict__ values,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    StencilGeometry g,
    bool check_finite,
    scalar_t* __restrict__ mesh,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  Stencil<acc_t, W> s;
  const bool valid = make_stencil<scalar_t, acc_t, W>(positions + 3 * p, g, s);
  count_in_warp(!valid, bad + kBadPositions);
  const int64_t channel_stride = g.shape[0] * g.shape[1] * g.shape[2];
  scalar_t* m = mesh + (p / per_batch) * channels * channel_stride;
  if (!valid) {
    // Reported (maybe after this call returns): the mesh must not look valid.
    for (int64_t ch = 0; ch < channels; ++ch) {
      gpuAtomicAdd(m + ch * channel_stride, static_cast<scalar_t>(NAN));
    }
    return;
  }
  bool finite = true;
  for (int64_t ch = 0; ch < channels; ++ch) {
    // Each weight is loaded once. A non-finite one is counted and painted:
    // it poisons the mesh until the report.
    const acc_t v = values ? static_cast<acc_t>(values[p * channels + ch]) : acc_t(1);
    finite = finite && ::isfinite(v);
    scalar_t* mc = m + ch * channel_stride;
#pragma unroll
    for (int a = 0; a < W; ++a) {
#pragma unroll
      for (int b = 0; b < W; ++b) {
        scalar_t* row = mc + s.offset[0][a] + s.offset[1][b];
        const acc_t vab = v * s.weight[0][a] * s.weight[1][b];
#pragma unroll
        for (int c = 0; c < W; ++c) {
          gpuAtomicAdd(row + s.offset[2][c], static_cast<scalar_t>(vab * s.weight[2][c]));
        }
      }
    }
  }
  if (check_finite) {
    count_in_warp(!finite, bad + kBadValues);
  }
}

template <typename scalar_t, int W>
__global__ void readout_kernel(
    const scalar_t* __restrict__ mesh,
    MeshLayout layout,
    const scalar_t* __restrict__ positions,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    StencilGeometry g,
    bool check_finite,
    scalar_t* __restrict__ out,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  Stencil<acc_t, W> s;
  const bool valid = make_stencil<scalar_t, acc_t, W>(positions + 3 * p, g, s, layout.node_stride);
  count_in_warp(!valid, bad + kBadPositions);
  if (!valid) {
    fill_rejected(out + p * channels, channels);
    return;
  }
  const scalar_t* m = mesh + (p / per_batch) * layout.member;
  const bool finite = read_mesh<scalar_t, acc_t, W>(m, layout, channels, s, out + p * channels);
  if (check_finite) {
    count_in_warp(!finite, bad + kBadValues);
  }
}

template <typename scalar_t, int W>
__global__ void position_gradient_kernel(
    const scalar_t* __restrict__ mesh,
    MeshLayout layout,
    const scalar_t* __restrict__ positions,
    const scalar_t* __restrict__ values,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    StencilGeometry g,
    scalar_t* __restrict__ out,
    unsigned long long* __restrict__ bad,
    int64_t readout_channels,  // > 0: also the readout of channels 0 .. K-1
    scalar_t* __restrict__ read,
    unsigned long long* __restrict__ bad_read) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  Stencil<acc_t, W> s;
  const bool valid = make_stencil<scalar_t, acc_t, W, true>(positions + 3 * p, g, s, layout.node_stride);
  count_in_warp(!valid, bad + kBadPositions);
  if (!valid) {
    fill_rejected(out + 3 * p, 3);
    fill_rejected(read + p * readout_channels, readout_channels);
    return;
  }
  const scalar_t* m = mesh + (p / per_batch) * layout.member;
  if (readout_channels > 0) {
    const bool finite = read_mesh<scalar_t, acc_t, W>(m, layout, readout_channels, s, read + p * readout_channels);
    count_in_warp(!finite, bad_read + kBadValues);
  }
  acc_t grad[3];
  position_gradient_at<scalar_t, acc_t, W, 0>(
      m, layout.channel, channels, s,
      [&](int64_t ch) { return values ? static_cast<acc_t>(values[p * channels + ch]) : acc_t(1); }, grad);
  out[3 * p + 0] = static_cast<scalar_t>(grad[0]);
  out[3 * p + 1] = static_cast<scalar_t>(grad[1]);
  out[3 * p + 2] = static_cast<scalar_t>(grad[2]);
}

// What an immediate error of _readout_kick_drift_ names (the CPU op's `where`
// and `read`): per particle, the position as read and the values read of a
// particle left out (NaN for a rejected one), the block's centre and zeros for
// the others. Null (deferred mode, graph capture): nothing is written.
template <typename scalar_t>
struct LeftOutRecord {
  scalar_t* where = nullptr;  // (B N, 3)
  scalar_t* read = nullptr;   // (B N, 3)
  scalar_t centre[3] = {scalar_t(0), scalar_t(0), scalar_t(0)};
};

// torchpm::_readout_kick_drift_, one thread per particle: the readout of its
// force (make_stencil and read_mesh, as readout_kernel), then the rule of
// ../updates.h (update_particle): updated, or, rejected or reading a non-finite
// value with check_finite, left out (momentum NaN, position as read). The CPU
// op (../cpu/mass_assignment.cpp) applies the same rule a run at a time.
template <typename scalar_t, int W>
__global__ void readout_kick_drift_kernel(
    const scalar_t* __restrict__ mesh,
    MeshLayout layout,
    scalar_t* __restrict__ positions,
    scalar_t* __restrict__ momenta,
    int64_t per_batch,
    int64_t total,
    StencilGeometry g,
    bool check_finite,
    KickDrift<scalar_t> factors,
    unsigned long long* __restrict__ bad,
    LeftOutRecord<scalar_t> record) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  scalar_t* x = positions + 3 * p;
  scalar_t* v = momenta + 3 * p;
  Stencil<acc_t, W> s;
  const bool accepted = make_stencil<scalar_t, acc_t, W>(x, g, s, layout.node_stride);
  count_in_warp(!accepted, bad + kBadPositions);
  scalar_t force[3];
  bool finite = false;
  if (accepted) {
    finite = read_mesh<scalar_t, acc_t, W>(mesh + (p / per_batch) * layout.member, layout, 3, s, force);
  } else {
    fill_rejected(force, 3);
  }
  if (check_finite) {
    count_in_warp(accepted && !finite, bad + kBadValues);
  }
  const bool updated = accepted && (finite || !check_finite);
  if (record.where != nullptr) {
    for (int d = 0; d < 3; ++d) {
      record.where[3 * p + d] = updated ? record.centre[d] : x[d];
      record.read[3 * p + d] = updated ? scalar_t(0) : force[d];
    }
  }
  update_particle(updated, x, v, force, factors);
}

// The frame of the CUDA paints: paint_op, the device guard, and the particle
// checks (the op's counters, reported after the launches). launch(args, mesh,
// dtype, width, stream, bad) queues the kernels; `bad` is the op's counter slot.
template <typename Launch>
at::Tensor cuda_paint_op(
    const char* op,
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool accumulates,
    const Launch& launch) {
  return paint_op(op, positions, weights, shape, offset, periodic, order, accumulates,
                  [&](const PaintArguments& args, at::Tensor& mesh, auto dtype, auto width) {
    const c10::cuda::CUDAGuard guard(args.positions.device());
    DeviceCounters& counters = counters_for(op, args.positions.device());
    const bool in_capture = capturing();
    launch(args, mesh, dtype, width, c10::cuda::getCurrentCUDAStream(), slot_pointer(counters, kPaintOp));
    report_after_launch(kPaintOp, counters, in_capture, CallDiagnosis(args.positions, args.weights, args.geometry));
  });
}

at::Tensor paint_cuda(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool check_finite) {
  const char* op = "torchpm.paint";
  return cuda_paint_op(op, positions, weights, shape, offset, periodic, order, /*accumulates=*/true,
                       [&](const PaintArguments& args, at::Tensor& mesh, auto dtype, auto width,
                           cudaStream_t stream, unsigned long long* bad) {
    using scalar_t = typename decltype(dtype)::type;
    at::globalContext().alertNotDeterministic("torchpm::paint (CUDA atomics)");
    const int64_t total = args.positions.size(0) * args.positions.size(1);
    paint_kernel<scalar_t, decltype(width)::value><<<blocks_for(op, total), kThreads, 0, stream>>>(
        args.positions.data_ptr<scalar_t>(),
        args.weights.defined() ? args.weights.data_ptr<scalar_t>() : nullptr, args.channels,
        args.positions.size(1), total, args.geometry, check_finite && args.weights.defined(),
        mesh.data_ptr<scalar_t>(), bad);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The node-by-node paint (node_paint.h), one thread per particle, key or node.
template <typename scalar_t, int W>
__global__ void cell_key_kernel(
    const scalar_t* __restrict__ positions,
    const scalar_t* __restrict__ values,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    StencilGeometry g,
    bool check_finite,
    int64_t* __restrict__ keys,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= total) {
    return;
  }
  const bool valid = cell_key<scalar_t, acc_t, W>(positions + 3 * p, g, p / per_batch, keys[p]);
  count_in_warp(!valid, bad + kBadPositions);
  if (check_finite) {
    count_in_warp(!finite_values(values + p * channels, channels), bad + kBadValues);
  }
}

__global__ void first_of_key_kernel(
    const int64_t* __restrict__ sorted, int64_t total, int64_t keys, int64_t* __restrict__ start) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < keys;
       k += int64_t(gridDim.x) * blockDim.x) {
    start[k] = first_of_key(sorted, total, k);
  }
}

template <typename scalar_t, int W>
__global__ void paint_node_kernel(
    SortedParticles<scalar_t> particles, StencilGeometry g, int64_t nodes, scalar_t* __restrict__ mesh) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t node = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; node < nodes;
       node += int64_t(gridDim.x) * blockDim.x) {
    paint_node_at<scalar_t, acc_t, W>(particles, g, node, mesh);
  }
}

at::Tensor paint_deterministic_cuda(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool check_finite) {
  // Errors name the paint the user called (torchpm.paint takes this op).
  const char* op = "torchpm.paint";
  return cuda_paint_op(op, positions, weights, shape, offset, periodic, order, /*accumulates=*/false,
                       [&](const PaintArguments& args, at::Tensor& mesh, auto dtype, auto width,
                           cudaStream_t stream, unsigned long long* bad) {
    using scalar_t = typename decltype(dtype)::type;
    constexpr int W = decltype(width)::value;
    const at::Tensor& x = args.positions;
    const StencilGeometry& g = args.geometry;
    const int64_t total = x.size(0) * x.size(1);
    const int64_t cells = g.shape[0] * g.shape[1] * g.shape[2];
    const int64_t key_count = x.size(0) * (cells + 1);
    auto keys = at::empty({total}, x.options().dtype(at::kLong));
    cell_key_kernel<scalar_t, W><<<blocks_for(op, total), kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), args.weights.defined() ? args.weights.data_ptr<scalar_t>() : nullptr,
        args.channels, x.size(1), total, g, check_finite && args.weights.defined(),
        keys.data_ptr<int64_t>(), bad);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const auto sorted = sort_particles_by_key(keys, x, args.weights);
    auto start = at::empty({key_count + 1}, keys.options());
    first_of_key_kernel<<<grid_stride_blocks(key_count + 1), kThreads, 0, stream>>>(
        sorted.keys.data_ptr<int64_t>(), total, key_count + 1, start.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const SortedParticles<scalar_t> particles{
        sorted.positions.data_ptr<scalar_t>(),
        sorted.values.defined() ? sorted.values.data_ptr<scalar_t>() : nullptr,
        start.data_ptr<int64_t>(), args.channels};
    const int64_t nodes = x.size(0) * cells;
    paint_node_kernel<scalar_t, W><<<grid_stride_blocks(nodes), kThreads, 0, stream>>>(
        particles, g, nodes, mesh.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The tiled paint (tile_paint.h). Pass 1: each particle's tile and its rank
// among the tile's particles. The lanes of a warp that share a tile take their
// ranks with one atomic (clustered particles would otherwise serialise on their
// tile's counter). Every lane of the warp runs it (no early return): the warp
// intrinsics name the whole warp.
template <typename scalar_t, int W>
__global__ void tile_bin_kernel(
    const scalar_t* __restrict__ positions,
    const scalar_t* __restrict__ values,
    int64_t channels,
    int64_t per_batch,
    int64_t total,
    StencilGeometry g,
    TileGrid grid,
    bool check_finite,
    int32_t* __restrict__ bin,
    int32_t* __restrict__ rank,
    int32_t* __restrict__ count,
    scalar_t* __restrict__ mesh,
    unsigned long long* __restrict__ bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const bool in_range = p < total;
  int64_t tile = -1;
  const bool valid = in_range && tile_of<scalar_t, acc_t, W>(positions + 3 * p, g, grid, p / per_batch, tile);
  count_in_warp(in_range && !valid, bad + kBadPositions);
  if (check_finite) {
    count_in_warp(valid && !finite_values(values + p * channels, channels), bad + kBadValues);
  }
  const int key = valid ? static_cast<int>(tile) : -1;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
  const unsigned peers = __match_any_sync(0xffffffffu, key);
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(peers) - 1;
  int first = 0;
  if (lane == leader && valid) {
    first = atomicAdd(count + key, __popc(peers));
  }
  first = __shfl_sync(0xffffffffu, first, leader);
  const int own = first + __popc(peers & ((1u << lane) - 1u));
#else  // no __match_any_sync before sm_70: one atomic per particle
  const int own = valid ? atomicAdd(count + key, 1) : 0;
#endif
  if (!in_range) {
    return;
  }
  bin[p] = key;
  if (valid) {
    rank[p] = own;
    return;
  }
  // Rejected: reported (maybe after this call returns); the mesh must not look valid.
  const int64_t cells = g.shape[0] * g.shape[1] * g.shape[2];
  for (int64_t ch = 0; ch < channels; ++ch) {
    gpuAtomicAdd(mesh + ((p / per_batch) * channels + ch) * cells, static_cast<scalar_t>(NAN));
  }
}

// Pass 2: the particles in tile order (start: each tile's first place).
__global__ void tile_place_kernel(
    const int32_t* __restrict__ bin,
    const int32_t* __restrict__ rank,
    const int32_t* __restrict__ start,
    int64_t total,
    int32_t* __restrict__ order) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < total;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int32_t tile = bin[p];
    if (tile >= 0) {
      order[start[tile] + rank[p]] = static_cast<int32_t>(p);
    }
  }
}

// Pass 3: one block per chunk of a tile's particles (blocks past the last chunk
// return at once). The tile copy lives in dynamic shared memory:
// C (kTile + W - 1)^3 values, at most 42.6 kB (float64, C = 4, PCS).
template <typename scalar_t, int W, int C>
__global__ void tile_paint_kernel(
    const scalar_t* __restrict__ positions,
    const scalar_t* __restrict__ values,
    int64_t channels,
    int64_t channel0,
    StencilGeometry g,
    TileGrid grid,
    int64_t tiles,
    const int32_t* __restrict__ chunk_end,
    const int32_t* __restrict__ start,
    const int32_t* __restrict__ count,
    const int32_t* __restrict__ order,
    scalar_t* __restrict__ mesh) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t S = tile_span<W>();
  constexpr int64_t nodes = S * S * S;
  extern __shared__ __align__(16) unsigned char tile_shared[];
  scalar_t* copy = reinterpret_cast<scalar_t*>(tile_shared);
  int64_t tile;
  int64_t chunk;
  if (!chunk_of_block(chunk_end, tiles, blockIdx.x, tile, chunk)) {
    return;  // the whole block
  }
  int64_t origin[3];
  tile_origin(tile, grid, origin);
  for (int64_t i = threadIdx.x; i < C * nodes; i += blockDim.x) {
    copy[i] = scalar_t(0);
  }
  __syncthreads();
  const int64_t begin = start[tile] + chunk * kTileChunk;
  const int64_t end = ::min(begin + kTileChunk, static_cast<int64_t>(start[tile]) + count[tile]);
  for (int64_t q = begin + threadIdx.x; q < end; q += blockDim.x) {
    const int64_t p = order[q];
    add_to_tile<scalar_t, acc_t, W, C>(
        positions + 3 * p, values ? values + p * channels : nullptr, channel0, g, origin, copy,
        [](scalar_t* target, scalar_t v) { gpuAtomicAdd(target, v); });
  }
  __syncthreads();
  const int64_t cells = g.shape[0] * g.shape[1] * g.shape[2];
  scalar_t* m = mesh + ((tile / grid.per_member) * channels + channel0) * cells;
  for (int64_t index = threadIdx.x; index < nodes; index += blockDim.x) {
    int64_t node;
    if (!tile_node<W>(index, origin, g, node)) {
      continue;
    }
#pragma unroll
    for (int ch = 0; ch < C; ++ch) {
      const scalar_t v = copy[ch * nodes + index];
      if (v != scalar_t(0)) {  // NaN too
        gpuAtomicAdd(m + ch * cells + node, v);
      }
    }
  }
}

at::Tensor paint_tiled_cuda(
    const at::Tensor& positions,
    const std::optional<at::Tensor>& weights,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    std::array<bool, 3> periodic,
    int64_t order,
    bool check_finite) {
  // Errors name the paint the user called (torchpm.paint takes this op).
  const char* op = "torchpm.paint";
  return cuda_paint_op(op, positions, weights, shape, offset, periodic, order, /*accumulates=*/true,
                       [&](const PaintArguments& args, at::Tensor& mesh, auto dtype, auto width,
                           cudaStream_t stream, unsigned long long* bad) {
    using scalar_t = typename decltype(dtype)::type;
    constexpr int W = decltype(width)::value;
    at::globalContext().alertNotDeterministic("torchpm::_paint_tiled (CUDA atomics)");
    const at::Tensor& x = args.positions;
    const StencilGeometry& g = args.geometry;
    const int64_t total = x.size(0) * x.size(1);
    const TileGrid grid = make_tile_grid(g);
    const int64_t tiles = x.size(0) * grid.per_member;
    check_tile_sizes(op, total, tiles);
    const auto int_options = x.options().dtype(at::kInt);
    auto count = at::zeros({tiles}, int_options);
    auto bin = at::empty({total}, int_options);
    auto rank = at::empty({total}, int_options);
    const scalar_t* values = args.weights.defined() ? args.weights.data_ptr<scalar_t>() : nullptr;
    tile_bin_kernel<scalar_t, W><<<blocks_for(op, total), kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), values, args.channels, x.size(1), total, g, grid,
        check_finite && values != nullptr, bin.data_ptr<int32_t>(), rank.data_ptr<int32_t>(),
        count.data_ptr<int32_t>(), mesh.data_ptr<scalar_t>(), bad);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const TilePrefixSums sums = tile_prefix_sums(count);
    auto in_order = at::empty({total}, int_options);
    tile_place_kernel<<<grid_stride_blocks(total), kThreads, 0, stream>>>(
        bin.data_ptr<int32_t>(), rank.data_ptr<int32_t>(), sums.start.data_ptr<int32_t>(), total,
        in_order.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const auto blocks = static_cast<unsigned int>(tile_chunk_bound(tiles, total));
    for_channel_groups(args.channels, [&](auto group, int64_t channel0) {
      constexpr int C = decltype(group)::value;
      const size_t shared = C * tile_span<W>() * tile_span<W>() * tile_span<W>() * sizeof(scalar_t);
      tile_paint_kernel<scalar_t, W, C><<<blocks, kThreads, shared, stream>>>(
          x.data_ptr<scalar_t>(), values, args.channels, channel0, g, grid, tiles,
          sums.chunk_end.data_ptr<int32_t>(), sums.start.data_ptr<int32_t>(), count.data_ptr<int32_t>(),
          in_order.data_ptr<int32_t>(), mesh.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

at::Tensor readout_cuda(
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
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t total = positions.size(0) * positions.size(1);
  auto out = at::empty({positions.size(0), positions.size(1), channels}, positions.options());
  if (total > 0) {
    DeviceCounters& counters = counters_for(op, positions.device());
    const bool in_capture = capturing();
    unsigned long long* bad = slot_pointer(counters, kReadoutOp);
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "readout_cuda", [&] {
      dispatch_order(op, order, [&](auto width) {
        readout_kernel<scalar_t, decltype(width)::value>
            <<<blocks_for(op, total), kThreads, 0, stream>>>(
                mesh.data_ptr<scalar_t>(), layout, positions.data_ptr<scalar_t>(), channels,
                positions.size(1), total, g, check_finite, out.data_ptr<scalar_t>(),
                bad);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    report_after_launch(kReadoutOp, counters, in_capture, CallDiagnosis(positions, out, g));
  }
  return has_channel_dim ? out : out.squeeze(2);
}

// torchpm::_readout_kick_drift_ on CUDA: the CPU op's contract (see
// readout_kick_drift_cpu): every particle updated except those left out
// (momentum NaN, position as read), counted in the readout's slot. Immediate
// mode raises the CPU op's error, naming the worst particle where it was
// read; the kernel then also writes what the error names (LeftOutRecord, two
// (B, N, 3) arrays). Deferred mode (the default on CUDA) writes nothing more
// than the updates: the late error gives the counts and says how to have the
// particle named.
void readout_kick_drift_cuda(
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
  const StencilGeometry& g = args.geometry;
  bump_version(positions);
  bump_version(momenta);
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t total = positions.size(0) * positions.size(1);
  if (total == 0) {
    return;
  }
  DeviceCounters& counters = counters_for(op, positions.device());
  const bool in_capture = capturing();
  const bool immediate = !errors_deferred(c10::DeviceType::CUDA) && !in_capture;
  at::Tensor where;
  at::Tensor read;
  if (immediate) {
    where = at::empty_like(positions, at::MemoryFormat::Contiguous);
    read = at::empty_like(positions, at::MemoryFormat::Contiguous);
  }
  unsigned long long* bad = slot_pointer(counters, kReadoutOp);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "readout_kick_drift_cuda", [&] {
    LeftOutRecord<scalar_t> record;
    if (immediate) {
      record.where = where.data_ptr<scalar_t>();
      record.read = read.data_ptr<scalar_t>();
      for (int d = 0; d < 3; ++d) {
        record.centre[d] =
            static_cast<scalar_t>(static_cast<double>(g.offset[d]) + 0.5 * static_cast<double>(g.shape[d]));
      }
    }
    dispatch_order(op, order, [&](auto width) {
      readout_kick_drift_kernel<scalar_t, decltype(width)::value>
          <<<blocks_for(op, total), kThreads, 0, stream>>>(
              args.mesh.data_ptr<scalar_t>(), args.layout, positions.data_ptr<scalar_t>(),
              momenta.data_ptr<scalar_t>(), positions.size(1), total, g, check_finite,
              make_kick_drift<scalar_t>(kicks, drift), bad, record);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  report_after_launch(
      kReadoutOp, counters, in_capture,
      immediate ? CallDiagnosis(where, read, g, op, kLeftOutNote)
                : CallDiagnosis::unnamed(positions.device(), op, kLeftOutNote));
}

// See position_gradient_impl in ../cpu/mass_assignment.cpp.
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
  const StencilGeometry& g = args.geometry;
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t total = positions.size(0) * positions.size(1);
  auto out = at::empty({positions.size(0), positions.size(1), 3}, positions.options());
  auto read = at::empty({positions.size(0), positions.size(1), readout_channels}, positions.options());
  if (total > 0) {
    DeviceCounters& counters = counters_for(op, positions.device());
    const bool in_capture = capturing();
    unsigned long long* bad = slot_pointer(counters, kPositionGradientOp);
    unsigned long long* bad_read = slot_pointer(counters, kReadoutOp);
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "position_gradient_cuda", [&] {
      dispatch_order(op, order, [&](auto width) {
        position_gradient_kernel<scalar_t, decltype(width)::value>
            <<<blocks_for(op, total), kThreads, 0, stream>>>(
                mesh.data_ptr<scalar_t>(), args.layout, positions.data_ptr<scalar_t>(),
                values.defined() ? values.data_ptr<scalar_t>() : nullptr, channels,
                positions.size(1), total, g, out.data_ptr<scalar_t>(),
                bad, readout_channels, read.data_ptr<scalar_t>(), bad_read);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    report_after_launch(
        kPositionGradientOp, counters, in_capture, CallDiagnosis(positions, {}, g));
    if (readout_channels > 0) {
      report_after_launch(kReadoutOp, counters, in_capture, CallDiagnosis(positions, read, g));
    }
  }
  return {out, read};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CUDA, m) {
  m.impl("paint", &paint_cuda);
  m.impl("_paint_deterministic", &paint_deterministic_cuda);
  m.impl("_paint_tiled", &paint_tiled_cuda);
  m.impl("readout", &readout_cuda);
  m.impl("_readout_kick_drift_", &readout_kick_drift_cuda);
  m.impl("_position_gradient", &position_gradient_op<position_gradient_impl>);
  m.impl("_readout_and_position_gradient", &readout_and_position_gradient_op<position_gradient_impl>);
}

}  // namespace torchpm
