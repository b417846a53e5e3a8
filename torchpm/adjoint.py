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

So the forward pass keeps only the final state (and what the pull-back of its
last force needs), and the backward pass walks the steps in reverse: it rebuilds
the state at the start of each step, evaluating the force there once and keeping
that evaluation's intermediates, and pulls the adjoints
``(lambda_x, lambda_p, lambda_F)`` through the step (the kicks and the drift by
hand, the force by its pull-back: :class:`ParticleMeshForce` for torchpm's PM
force, ``torch.autograd.grad`` for any other function), collecting on the way the
adjoints of the step factors (hence of the cosmology, through the growth table
outside) and of every parameter the force depends on (``1.5 Omega_m``,
force-correction weights). Memory is that of one step plus two states, whatever
the number of steps; the backward pass costs one force evaluation and one force
pull-back per step, so forward + backward costs about plain autograd's plus one
forward pass. For the PM force the evaluation and the pull-back at the same
positions share their particle passes (the cotangent is known before the force is
re-evaluated: :meth:`ParticleMeshForce.evaluate_and_pull`), which takes one paint
per step off that extra forward pass.

Reconstructing the trajectory backwards is exact up to rounding, but not beyond
it: the forward drift rounds ``x + d p`` to the dtype, dropping the low bits of
``x``, so the reversed drift recovers the positions to about one ulp of their
absolute value (4.8e-7 cells at 8 cells in float32, 9e-16 in float64; measured
at 8^3, 10 steps). That is far below the float64 tolerances of the tests (1e-8;
measured <= 1e-11). In float32 most gradients agree with autograd to float32
rounding (~1e-6 relative), but a gradient made of large cancelling terms, like
d/dOmega_c, amplifies the reconstruction error to a few 1e-4 relative (replaying
the stored forward trajectory instead brings it back to autograd's own float32
error, 6e-5): inherent to reversing a float32 integration, not to the
bookkeeping (whose sums are accumulated in float64). See benchmarks/RESULTS.md
section 5.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .fourier import gradient_inverse_laplacian, gradient_transpose_k, multiply_real
from .ops._arguments import order_number
from .pm import StepFactors, add_scaled, kick_drift_kick

__all__ = ["adjoint_integrate", "AutogradForce", "ParticleMeshForce"]

# Columns of the step-factor table passed through the autograd Function.
_FIELDS = StepFactors._fields  # a_start, a_end, first_kick, drift, second_kick


def _migrating_step(migrate):
    """:func:`kick_drift_kick` with ``migrate`` applied right after the drift (the same
    arithmetic in the same order, so identity migration gives identical numbers)."""

    def step(positions, momenta, forces, factors, force_function):
        momenta = add_scaled(momenta, forces, factors.first_kick)
        positions = add_scaled(positions, momenta, factors.drift)
        positions, momenta = migrate(positions, momenta)
        forces = force_function(positions, factors.a_end)
        momenta = add_scaled(momenta, forces, factors.second_kick)
        return positions, momenta, forces

    return step


def _row_factors(row: torch.Tensor) -> StepFactors:
    return StepFactors(*row.unbind(0))


class AutogradForce:
    """A plain force function ``force(positions, a) -> forces`` as the adjoint needs it:
    :meth:`evaluate` keeps the autograd graph of one evaluation, :meth:`pull_back`
    differentiates it with ``torch.autograd.grad``. Correct for any differentiable
    function; :class:`ParticleMeshForce` does the same for the PM force with less work."""

    def __init__(self, function: Callable):
        self.function = function

    def __call__(self, positions, a):
        return self.function(positions, a)

    def evaluate(self, positions, a):
        """``(forces, saved)``: the forces at ``positions`` (detached) and what
        :meth:`pull_back` needs."""
        with torch.enable_grad():
            positions = positions.detach().requires_grad_(True)
            a = a.detach().requires_grad_(True)
            value = self.function(positions, a)
        return value.detach(), (positions, a, value)

    def pull_back(self, saved, cotangent, parameters, cotangent_dot_forces=None):
        """``(grad_positions, grad_a, grad_parameters)`` of ``<cotangent, forces>``
        (``None`` where there is no dependence; ``cotangent_dot_forces`` is unused here)."""
        positions, a, value = saved
        grads = torch.autograd.grad(value, [positions, a, *parameters], grad_outputs=cotangent, allow_unused=True)
        return _zeros_if_none(grads[0], positions), grads[1], list(grads[2:])


class ParticleMeshForce:
    """:func:`torchpm.pm.compute_forces` with a hand-written vector-Jacobian product.

    The forces are ``F_i = readout(f_i, x)``, ``f_i = IDFT[K_i DFT(rho)]``,
    ``rho = paint(x, w)``, with ``K_i = G'_i L C`` (``G'_i`` the gradient kernel times
    ``1.5 Omega_m`` and the particle mass, ``L`` the inverse Laplacian with the window
    compensation, ``C`` the optional force-correction filter). For a cotangent ``c``
    ``(B, N, 3)`` the pull-back of ``<c, F>`` is

    * to the positions: ``d/dx <c, readout(f, x)>`` (the readout's position gradient
      with the 3-channel field ``f`` of the evaluation) plus
      ``d/dx <rho_bar, paint(x, w)> = d/dx <w, readout(rho_bar, x)>`` with
      ``rho_bar = IDFT[L C Z]``, both in one pass over the particles,
      ``Z = sum_i conj(G'_i) DFT(paint(x, c_i))``: the three components combine into
      one field (the transpose of a real convolution ``IDFT K DFT`` is
      ``IDFT conj(K) DFT``). With the real-space ``"fd4"`` gradient they combine
      before the transform, ``Z = DFT(sum_i D_i^T paint(x, c_i))`` with the
      stencil's transpose, so the backward costs one 3-channel paint, one
      1-channel forward DFT and one 1-channel inverse DFT (a 3-channel forward
      DFT with the Fourier gradient);
    * to ``1.5 Omega_m``: ``<c, F> / (1.5 Omega_m)`` (the forces are linear in it);
    * to the filter ``C`` (hence the correction's parameters and ``a``):
      ``(h / N) L Re(DFT(rho) conj(Z))``, ``h`` the Hermitian weights of the rfft
      block (2 for the modes standing for a conjugate pair), ``N`` the mesh size.

    Versus autograd through :func:`~torchpm.pm.compute_forces` this skips the
    gradient of the complex kernels, the copies of the FFT backwards and the
    autograd bookkeeping, and computes the two position gradients (the costliest
    particle pass) in one go; on a process grid the force field comes with the
    readout's halo (from the potential's halo exchange, as in
    :func:`~torchpm.pm.compute_forces`) and only ``rho_bar``'s halo is filled
    before the position gradients. When the cotangent is known before the
    evaluation (the adjoint loop), :meth:`evaluate_and_pull` does both at once:
    density and cotangent in one 4-channel paint, the forces' readout and the
    position gradients at the same positions behind one helper
    (:func:`_readout_and_position_gradient`).

    Args:
        function: the plain force ``function(positions, a)`` (the forward pass);
            :meth:`evaluate` must give bit for bit the same numbers (on CUDA under
            ``torch.use_deterministic_algorithms`` only: the default paints sum with
            atomics, in a varying order, so two evaluations differ by rounding).
        kernels: :class:`~torchpm.fourier.FourierKernels` of the force mesh.
        particle_mass: mesh cells per particle.
        force_scale: callable returning ``1.5 Omega_m`` (0-d tensor, with its graph to
            the cosmological parameters).
        force_correction: the filter callable ``(k, a) -> C`` or None.
        weights: callable returning the current ``(B, N)`` particle weights or None.
        order: mass-assignment order.
    """

    def __init__(self, function, kernels, *, particle_mass, force_scale, force_correction, weights, order):
        self.function = function
        self.kernels = kernels
        self.particle_mass = particle_mass
        self.force_scale = force_scale
        self.force_correction = force_correction
        self.weights = weights
        self.order = order
        self._hermitian = None

    def __call__(self, positions, a):
        return self.function(positions, a)

    def _factors(self, positions, a):
        """``(a, scale, filter_)``: ``a`` as a leaf needing grad, ``1.5 Omega_m`` and the
        force-correction filter with their (small) autograd graphs."""
        kernels = self.kernels
        with torch.enable_grad():
            a = a.detach().requires_grad_(True)
            scale = self.force_scale()
            if isinstance(scale, torch.Tensor):
                scale = scale.to(device=positions.device)
            filter_ = None
            if self.force_correction is not None:
                filter_ = self.force_correction(
                    kernels.k_magnitude, torch.as_tensor(a, dtype=kernels.dtype, device=positions.device)
                )
        return a, scale, filter_

    def _force_field(self, density_k, scale, filter_):
        """``(gradient_scale, field)``: the per-axis factors of the gradient ``G'_i = f_i
        G_i`` and the 3-channel force field ``IDFT[K_i DFT(rho)]`` with the readout's
        halo on a process grid (``halo_for``), with :func:`~torchpm.pm.compute_forces`'s
        arithmetic (bit for bit)."""
        kernels = self.kernels
        plain_scale = scale.detach() if isinstance(scale, torch.Tensor) else scale
        gradient_scale = [plain_scale * (self.particle_mass / c) for c in kernels.cell_size]
        plain_filter = filter_.detach() if isinstance(filter_, torch.Tensor) else filter_
        return gradient_scale, gradient_inverse_laplacian(
            density_k, kernels, plain_filter, gradient_scale, halo_for=self.order
        )

    def _density_adjoint(self, cotangent_mesh, density_k, gradient_scale, filter_):
        """``(rho_bar, filter_adjoint)`` from the painted cotangent ``(B, 3,
        *local_real_shape)``: ``rho_bar = IDFT[L C Z]`` (``(B, *local_real_shape)``) and
        ``(h/N) L Re(rho_k conj(Z))`` summed to the filter's shape (None when the filter
        needs no gradient), ``Z = sum_i conj(G'_i) DFT(cotangent_mesh[:, i])``
        (:func:`~torchpm.fourier.gradient_transpose_k`: with the real-space gradient,
        the DFT of the stencil's transpose, one forward FFT)."""
        kernels, mesh = self.kernels, self.kernels.mesh
        combined = gradient_transpose_k(cotangent_mesh, kernels, gradient_scale)
        potential = multiply_real(combined, kernels.inverse_laplacian_pair, paired=True)
        filter_adjoint = None
        if filter_ is not None:
            if isinstance(filter_, torch.Tensor) and filter_.requires_grad:
                if self._hermitian is None:
                    self._hermitian = mesh.hermitian_weights(dtype=kernels.dtype, device=combined.device)
                # (h/N) L Re(rho_k conj(Z)), summed down to the filter's shape.
                product = density_k * combined.conj()
                filter_adjoint = (product.real * kernels.inverse_laplacian * (self._hermitian / mesh.size))
                filter_adjoint = filter_adjoint.sum_to_size(filter_.shape)
            potential = multiply_real(potential, filter_.detach() if isinstance(filter_, torch.Tensor) else filter_)
        del combined
        return mesh.irfftn(potential), filter_adjoint

    def _parameter_adjoints(self, a, scale, filter_, filter_adjoint, parameters, cotangent_dot_forces):
        """``(grad_a, grad_parameters)`` through the graphs of ``1.5 Omega_m`` (adjoint
        ``<c, F> / (1.5 Omega_m)``, ``cotangent_dot_forces()`` giving ``<c, F>``, called
        only when needed) and of the filter."""
        outputs, adjoints = [], []
        if isinstance(scale, torch.Tensor) and scale.requires_grad and parameters:
            outputs.append(scale)
            adjoints.append((cotangent_dot_forces() / scale.detach().to(torch.float64)).to(scale.dtype))
        if filter_adjoint is not None:
            outputs.append(filter_)
            adjoints.append(filter_adjoint)
        if not outputs:
            return None, [None] * len(parameters)
        grads = torch.autograd.grad(outputs, [a, *parameters], grad_outputs=adjoints, allow_unused=True)
        return grads[0], list(grads[1:])

    # The (B, N, 4) particle values below are built with torch.stack of the (B, N)
    # components: a torch.cat along the last dimension copies 1 and 3 entries per
    # particle at a time, twice as slow.

    @staticmethod
    def _unit_weights(weights, like):
        """The ``(B, N)`` particle weights as a tensor (ones for None) in ``like``'s dtype."""
        return like.new_ones(like.shape[:2]) if weights is None else weights.to(like.dtype)

    def evaluate(self, positions, a):
        """As :meth:`AutogradForce.evaluate`; the same arithmetic as
        :func:`~torchpm.pm.compute_forces`, keeping the 3-channel field, the density
        spectrum and the (small) autograd graphs of the filter and ``1.5 Omega_m``."""
        mesh, order = self.kernels.mesh, self.order
        positions = positions.detach()
        a, scale, filter_ = self._factors(positions, a)
        weights = self.weights()
        with torch.no_grad():
            density_k = mesh.rfftn(mesh.paint(positions, weights, order=order))
            gradient, field = self._force_field(density_k, scale, filter_)
            value = mesh.readout(field, positions, order=order, haloed=True)
        saved = dict(
            positions=positions, a=a, scale=scale, filter=filter_, weights=weights, density_k=density_k,
            gradient=gradient, field=field, value=value,
        )
        return value, saved

    def pull_back(self, saved, cotangent, parameters, cotangent_dot_forces=None):
        """As :meth:`AutogradForce.pull_back` (``cotangent_dot_forces``: ``<cotangent,
        forces>`` if the caller has it, float64)."""
        mesh = self.kernels.mesh
        positions = saved["positions"]
        with torch.no_grad():
            density_adjoint, filter_adjoint = self._density_adjoint(
                mesh.paint(positions, cotangent, order=self.order), saved["density_k"], saved["gradient"],
                saved["filter"]
            )
            # Both position gradients in one pass over the particles: the readout's,
            # d/dx <c, readout(f, x)>, and the paint's, d/dx <rho_bar, paint(x, w)> =
            # d/dx <w, readout(rho_bar, x)>, as one 4-channel field with 4 values.
            weights = self._unit_weights(saved["weights"], cotangent)
            grad_positions = _position_gradient(
                mesh,
                _force_and_density(saved["field"], mesh.with_stencil_halo(density_adjoint.unsqueeze(1), self.order)),
                positions,
                torch.stack([*cotangent.unbind(-1), weights], dim=-1),
                self.order,
            )
        def dot():
            return _dot(cotangent, saved["value"]) if cotangent_dot_forces is None else cotangent_dot_forces

        grad_a, grads = self._parameter_adjoints(
            saved["a"], saved["scale"], saved["filter"], filter_adjoint, parameters, dot
        )
        return grad_positions, grad_a, grads

    def evaluate_and_pull(self, positions, a, cotangent, parameters, cotangent_dot_forces=None):
        """:meth:`evaluate` and :meth:`pull_back` at the same positions in one go, for a
        cotangent known before the forces (the adjoint loop's case).

        The density and the cotangent are painted together, as one 4-channel paint
        ``paint(x, [w, c_x, c_y, c_z])`` (one pass over the particles instead of two);
        channel 0 is transformed alone, by the same FFT call as :meth:`evaluate`, so the
        forces are :meth:`evaluate`'s bit for bit (the reversed trajectory relies on
        it; on CUDA under deterministic algorithms only, as above: otherwise they agree
        to rounding, and so does the reversed trajectory). The readout of the forces and
        the two position gradients at the same positions go through one helper, :func:`_readout_and_position_gradient` (one
        pass over the particles).

        Args:
            positions: ``(B, N, 3)``.
            a: 0-d tensor, the scale factor of the evaluation.
            cotangent: ``(B, N, 3)``, the adjoint ``c`` of the forces.
            parameters: as in :meth:`pull_back`.
            cotangent_dot_forces: optional callable ``forces -> <c, forces>`` (0-d
                float64), called at most once, for a caller that needs a dot with the
                forces anyway; None: computed here when needed.

        Returns:
            ``(forces, grad_positions, grad_a, grad_parameters)``: the forces ``(B, N, 3)``
            (detached) and :meth:`pull_back`'s three results for ``<c, forces>``.
        """
        mesh, order = self.kernels.mesh, self.order
        positions = positions.detach()
        a, scale, filter_ = self._factors(positions, a)
        weights = self._unit_weights(self.weights(), cotangent)
        with torch.no_grad():
            painted = mesh.paint(positions, torch.stack([weights, *cotangent.unbind(-1)], dim=-1), order=order)
            # Channel 0 alone, contiguous like evaluate's 1-channel paint: the same FFT
            # call on the same bits (batching it with the cotangent's channels could let
            # the FFT library take another algorithm and round differently).
            density = painted[:, 0]
            if mesh.is_local:
                density = density.contiguous()
            density_k = mesh.rfftn(density)
            del density
            gradient, field = self._force_field(density_k, scale, filter_)
            density_adjoint, filter_adjoint = self._density_adjoint(painted[:, 1:], density_k, gradient, filter_)
            del painted
            forces, grad_positions = _readout_and_position_gradient(
                mesh,
                _force_and_density(field, mesh.with_stencil_halo(density_adjoint.unsqueeze(1), order)),
                positions,
                torch.stack([*cotangent.unbind(-1), weights], dim=-1),
                order,
            )
            del field, density_adjoint

        def dot():
            return _dot(cotangent, forces) if cotangent_dot_forces is None else cotangent_dot_forces(forces)

        grad_a, grads = self._parameter_adjoints(a, scale, filter_, filter_adjoint, parameters, dot)
        return forces, grad_positions, grad_a, grads


def _force_and_density(field, density):
    """The ``(B, 3, ...)`` force field and a ``(B, 1, ...)`` density-like field as one
    ``(B, 4, ...)`` mesh, interleaved (``torch.channels_last_3d``: a node's four values
    side by side), the layout the fused readout and position gradient read fastest."""
    out = torch.empty((field.shape[0], 4, *field.shape[2:]), dtype=field.dtype, device=field.device,
                      memory_format=torch.channels_last_3d)
    # One torch.cat into the buffer: faster than two slice assignments (1.3x, 128^3 CPU).
    return torch.cat([field, density], dim=1, out=out)


def _readout_and_position_gradient(mesh, field, positions, values, order):
    """``(readout(field[:, :3], x), d/dx_p sum_c values[p, c] readout(field, x)[p, c])``,
    both ``(B, N, 3)``, from a ``(B, C, ...)`` field (``C >= 3``) that holds the halo of
    ``order`` (:meth:`mesh.with_stencil_halo`) and ``(B, N, C)`` values: the forces from
    the first 3 channels (bit for bit ``mesh.readout(field[:, :3], positions,
    haloed=True)``) and the position gradient of all channels, at the same positions,
    in one pass over the particles (``torch.ops.torchpm._readout_and_position_gradient``:
    every stencil computed once; the readout part is the readout op's own
    arithmetic)."""
    _, _, offset, periodic = mesh._block_geometry(order)
    return torch.ops.torchpm._readout_and_position_gradient(
        field, positions, values, 3, offset, periodic, order_number(order, "readout and position gradient")
    )


def _position_gradient(mesh, field, positions, values, order):
    """``d/dx_p sum_c values[p, c] readout(field, x)[p, c]``, ``(B, N, 3)``: what the
    positions get from the backward of ``mesh.readout(field, positions, haloed=True)``,
    computed without the readout, from a field that holds the halo of ``order``
    (:meth:`mesh.with_stencil_halo`)."""
    _, _, offset, periodic = mesh._block_geometry(order)
    return torch.ops.torchpm._position_gradient(
        field, positions, values, offset, periodic, order_number(order, "position gradient")
    )


class _AdjointKickDriftKick(torch.autograd.Function):
    """``(x_0, p_0, F_0 or None, factor table, *parameters) -> (x_N, p_N, F_N)``; backward
    by the adjoint method (see the module docstring; ``F_0`` given: see
    :func:`adjoint_integrate`'s ``forces``). ``setup`` is a plain dict carrying the
    force (an :class:`AutogradForce` or :class:`ParticleMeshForce`), the hooks and
    the parameter list."""

    @staticmethod
    def forward(setup, positions, momenta, initial_forces, table, *parameters):
        force, step, callback = setup["force"], setup["step"], setup["callback"]
        rows = table.unbind(0)
        last = {}

        def force_kept(x, a):
            # The last force of the run, with what its pull-back needs: the backward
            # pass starts from it instead of evaluating it again.
            value, last["saved"] = force.evaluate(x, a)
            return value

        forces = force(positions, rows[0][0]) if initial_forces is None else initial_forces
        for number, row in enumerate(rows, start=1):
            function = force_kept if number == len(rows) and setup["keep_last_force"] else force
            positions, momenta, forces = step(positions, momenta, forces, _row_factors(row), function)
            if callback is not None:
                callback(number, float(row[1]))
        setup["last_force"] = last.get("saved")
        return positions, momenta, forces

    @staticmethod
    def setup_context(ctx, inputs, output):
        # (the setup_context form, which torch.func transforms require)
        setup, initial_forces, table = inputs[0], inputs[3], inputs[4]
        ctx.setup = setup
        ctx.last_force = setup.pop("last_force", None)
        ctx.set_materialize_grads(False)  # an unused output's adjoint stays None: no zero tensors
        ctx.given_forces = initial_forces is not None
        ctx.save_for_backward(*output, table, *([initial_forces] if ctx.given_forces else []))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_positions, grad_momenta, grad_forces):
        positions, momenta, forces, table, *given = ctx.saved_tensors
        setup = ctx.setup
        force, migrate = setup["force"], setup["migrate"]
        parameters = list(setup["parameters"])
        dtype = positions.dtype
        adjoint_x = _zeros_if_none(grad_positions, positions)
        adjoint_p = _zeros_if_none(grad_momenta, momenta)
        grad_table = torch.zeros_like(table)
        grad_parameters = [None] * len(parameters)
        # Python floats: one host copy of the table instead of small tensor ops per step.
        # The kick and drift factors as the forward pass applied them (rounded to the
        # dtype), as Python floats: no small tensor ops per step.
        rounded = table[:, 2:5].to(dtype).tolist()

        def add_adjoints(grad_a, grads, slot):
            """Adds a force pull-back's ``a`` and parameter adjoints in."""
            if grad_a is not None:
                grad_table[slot] += grad_a
            for index, grad in enumerate(grads):
                if grad is not None:
                    current = grad_parameters[index]
                    grad_parameters[index] = grad if current is None else current + grad

        def pull(saved, cotangent, slot, cotangent_dot_forces=None):
            """The force's pull-back: parameter and ``a`` adjoints added in, the position adjoint returned."""
            grad_x, grad_a, grads = force.pull_back(saved, cotangent, parameters, cotangent_dot_forces)
            add_adjoints(grad_a, grads, slot)
            return grad_x

        # The adjoint of pm.kick_drift_kick, written out. Step i, with factors k1, d, k2:
        #   p_h = p_i + k1 F_i;  x' = x_i + d p_h;  (x_{i+1}, p_h) = migrate(x', p_h)
        #   F_{i+1} = force(x_{i+1});  p_{i+1} = p_h + k2 F_{i+1}
        # The force at the start of a step is re-evaluated once, during the
        # reconstruction, and pulled back once: one force evaluation and one force
        # pull-back per step.
        #
        # The cotangent of F_{i+1} is adjoint_F + k2 lambda_p, and for every step but the
        # last adjoint_F = k1' lambda_p (k1' the first kick of the step after): so the
        # cotangent is a multiple of lambda_p, and <lambda_p, F_{i+1}> gives at once the
        # adjoint of k2, of k1' and of 1.5 Omega_m (one particle dot per step, not three).
        #
        # lambda_p of that cotangent is final as soon as F_{i+1} is re-evaluated (the
        # reverse drift before it made it): so a force with `evaluate_and_pull`
        # (ParticleMeshForce) pulls F_{i+1} back right at its evaluation, sharing the
        # particle passes (one paint of density and cotangent together, one readout and
        # position-gradient pass). Only the last force, evaluated in the forward pass
        # before the adjoints existed, goes through `pull_back`; a force with only
        # `evaluate` and `pull_back` pulls every force back one iteration later.
        fused = hasattr(force, "evaluate_and_pull")
        adjoint_F = grad_forces  # None: zero
        kick_after = 0.0  # k1 of step i + 1 (adjoint_F = kick_after * lambda_p)
        saved = ctx.last_force  # what the pull-back of the force in `forces` needs; None: pulled back
        ctx.last_force = None  # (freed; a second backward, with retain_graph, evaluates it again)
        momentum_dot_force = None  # <lambda_p, forces> if the fused pull-back computed it
        steps = table.shape[0]
        if saved is None:
            # The last force was not kept by the forward pass (keep_last_force=False): it is
            # evaluated once more at the same positions (the same bits as `forces`) and,
            # its cotangent adjoint_F + k2 lambda_p being known already, pulled back in
            # the same call where the force can (the cost of the kept force's pull-back).
            if fused:
                cotangent = (adjoint_p * rounded[-1][2] if adjoint_F is None
                             else torch.add(adjoint_F, adjoint_p, alpha=rounded[-1][2]))
                _, grad_x, grad_a, grads = force.evaluate_and_pull(positions, table[-1, 1], cotangent, parameters)
                add_adjoints(grad_a, grads, (steps - 1, 1))
                adjoint_x = adjoint_x + grad_x
                adjoint_F = None
                del cotangent, grad_x
            else:
                saved = force.evaluate(positions, table[-1, 1])[1]
        for index in range(steps - 1, -1, -1):
            first_kick, drift, second_kick = rounded[index]
            if momentum_dot_force is None:
                momentum_dot_force = _dot(adjoint_p, forces)
            grad_table[index, 4] += momentum_dot_force
            if index + 1 < steps:
                grad_table[index + 1, 2] += momentum_dot_force
            if saved is not None:
                if adjoint_F is None:
                    cotangent = adjoint_p * (kick_after + second_kick)
                    cotangent_dot_forces = momentum_dot_force * (kick_after + second_kick)
                else:
                    cotangent = torch.add(adjoint_F, adjoint_p, alpha=second_kick)
                    cotangent_dot_forces = None
                    adjoint_F = None
                adjoint_x = adjoint_x + pull(saved, cotangent, (index, 1), cotangent_dot_forces)
                del cotangent
                saved = None
            momentum_dot_force = None
            adjoint_half = adjoint_p
            with torch.no_grad():
                # The forward pass's arithmetic undone, with its factors rounded to the
                # dtype as it used them; one fused op per update.
                half = torch.sub(momenta, forces, alpha=second_kick)
                positions = torch.sub(positions, half, alpha=drift)
            if migrate is not None:
                # Back to the particles' homes at a_i, the adjoints travelling with them.
                positions, half, adjoint_x, adjoint_half = migrate(positions, half, adjoint_x, adjoint_half)
            # Drift: x' = x_i + d p_h.
            grad_table[index, 3] += _dot(adjoint_x, half)
            adjoint_half = torch.add(adjoint_half, adjoint_x, alpha=drift)
            if index == 0 and given:
                # F_0 was an input (the last force of an earlier integration): nothing to
                # re-evaluate or pull back here; its adjoint k1_0 lambda_h goes back to it.
                adjoint_p = adjoint_half
                kick_after = first_kick
                break
            # First kick: p_h = p_i + k1 F_i; its adjoint is added at the next (earlier)
            # step from <lambda_p, F_i>, lambda_p = lambda_h.
            if fused:
                # F_i (i > 0) is F_{(i-1)+1}: cotangent (k1_i + k2_{i-1}) lambda_h, its ``a``
                # adjoint to a_end of step i - 1; F_0's is k1_0 lambda_h, to a_start of step 0.
                factor = first_kick + rounded[index - 1][2] if index > 0 else first_kick
                dots = []

                def dot_with_forces(value, direction=adjoint_half, factor=factor, dots=dots):
                    # <lambda_p, F_i>, kept for the kick adjoints: the one dot of the step.
                    dots.append(_dot(direction, value))
                    return dots[0] * factor

                forces, grad_x, grad_a, grads = force.evaluate_and_pull(
                    positions, table[index, 0], adjoint_half * factor, parameters, dot_with_forces
                )
                add_adjoints(grad_a, grads, (index - 1, 1) if index > 0 else (0, 0))
                adjoint_x = adjoint_x + grad_x
                del grad_x
                momentum_dot_force = dots[0] if dots else None
            else:
                forces, saved = force.evaluate(positions, table[index, 0])
            with torch.no_grad():
                momenta = torch.sub(half, forces, alpha=first_kick)
            adjoint_p = adjoint_half
            kick_after = first_kick
        if given:
            # In the layout of the inputs, where F_0 is: <lambda_p, F_0> for k1_0's adjoint.
            adjoint_x, adjoint_p = setup["restore"](positions, adjoint_x, adjoint_p)
            grad_table[0, 2] += _dot(adjoint_p, given[0])
            return (None, adjoint_x, adjoint_p, adjoint_p * kick_after, grad_table, *grad_parameters)
        # F_0 = force(x_0, a_0) was computed inside the Function too.
        if momentum_dot_force is None:
            momentum_dot_force = _dot(adjoint_p, forces)
        grad_table[0, 2] += momentum_dot_force
        if saved is not None:
            adjoint_x = adjoint_x + pull(saved, adjoint_p * kick_after, (0, 0), momentum_dot_force * kick_after)
        adjoint_x, adjoint_p = setup["restore"](positions, adjoint_x, adjoint_p)
        return (None, adjoint_x, adjoint_p, None, grad_table, *grad_parameters)


# Entries summed in the tensor's dtype before the float64 accumulation in _dot (64
# particles' 3 components).
_DOT_RUN = 192


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b)`` as a 0-d float64 tensor, the long sum accumulated in float64: the
    step-factor adjoints are sums over every particle with cancellations, which a float32
    accumulation of the whole sum would round to ~1e-4 relative.

    The products are first summed in their own dtype over runs of ``_DOT_RUN``
    consecutive entries, and only those partial sums are converted and added in
    float64: converting every product to float64 (``torch.sum(a * b, dtype=float64)``)
    writes a float64 copy of the whole product, which cost more than the rest of the
    dot. A short run adds a rounding of the order of the products' own (measured on
    random float32 data: 3e-8 relative against 2e-8, for a sum 1000x smaller than the
    sum of its terms' magnitudes)."""
    product = (a * b).reshape(-1)
    whole = product.numel() - product.numel() % _DOT_RUN
    partial = product[:whole].view(-1, _DOT_RUN).sum(dim=1)
    return partial.sum(dtype=torch.float64) + product[whole:].sum(dtype=torch.float64)


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
    sources: Sequence[torch.Tensor] | None = None,
    forces: torch.Tensor | None = None,
    keep_last_force: bool = True,
):
    """Integrate the kick-drift-kick loop with gradients by the adjoint method.

    Args:
        positions, momenta: ``(B, N, 3)`` at ``factors[0].a_start`` (any units the
            ``force_function`` understands; torchpm uses force-mesh cells).
        factors: the :class:`~torchpm.pm.StepFactors` of every step (0-d tensors; their
            gradients flow back to whatever they were computed from, e.g. the cosmology).
        force_function: ``force_function(positions, a) -> forces (B, N, 3)``, with ``a`` a
            0-d tensor. It is called again in the backward pass, so it must be a pure
            function of its arguments and of ``parameters``. A plain callable is
            differentiated with autograd (:class:`AutogradForce`); an object with
            ``evaluate`` and ``pull_back`` methods like those of :class:`AutogradForce`
            supplies its own pull-back, and one that also has ``evaluate_and_pull``
            (:class:`ParticleMeshForce`) evaluates and pulls back each force of the
            backward pass in one call.
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
        sources: for each of ``parameters``, the tensor its gradient is passed on to
            (default: the parameter itself). For a tensor with a history that would
            otherwise be walked at every step of the backward pass (saved tensors are
            freed after the first walk): the forces read a detached copy, given in
            ``parameters``, and the tensor itself, given here, receives the total once.
        forces: the forces at the start, ``force_function(positions, a_start)``, when
            they are known already: the forces an earlier integration ended with, so
            that integrations chained at step ends evaluate no force twice. They are
            not evaluated again, in the forward pass or the backward pass, and their
            gradient (the first kick's factor times the adjoint of the momenta) goes
            back to them, in their layout, so the earlier integration's backward pass
            takes it as the adjoint of its last force.
        keep_last_force: keep what the pull-back of the last force needs (its force
            field and density spectrum on the mesh) from the forward pass, so the
            backward pass starts without evaluating it again (default). False: the
            backward pass evaluates it once more and the forward pass keeps nothing on
            the mesh, for integrations chained one after another, whose outputs the
            graph keeps until the backward pass.

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
    if forces is not None and (not isinstance(forces, torch.Tensor) or forces.shape != positions.shape):
        raise ValueError(
            "adjoint_integrate: `forces` must be None or the forces at the start, shaped like `positions` "
            f"{tuple(positions.shape)}, got "
            f"{tuple(forces.shape) if isinstance(forces, torch.Tensor) else type(forces).__name__}"
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
    if not (hasattr(force_function, "evaluate") and hasattr(force_function, "pull_back")):
        force_function = AutogradForce(force_function)
    setup = dict(
        force=force_function,
        step=step,
        migrate=migrate,
        callback=callback,
        parameters=parameters,
        keep_last_force=bool(keep_last_force),
        restore=restore or (lambda positions, adjoint_x, adjoint_p: (adjoint_x, adjoint_p)),
    )
    if sources is None:
        sources = parameters
    sources = list(sources)
    if len(sources) != len(parameters) or any(
        not isinstance(s, torch.Tensor) or s.shape != p.shape for s, p in zip(sources, parameters)
    ):
        raise ValueError(
            "adjoint_integrate: `sources` must hold one tensor per parameter, of its shape, got "
            f"{[tuple(getattr(s, 'shape', ())) for s in sources]} for {[tuple(p.shape) for p in parameters]}"
        )
    return _AdjointKickDriftKick.apply(setup, positions, momenta, forces, table, *sources)
