"""JaxPM 0.1.6 (CPU, float64) as an independent reference for torchpm's physics.

Numpy in, numpy out. Imports neither torch nor torchpm. Install the pinned stack with
``bash tools/install_jaxpm.sh`` (jax/jaxlib 0.6.2, jaxdecomp 0.2.7, jaxpm 0.1.6,
jax-cosmo 0.1.0, diffrax 0.7.0; see tools/jaxpm-requirements.txt). Importing this
module turns on ``jax_enable_x64`` and pins JAX to the CPU for the whole process.

``SKIP_REASON`` is None when JaxPM imports, else a string for ``pytest.skip``.

Cosmology: every call builds a fresh ``jax_cosmo.Cosmology`` from the dict
``{Omega_c, Omega_b, h, n_s, sigma8}`` with Omega_k = 0, w0 = -1, wa = 0, so the growth
tables jax_cosmo/JaxPM cache in ``cosmo._workspace`` never leak between calls.

Conventions (checked against JaxPM 0.1.6's source, ``jaxpm/pm.py``):

* Mesh units throughout: positions in cells, k in radians per cell (w = 2 pi n / N),
  H0 = 1. Particle i sits on node ``np.indices(shape).reshape(3, -1).T[i]`` (C order).
* ``linear_field``: JaxPM draws ``w = jax.random.normal(seed, shape)`` and returns
  ``ifft3d( fft3d(w) * sqrt(P(k) * Nx*Ny*Nz / (Lx*Ly*Lz)) )`` with k = |(w_i N_i / L_i)|
  in h/Mpc, fft3d unnormalised, ifft3d with 1/N (jaxdecomp pfft3d/pifft3d; the real
  part is kept). That is exactly DESIGN.md's ``delta(k) = DFT(w)(k) sqrt(P(k) N / V)``.
  JaxPM leaves P to the caller: we pass ``jax_cosmo.power.linear_matter_power(cosmo, k)``
  (Eisenstein & Hu *with* BAO wiggles, "eisenhu_osc", sigma8-normalised by jax_cosmo's
  top-hat integral) evaluated exactly on the mesh; it returns P(0) = 0, so the k = 0 mode
  is zeroed as in DESIGN.md. (JaxPM's own tests instead interpolate P on
  logspace(-4, 1, 128); that adds ~1e-3 interpolation error and leaves P(0) = P(1e-4) != 0,
  so we do not do it.) We feed the caller's noise by swapping ``jaxpm.pm.normal_field``
  for the duration of the call and then call ``jaxpm.pm.linear_field`` itself.
  Caveat: ``linear_matter_power`` caches jax_cosmo's growth table under the SAME key
  (``cosmo._workspace["background.growth_factor"]``) that JaxPM's growth functions use,
  and JaxPM's LPT then fails (KeyError 'h') or would use the wrong table; ``lpt``/``nbody``
  therefore reset ``cosmo._workspace = {}`` after building the field, as JaxPM's tests do.
* ``lpt``: ``jaxpm.pm.lpt(cosmo, delta, particles=grid, a=a0, order)`` with the 4-point
  gradient ``i(8 sin w - sin 2w)/6`` and the exact ``-1/|w|^2`` (0 at w = 0), also for the
  second-order source phi_ij = G_i G_j (-1/|w|^2) delta. Displacement
  ``dx = D1 Psi1 + 3/7 D2 Psi2`` (D2 > 0, D2(1) = 1), momentum
  ``p = a^2 E(a) [f1 D1 Psi1 + f2 3/7 D2 Psi2]``, i.e. ``p = a^3 E(a) dx/da`` in mesh units:
  the same convention as DESIGN.md. Positions are ``q + dx``, NOT wrapped into the box.
* ``nbody``: JaxPM's ODE ``dx/da = p / (a^3 E)``, ``dp/da = 1.5 Omega_m F / (a^2 E)`` with
  ``F = readout(IDFT[-G_i (-1/|w|^2) DFT(rho)])`` and rho the CIC paint of the particles
  (``jaxpm.pm.make_diffrax_ode``), solved by diffrax Dopri5 + PIDController(rtol, atol,
  pcoeff=0.4, icoeff=1, dcoeff=0), SaveAt(t1) (JaxPM 0.1.6 has no FastPM KDK; its tests
  use this ODE). Final positions are returned in force-mesh units, not wrapped.
  Mesh factor B > 1: JaxPM 0.1.6's public ``cic_paint``/``cic_read`` reshape positions to
  the mesh shape, so they only work when #particles == #cells. For B > 1 we run the ICs and
  LPT on the particle grid, multiply positions AND momenta by B (mesh units of the force
  mesh; p = a^3 E dx/da scales like x), and, during the solve, swap ``jaxpm.pm.cic_paint``
  / ``cic_read`` for JaxPM's own single-device kernels ``_cic_paint_impl`` /
  ``_cic_read_impl`` (which take any (N, 3)), painting each particle with mass B^3 so rho
  has mean 1 on the force mesh (as in DESIGN.md; unit masses would make the force B^3 too
  weak). For B = 1 the public JaxPM functions run unmodified. (At B = 2 the particle
  lattice is coarser than the mesh; its lowest modes grow ~1.5% faster than D1 over
  a = 0.1 -> 0.5 in the self-test, the usual lattice discreteness effect, while B = 1
  grows ~2.4% slower than D1 there, from the CIC^2 window.)
* ``paint``: JaxPM's CIC of unit-mass particles (public ``cic_paint`` when #particles ==
  #cells, else ``_cic_paint_impl``, the same kernel), periodic.

Growth functions available (use ``growth(cosmo, a)`` below for numpy values):
``jaxpm.growth.growth_factor`` (D1, D1(1)=1), ``growth_rate`` (f1 = dlnD1/dlna),
``growth_factor_second`` (D2 > 0, D2(1)=1; JaxPM uses 3/7 D2 as the 2LPT factor),
``growth_rate_second`` (f2), ``Gf``/``Gf2`` (a^3 E dD/da), ``dGfa``/``dGf2a`` (gf = dGf/da).
All come from one table: jax_cosmo's ``odeint`` on 128 log-spaced a in [1e-3, 1] started
from D1 = a, D2 = -3/7 a^2 and linearly interpolated in a; this is what JaxPM's LPT uses.
Measured against a tight scipy solve of DESIGN.md's growth ODEs (Planck15, a = 0.05..1):
D1, f1, f2 agree to <= 1.3e-4 (worst near a = 0.5), D2 to <= 7e-4 (its start at a = 1e-3
is not on the pure growing mode). ``jax_cosmo.background.growth_factor``/``growth_rate``
(first order only) give the same numbers (same ODE, same table); ``Esqr``, ``Omega_m_a`` are
in ``jax_cosmo.background`` too.

Cost (2-core CPU, shared): each function compiles once per mesh shape (5-15 s), later
calls take milliseconds, except ``nbody``: at 32^3 with rtol = atol = 1e-8, B = 1 takes
~31 Dopri5 steps, ~5 s; B = 2 (64^3 force mesh) ~75 steps, ~50 s; 32x32x64 with B = 2
~70 s. rtol 1e-8 is converged: positions move by <= 7.5e-5 cells (rms 1e-6) against
rtol 1e-10. Set TORCHPM_JAXPM_CACHE=<folder> to cache ``nbody`` results on disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import sys
import types

import numpy as np

SKIP_REASON: str | None = None


def _shim_pkg_resources() -> None:
    # jax-cosmo 0.1.0 does `from pkg_resources import ...` only to read its version;
    # setuptools >= 81 no longer ships pkg_resources. Provide the two names it needs.
    try:
        import pkg_resources  # noqa: F401
        return
    except ImportError:
        pass
    mod = types.ModuleType("pkg_resources")

    class DistributionNotFound(Exception):
        pass

    def get_distribution(name):
        try:
            return types.SimpleNamespace(version=importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError as exc:
            raise DistributionNotFound(name) from exc

    mod.DistributionNotFound = DistributionNotFound
    mod.get_distribution = get_distribution
    sys.modules["pkg_resources"] = mod


try:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _shim_pkg_resources()
    import jax

    jax.config.update("jax_enable_x64", True)
    try:
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # backends already initialised by an earlier jax user
        pass
    import diffrax
    import jax.numpy as jnp
    import jax_cosmo as jc
    import jaxpm
    import jaxpm.growth as jgrowth
    import jaxpm.painting as jpainting
    import jaxpm.pm as jpm

    JAXPM_VERSION = importlib.metadata.version("jaxpm")
    if JAXPM_VERSION != "0.1.6":
        SKIP_REASON = f"JaxPM {JAXPM_VERSION} installed, the adapter is written for 0.1.6"
except Exception as exc:  # ImportError, or a broken jax install
    SKIP_REASON = (f"JaxPM reference unavailable ({type(exc).__name__}: {exc}); "
                   "run `bash tools/install_jaxpm.sh`")


def _check():
    if SKIP_REASON is not None:
        raise RuntimeError(SKIP_REASON)


def make_cosmology(cosmo: dict):
    """A fresh jax_cosmo.Cosmology (empty growth cache) from the torchpm-style dict."""
    _check()
    return jc.Cosmology(Omega_c=float(cosmo["Omega_c"]), Omega_b=float(cosmo["Omega_b"]),
                        h=float(cosmo["h"]), n_s=float(cosmo["n_s"]),
                        sigma8=float(cosmo["sigma8"]), Omega_k=0.0, w0=-1.0, wa=0.0)


@contextlib.contextmanager
def _patched(module, **attrs):
    old = {k: getattr(module, k) for k in attrs}
    for k, v in attrs.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _noise(white_noise):
    w = np.asarray(white_noise, dtype=np.float64)
    if w.ndim != 3:
        raise ValueError(f"white_noise must be (nx, ny, nz), got {w.shape}")
    return w


def _linear_field_impl(noise, c, box_size):
    """JaxPM's linear_field with its random draw replaced by the given noise."""

    def normal_field(seed, shape, sharding=None, dtype=float):
        assert tuple(shape) == noise.shape
        return noise

    def pk(k):
        return jc.power.linear_matter_power(c, k)

    with _patched(jpm, normal_field=normal_field):
        return jpm.linear_field(noise.shape, box_size, pk, seed=None)


def _lpt_impl(noise, c, a0, box_size, order):
    delta = _linear_field_impl(noise, c, box_size)
    # jax_cosmo's linear_matter_power filled cosmo._workspace["background.growth_factor"]
    # with jax_cosmo's own growth table; JaxPM's growth functions use the same key but need
    # their own table (with D2, f2, ...). Reset it, as JaxPM's tests do.
    c._workspace = {}
    grid = _grid(noise.shape)
    dx, p, _ = jpm.lpt(c, delta, particles=grid, a=a0, order=order)
    return grid + dx, p  # (nx, ny, nz, 3) each


def _box(box_size):
    box = tuple(float(x) for x in box_size)
    if len(box) != 3 or min(box) <= 0:
        raise ValueError(f"box_size must be three positive lengths, got {box_size}")
    return jnp.asarray(box, dtype=jnp.float64)


def _linear_field_jax(w, box_size, c):
    return _linear_field_jit(jnp.asarray(w), c, _box(box_size))


def linear_field(white_noise, box_size, cosmo):
    """JaxPM's linear density contrast at a = 1 on white_noise's grid, float64."""
    _check()
    w = _noise(white_noise)
    return np.asarray(_linear_field_jax(w, box_size, make_cosmology(cosmo)))


def _linear_power_impl(c, k, a):
    return jc.power.linear_matter_power(c, k, a=a)


def linear_power(k, cosmo, a=1.0):
    """jax_cosmo's Eisenstein-Hu linear P(k) [(Mpc/h)^3], k in h/Mpc (what linear_field uses)."""
    _check()
    k = np.asarray(k, dtype=np.float64)
    out = _linear_power_jit(make_cosmology(cosmo), jnp.asarray(k.reshape(-1)), jnp.float64(a))
    return np.asarray(out).reshape(k.shape)


def _growth_impl(c, c2, a):
    out = {
        "E": jnp.sqrt(jc.background.Esqr(c, a)),
        "D1": jgrowth.growth_factor(c, a),
        "f1": jgrowth.growth_rate(c, a),
        "D2": jgrowth.growth_factor_second(c, a),
        "f2": jgrowth.growth_rate_second(c, a),
        "Gf": jgrowth.Gf(c, a),
        "gf": jgrowth.dGfa(c, a),
        "Gf2": jgrowth.Gf2(c, a),
        "gf2": jgrowth.dGf2a(c, a),
    }
    # separate cosmology (cache): jax_cosmo's own table differs from JaxPM's
    out["D1_jax_cosmo"] = jc.background.growth_factor(c2, a)
    out["f1_jax_cosmo"] = jc.background.growth_rate(c2, a)
    return out


if SKIP_REASON is None:
    # Eager JAX is slow here (jax_cosmo's sigma8 integral alone is ~3 s at 32^3): jit both;
    # the monkeypatches above are active while the functions are traced.
    # The box is traced (one compilation per mesh shape and LPT order).
    _linear_field_jit = jax.jit(_linear_field_impl)
    _lpt_jit = jax.jit(_lpt_impl, static_argnums=(4,))
    _growth_jit = jax.jit(_growth_impl)
    _linear_power_jit = jax.jit(_linear_power_impl)


def growth(cosmo, a):
    """JaxPM's growth functions at scale factors a (numpy, 1-d).

    Keys: E, D1, f1, D2, f2, Gf, gf (= dGf/da), Gf2, gf2 (what JaxPM's LPT uses), and
    D1_jax_cosmo, f1_jax_cosmo (jax_cosmo.background's own first-order table).
    """
    _check()
    a = np.atleast_1d(np.asarray(a, dtype=np.float64))
    if a.ndim != 1:
        raise ValueError("a must be a scalar or 1-d")
    n = max(8, 1 << (len(a) - 1).bit_length())  # pad: few distinct compilations
    ap = np.concatenate([a, np.ones(n - len(a))])
    out = _growth_jit(make_cosmology(cosmo), make_cosmology(cosmo), jnp.asarray(ap))
    return {k: np.asarray(v)[:len(a)] for k, v in out.items()}


def _grid(shape):
    return jnp.stack(jnp.meshgrid(*[jnp.arange(s, dtype=jnp.float64) for s in shape],
                                  indexing="ij"), axis=-1)


def _lpt_jax(w, box_size, c, a0, order):
    if order not in (1, 2):
        raise ValueError("order must be 1 or 2")
    return _lpt_jit(jnp.asarray(w), c, jnp.float64(a0), _box(box_size), int(order))


def lpt(white_noise, box_size, cosmo, a0, order):
    """JaxPM's LPT at a0: (positions (N, 3) [particle-grid cells], momenta (N, 3), p = a^3 E dx/da)."""
    _check()
    w = _noise(white_noise)
    pos, p = _lpt_jax(w, box_size, make_cosmology(cosmo), a0, order)
    return np.asarray(pos).reshape(-1, 3), np.asarray(p).reshape(-1, 3)


@contextlib.contextmanager
def _force_mesh_patch(B):
    """For B > 1, let JaxPM's pm_forces paint/read N != #cells particles, with mass B^3."""
    if B == 1:
        yield
        return
    mass = float(B ** 3)  # force-mesh cells per particle -> rho has mean 1

    def cic_paint(grid_mesh, positions, weight=1.0, halo_size=0, sharding=None):
        return jpainting._cic_paint_impl(grid_mesh, positions, weight * mass)

    def cic_read(grid_mesh, positions, halo_size=0, sharding=None):
        return jpainting._cic_read_impl(grid_mesh, positions)

    with _patched(jpm, cic_paint=cic_paint, cic_read=cic_read):
        yield


_SOLVERS = {}


def _solver(mesh_shape, B, rtol, atol, max_steps):
    """One jitted solve per setting, so repeated calls reuse the compiled program.

    Traced (hence patched, see _force_mesh_patch) on first use only.
    """
    key = (mesh_shape, B, rtol, atol, max_steps)
    if key not in _SOLVERS:
        ode_fn = jpm.make_diffrax_ode(mesh_shape, paint_absolute_pos=True)

        def solve(y0, c, a0, a1):
            # diffrax returns y0 unchanged when t1 == t0.
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(ode_fn), diffrax.Dopri5(), t0=a0, t1=a1, dt0=None, y0=y0,
                args=c, saveat=diffrax.SaveAt(t1=True),
                stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol, pcoeff=0.4,
                                                          icoeff=1, dcoeff=0),
                max_steps=max_steps)
            return sol.ys[-1], sol.stats

        _SOLVERS[key] = jax.jit(solve)
    return _SOLVERS[key]


def nbody(white_noise, box_size, cosmo, a0, order, mesh_factor=1, a_final=1.0,
          rtol=1e-8, atol=1e-8, max_steps=16384, return_stats=False):
    """JaxPM's ODE N-body solution at a_final from LPT at a0.

    Returns final positions (N, 3) in cells of the force mesh (B x the particle grid per
    side), not wrapped; with return_stats=True also diffrax's stats dict. If the
    environment variable TORCHPM_JAXPM_CACHE names a folder, results are cached there
    (keyed by a hash of every input, the noise bytes and the JaxPM/jax/diffrax versions).
    """
    _check()
    B = int(mesh_factor)
    if B != mesh_factor or B < 1:
        raise ValueError("mesh_factor must be a positive integer")
    w = _noise(white_noise)
    cache_file = None
    if os.environ.get("TORCHPM_JAXPM_CACHE"):
        key = hashlib.sha256(repr((
            w.shape, [float(x) for x in box_size], sorted((k, float(v)) for k, v in cosmo.items()),
            float(a0), int(order), B, float(a_final), float(rtol), float(atol), int(max_steps),
            JAXPM_VERSION, jax.__version__, diffrax.__version__)).encode() + w.tobytes()).hexdigest()
        cache_file = os.path.join(os.environ["TORCHPM_JAXPM_CACHE"], f"nbody-{key[:32]}.npz")
        if os.path.exists(cache_file):
            with np.load(cache_file) as f:
                out, stats = f["positions"], {k[6:]: int(f[k]) for k in f.files if k[:6] == "stats_"}
            return (out, stats) if return_stats else out
    c = make_cosmology(cosmo)
    pos, p = _lpt_jax(w, box_size, c, a0, order)
    if B == 1:
        y0 = jnp.stack([pos, p])  # JaxPM's own layout: (2, nx, ny, nz, 3)
    else:
        y0 = jnp.stack([B * pos.reshape(-1, 3), B * p.reshape(-1, 3)])
    mesh_shape = tuple(B * s for s in w.shape)
    solve = _solver(mesh_shape, B, float(rtol), float(atol), int(max_steps))
    with _force_mesh_patch(B):
        ys, stats = solve(y0, c, jnp.float64(a0), jnp.float64(a_final))
    stats = {k: int(v) for k, v in stats.items()}
    out = np.asarray(ys[0]).reshape(-1, 3)
    if cache_file is not None:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        tmp = cache_file + f".{os.getpid()}.tmp.npz"
        np.savez(tmp, positions=out, **{"stats_" + k: v for k, v in stats.items()})
        os.replace(tmp, cache_file)
    return (out, stats) if return_stats else out


def paint(positions, mesh_shape):
    """JaxPM's periodic CIC paint of unit-mass particles (positions (N, 3) in cells)."""
    _check()
    pos = jnp.asarray(np.asarray(positions, dtype=np.float64).reshape(-1, 3))
    mesh_shape = tuple(int(s) for s in mesh_shape)
    mesh = jnp.zeros(mesh_shape, dtype=jnp.float64)
    if pos.shape[0] == int(np.prod(mesh_shape)):
        out = jpainting.cic_paint(mesh, pos)
    else:
        out = jpainting._cic_paint_impl(mesh, pos)
    return np.asarray(out)


def density_plane(positions, box_shape, center, width, plane_resolution):
    """``jaxpm.lensing.density_plane`` (positions (N, 3) in mesh cells, ``box_shape`` the
    mesh, the slab ``(center - width/2, center + width/2]`` along z in cells): CIC-painted
    counts per unit cell volume, (plane_resolution, plane_resolution)."""
    _check()
    import jaxpm.lensing as jlensing

    pos = jnp.asarray(np.asarray(positions, dtype=np.float64).reshape(-1, 3))
    return np.asarray(jlensing.density_plane(pos, tuple(int(s) for s in box_shape), float(center), float(width),
                                             int(plane_resolution)))


def convergence_born(cosmo, planes, coords, z_source, source_distances=None):
    """``jaxpm.lensing.convergence_Born``: ``planes`` a list of dicts (r, a, plane, dx, dz)
    with numpy planes, ``coords`` (2, ...) radians, ``z_source`` (n_z,). Returns
    (n_z, ...). JaxPM subtracts each plane's mean and reads the plane at index
    ``coords r / dx - 1/2`` (pixel centres at ``(j + 1/2) dx``), periodic, bilinear.

    ``source_distances`` (n_z,), Mpc/h: used instead of jax_cosmo's distances to the
    sources (its table is off by up to 0.3 Mpc/h), by swapping
    ``jax_cosmo.background.radial_comoving_distance`` for the call."""
    _check()
    import jaxpm.lensing as jlensing

    c = make_cosmology(cosmo)
    entries = [dict(r=float(p["r"]), a=float(p["a"]), plane=jnp.asarray(p["plane"], dtype=jnp.float64),
                    dx=float(p["dx"]), dz=float(p["dz"])) for p in planes]
    patch = {}
    if source_distances is not None:
        fixed = jnp.asarray(np.atleast_1d(source_distances), dtype=jnp.float64)
        patch["radial_comoving_distance"] = lambda cosmo, a: fixed
    with _patched(jc.background, **patch):
        out = jlensing.convergence_Born(c, entries, jnp.asarray(coords, dtype=jnp.float64),
                                        jnp.asarray(np.atleast_1d(z_source), dtype=jnp.float64))
    return np.asarray(out)


def comoving_distance(cosmo, a):
    """``jax_cosmo.background.radial_comoving_distance`` (Mpc/h; a table of 256 log-spaced a
    in [1e-3, 1] integrated by odeint, then interpolated)."""
    _check()
    c = make_cosmology(cosmo)
    return np.asarray(jc.background.radial_comoving_distance(c, jnp.atleast_1d(jnp.asarray(a, dtype=jnp.float64))))
