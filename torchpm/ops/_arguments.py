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
