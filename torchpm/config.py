"""One declaration of every setting of a run, and the validators built on it.

:data:`SETTINGS` lists each setting once (name, kind, default, unit, range or
choices, meaning). The same table

* validates the keys of a TOML config for ``python -m torchpm run`` (:func:`load_config`),
* supplies the argument checks of :class:`torchpm.Simulation` (:func:`simulation_arguments`),
* generates the configuration table of the README (:func:`markdown_table`,
  ``python -m torchpm config-table``; a test keeps the two equal).

Every check raises :class:`SettingError` (a ``ValueError`` and a ``TypeError``)
whose message names the setting, the value given and what was expected. The
checks are strict on types: a bool is not a number, a string is not a number or
a shape, ``1.5`` is not an integer, ``"false"`` is not a bool, NaN and infinity
are not numbers a run can use.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Any, Callable, Sequence

# How far below 0 rounding may leave 1 - Omega_m - Omega_k (Einstein-de Sitter: -5.6e-17),
# in the settings' checks and torchpm.Cosmology's.
DARK_ENERGY_TOLERANCE = 1e-12

__all__ = [
    "SETTINGS",
    "Setting",
    "SettingError",
    "as_bool",
    "as_choice",
    "as_float",
    "as_int",
    "as_scale_factors",
    "as_shape",
    "as_box_size",
    "as_steps",
    "defaults",
    "load_config",
    "markdown_table",
    "simulation_arguments",
    "validate",
    "MAX_STEPS",
]

# A FastPM run uses tens to hundreds of steps; a count far beyond this is a typo
# (steps = 10**9 would otherwise build a multi-GB list of scale factors).
MAX_STEPS = 100_000
COSMOLOGY_PRESETS = ("Planck15", "Planck18")
COSMOLOGY_KEYS = ("Omega_c", "Omega_b", "h", "n_s", "sigma8", "Omega_k", "w0", "wa")
COSMOLOGY_REQUIRED = ("Omega_c", "Omega_b", "h", "n_s", "sigma8")
POWER_NAMES = ("eisenstein_hu", "eisenstein_hu_nowiggle")
PAINT_ORDERS = ("ngp", "cic", "tsc", "pcs")


class SettingError(ValueError, TypeError):
    """A setting with a wrong type or value. Both a ValueError and a TypeError,
    so callers that catch either keep working."""


def _show(value) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _fail(name: str, expected: str, value) -> SettingError:
    return SettingError(f"`{name}` must be {expected}, got {_show(value)}")


# ----------------------------------------------------------------------------------
# Validators shared by the CLI and Simulation.


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not _is_bool_like(value)


def _is_bool_like(value) -> bool:
    # (numpy's bool scalar: numpy.bool_, named "bool" from numpy 2 on)
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def as_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``; floats are accepted only when integral."""
    expected = "an integer" + _range_text(low, high)
    if not _is_number(value):
        raise _fail(name, expected, value)
    if not isinstance(value, numbers.Integral):
        number = float(value)
        if not math.isfinite(number) or not number.is_integer():
            raise _fail(name, expected, value)
    result = int(value)
    if (low is not None and result < low) or (high is not None and result > high):
        raise _fail(name, expected, value)
    return result


def as_float(
    name: str, value, low: float | None = None, high: float | None = None, *, low_open: bool = False
) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    expected = "a finite number" + _range_text(low, high, low_open=low_open)
    if not _is_number(value):
        raise _fail(name, expected, value)
    result = float(value)
    if not math.isfinite(result):
        raise _fail(name, expected, value)
    if low is not None and (result < low or (low_open and result == low)):
        raise _fail(name, expected, value)
    if high is not None and result > high:
        raise _fail(name, expected, value)
    return result


def as_bool(name: str, value) -> bool:
    """``value`` if it is a bool (``"false"``, 0 and 1 are not)."""
    if not _is_bool_like(value):
        raise _fail(name, "true or false (a bool)", value)
    return bool(value)


def as_choice(name: str, value, choices: Sequence) -> Any:
    """``value`` if it is one of ``choices`` (same type: ``"2"`` is not ``2``)."""
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return value
    raise _fail(name, "one of " + ", ".join(repr(c) for c in choices), value)


def _items(name: str, value, expected: str) -> list:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise _fail(name, expected, value)
    try:
        return list(value)
    except TypeError:
        raise _fail(name, expected, value) from None


def as_shape(name: str, value) -> tuple[int, int, int]:
    """An int or 3 ints, each positive, as a 3-tuple."""
    expected = "a positive integer or a list of 3 positive integers"
    if _is_number(value):
        n = as_int(name, value, 1)
        return (n, n, n)
    items = _items(name, value, expected)
    if len(items) != 3:
        raise _fail(name, expected, value)
    try:
        return tuple(as_int(name, item, 1) for item in items)
    except SettingError:
        raise _fail(name, expected, value) from None


# A box far larger than the Hubble volume (~1.4e4 Mpc/h) is a typo; beyond float32's
# range it would turn every position into inf or NaN.
MAX_BOX_SIZE = 1e6


def as_box_size(name: str, value) -> tuple[float, float, float]:
    """A positive finite number or 3 of them (Mpc/h, at most :data:`MAX_BOX_SIZE`), as a 3-tuple."""
    expected = f"a number in (0, {MAX_BOX_SIZE:g}] or a list of 3 (Mpc/h)"
    if _is_number(value):
        size = as_float(name, value, 0.0, MAX_BOX_SIZE, low_open=True)
        return (size, size, size)
    items = _items(name, value, expected)
    if len(items) != 3:
        raise _fail(name, expected, value)
    try:
        return tuple(as_float(name, item, 0.0, MAX_BOX_SIZE, low_open=True) for item in items)
    except SettingError:
        raise _fail(name, expected, value) from None


def as_scale_factors(name: str, value, after: float | None = None, *, allow_empty: bool = True) -> list[float]:
    """A strictly increasing list of scale factors in (0, 1], each larger than ``after``."""
    expected = "a list of strictly increasing scale factors in (0, 1]" + (f" after {after}" if after is not None else "")
    items = _items(name, value, expected)
    if not items and not allow_empty:
        raise _fail(name, expected + " (at least one)", value)
    values = []
    for item in items:
        try:
            values.append(as_float(name, item, 0.0, 1.0, low_open=True))
        except SettingError:
            raise _fail(name, expected, value) from None
    grid = ([after] if after is not None else []) + values
    if any(b <= a for a, b in zip(grid, grid[1:])):
        raise _fail(name, expected, value)
    return values


def as_steps(steps, a_start: float, a_end: float) -> list[float]:
    """The scale factors of a run, ``[a_start, a_1, ..., a_end]``.

    ``steps`` is a count (at most :data:`MAX_STEPS`, validated before any list is
    built; steps linear in ``a``, the FastPM default) or the increasing list of
    scale factors after ``a_start``.
    """
    a_start = as_float("a_start", a_start, 0.0, 1.0, low_open=True)
    if _is_number(steps):
        count = as_int("steps", steps, 0, MAX_STEPS)
        a_end = as_float("a_end", a_end, 0.0, 1.0, low_open=True)
        if count == 0:
            return [a_start]
        if a_end <= a_start:
            raise SettingError(f"`a_end` ({a_end}) must be larger than `a_start` ({a_start}) when `steps` > 0")
        return [a_start + (a_end - a_start) * i / count for i in range(count + 1)]
    expected = f"a number of steps (0 to {MAX_STEPS}) or a list of strictly increasing scale factors in (0, 1] after a_start"
    if isinstance(steps, (str, bytes, bool)) or not hasattr(steps, "__len__"):
        raise _fail("steps", expected, steps)
    if len(steps) > MAX_STEPS:
        raise SettingError(f"`steps` must list at most {MAX_STEPS} scale factors, got {len(steps)}")
    try:
        values = as_scale_factors("steps", steps, a_start)
    except SettingError:
        raise _fail("steps", expected + f" = {a_start}", steps) from None
    return [a_start] + values


def _redshifts(name, value) -> list[float]:
    """A list of at most 64 redshifts, each in (0, 1100]."""
    if isinstance(value, (str, bytes, bool)) or not isinstance(value, Sequence):
        raise _fail(name, "a list of redshifts in (0, 1100]", value)
    if len(value) > 64:
        raise SettingError(f"`{name}` must list at most 64 redshifts, got {len(value)}")
    redshifts = []
    for index, z in enumerate(value):
        try:
            redshifts.append(as_float(name, z, 0.0, 1100.0, low_open=True))
        except SettingError:
            raise _fail(name, f"a list of redshifts in (0, 1100] (item {index} is not)", value) from None
    return redshifts


def _range_text(low, high, low_open=False) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" > {low}" if low_open else f" >= {low}"
    if low is None:
        return f" <= {high}"
    return f" in {'(' if low_open else '['}{low}, {high}]"


# ----------------------------------------------------------------------------------
# Checks of the kinds that only the CLI config has.


def _check_cosmology(name, value):
    if isinstance(value, str):
        for preset in COSMOLOGY_PRESETS:
            if value.lower() == preset.lower():
                return preset
        raise _fail(name, "'Planck15', 'Planck18' or a table {Omega_c = ..., Omega_b = ..., h = ..., n_s = ..., sigma8 = ...}", value)
    if not isinstance(value, dict):
        raise _fail(name, "'Planck15', 'Planck18' or a table of parameters", value)
    unknown = sorted(set(value) - set(COSMOLOGY_KEYS))
    if "f_nl" in unknown:
        raise SettingError(f"`{name}`: `f_nl` is a setting of its own: write `f_nl = {value['f_nl']!r}` outside the table")
    if unknown:
        raise SettingError(f"`{name}`: unknown parameters {unknown}; known: {list(COSMOLOGY_KEYS)}")
    missing = [key for key in COSMOLOGY_REQUIRED if key not in value]
    if missing:
        raise SettingError(f"`{name}`: missing parameters {missing} (required: {list(COSMOLOGY_REQUIRED)})")
    table = {key: as_float(f"{name}.{key}", item) for key, item in value.items()}
    for key in ("Omega_c", "h", "sigma8"):
        if table[key] <= 0:
            raise _fail(f"{name}.{key}", "positive", value[key])
    if table["Omega_b"] < 0:
        raise _fail(f"{name}.Omega_b", "non-negative", value["Omega_b"])
    dark_energy = 1.0 - table["Omega_c"] - table["Omega_b"] - table.get("Omega_k", 0.0)
    if dark_energy < -DARK_ENERGY_TOLERANCE:  # rounding (Einstein-de Sitter) is no dark energy
        raise SettingError(f"`{name}`: the dark-energy density 1 - Omega_m - Omega_k must not be negative, got {dark_energy}")
    return table


def _check_power(name, value):
    if not isinstance(value, str) or not value:
        raise _fail(name, f"one of {', '.join(map(repr, POWER_NAMES))} or the path of a two-column text table", value)
    if value in POWER_NAMES:
        return value
    if os.path.isdir(value):
        raise SettingError(f"`{name}`: {value!r} is a directory, expected a two-column text table or one of {POWER_NAMES}")
    if not os.path.isfile(value):
        raise SettingError(f"`{name}`: {value!r} is neither one of {POWER_NAMES} nor an existing table file")
    try:
        with open(value, encoding="utf-8") as handle:
            handle.read()
    except UnicodeDecodeError:
        raise SettingError(f"`{name}`: {value!r} is not a UTF-8 text table (a binary file?)") from None
    except OSError as error:
        raise SettingError(f"`{name}`: cannot read {value!r}: {error.strerror}") from None
    return value


def _check_device(name, value):
    import torch

    if not isinstance(value, str) or not value:
        raise _fail(name, "a device string such as 'cpu', 'cuda' or 'cuda:1'", value)
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise _fail(name, "a device string such as 'cpu', 'cuda' or 'cuda:1'", value) from None
    if device.type not in ("cpu", "cuda"):
        raise _fail(name, "'cpu' or a CUDA device ('cuda', 'cuda:N')", value)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingError(f"`{name}` = {value!r}, but no CUDA device is available to this torch build")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SettingError(f"`{name}` = {value!r}, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return value


def _check_output(name, value):
    if not isinstance(value, str) or not value.strip():
        raise _fail(name, "a non-empty folder path", value)
    return value


def _linking_length(name, value):
    if not (_is_number(value) and math.isfinite(float(value)) and 0.0 <= float(value) < 1.0):
        raise _fail(name, "0 (no halos) or a linking length in (0, 1) mean particle separations (0.2 is usual)", value)
    return float(value)


def _check_grid(name, value):
    expected = "[] (a balanced grid for the world size) or a list of 2 positive integers [P0, P1]"
    items = _items(name, value, expected)
    if len(items) not in (0, 2):
        raise _fail(name, expected, value)
    try:
        return [as_int(name, item, 1) for item in items]
    except SettingError:
        raise _fail(name, expected, value) from None


# ----------------------------------------------------------------------------------
# The declaration.


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: its name, type, default, unit, allowed values and meaning.

    ``check(name, value)`` returns the normalised value or raises SettingError;
    ``kind`` (the TOML type) and ``allowed`` (range or choices) describe it for people.
    """

    name: str
    kind: str
    default: Any
    unit: str
    allowed: str
    help: str
    check: Callable[[str, Any], Any]

    def validate(self, value):
        return self.check(self.name, value)


def _choice(*choices):
    return lambda name, value: as_choice(name, value, choices)


def _int(low=None, high=None):
    return lambda name, value: as_int(name, value, low, high)


def _float(low=None, high=None, low_open=False):
    return lambda name, value: as_float(name, value, low, high, low_open=low_open)


def _steps(name, value):
    if _is_number(value):
        return as_int(name, value, 0, MAX_STEPS)
    return as_scale_factors(name, value)  # ([]: no step, as 0 and as Simulation(steps=[]))


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "n_particles", "int or 3 ints", default=64, unit="", allowed="int >= 1 or [nx, ny, nz]",
        help="particles per side (the white-noise and linear-field grid)",
        check=as_shape,
    ),
    Setting(
        "box_size", "float or 3 floats", default=256.0, unit="Mpc/h", allowed="(0, 1e6], or 3 values",
        help="box side(s)",
        check=as_box_size,
    ),
    Setting(
        "mesh_factor", "int", default=2, unit="", allowed="int >= 1",
        help="force mesh cells per particle per side",
        check=_int(1),
    ),
    Setting(
        "a_start", "float", default=0.1, unit="", allowed="(0, 1]",
        help="scale factor of the 2LPT initial conditions",
        check=_float(0.0, 1.0, True),
    ),
    Setting(
        "a_end", "float", default=1.0, unit="", allowed="(0, 1]",
        help="final scale factor when `steps` is a count",
        check=_float(0.0, 1.0, True),
    ),
    Setting(
        "steps", "int or list of floats", default=10, unit="", allowed=f"0 to {MAX_STEPS}, or a list",
        help="number of steps linear in a, or the increasing scale factors to step to",
        check=_steps,
    ),
    Setting(
        "lpt_order", "int", default=2, unit="", allowed="1, 2",
        help="order of the initial Lagrangian perturbation theory",
        check=_choice(1, 2),
    ),
    Setting(
        "lpt_normalisation", "string", default="fastpm", unit="", allowed="fastpm, exact",
        help="2LPT growth normalisation: FastPM's D2(a)/D2(1) or the consistent D2(a)/D1(1)^2",
        check=_choice("fastpm", "exact"),
    ),
    Setting(
        "integrator", "string", default="fastpm", unit="", allowed="fastpm, leapfrog",
        help="kick-drift-kick factors (FastPM growth-corrected or plain)",
        check=_choice("fastpm", "leapfrog"),
    ),
    Setting(
        "gradient", "string", default="fd4", unit="", allowed="fd4, exact",
        help="gradient kernel of the force (4-point finite difference or i k)",
        check=_choice("fd4", "exact"),
    ),
    Setting(
        "laplacian", "string", default="exact", unit="", allowed="exact, fd",
        help="inverse-Laplacian kernel (-1/k^2 or its finite-difference form)",
        check=_choice("exact", "fd"),
    ),
    Setting(
        "cic_compensation", "bool", default=False, unit="", allowed="true, false",
        help="divide the force kernel by the CIC window once (FastPM, JaxPM); CIC only",
        check=lambda n, v: as_bool(n, v),
    ),
    Setting(
        "window_compensation", "bool", default=False, unit="", allowed="true, false",
        help="divide the force kernel by the square of the paint_order window (not with cic_compensation)",
        check=lambda n, v: as_bool(n, v),
    ),
    Setting(
        "paint_order", "string", default="cic", unit="", allowed="ngp, cic, tsc, pcs",
        help="mass-assignment order of paint and readout",
        check=_choice(*PAINT_ORDERS),
    ),
    Setting(
        "power_spectrum", "string", default="eisenstein_hu", unit="(Mpc/h)^3", allowed="eisenstein_hu, eisenstein_hu_nowiggle, or a file",
        help="linear P(k) at a = 1: a fit or a two-column table (k h/Mpc, P)",
        check=_check_power,
    ),
    Setting(
        "cosmology", "string or table", default="Planck15", unit="", allowed="Planck15, Planck18, or a table",
        help="preset or {Omega_c, Omega_b, h, n_s, sigma8[, Omega_k, w0, wa]}",
        check=_check_cosmology,
    ),
    Setting(
        "f_nl", "float", default=0.0, unit="", allowed="a finite number",
        help="local primordial non-Gaussianity of the initial conditions, Phi = phi + f_nl (phi^2 - <phi^2>) "
             "(the CMB convention; 0: Gaussian); sets the cosmology's `f_nl`",
        check=_float(),
    ),
    Setting(
        "primordial_kmax", "float", default=0.0, unit="k_Nyquist", allowed="0 (none) or > 0",
        help="cut the initial conditions' Gaussian potential (and so every Gaussian mode) at and above this "
             "fraction of the particle grid's Nyquist wavenumber before the f_nl square (FastPM's "
             "kmax_primordial_over_knyquist; 2/3 keeps the square's aliases above 2/3 k_Nyquist; 0: no cut)",
        check=_float(0.0),
    ),
    Setting(
        "seed", "int", default=0, unit="", allowed=f"0 to {2**63 - 1}",
        help="seed of the white noise",
        check=_int(0, 2**63 - 1),
    ),
    Setting(
        "fixed_amplitude", "bool", default=False, unit="", allowed="true, false",
        help="fixed initial conditions: every Fourier amplitude of the white noise set to its expectation, phases kept",
        check=lambda n, v: as_bool(n, v),
    ),
    Setting(
        "paired", "bool", default=False, unit="", allowed="true, false",
        help="the paired partner of `seed`'s initial conditions: the negated white noise (phases shifted by pi)",
        check=lambda n, v: as_bool(n, v),
    ),
    Setting(
        "batch", "int", default=1, unit="", allowed="1 to 1000000",
        help="independent simulations run together",
        check=_int(1, 1_000_000),
    ),
    Setting(
        "dtype", "string", default="float32", unit="", allowed="float32, float64",
        help="dtype of particles and fields (the background is float64)",
        check=_choice("float32", "float64"),
    ),
    Setting(
        "device", "string", default="cpu", unit="", allowed="cpu, cuda, cuda:N",
        help="where the run happens",
        check=_check_device,
    ),
    Setting(
        "threads", "int", default=0, unit="", allowed="0 to 4096",
        help="torch.set_num_threads (0 leaves torch's default)",
        check=_int(0, 4096),
    ),
    Setting(
        "output", "string", default="out", unit="", allowed="folder",
        help="output folder (created and tested for writing before the run)",
        check=_check_output,
    ),
    Setting(
        "snapshots", "list of floats", default=[], unit="", allowed="list in (0, 1]",
        help="scale factors (on the step grid) at which to write Gadget HDF5 snapshots",
        check=lambda n, v: as_scale_factors(n, v),
    ),
    Setting(
        "redshift_space", "string", default="none", unit="", allowed="none, x, y, z",
        help="line of sight of the redshift-space P(k) multipoles P_0, P_2, P_4 written to power_multipoles.txt",
        check=_choice("none", "x", "y", "z"),
    ),
    Setting(
        "correlation_function", "bool", default=False, unit="", allowed="true, false",
        help="also write correlation_function.txt (and one per snapshot): xi(r) of the density in shells one "
             "force-mesh cell wide up to half the box, with linear theory",
        check=lambda n, v: as_bool(n, v),
    ),
    Setting(
        "write_density", "bool", default=False, unit="", allowed="true, false",
        help="write the final density on the force mesh (and in redshift space) to density.hdf5",
        check=lambda n, v: as_bool(n, v),
    ),
    Setting(
        "lensing_planes", "int", default=0, unit="", allowed="0 to 1000",
        help="lens planes tiling the box along `lensing_axis` (0: none): their scale factors join the steps, and "
             "lensing.hdf5 holds the planes, the Born convergence maps and their C_ell",
        check=_int(0, 1000),
    ),
    Setting(
        "lensing_axis", "string", default="z", unit="", allowed="x, y, z",
        help="line of sight of the light cone (the observer on the box face where it is 0)",
        check=_choice("x", "y", "z"),
    ),
    Setting(
        "lensing_field", "float", default=5.0, unit="deg", allowed="(0, 90]",
        help="side of the square convergence maps",
        check=_float(0.0, 90.0, True),
    ),
    Setting(
        "lensing_pixels", "int", default=128, unit="", allowed="1 to 16384",
        help="pixels per side of the convergence maps",
        check=_int(1, 16384),
    ),
    Setting(
        "lensing_resolution", "int", default=0, unit="", allowed="0 to 16384",
        help="pixels per side of each lens plane (0: the force mesh's cells across)",
        check=_int(0, 16384),
    ),
    Setting(
        "lensing_sources", "list of floats", default=[], unit="", allowed="redshifts in (0, 1100]",
        help="source redshifts of the convergence maps ([]: the far end of the planes)",
        check=lambda n, v: _redshifts(n, v),
    ),
    Setting(
        "halos_linking_length", "float", default=0.0, unit="mean separation", allowed="0 (none) or (0, 1)",
        help="friends-of-friends halos at the end and at each snapshot, linked within this many mean particle "
             "separations (0: none; 0.2 is usual), written to halos.hdf5 and halos_000.hdf5, ...",
        check=lambda n, v: _linking_length(n, v),
    ),
    Setting(
        "halos_min_members", "int", default=20, unit="particles", allowed="2 to 2147483647",
        help="the smallest halo kept in the halo catalogues",
        check=_int(2, 2**31 - 1),
    ),
    Setting(
        "shot_noise", "string", default="subtract", unit="", allowed="subtract, keep",
        help="the Poisson shot noise V/N_particles in the P(k) table and figure: subtracted or kept",
        check=_choice("subtract", "keep"),
    ),
    Setting(
        "sort_every", "int", default=0, unit="steps", allowed=f"0 to {MAX_STEPS}",
        help="sort the particles into spatial order after the LPT and every this many steps (0: never)",
        check=_int(0, MAX_STEPS),
    ),
    Setting(
        "memory_check", "string", default="error", unit="", allowed="error, warn, off",
        help="what to do when the estimated peak memory exceeds the device's",
        check=_choice("error", "warn", "off"),
    ),
    Setting(
        "grid", "list of 2 ints", default=[], unit="", allowed="[] or [P0, P1]",
        help="process grid of a distributed run ([] = the most square grid of the world size that can split the meshes)",
        check=_check_grid,
    ),
    Setting(
        "collective_timeout", "float", default=300.0, unit="s", allowed="> 0",
        help="timeout of the collectives of a distributed run",
        check=_float(0.0, 1e7, True),
    ),
)

BY_NAME = {setting.name: setting for setting in SETTINGS}


def defaults() -> dict:
    """Every setting at its default (fresh copies of list defaults)."""
    return {s.name: (list(s.default) if isinstance(s.default, list) else s.default) for s in SETTINGS}


def validate(config: dict) -> dict:
    """Check every key of ``config`` against :data:`SETTINGS` and the rules that
    relate keys; return the normalised config. Raises SettingError."""
    unknown = sorted(set(config) - set(BY_NAME))
    if unknown:
        raise SettingError(f"unknown keys {unknown}; known keys: {sorted(BY_NAME)}")
    result = {}
    for name, value in config.items():
        result[name] = BY_NAME[name].validate(value)
    # Rules between keys: the scale-factor grid and the snapshots on it.
    grid = as_steps(result.get("steps", 10), result.get("a_start", 0.1), result.get("a_end", 1.0))
    snapshots = result.get("snapshots", [])
    for a in snapshots:
        if not any(abs(a - s) <= 1e-9 * s for s in grid):
            raise SettingError(
                f"`snapshots`: {a} is not one of the scale factors of the run; snapshots are written "
                f"at the end of a step: choose from a_start = {grid[0]}, the step ends up to a_end = {grid[-1]}"
            )
    return result


def _line_of(text: str, key: str) -> int | None:
    """The line of ``text`` where top-level ``key`` is set, if it can be found."""
    pattern = re.compile(rf"^\s*(\[\s*)?[\"']?{re.escape(key)}[\"']?\s*(=|\])")
    for number, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line):
            return number
    return None


def load_config(path: str | None, overrides: dict | None = None) -> dict:
    """The defaults updated by the TOML file at ``path`` (and ``overrides``), validated.

    Raises SettingError with a one-line message naming the file, the line (when
    it can be found) and the key.
    """
    config = defaults()
    text = ""
    user = {}
    if path is not None:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise SettingError("reading a config needs Python >= 3.11 or `pip install tomli`") from None
        if os.path.isdir(path):
            raise SettingError(f"config {path!r} is a directory, expected a TOML file")
        try:
            with open(path, "rb") as handle:
                raw = handle.read()
        except FileNotFoundError:
            raise SettingError(f"config file {path!r} not found") from None
        except OSError as error:
            raise SettingError(f"cannot read config {path!r}: {error.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise SettingError(f"config {path!r} is not UTF-8 text (byte {error.start}); expected a TOML file") from None
        try:
            user = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise SettingError(f"{path}: not valid TOML: {error}") from None
    for key, value in (overrides or {}).items():
        user[key] = value
    unknown = sorted(set(user) - set(BY_NAME))
    if unknown:
        line = _line_of(text, unknown[0]) if text else None
        where = f"{path}:{line}: " if line else (f"{path}: " if path else "")
        raise SettingError(f"{where}unknown keys {unknown}; known keys: {sorted(BY_NAME)}")
    for key, value in user.items():
        try:
            config[key] = BY_NAME[key].validate(value)
        except SettingError as error:
            line = _line_of(text, key) if text and key not in (overrides or {}) else None
            where = f"{path}:{line}: " if line else (f"{path}: " if path and key not in (overrides or {}) else "")
            raise SettingError(f"{where}{error}") from None
    try:
        return validate(config)
    except SettingError as error:
        raise SettingError(f"{path}: {error}" if path else str(error)) from None


def markdown_table() -> str:
    """The README table of every setting (generated; do not edit the README by hand)."""
    import json

    def show(value):
        return json.dumps(value) if not isinstance(value, str) else f'"{value}"'

    lines = ["| key | type | default | unit | allowed | meaning |", "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        lines.append(f"| `{s.name}` | {s.kind} | `{show(s.default)}` | {s.unit} | {s.allowed} | {s.help} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------
# Simulation's arguments.


def simulation_arguments(
    *, n_particles, box_size, mesh_factor, a_start, steps, a_end, lpt_order, integrator, gradient,
    laplacian, cic_compensation, checkpoint,
) -> dict:
    """Check and normalise the plain (non-object) arguments of :class:`torchpm.Simulation`.

    Returns ``particle_shape``, ``box_size``, ``mesh_factor``, ``scale_factors``
    (``[a_start, ..., a_end]``), ``lpt_order``, ``integrator``, ``gradient``,
    ``laplacian``, ``cic_compensation``, ``checkpoint``.
    """
    return dict(
        particle_shape=as_shape("n_particles", n_particles),
        box_size=as_box_size("box_size", box_size),
        mesh_factor=as_int("mesh_factor", mesh_factor, 1),
        scale_factors=as_steps(steps, a_start, a_end),
        lpt_order=BY_NAME["lpt_order"].validate(lpt_order),
        integrator=BY_NAME["integrator"].validate(integrator),
        gradient=BY_NAME["gradient"].validate(gradient),
        laplacian=BY_NAME["laplacian"].validate(laplacian),
        cic_compensation=as_bool("cic_compensation", cic_compensation),
        checkpoint=as_bool("checkpoint", checkpoint),
    )
