"""The bispectrum of a mesh field: the FFT (shell-product) estimator, on one device and on a
process grid, differentiable in the field.

Convention (DESIGN.md's P(k) = V/N^2 <|DFT delta|^2>, ``N`` cells in a box of volume
``V``): with ``delta_k`` the unnormalised DFT of the field and the continuous transform
``delta(k) = (V/N) delta_k``, ``<delta(k1) delta(k2) delta(k3)> = V B`` for
``k1 + k2 + k3 = 0`` gives::

    B(k1, k2, k3) = V^2 / N^3 < delta_k1 delta_k2 delta_k3 >_triangles

the mean over the closed triangles: the triples of modes of the full DFT
``(k1, k2, k3)``, ``k_n`` in shell ``n`` (``edge_n <= |k_n| < edge_{n+1}``),
``k1 + k2 + k3 = 0`` as vectors. A triple and its mirror ``(-k1, -k2, -k3)`` are
two triangles, and two sides in one shell are counted in both orders.

Estimator. For each shell ``i``, ``I_i(x) = IDFT[delta_k 1_i(k)]`` and ``N_i(x) =
IDFT[1_i(k)]`` (``1/N``-normalised inverse). Summing over the cells::

    sum_x I_1 I_2 I_3 = 1/N^2 sum_{k1 + k2 + k3 = 0 mod grid} delta_k1 delta_k2 delta_k3

and ``sum_x N_1 N_2 N_3`` is ``1/N^2`` times the number of those triples, so
``B = V^2/N^3 * sum_x I_1 I_2 I_3 / sum_x N_1 N_2 N_3`` and the number of triangles
is ``N^2 sum_x N_1 N_2 N_3``. The sum over the cells closes the triangles only modulo
the grid: three wavevectors whose components along an axis add up to ``+-n`` cells
(possible once the three shells' upper edges add up to more than ``2 pi n / L``
along it, e.g. three sides of ``n/3`` cells) would be counted too. Along such axes
the fields are also evaluated half a cell away (``delta_k`` times ``exp(i w/2)``,
with ``w`` the mode's wavevector in radians per cell); the sum over the shifts
multiplies a triangle closing exactly by 2 and one closing only modulo the grid by
``1 + exp(i pi) = 0``, so only geometric triangles remain (the interlacing trick
applied to the shell fields). A configuration needs up to ``2^3`` evaluations, and
none extra when its three shells' upper edges add up to at most ``2 pi n / L`` along
every axis (twice that axis's Nyquist frequency: e.g. shells below two thirds of the
Nyquist frequency). Shells lie in ``(0, k_Nyquist]`` (the smallest Nyquist frequency
of the axes), so no shell holds a mode on a Nyquist plane, whose wavevector would be
ambiguous.

The reduced bispectrum is ``Q = B / (P1 P2 + P2 P3 + P3 P1)`` with ``P_n`` the power
spectrum (:func:`torchpm.analysis.power_spectrum`'s estimator) in the shell of side
``n``. Poisson shot noise (``shot_noise = S``, or ``n_particles`` for ``S = V /
n_particles = 1 / nbar``) is subtracted as ``B - S (P1 + P2 + P3) - S^2`` with the
``P_n`` already shot-noise subtracted (``P_n = P_measured - S``), the expectation of a
Poisson sample's estimator (``(P1 + P2 + P3)/nbar + 1/nbar^2`` in terms of the true
power); the shell's ``P_n`` stands for the mean of ``P(k_n)`` over the triangles (the
same when P varies little across a shell).

Distributed fields: as :func:`torchpm.analysis.power_spectrum`, pass the field's ``mesh``
(a :class:`~torchpm.distributed.PencilDecomposition`, e.g. ``sim.force_mesh``) and this
rank's block; the shell fields come from the mesh's inverse transform and the sums over
the cells are all-reduced, so every rank gets the global result.
"""

from __future__ import annotations

import itertools
import math
import numbers
import warnings
from typing import NamedTuple, Sequence

import torch

from ._transforms import is_vmapped
from .analysis import _bin_edges, _measure, _outside_torchpm, _shot_noise_argument, _window_argument
from .fourier import window_of
from .mesh import LocalMesh, as_box_size
from .ops._arguments import order_number

__all__ = ["Bispectrum", "bispectrum", "triangle_configurations"]


class Bispectrum(NamedTuple):
    """Binned bispectrum of ``n`` triangle configurations (sides ``k1``, ``k2``, ``k3``).

    ``k``: ``(n, 3)`` mean ``|k_i|`` (h/Mpc) of each side over the configuration's
    triangles; ``bispectrum``: ``(B, n)`` or ``(n,)`` in (Mpc/h)^6; ``triangles``: ``(n,)``
    int64, the number of closed triangles (mode triples); ``reduced``: ``Q``, shaped as
    ``bispectrum`` (NaN where ``P1 P2 + P2 P3 + P3 P1 = 0``, with a warning);
    ``power``: ``(B, n, 3)`` or ``(n, 3)``, the power spectrum in each side's shell
    ((Mpc/h)^3, shot noise subtracted); ``shells``: ``(n, 3)`` int64, each side's shell
    (an index into ``edges``); ``edges``: ``(n_bins + 1,)`` the shells' edges in h/Mpc."""

    k: torch.Tensor
    bispectrum: torch.Tensor
    triangles: torch.Tensor
    reduced: torch.Tensor
    power: torch.Tensor
    shells: torch.Tensor
    edges: torch.Tensor


# Complex entries held by one batch of shell transforms: the shells are transformed a
# few at a time so that the complex temporaries stay near this size.
_SHELL_CHUNK = 1 << 18


def triangle_configurations(edges) -> list[tuple[int, int, int]]:
    """The default configurations of shells with edges ``edges`` (h/Mpc): every
    ``(i, j, l)`` with ``i <= j <= l`` whose shell centres ``c`` satisfy the triangle
    condition ``c_l <= c_i + c_j``."""
    edges = torch.as_tensor(edges, dtype=torch.float64).reshape(-1)
    centres = (0.5 * (edges[1:] + edges[:-1])).tolist()
    return [(i, j, l) for i, j, l in itertools.combinations_with_replacement(range(len(centres)), 3)
            if centres[l] <= (centres[i] + centres[j]) * (1 + 1e-12)]


def _nyquist(shape, box) -> float:
    """The smallest Nyquist frequency of the axes, h/Mpc."""
    return min(math.pi * n / b for n, b in zip(shape, box))


def _shell_edges(bins, shape, box) -> torch.Tensor:
    """The shells' edges (float64, CPU) for ``bins``, or a ValueError naming `bins`."""
    k_fundamental = min(2 * math.pi / b for b in box)
    k_nyquist = _nyquist(shape, box)
    if isinstance(bins, numbers.Integral) and not isinstance(bins, bool):
        if int(bins) < 1:
            raise ValueError(f"`bins` must be a positive number of bins or increasing bin edges, got {bins}")
        # (to the Nyquist frequency, not to the corner of the Fourier cube as P(k)'s bins)
        return torch.linspace(0.5 * k_fundamental, k_nyquist, int(bins) + 1, dtype=torch.float64)
    edges = _bin_edges(None, LocalMesh(shape), box, bins, "cpu")
    if bool(edges[0] < 0) or bool(edges[-1] > k_nyquist * (1 + 1e-12)):
        raise ValueError(
            f"`bins` must lie in (0, k_Nyquist] with k_Nyquist = {k_nyquist:.6g} h/Mpc (pi n / L, the smallest "
            f"of the axes), got edges from {float(edges[0]):.6g} to {float(edges[-1]):.6g} h/Mpc: shells beyond "
            "the Nyquist frequency are not sampled in every direction"
        )
    return edges


def _triangles_argument(triangles, n_bins: int) -> list[tuple[int, int, int]]:
    """``triangles`` as a list of 3 shell indices each, or a ValueError naming it."""
    message = (f"`triangles` must be None or a non-empty list of (i, j, l) shell indices, integers in "
               f"[0, {n_bins}) (the number of bins), got {triangles!r}")
    if isinstance(triangles, (str, bytes, bool, numbers.Number)):
        raise ValueError(message)
    try:
        values = torch.as_tensor(triangles)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(message) from None
    if values.dim() != 2 or values.shape[1] != 3 or values.shape[0] == 0 or values.dtype == torch.bool \
            or values.is_floating_point() or values.is_complex() or bool((values < 0).any()) \
            or bool((values >= n_bins).any()):
        raise ValueError(message)
    return [tuple(int(v) for v in row) for row in values.tolist()]


class _TrianglePlan(torch.nn.Module):
    """Which shell fields each triangle configuration needs, and their sums over the cells.

    ``triangles``: sorted shell triples ``a <= b <= c``; ``index``: the shell of each
    entry of this rank's rfft block (``n_bins`` for none). For each shift (a set of axes
    along which the fields are evaluated half a cell away) the plan holds the shells
    needed and the configurations grouped by their first two shells, so that the third
    shells of a group are one matrix product. Every quantity that sets a collective's
    size (shells, chunks, batch) is global, so every rank of a grid runs the same
    transforms.

    Its tensors are non-persistent integer buffers, so the plan follows ``.to(device)``
    and a ``.to(dtype)`` leaves it exact: the shifts' phases and weights are made from
    the integer frequencies and shift counts where they are used."""

    def __init__(self, mesh, box, edges, index, triangles):
        super().__init__()
        self.mesh = mesh
        self.count = len(triangles)
        device = index.device
        self.register_buffer("index", index, persistent=False)
        # Integer frequencies of this rank's rfft block (fftfreq times n; rfftfreq along z).
        shape = mesh.global_shape
        for axis, (n, local, offset) in enumerate(zip(shape, mesh.local_fourier_shape, mesh.local_fourier_offset)):
            full = torch.arange(n // 2 + 1) if axis == 2 else torch.fft.ifftshift(torch.arange(n) - n // 2)
            self.register_buffer(f"frequencies_{axis}", full[offset:offset + local].to(device), persistent=False)
        upper = edges[1:].tolist()
        aliased = []
        for a, b, c in triangles:
            reach = upper[a] + upper[b] + upper[c]  # h/Mpc; |k_d| of a side stays below its upper edge
            aliased.append(frozenset(d for d in range(3) if reach * box[d] / (2 * math.pi) > shape[d] * (1 - 1e-10)))
        # (each sum is weighted by 2^-(number of shifted axes))
        self.register_buffer("aliased_axes", torch.tensor([len(axes) for axes in aliased], dtype=torch.int64,
                                                          device=device), persistent=False)
        # Per shift: the shifted axes, and groups (a, b, third, members) of Python ints and
        # slices into the shift's buffers shells_s, thirds_s and members_s.
        self.shifts = []
        for size in range(4):
            for shift in itertools.combinations(range(3), size):
                members = [t for t, axes in enumerate(aliased) if set(shift) <= axes]
                if not members:
                    continue
                shells = sorted({s for t in members for s in triangles[t]})
                position = {s: p for p, s in enumerate(shells)}
                groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
                for t in members:
                    a, b, c = triangles[t]
                    groups.setdefault((position[a], position[b]), []).append((position[c], t))
                plan_groups, thirds, ordered = [], [], []
                for (a, b), items in groups.items():
                    items.sort()
                    third = [p for p, _ in items]
                    if third == list(range(third[0], third[0] + len(third))):
                        third_index = slice(third[0], third[0] + len(third))
                    else:
                        third_index = (len(thirds), len(thirds) + len(third))
                        thirds += third
                    plan_groups.append((a, b, third_index, (len(ordered), len(ordered) + len(items))))
                    ordered += [t for _, t in items]
                s = len(self.shifts)
                self.register_buffer(f"shells_{s}", torch.tensor(shells, dtype=torch.int64, device=device),
                                     persistent=False)
                self.register_buffer(f"thirds_{s}", torch.tensor(thirds, dtype=torch.int64, device=device),
                                     persistent=False)
                self.register_buffer(f"members_{s}", torch.tensor(ordered, dtype=torch.int64, device=device),
                                     persistent=False)
                self.shifts.append((shift, plan_groups))
        p0, p1 = mesh.grid_shape
        self.entries = max(1, math.prod(mesh.fourier_shape) // (p0 * p1))

    @property
    def device(self) -> torch.device:
        return self.index.device

    def wavevectors(self):
        """``(w_x, w_y, w_z)`` float64 in radians per cell, broadcastable against this rank's
        rfft block (:meth:`~torchpm.mesh.Mesh.wavevectors`, made from the integer buffers)."""
        local = self.mesh.local_fourier_shape
        result = []
        for axis, n in enumerate(self.mesh.global_shape):
            shape = [1, 1, 1]
            shape[axis] = local[axis]
            frequencies = getattr(self, f"frequencies_{axis}").to(torch.float64)
            result.append((2 * math.pi * (frequencies / n)).reshape(shape))
        return tuple(result)

    def weights(self) -> torch.Tensor:
        return torch.pow(0.5, self.aliased_axes.to(torch.float64))

    def _shift(self, s):
        """``(phase or None, shells, groups)`` of shift ``s``, each group ``(a, b, third,
        members)`` with ``third`` a slice or an index tensor and ``members`` an index tensor."""
        axes, plan_groups = self.shifts[s]
        phase = None
        if axes:
            w = self.wavevectors()
            phase = torch.exp(1j * (sum(w[d] for d in axes) * 0.5)).expand(*self.mesh.local_fourier_shape)
        thirds, members = getattr(self, f"thirds_{s}"), getattr(self, f"members_{s}")
        groups = [(a, b, third if isinstance(third, slice) else thirds[third[0]:third[1]], members[start:end])
                  for a, b, third, (start, end) in plan_groups]
        return phase, getattr(self, f"shells_{s}"), groups

    def _chunk(self, batch: int) -> int:
        return max(1, _SHELL_CHUNK // (batch * self.entries))

    def _factors(self, shells, phase, conjugate=False):
        """``(len(shells), *local_fourier_shape)``: the shells' indicators times the phase."""
        masks = self.index.unsqueeze(0) == shells.view(-1, 1, 1, 1)
        if phase is None:
            return masks.to(torch.complex128)
        phase = phase.conj() if conjugate else phase
        return torch.where(masks, phase, torch.zeros((), dtype=phase.dtype, device=phase.device))

    def fields(self, coefficients, shells, phase):
        """``(C, len(shells), M)`` float64: ``IDFT[coefficients 1_shell phase]`` for each
        shell, ``M`` the cells of this rank's block."""
        batch = coefficients.shape[0]
        cells = math.prod(self.mesh.local_real_shape)
        out = torch.empty(batch, len(shells), cells, dtype=torch.float64, device=self.device)
        step = self._chunk(batch)
        for start in range(0, len(shells), step):
            end = min(len(shells), start + step)
            factors = self._factors(shells[start:end], phase)
            out[:, start:end] = self.mesh.irfftn(coefficients.unsqueeze(1) * factors).reshape(batch, end - start, cells)
        return out

    def adjoint(self, gradients, shells, phase):
        """The vector-Jacobian product of :meth:`fields` in its coefficients: for the
        ``1/N`` inverse real DFT, ``DFT[g] * (1 or 2) / N``, the weight of each rfft entry
        (its Hermitian partner counted), as torch's own ``irfftn`` backward."""
        batch = gradients.shape[0]
        weight = self.mesh.hermitian_weights(dtype=torch.float64, device=self.device) / self.mesh.size
        result = torch.zeros(batch, *self.mesh.local_fourier_shape, dtype=torch.complex128, device=self.device)
        step = self._chunk(batch)
        for start in range(0, len(shells), step):
            end = min(len(shells), start + step)
            block = gradients[:, start:end].reshape(batch, end - start, *self.mesh.local_real_shape)
            transformed = self.mesh.rfftn(block) * weight
            result = result + (transformed * self._factors(shells[start:end], phase, conjugate=True)).sum(1)
        return result

    def sums(self, coefficients):
        """``(C, n)``: this rank's ``sum_x I_a I_b I_c`` of each configuration, each shift's
        sum weighted by ``2^-(number of shifted axes)``."""
        out = torch.zeros(coefficients.shape[0], self.count, dtype=torch.float64, device=self.device)
        for s in range(len(self.shifts)):
            phase, shells, groups = self._shift(s)
            fields = self.fields(coefficients, shells, phase)
            for a, b, third, members in groups:
                pair = fields[:, a] * fields[:, b]
                out[:, members] += torch.bmm(fields[:, third], pair.unsqueeze(-1)).squeeze(-1)
            del fields, pair  # (before the next shift's fields are made)
        return out * self.weights()

    def gradient(self, coefficients, grad):
        """The vector-Jacobian product of :meth:`sums` in the coefficients (the shell
        fields recomputed, one shift at a time)."""
        # Under torch.func.jacrev (vmap over the cotangents) `grad` carries a batch dimension.
        batched = is_vmapped(grad)
        grad = grad * self.weights()
        result = torch.zeros_like(coefficients)
        for s in range(len(self.shifts)):
            phase, shells, groups = self._shift(s)
            fields = self.fields(coefficients, shells, phase)
            field_grad = torch.zeros_like(fields)
            if batched:  # (the in-place sums below need a target batched as `grad` is)
                field_grad = field_grad + torch.zeros_like(grad).sum()
            for a, b, third, members in groups:
                g = grad[:, members]  # (C, n_third)
                weighted = torch.bmm(g.unsqueeze(1), fields[:, third]).squeeze(1)  # sum_c g_c I_c
                pair = (fields[:, a] * fields[:, b]).unsqueeze(1)
                if batched:  # (the fused in-place ops have no batching rule: plain sums)
                    field_grad[:, a] += fields[:, b] * weighted
                    field_grad[:, b] += fields[:, a] * weighted
                    field_grad.index_add_(1, torch.arange(field_grad.shape[1], device=field_grad.device)[third],
                                          g.unsqueeze(-1) * pair)
                    continue
                field_grad[:, a].addcmul_(fields[:, b], weighted)
                field_grad[:, b].addcmul_(fields[:, a], weighted)
                if isinstance(third, slice):  # (in place: no temporary of the third shells' size)
                    field_grad[:, third].baddbmm_(g.unsqueeze(-1), pair)
                else:
                    field_grad.index_add_(1, third, g.unsqueeze(-1) * pair)
            del fields, weighted, pair
            result = result + self.adjoint(field_grad, shells, phase)
            del field_grad
        return result

    def counts(self, k_magnitude):
        """``(n,)`` ``sum_x N_a N_b N_c`` and ``(n, 3)`` ``sum_x K_a N_b N_c`` (and the two
        other sides) with ``K = IDFT[|k| 1_shell]``: the number of triangles and the sums
        of their sides' lengths, over ``N^2``, on this rank's block."""
        coefficients = torch.stack([torch.ones_like(k_magnitude), k_magnitude]).to(torch.complex128)
        count = torch.zeros(self.count, dtype=torch.float64, device=self.device)
        sides = torch.zeros(self.count, 3, dtype=torch.float64, device=self.device)
        products = None
        for s in range(len(self.shifts)):
            phase, shells, groups = self._shift(s)
            ones, lengths = self.fields(coefficients, shells, phase)
            if products is None:
                products = torch.empty(3, ones.shape[-1], dtype=torch.float64, device=self.device)
            for a, b, third, members in groups:
                torch.mul(ones[a], ones[b], out=products[0])
                torch.mul(lengths[a], ones[b], out=products[1])
                torch.mul(ones[a], lengths[b], out=products[2])
                by_ones = products @ ones[third].T  # (3, n_third): one pass over the third shells' fields
                count[members] += by_ones[0]
                sides[members, :2] += by_ones[1:].T
                sides[members, 2] += lengths[third] @ products[0]
            del ones, lengths
        weights = self.weights()
        return count * weights, sides * weights.unsqueeze(-1)


class _TriangleSums(torch.autograd.Function):
    """``sum_x I_a I_b I_c`` per configuration from the field's transform. Only the
    transform is kept for the backward, which recomputes the shell fields (memory: one
    set of shell fields at a time, not one per shift and product). The backward is made
    of differentiable operations, so under ``create_graph=True`` it is recorded and the
    sums can be differentiated again."""

    @staticmethod
    def forward(coefficients, plan):
        return plan.sums(coefficients)

    @staticmethod
    def setup_context(ctx, inputs, output):
        coefficients, plan = inputs
        ctx.plan = plan
        ctx.save_for_backward(coefficients)

    @staticmethod
    def backward(ctx, grad):
        (coefficients,) = ctx.saved_tensors
        return ctx.plan.gradient(coefficients, grad), None


class _Tables(torch.nn.Module):
    """Everything of a bispectrum measurement that does not depend on the field, for one
    mesh, box, set of shells and configurations, window and shot noise: each Fourier
    entry's shell, each shell's mode count, the triangle plan, the triangle counts and
    mean side lengths. Built once (on a grid collective: the mode counts and the triangle
    counts are all-reduced), then :meth:`forward` measures any number of fields; the
    function :func:`bispectrum` builds one per call, :class:`torchpm.nn.BispectrumEstimator`
    keeps one.

    Non-persistent buffers: ``k`` ``(n, 3)`` and ``edges`` (float64 as built; the only
    floating-point ones, reported, never computed with, so a ``.to(dtype)`` loses nothing
    the measurement uses), ``triangles`` ``(n,)``, ``shells`` ``(n, 3)``, ``modes``
    ``(n_bins,)``, ``hermitian`` (the rfft entries' mode weights) int64, and the plan's.

    ``configurations``: the ``(i, j, l)`` shell triples, or None for the default ones
    (:func:`triangle_configurations`), of which those without a closed triangle are left
    out; raises ValueError (on every rank of a grid alike: it is decided from all-reduced
    counts) for an empty shell that a configuration uses or a given configuration without
    a closed triangle."""

    def __init__(self, function: str, mesh, box, edges, configurations, window, noise: float, device):
        super().__init__()
        self.mesh, self.box, self.window, self.noise, self.function = mesh, tuple(box), window, float(noise), function
        n_bins = edges.numel() - 1
        w = mesh.wavevectors(dtype=torch.float64, device=device)
        k_axes = [wi * n / b for wi, n, b in zip(w, mesh.global_shape, box)]
        k_magnitude = torch.sqrt(k_axes[0] ** 2 + k_axes[1] ** 2 + k_axes[2] ** 2)
        edges_here = edges.to(device)
        index = torch.bucketize(k_magnitude, edges_here, right=True) - 1
        index = torch.where((index >= 0) & (index < n_bins) & (k_magnitude > 0), index, torch.full_like(index, n_bins))
        hermitian = mesh.hermitian_weights(dtype=torch.float64, device=device)
        modes = torch.zeros(n_bins + 1, dtype=torch.float64, device=device).index_add(
            0, index.reshape(-1), hermitian.expand(*mesh.local_fourier_shape).reshape(-1))
        modes = mesh.all_reduce(modes[:n_bins])  # (every rank's modes: the global counts)

        default = configurations is None
        if default:
            configurations = triangle_configurations(edges)
        used = sorted({s for triple in configurations for s in triple})
        empty = [s for s in used if not bool(modes[s] > 0)]
        if empty:
            ranges = ", ".join(f"[{float(edges[s]):.4g}, {float(edges[s + 1]):.4g})" for s in empty[:5])
            raise ValueError(
                f"{function}: {len(empty)} of the shells the configurations use hold no mode of the "
                f"{'x'.join(map(str, mesh.global_shape))} mesh (h/Mpc: {ranges}{', ...' if len(empty) > 5 else ''}); "
                "pass wider bins (the modes are 2 pi / L apart) or configurations without them"
            )

        # Sorted triples (the sums are symmetric); each side is mapped back to its position.
        orders = [sorted(range(3), key=lambda p: triple[p]) for triple in configurations]
        sorted_triples = [tuple(triple[p] for p in order) for triple, order in zip(configurations, orders)]
        plan = _TrianglePlan(mesh, box, edges, index, sorted_triples)
        with torch.no_grad():
            count, sides = plan.counts(k_magnitude)
            totals = mesh.all_reduce(torch.cat([count.unsqueeze(-1), sides], dim=-1)) * mesh.size**2
        counted = torch.round(totals[:, 0])
        closed = (counted > 0).tolist()
        if not all(closed):
            if not default:
                missing = [configurations[t] for t, ok in enumerate(closed) if not ok]
                raise ValueError(
                    f"{function}: {len(missing)} of the configurations in `triangles` have no closed triangle on this "
                    f"mesh ({', '.join(map(str, missing[:5]))}{', ...' if len(missing) > 5 else ''}; the shells' edges "
                    f"are {[round(float(e), 6) for e in edges]} h/Mpc): leave them out"
                )
            keep = [t for t, ok in enumerate(closed) if ok]
            if not keep:
                raise ValueError(
                    f"{function}: no configuration of the shells (edges {[round(float(e), 6) for e in edges]} h/Mpc) "
                    f"has a closed triangle on the {'x'.join(map(str, mesh.global_shape))} mesh; pass more or wider "
                    "bins"
                )
            configurations = [configurations[t] for t in keep]
            orders = [orders[t] for t in keep]
            sorted_triples = [sorted_triples[t] for t in keep]
            totals, counted = totals[keep], counted[keep]
            plan = _TrianglePlan(mesh, box, edges, index, sorted_triples)
        self.plan = plan
        self.configurations = [tuple(triple) for triple in configurations]
        # Mean side lengths, back in each configuration's own order.
        sorted_k = totals[:, 1:] / counted.unsqueeze(-1)
        position = torch.tensor([[order.index(p) for p in range(3)] for order in orders], dtype=torch.int64,
                                device=device)
        self.register_buffer("k", torch.gather(sorted_k, 1, position), persistent=False)
        self.register_buffer("edges", edges_here, persistent=False)
        self.register_buffer("triangles", counted.to(torch.int64), persistent=False)
        self.register_buffer("shells", torch.tensor(configurations, dtype=torch.int64, device=device).reshape(-1, 3),
                             persistent=False)
        self.register_buffer("modes", torch.round(modes).to(torch.int64), persistent=False)
        self.register_buffer("hermitian", hermitian.to(torch.int64), persistent=False)

    def forward(self, field_k: torch.Tensor):
        """``(B, n)`` B, ``(B, n)`` Q and ``(B, n, 3)`` the sides' P, float64, from ``field_k``:
        the complex128 transform ``(B, *local_fourier_shape)`` of the field (this rank's
        block of it on a grid; every rank gets the global result)."""
        mesh, plan, box = self.mesh, self.plan, self.box
        n_bins = self.modes.numel()
        batch = field_k.shape[0]
        if self.window is not None:
            field_k = field_k / window_of(plan.wavevectors(), self.window)
        # The shells' power sums and the triangle sums: one all-reduce for both.
        values = (field_k.real**2 + field_k.imag**2) * self.hermitian.to(torch.float64)
        power_sums = values.new_zeros(batch, n_bins + 1).index_add(1, plan.index.reshape(-1), values.reshape(batch, -1))
        totals = mesh.all_reduce(torch.cat([power_sums[:, :n_bins], _TriangleSums.apply(field_k, plan)], dim=1))
        modes = self.modes.to(torch.float64)
        # (a shell without modes is used by no configuration: its entry is never read)
        power_full = totals[:, :n_bins] * (math.prod(box) / mesh.size**2) / torch.where(modes > 0, modes, 1.0) \
            - self.noise
        value = totals[:, n_bins:] * (math.prod(box) ** 2 / mesh.size) / self.triangles.to(torch.float64)
        power = power_full[:, self.shells]  # (B, n, 3)
        if self.noise:
            value = value - self.noise * power.sum(-1) - self.noise**2
        p1, p2, p3 = power.unbind(-1)
        denominator = p1 * p2 + p2 * p3 + p3 * p1
        defined = denominator != 0
        if not bool(defined.all()):
            undefined = [self.configurations[t] for t in sorted(set((~defined).nonzero()[:, 1].tolist()))]
            warnings.warn(
                f"{self.function}: the reduced bispectrum Q is undefined (NaN) for {len(undefined)} configurations "
                f"whose shells hold no power (P1 P2 + P2 P3 + P3 P1 = 0): {', '.join(map(str, undefined[:5]))}"
                f"{', ...' if len(undefined) > 5 else ''}",
                stacklevel=_outside_torchpm(),
            )
        reduced = torch.where(defined, value / torch.where(defined, denominator, torch.ones_like(denominator)),
                              torch.full_like(value, math.nan))
        return value, reduced, power


def _settings(function: str, shape, box_size, bins, triangles, compensate_cic, window, shot_noise, n_particles):
    """The arguments that do not depend on the field, checked: ``(box, edges,
    configurations, window, noise, key, error)`` with ``configurations`` None for the
    default ones, ``window`` the window's name (or None), ``noise`` the shot noise to
    subtract, ``key`` the configurations as the ranks of a grid compare them and
    ``error`` the first problem found (a message or an exception; None if none), for
    the caller to raise with the ranks' other errors. ``shape``: the global mesh's, or
    None where unknown (then ``edges`` is None)."""
    noise, error = _shot_noise_argument(shot_noise, n_particles, box_size)
    if window is not None and error is None:
        try:
            order_number(window, function, "window")
        except (TypeError, ValueError) as exc:
            error = exc
    try:
        window = _window_argument(window, compensate_cic)
    except (TypeError, ValueError) as exc:
        window, error = None, error or exc
    edges, configurations = None, None
    try:
        box = as_box_size(box_size)
    except ValueError as exc:
        box, error = None, error or exc
    if box is not None and shape is not None:
        try:
            edges = _shell_edges(bins, shape, box)
            if triangles is not None:
                configurations = _triangles_argument(triangles, edges.numel() - 1)
        except ValueError as exc:
            error = error or exc
    key = None if triangles is None or configurations is None else repr(configurations)
    return box, edges, configurations, window, noise, key, error


def bispectrum(
    field: torch.Tensor,
    box_size: float | Sequence[float],
    *,
    bins=None,
    triangles=None,
    compensate_cic: bool = False,
    window: str | None = None,
    shot_noise: float | None = None,
    n_particles: int | None = None,
    mesh=None,
) -> Bispectrum:
    """Bispectrum ``B(k1, k2, k3)`` and reduced bispectrum ``Q`` of a field in triangles of
    shells of |k| (the estimator and its normalisation: the module's docstring).

    Args:
        field: ``(nx, ny, nz)`` or ``(B, nx, ny, nz)`` real field (an overdensity; the
            ``k = 0`` mode is in no shell). float32 fields are measured in float64.
        box_size: box side(s) in Mpc/h.
        bins: the shells: None (width ``2 pi / L`` centred on multiples of it, up to the
            Nyquist frequency, as :func:`~torchpm.analysis.power_spectrum`'s), a number of
            equal-width shells from ``pi / L`` to the Nyquist frequency, or edges in h/Mpc
            within ``[0, k_Nyquist]`` (``k_Nyquist = min_i pi n_i / L_i``). An empty shell
            that a configuration uses is an error.
        triangles: the configurations, ``(i, j, l)`` shell indices (any order; the
            result's sides follow it); None: every ``i <= j <= l`` whose shell centres
            satisfy ``c_l <= c_i + c_j``, leaving out those without a closed triangle
            (:func:`triangle_configurations`). A given configuration without any closed
            triangle is an error.
        window: the mass-assignment window the field was painted with (``"ngp"``,
            ``"cic"``, ``"tsc"``, ``"pcs"``): each mode is divided by ``W = prod
            sinc^p(w/2pi)`` (the powers by ``W^2``), as for P(k). ``compensate_cic``: the
            same as ``window="cic"``. Interlacing: paint with
            :func:`~torchpm.analysis.paint_density` ``(interlacing=True)``.
        shot_noise: ``S`` in (Mpc/h)^3, or ``n_particles`` for ``S = V / n_particles``:
            subtract Poisson noise, ``S (P1 + P2 + P3) + S^2`` from B and ``S`` from the
            ``P_n`` (see the module's docstring).
        mesh: the mesh the field lives on (default: a :class:`~torchpm.mesh.LocalMesh`
            of the field's shape); on a process grid, the field is this rank's block and
            every rank gets the global result.

    Cost: for each shell, one inverse FFT of the batch (up to 8 per shell for shells
    beyond two thirds of the Nyquist frequency, see the module's docstring), plus one
    product over the mesh per configuration and batch member; the number of
    configurations grows as ``n_bins^3``. Memory, whatever the number of configurations:
    the triangle counts hold two float64 real fields of this rank's block per shell, then
    the bispectrum one per shell and batch member (two in the backward pass), so the
    peak is about ``8 max(2, B) n_bins n_cells`` bytes (``2 B`` in the backward) plus
    transients of some ten fields (the transforms run shell by shell on large meshes;
    benchmarks/RESULTS.md has measurements). The shells, the plan and the triangle
    counts do not depend on the field, yet are made at every call (about two thirds of a
    call at 64^3): for many fields on the same mesh with the same settings (a training
    loss), :class:`torchpm.nn.BispectrumEstimator` makes them once and runs the rest of
    this code.

    Differentiable in the field, also twice (the backward recomputes the shell fields).

    Returns:
        :class:`Bispectrum`.
    """
    function = "bispectrum"
    shape = getattr(mesh, "global_shape", None)
    if shape is None and mesh is None and isinstance(field, torch.Tensor) and field.dim() in (3, 4):
        shape = tuple(field.shape[-3:])
    _, edges, configurations, _, noise, key, error = _settings(
        function, shape, box_size, bins, triangles, compensate_cic, window, shot_noise, n_particles)
    mesh, box, window, (field_k,), single = _measure(
        function, {"field": field}, box_size, bins, compensate_cic, window, mesh,
        [("the shot noise subtracted", noise), ("`triangles`", key)], error)
    tables = _Tables(function, mesh, box, edges, configurations, window, noise, field_k.device)
    value, reduced, power = tables(field_k)
    if single:
        value, reduced, power = value[0], reduced[0], power[0]
    return Bispectrum(tables.k, value, tables.triangles, reduced, power, tables.shells, tables.edges)
