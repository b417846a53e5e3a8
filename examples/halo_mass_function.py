"""The friends-of-friends halo mass function of a run against the fits of the literature.

Runs one simulation, finds its FoF halos (linking length 0.2, at least ``--min-members``
particles), measures ``dn/dln M`` in bins of about 0.2 dex with Poisson errors
(:func:`torchpm.halos.mass_function`) and divides it by Watson et al. (2013, FoF),
Jenkins et al. (2001, FoF) and Sheth & Tormen (1999)
(:func:`torchpm.halos.mass_function_theory`). Writes ``result.json`` and
``mass_function.png`` into ``--output``.

    python examples/halo_mass_function.py                  # 128^3 particles in 256 Mpc/h, about 70 s on 2 cores
    python examples/halo_mass_function.py --particles 256 --box-size 512 --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

import torchpm
from torchpm.halos import find_halos, mass_function, mass_function_theory, simulation_particle_mass

MODELS = ("watson13", "jenkins01", "sheth99")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--particles", type=int, default=128, help="particles per side (force mesh: twice that)")
    parser.add_argument("--box-size", type=float, default=256.0, help="Mpc/h")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--min-members", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default=os.path.join("out", "halo_mass_function"))
    args = parser.parse_args()

    start = time.perf_counter()
    sim = torchpm.Simulation(args.particles, args.box_size, mesh_factor=2, steps=args.steps).to(args.device)
    with torch.no_grad():
        state = sim(sim.white_noise(seed=args.seed))
    simulated = time.perf_counter()
    halos = find_halos(sim, state, min_members=args.min_members)
    found = time.perf_counter()
    particle_mass = float(simulation_particle_mass(sim))
    a = float(state.a)
    # Bins of about 0.2 dex whose edges fall halfway between whole numbers of particles (a
    # halo's mass is a whole number of them, summed in the state's dtype).
    members = np.unique(np.round(args.min_members * 10 ** (0.2 * np.arange(16))))
    edges = particle_mass * (members - 0.5)
    measured = mass_function(halos, sim.box_size, bins=edges.tolist())
    keep = measured.counts[0] > 0
    if not bool(keep.any()):
        raise SystemExit(f"no halo of >= {args.min_members} particles in the mass bins: use more particles, more "
                         "steps or a smaller box (--particles, --steps, --box-size)")
    mass = measured.mass[keep].cpu()
    cosmology = sim.cosmology.to("cpu")

    def power(k):
        return sim.linear_power(k.to(sim.cosmology.device)).cpu()

    fits = {model: mass_function_theory(mass, cosmology, a, model=model, power=power) for model in MODELS}
    # Halos of at least 50 particles: the count against Watson et al.'s integrated over ln M.
    grid = torch.logspace(math.log10(49.5 * particle_mass), 16.5, 400, dtype=torch.float64)
    expected = float(torch.trapezoid(mass_function_theory(grid, cosmology, a, power=power), torch.log(grid))) \
        * math.prod(sim.box_size)
    above = int(((halos.masses[0] >= 49.5 * particle_mass)).sum())
    dn, error, counts = (t[0][keep].cpu() for t in (measured.dn_dlnM, measured.error, measured.counts))
    result = {
        "particle_mass": particle_mass,
        "halos": int((halos.masses > 0).sum()),
        "mass": mass.tolist(),
        "particles": (mass / particle_mass).tolist(),
        "counts": counts.tolist(),
        "dn_dlnM": dn.tolist(),
        "error": error.tolist(),
        **{f"ratio_{model}": (dn / fit).tolist() for model, fit in fits.items()},
        "halos_above_50": above,
        "expected_above_50_watson13": expected,
        "simulation_seconds": simulated - start,
        "fof_seconds": found - simulated,
    }
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "result.json"), "w") as handle:
        json.dump(result, handle, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 6.5), sharex=True,
                                         gridspec_kw=dict(height_ratios=(2, 1)))
    top.errorbar(mass, dn, yerr=error, fmt="o", ms=3, color="k", label="FoF, b = 0.2")
    for model, fit in fits.items():
        top.plot(mass, fit, label=model)
        bottom.plot(mass, dn / fit, "o-", ms=3, label=model)
    bottom.fill_between(mass, 1 - error / dn, 1 + error / dn, color="0.85", label="Poisson error")
    top.set_xscale("log")
    top.set_yscale("log")
    top.set_ylabel("dn/dlnM [(h/Mpc)$^3$]")
    top.set_title(f"{args.particles}^3 particles in {args.box_size:g} Mpc/h, {args.steps} steps, a = {a:g}")
    top.legend(fontsize=8)
    bottom.axhline(1.0, color="k", lw=0.5)
    bottom.set_xlabel("M [Msun/h]")
    bottom.set_ylabel("measured / fit")
    bottom.set_ylim(0.4, 1.6)
    figure.tight_layout()
    figure.savefig(os.path.join(args.output, "mass_function.png"), dpi=110)

    print(f"{result['halos']} halos of at least {args.min_members} particles ({particle_mass:.3e} Msun/h each); "
          f"simulation {result['simulation_seconds']:.1f} s, FoF {result['fof_seconds']:.1f} s")
    print("  M [Msun/h]  particles  halos  " + "  ".join(f"/{model}" for model in MODELS))
    for i in range(len(mass)):
        print(f"  {float(mass[i]):.3e}  {float(mass[i]) / particle_mass:9.0f}  {int(counts[i]):5d}  "
              + "  ".join(f"{result[f'ratio_{model}'][i]:9.3f}" for model in MODELS))
    print(f"halos of at least 50 particles: {above}, Watson et al. integrated: {expected:.1f}")
    print(f"wrote {args.output}/result.json and mass_function.png")


if __name__ == "__main__":
    main()
