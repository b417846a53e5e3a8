"""Background cosmology, linear growth and linear power, differentiable in the parameters.

Units: ``H0 = 1`` (times are in 1/H0), lengths in Mpc/h, wavenumbers in h/Mpc,
power in (Mpc/h)^3. Everything is float64 torch, so gradients flow from any
result into the parameters of :class:`Cosmology` (which are tensors).

Background (radiation neglected, as in the FastPM scheme)::

    E(a)^2 = Om a^-3 + Ok a^-2 + Ode a^(-3(1 + w0 + wa)) exp(3 wa (a - 1)),  Ode = 1 - Om - Ok

Growth (``' = d/da``; integrated in ``ln a`` with a fixed-step order-6 Gauss-Legendre
Runge-Kutta and read by quintic Hermite interpolation, :func:`growth_table`)::

    D1'' = -Q D1' + R D1,   D2'' = -Q D2' + R (D2 - D1^2),
    Q = (3 + dlnE/dlna) / a,  R = 1.5 Om(a) / a^2,

started deep in matter domination with ``D1 = a``, ``D2 = -3/7 a^2`` (plus the
first-order curvature and dark-energy corrections) and rescaled so that both equal 1
at ``a = 1``. FastPM's time functions are
``Gp = D1``, ``gp = dD1/da``, ``Gf = a^3 E dD1/da`` and
``gf = dGf/da = 1.5 Om D1 / (a^2 E)``.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from typing import Callable, NamedTuple

import torch

from .config import DARK_ENERGY_TOLERANCE
from ._transforms import is_vmapped

__all__ = [
    "Cosmology",
    "Planck15",
    "Planck18",
    "GrowthTable",
    "growth_table",
    "eisenstein_hu_transfer",
    "linear_power",
    "PowerTable",
    "sigma_r",
    "resolve_power",
]

_PARAMETERS = ("Omega_c", "Omega_b", "h", "n_s", "sigma8", "Omega_k", "w0", "wa", "f_nl")
T_CMB = 2.7255  # K, the CMB temperature the Eisenstein & Hu fits use
HUBBLE_DISTANCE = 2997.92458  # c / H0 in Mpc/h (c = 299792.458 km/s, H0 = 100 h km/s/Mpc)
_DISTANCE_NODES = 96  # Gauss-Legendre nodes in ln a per distance (exact to rounding for a >= 1e-4)


class Cosmology:
    """A cosmology whose parameters are float64 tensors (gradients flow into them).

    Args:
        Omega_c, Omega_b: cold dark matter and baryon density parameters today.
        h: H0 / (100 km/s/Mpc).
        n_s: primordial spectral index.
        sigma8: rms linear overdensity in spheres of 8 Mpc/h at a = 1.
        Omega_k: curvature density parameter (0: flat).
        w0, wa: dark-energy equation of state ``w(a) = w0 + wa (1 - a)``.
        f_nl: amplitude of local-type primordial non-Gaussianity: the primordial potential
            is ``Phi = phi + f_nl (phi^2 - <phi^2>)`` with ``phi`` Gaussian (0: Gaussian
            initial conditions). ``Phi`` is the potential of matter domination in the
            convention of the CMB constraints, positive where the density is:
            ``delta_L(k, a) = M(k, a) Phi(k)`` with
            ``M = 2/3 (k c/H0)^2 T(k) D_md(a) / Omega_m`` and ``D_md = a`` deep in matter
            domination (:func:`torchpm.ic.primordial_transfer`). Any finite value.

    Each may be a Python number or a tensor (a 0-d tensor that requires grad
    makes every result differentiable in it). Values are checked: densities and
    ``h``, ``sigma8`` must be positive and the dark-energy density
    ``1 - Omega_m - Omega_k`` must not be negative.
    """

    def __init__(
        self,
        Omega_c,
        Omega_b,
        h,
        n_s,
        sigma8,
        Omega_k=0.0,
        w0=-1.0,
        wa=0.0,
        f_nl=0.0,
        *,
        name: str | None = None,
    ):
        values = dict(
            Omega_c=Omega_c, Omega_b=Omega_b, h=h, n_s=n_s, sigma8=sigma8, Omega_k=Omega_k, w0=w0, wa=wa, f_nl=f_nl
        )
        for key, value in values.items():
            # A Python number goes straight to float64: a float32 default would round
            # 0.2589 to 0.25889998674 and spoil finite differences in the parameters.
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
            if is_vmapped(tensor):
                raise NotImplementedError(
                    f"Cosmology: `{key}` is batched by torch.func.vmap, which a Cosmology does not support (its "
                    "parameters are checked, and its growth table built, value by value). Build one Cosmology per "
                    "value in a loop; torch.func.grad, vjp and jacrev over the parameters work"
                )
            if tensor.numel() != 1:
                raise ValueError(f"Cosmology: `{key}` must be a scalar, got shape {tuple(tensor.shape)}")
            if tensor.dim() or tensor.dtype != torch.float64:  # (the caller's 0-d float64 tensor is kept:
                tensor = tensor.reshape(()).to(torch.float64)  # its .grad is read from the attribute too)
            if not bool(torch.isfinite(tensor.detach())):
                raise ValueError(f"Cosmology: `{key}` must be finite, got {float(tensor.detach())}")
            setattr(self, key, tensor)
        value = {key: float(getattr(self, key).detach()) for key in _PARAMETERS}
        for key in ("Omega_c", "h", "sigma8"):
            if value[key] <= 0:
                raise ValueError(f"Cosmology: `{key}` must be positive, got {value[key]}")
        if value["Omega_b"] < 0:
            raise ValueError(f"Cosmology: `Omega_b` must not be negative, got {value['Omega_b']}")
        dark_energy = 1.0 - value["Omega_c"] - value["Omega_b"] - value["Omega_k"]
        # A rounding tolerance: Omega_c = 0.8, Omega_b = 0.2 (Einstein-de Sitter) gives
        # 1 - 0.8 - 0.2 = -5.6e-17, which is no dark energy, not a negative one.
        if dark_energy < -DARK_ENERGY_TOLERANCE:
            raise ValueError(
                "Cosmology: the dark-energy density 1 - Omega_m - Omega_k must not be negative, "
                f"got {dark_energy}"
            )
        if value["Omega_k"] < 0:
            # A closed universe with too little dark energy has H^2 <= 0 somewhere in
            # 0 < a <= 1 (it recollapses or bounces): E(a) and everything built on it
            # would be NaN. E^2 is smooth on (0, 1]: checked on a grid.
            grid = torch.linspace(0.0, 1.0, 4097, dtype=torch.float64)[1:]
            with torch.no_grad():
                e2a3 = self.E_squared(grid).cpu() * grid**3  # (a^3: the deepest point, not the nearest to 0)
            if bool((e2a3 <= 0).any()):
                raise ValueError(
                    f"Cosmology: E(a)^2 = (H/H0)^2 is not positive at a = {float(grid[e2a3.argmin()]):.4g} (Omega_k = "
                    f"{value['Omega_k']}, Omega_m = {value['Omega_c'] + value['Omega_b']}): this closed "
                    "universe has no expanding history from a = 0 to a = 1 (it recollapses or bounces); "
                    "raise the dark-energy density or Omega_k"
                )
        self.name = name

    # Derived parameters ---------------------------------------------------------------
    @property
    def Omega_m(self) -> torch.Tensor:
        """Total matter density parameter today, ``Omega_c + Omega_b``."""
        return self.Omega_c + self.Omega_b

    @property
    def Omega_de(self) -> torch.Tensor:
        """Dark-energy density today, ``1 - Omega_m - Omega_k``."""
        return 1.0 - self.Omega_m - self.Omega_k

    def parameters(self) -> dict:
        """The 9 parameters as a dict of tensors."""
        return {key: getattr(self, key) for key in _PARAMETERS}

    def to(self, device=None) -> "Cosmology":
        """A copy with the parameters on ``device`` (differentiable: the graph is kept)."""
        params = {key: value.to(device) for key, value in self.parameters().items()}
        return Cosmology(**params, name=self.name)

    @property
    def device(self):
        return self.Omega_c.device

    def __repr__(self) -> str:
        body = ", ".join(f"{key}={float(value.detach()):.6g}" for key, value in self.parameters().items())
        return f"Cosmology({body}{', name=' + repr(self.name) if self.name else ''})"

    # Background ------------------------------------------------------------------------
    def _as_a(self, a) -> torch.Tensor:
        a = torch.as_tensor(a, dtype=torch.float64, device=self.device)
        if not bool(((a > 0) & torch.isfinite(a)).all()):
            raise ValueError("Cosmology: the scale factor `a` must be positive and finite")
        return a

    def _dark_energy(self, a):
        """``Ode(a) a^0 / Ode``: ``a^(-3(1 + w0 + wa)) exp(3 wa (a - 1))``."""
        return torch.exp(-3.0 * (1.0 + self.w0 + self.wa) * torch.log(a) + 3.0 * self.wa * (a - 1.0))

    def E_squared(self, a) -> torch.Tensor:
        """``E(a)^2 = (H(a)/H0)^2`` (float64, any shape of ``a``)."""
        a = self._as_a(a)
        return self.Omega_m * a**-3 + self.Omega_k * a**-2 + self.Omega_de * self._dark_energy(a)

    def E(self, a) -> torch.Tensor:
        """``E(a) = H(a)/H0``."""
        return torch.sqrt(self.E_squared(a))

    def dlnE_dlna(self, a) -> torch.Tensor:
        """``d ln E / d ln a``."""
        a = self._as_a(a)
        de = self.Omega_de * self._dark_energy(a)
        derivative = (
            -3.0 * self.Omega_m * a**-3
            - 2.0 * self.Omega_k * a**-2
            + de * (-3.0 * (1.0 + self.w0 + self.wa) + 3.0 * self.wa * a)
        )
        return 0.5 * derivative / self.E_squared(a)

    def Omega_m_a(self, a) -> torch.Tensor:
        """``Omega_m(a) = Omega_m a^-3 / E(a)^2``."""
        a = self._as_a(a)
        return self.Omega_m * a**-3 / self.E_squared(a)

    # Distances ---------------------------------------------------------------------------
    def comoving_distance(self, a) -> torch.Tensor:
        """Line-of-sight comoving distance to scale factor ``a`` in Mpc/h (float64, any
        shape of ``a``, differentiable in ``a`` and the parameters)::

            chi(a) = (c / H0) int_a^1 da' / (a'^2 E(a'))

        computed by Gauss-Legendre quadrature in ``ln a`` (96 nodes: the integrand
        ``1 / (a E)`` is smooth in ``ln a``; exact to rounding for ``a >= 1e-4``)."""
        a = self._as_a(a)
        nodes, weights = _gauss_legendre(_DISTANCE_NODES, a.device)
        log_a = torch.log(a).unsqueeze(-1)
        # [-1, 1] -> [ln a, 0]
        u = 0.5 * log_a * (1.0 - nodes)
        a_nodes = torch.exp(u)
        integrand = 1.0 / (a_nodes * torch.sqrt(self.E_squared(a_nodes)))
        return HUBBLE_DISTANCE * (-0.5 * log_a.squeeze(-1)) * (integrand * weights).sum(-1)

    def transverse_distance(self, chi) -> torch.Tensor:
        """Transverse comoving distance ``f_K(chi)`` in Mpc/h of a line-of-sight comoving
        distance ``chi`` (Mpc/h): ``chi`` when flat, ``sinh(sqrt(Ok) chi / D_H) D_H / sqrt(Ok)``
        when open, ``sin`` when closed (``D_H = c / H0``); smooth in ``Omega_k`` through 0."""
        chi = torch.as_tensor(chi, dtype=torch.float64, device=self.device)
        s = self.Omega_k * (chi / HUBBLE_DISTANCE) ** 2
        small = s.abs() < 1e-3
        s_safe = torch.where(small, torch.ones_like(s), s)
        root = torch.sqrt(s_safe.abs())
        exact = torch.where(s_safe > 0, torch.sinh(root), torch.sin(root)) / root
        series = 1.0 + s / 6.0 + s**2 / 120.0 + s**3 / 5040.0
        return chi * torch.where(small, series, exact)

    def transverse_comoving_distance(self, a) -> torch.Tensor:
        """``f_K(chi(a))`` in Mpc/h: comoving size per radian at scale factor ``a``."""
        return self.transverse_distance(self.comoving_distance(a))

    def scale_factor_at_distance(self, chi) -> torch.Tensor:
        """The scale factor whose comoving distance (:meth:`comoving_distance`) is ``chi``
        Mpc/h (float64, any shape; ``chi >= 0``). Newton's method to rounding, then two
        differentiable steps, so gradients in ``chi`` and the parameters are those of the
        inverse function (first and second derivatives): ``da/dchi = -a^2 E(a) / D_H``."""
        chi = torch.as_tensor(chi, dtype=torch.float64, device=self.device)
        if not bool(((chi >= 0) & torch.isfinite(chi)).all()):
            raise ValueError("Cosmology.scale_factor_at_distance: `chi` must be finite and not negative (Mpc/h)")
        with torch.no_grad():
            chi_value = chi.detach()
            # a first guess from 257 nodes (3.6 % apart in a), then Newton to rounding
            table_a = torch.logspace(-4, 0, 257, dtype=torch.float64, device=self.device)
            table_chi = self.comoving_distance(table_a).detach()
            if bool((chi_value > table_chi[0]).any()):
                raise ValueError(
                    f"Cosmology.scale_factor_at_distance: `chi` = {float(chi_value.max()):.6g} Mpc/h is beyond "
                    f"a = 1e-4 ({float(table_chi[0]):.6g} Mpc/h)")
            # chi decreases with a: search the reversed table, then interpolate in ln a
            index = torch.searchsorted(table_chi.flip(0).contiguous(), chi_value.reshape(-1)).clamp(1, 256)
            lo, hi = 256 - index, 257 - index  # table_chi[lo] >= chi >= table_chi[hi]
            t = (chi_value.reshape(-1) - table_chi[hi]) / (table_chi[lo] - table_chi[hi])
            log_a = torch.log(table_a[hi]) + t * (torch.log(table_a[lo]) - torch.log(table_a[hi]))
            a = torch.exp(log_a).reshape(chi_value.shape)
            for _ in range(4):
                a = a + (self.comoving_distance(a) - chi_value) * a**2 * self.E(a) / HUBBLE_DISTANCE
                a = a.clamp(1e-4, 1.0)
        # two Newton steps with gradients: their value is a (the residual is ~1e-16); the
        # first, from the detached root, gives exact first derivatives of the inverse
        # function, the second (quadratic convergence) exact second derivatives too
        for _ in range(2):
            a = a + (self.comoving_distance(a) - chi) * a**2 * self.E(a) / HUBBLE_DISTANCE
        return a

    # Growth (convenience: builds a table each call; a simulation builds one once) ------
    def growth(self, a) -> "GrowthValues":
        """:class:`GrowthValues` (D1, D2, f1, f2, Gp, gp, Gf, gf, E) at ``a``."""
        return growth_table(self).at(a)

    def growth_factor(self, a) -> torch.Tensor:
        """Linear growth ``D1(a)``, 1 at ``a = 1``."""
        return self.growth(a).D1


@functools.lru_cache(maxsize=8)
def _gauss_legendre_rule(n: int):
    import numpy

    return numpy.polynomial.legendre.leggauss(n)


def _gauss_legendre(n: int, device):
    """Nodes and weights of the ``n``-point Gauss-Legendre rule on [-1, 1] (float64)."""
    nodes, weights = _gauss_legendre_rule(n)
    return (torch.tensor(nodes, dtype=torch.float64, device=device),
            torch.tensor(weights, dtype=torch.float64, device=device))


def Planck15(**overrides) -> Cosmology:
    """Planck 2015 (TT,TE,EE+lowP+lensing+ext, the jax-cosmo/astropy values)."""
    params = dict(Omega_c=0.2589, Omega_b=0.0486, h=0.6774, n_s=0.9667, sigma8=0.8159)
    params.update(overrides)
    return Cosmology(**params, name="Planck15")


def Planck18(**overrides) -> Cosmology:
    """Planck 2018 (TT,TE,EE+lowE+lensing+BAO, Table 2 last column; Omega_c = omega_c / h^2)."""
    h = 0.6766
    params = dict(Omega_c=0.11933 / h**2, Omega_b=0.02242 / h**2, h=h, n_s=0.9665, sigma8=0.8102)
    params.update(overrides)
    return Cosmology(**params, name="Planck18")


# ---------------------------------------------------------------------------------------
# Growth


class GrowthValues(NamedTuple):
    """Growth quantities at a set of scale factors (float64 tensors, shape of ``a``)."""

    a: torch.Tensor
    E: torch.Tensor  # H/H0
    D1: torch.Tensor  # linear growth, 1 at a = 1
    D2: torch.Tensor  # second-order growth, 1 at a = 1 (positive; 2LPT uses 3/7 D2 or D2_norm D2)
    f1: torch.Tensor  # dlnD1/dlna
    f2: torch.Tensor  # dlnD2/dlna
    Gp: torch.Tensor  # = D1
    gp: torch.Tensor  # dD1/da
    Gf: torch.Tensor  # a^3 E dD1/da
    gf: torch.Tensor  # dGf/da = 1.5 Omega_m D1 / (a^2 E)
    # 0-d: -D2(1) / D1(1)^2 of the solutions started as D1 = a, D2 = -3/7 a^2 (3/7 for
    # Omega_m = 1); the consistent 2LPT coefficient is D2_norm * D2(a) (ic.py).
    D2_norm: torch.Tensor | None = None


# The growth system in ln a, made linear: with s = 1.5 Omega_m(a), d = 2 + dlnE/dlna and
# y = (D1, F1, D2, F2, D1^2, D1 F1, F1^2) (F = dD/dlna), dy/dlna = A(s, d) y exactly:
#   D1' = F1                     F1' = s D1 - d F1
#   D2' = F2                     F2' = s D2 - d F2 - s D1^2
#   (D1^2)' = 2 D1 F1            (D1 F1)' = s D1^2 - d D1 F1 + F1^2
#   (F1^2)' = 2 s D1 F1 - 2 d F1^2
# A = _A_ONE + s _A_S + d _A_D. Being linear, one RK step is a 7x7 matrix that depends on
# the background only, so every step is built at once and chained by a prefix product.
# Entries are (row, column, coefficient): the constant part, the factors of s and of d.
_A_ONE = ((0, 1, 1.0), (2, 3, 1.0), (4, 5, 2.0), (5, 6, 1.0))
_A_S = ((1, 0, 1.0), (3, 2, 1.0), (3, 4, -1.0), (5, 4, 1.0), (6, 5, 2.0))
_A_D = ((1, 1, -1.0), (3, 3, -1.0), (5, 5, -1.0), (6, 6, -2.0))


def _system_matrix(s: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``A`` of the linear growth system at each sample: ``(..., 7, 7)``."""
    patterns = torch.zeros(3, 7, 7, dtype=torch.float64)
    for layer, entries in enumerate((_A_ONE, _A_S, _A_D)):
        for i, j, value in entries:
            patterns[layer, i, j] = value
    patterns = patterns.to(s.device)  # one copy, not 13 writes on an accelerator
    return patterns[0] + s[..., None, None] * patterns[1] + d[..., None, None] * patterns[2]


def _prefix_products(steps: torch.Tensor) -> torch.Tensor:
    """``P_k = M_{k-1} ... M_0`` for ``k = 0..n`` (``P_0 = I``) of ``(n, m, m)`` matrices,
    by doubling (log2 n batched products instead of n sequential ones)."""
    n, m = steps.shape[0], steps.shape[-1]
    product = steps
    span = 1
    while span < n:
        # product[k] covers steps k-span+1..k; extend it back by another span.
        product = torch.cat([product[:span], product[span:] @ product[:-span]])
        span *= 2
    identity = torch.eye(m, dtype=steps.dtype, device=steps.device).unsqueeze(0)
    return torch.cat([identity, product])


def _early_growth(cosmology: Cosmology, a: float):
    """``(D1, F1, D2, F2)`` at an early ``a``: the growing modes of matter domination with
    their first-order corrections from curvature and dark energy.

    Each sub-dominant term of ``E^2 / (Omega_m a^-3)`` is a power ``x = X a^n``
    (curvature: ``n = 1``; dark energy: ``n = -3 (w0 + wa)``, its ``exp(3 wa a)``
    being second order). Inserting ``D1 = a (1 + c x)``, ``D2 = -3/7 a^2 (1 + e x)``
    in the ODEs and keeping first order in ``x``::

        c = -(n + 3) / 2 / ((1 + n)^2 + (1 + n) / 2 - 3 / 2)
        e = (3 n / 7 - 3 c + 15 / 7) / (-3/7 (2 + n)^2 - 3/14 (2 + n) + 9/14)

    (``c = -2/11`` for a cosmological constant, ``-4/7`` for curvature). Without
    them, starting at ``a_min = 1e-3`` would excite a decaying mode of relative size
    ``Omega_k / Omega_m * a_min`` (1e-4), still 3e-7 at ``a = 0.01``; with them the
    start is exact to second order, ``(Omega_k / Omega_m a_min)^2``.
    """
    om = cosmology.Omega_m
    terms = [(cosmology.Omega_k / om * a, 1.0)]
    n_de = -3.0 * (cosmology.w0 + cosmology.wa)
    x_de = cosmology.Omega_de / om * torch.exp(-3.0 * cosmology.wa + n_de * math.log(a))
    terms.append((x_de, n_de))
    d1, f1 = om * 0.0 + a, om * 0.0 + a
    d2, f2 = om * 0.0 - 3.0 / 7.0 * a**2, om * 0.0 - 6.0 / 7.0 * a**2
    for x, n in terms:
        c = -(n + 3.0) / 2.0 / ((1.0 + n) ** 2 + (1.0 + n) / 2.0 - 1.5)
        e = (3.0 * n / 7.0 - 3.0 * c + 15.0 / 7.0) / (-3.0 / 7.0 * (2.0 + n) ** 2 - 3.0 / 14.0 * (2.0 + n) + 9.0 / 14.0)
        d1 = d1 + a * c * x
        f1 = f1 + a * c * (1.0 + n) * x
        d2 = d2 - 3.0 / 7.0 * a**2 * e * x
        f2 = f2 - 3.0 / 7.0 * a**2 * e * (2.0 + n) * x
    return d1, f1, d2, f2


# Three-stage Gauss-Legendre Runge-Kutta (order 6): nodes, coefficients a_ij, weights.
_R15 = math.sqrt(15.0)
_GAUSS_C = (0.5 - _R15 / 10.0, 0.5, 0.5 + _R15 / 10.0)
_GAUSS_A = (
    (5.0 / 36.0, 2.0 / 9.0 - _R15 / 15.0, 5.0 / 36.0 - _R15 / 30.0),
    (5.0 / 36.0 + _R15 / 24.0, 2.0 / 9.0, 5.0 / 36.0 - _R15 / 24.0),
    (5.0 / 36.0 + _R15 / 30.0, 2.0 / 9.0 + _R15 / 15.0, 5.0 / 36.0),
)
_GAUSS_B = (5.0 / 18.0, 4.0 / 9.0, 5.0 / 18.0)


_STEPS_PER_EFOLD = 256 / math.log(1000.0)  # default node density of growth_table
_EARLY_SPAN = math.log(100.0)  # e-folds integrated before the table starts (growth_table)


# Quintic Hermite basis on [0, 1] (value, h * first, h^2 * second derivative at each end).
def _hermite5(t):
    t2 = t * t
    t3 = t2 * t
    t4 = t3 * t
    t5 = t4 * t
    basis = (
        1 - 10 * t3 + 15 * t4 - 6 * t5,
        t - 6 * t3 + 8 * t4 - 3 * t5,
        0.5 * (t2 - 3 * t3 + 3 * t4 - t5),
        10 * t3 - 15 * t4 + 6 * t5,
        -4 * t3 + 7 * t4 - 3 * t5,
        0.5 * (t3 - 2 * t4 + t5),
    )
    slope = (
        -30 * t2 + 60 * t3 - 30 * t4,
        1 - 18 * t2 + 32 * t3 - 15 * t4,
        0.5 * (2 * t - 9 * t2 + 12 * t3 - 5 * t4),
        30 * t2 - 60 * t3 + 30 * t4,
        -12 * t2 + 28 * t3 - 15 * t4,
        0.5 * (3 * t2 - 8 * t3 + 5 * t4),
    )
    return basis, slope


class GrowthTable:
    """D1, D2 and their first two ``ln a`` derivatives on a grid of ``ln a``, evaluated by
    quintic Hermite interpolation (value, slope and curvature are all known at the
    nodes, from the ODE, so the value error is ``O(h^6)`` and the slope's ``O(h^5)``:
    with the default grid D1, D2, f1, f2, Gf, gf are within ~5e-10 of a converged
    integration at any ``a`` of the range). Build it with :func:`growth_table`.

    Attributes:
        log_a: ``(n + 1,)`` equally spaced nodes of ``ln a`` from ``ln a_min`` to 0.
        values: ``(n + 1, 2, 3)``: for (D1, D2), normalised to 1 at ``a = 1``, the
            value, ``dD/dlna`` and ``d^2D/dlna^2`` at each node.
        D2_norm: 0-d, ``-D2(1) / D1(1)^2`` before normalisation (see :class:`GrowthValues`).
        D1_matter_era: 0-d, ``D1(1)`` in the normalisation ``D1 = a`` deep in matter
            domination (about 0.78 for Planck15; the potential's growth suppression
            ``D1 / a`` at ``a = 1``), or None.
    """

    def __init__(self, cosmology, log_a, values, D2_norm, D1_matter_era=None):
        self.cosmology = cosmology
        self.log_a = log_a
        self.values = values
        self.D2_norm = D2_norm
        self.D1_matter_era = D1_matter_era
        self._step = float(log_a[-1] - log_a[0]) / (log_a.numel() - 1)  # a Python float: no sync per lookup

    def _interpolate(self, log_a):
        grid = self.log_a
        step = self._step
        if bool((log_a < grid[0] - 1e-12).any()) or bool((log_a > grid[-1] + 1e-12).any()):
            raise ValueError(
                f"growth: scale factor outside the table range [{math.exp(float(grid[0])):.3g}, "
                f"{math.exp(float(grid[-1])):.3g}]; build the table with a smaller `a_min`"
            )
        position = ((log_a - grid[0]) / step).detach()
        index = position.floor().long().clamp(0, grid.numel() - 2)
        t = ((log_a - grid[index]) / step).unsqueeze(-1)
        # index_select, not values[index]: a 0-d index would make the latter a host read of
        # the index, which torch.compile's inductor cannot lower.
        rows = self.values.index_select(0, torch.stack((index, index + 1), dim=-1).reshape(-1))
        left, right = rows.reshape(*index.shape, 2, *self.values.shape[1:]).unbind(dim=index.dim())  # (..., 2, 3)
        scale = (1.0, step, step**2)
        basis, slope_basis = _hermite5(t)
        value = 0.0
        slope = 0.0
        for k in range(3):
            value = value + (basis[k] * left[..., k] + basis[k + 3] * right[..., k]) * scale[k]
            slope = slope + (slope_basis[k] * left[..., k] + slope_basis[k + 3] * right[..., k]) * scale[k]
        return value, slope / step

    def at(self, a) -> GrowthValues:
        """All growth quantities at ``a`` (any shape; float64)."""
        cosmology = self.cosmology
        a = cosmology._as_a(a).to(self.log_a.device)
        value, slope = self._interpolate(torch.log(a))
        D1, D2 = value[..., 0], value[..., 1]
        F1, F2 = slope[..., 0], slope[..., 1]
        E = cosmology.E(a)
        gp = F1 / a
        return GrowthValues(
            a=a,
            E=E,
            D1=D1,
            D2=D2,
            f1=F1 / D1,
            f2=F2 / D2,
            Gp=D1,
            gp=gp,
            Gf=a**3 * E * gp,
            gf=1.5 * cosmology.Omega_m * D1 / (a**2 * E),
            D2_norm=self.D2_norm,
        )


def growth_table(cosmology: Cosmology, a_min: float = 1e-3, steps: int | None = None) -> GrowthTable:
    """Integrate the growth ODEs and tabulate them from ``a_min`` to 1.

    Args:
        cosmology: the :class:`Cosmology`.
        a_min: smallest scale factor of the table.
        steps: equal steps in ``ln a`` between the nodes (default: 37 per e-fold,
            256 for ``a_min = 1e-3``).

    In ``ln a`` with ``F = dD/dlna`` the ODEs of the module docstring read
    ``dF1/dlna = -(2 + dlnE/dlna) F1 + 1.5 Om(a) D1`` and
    ``dF2/dlna = -(2 + dlnE/dlna) F2 + 1.5 Om(a) (D2 - D1^2)``. Carrying ``D1^2``,
    ``D1 F1`` and ``F1^2`` along makes the system linear, so each step of the
    integrator (3-stage Gauss-Legendre Runge-Kutta, order 6) is a 7x7 matrix built
    from the background alone: all steps are built in one vectorised pass and chained
    by a prefix product (no Python loop over steps; cheap to differentiate). The
    start, 100 times earlier than ``a_min``, is the matter-dominated growing mode with
    its first-order curvature and dark-energy corrections (:func:`_early_growth`), so
    no decaying mode is excited. Measured against an adaptive solver at rtol 1e-12
    (tests/test_precision.py), D1, D2, f1, f2, Gf, gf and gp are within ~5e-10 at any
    ``a`` in the range with the default steps. Differentiable in the parameters.

    Raises:
        ValueError: for ``a_min`` outside (0, 1), ``steps < 2``, or ``w0 + wa >= 0``
        (dark energy would not vanish at early times, so there is no matter-dominated
        start).
    """
    if not 0 < a_min < 1:
        raise ValueError(f"growth_table: `a_min` must be in (0, 1), got {a_min}")
    if steps is None:
        steps = max(2, math.ceil(-math.log(a_min) * _STEPS_PER_EFOLD))
    integral = isinstance(steps, numbers.Real) and not isinstance(steps, bool) and math.isfinite(steps)
    if not integral or int(steps) != steps or steps < 2:
        raise ValueError(f"growth_table: `steps` must be an integer >= 2, got {steps!r}")
    steps = int(steps)
    w_early = float((cosmology.w0 + cosmology.wa).detach())
    if w_early >= 0:
        raise ValueError(
            f"growth_table: needs w0 + wa < 0 so that matter dominates at early times, got {w_early}"
        )
    device = cosmology.device
    log_a = torch.linspace(math.log(a_min), 0.0, steps + 1, dtype=torch.float64, device=device)
    # The integration starts _EARLY_SPAN e-folds before the table (with about the same
    # step): what the first-order start misses, (Omega_k / Omega_m a)^2, is then ~1e-12
    # instead of ~1e-8 at a_min = 1e-3. Longer early steps would cost D2_norm accuracy
    # (4 times longer: 1e-8), which compares amplitudes of D2 and D1^2 set early on.
    h = -math.log(a_min) / steps
    early = max(1, math.ceil(_EARLY_SPAN / h))
    a_start = a_min * math.exp(-_EARLY_SPAN)
    nodes = torch.cat(
        [torch.linspace(math.log(a_start), math.log(a_min), early + 1, dtype=torch.float64, device=device)[:-1], log_a]
    )
    widths = nodes[1:] - nodes[:-1]  # (n,)
    n = widths.numel()
    # Background at the three Gauss-Legendre points of every step and at the table nodes.
    offsets = torch.tensor(_GAUSS_C, dtype=torch.float64, device=device)
    points = (nodes[:-1, None] + widths[:, None] * offsets).reshape(-1)
    samples = torch.exp(torch.cat([points, log_a]))
    A = _system_matrix(1.5 * cosmology.Omega_m_a(samples), 2.0 + cosmology.dlnE_dlna(samples))
    stages, A_nodes = A[: 3 * n].reshape(n, 3, 7, 7), A[3 * n :]
    # Stage slopes K_i = A_i (y + h sum_j a_ij K_j) are linear in y: K = S y with the
    # (21, 7) matrix S solving (I - h [a_ij A_i]) S = [A_i]; one step is I + h sum_i b_i S_i.
    coupling = torch.tensor(_GAUSS_A, dtype=torch.float64, device=device)
    blocks = (coupling[None, :, None, :, None] * stages[:, :, :, None, :]).reshape(n, 21, 21)
    system = torch.eye(21, dtype=torch.float64, device=device) - widths[:, None, None] * blocks
    slopes = torch.linalg.solve(system, stages.reshape(n, 21, 7)).reshape(n, 3, 7, 7)
    weights = torch.tensor(_GAUSS_B, dtype=torch.float64, device=device)
    step_matrices = torch.eye(7, dtype=torch.float64, device=device) + widths[:, None, None] * (
        weights[:, None, None] * slopes
    ).sum(1)
    D1, F1, D2, F2 = _early_growth(cosmology, a_start)
    y0 = torch.stack([D1, F1, D2, F2, D1 * D1, D1 * F1, F1 * F1])
    y = (_prefix_products(step_matrices)[early:] @ y0.unsqueeze(-1)).squeeze(-1)  # (steps + 1, 7) at log_a
    curvature = (A_nodes @ y.unsqueeze(-1)).squeeze(-1)  # dy/dlna at the nodes
    norm1, norm2 = y[-1, 0], y[-1, 2]
    d1 = torch.stack([y[:, 0], y[:, 1], curvature[:, 1]], dim=-1) / norm1
    d2 = torch.stack([y[:, 2], y[:, 3], curvature[:, 3]], dim=-1) / norm2
    return GrowthTable(cosmology, log_a, torch.stack([d1, d2], dim=1), -norm2 / (norm1 * norm1), norm1)


# ---------------------------------------------------------------------------------------
# Linear power


def eisenstein_hu_transfer(k, cosmology: Cosmology, wiggles: bool = True) -> torch.Tensor:
    """Eisenstein & Hu (1998, ApJ 496, 605) matter transfer function.

    Args:
        k: wavenumbers in h/Mpc (tensor, any shape; float64 is used inside).
        cosmology: the :class:`Cosmology` (Omega_m, Omega_b, h; T_CMB = 2.7255 K).
        wiggles: True for the full fit with baryon acoustic oscillations (their
            eqs. 2-24), False for the zero-baryon-oscillation shape (eqs. 26-31).

    Returns:
        ``T(k)`` (float64, shape of ``k``), 1 at ``k -> 0``.

    Raises:
        ValueError: ``wiggles=True`` with ``Omega_b = 0`` (the baryon fit divides by the
        baryon density: every T would be NaN); the no-wiggle fit handles it.
    """
    if wiggles and float(cosmology.Omega_b.detach()) <= 0:
        raise ValueError(
            "eisenstein_hu_transfer: the Eisenstein & Hu fit with BAO wiggles needs `Omega_b` > 0, got "
            f"{float(cosmology.Omega_b.detach())}; use wiggles=False ('eisenstein_hu_nowiggle') for a "
            "universe without baryons"
        )
    k = torch.as_tensor(k, dtype=torch.float64, device=cosmology.device)
    h = cosmology.h
    omega_m = cosmology.Omega_m * h**2
    omega_b = cosmology.Omega_b * h**2
    f_b = cosmology.Omega_b / cosmology.Omega_m
    f_c = cosmology.Omega_c / cosmology.Omega_m
    theta = T_CMB / 2.7
    k_mpc = k * h  # 1/Mpc

    if not wiggles:
        # eq. 26: fitted sound horizon (Mpc); eqs. 28-31.
        s = 44.5 * torch.log(9.83 / omega_m) / torch.sqrt(1.0 + 10.0 * omega_b**0.75)
        alpha_gamma = 1.0 - 0.328 * torch.log(431.0 * omega_m) * f_b + 0.38 * torch.log(22.3 * omega_m) * f_b**2
        gamma_eff = cosmology.Omega_m * h * (alpha_gamma + (1.0 - alpha_gamma) / (1.0 + (0.43 * k_mpc * s) ** 4))
        q = k * theta**2 / gamma_eff
        L0 = torch.log(2.0 * math.e + 1.8 * q)
        C0 = 14.2 + 731.0 / (1.0 + 62.5 * q)
        return L0 / (L0 + C0 * q**2)

    z_eq = 2.50e4 * omega_m * theta**-4  # eq. 2
    k_eq = 7.46e-2 * omega_m * theta**-2  # eq. 3, 1/Mpc
    b1 = 0.313 * omega_m**-0.419 * (1.0 + 0.607 * omega_m**0.674)
    b2 = 0.238 * omega_m**0.223
    z_d = 1291.0 * omega_m**0.251 / (1.0 + 0.659 * omega_m**0.828) * (1.0 + b1 * omega_b**b2)  # eq. 4
    R_d = 31.5 * omega_b * theta**-4 * (1000.0 / z_d)  # eq. 5
    R_eq = 31.5 * omega_b * theta**-4 * (1000.0 / z_eq)
    s = (
        2.0 / (3.0 * k_eq) * torch.sqrt(6.0 / R_eq)
        * torch.log((torch.sqrt(1.0 + R_d) + torch.sqrt(R_d + R_eq)) / (1.0 + torch.sqrt(R_eq)))
    )  # eq. 6, Mpc
    k_silk = 1.6 * omega_b**0.52 * omega_m**0.73 * (1.0 + (10.4 * omega_m) ** -0.95)  # eq. 7
    q = k_mpc / (13.41 * k_eq)  # eq. 10

    a1 = (46.9 * omega_m) ** 0.670 * (1.0 + (32.1 * omega_m) ** -0.532)
    a2 = (12.0 * omega_m) ** 0.424 * (1.0 + (45.0 * omega_m) ** -0.582)
    alpha_c = a1 ** (-f_b) * a2 ** (-(f_b**3))  # eq. 11
    bb1 = 0.944 / (1.0 + (458.0 * omega_m) ** -0.708)
    bb2 = (0.395 * omega_m) ** -0.0266
    beta_c = 1.0 / (1.0 + bb1 * (f_c**bb2 - 1.0))  # eq. 12

    def T0(alpha, beta):  # eqs. 19-20
        L = torch.log(math.e + 1.8 * beta * q)
        C = 14.2 / alpha + 386.0 / (1.0 + 69.9 * q**1.08)
        return L / (L + C * q**2)

    ks = k_mpc * s
    f = 1.0 / (1.0 + (ks / 5.4) ** 4)  # eq. 18
    T_c = f * T0(1.0, beta_c) + (1.0 - f) * T0(alpha_c, beta_c)  # eq. 17

    y = (1.0 + z_eq) / (1.0 + z_d)
    sqrt_1y = torch.sqrt(1.0 + y)
    G = y * (-6.0 * sqrt_1y + (2.0 + 3.0 * y) * torch.log((sqrt_1y + 1.0) / (sqrt_1y - 1.0)))  # eq. 15
    alpha_b = 2.07 * k_eq * s * (1.0 + R_d) ** -0.75 * G  # eq. 14
    beta_node = 8.41 * omega_m**0.435  # eq. 23
    beta_b = 0.5 + f_b + (3.0 - 2.0 * f_b) * torch.sqrt((17.2 * omega_m) ** 2 + 1.0)  # eq. 24
    # eq. 22; k -> 0 limit of s_tilde is 0 (ks is positive for every k we are given)
    s_tilde = s / (1.0 + (beta_node / ks) ** 3) ** (1.0 / 3.0)
    x = k_mpc * s_tilde
    j0 = torch.where(x.abs() < 1e-6, 1.0 - x * x / 6.0, torch.sin(x) / torch.where(x == 0, 1.0, x))
    T_b = (
        T0(1.0, 1.0) / (1.0 + (ks / 5.2) ** 2)
        + alpha_b / (1.0 + (beta_b / ks) ** 3) * torch.exp(-((k_mpc / k_silk) ** 1.4))
    ) * j0  # eq. 21
    return f_b * T_b + f_c * T_c  # eq. 16


def _top_hat(x):
    """Fourier transform of a unit spherical top hat, ``3 (sin x - x cos x) / x^3``."""
    small = x.abs() < 1e-3
    safe = torch.where(small, torch.ones_like(x), x)
    exact = 3.0 * (torch.sin(safe) - safe * torch.cos(safe)) / safe**3
    return torch.where(small, 1.0 - x * x / 10.0, exact)


def _log_k_grid(device, k_min=1e-5, k_max=1e2, points=4097):
    return torch.logspace(math.log10(k_min), math.log10(k_max), points, dtype=torch.float64, device=device)


def _simpson(values, x):
    """Simpson's rule on an odd number of equally spaced samples along the last axis."""
    dx = x[1] - x[0]
    return dx / 3.0 * (values[..., 0] + values[..., -1] + 4.0 * values[..., 1:-1:2].sum(-1) + 2.0 * values[..., 2:-1:2].sum(-1))


def sigma_r(power: Callable, radius: float = 8.0, device=None) -> torch.Tensor:
    """``sigma(R)`` of a power spectrum: ``sigma^2 = 1/(2 pi^2) int k^3 P(k) W(kR)^2 dln k``.

    ``power`` maps k in h/Mpc to P in (Mpc/h)^3; ``radius`` in Mpc/h. Simpson's rule
    on 4097 points in ``ln k`` over [1e-5, 100] h/Mpc.
    """
    k = _log_k_grid(device)
    integrand = k**3 * power(k) * _top_hat(k * radius) ** 2
    return torch.sqrt(_simpson(integrand, torch.log(k)) / (2.0 * math.pi**2))


def linear_power(k, cosmology: Cosmology, *, wiggles: bool = True) -> torch.Tensor:
    """Linear matter power at ``a = 1``: ``P(k) = A k^n_s T(k)^2`` with ``sigma8`` fixing ``A``.

    Args:
        k: wavenumbers in h/Mpc.
        cosmology: the :class:`Cosmology`.
        wiggles: Eisenstein & Hu with (True) or without (False) BAO wiggles.

    Returns:
        ``P(k)`` in (Mpc/h)^3, float64, differentiable in the parameters.
    """
    def shape(kk):
        return kk**cosmology.n_s * eisenstein_hu_transfer(kk, cosmology, wiggles) ** 2

    amplitude = (cosmology.sigma8 / sigma_r(shape, 8.0, cosmology.device)) ** 2
    k = torch.as_tensor(k, dtype=torch.float64, device=cosmology.device)
    return amplitude * shape(k)


class PowerTable:
    """A linear power spectrum at ``a = 1`` read from a two-column text file.

    The file holds ``k`` (h/Mpc, strictly increasing, positive) and ``P(k)``
    ((Mpc/h)^3, positive) in two whitespace-separated columns; lines starting
    with ``#`` are comments. Values in between are interpolated linearly in
    ``(ln k, ln P)``. Calling it with wavenumbers outside the table raises a
    ValueError (no extrapolation).

    Args:
        path: the text file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        rows, lines = [], []
        try:
            # utf-8-sig: a byte-order mark (as some editors write) is not part of line 1
            with open(self.path, encoding="utf-8-sig") as handle:
                for number, line in enumerate(handle, start=1):
                    text = line.split("#", 1)[0].strip()
                    if not text:
                        continue
                    fields = text.replace(",", " ").split()
                    if len(fields) != 2:
                        raise ValueError(
                            f"power table {self.path!r}, line {number}: expected 2 columns "
                            f"(k in h/Mpc, P in (Mpc/h)^3), got {len(fields)}: {text!r}"
                        )
                    try:
                        rows.append((float(fields[0]), float(fields[1])))
                    except ValueError:
                        raise ValueError(
                            f"power table {self.path!r}, line {number}: not two numbers: {text!r}"
                        ) from None
                    lines.append(number)
        except FileNotFoundError:
            raise ValueError(f"power table: file {self.path!r} not found") from None
        except UnicodeDecodeError:
            raise ValueError(f"power table {self.path!r}: not a UTF-8 text table (a binary file?)") from None
        except OSError as error:  # a directory, no permission, ...
            raise ValueError(f"power table {self.path!r}: cannot be read ({error.strerror or error})") from None
        if len(rows) < 2:
            raise ValueError(f"power table {self.path!r}: needs at least 2 rows, got {len(rows)}")
        table = torch.tensor(rows, dtype=torch.float64)
        k, p = table[:, 0], table[:, 1]
        bad = ~torch.isfinite(table).all(1) | (k <= 0) | (p <= 0)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"power table {self.path!r}, line {lines[row]}: k and P must be finite and positive, got "
                f"{rows[row][0]!r} {rows[row][1]!r}"
            )
        if bool((k[1:] <= k[:-1]).any()):
            row = int(torch.nonzero(k[1:] <= k[:-1])[0]) + 1
            raise ValueError(
                f"power table {self.path!r}, line {lines[row]}: k must be strictly increasing, got {rows[row][0]!r} "
                f"after {rows[row - 1][0]!r}"
            )
        self.k, self.power = k, p
        self._log_k, self._log_p = torch.log(k), torch.log(p)

    @property
    def k_range(self) -> tuple[float, float]:
        return float(self.k[0]), float(self.k[-1])

    def check_covers(self, k_min: float, k_max: float) -> None:
        """ValueError unless the table spans ``[k_min, k_max]`` (h/Mpc)."""
        low, high = self.k_range
        # A relative tolerance lets a table written with the mesh's own k values match.
        if k_min < low * (1 - 1e-9) or k_max > high * (1 + 1e-9):
            raise ValueError(
                f"power table {self.path!r} covers k in [{low:.4g}, {high:.4g}] h/Mpc but the "
                f"mesh needs [{k_min:.4g}, {k_max:.4g}] h/Mpc; extend the table"
            )

    def __call__(self, k, cosmology: Cosmology | None = None) -> torch.Tensor:
        """``P(k)`` in (Mpc/h)^3 at ``k`` in h/Mpc (the cosmology is ignored)."""
        k = torch.as_tensor(k, dtype=torch.float64)
        device = k.device
        if k.numel():
            self.check_covers(float(k.min()), float(k.max()))
        log_k = torch.log(k)
        grid, values = self._log_k.to(device), self._log_p.to(device)
        index = torch.searchsorted(grid, log_k.reshape(-1).contiguous()).clamp(1, grid.numel() - 1)
        index = index.reshape(k.shape)
        t = (log_k - grid[index - 1]) / (grid[index] - grid[index - 1])
        return torch.exp(values[index - 1] + t * (values[index] - values[index - 1]))


# Every name of a built-in spectrum, mapped to its canonical name.
_BUILTIN_POWER = {
    "eisenstein_hu": "eisenstein_hu", "eh": "eisenstein_hu", "eisenstein_hu_wiggles": "eisenstein_hu",
    "eisenstein_hu_nowiggle": "eisenstein_hu_nowiggle", "eh_nowiggle": "eisenstein_hu_nowiggle",
}


def builtin_power_name(name: str) -> str:
    """The canonical name of a built-in spectrum given any of its names; other strings unchanged."""
    return _BUILTIN_POWER.get(name, name)


def resolve_power(power) -> Callable:
    """A callable ``power(k, cosmology) -> P(k)`` at ``a = 1`` from a user choice.

    ``power`` may be ``"eisenstein_hu"`` (with wiggles), ``"eisenstein_hu_nowiggle"``,
    a path to a two-column table (:class:`PowerTable`), or such a callable.
    """
    if callable(power):
        return power
    if isinstance(power, (str, os.PathLike)):
        name = builtin_power_name(os.fspath(power))
        if name == "eisenstein_hu":
            return lambda k, cosmology: linear_power(k, cosmology, wiggles=True)
        if name == "eisenstein_hu_nowiggle":
            return lambda k, cosmology: linear_power(k, cosmology, wiggles=False)
        return PowerTable(name)
    raise ValueError(
        "`power_spectrum` must be 'eisenstein_hu', 'eisenstein_hu_nowiggle', a path to a "
        f"two-column table or a callable (k, cosmology) -> P, got {power!r}"
    )
