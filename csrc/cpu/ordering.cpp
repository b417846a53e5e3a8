// CPU kernel of torchpm::_spatial_order: the permutation that puts particles in
// spatial order (torchpm/ordering.py explains why and when).
//
// A stable counting sort by the (x, y) mesh row of each particle: the rows of a
// block are few (nx * ny, the mesh size to the power 2/3), so the histogram stays
// small whatever the mesh, and particles of one row touch the same few mesh
// lines in paint and readout. Inside a row the particles are ordered by id, so
// the order depends only on the positions and ids of the particles, not on the
// order they came in: a run that sorts at a step and a run resumed at that step
// paint in the same order and give the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "../stencil.h"
#include "../torchpm.h"

namespace torchpm {
namespace {

// Beyond this magnitude (cells) a coordinate has no fractional part worth a
// row: such particles go to the last bin, as non-finite ones do.
constexpr double kMaxKeyCoordinate = 4503599627370496.0;  // 2^52

template <typename scalar_t>
void order_one(
    const scalar_t* pos,
    const int64_t* ids,
    int64_t n,
    const int64_t shape[2],
    const int64_t offset[2],
    const int64_t period[2],
    int64_t* bin,
    int64_t* out) {
  const int64_t rows = shape[0] * shape[1];
  // Row of each particle. The key only orders: a coordinate outside the block
  // after wrapping (a particle not owned here, which migration prevents) goes
  // to the nearest edge row, an empty slot (id < 0) or a non-finite position
  // to the last bin. Nothing is dropped; the force calculation reports
  // positions it cannot use.
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      if (ids[p] < 0) {
        bin[p] = rows;
        continue;
      }
      int64_t index[2];
      bool ok = true;
      for (int d = 0; d < 2; ++d) {
        const double x = static_cast<double>(pos[3 * p + d]);
        if (!(std::fabs(x) < kMaxKeyCoordinate)) {  // NaN fails too
          ok = false;
          break;
        }
        int64_t i = static_cast<int64_t>(floor_of_bounded(x)) - offset[d];
        if (i < 0 || i >= period[d]) {  // only unwrapped coordinates pay a division
          i %= period[d];
          i += i < 0 ? period[d] : 0;
        }
        index[d] = std::min(i, shape[d] - 1);
      }
      bin[p] = ok ? index[0] * shape[1] + index[1] : rows;
    }
  });
  // Stable counting sort, in parallel: each of `parts` consecutive ranges of
  // particles counts its rows, and writes its particles of row r after those of
  // the ranges before it. The permutation does not depend on `parts`.
  const int64_t bins = rows + 1;
  const int64_t parts = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(1, 4 * bins)));
  const int64_t per_part = (n + parts - 1) / parts;
  std::vector<int64_t> count(parts * bins, 0);  // count[part * bins + row], then that part's first slot
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t part = first; part < last; ++part) {
      int64_t* c = count.data() + part * bins;
      for (int64_t p = part * per_part; p < std::min(n, (part + 1) * per_part); ++p) {
        ++c[bin[p]];
      }
    }
  });
  std::vector<int64_t> start(bins + 1, 0);  // first slot of each row
  int64_t slot = 0;
  for (int64_t r = 0; r < bins; ++r) {
    start[r] = slot;
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t c = count[part * bins + r];
      count[part * bins + r] = slot;
      slot += c;
    }
  }
  start[bins] = slot;
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t part = first; part < last; ++part) {
      int64_t* fill = count.data() + part * bins;
      for (int64_t p = part * per_part; p < std::min(n, (part + 1) * per_part); ++p) {
        out[fill[bin[p]]++] = p;
      }
    }
  });
  // Rows by id (index for equal ids, i.e. empty slots). Between two sorts most
  // particles keep their row and its id order, so a row is usually sorted or
  // nearly: an insertion sort then costs one pass; rows far from sorted (the
  // first sort of a scrambled set) go to std::sort.
  const auto before = [ids](int64_t a, int64_t b) {
    return ids[a] < ids[b] || (ids[a] == ids[b] && a < b);
  };
  at::parallel_for(0, rows + 1, 256, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      int64_t* lo = out + start[r];
      int64_t* hi = out + start[r + 1];
      int64_t descents = 0;
      for (int64_t* k = lo; k + 1 < hi; ++k) {
        descents += before(k[1], k[0]) ? 1 : 0;
      }
      if (descents == 0) {
        continue;
      }
      if (descents > 8) {
        std::sort(lo, hi, before);
        continue;
      }
      for (int64_t* k = lo + 1; k < hi; ++k) {
        const int64_t value = *k;
        int64_t* j = k;
        for (; j > lo && before(value, j[-1]); --j) {
          *j = j[-1];
        }
        *j = value;
      }
    }
  });
}

// (B, N, ...) -> (B, N, row_elements) contiguous, and the row size in bytes.
at::Tensor as_rows(const char* op, const at::Tensor& input, const at::Tensor& order, int64_t& row_bytes) {
  TORCH_CHECK_VALUE(
      order.scalar_type() == at::kLong && order.dim() == 2, op,
      ": expected an int64 `order` of shape (B, N), got ", order.scalar_type(), " ",
      format_list(order.sizes()), ".");
  TORCH_CHECK_VALUE(
      input.dim() >= 2 && input.size(0) == order.size(0) && input.size(1) == order.size(1), op,
      ": expected `input` of shape (B, N, ...) with (B, N) = ", format_list(order.sizes()),
      " from `order`, got ", format_list(input.sizes()), ".");
  const at::Tensor rows = input.contiguous();
  row_bytes = order.size(1) == 0 || order.size(0) == 0
      ? 0 : rows.numel() / (order.size(0) * order.size(1)) * rows.element_size();
  return rows;
}

// Copies row `from` of `source` to row `to` of `target` (rows of `bytes` bytes),
// with the common particle rows (3 floats, 3 doubles, one id) as fixed-size
// copies the compiler turns into a few moves.
inline void copy_row(char* target, const char* source, int64_t bytes) {
  switch (bytes) {
    case 8:
      std::memcpy(target, source, 8);
      break;
    case 12:
      std::memcpy(target, source, 12);
      break;
    case 24:
      std::memcpy(target, source, 24);
      break;
    default:
      std::memcpy(target, source, bytes);
  }
}

// out[b, k] = input[b, order[b, k]] (gather) or out[b, order[b, k]] = input[b, k]
// (scatter; the inverse of the gather when `order` is a permutation).
at::Tensor move_rows(const char* op, const at::Tensor& input, const at::Tensor& order_in, bool scatter) {
  int64_t row_bytes = 0;
  const at::Tensor order = order_in.contiguous();
  const at::Tensor rows = as_rows(op, input, order, row_bytes);
  auto out = scatter ? at::zeros_like(rows) : at::empty_like(rows);
  const int64_t batch = order.size(0);
  const int64_t n = order.size(1);
  if (out.numel() == 0) {
    return out;
  }
  const int64_t* index = order.data_ptr<int64_t>();
  const char* source = static_cast<const char*>(rows.data_ptr());
  char* target = static_cast<char*>(out.data_ptr());
  std::atomic<int64_t> bad{-1};
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* member_index = index + b * n;
    const char* member_source = source + b * n * row_bytes;
    char* member_target = target + b * n * row_bytes;
    at::parallel_for(0, n, 8192, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        const int64_t k = member_index[q];
        if (k < 0 || k >= n) {
          bad = b * n + q;
          continue;
        }
        if (scatter) {
          copy_row(member_target + k * row_bytes, member_source + q * row_bytes, row_bytes);
        } else {
          copy_row(member_target + q * row_bytes, member_source + k * row_bytes, row_bytes);
        }
      }
    });
  }
  int64_t at = bad.load();
  if (at >= 0) {
    // The threads report some bad slot; the message names the first one.
    at = 0;
    while (index[at] >= 0 && index[at] < n) {
      ++at;
    }
  }
  TORCH_CHECK_VALUE(
      at < 0, op, ": `order` must hold slots in [0, ", n, "), got ", at < 0 ? 0 : index[at],
      " at flat position ", at, ".");
  return out;
}

at::Tensor gather_rows_cpu(const at::Tensor& input, const at::Tensor& order) {
  return move_rows("torchpm._gather_rows", input, order, false);
}

at::Tensor scatter_rows_cpu(const at::Tensor& input, const at::Tensor& order) {
  return move_rows("torchpm._scatter_rows", input, order, true);
}

at::Tensor spatial_order_cpu(
    const at::Tensor& positions_in,
    const at::Tensor& ids_in,
    at::IntArrayRef shape,
    at::IntArrayRef offset,
    at::IntArrayRef period) {
  const char* op = "torchpm._spatial_order";
  const at::Tensor positions = check_positions(op, positions_in);
  TORCH_CHECK_VALUE(
      shape.size() == 2 && offset.size() == 2 && period.size() == 2, op,
      ": `shape`, `offset` and `period` must have 2 entries (x and y), got ",
      format_list(shape), ", ", format_list(offset), ", ", format_list(period), ".");
  for (int d = 0; d < 2; ++d) {
    TORCH_CHECK_VALUE(
        shape[d] > 0 && period[d] > 0 && shape[d] <= kMaxAxisSize && period[d] <= kMaxAxisSize, op,
        ": `shape` and `period` must be positive mesh sizes, got ", format_list(shape), " and ",
        format_list(period), ".");
  }
  const at::Tensor ids = check_particle_ids(op, ids_in, positions);
  const int64_t batch = positions.size(0);
  const int64_t n = positions.size(1);
  auto out = at::empty({batch, n}, ids.options());
  if (out.numel() == 0) {
    return out;
  }
  const int64_t geometry[3][2] = {{shape[0], shape[1]}, {offset[0], offset[1]}, {period[0], period[1]}};
  // Written in full by order_one before it is read: not zeroed first.
  std::unique_ptr<int64_t[]> bin(new int64_t[n]);
  AT_DISPATCH_FLOATING_TYPES(positions.scalar_type(), "spatial_order_cpu", [&] {
    const scalar_t* pos = positions.data_ptr<scalar_t>();
    const int64_t* id = ids.data_ptr<int64_t>();
    int64_t* result = out.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      order_one<scalar_t>(pos + 3 * n * b, id + n * b, n, geometry[0], geometry[1], geometry[2],
                          bin.get(), result + n * b);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchpm, CPU, m) {
  m.impl("_spatial_order", &spatial_order_cpu);
  m.impl("_gather_rows", &gather_rows_cpu);
  m.impl("_scatter_rows", &scatter_rows_cpu);
}

}  // namespace torchpm
