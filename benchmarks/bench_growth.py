"""Cost of the growth table per run: build + the lookups a run makes, against the
previous table (128 RK4 steps in a Python loop, cubic Hermite lookup; kept here as
the reference) and against one small simulation forward, all in the same process.

    python benchmarks/bench_growth.py [--repeats 21] [--threads 1]

(the torchpm it imports is printed: from a source checkout that is not the installed
one, run it with ``PYTHONPATH=.``).

Prints the median and minimum CPU time (time.process_time, so that other tenants
of a shared machine disturb it less) of: the table build, the LPT lookup at a_start
and the kick/drift factors of a 10-step run; with ``grad`` also the backward into
Omega_c. The last row is a 32^3-particle, 10-step float32 Simulation forward.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import torchpm
from harness import Table, print_header, timed, timed_together
from torchpm.cosmology import GrowthValues, growth_table
from torchpm.pm import step_factors


class _PreviousTable:
    """The table before this benchmark's commit: RK4 in a Python loop over 128 steps of
    ln a from 1e-3, values and first derivatives at the nodes, cubic Hermite lookup."""

    def __init__(self, cosmology, a_min=1e-3, steps=128):
        self.cosmology = cosmology
        log_a = torch.linspace(math.log(a_min), 0.0, steps + 1, dtype=torch.float64)
        h = float(log_a[1] - log_a[0])
        fine = torch.exp(torch.linspace(math.log(a_min), 0.0, 2 * steps + 1, dtype=torch.float64))
        damping, source = 2.0 + cosmology.dlnE_dlna(fine), 1.5 * cosmology.Omega_m_a(fine)

        def derivative(state, j):
            D1, F1, D2, F2 = state
            return F1, -damping[j] * F1 + source[j] * D1, F2, -damping[j] * F2 + source[j] * (D2 - D1 * D1)

        zero = cosmology.Omega_m * 0.0
        state = (zero + a_min, zero + a_min, zero - 3 / 7 * a_min**2, zero - 6 / 7 * a_min**2)
        history = [state]
        for i in range(steps):
            k1 = derivative(state, 2 * i)
            k2 = derivative(tuple(s + 0.5 * h * k for s, k in zip(state, k1)), 2 * i + 1)
            k3 = derivative(tuple(s + 0.5 * h * k for s, k in zip(state, k2)), 2 * i + 1)
            k4 = derivative(tuple(s + h * k for s, k in zip(state, k3)), 2 * i + 2)
            state = tuple(s + h / 6 * (a + 2 * b + 2 * c + d) for s, a, b, c, d in zip(state, k1, k2, k3, k4))
            history.append(state)
        D1, F1, D2, F2 = (torch.stack(column) for column in zip(*history))
        self.log_a, self.step = log_a, h
        self.values = torch.stack([D1 / D1[-1], D2 / D2[-1]], -1)
        self.slopes = torch.stack([F1 / D1[-1], F2 / D2[-1]], -1)

    def at(self, a):
        a = torch.as_tensor(a, dtype=torch.float64)
        log_a, step = torch.log(a), self.step
        index = ((log_a - self.log_a[0]) / step).detach().floor().long().clamp(0, self.log_a.numel() - 2)
        t = ((log_a - self.log_a[index]) / step).unsqueeze(-1)
        y0, y1 = self.values[index], self.values[index + 1]
        m0, m1 = self.slopes[index] * step, self.slopes[index + 1] * step
        t2, t3 = t * t, t * t * t
        value = (2 * t3 - 3 * t2 + 1) * y0 + (t3 - 2 * t2 + t) * m0 + (-2 * t3 + 3 * t2) * y1 + (t3 - t2) * m1
        slope = ((6 * t2 - 6 * t) * y0 + (3 * t2 - 4 * t + 1) * m0 + (-6 * t2 + 6 * t) * y1 + (3 * t2 - 2 * t) * m1) / step
        c = self.cosmology
        E, D1, F1 = c.E(a), value[..., 0], slope[..., 0]
        gp = F1 / a
        return GrowthValues(a, E, D1, value[..., 1], F1 / D1, slope[..., 1] / value[..., 1], D1, gp,
                            a**3 * E * gp, 1.5 * c.Omega_m * D1 / (a**2 * E))


def _one_run(build, grad):
    """``(setup, run)``: a fresh cosmology (untimed, so that every run builds its own
    table), then the table build, the lookups of a 10-step run and with ``grad`` the
    backward into Omega_c."""
    made = {}

    def setup():
        made["omega_c"] = torch.tensor(0.2589, dtype=torch.float64, requires_grad=grad)
        made["cosmology"] = torchpm.Planck15(Omega_c=made["omega_c"])

    def run():
        table = build(made["cosmology"])
        lpt = table.at(torch.tensor(0.1, dtype=torch.float64))
        factors = step_factors(table, torch.linspace(0.1, 1.0, 11, dtype=torch.float64))
        if grad:
            total = lpt.D1 + lpt.D2 + lpt.f1 + sum(f.first_kick + f.drift + f.second_kick for f in factors)
            torch.autograd.grad(total, made["omega_c"])

    return setup, run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print_header("growth-table benchmark", "cpu", [f"CPU time in ms (median / min of {args.repeats})"])
    table = Table([("table", "<28"), ("what", "<24"), ("median / min ms", ">19")], style="aligned", separator=" ")
    builds = {"previous: RK4 x128 + cubic": _PreviousTable, "now: GL6 + quintic": growth_table}

    def cell(timing):
        return f"{1e3 * timing.median:8.2f} / {1e3 * timing.minimum:8.2f}"

    table.print_header()
    for grad in (False, True):
        # Interleaved, so that a busy neighbour slows both alike.
        timings = timed_together({label: _one_run(build, grad) for label, build in builds.items()}, "cpu",
                                 args.repeats, clock=time.process_time)
        for label, timing in timings.items():
            table.print_row(label, "build+lookups+backward" if grad else "build+lookups", cell(timing))
    sim = torchpm.Simulation(32, 128.0, steps=10, a_start=0.1)
    noise = sim.white_noise(seed=0)

    def forward():
        with torch.no_grad():
            sim(noise)

    timing = timed(forward, "cpu", max(3, args.repeats // 7), clock=time.process_time)
    table.print_row("Simulation(32^3, 10 steps)", "forward, table cached", cell(timing))


if __name__ == "__main__":
    main()
