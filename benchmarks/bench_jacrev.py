"""Cost of a Jacobian through a whole simulation: ``torch.func.jacrev`` against
``torch.autograd.grad`` row by row (``retain_graph``) and the forward alone, in the same
process.

    python benchmarks/bench_jacrev.py [--sizes 16 32] [--rows 4 8] [--repeats 5] [--threads 2]
    python benchmarks/bench_jacrev.py --no-batching-rules ...   # torch's row-by-row fallback

The function: ``rows`` summaries (the mean of delta^p, p = 2, 3, ...) of the density at
a = 1 of an N^3-particle run (box 8 N Mpc/h, 5 steps from a = 0.1, float64), in the white
noise. Medians of ``--repeats`` after a warm-up (CPU only). ``--no-batching-rules`` imports torchpm
with ``TORCHPM_VMAP_RULES=0``: without the ops' vmap rules (``torchpm/ops/_vmap.py``),
vmap runs them one row at a time.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch

from harness import Table, print_header, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-batching-rules", action="store_true")
    args = parser.parse_args()
    if len(args.rows) != len(args.sizes):
        parser.error("--rows needs one count per --sizes entry")
    torch.set_num_threads(args.threads)
    if args.no_batching_rules:
        os.environ["TORCHPM_VMAP_RULES"] = "0"  # read when torchpm is imported
    import torchpm

    warnings.filterwarnings("ignore", message=".*batching rule.*")
    print_header("Jacobian benchmark", "cpu",
                 ["float64", f"batching rules {'off' if args.no_batching_rules else 'on'}"])
    table = Table(["particles", "rows", ("jacrev [s]", ".3f"), ("autograd.grad row by row [s]", ".3f"),
                   ("forward [s]", ".3f")])
    table.print_header()
    for n, rows in zip(args.sizes, args.rows):
        sim = torchpm.Simulation(n, 8.0 * n, steps=5, dtype=torch.float64)
        noise = sim.white_noise(seed=1)

        def summaries(x):
            delta = sim.density(sim(x)) - 1.0
            return torch.stack([(delta**p).mean() for p in range(2, 2 + rows)])

        def row_by_row():
            leaf = noise.clone().requires_grad_()
            out = summaries(leaf)
            return [torch.autograd.grad(out[r], leaf, retain_graph=True)[0] for r in range(rows)]

        def forward():
            with torch.no_grad():
                summaries(noise)

        jacobian = timed(lambda: torch.func.jacrev(summaries)(noise), "cpu", args.repeats).median
        autograd = timed(row_by_row, "cpu", args.repeats).median
        table.print_row(f"{n}^3", rows, jacobian, autograd, timed(forward, "cpu", args.repeats).median)


if __name__ == "__main__":
    main()
