// CPU kernel of torchpm::_migration_holes: who leaves a block, in one pass
// (torchpm/distributed/particles.py plans a migration stage from it).
//
// The slots that are free once the particles leaving along one grid axis are
// gone: every empty slot (id < 0) and every occupied slot whose coordinate
// along `axis` lies outside [low, high). A NaN coordinate compares false both
// ways and stays (the count of non-finite positions reports it). The flat slot
// indices come out in increasing order. Torch needs about seven passes over the
// slots for this (the comparisons, their combinations and nonzero); here each
// chunk of slots is read once from memory (its flags, then, while it is in
// cache, the count of occupied slots with a non-finite coordinate, which the
// migration must report on every rank).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

#include "../torchpm.h"

namespace torchpm {
namespace {

constexpr int64_t kChunk = 1 << 16;

// Occupied slots of `n` particles at `p` (xyz interleaved) whose position has
// a NaN or infinite coordinate, or one at or beyond +-2^40 cells (kMaxAbsPosition: what
// the paint refuses; the migration wraps a split axis, which would hide it). A
// chunk without any such coordinate (the usual case) costs one vectorised pass
// over its contiguous coordinates; only a chunk holding one pays for the
// per-particle count.
template <typename scalar_t>
int64_t count_non_finite(const scalar_t* p, const int64_t* id, int64_t n) {
  constexpr scalar_t largest = static_cast<scalar_t>(kMaxAbsPosition);
  uint32_t any = 0;
  for (int64_t j = 0; j < 3 * n; ++j) {
    // False for a value inside +-2^40, true at or beyond, for +-Inf and (unordered) NaN.
    any |= static_cast<uint32_t>(!(std::fabs(p[j]) < largest));
  }
  if (!any) {
    return 0;
  }
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool finite = std::fabs(p[3 * i]) < largest && std::fabs(p[3 * i + 1]) < largest &&
        std::fabs(p[3 * i + 2]) < largest;
    count += static_cast<int64_t>(id[i] >= 0 && !finite);
  }
  return count;
}

template <typename scalar_t>
void find_holes(
    const scalar_t* pos,
    const int64_t* ids,
    int64_t count,
    int axis,
    double low,
    double high,
    std::vector<std::vector<int64_t>>& holes,
    std::vector<int64_t>& bad) {
  const int64_t chunks = static_cast<int64_t>(holes.size());
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    // Flags first, in loops without branches the compiler can vectorise; then the
    // (few) flagged slots are collected, eight flags per test.
    std::unique_ptr<uint8_t[]> flag(new uint8_t[kChunk + 8]);
    for (int64_t c = first; c < last; ++c) {
      const int64_t begin = c * kChunk;
      const int64_t n = std::min(count, begin + kChunk) - begin;
      const int64_t* id = ids + begin;
      const scalar_t* p = pos + 3 * begin;
      const scalar_t* column = p + axis;
      const scalar_t lo = static_cast<scalar_t>(low);
      const scalar_t hi = static_cast<scalar_t>(high);
      uint8_t* f = flag.get();
      // Empty (the id's sign bit: a shift the compiler vectorises, where `id < 0`
      // stayed scalar), or outside along `axis`. A NaN coordinate compares false both
      // ways: it stays (count_non_finite reports it).
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t x = column[3 * i];
        f[i] = static_cast<uint8_t>(static_cast<uint64_t>(id[i]) >> 63) | static_cast<uint8_t>((x < lo) | (x >= hi));
      }
      std::memset(f + n, 0, 8);
      std::vector<int64_t>& mine = holes[c];
      for (int64_t i = 0; i < n; i += 8) {
        uint64_t word;
        std::memcpy(&word, f + i, 8);
        if (word == 0) {
          continue;
        }
        for (int64_t k = i; k < std::min(n, i + 8); ++k) {
          if (f[k]) {
            mine.push_back(begin + k);
          }
        }
      }
      bad[c] = count_non_finite(p, id, n);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> migration_holes_cpu(
    const at::Tensor& positions_in,
    const at::Tensor& ids_in,
    int64_t axis,
    double low,
    double high) {
  const char* op = "torchpm._migration_holes";
  const at::Tensor positions = check_positions(op, positions_in);
  TORCH_CHECK_VALUE(axis >= 0 && axis < 3, op, ": expected `axis` 0, 1 or 2, got ", axis, ".");
  TORCH_CHECK_VALUE(
      std::isfinite(low) && std::isfinite(high) && low <= high, op,
      ": expected finite bounds `low` <= `high`, got ", low, " and ", high, ".");
  const at::Tensor ids = check_particle_ids(op, ids_in, positions);
  const int64_t count = ids.numel();
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  std::vector<std::vector<int64_t>> holes(chunks);
  std::vector<int64_t> bad(chunks, 0);
  if (count > 0) {
    AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "migration_holes_cpu", [&] {
      find_holes<scalar_t>(
          positions.data_ptr<scalar_t>(), ids.data_ptr<int64_t>(), count, static_cast<int>(axis), low,
          high, holes, bad);
    });
  }
  int64_t total = 0;
  int64_t non_finite = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    total += static_cast<int64_t>(holes[c].size());
    non_finite += bad[c];
  }
  auto out = at::empty({total}, ids.options());
  int64_t* dst = out.data_ptr<int64_t>();
  for (const auto& part : holes) {
    if (!part.empty()) {
      std::memcpy(dst, part.data(), part.size() * sizeof(int64_t));
      dst += part.size();
    }
  }
  return {out, at::scalar_tensor(non_finite, ids.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CPU, m) {
  m.impl("_migration_holes", &migration_holes_cpu);
}

}  // namespace torchpm
