"""The reduced bispectrum Q of torchpm's 2LPT (and optionally PM-evolved) density at large
scales against tree-level perturbation theory.

    python benchmarks/bispectrum_tree_level.py [--particles 128] [--box 1000] [--pairs 3]
                                               [--scale-factors 1.0 0.5] [--evolve STEPS]

Tree level: ``B = 2 F2(k1, k2) P(k1) P(k2) + 2 perms`` with ``F2 = 5/7 + mu/2 (k1/k2 +
k2/k1) + 2/7 mu^2`` and the linear power grown by ``D1(a)^2`` (the simulation's own
``linear_power`` and growth); ``Q = B / (P1 P2 + P2 P3 + P3 P1)``. The theory is averaged
over the same triangles as the measurement: random pairs ``(k1, k2)`` of grid modes in
the first two shells, kept when ``k3 = -(k1 + k2)`` lies in the third (a Monte Carlo over
the configuration's closed triangles), with each shell's P averaged over its modes as the
estimator does.

Measurement: paired-and-fixed initial conditions (``fixed_amplitude=True``, each seed and
its partner; a pair's mean cancels the Gaussian (odd) part of the estimator, which
dominates the variance of B for one field), particles at ``a`` from 2LPT (``steps=0``) or
evolved with ``--evolve`` FastPM steps from ``a = 0.1`` (force mesh twice as fine),
painted with CIC and interlacing on an ``n^3`` mesh (``--mesh``, default one cell per particle), the CIC window divided out; no shot
noise (a lattice start). The uncertainty is the scatter of the pairs' means over
``sqrt(pairs)`` (a crude estimate with a few pairs). Run from a source checkout with
``PYTHONPATH=.``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

import torchpm
from harness import Table, print_header
from torchpm.analysis import paint_density
from torchpm.bispectrum import bispectrum


def tree_level(shells_modes, configuration, power, samples, rng):
    """``(<B_tree>, <k1>, <k2>, <k3>)`` over the closed triangles of ``configuration`` by
    Monte Carlo: ``shells_modes[s]`` the wavevectors (h/Mpc) of shell ``s``, ``power`` the
    grown linear P(k) as a numpy callable."""
    i, j, l = configuration
    first, second = shells_modes[i], shells_modes[j]
    lower, upper = shells_modes["edges"][l], shells_modes["edges"][l + 1]
    kept_b, kept_k = [], []
    while sum(len(b) for b in kept_b) < samples:
        k1 = first[rng.integers(len(first), size=samples)]
        k2 = second[rng.integers(len(second), size=samples)]
        k3 = -(k1 + k2)
        lengths = [np.linalg.norm(k, axis=-1) for k in (k1, k2, k3)]
        closed = (lengths[2] >= lower) & (lengths[2] < upper)
        if not closed.any():
            continue
        vectors = [k[closed] for k in (k1, k2, k3)]
        norms = [n[closed] for n in lengths]
        powers = [power(n) for n in norms]

        def f2(a, b):
            mu = (vectors[a] * vectors[b]).sum(-1) / (norms[a] * norms[b])
            return 5 / 7 + 0.5 * mu * (norms[a] / norms[b] + norms[b] / norms[a]) + 2 / 7 * mu**2

        b = 2 * (f2(0, 1) * powers[0] * powers[1] + f2(1, 2) * powers[1] * powers[2]
                 + f2(2, 0) * powers[2] * powers[0])
        kept_b.append(b)
        kept_k.append(np.stack(norms, -1))
    return np.concatenate(kept_b).mean(), np.concatenate(kept_k).mean(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--particles", type=int, default=128)
    parser.add_argument("--box", type=float, default=1000.0)
    parser.add_argument("--mesh", type=int, default=None, help="cells per side of the measurement mesh "
                        "(default: one per particle)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="the pairs' seeds: first-seed, first-seed + 1, ...")
    parser.add_argument("--scale-factors", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--evolve", type=int, default=0, help="FastPM steps from a = 0.1 (0: 2LPT at a)")
    parser.add_argument("--shells", type=int, default=5, help="shells 3 k_f wide from 1.5 k_f")
    parser.add_argument("--samples", type=int, default=400_000)
    arguments = parser.parse_args()
    n, box = arguments.particles, arguments.box
    cells = arguments.mesh or n
    k_fundamental = 2 * math.pi / box
    edges = [k_fundamental * (1.5 + 3 * s) for s in range(arguments.shells + 1)]
    centres = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    # every equilateral configuration, and isosceles ones k1 = k2 in the second-largest
    # shell with every third side the triangle condition allows
    pair = arguments.shells - 2
    configurations = [(s, s, s) for s in range(arguments.shells)]
    configurations += [(pair, pair, s) for s in range(arguments.shells) if s != pair
                       and centres[s] <= 2 * centres[pair]]

    # the grid's modes of each shell (h/Mpc), for the theory's average over triangles
    reps = np.stack(np.meshgrid(*[np.fft.fftfreq(cells, 1 / cells)] * 3, indexing="ij"), -1).reshape(-1, 3)
    vectors = reps * k_fundamental
    lengths = np.linalg.norm(vectors, axis=-1)
    shells_modes = {"edges": edges}
    for s in range(arguments.shells):
        shells_modes[s] = vectors[(lengths >= edges[s]) & (lengths < edges[s + 1])]

    print_header("reduced bispectrum against tree level", "cpu", [
        "Planck15", f"box {box} Mpc/h", f"{n}^3 particles", f"{cells}^3 CIC interlaced mesh",
        f"{arguments.pairs} paired-fixed pairs (seeds from {arguments.first_seed})",
        "2LPT" if not arguments.evolve else f"{arguments.evolve} FastPM steps from a = 0.1"])
    for a in arguments.scale_factors:
        started = time.perf_counter()
        if arguments.evolve:
            sim = torchpm.Simulation(n_particles=n, box_size=box, mesh_factor=2, a_start=0.1, a_end=a,
                                     steps=arguments.evolve, dtype=torch.float32)
        else:
            sim = torchpm.Simulation(n_particles=n, box_size=box, mesh_factor=1, a_start=a, steps=0,
                                     dtype=torch.float32)
        growth = float(sim.cosmology.growth_factor(torch.tensor(a, dtype=torch.float64)))

        def power(k):
            return sim.linear_power(torch.as_tensor(k)).numpy() * growth**2

        paint_mesh = torchpm.LocalMesh(cells)
        per_pair_q, per_pair_b = [], []
        for seed in range(arguments.first_seed, arguments.first_seed + arguments.pairs):
            fields = []
            for paired in (False, True):
                noise = sim.white_noise(seed=seed, fixed_amplitude=True, paired=paired)
                state = sim(noise, return_mesh_units=True)
                # force-mesh cells -> cells of the measurement mesh
                positions = state.positions * (cells / sim.force_mesh.global_shape[0])
                fields.append(paint_density(positions, paint_mesh, order="cic", interlacing=True))
            result = bispectrum(torch.cat(fields), box, bins=edges, triangles=configurations, window="cic")
            per_pair_q.append(result.reduced.mean(0).numpy())
            per_pair_b.append(result.bispectrum.mean(0).numpy())
        q, b = np.array(per_pair_q), np.array(per_pair_b)
        q_error = q.std(0, ddof=1) / math.sqrt(len(q)) if len(q) > 1 else np.full(q.shape[1], np.nan)
        rng = np.random.default_rng(0)
        shell_power = [power(np.linalg.norm(shells_modes[s], axis=-1)).mean() for s in range(arguments.shells)]
        print(f"\n## a = {a} (D1 = {growth:.4f}), {time.perf_counter() - started:.0f} s\n")
        measured_power = {}
        for t, configuration in enumerate(configurations):
            for side, s in enumerate(configuration):
                measured_power[s] = float(result.power[:, t, side].mean())
        print("P / P_lin in the shells (last pair): " + ", ".join(
            f"{measured_power[s] / shell_power[s]:.3f}" for s in range(arguments.shells)) + "\n")
        table = Table(["shells", "k1, k2, k3 (h/Mpc, measured)", "k1, k2, k3 (theory's triangles)", "triangles",
                       "Q measured", ("Q tree", ".3f"), ("Q / Q tree", ".3f"), ("B / B tree", ".3f")])
        table.print_header()
        for t, configuration in enumerate(configurations):
            b_tree, k_tree = tree_level(shells_modes, configuration, power, arguments.samples, rng)
            p1, p2, p3 = (shell_power[s] for s in configuration)
            q_tree = b_tree / (p1 * p2 + p2 * p3 + p3 * p1)
            k_measured = ", ".join(f"{v:.4f}" for v in result.k[t].tolist())
            k_theory = ", ".join(f"{v:.4f}" for v in k_tree)
            table.print_row(str(configuration), k_measured, k_theory, int(result.triangles[t]),
                            f"{q[:, t].mean():.3f} +- {q_error[t]:.3f}", q_tree, q[:, t].mean() / q_tree,
                            b[:, t].mean() / b_tree)


if __name__ == "__main__":
    main()
