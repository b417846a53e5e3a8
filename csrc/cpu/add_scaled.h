// out = x + y * factor with the rounding of torch's mul then add: the product
// rounded first, kept in `product` (count entries) before the sums read it, so
// that no compiler contracts the two into a fused multiply-add. `out` may be
// `x` (in place). Shared by the one-pass updates (updates.cpp) and the readout
// that carries them (mass_assignment.cpp, _readout_kick_drift_), which must
// round alike.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace torchpm {

template <typename scalar_t>
C10_ALWAYS_INLINE void add_scaled_block(const scalar_t* x, const scalar_t* y, scalar_t factor, scalar_t* out,
                                        int64_t count, scalar_t* product) {
  for (int64_t i = 0; i < count; ++i) {
    product[i] = y[i] * factor;
  }
  for (int64_t i = 0; i < count; ++i) {
    out[i] = x[i] + product[i];
  }
}

}  // namespace torchpm
