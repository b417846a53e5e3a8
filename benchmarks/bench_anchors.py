"""The single-device rows of DESIGN.md's "numbers to beat" in their own configurations:
the PM step and the 2LPT with N^3 particles on a (B N)^3 mesh, and a whole run (initial
conditions, 2LPT and S steps), as pmwd times them (its figures beside ours; they were
measured on an H100, ours on whatever device runs this: the ratio is across hardware).

    python benchmarks/bench_anchors.py --device cuda       # 256^3 and 512^3 on B = 1, 512^3 on B = 2, 63 steps
    python benchmarks/bench_anchors.py --sizes 32 --mesh-factors 1 2 --run-steps 10    # a CPU-sized check

bench_pm.py covers B = 1 in detail (where a step's time goes, particle order, JaxPM in the
same process); this adds B = 2, the run as a whole, and its peak memory (above what the module and
the white noise hold before it). Float32, the
default FastPM settings (CIC, 4-point gradient), a box of 2 Mpc/h per particle spacing.
Medians of ``--repeats`` after one warm-up, the device synchronised around each call.
"""

from __future__ import annotations

import argparse

import torch

import torchpm
from harness import PeakMemory, Table, print_header, restorer, timed
from torchpm.pm import step_factors

# DESIGN.md, "Numbers to beat": pmwd on an H100 (PCIe for the step and the 2LPT, 80 GB for
# the run). (particles per side, mesh factor) -> milliseconds, or seconds for the run.
ANCHORS = {
    (256, 1): {"step": 7.98, "lpt": 12.7},
    (512, 1): {"step": 94.6, "lpt": 97.3},
    (512, 2): {"step": 207.0, "run": 13.0, "run_steps": 63},
}


def _step_and_lpt(sim, noise, steps, device, repeats):
    """(2LPT ms, step ms): the step is Simulation.evolve's steady state, the force with the
    kicks and the drift in its readout, in place on the arrays of the step before."""
    lpt = timed(lambda: sim.lpt(sim.linear_field(noise)), device, repeats)
    x, p, ids = lpt.result
    factor = step_factors(sim.growth_table(), torch.tensor([0.1, 0.1 + 0.9 / steps], dtype=torch.float64))[0]
    (step_x, step_p), restore = restorer(x, p)
    step = timed(lambda: sim._fused_step(step_x, step_p, ids, factor, factor), device, repeats, setup=restore)
    return 1e3 * lpt.median, 1e3 * step.median


def measure(n, factor, steps, device, repeats):
    """``{"step", "lpt", "run"}`` (ms, ms, s) and ``"peak"`` (bytes) of the whole run."""
    sim = torchpm.Simulation(n_particles=n, box_size=float(2 * n), mesh_factor=factor, a_start=0.1,
                             steps=steps).to(device)
    noise = sim.white_noise(seed=0).to(device)
    out = {}
    with torch.no_grad():
        out["lpt"], out["step"] = _step_and_lpt(sim, noise, steps, device, repeats)
        run = timed(lambda: sim(noise).positions, device, repeats)
        out["run"] = run.median
        if not bool(torch.isfinite(run.result).all()):
            raise RuntimeError(f"{n}^3 on B = {factor}: the run left non-finite positions")
        del run
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        # CUDA: the allocator's peak; the CPU: the resident set's high-water mark, restarted
        # here, with the freed heap given back first
        with PeakMemory(device, host="high-water", reset_high_water=True, release_freed=True) as memory:
            sim(noise)
        out["peak"] = memory.peak
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="particles per side (default: the anchors' on CUDA, 32 and 64 elsewhere)")
    parser.add_argument("--mesh-factors", type=int, nargs="+", default=None,
                        help="mesh cells per particle spacing (default: the anchors' pairs, or 1 and 2)")
    parser.add_argument("--run-steps", type=int, default=63, help="steps of the whole run (pmwd's: 63)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.run_steps < 1 or args.repeats < 1:
        parser.error("--run-steps and --repeats must be at least 1")
    cuda = torch.device(args.device).type == "cuda"
    if args.sizes is None and args.mesh_factors is None and cuda:
        cases = list(ANCHORS)
    else:
        sizes = args.sizes or ([256, 512] if cuda else [32, 64])
        cases = [(n, b) for n in sizes for b in (args.mesh_factors or [1, 2])]
    if any(n < 2 or b < 1 for n, b in cases):
        parser.error("--sizes must be at least 2 and --mesh-factors at least 1")
    print_header("PM anchors benchmark", args.device, [f"float32, {args.run_steps} steps a = 0.1 -> 1"])
    print("pmwd's figures: H100 PCIe (step, 2LPT) and H100 80 GB (the 63-step run) from DESIGN.md; "
          "'x' = pmwd's time / torchpm's on this device (above 1: torchpm faster)\n")
    table = Table(["particles", "mesh", ("step [ms]", ".2f"), "pmwd step", ("2LPT [ms]", ".2f"), "pmwd 2LPT",
                   (f"run, {args.run_steps} steps [s]", ".3f"), "pmwd run", ("peak [MiB]", ".0f")])
    table.print_header()
    for n, factor in cases:
        result = measure(n, factor, args.run_steps, args.device, args.repeats)
        anchor = ANCHORS.get((n, factor), {})

        def versus(key, ours, scale=1.0):
            if key not in anchor or (key == "run" and anchor["run_steps"] != args.run_steps):
                return "-"
            return f"{anchor[key]:g} ({anchor[key] / (ours * scale):.1f}x)"

        table.print_row(f"{n}^3", f"{n * factor}^3", result["step"], versus("step", result["step"]), result["lpt"],
                        versus("lpt", result["lpt"]), result["run"], versus("run", result["run"]),
                        result["peak"] / 2**20)


if __name__ == "__main__":
    main()
