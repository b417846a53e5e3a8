"""Peak host memory of a run without gradients against ``Simulation.memory_estimate``.

Each case runs in a fresh process: the peak resident set (VmHWM, reset through
/proc/self/clear_refs after a warm-up run) minus the resident set before the run.
Linux only.

    python benchmarks/memory_estimate.py                          # the cases below
    python benchmarks/memory_estimate.py --case 32 2 float32 ...  # particles per side, mesh factor, dtype
"""

import argparse
import os
import sys

from harness import PeakMemory, Table, child_report, print_header

CASES = [(64, 2, "float32"), (96, 1, "float32"), (64, 2, "float64"), (32, 4, "float32"), (96, 1, "float64"),
         (128, 1, "float32"), (128, 2, "float32"), (160, 1, "float32"), (192, 1, "float32")]
DTYPES = ("float32", "float64")


def measure(n, factor, dtype):
    """``{"measured": bytes, "estimate": bytes}`` of a 2-step run of ``n^3`` particles."""
    import torch

    import torchpm

    dtype = getattr(torch, dtype)
    sim = torchpm.Simulation(n_particles=n, mesh_factor=factor, box_size=4.0 * n, steps=2, dtype=dtype,
                             memory_check="off")
    small = torchpm.Simulation(n_particles=4, mesh_factor=factor, steps=1, dtype=dtype)
    with torch.no_grad():
        small(small.white_noise())  # libraries and thread pools warmed up
        with PeakMemory("cpu", host="high-water", reset_high_water=True) as memory:
            sim.density(sim(sim.white_noise(seed=0)))
    return {"measured": memory.peak, "estimate": sim.memory_estimate().peak}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", nargs=3, action="append", metavar=("PARTICLES", "FACTOR", "DTYPE"),
                        help="a case instead of the default list (repeatable): particles per side, mesh factor, "
                             f"dtype ({' or '.join(DTYPES)})")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    cases = CASES
    if arguments.case:
        cases = []
        for particles, factor, dtype in arguments.case:
            if not (particles.isdigit() and factor.isdigit() and int(particles) > 0 and int(factor) > 0):
                parser.error(f"--case needs positive integers for the particles per side and the mesh factor, "
                             f"got {particles!r} {factor!r}")
            if dtype not in DTYPES:
                parser.error(f"--case dtype must be {' or '.join(DTYPES)}, got {dtype!r}")
            cases.append((int(particles), int(factor), dtype))
    if arguments.one:
        import json

        n, factor, dtype = arguments.one
        print(json.dumps(measure(int(n), int(factor), dtype)))
        return
    print_header("memory estimate against the measured peak", "cpu", ["no gradients", "2 steps"])
    table = Table([("particles", ">10"), ("factor", ">6"), ("dtype", ">8"), ("measured MiB", ">13.1f"),
                   ("estimate MiB", ">13.1f"), ("ratio", ">6.2f")], style="aligned")
    table.print_header()
    for n, factor, dtype in cases:
        report = child_report([sys.executable, os.path.abspath(__file__), "--one", str(n), str(factor), dtype])
        measured, estimate = report["measured"], report["estimate"]
        table.print_row(f"{n}^3", factor, dtype, measured / 2**20, estimate / 2**20, estimate / measured)


if __name__ == "__main__":
    main()
