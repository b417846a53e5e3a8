"""Gradients through the whole simulation: plain autograd, ``checkpoint=True`` and the
adjoint method (``adjoint=True``), peak memory and time of forward + backward.

Usage::

    python benchmarks/bench_adjoint.py                     # CPU, 64^3, 10 and 100 steps
    python benchmarks/bench_adjoint.py --device cuda --size 128

Particles = mesh cells (mesh factor 1), float32, Planck15 with Omega_c requiring grad,
a from 0.1 to 1. The loss is a fixed random projection of the final positions and
momenta; its gradient is taken w.r.t. the white noise and Omega_c. "forward" is the
same run under ``torch.no_grad()``. Times are medians of ``--repeats`` runs after a
warm-up, forward and forward + backward alternating. Peak memory of one forward +
backward is measured in a fresh child process for every (mode, steps) with
harness.py's ``PeakMemory`` (CUDA
``max_memory_allocated``; on the CPU the sampled resident set size, glibc's mmap
threshold fixed so that freed blocks leave it). Targets (issue 8): adjoint peak at
100 steps <= 1.1x its peak at 10 steps; adjoint forward + backward <= 3x forward.

``--clock process`` times with the CPU time of this process instead of the wall
clock (CPU only): on a machine shared with other jobs the wall time of a run
includes the time it waits for a core, which comes and goes, while its CPU time
does not; with ``--threads 1`` it is the work done (two or more threads add their
spin-waiting).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import torchpm  # noqa: E402
from harness import FIXED_MMAP_THRESHOLD, ChildFailed, PeakMemory, Table, child_report, print_header  # noqa: E402
from harness import timed_together  # noqa: E402

MODES = ("autograd", "checkpoint", "adjoint")


def setup(n, steps, mode, device):
    omega_c = torch.tensor(0.2589, dtype=torch.float64, device=device, requires_grad=True)
    sim = torchpm.Simulation(
        n, 4.0 * n, mesh_factor=1, a_start=0.1, steps=steps, cosmology=torchpm.Planck15(Omega_c=omega_c),
        checkpoint=mode == "checkpoint", adjoint=mode == "adjoint",
    ).to(device)
    noise = sim.white_noise(seed=0).requires_grad_(True)
    generator = torch.Generator().manual_seed(1)
    u = torch.randn(1, n**3, 3, generator=generator).to(device)

    def forward_backward():
        state = sim(noise)
        loss = (u * state.positions).sum() + (u * state.momenta).sum()
        return torch.autograd.grad(loss, [noise, omega_c])

    def forward():
        with torch.no_grad():
            return sim(noise)

    return forward_backward, forward


def child(arguments):
    device = torch.device(arguments.device)
    forward_backward, _ = setup(arguments.size, arguments.steps, arguments.mode, device)
    with PeakMemory(device) as memory:
        forward_backward()
    print(json.dumps({"memory": memory.peak}))


def peak_memory(arguments, mode, steps):
    command = [
        sys.executable, os.path.abspath(__file__), "--memory-child", mode, "--steps", str(steps),
        "--size", str(arguments.size), "--device", arguments.device, "--threads", str(torch.get_num_threads()),
    ]
    try:
        return child_report(command, FIXED_MMAP_THRESHOLD)["memory"]
    except ChildFailed as error:
        print(f"# memory child failed ({mode}, {steps} steps): {error.stderr.strip()[-500:]}")
        return float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=64, help="particles (= mesh) per side")
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--timing-steps", type=int, default=10, help="steps of the timed runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="timings only")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="wall time, or the CPU time of this process (CPU only; see the module docs)")
    parser.add_argument("--memory-child", choices=MODES, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    if arguments.memory_child:
        arguments.mode, arguments.steps = arguments.memory_child, arguments.steps[0]
        child(arguments)
        return
    device = torch.device(arguments.device)
    if arguments.clock == "process" and device.type != "cpu":
        parser.error("--clock process measures CPU time: use it with --device cpu")
    print_header("gradient benchmark", device, ["float32", f"{arguments.size}^3 particles and mesh",
                                                f"CPU kernels {torchpm.cpu_kernels()}"])
    print()
    table = Table(["mode"] + [f"peak {s} steps [MiB]" for s in arguments.steps]
                  + [f"peak ratio {arguments.steps[-1]}/{arguments.steps[0]}", "forward [s]", "forward+backward [s]",
                     "ratio"])
    table.print_header()
    clock = time.perf_counter if arguments.clock == "wall" else time.process_time
    for mode in arguments.modes:
        peaks = [float("nan") if arguments.no_memory else peak_memory(arguments, mode, steps) for steps in arguments.steps]
        forward_backward, forward = setup(arguments.size, arguments.timing_steps, mode, device)
        # Alternate the two, one run of each per repeat, so that a change of load on a
        # shared machine hits both sides of the ratio alike.
        timings = timed_together({"forward": forward, "forward+backward": forward_backward}, device,
                                 arguments.repeats, clock=clock)
        forwards, boths = timings["forward"].times, timings["forward+backward"].times
        # The ratio of each pair taken back to back, then the median: robust to load drift.
        ratio = statistics.median(both / alone for alone, both in zip(forwards, boths))
        table.print_row(mode, *(f"{p / 2**20:.0f}" for p in peaks), f"{peaks[-1] / peaks[0]:.2f}x",
                        f"{statistics.median(forwards):.2f}", f"{statistics.median(boths):.2f}", f"{ratio:.2f}x")
    print()
    print(f"Timings ({arguments.clock} clock) at {arguments.timing_steps} steps; ratio = median over the repeats of (forward + backward) / "
          "forward (no_grad), each pair timed back to back.")


if __name__ == "__main__":
    main()
