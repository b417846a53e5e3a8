// Immediate or deferred reporting of bad particles (error_checking.h).
#include "error_checking.h"
#include "updates.h"  // kLeftOutNote

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <sstream>

namespace torchpm {

namespace {

// More pending checks than this (a host far ahead of its GPU) and the oldest is
// waited for, so the queue and the tensors it keeps alive stay bounded.
constexpr size_t kMaxPending = 1024;

struct Registry {
  std::mutex mutex;
  std::deque<PendingCheck> pending;
  std::atomic<size_t> size{0};
  std::atomic<int> mode{-1};  // -1: not read from the environment yet
  DeviceHooks hooks;
};

// Never destroyed: pending checks may hold CUDA tensors and events, which must
// not be released after the CUDA runtime has shut down at exit.
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

ErrorChecking mode_from_environment() {
  const char* value = std::getenv("TORCHPM_ERROR_CHECKING");
  if (value == nullptr || *value == '\0') {
    return ErrorChecking::Auto;
  }
  return parse_error_checking(value, "the environment variable TORCHPM_ERROR_CHECKING");
}

bool diagnosis_current(const CallDiagnosis& d) {
  return d.positions.defined() && d.positions._version() == d.positions_version &&
      (!d.values.defined() || d.values._version() == d.values_version);
}

// Raises the error of `counts` (one slot) found by `check`.
[[noreturn]] void raise_counts(
    OpSlot op, const BadCounts& counts, const PendingCheck& check, bool late,
    const char* caller) {
  std::string late_note;
  if (late) {
    std::ostringstream note;
    note << "Reported late, by " << caller << ": with error checking \""
         << error_checking_name(error_checking())
         << "\" an op returns without waiting for its particle check (the default on CUDA, "
            "where waiting costs a host synchronisation). Call "
            "torchpm.set_error_checking(\"immediate\") to raise inside the call, or "
            "torchpm.check() where the errors should surface.";
    late_note = note.str();
  }
  const bool own = check.op == op;
  const CallDiagnosis& d = check.diagnosis;
  const char* name = own && d.op != nullptr ? d.op : op_name(op);
  const std::string outcome = own ? d.outcome : std::string();
  if (own && diagnosis_current(d)) {
    const std::string context =
        outcome.empty() ? late_note : (late_note.empty() ? outcome : outcome + " " + late_note);
    if (counts.positions > 0) {
      throw_bad_particles(name, d.positions, d.geometry, counts.positions, context);
    }
    if (d.values.defined()) {
      throw_non_finite(name, value_name(op), d.values, counts.values, context);
    }
  }
  // The call's tensors were written to since, or it kept none (or the count
  // comes from a CUDA graph replay): say what is known without pointing at a
  // particle.
  std::ostringstream msg;
  msg << name;
  if (!own && op == kReadoutOp) {
    // the fused step counts in the readout's slot too: either may have found them
    msg << " (or torchpm._readout_kick_drift_, a Simulation step's readout with its kicks and drift)";
  }
  msg << ": a call";
  if (own && !d.device.empty()) {
    msg << " on " << d.device;
  }
  if (!own) {
    msg << " (inside a CUDA graph, or on another stream)";
  }
  msg << " found ";
  if (counts.positions > 0) {
    msg << counts.positions
        << " particles whose `positions` are non-finite or outside the mesh block (they "
           "cannot be "
        << (op == kReadoutOp ? "read" : "deposited") << ")";
  } else {
    msg << counts.values << " particles with NaN or Inf `" << value_name(op) << "`";
  }
  if (!own && op == kReadoutOp) {
    msg << "; the readout returned NaN in their place, the fused step left them out (" << kLeftOutNote << ") ";
  } else if (outcome.empty()) {
    msg << "; it returned NaN in their place. ";
  } else {
    msg << ". " << outcome << " ";
  }
  if (!own) {
    msg << "The call's inputs are not known";
  } else if (!d.positions.defined()) {
    msg << "The call kept nothing to name them by";
  } else {
    msg << "Its inputs changed since";
  }
  msg << ", so the first bad particle cannot be named: rerun with "
         "torchpm.set_error_checking(\"immediate\") (and without the graph) to raise inside "
         "the call. ";
  msg << late_note;
  throw c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg.str());
}

// Takes the counts of the oldest pending check (waiting for it with `wait`)
// and raises its first error. Returns false when it is not ready. Called with
// the lock held; the check is removed before the throw, so each error is
// raised once.
bool drain_front(Registry& r, bool wait, const char* caller, bool late) {
  PendingCheck& front = r.pending.front();
  if (!front.ready()) {
    if (!wait) {
      return false;
    }
    front.wait();
  }
  PendingCheck check = std::move(front);
  r.pending.pop_front();
  r.size.store(r.pending.size());
  const SlotCounts counts = check.take();
  // The submitting op first: its diagnosis names the particle.
  if (check.op >= 0 && counts[check.op].any()) {
    raise_counts(static_cast<OpSlot>(check.op), counts[check.op], check, late, caller);
  }
  for (int op = 0; op < kOpSlots; ++op) {
    if (counts[op].any()) {
      raise_counts(static_cast<OpSlot>(op), counts[op], check, late, caller);
    }
  }
  return true;
}

// Drains the ready checks at the front of the queue (all of them with `wait`).
void drain(Registry& r, bool wait, const char* caller, bool late) {
  while (!r.pending.empty() && drain_front(r, wait, caller, late)) {
  }
}

}  // namespace

CallDiagnosis::CallDiagnosis(
    const at::Tensor& positions_, const at::Tensor& values_, const StencilGeometry& g, const char* op_,
    std::string outcome_)
    : positions(positions_), values(values_), geometry(g), op(op_), outcome(std::move(outcome_)) {
  positions_version = positions.defined() ? positions._version() : 0;
  values_version = values.defined() ? values._version() : 0;
  device = positions.defined() ? positions.device().str() : "";
}

CallDiagnosis CallDiagnosis::unnamed(const c10::Device& device, const char* op, std::string outcome) {
  CallDiagnosis d;
  d.device = device.str();
  d.op = op;
  d.outcome = std::move(outcome);
  return d;
}

ErrorChecking parse_error_checking(const std::string& name, const char* what) {
  if (name == "auto") return ErrorChecking::Auto;
  if (name == "immediate") return ErrorChecking::Immediate;
  if (name == "deferred") return ErrorChecking::Deferred;
  TORCH_CHECK_VALUE(
      false, "torchpm: ", what, " must be \"auto\" (deferred on CUDA, immediate on the CPU), "
      "\"immediate\" or \"deferred\", got \"", name, "\".");
}

const char* error_checking_name(ErrorChecking mode) {
  switch (mode) {
    case ErrorChecking::Immediate:
      return "immediate";
    case ErrorChecking::Deferred:
      return "deferred";
    default:
      return "auto";
  }
}

ErrorChecking error_checking() {
  Registry& r = registry();
  int mode = r.mode.load();
  if (mode < 0) {
    // Read once; a bad value raises here (at import in Python) and at every
    // later use until fixed.
    mode = static_cast<int>(mode_from_environment());
    int expected = -1;
    r.mode.compare_exchange_strong(expected, mode);
    mode = r.mode.load();
  }
  return static_cast<ErrorChecking>(mode);
}

ErrorChecking set_error_checking(ErrorChecking mode) {
  ErrorChecking previous = ErrorChecking::Auto;
  try {
    previous = error_checking();
  } catch (const c10::ValueError&) {
    // a bad environment value is replaced by the explicit setting
  }
  registry().mode.store(static_cast<int>(mode));
  return previous;
}

bool errors_deferred(c10::DeviceType type) {
  switch (error_checking()) {
    case ErrorChecking::Immediate:
      return false;
    case ErrorChecking::Deferred:
      return true;
    default:
      return type == c10::DeviceType::CUDA;
  }
}

const char* op_name(OpSlot op) {
  static const char* names[kOpSlots] = {
      "torchpm.paint", "torchpm.readout", "torchpm._position_gradient"};
  return names[op];
}

const char* value_name(OpSlot op) {
  static const char* names[kOpSlots] = {"weights", "mesh", "values"};
  return names[op];
}

void raise_pending_errors(bool wait, const char* caller) {
  Registry& r = registry();
  if (r.size.load() == 0) {
    return;
  }
  if (r.hooks.capturing && r.hooks.capturing()) {
    // Event queries are illegal while a CUDA graph is being captured.
    return;
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  drain(r, wait, caller, true);
}

void report_earlier_errors(const char* caller) {
  raise_pending_errors(false, caller);
}

void report_bad_particles(OpSlot op, const BadCounts& counts, CallDiagnosis diagnosis) {
  if (!counts.any()) {
    return;
  }
  PendingCheck check;
  check.op = op;
  check.diagnosis = std::move(diagnosis);
  if (!errors_deferred(check.diagnosis.positions.device().type())) {
    check.take = [] { return SlotCounts{}; };
    raise_counts(op, counts, check, false, op_name(op));
  }
  check.ready = [] { return true; };
  check.wait = [] {};
  check.take = [op, counts] {
    SlotCounts all{};
    all[op] = counts;
    return all;
  };
  submit_check(std::move(check), false);
}

void submit_check(PendingCheck check, bool immediate) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const OpSlot op = static_cast<OpSlot>(std::max(check.op, 0));
  // The submitting call, named in the late errors it drains: an op that counts in
  // another op's slot (_readout_kick_drift_ in the readout's) by its own name, a
  // snapshot (op -1) by torchpm.check.
  const char* caller = check.diagnosis.op != nullptr ? check.diagnosis.op
      : check.op < 0                                 ? "torchpm.check"
                                                     : op_name(op);
  r.pending.push_back(std::move(check));
  r.size.store(r.pending.size());
  if (immediate) {
    // Everything queued before belongs to earlier calls: their errors are late.
    while (r.pending.size() > 1) {
      drain_front(r, true, caller, true);
    }
    drain_front(r, true, caller, false);
    return;
  }
  while (r.pending.size() > kMaxPending) {
    drain_front(r, true, caller, true);
  }
}

void set_device_hooks(DeviceHooks hooks) {
  registry().hooks = hooks;
}

void check_errors() {
  Registry& r = registry();
  TORCH_CHECK(
      !(r.hooks.capturing && r.hooks.capturing()),
      "torchpm.check() waits for the GPU, which is not allowed while a CUDA graph is being "
      "captured: call it outside the capture (after graph.replay()).");
  if (r.hooks.snapshot_counters) {
    r.hooks.snapshot_counters();
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  drain(r, true, "torchpm.check()", true);
}

}  // namespace torchpm
