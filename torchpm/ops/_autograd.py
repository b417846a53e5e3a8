"""Autograd registration of torchpm's C++ ops: reverse mode under ``torch.autograd`` and
``torch.func`` (grad, vjp), forward-mode AD refused.

``torch.library.register_autograd`` gives an op a kernel that, when no input requires
grad, runs the op below autograd: a forward-mode tangent (a dual tensor of
``torch.autograd.forward_ad``, or ``torch.func.jvp``) is then dropped and the result
has a zero tangent, silently. These ops have reverse-mode formulas only, so the
kernel registered here raises instead when an input carries a tangent, then runs
torch's kernel. On a torch without the internals it builds on, the plain
``register_autograd`` is used (no forward-mode check).

torch's kernel runs the op in an ``autograd.Function`` written in the combined
``forward(ctx, ...)`` style, which ``torch.func`` transforms refuse ("it must override
the setup_context staticmethod"). Under a ``torch.func`` transform the kernel here runs
the op in a ``setup_context``-style function instead, with the same setup and backward,
so ``torch.func.grad``/``vjp`` take the same derivatives as ``torch.autograd.grad``.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import _C

_functorch_active = getattr(_C, "_are_functorch_transforms_active", lambda: False)
_fill_defaults = None
# autograd.Function.apply without its torch.func dispatch (which cannot run inside an op's
# Autograd kernel): records the function at the transform's level, as a C++ op's own
# autograd kernel does.
_function_base_apply = getattr(torch._C, "_FunctionBase", object).__dict__.get("apply")


def _apply_at_this_level(function, *args):
    allowed = _C._functorch.get_single_level_autograd_function_allowed()
    _C._functorch.set_single_level_autograd_function_allowed(True)
    try:
        return _function_base_apply.__get__(None, function)(*args)
    finally:
        _C._functorch.set_single_level_autograd_function_allowed(allowed)

_LIBRARY = torch.library.Library("torchpm", "IMPL")


def _has_tangent(value) -> bool:
    if isinstance(value, torch.Tensor):
        return _forward_ad.unpack_dual(value).tangent is not None
    if isinstance(value, (list, tuple)):
        return any(_has_tangent(v) for v in value)
    return False


class _CallInfo:
    """The dispatch key set and keyword-only arguments of one call, carried through
    ``Function.apply`` as one non-tensor argument (``apply`` takes positional arguments
    only)."""

    def __init__(self, keyset, values):
        self.keyset = keyset
        self.values = values


def _functorch_function(op, backward, setup_context):
    """An ``autograd.Function`` in the ``setup_context`` style, which ``torch.func``
    transforms accept, running ``op`` with ``setup_context`` and ``backward`` registered
    for it. ``forward`` receives the tensors of the level below the transform and calls the
    op on them (its kernel then runs the op below autograd, or records it for an outer
    ``torch.autograd`` graph)."""
    schema = op._schema
    has_keyword_only = any(argument.kwarg_only for argument in schema.arguments)

    def forward(*args):
        # As a C++ op's autograd kernel does: the op below this level's autograd, where
        # the transforms below (an outer torch.func.grad, an outer torch.autograd graph)
        # record it. Function.apply turned grad mode off, which the levels below would
        # take as theirs (torch.func honours no_grad set inside the transformed function).
        info = args[-1]
        with torch.enable_grad(), _C._AutoDispatchBelowAutograd():
            return op.redispatch(info.keyset & _C._after_autograd_keyset, *args[:-1], **info.values)

    def setup(ctx, inputs, output):
        keyword_only = inputs[-1].values
        args, kwargs = _fill_defaults(schema, inputs[:-1], keyword_only)
        if has_keyword_only:
            setup_context(ctx=ctx, inputs=args, keyword_only_inputs=kwargs, output=output)
        else:
            setup_context(ctx=ctx, inputs=args, output=output)

    def run_backward(ctx, *grads):
        previous = ctx.needs_input_grad
        try:
            ctx.needs_input_grad = previous[:-1]
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = previous
        return (*result, None) if isinstance(result, tuple) else (result, None)

    return type(
        f"FunctorchBackwardFor_{op._namespace}_{op._opname}_{op._overloadname}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "setup_context": staticmethod(setup),
         "backward": staticmethod(run_backward)},
    )


def register_autograd(qualname: str, backward, *, setup_context) -> None:
    """``torch.library.register_autograd(qualname, backward, setup_context=...)``, with
    forward-mode AD refused by a ``NotImplementedError`` naming the op."""
    try:
        from torch._library.autograd import Info, make_autograd_impl
        from torch._library.utils import fill_defaults, lookup_op

        op = lookup_op(qualname)
        inner = make_autograd_impl(op, Info(backward, setup_context))
        global _fill_defaults
        _fill_defaults = fill_defaults
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - torch internals moved
        torch.library.register_autograd(qualname, backward, setup_context=setup_context)
        return

    def kernel(keyset, *args, **keyword_args):
        if getattr(_forward_ad, "_current_level", -1) >= 0 and _has_tangent(args):
            raise NotImplementedError(
                f"{qualname}: forward-mode AD (torch.func.jvp, jacfwd, hessian, torch.autograd.forward_ad "
                "dual tensors) is not supported by torchpm's ops, which have reverse-mode derivatives only; "
                "use torch.autograd.grad / backward or torch.func.grad / vjp / jacrev (a Hessian: "
                "torch.func.jacrev(torch.func.jacrev(f))), or torch.autograd.functional.jvp for a "
                "Jacobian-vector product (it takes it by double backward)"
            )
        if (_functorch_active() and _function_base_apply is not None and torch.is_grad_enabled()
                and _C._any_requires_grad(*args)):
            return _apply_at_this_level(functorch_function, *args, _CallInfo(keyset, keyword_args))
        return inner(keyset, *args, **keyword_args)

    functorch_function = _functorch_function(op, backward, setup_context)

    _LIBRARY.impl(qualname.split("::", 1)[1], kernel, "Autograd", with_keyset=True)
