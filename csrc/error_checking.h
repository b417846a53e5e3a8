// Reporting of bad particles (outside the mesh block, non-finite positions or
// values) found inside the mass-assignment kernels, immediately or deferred.
//
// Every kernel counts the particles it rejects. Getting that count to the host
// is free on the CPU but costs a synchronisation on CUDA: a host round trip per
// call that drains the queue and cannot be captured in a CUDA graph. So the
// report has two modes:
//
// * immediate: the op raises before it returns (on CUDA: one small
//   synchronising copy per call);
// * deferred: the op returns; its count travels to pinned host memory with an
//   asynchronous copy and an event, and the error is raised by the next
//   torchpm op whose event query finds it complete (no synchronisation), or by
//   torchpm.check() (waits for every pending count). A deferred call returns
//   NaN in place of what a rejected particle should have contributed (readout
//   and position gradient: its entries; paint: added to node (0, 0, 0) of its
//   batch's mesh, every channel; _readout_kick_drift_: its momentum, in both
//   modes), so a result used before the report cannot look valid.
//
// "auto" (the default) is deferred on CUDA and immediate on the CPU, where the
// count is known when the kernel returns. The environment variable
// TORCHPM_ERROR_CHECKING (auto | immediate | deferred) sets the starting mode.
//
// Inside CUDA graph capture nothing may synchronise or query an event: the
// kernels add their counts to per-device counters that are never reset, and any
// increase is reported by the next op outside the graph or by torchpm.check().
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include "torchpm.h"

namespace torchpm {

enum class ErrorChecking { Auto, Immediate, Deferred };

// Parses "auto" / "immediate" / "deferred"; raises a ValueError naming `what`.
ErrorChecking parse_error_checking(const std::string& name, const char* what);
const char* error_checking_name(ErrorChecking mode);
ErrorChecking error_checking();
// Returns the previous mode.
ErrorChecking set_error_checking(ErrorChecking mode);
// Whether an error found by a kernel on this device type is reported late.
bool errors_deferred(c10::DeviceType type);

// The ops whose kernels count bad particles; each has two counters: rejected
// positions, and non-finite values (`value_name`).
enum OpSlot : int { kPaintOp = 0, kReadoutOp = 1, kPositionGradientOp = 2, kOpSlots = 3 };
const char* op_name(OpSlot op);
const char* value_name(OpSlot op);

struct BadCounts {
  int64_t positions = 0;
  int64_t values = 0;
  bool any() const { return positions > 0 || values > 0; }
};
using SlotCounts = std::array<BadCounts, kOpSlots>;

// What an error message can say about the call that found the bad particles:
// the tensors the kernel read (positions, and the per-particle values checked
// for finiteness: the weights of paint, the result of readout) and the block.
// Kept by a deferred check; used only while their version counters show that
// nobody wrote to them since.
struct CallDiagnosis {
  at::Tensor positions;
  at::Tensor values;  // (B, N, C), or undefined
  StencilGeometry geometry{};
  int64_t positions_version = 0;
  int64_t values_version = 0;
  std::string device;
  // An op that counts in another op's slot (_readout_kick_drift_ in the
  // readout's): its name, and what it did with the bad particles, for the
  // message; null and empty for the slot's own op.
  const char* op = nullptr;
  std::string outcome;

  CallDiagnosis() = default;
  CallDiagnosis(const at::Tensor& positions, const at::Tensor& values, const StencilGeometry& g,
                const char* op = nullptr, std::string outcome = std::string());
  // A call that keeps nothing to name its bad particles by (the message says
  // how to have them named): its device, op and outcome.
  static CallDiagnosis unnamed(const c10::Device& device, const char* op, std::string outcome);
};

// One call's counts on their way to the host.
struct PendingCheck {
  int op = -1;  // the submitting call's OpSlot, or -1 (a snapshot by torchpm.check)
  CallDiagnosis diagnosis;
  std::function<bool()> ready;  // never blocks
  std::function<void()> wait;   // blocks until ready
  // Called once, after ready, in submission order: the counts this check adds
  // to what earlier checks already reported.
  std::function<SlotCounts()> take;
};

// Raises the first error among the completed pending checks (with wait: after
// waiting for all of them). `caller` is named in the message of a deferred
// error ("reported by ..."). Each error is raised once.
void raise_pending_errors(bool wait, const char* caller);

// Called by every op before its kernel: reports what earlier calls left,
// without waiting (no-op when nothing is pending).
void report_earlier_errors(const char* caller);

// Called by a kernel that knows its counts on return (the CPU): raises at once
// in immediate mode; in deferred mode leaves the error for later and returns.
void report_bad_particles(OpSlot op, const BadCounts& counts, CallDiagnosis diagnosis);

// Called by a kernel whose counts are still on the device (CUDA): queues the
// check, and in immediate mode waits for it and raises.
void submit_check(PendingCheck check, bool immediate);

// Hooks of the CUDA backend: whether the current stream is capturing a graph
// (nothing may be queried then), and a snapshot of every device's counters
// (queued as pending checks) for torchpm.check().
struct DeviceHooks {
  bool (*capturing)() = nullptr;
  void (*snapshot_counters)() = nullptr;
};
void set_device_hooks(DeviceHooks hooks);

// torchpm.check(): waits for every pending count (and, on CUDA, for the
// counters of graph replays) and raises the first error.
void check_errors();

}  // namespace torchpm
