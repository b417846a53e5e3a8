"""Process groups of a ``(P0, P1)`` grid, reductions over the whole grid, and failing together.

World rank ``r0 * P1 + r1`` has grid coordinates ``(r0, r1)``. Grid axis 0 is the
group of ranks that share ``r1`` (they split x), grid axis 1 the group that shares
``r0`` (they split y). An axis of size 1 has no group and never communicates, so
a 1 x 1 grid needs no ``torch.distributed`` at all.

Every function here that communicates is collective over the grid: all ranks
call it in the same order.
"""

from __future__ import annotations

import datetime
import functools
import importlib.abc
import operator
import os
import sys
import threading
import zlib
from typing import Sequence

import torch

from .._transforms import outside_transforms, plain

__all__ = ["process_grid_groups", "GridAxis", "GridGroups", "WorldGroup", "agreement_checks"]

# Length of the descriptor every rank sends before a collective (see GridGroups.agree):
# fixed, so that ranks calling different operations still run a matching all-reduce.
AGREEMENT_SLOTS = 16


def _untraced(function, reason):
    """``function`` under ``torch.compiler.disable`` (which imports ``torch._dynamo``)."""
    try:
        return torch.compiler.disable(function, reason=reason)
    except TypeError:  # torch < 2.8 has no reason=
        return torch.compiler.disable(function)


# The functions `eager` wrapped before torch._dynamo was imported, each with a one-element
# list that holds what a call runs: the function itself until then, then its
# torch.compiler.disable twin (made by `_dynamo_imported`, which empties the list).
_EAGER: list[tuple[object, str, list]] = []
_LOCK = threading.Lock()


def _dynamo_imported() -> None:
    """Give every function `eager` wrapped its ``torch.compiler.disable`` twin (once).
    The twins are made outside the lock: making one imports Dynamo, which may wait for
    another thread's import of it, which ends by calling this."""
    with _LOCK:
        waiting = list(_EAGER)
        _EAGER.clear()
    for function, reason, runs in waiting:
        if runs[0] is function:
            runs[0] = _untraced(function, reason)


class _TwinsAfter(importlib.abc.Loader):
    """The loader Python's finders chose for ``torch._dynamo``, and `_dynamo_imported` once
    its code has run. The module keeps the real loader (introspection, reloads)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _dynamo_imported()
        if _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """Hands the import of ``torch._dynamo`` to the loader the other finders choose, with
    `_dynamo_imported` after it (`_TwinsAfter`).

    ``torch.compiler.disable`` imports all of Dynamo (about 2.5 s, more than ``import
    torch``), so applying it at import would cost every process that imports torchpm,
    most of which never compile. Nothing can trace a function before Dynamo is imported,
    so the twins are made right after that import, before any tracing. A lookup that
    imports nothing (``importlib.util.find_spec``) leaves no state behind; an import this
    finder does not see (a finder put before it later) is caught by the first call of a
    wrapped function (see `eager`)."""

    def __init__(self):
        self.busy = threading.local()

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo" or getattr(self.busy, "value", False):
            return None
        self.busy.value = True  # (a finder below that asks importlib again gets None here)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _TwinsAfter(spec.loader)
                    return spec
            return None
        finally:
            self.busy.value = False


_FINDER = _AfterDynamo()
if "torch._dynamo" not in sys.modules:
    sys.meta_path.insert(0, _FINDER)


def eager(function=None, *, local=None):
    """Run ``function`` outside ``torch.compile``'s graphs: it talks to process groups,
    which Dynamo cannot trace, so a compiled function that calls it breaks its graph
    there and runs it eagerly (with ``fullgraph=True`` torch refuses it). Autograd
    records it as in eager mode.

    ``local(*args, **kwargs)``, given the call's arguments (``self`` first for a method),
    says when a call talks to no process group (a 1 x 1 grid): such a call is traced like
    any other code, so one device keeps ``fullgraph=True``.

    The ``torch.compiler.disable`` twin is made when ``torch._dynamo`` is imported (see
    `_AfterDynamo`), not when torchpm is; what the decorator returns is a plain wrapper
    that calls it (Dynamo steps into the wrapper and breaks its graph at the twin).
    """
    def wrap(function):
        reason = (f"torchpm's {function.__qualname__} talks to process groups, which torch.compile cannot "
                  "trace: it runs eagerly between graphs, so compile without fullgraph=True")
        runs = [function]
        with _LOCK:
            waiting = "torch._dynamo" not in sys.modules
            if waiting:
                _EAGER.append((function, reason, runs))
        if not waiting:
            runs[0] = _untraced(function, reason)

        @functools.wraps(function)
        def call(*args, **kwargs):
            if local is not None and local(*args, **kwargs):
                return function(*args, **kwargs)
            if runs[0] is function and "torch._dynamo" in sys.modules:
                _dynamo_imported()  # Dynamo was imported past `_AfterDynamo`
            return runs[0](*args, **kwargs)

        return call

    return wrap if function is None else wrap(function)


def agreement_checks() -> bool:
    """Whether decompositions built from now on check, before every collective, that the
    ranks agree on the call (``TORCHPM_CHECK_AGREEMENT``, default on; ``0`` turns it off,
    for benchmarks only). Read when a :class:`PencilDecomposition` is built, whose ranks
    then agree on it."""
    value = os.environ.get("TORCHPM_CHECK_AGREEMENT", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def _encode(value) -> list[int]:
    """A value of an agreement descriptor as integers: ints as themselves, tuples of ints
    with their length first, anything else (dtypes, strings) by a CRC-32 of its text,
    which is the same in every process."""
    if isinstance(value, bool):
        return [int(value)]
    if isinstance(value, int) and _INT64_MIN <= value <= _INT64_MAX:
        return [value]
    if isinstance(value, (tuple, list)) and all(
            isinstance(v, int) and not isinstance(v, bool) and _INT64_MIN <= v <= _INT64_MAX for v in value):
        return [len(value), *value]
    # (integers beyond int64 too: the descriptor is an int64 vector)
    return [zlib.crc32(str(value).encode())]


_INT64_MIN, _INT64_MAX = -(2**63) + 1, 2**63 - 1  # (each value is negated too)


@eager
def process_grid_groups(
    grid: Sequence[int],
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
):
    """Create the two process groups of a ``(P0, P1)`` grid over the default world.

    Every rank of the world must call this with the same arguments (``new_group`` is
    collective). Returns ``(group_axis0, group_axis1)`` for the calling rank; an axis
    of size 1 gets ``None`` (no communication along it). The groups are made once per
    world and arguments: a later call with the same arguments returns them again (a
    ``Simulation`` built per sample in a loop does not open new connections each time),
    until ``destroy_process_group`` ends the world.

    Args:
        grid: ``(P0, P1)`` with ``P0 * P1 == world size``.
        backend: passed to ``new_group`` (default: the world's backend).
        timeout: bound on every collective of these groups (default: the world's, as
            given to ``init_process_group``; ``new_group`` alone would take torch's
            default of 10 or 30 minutes).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "process_grid_groups: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (or build a PencilDecomposition "
            "without groups for a single process)"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    error, p0, p1 = None, 0, 0
    try:
        items = tuple(grid)
        if len(items) != 2 or any(isinstance(p, bool) for p in items):
            raise TypeError
        p0, p1 = (operator.index(p) for p in items)
    except (TypeError, ValueError):
        error = f"process_grid_groups: `grid` must be 2 positive integers (P0, P1), got {grid!r}"
    if error is None and (p0 < 1 or p1 < 1 or p0 * p1 != world):
        error = f"`grid` {tuple(grid)} must be 2 positive integers whose product is the world size {world}"
    if timeout is None:
        timeout = _world_timeout()
    # new_group is collective over the world: every rank must make the same groups in the
    # same order (a rank with another grid, or one that raises here alone, would leave the
    # others waiting in the store until its timeout). A rank's own timeout may differ.
    WorldGroup().agree("process_grid_groups", [("`grid`", (p0, p1)), ("`backend`", str(backend))], error)
    key = (p0, p1, backend, timeout)
    cached = _GRID_GROUPS.get(key)
    if cached is not None and all(_alive(g) for g in cached):
        return cached
    try:
        group0, group1 = _new_grid_groups(p0, p1, rank, {"backend": backend, "timeout": timeout})
    except RuntimeError as failure:  # most often the store's timeout: a rank that did not build it
        raise type(failure)(
            f"process_grid_groups: making the {p0} x {p1} grid's process groups failed: every rank of the world "
            "must build the grid (Simulation(grid=...), process_grid_groups) at the same point, each group in "
            f"the same order. ({failure})"
        ) from failure
    _GRID_GROUPS[key] = (group0, group1)
    return group0, group1


def _new_grid_groups(p0: int, p1: int, rank: int, kwargs: dict):
    """The ``new_group`` calls of :func:`process_grid_groups` (every rank makes every group)."""
    import torch.distributed as dist

    r0, r1 = divmod(rank, p1)
    group0 = group1 = None
    if p0 > 1:
        for column in range(p1):
            g = dist.new_group([row * p1 + column for row in range(p0)], **kwargs)
            if column == r1:
                group0 = g
    if p1 > 1:
        for row in range(p0):
            g = dist.new_group([row * p1 + column for column in range(p1)], **kwargs)
            if row == r0:
                group1 = g
    return group0, group1


def _control_device(groups) -> torch.device:
    """Where the small tensors of the grid's own reductions (agreement descriptors, counts,
    flags) go: the CPU when every group has a CPU backend (gloo, MPI, or a world made with
    ``"cpu:gloo,cuda:nccl"``), else the current device of the groups' device type (a
    world made with ``"nccl"`` alone, which cannot reduce a CPU tensor)."""
    for group in groups:
        types = list(getattr(group, "_device_types", None) or [])
        if types and torch.device("cpu") not in types:
            kind = types[0].type
            module = getattr(torch, kind, None)
            index = module.current_device() if module is not None and hasattr(module, "current_device") else None
            return torch.device(kind, index)
    return torch.device("cpu")


def _to_control(tensor: torch.Tensor, groups) -> torch.Tensor:
    """``tensor`` where ``groups`` can reduce it: a CPU tensor moves to the current GPU when
    they have no CPU backend (NCCL alone); anything else stays."""
    if tensor.device.type != "cpu":
        return tensor
    return tensor.to(_control_device(groups))


# The groups process_grid_groups made, by (P0, P1, backend, timeout).
_GRID_GROUPS: dict = {}


def _alive(group) -> bool:
    """Whether ``group`` (None: an axis without one) still belongs to the world (not
    ended by ``destroy_process_group``)."""
    if group is None:
        return True
    from torch.distributed import distributed_c10d

    try:
        return group in distributed_c10d._world.pg_map
    except AttributeError:  # a torch without the registry: make new groups, as before
        return False


def _world_timeout() -> datetime.timedelta | None:
    """The timeout the world's group was created with, or None where torch does not say."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


class GridAxis:
    """One axis of the process grid: its group (None for size 1), size, our rank in it, and its name."""

    @eager(local=lambda self, group, axis: group is None)
    def __init__(self, group, axis):
        self.group = group
        if group is None:
            self.size, self.rank, self.name = 1, 0, None
        else:
            import torch.distributed as dist

            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            self.name = group.group_name
            if self.rank < 0:
                raise ValueError(f"PencilDecomposition: this process is not a member of the group of grid axis {axis}")


def _reduced(tensor: torch.Tensor, groups, op=None) -> torch.Tensor:
    """A new tensor, on ``tensor``'s device: every rank's ``tensor`` reduced over ``groups``
    (``op`` a ``ReduceOp``, default the sum). Its values only, no derivative (the callers
    give one where there is): computed on plain tensors outside torch.func transforms."""
    import torch.distributed as dist

    with outside_transforms():
        result = _to_control(plain(tensor).detach().clone().contiguous(), groups)
        for group in groups:
            dist.all_reduce(result, op=dist.ReduceOp.SUM if op is None else op, group=group)
        return result.to(tensor.device)


class _SumOverGrid(torch.autograd.Function):
    """Sum of every rank's tensor, on every rank. Backward: identity.

    The convention for a *replicated* result: every rank goes on to compute the
    same scalar from it and calls backward, and the gradient wanted is that of
    this one scalar, so each rank's input receives the upstream gradient as is.
    """

    @staticmethod
    def forward(tensor, groups):
        return _reduced(tensor, groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None

    @staticmethod
    def vmap(info, in_dims, tensor, groups):
        # elementwise over the ranks: a vmapped dimension is summed as any other
        return _SumOverGrid.apply(tensor, groups), in_dims[0]


class _ReplicatedInput(torch.autograd.Function):
    """Identity whose backward sums the gradient over the grid.

    For a tensor that every rank holds the same copy of (a cosmological parameter, a
    network weight) and uses in its own part of a distributed computation: each rank's
    backward yields only its part's contribution, and the sum is the gradient of the
    whole computation, which every rank then holds.
    """

    @staticmethod
    def forward(tensor, groups):
        return tensor.view_as(tensor)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.groups = inputs[1]

    @staticmethod
    def vmap(info, in_dims, tensor, groups):
        return _ReplicatedInput.apply(tensor, groups), in_dims[0]

    @staticmethod
    def backward(ctx, grad):
        # the sum as a function of its own: differentiable again (second derivatives), and
        # run on plain tensors under torch.func transforms
        return _SumOverGrid.apply(grad, ctx.groups), None


def all_gather_grid(tensor: torch.Tensor, groups, dim: int) -> torch.Tensor:
    """Every rank's ``tensor`` (the same shape on every rank) concatenated along ``dim``
    in rank order, on every rank: an all-gather over the grid's axis-1 group, then over
    its axis-0 group (``groups``: a mesh's ``(axis-0 group, axis-1 group)``, None for an
    axis of one rank). Not differentiable."""
    import torch.distributed as dist

    for axis in (1, 0):
        group = groups[axis]
        if group is None:
            continue
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        tensor = torch.cat(parts, dim=dim)
    return tensor


def _is_replicated_input(node) -> bool:
    """Whether an autograd node is :class:`_ReplicatedInput`'s (under a torch.func
    transform, that of the function torch generates from it for the transform's level)."""
    return isinstance(node, _ReplicatedInput._backward_cls) or type(node).__name__ == "_ReplicatedInputGeneratedBackward"


def unsummed_leaves(tensor, stop: Sequence[torch.Tensor] = ()) -> list:
    """The tensors requiring grad that ``tensor``'s autograd graph reaches other than through
    :meth:`GridGroups.replicate` (its inputs' gradients are summed over the grid) or one of
    the ``stop`` tensors (known inputs, e.g. the parameters an adjoint differentiates by):
    on a grid, a gradient that reaches them holds only this rank's share of the run. Empty
    for a tensor that needs no gradient."""
    if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
        return []
    if any(tensor is t for t in stop):
        return []
    if tensor.grad_fn is None:
        return [tensor]
    stop_nodes = {t.grad_fn for t in stop if t.grad_fn is not None}
    stop_leaves = {id(t) for t in stop if t.grad_fn is None}
    found, seen, stack = [], set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if _is_replicated_input(node) or node in stop_nodes:
            continue
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if isinstance(variable, torch.Tensor):
            if id(variable) not in stop_leaves:
                found.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _single_rank(grid, *args, **kwargs) -> bool:
    """No process group at all (the 1 x 1 grid of one device)."""
    return not grid._groups()


class GridGroups:
    """The two axes of a process grid and the grid-wide operations built on them."""

    def __init__(self, groups):
        self.axes = (GridAxis(groups[0], 0), GridAxis(groups[1], 1))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.axes[0].size, self.axes[1].size)

    @property
    def coords(self) -> tuple[int, int]:
        return (self.axes[0].rank, self.axes[1].rank)

    @property
    def size(self) -> int:
        return self.axes[0].size * self.axes[1].size

    @property
    def rank(self) -> int:
        """This rank's index on the grid, ``r0 * P1 + r1``."""
        return self.axes[0].rank * self.axes[1].size + self.axes[1].rank

    def _groups(self):
        return [axis.group for axis in self.axes if axis.group is not None]

    @eager(local=_single_rank)
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over every rank of the grid; every rank gets the result.

        ``op``: ``"sum"`` (differentiable, with the replicated-result convention of
        :class:`_SumOverGrid`), ``"max"`` or ``"min"`` (not differentiable). A 1 x 1 grid
        returns the tensor unchanged.
        """
        groups = self._groups()
        if not groups:
            return tensor
        if op == "sum":
            return _SumOverGrid.apply(tensor, groups)
        import torch.distributed as dist

        reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op)
        if reduce_op is None:
            raise ValueError(f"all_reduce: `op` must be 'sum', 'max' or 'min', got {op!r}")
        return _reduced(tensor, groups, reduce_op)

    @eager(local=_single_rank)
    def replicate(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` for use in a distributed computation when every rank holds the same
        copy: the identity, whose backward sums the gradient over the grid, so every rank
        receives the full gradient (see :class:`_ReplicatedInput`). Identity on a 1 x 1 grid."""
        groups = self._groups()
        if not groups or not tensor.requires_grad:
            return tensor
        return _ReplicatedInput.apply(tensor, groups)

    @eager(local=_single_rank)
    def all_gather_counts(self, values: Sequence[int], device=None) -> torch.Tensor:
        """``(grid size, len(values))`` int64: every rank's ``values``, row ``r0 * P1 + r1``
        (on ``device``; by default where the groups can reduce it: the CPU, or the current
        GPU when they have no CPU backend, as with NCCL alone)."""
        if device is None:
            device = _control_device(self._groups())
        table = torch.zeros(self.size, len(values), dtype=torch.int64, device=device)
        table[self.rank] = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
        return self.all_reduce(table, "sum")

    @eager(local=_single_rank)
    def _gather_objects(self, items: list) -> list:
        """Every rank's list ``items`` concatenated, on every rank (one ``all_gather_object``
        per grid axis; for the rare failure path only)."""
        import torch.distributed as dist

        with outside_transforms():  # its byte tensors made plain under torch.func transforms
            for group in self._groups():
                parts = [None] * dist.get_world_size(group)
                dist.all_gather_object(parts, items, group=group)
                items = [item for part in parts for item in part]
        return items

    @eager(local=_single_rank)
    def agree(self, operation: str, values: Sequence[tuple[str, object]], error: str | BaseException | None = None,
              exception=ValueError, *, device=None, _together: bool = False) -> None:
        """Check that every rank of the grid calls ``operation`` with the same ``values``,
        before a collective whose message sizes depend on them.

        ``values``: ``(name, value)`` pairs (ints, tuples of ints, dtypes, strings), the
        same names in the same order on every rank for one ``operation``. ``error``: this
        rank's own argument error (a message or the exception), if any, so that a rank
        with a bad argument makes the others raise instead of leaving them waiting in the
        collective.

        One all-reduce (max) of a fixed-length int64 vector ``[d, -d]``, ``d`` the encoded
        descriptor: the ranks agree when max equals min everywhere. Otherwise the ranks
        exchange their descriptors and every rank raises ``exception`` (``TypeError`` or
        ``SettingError`` if every failing rank's own error was one) naming each disagreeing value and each
        rank's value. A 1 x 1 grid only raises its own ``error``.
        """
        if not self._groups():
            if isinstance(error, BaseException):
                raise error
            if error:
                raise exception(error)
            return
        descriptor = _encode(operation) + [1 if error else 0]
        for _, value in values:
            descriptor += _encode(value)
        if len(descriptor) > AGREEMENT_SLOTS:
            # Fold the tail into one checksum: same length on every rank, whatever it carries.
            tail = descriptor[AGREEMENT_SLOTS - 1 :]
            descriptor = descriptor[: AGREEMENT_SLOTS - 1] + [zlib.crc32(repr(tail).encode())]
        descriptor += [0] * (AGREEMENT_SLOTS - len(descriptor))
        if device is None:
            device = _control_device(self._groups())
        both = torch.tensor(descriptor + [-d for d in descriptor], dtype=torch.int64, device=device)
        try:
            reduced = self.all_reduce(both, "max").tolist()
        except RuntimeError as failure:
            # Most often the group's timeout: another rank failed or never called this.
            import torch.distributed as dist

            raise dist.DistBackendError(
                f"{operation}: the agreement check before the collective failed (gloo/NCCL timeout or a lost "
                f"peer: another rank raised, died or never called {operation}): {failure}"
            ) from failure
        if reduced[:AGREEMENT_SLOTS] == [-d for d in reduced[AGREEMENT_SLOTS:]] and reduced[1] == 0:
            return
        self._raise_disagreement(operation, values, error, exception, together=_together)

    def _raise_disagreement(self, operation, values, error, exception, together=False):
        kind = type(error).__name__ if isinstance(error, BaseException) else exception.__name__
        mine = (self.rank, operation, [(name, str(value)) for name, value in values], str(error) if error else None,
                kind, together)
        reports = sorted(self._gather_objects([mine]))
        where = self._where
        parts = []
        failures = [(report[0], report[3], report[4]) for report in reports if report[3]]
        # The ranks' own errors first: a failing rank's other values may be placeholders.
        # (ranks that raise the same message share one mention)
        by_message: dict = {}
        for rank, message, _ in failures:
            by_message.setdefault(message, []).append(rank)
        parts += [f"{', '.join(where(rank) for rank in ranks)}: {message}" for message, ranks in by_message.items()]
        operations = {report[1] for report in reports}
        if len(operations) > 1:
            calls = ", ".join(f"{where(report[0])}: {report[1]}" for report in reports)
            parts.append(f"the ranks called different collective operations ({calls}); every rank must call the "
                         "same operations in the same order")
        else:
            # (compared among the ranks without an error of their own: a failing rank's
            # values are placeholders)
            compared = [report for report in reports if not report[3]]
            # (the names every rank passed: a value that decides which others follow, such
            # as a run's input, is named alone)
            names = [name for name, _ in (compared or reports)[0][2]
                     if all(name in dict(report[2]) for report in compared)]
            for name in names:
                seen = [dict(report[2]).get(name) for report in compared]
                if len(set(seen)) > 1:
                    ranks = ", ".join(f"{where(report[0])}: {value}" for report, value in zip(compared, seen))
                    parts.append(f"the ranks disagree on {name} ({ranks})")
            if len(parts) > len(by_message):
                parts[-1] += "; every rank must pass the same values"
        kinds = {kind for _, _, kind in failures}
        if len(kinds) == 1 and kinds <= {"TypeError", "SettingError"}:
            # (a SettingError, the settings' own ValueError and TypeError, stays one for
            # callers that catch either)
            from ..config import SettingError

            exception = {"TypeError": TypeError, "SettingError": SettingError}[kinds.pop()]
        text = "; ".join(parts) or "the ranks' descriptors differ"
        # (a check raised together names no operation when every rank is in it: the same
        # text on every rank)
        prefix = "" if len(operations) == 1 and all(report[5] for report in reports) else f"{operation}: "
        error = exception(f"{prefix}{text} [every rank of {self._scope()} raises this error together]")
        error.raised_together = True  # (a caller's follow-up check must not wait for ranks that raised too)
        raise error

    def _where(self, rank: int) -> str:
        return f"rank {rank} (grid {divmod(rank, self.shape[1])})"

    def _scope(self) -> str:
        p0, p1 = self.shape
        return f"the {p0} x {p1} grid"

    @eager(local=_single_rank)
    def raise_together(self, error: str | BaseException | None, exception=ValueError, *, device=None,
                       operation: str = "a check raised together") -> None:
        """Raise ``exception`` on every rank when any rank passes a non-empty ``error`` (a
        message, or an exception whose type is kept: ``TypeError`` or ``SettingError``
        when every failing rank's was one).

        Collective: each rank reports whether it failed, in the fixed-length descriptor
        all-reduce of :meth:`agree` (with no values), so a rank whose input is bad cannot
        leave the others waiting in a collective, and a rank in another collective's check
        meets a matching message (an error naming both calls, not a gloo abort). On
        failure the ranks exchange their messages, and every rank raises with all of
        them, each naming its rank.
        """
        if not self._groups():
            if isinstance(error, BaseException):
                raise error
            if error:
                raise exception(error)
            return
        self.agree(operation, [], error, exception, device=device, _together=True)


class WorldGroup(GridGroups):
    """Every process of the default world as one axis: the checks of :class:`GridGroups`
    (``agree``, ``raise_together``) before a process grid's own groups exist, as when a
    ``Simulation(grid=...)`` checks its arguments (``new_group`` is collective over the
    world). Ranks are the world's."""

    def __init__(self):
        import torch.distributed as dist

        world = dist.group.WORLD
        super().__init__((world if dist.get_world_size() > 1 else None, None))

    def _where(self, rank: int) -> str:
        return f"rank {rank}"

    def _scope(self) -> str:
        return f"the world ({self.size} processes)"
