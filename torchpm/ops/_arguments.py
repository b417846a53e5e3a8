"""Argument checks of the mass-assignment ops, shared by the public functions.

Each check names the argument, shows the value and says what was expected:
``TypeError`` for a value of the wrong kind (a string where bools are
expected, a float where an integer is), ``ValueError`` for the right kind
with a wrong value (wrong length, out of range).
"""

from __future__ import annotations

import operator

import numpy as np
import torch

ORDERS = {"ngp": 1, "cic": 2, "tsc": 3, "pcs": 4}
ORDER_NAMES = {v: k for k, v in ORDERS.items()}
MAX_AXIS = 2**31 - 1


def order_number(order, op: str, name: str = "order") -> int:
    """``"ngp"|"cic"|"tsc"|"pcs"`` (or 1..4) -> the stencil width 1..4."""
    expected = f"{op}: `{name}` must be one of {tuple(ORDERS)} (or 1..4), got {order!r}"
    if isinstance(order, str):
        key = order.lower()
        if key in ORDERS:
            return ORDERS[key]
        raise ValueError(expected)
    if isinstance(order, (bool, np.bool_)) or not isinstance(order, (int, np.integer)):
        raise TypeError(expected)
    if not 1 <= int(order) <= 4:
        raise ValueError(expected)
    return int(order)


def _integer(value, name, op, what):
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: `{name}` must be {what}, got the bool {value!r}")
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() and not value.is_complex():
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{op}: `{name}` must be {what}, got {value!r} ({type(value).__name__}); "
            "non-integer values are not rounded"
        ) from None


def _three(value, name, op, what):
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
        raise TypeError(f"{op}: `{name}` must be {what}, got {value!r} ({type(value).__name__})")
    items = list(value)
    if len(items) != 3:
        raise ValueError(f"{op}: `{name}` must have 3 entries, got {value!r}")
    return items


def shape_argument(shape, op: str) -> list[int]:
    """3 positive integers below 2^31."""
    if shape is None:
        raise ValueError(f"{op}: `shape` (nx, ny, nz) of the mesh is required")
    what = "3 positive integers (nx, ny, nz)"
    items = [_integer(s, "shape", op, what) for s in _three(shape, "shape", op, what)]
    if any(s <= 0 for s in items):
        raise ValueError(f"{op}: `shape` must be {what}, got {tuple(items)!r}")
    if any(s > MAX_AXIS for s in items):
        raise ValueError(f"{op}: every entry of `shape` must be below 2^31, got {tuple(items)!r}")
    return items


def offset_argument(offset, op: str) -> list[int]:
    """None (0, 0, 0) or 3 integers (global index of the local node (0, 0, 0))."""
    if offset is None:
        return [0, 0, 0]
    what = "None or 3 integers (the global index of the local node (0, 0, 0))"
    items = [_integer(o, "offset", op, what) for o in _three(offset, "offset", op, what)]
    if any(abs(o) >= 2**40 for o in items):
        raise ValueError(f"{op}: `offset` {tuple(items)!r} is out of range (|offset| < 2^40)")
    return items


def periodic_argument(periodic, op: str) -> list[bool]:
    """A bool (all axes) or 3 bools; nothing else is read as a truth value."""
    what = "a bool or 3 bools"
    if isinstance(periodic, (bool, np.bool_)):
        return [bool(periodic)] * 3
    items = _three(periodic, "periodic", op, what)
    if not all(isinstance(p, (bool, np.bool_)) for p in items):
        raise TypeError(f"{op}: `periodic` must be {what}, got {periodic!r}")
    return [bool(p) for p in items]


def tensor_argument(value, name: str, op: str, optional: bool = False):
    """A torch.Tensor (numpy arrays and lists are not converted: the dtype and
    device would be guessed)."""
    if value is None and optional:
        return None
    if not isinstance(value, torch.Tensor):
        hint = " (convert with torch.as_tensor(..., dtype=..., device=...))" if isinstance(value, (np.ndarray, list, tuple)) else ""
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(value).__name__}{hint}")
    return value


def bool_argument(value, name: str, op: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: `{name}` must be a bool, got {value!r}")
    return bool(value)


# The checks of the C++ ops' arguments (csrc/checks.cpp), with their messages, for the
# ops whose CUDA kernel is a pure-torch composition (migration holes, spatial order,
# row permutations): on a GPU they fail as they do on the CPU instead of with an
# indexing error, a broadcast or a device-side assert.

def format_list(values) -> str:
    """A list as the C++ ``format_list`` writes it: ``(a, b)``."""
    return "(" + ", ".join(str(int(value)) for value in values) + ")"


def _dims(tensor: torch.Tensor) -> str:
    return format_list(tensor.shape)


def _scalar_type(dtype: torch.dtype) -> str:
    names = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float", torch.float64: "Double",
             torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
             torch.bool: "Bool"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def particle_positions(op: str, positions: torch.Tensor) -> None:
    """``positions`` ``(B, N, 3)`` float32/float64 (the C++ ``check_positions``)."""
    if positions.dim() != 3 or positions.shape[2] != 3:
        raise ValueError(f"{op}: expected `positions` of shape (B, N, 3), got {_dims(positions)}.")
    if positions.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: expected `positions` to be float32 or float64, got {_scalar_type(positions.dtype)}.")


def particle_ids(op: str, ids: torch.Tensor, positions: torch.Tensor) -> None:
    """``ids`` int64 ``(B, N)`` like ``positions`` (the C++ ``check_particle_ids``)."""
    if ids.dtype != torch.int64 or ids.dim() != 2 or tuple(ids.shape) != tuple(positions.shape[:2]):
        raise ValueError(f"{op}: expected int64 `ids` of shape ({positions.shape[0]}, {positions.shape[1]}) like "
                         f"`positions`, got {_scalar_type(ids.dtype)} {_dims(ids)}.")


def row_permutation(op: str, input: torch.Tensor, order: torch.Tensor) -> None:
    """An int64 ``(B, N)`` ``order`` of slots in ``[0, N)`` for a ``(B, N, ...)`` ``input``
    (the C++ ``as_rows`` and ``move_rows``). The range check reads the device: one host
    synchronisation per call on a GPU (a sort's few permutations), skipped while a CUDA
    graph is captured (the orders torchpm makes there are permutations by construction)."""
    if order.dtype != torch.int64 or order.dim() != 2:
        raise ValueError(f"{op}: expected an int64 `order` of shape (B, N), got {_scalar_type(order.dtype)} "
                         f"{_dims(order)}.")
    if input.dim() < 2 or tuple(input.shape[:2]) != tuple(order.shape):
        raise ValueError(f"{op}: expected `input` of shape (B, N, ...) with (B, N) = {_dims(order)} from `order`, "
                         f"got {_dims(input)}.")
    n = order.shape[1]
    if order.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # the range check reads the device, which a CUDA graph capture forbids
    bad = torch.nonzero(((order < 0) | (order >= n)).reshape(-1))
    if bad.numel():
        at = int(bad[0])
        raise ValueError(f"{op}: `order` must hold slots in [0, {n}), got {int(order.reshape(-1)[at])} at flat "
                         f"position {at}.")
