"""``torch.func.vmap`` rules for the mass-assignment and finite-difference ops.

Their tensors lead with an independent batch dimension ``B``, so a vmapped dimension of
size ``V`` folds into it: one call on ``V * B`` members instead of ``V`` calls (torch's
fallback, which warns). This is what ``torch.func.jacrev`` runs in its pull-back, and
what ``vmap`` over per-sample calls of the ops runs. An input without the vmapped
dimension is repeated for every ``V``; a vmapped argument that does not lead with ``B``
(the finite-difference scale) runs the op once per ``V``.
"""

from __future__ import annotations

import os

import torch

# op name -> positions of its tensor arguments that lead with the batch dimension
_BATCHED = {
    "paint": (0, 1),
    "_paint_tiled": (0, 1),
    "_paint_deterministic": (0, 1),
    "readout": (0, 1),
    "_position_gradient": (0, 1, 2),
    "_readout_and_position_gradient": (0, 1, 2),
    "_fd4_gradient": (0,),
    "_fd4_gradient_transpose": (0,),
}


def _fold(tensor, dim, size):
    """``tensor`` with its vmapped dimension ``dim`` (None: none, repeated ``size`` times)
    merged into its leading batch dimension, ``(size * B, ...)``."""
    if dim is None:
        tensor = tensor.unsqueeze(0).expand(size, *tensor.shape)
    else:
        tensor = tensor.movedim(dim, 0)
    return tensor.reshape(size * tensor.shape[1], *tensor.shape[2:])


def _unfold(output, size):
    return output.reshape(size, output.shape[0] // size, *output.shape[1:])


def _rule(op, batched):
    def rule(info, in_dims, *args):
        size = info.batch_size
        # (a non-tensor argument's entry is None, or a tuple of Nones for a list)
        in_dims = [dim if isinstance(dim, int) else None for dim in in_dims]
        if any(dim is not None and i not in batched for i, dim in enumerate(in_dims)):
            results = [
                op(*[a.select(dim, v) if dim is not None else a for a, dim in zip(args, in_dims)]) for v in range(size)
            ]
            if isinstance(results[0], tuple):
                return tuple(torch.stack(parts) for parts in zip(*results)), (0,) * len(results[0])
            return torch.stack(results), 0
        args = [
            _fold(a, dim, size) if i in batched and isinstance(a, torch.Tensor) else a
            for i, (a, dim) in enumerate(zip(args, in_dims))
        ]
        result = op(*args)
        if isinstance(result, tuple):
            return tuple(_unfold(r, size) for r in result), (0,) * len(result)
        return _unfold(result, size), 0

    return rule


def register() -> None:
    """Registers the rules (``TORCHPM_VMAP_RULES=0`` at import leaves torch's row-by-row
    fallback, for ``benchmarks/bench_jacrev.py``'s comparison)."""
    if not hasattr(torch.library, "register_vmap") or os.environ.get("TORCHPM_VMAP_RULES", "1") == "0":
        return
    for name, batched in _BATCHED.items():
        op = getattr(torch.ops.torchpm, name).default
        torch.library.register_vmap(f"torchpm::{name}", _rule(op, batched))
