// The integrator's updates x + y * f, shared by the CPU and CUDA kernels of
// _add_scaled(_) and _readout_kick_drift_, so that the CPU tests run the
// arithmetic CUDA runs and both backends give the bits of torch's mul then
// add: the factor rounded to the dtype (by the caller, as torch's mul rounds
// its scalar), the product rounded, then the sum; never a fused multiply-add
// (the adjoint and resumed runs rely on the same bits as the autograd path,
// which uses torch's two ops).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

namespace torchpm {

// a * b and a + b (float or double), each rounded to nearest. On the device
// the intrinsics, which nvcc never contracts into a fused multiply-add (it
// would by default); on the host the plain operators (add_scaled_block keeps
// them apart).
template <typename scalar_t>
C10_HOST_DEVICE C10_ALWAYS_INLINE scalar_t rounded_product(scalar_t a, scalar_t b) {
#ifdef __CUDA_ARCH__
  if constexpr (std::is_same_v<scalar_t, float>) {
    return __fmul_rn(a, b);
  } else {
    return __dmul_rn(a, b);
  }
#else
  return a * b;
#endif
}

template <typename scalar_t>
C10_HOST_DEVICE C10_ALWAYS_INLINE scalar_t rounded_sum(scalar_t a, scalar_t b) {
#ifdef __CUDA_ARCH__
  if constexpr (std::is_same_v<scalar_t, float>) {
    return __fadd_rn(a, b);
  } else {
    return __dadd_rn(a, b);
  }
#else
  return a + b;
#endif
}

// out = x + y * factor for `count` entries: the products first, kept in
// `product` (count entries) before the sums read them, so that no host
// compiler contracts the two into a fused multiply-add (and the loops
// vectorise). `out` may be `x` (in place).
template <typename scalar_t>
C10_HOST_DEVICE C10_ALWAYS_INLINE void add_scaled_block(const scalar_t* x, const scalar_t* y, scalar_t factor,
                                                        scalar_t* out, int64_t count, scalar_t* product) {
  for (int64_t i = 0; i < count; ++i) {
    product[i] = rounded_product(y[i], factor);
  }
  for (int64_t i = 0; i < count; ++i) {
    out[i] = rounded_sum(x[i], product[i]);
  }
}

// The factors of _readout_kick_drift_, rounded to the dtype: one or two kicks,
// and the drift when `drifts`.
template <typename scalar_t>
struct KickDrift {
  scalar_t kick[2];
  int kicks;
  bool drifts;
  scalar_t drift;
};

template <typename scalar_t>
KickDrift<scalar_t> make_kick_drift(c10::ArrayRef<double> kicks, std::optional<double> drift) {
  KickDrift<scalar_t> f{{scalar_t(0), scalar_t(0)}, static_cast<int>(kicks.size()), drift.has_value(),
                        static_cast<scalar_t>(drift.value_or(0.0))};
  for (size_t i = 0; i < kicks.size() && i < 2; ++i) {
    f.kick[i] = static_cast<scalar_t>(kicks[i]);
  }
  return f;
}

// The update rule of _readout_kick_drift_ for `count` coordinates (one
// particle's 3 on CUDA, a run of particles' on the CPU): momenta v += force *
// kick for each kick, then positions x += v * drift, each step rounded as
// _add_scaled_ rounds it, so the result is the composition readout,
// _add_scaled_, ..., bit for bit. `product`: count entries of scratch.
template <typename scalar_t>
C10_HOST_DEVICE C10_ALWAYS_INLINE void kick_drift_block(scalar_t* x, scalar_t* v, const scalar_t* force,
                                                        int64_t count, const KickDrift<scalar_t>& f,
                                                        scalar_t* product) {
  // kicks is 1 or 2 (checked): the two written out, as a loop over f.kick[i] with
  // a runtime i puts the struct in local memory in a CUDA kernel.
  add_scaled_block(v, force, f.kick[0], v, count, product);
  if (f.kicks > 1) {
    add_scaled_block(v, force, f.kick[1], v, count, product);
  }
  if (f.drifts) {
    add_scaled_block(x, v, f.drift, x, count, product);
  }
}

// A particle the readout rejects (outside the block or non-finite), or one that
// read a NaN or Inf (check_finite), is left out of the update: its momentum
// becomes NaN, its position stays where it was read, so the error names it
// there. What the error says about it:
constexpr const char* kLeftOutNote =
    "Their momenta are NaN and their positions as read; every other particle was updated.";

template <typename scalar_t>
C10_HOST_DEVICE C10_ALWAYS_INLINE void leave_out(scalar_t* v) {
  for (int c = 0; c < 3; ++c) {
    v[c] = std::numeric_limits<scalar_t>::quiet_NaN();
  }
}

// One particle (x, v: its 3 coordinates): updated with `force` (kick_drift_block),
// or left out (leave_out). The CUDA kernel's rule; the CPU applies the same two
// functions a run of particles at a time.
template <typename scalar_t>
C10_HOST_DEVICE C10_ALWAYS_INLINE void update_particle(bool updated, scalar_t* x, scalar_t* v,
                                                       const scalar_t* force, const KickDrift<scalar_t>& f) {
  if (!updated) {
    leave_out(v);
    return;
  }
  scalar_t product[3];
  kick_drift_block(x, v, force, 3, f, product);
}

}  // namespace torchpm
