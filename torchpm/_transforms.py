"""What torchpm needs to know about ``torch.func`` transforms.

Inside ``torch.func.grad``/``vjp``/``jacrev``, every tensor an op makes, constants
included, is wrapped for the transform's level, and a wrapper kept after the transform
returns has "escaped": using it under a later transform fails inside torch. The tables a
simulation caches (k-vectors, growth table, linear power) are built outside the
transforms, as the plain tensors they would be without one, when their inputs are plain.
"""

from __future__ import annotations

import contextlib

import torch

_functorch = getattr(torch._C, "_functorch", None)


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, vmap, ...) is running."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active and active())


def is_transformed(tensor) -> bool:
    """Whether ``tensor`` is a ``torch.func`` transform's wrapper (it carries a level's
    derivative or batch dimension)."""
    return (
        isinstance(tensor, torch.Tensor)
        and _functorch is not None
        and bool(_functorch.is_functorch_wrapped_tensor(tensor))
    )


@contextlib.contextmanager
def outside_transforms():
    """Runs its block as if no ``torch.func`` transform were active: the tensors it makes
    are plain (only for values that do not depend on a transformed tensor)."""
    if not transforms_active():
        yield
        return
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    with temporarily_clear_interpreter_stack():
        yield


def active_transforms() -> set[str]:
    """The kinds of the running ``torch.func`` transforms: ``"grad"`` (grad, vjp, jacrev),
    ``"vmap"``, ``"jvp"``, ``"functionalize"``."""
    if not transforms_active():
        return set()
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return {interpreter.key().name.lower() for interpreter in retrieve_all_functorch_interpreters()}


def is_vmapped(tensor) -> bool:
    """Whether ``tensor`` carries a ``torch.func.vmap`` batch dimension (at any level)."""
    while is_transformed(tensor):
        if _functorch.is_batchedtensor(tensor):
            return True
        tensor = _functorch.get_unwrapped(tensor)
    return False


def plain(tensor):
    """``tensor`` without its ``torch.func`` wrappers (its values; for control values,
    such as flags and counts, that carry no derivative)."""
    while is_transformed(tensor):
        tensor = _functorch.get_unwrapped(tensor)
    return tensor
