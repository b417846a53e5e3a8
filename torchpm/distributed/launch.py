"""Starting a run under ``torchrun``: the default process group, the device of this rank,
and collecting small results on rank 0.

``torchrun --nproc-per-node=N -m torchpm run cfg.toml`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the rendezvous variables; :func:`init_from_environment` then joins
the default process group with the backend that matches the device (NCCL for CUDA,
gloo for the CPU) and a bounded collective timeout, and gives each rank its GPU
(``cuda:LOCAL_RANK``). A plain single process (no ``WORLD_SIZE``, or 1) needs none of it.
"""

from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch

__all__ = ["RunContext", "init_from_environment", "finish", "gather_blocks", "nccl_failure_settings"]

# With these, a collective that a peer never joins makes NCCL's wait() block the host
# and raise after the process group's timeout, as gloo's does (README, "When a rank
# fails"). NCCL's default instead returns from wait() at once, stalls the stream,
# and lets its watchdog abort the whole process after the timeout.
_NCCL_BLOCKING_WAIT = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def nccl_failure_settings(environ=None) -> dict:
    """Make a failed NCCL collective raise like a gloo one: set ``TORCH_NCCL_BLOCKING_WAIT=1``
    in ``environ`` (default ``os.environ``) unless the user set it (or its older name
    ``NCCL_BLOCKING_WAIT``) already. Returns what it set.

    NCCL reads the variable when the process group is created, so this must run before
    ``torch.distributed.init_process_group``. With it, ``wait()`` on a collective blocks
    the host until the collective completes or the group's timeout expires, and then
    raises a ``DistBackendError`` on the ranks still alive (NCCL then skips its
    asynchronous error handling, which would abort the process). The cost is that the
    host waits for every collective, as it does with gloo; torchpm's collectives are
    followed by work that needs their result anyway. Set ``TORCH_NCCL_BLOCKING_WAIT=0``
    to keep NCCL's default instead.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _NCCL_BLOCKING_WAIT):
        return {}
    environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    return {"TORCH_NCCL_BLOCKING_WAIT": "1"}


class RunContext:
    """Where this process stands in a run: ``rank``, ``world_size``, ``device``, and
    whether :func:`init_from_environment` created the process group (then :func:`finish`
    destroys it)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, owns_group: bool):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.owns_group = owns_group

    @property
    def is_main(self) -> bool:
        """True on the rank that prints and writes (rank 0)."""
        return self.rank == 0

    def __repr__(self):
        return f"RunContext(rank={self.rank}, world_size={self.world_size}, device={self.device})"


def init_from_environment(device: str | torch.device = "cpu", timeout_s: float = 300.0) -> RunContext:
    """Join the default process group when launched by ``torchrun`` with several processes.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (a CUDA run uses ``cuda:LOCAL_RANK``, NCCL; a CPU
            run uses gloo).
        timeout_s: bound on every collective, in seconds: a rank that fails makes the
            others raise after at most this long instead of hanging. With NCCL that needs
            ``TORCH_NCCL_BLOCKING_WAIT=1``, set here unless the user set it
            (:func:`nccl_failure_settings`).
    """
    device = torch.device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size <= 1:
        return RunContext(0, 1, device, False)
    import torch.distributed as dist

    if not (timeout_s > 0):
        raise ValueError(f"`collective_timeout` must be a positive number of seconds, got {timeout_s!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("`device` is 'cuda' but no CUDA device is available to this process")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK {local_rank} has no GPU: this node has {torch.cuda.device_count()}; launch at most "
                "that many processes per node (torchrun --nproc-per-node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    owns = not dist.is_initialized()
    if owns:
        kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=float(timeout_s))}
        if backend == "nccl":
            kwargs["device_id"] = device
            nccl_failure_settings()
        dist.init_process_group(**kwargs)
    return RunContext(dist.get_rank(), dist.get_world_size(), device, owns)


def finish(context: RunContext) -> None:
    """Destroy the process group if :func:`init_from_environment` made it."""
    if context.owns_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class _Block(NamedTuple):
    offset: tuple
    values: object


def gather_blocks(block: torch.Tensor, offset, shape, mesh) -> torch.Tensor | None:
    """Assemble every rank's ``block`` (placed at ``offset`` in a tensor of ``shape``) on
    rank 0 of the grid; other ranks get None. For small results (a slice to plot)."""
    if mesh.is_local:
        return block
    import torch.distributed as dist

    item = _Block(tuple(int(o) for o in offset), block.detach().cpu())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, item)
    if dist.get_rank() != 0:
        return None
    whole = torch.zeros(shape, dtype=block.dtype)
    for part in parts:
        index = tuple(slice(o, o + n) for o, n in zip(part.offset, part.values.shape))
        whole[index] = part.values
    return whole
