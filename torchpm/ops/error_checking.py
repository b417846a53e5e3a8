"""When the mass-assignment ops report bad particles: inside the call, or later.

A bad particle is one whose position is non-finite or outside the mesh block (it
cannot be deposited or read), or, with ``check_finite=True``, whose weights (paint) or
mesh values read (readout) are NaN or Inf. The kernels count them as they go; an
op never drops one silently. What differs is *when* the error is raised:

``"immediate"``
    The op raises before it returns. On CUDA that costs one small synchronising
    device-to-host copy per call: the host waits for the GPU, the launch queue
    drains, and the op cannot be captured in a CUDA graph.
``"deferred"``
    The op returns at once. Its count follows on the stream (an asynchronous copy
    to pinned host memory and an event); the error is raised by the next torchpm
    op whose event query finds the count complete (no synchronisation), or by
    :func:`check`, which waits for every pending count. The message names the op
    that found the bad particles, the argument (``positions``, ``weights``,
    ``mesh``) and, while the call's tensors are unchanged, the first bad particle.
    A call with bad particles returns NaN where they should have contributed
    (readout and position gradient: their entries; paint: node ``(0, 0, 0)`` of
    every channel of their batch's mesh), so a result used before the report
    cannot pass for a valid one.
``"auto"`` (default)
    Deferred on CUDA, immediate on the CPU. On the CPU the count is in host memory
    when the kernel returns, so raising at once costs nothing; on CUDA the
    per-call synchronisation would cost more than the kernels themselves at small
    sizes and would forbid ``torch.compile(mode="reduce-overhead")``.

The environment variable ``TORCHPM_ERROR_CHECKING`` (``auto``, ``immediate`` or
``deferred``) sets the mode at import; :func:`set_error_checking` changes it.

Inside CUDA graph capture nothing may synchronise or query an event, so captured
calls always defer: their kernels add to per-device counters, and the counts of
every replay are reported by the next torchpm op outside the graph or by
:func:`check`. Call :func:`check` after replaying a graph (once per step is
enough) when no torchpm op runs outside it. The first torchpm op on a device must
run outside capture (the warm-up ``torch.cuda.graph`` asks for anyway) to create
those counters.
"""

from __future__ import annotations

import torch

__all__ = ["check", "set_error_checking", "get_error_checking"]

MODES = ("auto", "immediate", "deferred")


def set_error_checking(mode: str) -> str:
    """Set when bad particles are reported: ``"auto"``, ``"immediate"`` or
    ``"deferred"`` (module docs). Returns the previous mode."""
    if not isinstance(mode, str):
        raise TypeError(f"set_error_checking: `mode` must be one of {MODES}, got {mode!r} ({type(mode).__name__})")
    return torch.ops.torchpm._set_error_checking(mode)


def get_error_checking() -> str:
    """The current mode: ``"auto"``, ``"immediate"`` or ``"deferred"``."""
    return torch.ops.torchpm._error_checking()


def check() -> None:
    """Wait for the particle checks of every earlier torchpm call (including the
    replays of captured CUDA graphs) and raise the first error (a ``ValueError``
    naming the op and the argument). Synchronises with every device torchpm used.
    Each error is raised once."""
    torch.ops.torchpm.check()
