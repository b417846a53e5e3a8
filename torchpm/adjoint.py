"""Gradients of the whole kick-drift-kick loop by the adjoint method.

The FastPM kick-drift-kick step (:func:`torchpm.pm.kick_drift_kick`) is exactly
reversible. Going forward from ``(x_i, p_i, F_i)`` with the factors
``k1, d, k2`` of step ``i``::

    p_h     = p_i + k1 F_i
    x_{i+1} = x_i + d p_h
    F_{i+1} = force(x_{i+1}, a_{i+1})
    p_{i+1} = p_h + k2 F_{i+1}

and backward from ``(x_{i+1}, p_{i+1}, F_{i+1})``::

    p_h = p_{i+1} - k2 F_{i+1}
    x_i = x_{i+1} - d p_h
    F_i = force(x_i, a_i)
    p_i = p_h - k1 F_i

So the forward pass keeps only the final state, and the backward pass walks the
steps in reverse: it rebuilds the state at the start of each step, evaluating
the force there once with its autograd graph, and pulls the adjoints
``(lambda_x, lambda_p, lambda_F)`` through the step (the kicks and the drift by
hand, the force with ``torch.autograd.grad``), collecting on the way the adjoints
of the step factors (hence of the cosmology, through the growth table outside)
and of every parameter the force depends on (``1.5 Omega_m``, force-correction
weights). Memory is that of one step plus two states, whatever the number of
steps; the backward pass costs one force evaluation and one force backward per
step, so forward + backward costs plain autograd's plus one forward pass.

Reconstructing the trajectory backwards is exact up to rounding: the rounding
error grows with the chaotic divergence of the trajectories, which over the
few tens of steps of a PM run stays far below the float64 tolerances of the
tests (1e-14 relative at 8^3, 10 steps) and at float32 rounding in float32
(1e-7 relative; see tests/test_adjoint.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .pm import StepFactors, kick_drift_kick

__all__ = ["adjoint_integrate"]

# Columns of the step-factor table passed through the autograd Function.
_FIELDS = StepFactors._fields  # a_start, a_end, first_kick, drift, second_kick


def _migrating_step(migrate):
    """:func:`kick_drift_kick` with ``migrate`` applied right after the drift (the same
    arithmetic in the same order, so identity migration gives identical numbers)."""

    def step(positions, momenta, forces, factors, force_function):
        dtype = positions.dtype
        momenta = momenta + forces * factors.first_kick.to(dtype)
        positions = positions + momenta * factors.drift.to(dtype)
        positions, momenta = migrate(positions, momenta)
        forces = force_function(positions, factors.a_end)
        momenta = momenta + forces * factors.second_kick.to(dtype)
        return positions, momenta, forces

    return step


def _row_factors(row: torch.Tensor) -> StepFactors:
    return StepFactors(*row.unbind(0))


class _AdjointKickDriftKick(torch.autograd.Function):
    """``(x_0, p_0, factor table, *parameters) -> (x_N, p_N, F_N)``; backward by the
    adjoint method (see the module docstring). ``setup`` is a plain dict carrying the
    force function, the hooks and the parameter list."""

    @staticmethod
    def forward(ctx, setup, positions, momenta, table, *parameters):
        force_function, step, callback = setup["force_function"], setup["step"], setup["callback"]
        rows = table.unbind(0)
        forces = force_function(positions, rows[0][0])
        for number, row in enumerate(rows, start=1):
            positions, momenta, forces = step(positions, momenta, forces, _row_factors(row), force_function)
            if callback is not None:
                callback(number, float(row[1]))
        ctx.setup = setup
        ctx.save_for_backward(positions, momenta, forces, table)
        return positions, momenta, forces

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_positions, grad_momenta, grad_forces):
        positions, momenta, forces, table = ctx.saved_tensors
        setup = ctx.setup
        force_function, migrate = setup["force_function"], setup["migrate"]
        parameters = list(setup["parameters"])
        dtype = positions.dtype
        adjoint_x = _zeros_if_none(grad_positions, positions)
        adjoint_p = _zeros_if_none(grad_momenta, momenta)
        adjoint_F = _zeros_if_none(grad_forces, forces)
        grad_table = torch.zeros_like(table)
        grad_parameters = [None] * len(parameters)

        def force_with_graph(x, a):
            """The force at ``x`` with its graph kept, to pull one adjoint through it later."""
            with torch.enable_grad():
                x = x.detach().requires_grad_(True)
                a = a.detach().requires_grad_(True)
                return x, a, force_function(x, a)

        def pull_through_force(graph, adjoint, a_slot):
            """Adds the adjoint's pull-back to the parameters and ``a``; returns it for ``x``."""
            x, a, value = graph
            grads = torch.autograd.grad(value, [x, a] + parameters, grad_outputs=adjoint, allow_unused=True)
            if grads[1] is not None:
                grad_table[a_slot] += grads[1]
            for index, grad in enumerate(grads[2:]):
                if grad is not None:
                    current = grad_parameters[index]
                    grad_parameters[index] = grad if current is None else current + grad
            return _zeros_if_none(grads[0], x)

        # The adjoint of pm.kick_drift_kick, written out. Step i, with factors k1, d, k2:
        #   p_h = p_i + k1 F_i;  x' = x_i + d p_h;  (x_{i+1}, p_h) = migrate(x', p_h)
        #   F_{i+1} = force(x_{i+1});  p_{i+1} = p_h + k2 F_{i+1}
        # The force at the end of a step is re-evaluated with its graph once, during the
        # reconstruction, and pulled back in the next (earlier) step: one force
        # evaluation and one force backward per step.
        graph = force_with_graph(positions, table[-1, 1])
        for index in range(table.shape[0] - 1, -1, -1):
            first_kick, drift, second_kick = (table[index, j].to(dtype) for j in (2, 3, 4))
            # Second kick and force: p_{i+1} = p_h + k2 F, F_{i+1} = F = force(x_{i+1}).
            grad_table[index, 4] += _dot(adjoint_p, forces)
            adjoint_x = adjoint_x + pull_through_force(graph, adjoint_F + second_kick * adjoint_p, (index, 1))
            adjoint_half = adjoint_p
            with torch.no_grad():
                half = momenta - forces * second_kick
                positions = positions - half * drift
            if migrate is not None:
                # Back to the particles' homes at a_i, the adjoints travelling with them.
                positions, half, adjoint_x, adjoint_half = migrate(positions, half, adjoint_x, adjoint_half)
            # Drift: x' = x_i + d p_h.
            grad_table[index, 3] += _dot(adjoint_x, half)
            adjoint_half = adjoint_half + drift * adjoint_x
            # First kick: p_h = p_i + k1 F_i.
            graph = force_with_graph(positions, table[index, 0])
            forces = graph[2].detach()
            with torch.no_grad():
                momenta = half - forces * first_kick
            grad_table[index, 2] += _dot(adjoint_half, forces)
            adjoint_p = adjoint_half
            adjoint_F = first_kick * adjoint_half
        # F_0 = force(x_0, a_0) was computed inside the Function too.
        adjoint_x = adjoint_x + pull_through_force(graph, adjoint_F, (0, 0))
        adjoint_x, adjoint_p = setup["restore"](positions, adjoint_x, adjoint_p)
        return (None, adjoint_x, adjoint_p, grad_table, *grad_parameters)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b)`` accumulated in float64: the step-factor adjoints are sums over every
    particle with cancellations, which float32 accumulation would round to ~1e-4."""
    return torch.sum(a.to(torch.float64) * b.to(torch.float64))


def _zeros_if_none(grad, like):
    return torch.zeros_like(like) if grad is None else grad


def adjoint_integrate(
    positions: torch.Tensor,
    momenta: torch.Tensor,
    factors: Sequence[StepFactors],
    force_function: Callable,
    parameters: Sequence[torch.Tensor] = (),
    *,
    migrate: Callable | None = None,
    restore: Callable | None = None,
    callback: Callable | None = None,
):
    """Integrate the kick-drift-kick loop with gradients by the adjoint method.

    Args:
        positions, momenta: ``(B, N, 3)`` at ``factors[0].a_start`` (any units the
            ``force_function`` understands; torchpm uses force-mesh cells).
        factors: the :class:`~torchpm.pm.StepFactors` of every step (0-d tensors; their
            gradients flow back to whatever they were computed from, e.g. the cosmology).
        force_function: ``force_function(positions, a) -> forces (B, N, 3)``, with ``a`` a
            0-d tensor. It is called again in the backward pass, so it must be a pure
            function of its arguments and of ``parameters``.
        parameters: every tensor the forces depend on that needs a gradient (e.g. the
            cosmological parameters behind ``1.5 Omega_m``, a force correction's
            ``parameters()``). A tensor the forces read but that is missing here gets
            no gradient from the loop.
        migrate: hook ``migrate(positions, *payload) -> (positions, *payload)`` (default:
            none, i.e. particles never move between processes). Contract: it re-homes
            particles according to ``positions`` alone, carrying every ``(B, N, C)``
            per-particle tensor of ``payload`` along (the same permutation / exchange for
            all of them, no arithmetic on the values); the order of the particles it
            returns is free. It is called without autograd: after every drift in the
            forward pass with ``payload = (momenta,)``, and in the backward pass, after
            every reversed drift, with the reconstructed momenta and the two adjoints as
            payload, sending the particles to the homes of their earlier positions. The
            force function must accept particles in any layout ``migrate`` produces.
        restore: hook ``restore(positions_0, adjoint_x, adjoint_p) -> (adjoint_x, adjoint_p)``
            run once at the end of the backward pass with the reconstructed initial
            positions and the adjoints of the initial state, in the layout the backward
            pass ended in; it must return the adjoints in the layout (processes and order)
            of the ``positions`` and ``momenta`` passed in, e.g. by matching particle ids.
            Required with ``migrate``.
        callback: called as ``callback(step, a)`` after each forward step.

    Returns:
        ``(positions, momenta, forces)`` after the last step, identical to looping
        :func:`~torchpm.pm.kick_drift_kick`; their backward pass uses memory independent
        of the number of steps.
    """
    factors = list(factors)
    if not factors:
        raise ValueError("adjoint_integrate: `factors` must hold at least one step, got none")
    for name, value in (("positions", positions), ("momenta", momenta)):
        if not isinstance(value, torch.Tensor) or value.dim() != 3 or value.shape[-1] != 3:
            raise ValueError(
                f"adjoint_integrate: `{name}` must be a (B, N, 3) tensor, got "
                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
            )
    parameters = list(parameters)
    for index, parameter in enumerate(parameters):
        if not isinstance(parameter, torch.Tensor):
            raise TypeError(f"adjoint_integrate: `parameters[{index}]` must be a tensor, got {type(parameter).__name__}")
    if (restore is None) != (migrate is None):
        raise ValueError(
            "adjoint_integrate: pass `migrate` and `restore` together (restore brings the gradients back "
            "to the layout of the inputs after migrate has moved the particles), or neither"
        )
    step = kick_drift_kick if migrate is None else _migrating_step(migrate)
    table = torch.stack(
        [torch.stack([torch.as_tensor(getattr(f, name), dtype=torch.float64) for name in _FIELDS]) for f in factors]
    ).to(positions.device)
    setup = dict(
        force_function=force_function,
        step=step,
        migrate=migrate,
        callback=callback,
        parameters=parameters,
        restore=restore or (lambda positions, adjoint_x, adjoint_p: (adjoint_x, adjoint_p)),
    )
    return _AdjointKickDriftKick.apply(setup, positions, momenta, table, *parameters)
