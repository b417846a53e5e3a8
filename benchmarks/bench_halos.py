"""Friends-of-friends on evolved torchpm particles against scipy in the same run, and
optionally the FoF mass function against colossus's ``watson13`` fit.

    python benchmarks/bench_halos.py [--particles 64 128] [--repeats 3] [--device cpu|cuda]
    python benchmarks/bench_halos.py --particles 128 --mass-function [--box 256]

For each size ``n``: a Planck15 run of ``n^3`` particles in a box of ``2 n`` Mpc/h
(``--box`` to set it), mesh factor 2, 2LPT at a = 0.05 and 20 kick-drift-kick steps
(linear in a) to a = 1, float32. Then ``torchpm.friends_of_friends`` (b = 0.2 times the
mean separation) against scipy's ``cKDTree(boxsize=L).query_pairs(b)`` and
``connected_components`` on the same positions (in float64), both timed as a median of
``--repeats`` after one warm-up (synchronised on CUDA), and the two partitions compared
(they must be equal). ``--mass-function``: the catalogue of groups of at least 20
particles (``torchpm.find_halos``) binned in mass, against ``watson13`` FoF (b = 0.2) at
z = 0 from colossus. (Run from a source checkout with ``PYTHONPATH=.``.)
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import torchpm
from harness import Table, print_header, time_call, timed
from torchpm.halos import friends_of_friends, linking_distance


def scipy_groups(points: np.ndarray, box: float, b: float) -> np.ndarray:
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    n = len(points)
    pairs = cKDTree(points, boxsize=box).query_pairs(b, output_type="ndarray")
    graph = coo_matrix((np.ones(len(pairs), dtype=np.int8), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    return connected_components(graph, directed=False)[1]


def same_partition(labels: np.ndarray, components: np.ndarray) -> bool:
    """Equal partitions: each torchpm label maps to one scipy component and back."""
    pairs = np.unique(np.stack([labels, components], 1), axis=0)
    return len(pairs) == len(np.unique(labels)) == len(np.unique(components))


def mass_function(sim, state, bins_per_decade=5):
    """(mass bin edges from 20 particles up, dn/dlnM in (h/Mpc)^3, halo counts) of the FoF
    groups of 20 or more particles, and the watson13 dn/dlnM at the bins' geometric centres."""
    from colossus.cosmology import cosmology as colossus_cosmology
    from colossus.lss import mass_function as colossus_mass_function

    catalog = torchpm.find_halos(sim, state, min_members=20)
    keep = catalog.labels[0] >= 0
    masses = catalog.masses[0][keep].double().cpu().numpy()
    smallest = 20 * float(catalog.masses[0, 0] / catalog.members[0, 0])  # 20 particles: the first edge
    steps = int(np.ceil(np.log10(masses.max() / smallest) * bins_per_decade + 1e-9))
    edges = smallest * 10 ** (np.arange(steps + 1) / bins_per_decade)
    counts, _ = np.histogram(masses, edges)
    volume = float(np.prod(sim.box_size))
    measured = counts / volume / np.diff(np.log(edges))
    p = {key: float(value) for key, value in sim.cosmology.parameters().items()}
    colossus_cosmology.setCosmology("torchpm", params=dict(
        flat=True, H0=100 * p["h"], Om0=p["Omega_c"] + p["Omega_b"], Ob0=p["Omega_b"], sigma8=p["sigma8"],
        ns=p["n_s"], relspecies=False, persistence=""))
    centres = np.sqrt(edges[1:] * edges[:-1])
    fit = colossus_mass_function.massFunction(centres, 0.0, q_in="M", q_out="dndlnM", mdef="fof", model="watson13")
    return edges, measured, counts, fit


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--particles", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--box", type=float, default=None, help="box side in Mpc/h (default 2 n)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mass-function", action="store_true")
    args = parser.parse_args()
    print_header("friends-of-friends benchmark", args.device, ["float32"])

    for n in args.particles:
        box = args.box or 2.0 * n
        sim = torchpm.Simulation(n, box, mesh_factor=2, a_start=0.05, steps=20).to(args.device)
        with torch.no_grad():
            run_s, state = time_call(lambda: sim(sim.white_noise(seed=0)), args.device)
        b = linking_distance(box, sim.n_total, 0.2)
        points = state.positions[0].double().cpu().numpy()
        labels = friends_of_friends(state.positions, box, 0.2)
        components = scipy_groups(points, box, b)
        result = {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "threads": torch.get_num_threads(),
            "particles": n**3,
            "box": box,
            "run_s": run_s,
            "groups": int(components.max()) + 1,
            "groups_of_20_or_more": int((np.bincount(components) >= 20).sum()),
            "same_partition": bool(same_partition(labels[0].cpu().numpy(), components)),
            "torchpm_fof_s": timed(lambda: friends_of_friends(state.positions, box, 0.2), args.device,
                                   args.repeats).median,
            "scipy_kdtree_components_s": timed(lambda: scipy_groups(points, box, b), "cpu", args.repeats).median,
        }
        result["torchpm_over_scipy"] = result["torchpm_fof_s"] / result["scipy_kdtree_components_s"]
        print(json.dumps(result, indent=1), flush=True)
        if args.mass_function:
            edges, measured, counts, fit = mass_function(sim, state)
            table = Table([("M_low [Msun/h]", "<14.3e"), ("M_high", "<9.3e"), ("halos", "6d"),
                           ("dn/dlnM torchpm", "<15.3e"), ("watson13", "<9.3e"), ("ratio", ".3f")],
                          style="aligned", separator="  ")
            table.print_header()
            for k in range(len(counts)):
                table.print_row(edges[k], edges[k + 1], counts[k], measured[k], fit[k], measured[k] / fit[k])


if __name__ == "__main__":
    main()
