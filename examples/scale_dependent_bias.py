"""Scale-dependent halo bias from local primordial non-Gaussianity (Dalal et al. 2008).

Runs each seed twice from the same white noise, with ``f_nl = +F`` and ``f_nl = -F``
(``torchpm.Planck15(f_nl=...)``), finds friends-of-friends halos (linking length 0.2)
in both final states, paints the halos above ``--min-members`` particles and the matter
on a ``--mesh`` mesh, and measures the bias ``b(k) = P_hm(k) / P_mm(k)`` of each run.
Half the difference ``Delta b(k) = [b_+F(k) - b_-F(k)] / 2`` isolates the f_nl term (the
runs share their Gaussian modes, so most of the cosmic variance and of the halos'
stochasticity cancels), and is compared with the prediction of Dalal et al. (2008) and
Slosar et al. (2008) in the CMB convention of ``f_nl`` that torchpm uses::

    Delta b(k) = 2 F (b_1 - 1) q delta_c / M(k, a),
    M(k, a) = 2/3 (k c/H0)^2 T(k) D_md(a) / Omega_m,

``delta_c = 1.686``, ``b_1`` the large-scale bias of the mean of the two runs
(``k <= --k-bias``), ``T(k)`` the transfer function read from the linear power as
torchpm's initial conditions read it, and ``D_md(a)`` the linear growth normalised to
``a`` deep in matter domination (0.78 at a = 1 for Planck15). ``M(k, 1)`` is the
transfer from the primordial potential to the linear density of ``torchpm.ic``, so the
formula is ``3 F (b_1 - 1) q delta_c Omega_m H0^2 / (c^2 k^2 T(k) D(a))`` of Slosar et
al. (2008, their growth ``D`` normalised to ``1 / (1 + z)`` deep in matter domination).
``q = 1`` is the spherical-collapse prediction; N-body FoF halos are fitted better with
``q`` about 0.75 (Grossi et al. 2009; ``--q`` sets the second curve of the figure). The
prediction in each k bin is averaged over the bin's modes with the estimator's own
weights (the measured ``|delta_m(k)|^2`` of the mean of the two runs), so a bin whose
1/k^2 varies across it is compared like for like. The script also fits
``Delta b = c + s * prediction(q = 1)`` over ``k <= --k-fit``: ``s`` is the effective
``q``, and ``c`` a scale-independent shift (f_nl also changes the mass function, so the
halos above one mass in the two runs differ in ``b_1``; negative for F > 0).

Writes ``result.json`` (b(k) of each run, Delta b per seed, the predictions, the ratios in
the lowest bins) and, when matplotlib is available, ``scale_dependent_bias.png`` into
``--output``.

    python examples/scale_dependent_bias.py                 # 4 CPU-minutes: 7 minutes on 2 busy cores
    python examples/scale_dependent_bias.py --seeds 4       # 4 times that; benchmarks/RESULTS.md
    python examples/scale_dependent_bias.py --particles 64 --box-size 250 --f-nl 500   # a quick look

``--f-nl 0`` runs the same field twice: Delta b is then exactly 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import torchpm
from torchpm.analysis import cross_power, paint_density, power_spectrum
from torchpm.cosmology import HUBBLE_DISTANCE
from torchpm.ic import PRIMORDIAL_K

DELTA_C = 1.686


def run_spectra(sim, noise, mesh_shape, min_members):
    """Final state of ``sim`` from ``noise``: the matter and halo overdensities on
    ``mesh_shape`` (CIC), the halo count, mean halo mass, and the seconds of the run and
    of the halo finder."""
    with torch.no_grad():
        start = time.perf_counter()
        state = sim(noise)
        middle = time.perf_counter()
        halos = torchpm.find_halos(sim, state, linking_length=0.2, min_members=min_members)
        seconds = (middle - start, time.perf_counter() - middle)
    scale = torch.tensor(mesh_shape, dtype=state.positions.dtype, device=state.positions.device) / torch.tensor(
        sim.box_size, dtype=state.positions.dtype, device=state.positions.device)
    matter = paint_density(state.positions * scale, shape=mesh_shape)[0]
    keep = halos.members[0] >= min_members  # (the catalogue pads with 0-member rows only in a batch)
    if not bool(keep.any()):
        raise SystemExit(f"no halo of >= {min_members} particles: use more particles, a larger box or a smaller "
                         "--min-members")
    positions = halos.positions[0][keep].to(state.positions.dtype)
    halo_field = paint_density((positions * scale).unsqueeze(0), shape=mesh_shape)[0]
    mean_mass = float(halos.masses[0][keep].double().mean())
    return matter, halo_field, int(keep.sum()), mean_mass, seconds


def inverse_transfer(sim, mesh_shape, a):
    """``1 / M(k, a)`` on the rfft grid of ``mesh_shape`` (0 at k = 0), float64."""
    box = sim.box_size
    axes = [torch.fft.fftfreq(n, d=1.0 / n, dtype=torch.float64) * (2 * math.pi / length)
            for n, length in zip(mesh_shape[:-1], box[:-1])]
    axes.append(torch.fft.rfftfreq(mesh_shape[-1], d=1.0 / mesh_shape[-1], dtype=torch.float64)
                * (2 * math.pi / box[-1]))
    kx, ky, kz = torch.meshgrid(*axes, indexing="ij")
    k = torch.sqrt(kx**2 + ky**2 + kz**2)
    nonzero = k > 0
    safe = torch.where(nonzero, k, torch.ones_like(k))
    cosmology = sim.cosmology
    with torch.no_grad():
        power = sim.linear_power(torch.cat([safe.reshape(-1), torch.tensor([PRIMORDIAL_K], dtype=torch.float64)]))
        power = power.to(torch.float64).cpu()
        n_s = float(cosmology.n_s)
        transfer = torch.sqrt(power[:-1].reshape(k.shape) / power[-1] * (PRIMORDIAL_K / safe) ** n_s)
        table = sim.growth_table()
        d_md = float(table.at(a).D1) * float(table.D1_matter_era)  # D1(a) / D1(1) * D_md(1)
    m = 2.0 / 3.0 * (safe * HUBBLE_DISTANCE) ** 2 * transfer * d_md / float(cosmology.Omega_m)
    return torch.where(nonzero, 1.0 / m, torch.zeros_like(m)), d_md


def _finite(value):
    """``value`` with NaN replaced by None (strict JSON)."""
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--particles", type=int, default=256, help="particles per side")
    parser.add_argument("--box-size", type=float, default=1000.0, help="Mpc/h")
    parser.add_argument("--mesh-factor", type=int, default=1, help="force mesh cells per particle per side")
    parser.add_argument("--steps", type=int, default=10, help="FastPM steps from a = 0.1")
    parser.add_argument("--a-end", type=float, default=1.0, help="scale factor of the halos")
    parser.add_argument("--f-nl", type=float, default=100.0, help="F: the runs have f_nl = +F and -F")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0 .. seeds-1, each run with +F and -F")
    parser.add_argument("--fixed", action="store_true", help="fixed-amplitude white noise (paired-and-fixed ICs)")
    parser.add_argument("--min-members", type=int, default=20, help="smallest halo kept (particles)")
    parser.add_argument("--mesh", type=int, default=128, help="cells per side of the mesh the spectra use")
    parser.add_argument("--k-bias", type=float, default=0.05, help="b_1: mean bias of the bins k <= this (h/Mpc)")
    parser.add_argument("--low-bins", type=int, default=3, help="lowest k bins whose ratio is reported")
    parser.add_argument("--k-fit", type=float, default=0.05,
                        help="fit Delta b = c + s * prediction over the bins k <= this (h/Mpc)")
    parser.add_argument("--q", type=float, default=0.75, help="the N-body calibration of delta_c in the second curve")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default=os.path.join("out", "scale_dependent_bias"))
    args = parser.parse_args()

    start = time.perf_counter()
    mesh_shape = (args.mesh,) * 3
    sims = {}
    for sign in (+1, -1):
        cosmology = torchpm.Planck15(f_nl=sign * args.f_nl)
        sims[sign] = torchpm.Simulation(args.particles, args.box_size, mesh_factor=args.mesh_factor, steps=args.steps,
                                        a_end=args.a_end, cosmology=cosmology).to(args.device)
    box = sims[1].box_size

    bias = {+1: [], -1: []}
    cross_modes = []  # per seed: (sum over each bin of |delta_m|^2 / M, of |delta_m|^2): the prediction's weights
    halo_counts = {+1: [], -1: []}
    halo_masses = {+1: [], -1: []}
    inverse_m, d_md = inverse_transfer(sims[1], mesh_shape, args.a_end)
    k = modes = None
    for seed in range(args.seeds):
        noise = sims[1].white_noise(seed=seed, fixed_amplitude=args.fixed)
        matter = {}
        for sign in (+1, -1):
            delta_m, delta_h, count, mass, seconds = run_spectra(sims[sign], noise, mesh_shape, args.min_members)
            p_hm = cross_power(delta_h, delta_m, box, window="cic")
            p_mm = power_spectrum(delta_m, box, window="cic")
            bias[sign].append((p_hm.power / p_mm.power).double().cpu())
            halo_counts[sign].append(count)
            halo_masses[sign].append(mass)
            matter[sign] = delta_m
            k, modes = p_mm.k.double().cpu(), p_mm.modes.cpu()
            print(f"seed {seed}, f_nl = {sign * args.f_nl:+g}: {count} halos of >= {args.min_members} particles "
                  f"(mean mass {mass:.3g} Msun/h); run {seconds[0]:.0f} s, FoF {seconds[1]:.0f} s", flush=True)
        # the estimator's weights: Delta b_bin = sum_bin Delta b(k) |delta_m|^2 / sum_bin |delta_m|^2
        mean_matter = 0.5 * (matter[1] + matter[-1]).double().cpu()
        filtered = torch.fft.irfftn(torch.fft.rfftn(mean_matter) * inverse_m, s=mesh_shape)
        cross_modes.append((cross_power(filtered, mean_matter, box).power / power_spectrum(mean_matter, box).power))

    b_plus, b_minus = torch.stack(bias[1]), torch.stack(bias[-1])  # (seeds, bins)
    delta_b = 0.5 * (b_plus - b_minus)
    b_mean = 0.5 * (b_plus + b_minus)
    large = k <= args.k_bias
    if not bool(large.any()):
        raise SystemExit(f"no k bin at or below --k-bias {args.k_bias:g} h/Mpc (the lowest is {float(k[0]):.4g}): "
                         "raise --k-bias or the box size")
    weights = modes.double() * large
    b_1 = float((b_mean * weights).sum() / (weights.sum() * args.seeds))
    inverse_m_bins = torch.stack(cross_modes)  # (seeds, bins): <1/M> weighted by |delta_m|^2
    predicted = 2.0 * args.f_nl * (b_1 - 1.0) * DELTA_C * inverse_m_bins
    low = list(range(min(args.low_bins, k.numel())))
    ratio = delta_b[:, low] / predicted[:, low] if args.f_nl else torch.full((args.seeds, len(low)), float("nan"))

    def stats(values):
        values = values.flatten()
        spread = float(values.std()) if values.numel() > 1 else float("nan")
        return float(values.mean()), spread

    ratio_mean, ratio_scatter = stats(ratio)
    # Delta b = c + s * predicted (q = 1) over k <= k_fit, least squares weighted by the modes:
    # s is the effective q; c a scale-independent shift (f_nl also changes the mass function,
    # so the two runs' halo samples differ in b_1 at first order in F).
    fit = (k <= args.k_fit) & (modes > 0)
    design = torch.stack([torch.ones(int(fit.sum()), dtype=torch.float64), predicted.mean(0)[fit]], dim=1)
    root = modes[fit].double().sqrt().unsqueeze(1)
    offset, slope = float("nan"), float("nan")
    if args.f_nl and int(fit.sum()) >= 2:
        solution = torch.linalg.lstsq(design * root, delta_b.mean(0)[fit].unsqueeze(1) * root).solution
        offset, slope = solution.flatten().tolist()
    seconds = time.perf_counter() - start
    result = {
        "arguments": vars(args),
        "k": k.tolist(),
        "modes": modes.tolist(),
        "bias_plus": b_plus.tolist(),
        "bias_minus": b_minus.tolist(),
        "delta_b": delta_b.tolist(),
        "delta_b_mean": delta_b.mean(0).tolist(),
        "b_1": b_1,
        "delta_c": DELTA_C,
        "D_md": d_md,
        "predicted": predicted.tolist(),
        "predicted_mean": predicted.mean(0).tolist(),
        "low_k": [float(k[i]) for i in low],
        "ratio_low_k": ratio.tolist(),  # (seeds, low bins): measured / predicted with q = 1
        "ratio_low_k_mean": ratio_mean,
        "ratio_low_k_scatter": ratio_scatter,
        "fit_slope": slope,  # Delta b = fit_offset + fit_slope * predicted over k <= k_fit
        "fit_offset": offset,
        "halos_plus": halo_counts[1],
        "halos_minus": halo_counts[-1],
        "halo_mean_mass_plus": halo_masses[1],
        "halo_mean_mass_minus": halo_masses[-1],
        "seconds": seconds,
    }
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "result.json"), "w") as handle:
        json.dump(_finite(result), handle, indent=1)

    print(f"b_1 = {b_1:.3f} (k <= {args.k_bias:g} h/Mpc), D_md(a = {args.a_end:g}) = {d_md:.4f}")
    print("    k [h/Mpc]   Delta b measured   predicted (q = 1)   ratio")
    shown = delta_b.mean(0), predicted.mean(0)
    for i in range(min(8, k.numel())):
        r = float(shown[0][i] / shown[1][i]) if args.f_nl else float("nan")
        print(f"    {float(k[i]):.4f}      {float(shown[0][i]):+.4f}            {float(shown[1][i]):+.4f}"
              f"            {r:.2f}")
    print(f"measured / predicted in the {len(low)} lowest bins: {ratio_mean:.2f} +- {ratio_scatter:.2f} "
          f"(scatter over bins and seeds; q = {args.q:g} would give {ratio_mean / args.q:.2f})")
    print(f"fit over k <= {args.k_fit:g} h/Mpc: Delta b = {offset:+.4f} + {slope:.3f} x predicted (q = 1)")

    try:
        import matplotlib
    except ImportError:
        print(f"wrote {args.output}/result.json in {seconds:.0f} s (no matplotlib: no figure)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown_bins = k <= 4 * args.k_bias
    kk = k[shown_bins]
    figure, panels = plt.subplots(1, 2, figsize=(11, 4.5))
    panel = panels[0]
    for member in delta_b:
        panel.plot(kk, member[shown_bins], "o", color="C0", ms=3, alpha=0.5 if args.seeds > 1 else 1.0)
    if args.seeds > 1:
        error = delta_b.std(0) / math.sqrt(args.seeds)
        panel.errorbar(kk, delta_b.mean(0)[shown_bins], error[shown_bins], fmt="s", color="C0", ms=5,
                       label=f"measured, mean of {args.seeds} seeds")
    else:
        panel.plot([], [], "o", color="C0", label="measured")
    panel.plot(kk, predicted.mean(0)[shown_bins], "k-", label="Dalal et al. (q = 1)")
    panel.plot(kk, args.q * predicted.mean(0)[shown_bins], "k--", label=f"q = {args.q:g}")
    panel.axhline(0.0, color="0.7", lw=0.8)
    panel.set_xscale("log")
    panel.set_xlabel("k [h/Mpc]")
    panel.set_ylabel(r"$\Delta b(k) = [b_{+F}(k) - b_{-F}(k)] / 2$")
    panel.set_title(f"F = {args.f_nl:g}, b_1 = {b_1:.2f}")
    panel.legend(fontsize=8)
    panel = panels[1]
    panel.plot(kk, b_plus.mean(0)[shown_bins], "o-", color="C3", ms=3, label=f"f_nl = {args.f_nl:+g}")
    panel.plot(kk, b_minus.mean(0)[shown_bins], "o-", color="C2", ms=3, label=f"f_nl = {-args.f_nl:+g}")
    panel.axhline(b_1, color="k", ls=":", label="b_1")
    panel.set_xscale("log")
    panel.set_xlabel("k [h/Mpc]")
    panel.set_ylabel(r"$b(k) = P_{hm} / P_{mm}$")
    panel.legend(fontsize=8)
    figure.suptitle(f"FoF halos >= {args.min_members} particles, a = {args.a_end:g}, {args.particles}^3 particles "
                    f"in {args.box_size:g} Mpc/h")
    figure.tight_layout()
    figure.savefig(os.path.join(args.output, "scale_dependent_bias.png"), dpi=110)
    print(f"wrote {args.output}/result.json and scale_dependent_bias.png in {seconds:.0f} s")


if __name__ == "__main__":
    main()
