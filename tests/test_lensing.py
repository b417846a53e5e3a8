"""Weak lensing (torchpm.lensing) and the comoving distances it rests on.

Oracles: astropy's distances (independent quadrature, flat, open and closed, w0-wa);
JaxPM 0.1.6's ``density_plane`` and ``convergence_Born`` on the same particles and
planes (jaxpm_reference.py); hand-counted planes and hand-computed Born sums at plane
nodes; gradcheck; the run's own states for the light-cone driver. The grid cases are in
test_distributed_simulation.py (``lightcone``).
"""

import contextlib
import math

import numpy as np
import pytest
import torch

import jaxpm_reference as jaxpm
import torchpm
from torchpm import lensing
from torchpm.cosmology import HUBBLE_DISTANCE

astropy_cosmology = pytest.importorskip("astropy.cosmology")
needs_jaxpm = pytest.mark.skipif(jaxpm.SKIP_REASON is not None, reason=str(jaxpm.SKIP_REASON))

A = torch.tensor([1.0, 0.97, 0.8, 0.5, 0.25, 0.1, 0.02, 1e-3], dtype=torch.float64)


def _astropy(cosmology):
    """The same background in astropy (no radiation)."""
    c = {k: float(v) for k, v in cosmology.parameters().items()}
    return astropy_cosmology.w0waCDM(H0=100 * c["h"], Om0=c["Omega_c"] + c["Omega_b"],
                                     Ode0=1 - c["Omega_c"] - c["Omega_b"] - c["Omega_k"], w0=c["w0"], wa=c["wa"],
                                     Tcmb0=0)


COSMOLOGIES = {
    "planck15": torchpm.Planck15(),
    "open_w0wa": torchpm.Cosmology(0.25, 0.05, 0.7, 0.96, 0.8, Omega_k=0.1, w0=-0.9, wa=0.2),
    "closed": torchpm.Cosmology(0.35, 0.05, 0.7, 0.96, 0.8, Omega_k=-0.1),
}


@pytest.mark.parametrize("name", COSMOLOGIES)
def test_distances_against_astropy(name):
    cosmology = COSMOLOGIES[name]
    reference = _astropy(cosmology)
    h = float(cosmology.h)
    z = 1 / A.numpy() - 1
    chi = cosmology.comoving_distance(A).numpy()
    expected = reference.comoving_distance(z).value * h
    np.testing.assert_allclose(chi, expected, rtol=1e-12, atol=1e-9)
    transverse = cosmology.transverse_comoving_distance(A).numpy()
    np.testing.assert_allclose(transverse, reference.comoving_transverse_distance(z).value * h, rtol=1e-12, atol=1e-9)
    # the inverse to rounding
    a = cosmology.scale_factor_at_distance(torch.tensor(chi))
    np.testing.assert_allclose(a.numpy(), A.numpy(), rtol=1e-13)


@needs_jaxpm
def test_comoving_distance_against_jax_cosmo():
    cosmology = COSMOLOGIES["planck15"]
    parameters = {k: float(v) for k, v in cosmology.parameters().items()}
    a = A[A >= 0.02]
    theirs = jaxpm.comoving_distance(parameters, a.numpy())
    # jax_cosmo interpolates linearly in a table of 256 log-spaced a (2.7 % apart), which is
    # off by up to 0.3 Mpc/h (0.2 % at a = 0.97; astropy agrees with ours to 1e-15 there)
    np.testing.assert_allclose(cosmology.comoving_distance(a).numpy(), theirs, rtol=3e-3, atol=0.3)


def test_distance_gradients():
    omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)
    omega_k = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    a = torch.tensor([0.9, 0.4, 0.05], dtype=torch.float64, requires_grad=True)
    chi = torch.tensor([100.0, 1500.0, 6000.0], dtype=torch.float64, requires_grad=True)

    def distances(omega_c, omega_k, a, chi):
        c = torchpm.Cosmology(omega_c, 0.05, 0.68, 0.96, 0.8, Omega_k=omega_k)
        return c.comoving_distance(a), c.transverse_comoving_distance(a), c.scale_factor_at_distance(chi)

    # at Omega_k = 0 (f_K's series) and on both sides of it, in the series and in sinh / sin
    for value in (0.0, 1e-4, -1e-4, 0.3, -0.3):
        curvature = torch.tensor(value, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(distances, (omega_c, curvature, a, chi))
    # second derivatives of the inverse (Hessians through Limber): exact, not only first ones
    assert torch.autograd.gradgradcheck(lambda omega_c, chi: distances(omega_c, omega_k, a, chi)[2],
                                        (omega_c, chi))
    # the scale of a's second derivative is ~1e-8 per (Mpc/h)^2: against central differences
    c = torchpm.Planck15()
    x = torch.tensor(2000.0, dtype=torch.float64, requires_grad=True)
    (first,) = torch.autograd.grad(c.scale_factor_at_distance(x), x, create_graph=True)
    (second,) = torch.autograd.grad(first, x)
    h = 1.0
    with torch.no_grad():
        values = [float(c.scale_factor_at_distance(torch.tensor(2000.0 + d * h, dtype=torch.float64)))
                  for d in (-1, 0, 1)]
    numeric = (values[0] - 2 * values[1] + values[2]) / h**2
    assert abs(float(second) - numeric) < 1e-4 * abs(numeric), (float(second), numeric)
    # d chi / d a by hand: -D_H / (a^2 E)
    c = torchpm.Planck15()
    x = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(c.comoving_distance(x), x)
    assert abs(float(grad) + HUBBLE_DISTANCE / (0.36 * float(c.E(0.6)))) < 1e-9 * abs(float(grad))


def test_distance_errors():
    c = torchpm.Planck15()
    with pytest.raises(ValueError, match="`chi` must be finite and not negative"):
        c.scale_factor_at_distance(-1.0)
    with pytest.raises(ValueError, match="beyond"):
        c.scale_factor_at_distance(1e6)
    with pytest.raises(ValueError, match="scale factor `a` must be positive"):
        c.comoving_distance(0.0)


# -------------------------------------------------------------------------- planes


def test_lens_planes_and_steps():
    c = torchpm.Planck15()
    planes = lensing.lens_planes(c, (100.0, 100.0, 800.0), 4)
    assert planes.distances == (100.0, 300.0, 500.0, 700.0) and planes.widths == (200.0,) * 4 and planes.axis == 2
    chi = c.comoving_distance(torch.tensor(planes.scale_factors, dtype=torch.float64)).numpy()
    np.testing.assert_allclose(chi, planes.distances, rtol=1e-12)
    steps = lensing.lightcone_steps(planes, 0.1, 8)
    assert steps == sorted(steps) and steps[-1] == max(planes.scale_factors) and steps[0] > 0.1
    assert set(planes.scale_factors) <= set(steps)
    spacing = (max(planes.scale_factors) - 0.1) / 8
    linear = [s for s in steps if s not in planes.scale_factors]
    assert len(linear) >= 5 and all(min(abs(s - p) for p in planes.scale_factors) > 0.25 * spacing for s in linear)
    shallow = lensing.lens_planes(c, 100.0, 2, axis="x", depth=50.0)
    assert shallow.distances == (12.5, 37.5) and shallow.axis == 0
    with pytest.raises(ValueError, match="`depth` must be in"):
        lensing.lens_planes(c, 100.0, 2, depth=150.0)
    with pytest.raises(ValueError, match="`n_planes` must be a positive integer"):
        lensing.lens_planes(c, 100.0, 0)
    with pytest.raises(ValueError, match="`axis`"):
        lensing.lens_planes(c, 100.0, 2, axis=3)
    with pytest.raises(ValueError, match="`a_start` must be in"):
        lensing.lightcone_steps(planes, 0.99, 8)


@needs_jaxpm
def test_density_plane_against_jaxpm():
    mesh = (16, 16, 32)
    rng = np.random.default_rng(3)
    positions = rng.uniform(0, 1, (int(np.prod(mesh)), 3)) * mesh
    positions[:, :2] += rng.integers(-2, 3, (positions.shape[0], 2)) * 16  # outside the box: wrapped
    resolution = 8
    for center, width in ((10.0, 4.0), (25.5, 7.0)):
        theirs = jaxpm.density_plane(positions, mesh, center, width, resolution)
        ours = lensing.density_plane(torch.tensor(positions).unsqueeze(0), mesh, center, width, resolution)
        # JaxPM: counts per cell volume (mean 1 with one particle per cell); ours: delta
        np.testing.assert_allclose(ours[0].numpy(), theirs - 1.0, rtol=0, atol=1e-12)


def test_density_plane_hand_cases(device):
    box = (40.0, 20.0, 10.0)  # line of sight x: transverse (y, z) of 20 and 10 Mpc/h
    # on nodes of a (4, 2) plane: pixel (1, 1) is (y, z) = (5, 5)
    positions = torch.tensor([[[0.0, 5.0, 5.0],    # x = 0: the slab [-2, 2) holds it
                               [-2.0, 5.0, 5.0],   # x = 38 = -2 (periodic): the lower edge, in
                               [2.0, 5.0, 5.0],    # the upper edge, out
                               [39.0, 25.0, -5.0],  # (25, -5) = (5, 5) wrapped
                               [1.0, 2.5, 0.0],    # half-way between pixels (0, 0) and (1, 0)
                               [0.5, 10.0, 0.0],   # an empty slot (id -1)
                               [20.0, 10.0, 0.0]]],  # far from the slab
                             dtype=torch.float64, device=device)
    ids = torch.tensor([[0, 1, 2, 3, 4, -1, 5]], device=device)
    weights = torch.tensor([[1.0, 2.0, 1.0, 1.0, 4.0, 1.0, 1.0]], dtype=torch.float64, device=device)
    plane = lensing.density_plane(positions, box, 0.0, 4.0, (4, 2), axis="x", weights=weights, ids=ids, total=80.0)
    # mean per pixel: 80 particles x (4 / 40) of the depth / 8 pixels = 1
    expected = torch.full((4, 2), -1.0, dtype=torch.float64, device=device)
    expected[1, 1] += 1 + 2 + 1
    expected[0, 0] += 2
    expected[1, 0] += 2
    assert torch.equal(plane[0], expected)
    # default total: the weights of the full slots (1 + 2 + 1 + 1 + 4 + 1 = 10), so the
    # mean per pixel is 10 x (4 / 40) / 8 = 1/8
    default = lensing.density_plane(positions, box, 0.0, 4.0, (4, 2), axis=0, weights=weights, ids=ids)
    torch.testing.assert_close(default[0], (expected + 1) * 8.0 - 1, rtol=0, atol=1e-13)
    # NGP: the half-way particle goes to one pixel, whole
    ngp = lensing.density_plane(positions, box, 0.0, 4.0, (4, 2), axis=0, weights=weights, ids=ids, total=80.0,
                                order="ngp")
    expected_ngp = expected.clone()
    expected_ngp[0, 0] -= 2
    expected_ngp[1, 0] += 2  # (pixel coordinate 0.5 rounds up: floor(x + 1/2))
    assert torch.equal(ngp[0], expected_ngp)


def test_density_plane_errors():
    x = torch.rand(1, 10, 3, dtype=torch.float64)
    for kwargs, fragment in ((dict(width=0.0), "`width` must be in"), (dict(resolution=0), "`resolution`"),
                             (dict(order="quintic"), "order"), (dict(axis=4), "`axis`"),
                             (dict(weights=torch.ones(1, 9, dtype=torch.float64)), "`weights` must be"),
                             (dict(weights=torch.ones(1, 10)), "`weights` must have the positions' dtype"),
                             (dict(ids=torch.zeros(2, 10, dtype=torch.int64)), "`ids` must be"),
                             (dict(total=0), "`total` must be a positive number"),
                             (dict(center=float("nan")), "`center` must be a finite number")):
        arguments = dict(center=0.5, width=0.5, resolution=4)
        arguments.update(kwargs)
        with pytest.raises(ValueError, match=fragment):
            lensing.density_plane(x, 1.0, **arguments)
    with pytest.raises(ValueError, match="`positions` must be a \\(B, N, 3\\)"):
        lensing.density_plane(x[0], 1.0, 0.5, 0.5, 4)
    for column in (0, 2):  # a NaN across or along the line of sight
        bad = x.clone()
        bad[0, 3, column] = float("nan")
        with pytest.raises(ValueError, match="`positions` must be finite, got 1 particles"):
            lensing.density_plane(bad, 1.0, 0.5, 0.5, 4)
    # an empty slot's coordinates are not looked at
    bad = x.clone()
    bad[0, 3, 0] = float("nan")
    ids = torch.arange(10).unsqueeze(0).clone()
    ids[0, 3] = -1
    assert bool(torch.isfinite(lensing.density_plane(bad, 1.0, 0.5, 0.5, 4, ids=ids)).all())
    # nor its weight, which may be anything (slot 0 too, where the plane's unused slots
    # point); an occupied slot's must be finite
    ids[0, 0] = -1
    weights = torch.rand(1, 10, dtype=torch.float64)
    expected = lensing.density_plane(x, 1.0, 0.5, 0.5, 4, ids=ids, weights=torch.where(ids >= 0, weights, 0.0))
    for value in (float("nan"), float("inf"), 1e300):
        weights[0, 3] = weights[0, 0] = value
        torch.testing.assert_close(lensing.density_plane(x, 1.0, 0.5, 0.5, 4, ids=ids, weights=weights), expected,
                                   rtol=0, atol=0)
        with pytest.raises(ValueError, match="`weights` must be finite, got 2 NaN or inf") if value != 1e300 \
                else contextlib.nullcontext():
            lensing.density_plane(x, 1.0, 0.5, 0.5, 4, weights=weights)
    # with `total`, only the slab's weights are read: a NaN outside it is not refused
    inside = x.clone()
    inside[0, :5, 2], inside[0, 5:, 2] = 0.5, 0.9  # the slab is [0.25, 0.75)
    weights = torch.ones(1, 10, dtype=torch.float64)
    weights[0, 7] = float("nan")
    expected = lensing.density_plane(inside, 1.0, 0.5, 0.5, 4, weights=torch.ones_like(weights), total=9.0)
    torch.testing.assert_close(lensing.density_plane(inside, 1.0, 0.5, 0.5, 4, weights=weights, total=9.0), expected,
                               rtol=0, atol=0)
    weights[0, 2] = float("inf")
    with pytest.raises(ValueError, match="`weights` must be finite in the slab, got 1 NaN or inf"):
        lensing.density_plane(inside, 1.0, 0.5, 0.5, 4, weights=weights, total=9.0)
    for kwargs in (dict(ids=torch.full((1, 10), -1)), dict(weights=torch.zeros(1, 10, dtype=torch.float64))):
        with pytest.raises(ValueError, match="no mean density to divide by"):
            lensing.density_plane(x, 1.0, 0.5, 0.5, 4, **kwargs)
    with pytest.raises(ValueError, match="no mean density"):
        lensing.density_plane(x[:, :0], 1.0, 0.5, 0.5, 4)


def test_density_plane_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(2, 12, 3, generator=g, dtype=torch.float64) * 10).requires_grad_()
    w = torch.rand(2, 12, generator=g, dtype=torch.float64).requires_grad_()
    # (the slab's edges are steps: no particle sits within gradcheck's eps of them)
    assert torch.autograd.gradcheck(lambda x, w: lensing.density_plane(x, 10.0, 5.0, 6.0, (5, 4), weights=w), (x, w))


def test_neighbouring_planes_share_their_edges():
    """Particles within a few ulps of the edges between planes: the light cone's slabs hold
    each exactly once (``d + w/2`` and the next plane's ``d - w/2`` differ in the last bit
    for some planes, which lost or doubled such particles)."""
    c = torchpm.Planck15()
    for length, n in ((300.0, 7), (35.0, 3), (1000.0, 13)):
        planes = lensing.lens_planes(c, (10.0, 10.0, length), n)
        edges = lensing._shared_edges(planes, length)
        assert all(edges[i][1] == edges[i + 1][0] for i in range(n - 1))
        xs = []
        for d, w in zip(planes.distances[:-1], planes.widths[:-1]):
            x = d + 0.5 * w
            for _ in range(4):
                x = np.nextafter(x, -np.inf)
            for _ in range(8):
                xs.append(x)
                x = np.nextafter(x, np.inf)
        positions = torch.zeros(1, len(xs), 3, dtype=torch.float64)
        positions[0, :, 2] = torch.tensor(xs)
        for dtype in (torch.float64, torch.float32):
            counted = 0.0
            for i in range(n):
                plane = lensing.density_plane(positions.to(dtype), (10.0, 10.0, length), planes.distances[i],
                                              planes.widths[i], 1, total=len(xs), _edges=edges[i])
                counted += float((plane.double() + 1).sum()) * len(xs) * planes.widths[i] / length
            assert abs(counted - len(xs)) < 1e-4, (length, n, dtype, counted)


# ---------------------------------------------------------------------- convergence


def _random_planes(n, resolution, seed, batch=None):
    g = torch.Generator().manual_seed(seed)
    shape = (n, *resolution) if batch is None else (batch, n, *resolution)
    planes = torch.randn(*shape, generator=g, dtype=torch.float64)
    return planes - planes.mean((-1, -2), keepdim=True)


@needs_jaxpm
def test_convergence_against_jaxpm():
    cosmology = COSMOLOGIES["planck15"]
    parameters = {k: float(v) for k, v in cosmology.parameters().items()}
    box = (200.0, 200.0, 1600.0)
    geometry = lensing.lens_planes(cosmology, box, 8)
    planes = _random_planes(8, (32, 32), 1)
    angles = lensing.angular_grid(4.0, 12)
    z_source = [0.3, 0.8, 1.5]  # chi(0.3) = 830 Mpc/h: the farther planes do not lens those sources
    ours = lensing.convergence_born(planes, geometry, box, angles, z_source, cosmology)
    assert ours.shape == (12, 12, 3)
    theirs = 0
    dx = box[0] / 32
    # (our source distances, which astropy confirms: jax_cosmo's table is off by up to 0.3 Mpc/h)
    chi_s = cosmology.comoving_distance(1 / (1 + torch.tensor(z_source, dtype=torch.float64))).numpy()
    for i, (r, a, width) in enumerate(zip(geometry.distances, geometry.scale_factors, geometry.widths)):
        # JaxPM's pixel centres sit half a pixel from ours (nodes at j dx): shift its angles
        coords = np.moveaxis(angles.numpy(), -1, 0) + 0.5 * dx / r
        theirs = theirs + jaxpm.convergence_born(parameters, [dict(r=r, a=a, plane=planes[i].numpy(), dx=dx,
                                                                   dz=width)], coords, np.array(z_source),
                                                 source_distances=chi_s)
    theirs = np.moveaxis(theirs, 0, -1)
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=0, atol=1e-12 * scale)
    assert np.abs(theirs[..., 0]).max() > 0.01 * scale  # the near source is lensed at all


@pytest.mark.parametrize("name", ["planck15", "open_w0wa"])
def test_convergence_hand_case_at_plane_nodes(name, device):
    """One plane, angles pointing at its nodes: kappa = 3/2 Om (H0/c)^2 w f_K(chi)
    f_K(chi_s - chi) / f_K(chi_s) delta / a with astropy's distances."""
    cosmology = COSMOLOGIES[name]
    reference = _astropy(cosmology)
    h = float(cosmology.h)
    box = (64.0, 48.0, 300.0)
    geometry = lensing.LensPlanes((250.0,), (100.0,), (0.9,), 2)
    plane = _random_planes(1, (8, 6), 2).to(device)
    f_chi = float(cosmology.transverse_distance(torch.tensor(250.0, dtype=torch.float64)))
    nodes = torch.tensor([[1, 2], [7, 0], [3, 5], [8, 6]], dtype=torch.float64)  # (8, 6): node (0, 0) again
    angles = (nodes * torch.tensor([8.0, 8.0], dtype=torch.float64) / f_chi).to(device)
    kappa = lensing.convergence_born(plane, geometry, box, angles, 1.2, cosmology)
    chi_s = reference.comoving_distance(1.2).value * h
    ok = float(cosmology.Omega_k)

    def f_k(x):
        if ok == 0:
            return x
        root = math.sqrt(ok) / HUBBLE_DISTANCE
        return math.sinh(root * x) / root

    factor = 1.5 * float(cosmology.Omega_m) / HUBBLE_DISTANCE**2 * 100.0 * f_k(250.0) * f_k(chi_s - 250.0) / f_k(chi_s) / 0.9
    values = plane[0][[1, 7, 3, 0], [2, 0, 5, 0]]
    torch.testing.assert_close(kappa, factor * values, rtol=1e-12, atol=0)
    # beyond the source: nothing
    assert float(lensing.convergence_born(plane, geometry, box, angles, 0.05, cosmology).abs().max()) == 0.0


def test_convergence_gradcheck():
    geometry = lensing.LensPlanes((40.0, 120.0), (80.0, 80.0), (0.98, 0.95), 1)
    planes = _random_planes(2, (5, 4), 3, batch=2).requires_grad_()
    angles = (torch.rand(3, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.2).requires_grad_()
    omega_c = torch.tensor(0.26, dtype=torch.float64, requires_grad=True)

    def kappa(planes, angles, omega_c):
        c = torchpm.Cosmology(omega_c, 0.05, 0.68, 0.96, 0.8)
        return lensing.convergence_born(planes, geometry, (160.0, 30.0, 20.0), angles, [0.2, 0.5], c)

    assert torch.autograd.gradcheck(kappa, (planes, angles, omega_c))


def test_convergence_errors():
    c = torchpm.Planck15()
    geometry = lensing.LensPlanes((40.0, 120.0), (80.0, 80.0), (0.98, 0.95), 2)
    planes = _random_planes(2, (4, 4), 0)
    angles = torch.zeros(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="n = 2 planes"):
        lensing.convergence_born(planes[:1], geometry, 100.0, angles, 1.0, c)
    with pytest.raises(ValueError, match="`angles` must be a \\(..., 2\\)"):
        lensing.convergence_born(planes, geometry, 100.0, torch.zeros(3, 3), 1.0, c)
    with pytest.raises(ValueError, match="`z_source` must be positive"):
        lensing.convergence_born(planes, geometry, 100.0, angles, [1.0, -1.0], c)
    with pytest.raises(ValueError, match="`geometry` must be a LensPlanes"):
        lensing.convergence_born(planes, (40.0,), 100.0, angles, 1.0, c)
    with pytest.raises(ValueError, match="`cosmology` must be a torchpm.Cosmology"):
        lensing.convergence_born(planes, geometry, 100.0, angles, 1.0, None)
    with pytest.raises(ValueError, match="`field_of_view`"):
        lensing.angular_grid(-1.0, 8)
    for call in (lambda: lensing.angular_grid(200.0, 8), lambda: lensing.angular_grid((5.0, 90.5), 8),
                 lambda: lensing.angular_power_spectrum(torch.zeros(8, 8), 200.0)):
        with pytest.raises(ValueError, match=r"`field_of_view` must be at most 90 \(flat sky\)"):  # (the config's)
            call()
    assert lensing.angular_grid((90.0, 5.0), 8).shape == (8, 8, 2)
    with pytest.raises(ValueError, match="at least one plane"):
        lensing.convergence_born(planes[:0], lensing.LensPlanes((), (), (), 2), 100.0, angles, 1.0, c)
    with pytest.raises(ValueError, match="scale factors in \\(0, 1\\]"):
        lensing.convergence_born(planes, lensing.LensPlanes((40.0, 120.0), (80.0, 80.0), (0.98, 1.5), 2), 100.0,
                                 angles, 1.0, c)


# ------------------------------------------------------------------------ light cone


def _lightcone_simulation(**overrides):
    c = torchpm.Planck15()
    box = (40.0, 40.0, 160.0)
    planes = lensing.lens_planes(c, box, 4)
    config = dict(n_particles=(8, 8, 32), box_size=box, a_start=0.1, steps=lensing.lightcone_steps(planes, 0.1, 4),
                  dtype=torch.float64, cosmology=c)
    config.update(overrides)
    return torchpm.Simulation(**config), planes


def test_lightcone_planes_are_the_runs_planes(device, reproducible):
    sim, planes = _lightcone_simulation(mesh_factor=2)
    sim = sim.to(device)
    noise = sim.white_noise(2, seed=5)
    taken = lensing.lightcone(sim, noise, planes=planes, resolution=(10, 12))
    assert taken.shape == (2, 4, 10, 12)
    for i, a in enumerate(planes.scale_factors):
        state = sim(noise, until=a)  # an uninterrupted run to the plane's scale factor
        expected = lensing.density_plane(state.positions, sim.box_size, planes.distances[i], planes.widths[i],
                                         (10, 12), total=sim.n_total)
        torch.testing.assert_close(taken[:, i], expected, rtol=0, atol=1e-12)
        # the plane holds the particles of its slab at that time: counted directly
        z = state.positions[..., 2]
        inside = ((z >= planes.distances[i] - 20.0) & (z < planes.distances[i] + 20.0)).sum(-1)
        mean = sim.n_total * (40.0 / 160.0) / 120
        torch.testing.assert_close((taken[:, i] + 1).sum((1, 2)) * mean, inside.to(torch.float64), rtol=1e-12, atol=0)


def test_lightcone_gradients():
    """The gradient of a convergence loss in the white noise and Omega_c: autodiff against
    central differences, and the adjoint method against autodiff."""
    angles = lensing.angular_grid(6.0, 6)

    def loss(sim, planes, noise):
        taken = lensing.lightcone(sim, noise, planes=planes, resolution=8)
        kappa = lensing.convergence_born(taken, planes, sim.box_size, angles, 0.6, sim.cosmology)
        return (kappa**2).sum() * 1e4

    gradients = []
    for adjoint in (False, True):
        omega_c = torch.tensor(0.2589, dtype=torch.float64, requires_grad=True)
        sim, planes = _lightcone_simulation(adjoint=adjoint, cosmology=torchpm.Planck15(Omega_c=omega_c))
        noise = sim.white_noise(seed=1).requires_grad_()
        loss(sim, planes, noise).backward()
        gradients.append((noise.grad, omega_c.grad))
    (noise_grad, omega_grad), (adjoint_noise, adjoint_omega) = gradients
    torch.testing.assert_close(adjoint_noise, noise_grad, rtol=1e-7, atol=1e-7 * float(noise_grad.abs().max()))
    torch.testing.assert_close(adjoint_omega, omega_grad, rtol=1e-7, atol=0)
    sim, planes = _lightcone_simulation()
    noise = sim.white_noise(seed=1)
    direction = torch.randn(noise.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    eps = 1e-5
    with torch.no_grad():
        numeric = (loss(sim, planes, noise + eps * direction) - loss(sim, planes, noise - eps * direction)) / (2 * eps)
    analytic = float((noise_grad * direction).sum())
    assert abs(analytic - float(numeric)) < 1e-5 * abs(analytic), (analytic, float(numeric))
    values = []
    for omega in (0.2589 + 1e-5, 0.2589 - 1e-5):
        sim, planes = _lightcone_simulation(cosmology=torchpm.Planck15(Omega_c=omega))
        with torch.no_grad():
            values.append(float(loss(sim, planes, noise)))
    numeric_omega = (values[0] - values[1]) / 2e-5
    assert abs(float(omega_grad) - numeric_omega) < 1e-4 * abs(float(omega_grad)), (float(omega_grad), numeric_omega)


def test_lightcone_errors():
    sim, planes = _lightcone_simulation()
    plain = torchpm.Simulation((8, 8, 32), (40.0, 40.0, 160.0), a_start=0.1, steps=4, dtype=torch.float64)
    noise = sim.white_noise()
    with pytest.raises(ValueError, match="lightcone_steps"):
        lensing.lightcone(plain, noise, planes=planes, resolution=8)
    deep = lensing.lens_planes(sim.cosmology, (40.0, 40.0, 320.0), 4)
    with pytest.raises(ValueError, match="beyond the simulation's box"):
        lensing.lightcone(sim, noise, planes=deep, resolution=8)
    with pytest.raises(ValueError, match="`resolution`"):
        lensing.lightcone(sim, noise, planes=planes, resolution=(8, 0))
    with pytest.raises(ValueError, match="`planes` must be a LensPlanes"):
        lensing.lightcone(sim, noise, planes=None, resolution=8)


# -------------------------------------------------------------- angular power, Limber


def test_angular_power_spectrum_hand_cases():
    field = (4.0, 2.0)  # degrees; 32 x 16 pixels: square pixels of 1/8 degree
    omega = math.radians(4.0) * math.radians(2.0)
    j0 = torch.arange(32, dtype=torch.float64)
    wave = 0.3 * torch.cos(2 * math.pi * 3 * j0 / 32).unsqueeze(1).expand(32, 16)
    spectrum = angular = lensing.angular_power_spectrum(wave, field)
    ell_wave = 2 * math.pi * 3 / math.radians(4.0)
    ring = int(torch.argmin((spectrum.ell - ell_wave).abs()))
    # all the power in the wave's ring: C = A^2 Omega / (2 modes)
    expected = torch.zeros_like(spectrum.power)
    expected[ring] = 0.3**2 * omega / (2 * float(spectrum.modes[ring]))
    torch.testing.assert_close(spectrum.power, expected, rtol=1e-12, atol=1e-12 * float(expected.max()))
    # against numpy's DFT binned independently (mode counts, mean ell, power), batched
    maps = torch.randn(3, 32, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = lensing.angular_power_spectrum(maps, field)
    f = np.fft.fft2(maps.numpy())
    l0 = 2 * np.pi * np.fft.fftfreq(32, math.radians(4.0) / 32)
    l1 = 2 * np.pi * np.fft.fftfreq(16, math.radians(2.0) / 16)
    ell = np.hypot(l0[:, None], l1[None, :])
    fundamental = 2 * np.pi / math.radians(4.0)
    rings = np.floor(ell / fundamental + 0.5).astype(int)
    n_rings = int(round(min(np.pi * 32 / math.radians(4.0), np.pi * 16 / math.radians(2.0)) / fundamental))
    power, modes, means = [], [], []
    for r in range(1, n_rings + 1):
        mask = rings == r
        if mask.any():
            modes.append(mask.sum())
            means.append(ell[mask].mean())
            power.append((np.abs(f[:, mask]) ** 2).mean(-1) * (omega / 512) ** 2 / omega)
    np.testing.assert_array_equal(got.modes.numpy(), modes)
    np.testing.assert_allclose(got.ell.numpy(), means, rtol=1e-14)
    np.testing.assert_allclose(got.power.numpy(), np.stack(power, -1), rtol=1e-12)
    assert angular.power.dim() == 1 and got.power.shape == (3, len(modes))
    with pytest.raises(ValueError, match="`maps` must be"):
        lensing.angular_power_spectrum(torch.zeros(4), field)


def test_limber_against_an_independent_quadrature_and_jax_cosmo(tmp_path):
    """The Limber integral by scipy's adaptive quadrature with astropy's distances (same
    linear power and growth: checks the kernel, the distances and the integration), and
    jax_cosmo's angular_cl for a WeakLensing probe of one source redshift (independent
    code; its distance and growth tables carry a few 1e-3)."""
    from scipy import integrate

    cosmology = COSMOLOGIES["planck15"]
    reference = _astropy(cosmology)
    h = float(cosmology.h)
    om = float(cosmology.Omega_m)
    table = torchpm.cosmology.growth_table(cosmology)
    z_s = 1.0
    chi_s = reference.comoving_distance(z_s).value * h
    ells = [30.0, 2000.0]
    ours = lensing.limber_convergence_power(torch.tensor(ells), z_s, cosmology)
    capped = lensing.limber_convergence_power(torch.tensor(ells), z_s, cosmology, chi_max=1000.0)

    from scipy import optimize

    def reference_power(ell, z_max):  # Simpson in z on 4001 points (dchi = D_H dz / E(z))
        z = np.linspace(0, z_max, 4001)[1:]
        chi = reference.comoving_distance(z).value * h
        a = 1 / (1 + z)
        kernel = 1.5 * om / HUBBLE_DISTANCE**2 * (chi_s - chi) / chi_s / a
        k = torch.tensor((ell + 0.5) / chi, dtype=torch.float64)
        p = (table.at(torch.tensor(a, dtype=torch.float64)).D1 ** 2 * torchpm.linear_power(k, cosmology)).numpy()
        values = np.concatenate([[0.0], kernel**2 * p * HUBBLE_DISTANCE / reference.efunc(z)])
        return integrate.simpson(values, x=np.linspace(0, z_max, 4001))

    z_cap = optimize.brentq(lambda z: reference.comoving_distance(z).value * h - 1000.0, 0.01, 1.0, xtol=1e-15)
    for i, ell in enumerate(ells):
        expected = reference_power(ell, z_s)
        assert abs(float(ours[i]) / expected - 1) < 1e-6, (ell, float(ours[i]), expected)
        expected = reference_power(ell, z_cap)
        assert abs(float(capped[i]) / expected - 1) < 1e-6, (ell, float(capped[i]), expected)
    # a table of the same power, as a path and as a PowerTable: grown by D1^2 like the name;
    # one ending at k = 10 h/Mpc starts the integral where (ell + 1/2) / chi reaches 10
    k = np.logspace(-4, 2, 3000)
    path = tmp_path / "power.txt"
    np.savetxt(path, np.c_[k, torchpm.linear_power(torch.tensor(k), cosmology).numpy()])
    for given in (str(path), torchpm.PowerTable(path)):
        # (log-log interpolation of 3000 rows over 6 decades: ~1e-6)
        torch.testing.assert_close(lensing.limber_convergence_power(torch.tensor(ells), z_s, cosmology, power=given),
                                   ours, rtol=1e-5, atol=0)
    short = k[k <= 10.0]
    np.savetxt(path, np.c_[short, torchpm.linear_power(torch.tensor(short), cosmology).numpy()])
    cut = lensing.limber_convergence_power(torch.tensor(ells), z_s, cosmology, power=str(path))
    z_near = optimize.brentq(lambda z: reference.comoving_distance(z).value * h - 2000.5 / 10.0, 1e-4, 1.0, xtol=1e-15)
    edges = np.linspace(z_near, z_s, 4001)  # the integrand of reference_power on [z_near, z_s]
    chi = reference.comoving_distance(edges).value * h
    a = 1 / (1 + edges)
    kk = torch.tensor(2000.5 / chi, dtype=torch.float64)
    p = (table.at(torch.tensor(a, dtype=torch.float64)).D1 ** 2 * torchpm.linear_power(kk, cosmology)).numpy()
    values = (1.5 * om / HUBBLE_DISTANCE**2 * (chi_s - chi) / chi_s / a) ** 2 * p * HUBBLE_DISTANCE / reference.efunc(edges)
    assert abs(float(cut[1]) / integrate.simpson(values, x=edges) - 1) < 1e-5
    torch.testing.assert_close(cut[0], ours[0], rtol=1e-5, atol=0)  # ell = 30 needs k <= 10 from chi = 3 Mpc/h
    with pytest.raises(ValueError, match="`power` must be"):
        lensing.limber_convergence_power(torch.tensor(ells), z_s, cosmology, power=3)
    with pytest.raises(ValueError, match="`z_source` must be a redshift in"):
        lensing.limber_convergence_power(torch.tensor(ells), 1e300, cosmology)
    if jaxpm.SKIP_REASON is None:
        import jax.numpy as jnp
        import jax_cosmo as jc

        c = jaxpm.make_cosmology({k: float(v) for k, v in cosmology.parameters().items()})
        probe = jc.probes.WeakLensing([jc.redshift.delta_nz(z_s)])
        theirs = np.asarray(jc.angular_cl.angular_cl(c, jnp.array(ells), [probe], nonlinear_fn=jc.power.linear))[0]
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-2)
