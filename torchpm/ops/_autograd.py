"""Autograd registration of torchpm's C++ ops, refusing forward-mode AD.

``torch.library.register_autograd`` gives an op a kernel that, when no input requires
grad, runs the op below autograd: a forward-mode tangent (a dual tensor of
``torch.autograd.forward_ad``, or ``torch.func.jvp``) is then dropped and the result
has a zero tangent, silently. These ops have reverse-mode formulas only, so the
kernel registered here raises instead when an input carries a tangent, then runs
torch's kernel. On a torch without the internals it builds on, the plain
``register_autograd`` is used (no forward-mode check).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad

_LIBRARY = torch.library.Library("torchpm", "IMPL")


def _has_tangent(value) -> bool:
    if isinstance(value, torch.Tensor):
        return _forward_ad.unpack_dual(value).tangent is not None
    if isinstance(value, (list, tuple)):
        return any(_has_tangent(v) for v in value)
    return False


def register_autograd(qualname: str, backward, *, setup_context) -> None:
    """``torch.library.register_autograd(qualname, backward, setup_context=...)``, with
    forward-mode AD refused by a ``NotImplementedError`` naming the op."""
    try:
        from torch._library.autograd import Info, make_autograd_impl
        from torch._library.utils import lookup_op

        inner = make_autograd_impl(lookup_op(qualname), Info(backward, setup_context))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - torch internals moved
        torch.library.register_autograd(qualname, backward, setup_context=setup_context)
        return

    def kernel(keyset, *args, **keyword_args):
        if getattr(_forward_ad, "_current_level", -1) >= 0 and _has_tangent(args):
            raise NotImplementedError(
                f"{qualname}: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad dual tensors) is "
                "not supported by torchpm's ops, which have reverse-mode derivatives only; use "
                "torch.autograd.grad / backward, or torch.autograd.functional.jvp for a Jacobian-vector "
                "product (it takes it by double backward)"
            )
        return inner(keyset, *args, **keyword_args)

    _LIBRARY.impl(qualname.split("::", 1)[1], kernel, "Autograd", with_keyset=True)
