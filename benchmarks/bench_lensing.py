"""Cost of a light cone: the run to the nearest lens plane alone against the same run
taking its planes (``torchpm.lensing.lightcone``), the Born convergence map, and the
gradient of a map statistic in the white noise.

    python benchmarks/bench_lensing.py [--particles 32] [--planes 10] [--repeats 3] [--device cpu|cuda]

Box ``(L, L, 5 L)`` with ``L = 200 Mpc/h``, ``(n, n, 5 n)`` particles, mesh factor 2,
float32, ``--planes`` planes over the depth and 10 linear steps from a = 0.05 besides
the planes' scale factors (``lensing.lightcone_steps``). Times: median of ``--repeats``
after one warm-up, synchronised on CUDA. The light cone is one
``Simulation.trajectory``: it evaluates as many forces as the plain run and adds the
painting of the planes (and, in the fused no-grad steps, one more readout per plane).
``--adjoint`` also times the gradient with ``adjoint=True``. (Run from a source
checkout with ``PYTHONPATH=.``.)
"""

from __future__ import annotations

import argparse
import json

import torch

import torchpm
from harness import print_header, timed
from torchpm import lensing


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--particles", type=int, default=32)
    parser.add_argument("--planes", type=int, default=10)
    parser.add_argument("--pixels", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--adjoint", action="store_true", help="also time the gradient with adjoint=True")
    args = parser.parse_args()
    print_header("light-cone benchmark", args.device, ["float32"])

    n, length = args.particles, 200.0
    box = (length, length, 5 * length)
    cosmology = torchpm.Planck15()
    planes = lensing.lens_planes(cosmology, box, args.planes)
    steps = lensing.lightcone_steps(planes, 0.05, 10)
    sim = torchpm.Simulation((n, n, 5 * n), box, mesh_factor=2, a_start=0.05, steps=steps,
                             cosmology=cosmology).to(args.device)
    noise = sim.white_noise(seed=0)
    angles = lensing.angular_grid(10.0, args.pixels, device=sim.device)
    resolution = 2 * n

    def plain():
        with torch.no_grad():
            sim(noise)

    def cone():
        with torch.no_grad():
            lensing.lightcone(sim, noise, planes=planes, resolution=resolution)

    with torch.no_grad():
        taken = lensing.lightcone(sim, noise, planes=planes, resolution=resolution)

    def born():
        with torch.no_grad():
            lensing.convergence_born(taken, planes, box, angles, 0.5, cosmology)

    def gradient():
        source = noise.clone().requires_grad_()
        kappa = lensing.convergence_born(lensing.lightcone(sim, source, planes=planes, resolution=resolution),
                                         planes, box, angles, 0.5, cosmology)
        kappa.pow(2).mean().backward()

    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "particles": [n, n, 5 * n],
        "steps": len(steps),
        "planes": args.planes,
        "plain_run_s": timed(plain, args.device, args.repeats).median,
        "lightcone_s": timed(cone, args.device, args.repeats).median,
        "born_map_s": timed(born, args.device, args.repeats).median,
        "lightcone_forward_backward_s": timed(gradient, args.device, args.repeats).median,
    }
    if args.adjoint:
        sim.adjoint = True
        result["lightcone_forward_backward_adjoint_s"] = timed(gradient, args.device, args.repeats).median
        sim.adjoint = False
    result["lightcone_over_plain"] = result["lightcone_s"] / result["plain_run_s"]
    result["step_s"] = result["plain_run_s"] / len(steps)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
