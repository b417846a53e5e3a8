// The all-to-all of the distributed FFT transposer, issued from C++ on the c10d
// ProcessGroup that torch.distributed registered under the group's name. The
// same code drives ProcessGroupNCCL (CUDA tensors) and ProcessGroupGloo (CPU
// tensors): c10d picks the backend from the tensors' device.
//
// Failure model: a peer that died or never reaches the collective makes
// Work::wait() raise once the process group's timeout expires (set with
// torch.distributed.init_process_group(timeout=...) or new_group(timeout=...)).
// The error is re-raised as a DistBackendError that names the group and says so.
//
// That holds for gloo as is: its wait() blocks the host until the collective
// completes. NCCL's wait() by default only makes the current stream wait and
// returns at once; a dead peer then stalls the stream, the host blocks at its
// next synchronisation, and the NCCL watchdog aborts the process after the
// timeout (no exception reaches this code). With TORCH_NCCL_BLOCKING_WAIT=1,
// read when the group is created, NCCL's wait() blocks the host like gloo's and
// raises after the timeout, so the same code and message hold for both:
// torchpm.distributed.launch.init_from_environment sets it unless the user did,
// and the README ("When a rank fails") asks users who create their own NCCL
// group to do the same. The call below is the same for both backends.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include "../torchpm.h"

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchpm {
namespace {

// ProcessGroup's single-tensor all-to-all is all_to_all_single in newer torch
// (alltoall_base, its older name, deprecated there) and alltoall_base alone in
// older releases (torch 2.11, the GPU machine's): take whichever exists.
template <typename Group, typename = void>
struct HasAllToAllSingle : std::false_type {};

template <typename Group>
struct HasAllToAllSingle<Group, std::void_t<decltype(std::declval<Group&>().all_to_all_single(
                                    std::declval<at::Tensor&>(), std::declval<at::Tensor&>(),
                                    std::declval<std::vector<int64_t>&>(),
                                    std::declval<std::vector<int64_t>&>()))>> : std::true_type {};

template <typename Group>
c10::intrusive_ptr<c10d::Work> all_to_all_single(
    Group& group, at::Tensor& recv, at::Tensor& send, std::vector<int64_t>& out_splits,
    std::vector<int64_t>& in_splits) {
  if constexpr (HasAllToAllSingle<Group>::value) {
    return group.all_to_all_single(recv, send, out_splits, in_splits);
  } else {
    return group.alltoall_base(recv, send, out_splits, in_splits);
  }
}

int64_t checked_sum(const char* name, at::IntArrayRef splits, int64_t group_size) {
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(splits.size()) == group_size,
      "torchpm._all_to_all: expected `", name, "` to have one entry per rank of the group (",
      group_size, "), got ", format_list(splits, "[", "]"), ".");
  int64_t total = 0;
  for (auto s : splits) {
    TORCH_CHECK_VALUE(
        s >= 0, "torchpm._all_to_all: `", name, "` must be non-negative, got ",
        format_list(splits, "[", "]"), ".");
    total += s;
  }
  return total;
}

at::Tensor all_to_all(
    const at::Tensor& input,
    at::IntArrayRef input_split_sizes,
    at::IntArrayRef output_split_sizes,
    c10::string_view group_name) {
  TORCH_CHECK_VALUE(
      input.dim() == 1, "torchpm._all_to_all: expected a 1-D `input` buffer, got ",
      input.dim(), " dimensions.");
  const std::string name(group_name);
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(name);
  } catch (const std::exception& error) {
    TORCH_CHECK_VALUE(
        false, "torchpm._all_to_all: no process group is registered under the name '", name,
        "' (", error.what(), "). Pass the name of a live torch.distributed group "
        "(group.group_name) and create it before use.");
  }
  const int64_t size = group->getSize();
  const int64_t sent = checked_sum("input_split_sizes", input_split_sizes, size);
  const int64_t received = checked_sum("output_split_sizes", output_split_sizes, size);
  TORCH_CHECK_VALUE(
      sent == input.numel(), "torchpm._all_to_all: `input_split_sizes` ",
      format_list(input_split_sizes, "[", "]"), " sum to ", sent, " but `input` has ", input.numel(),
      " elements.");

  auto in = input.contiguous();
  auto out = at::empty({received}, in.options());
  std::vector<int64_t> in_splits(input_split_sizes.begin(), input_split_sizes.end());
  std::vector<int64_t> out_splits(output_split_sizes.begin(), output_split_sizes.end());
  // Gloo and NCCL move real words; a complex element is two of them.
  at::Tensor send = in, recv = out;
  if (in.is_complex()) {
    send = at::view_as_real(in).reshape({-1});
    recv = at::view_as_real(out).reshape({-1});
    for (auto& s : in_splits) s *= 2;
    for (auto& s : out_splits) s *= 2;
  }
  try {
    auto work = all_to_all_single(*group, recv, send, out_splits, in_splits);
    work->wait();
  } catch (const std::exception& error) {
    std::ostringstream msg;
    msg << "torchpm._all_to_all over process group '" << name << "' (" << group->getBackendName()
        << ", rank " << group->getRank() << " of " << size << ") failed: " << error.what()
        << "\nA peer rank probably raised, exited or did not reach this collective. The wait "
           "is bounded by the process group's timeout: set it with "
           "torch.distributed.init_process_group(..., timeout=datetime.timedelta(seconds=S)) "
           "or new_group(..., timeout=...).";
    throw c10::DistBackendError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg.str());
  }
  return out;
}

}  // namespace

// CompositeExplicitAutograd: one kernel for every device (c10d dispatches on the
// tensors' device), below autograd (torchpm/distributed/_ops.py registers the
// backward, the reverse all-to-all).
TORCH_LIBRARY_IMPL(torchpm, CompositeExplicitAutograd, m) {
  m.impl("_all_to_all", &all_to_all);
}

}  // namespace torchpm
