"""Time and peak memory of the bispectrum of a float32 ``n^3`` field (CIC window).

    python benchmarks/bench_bispectrum.py [--sizes 64 128] [--repeats 3] [--device cpu|cuda]
                                          [--reach two-thirds nyquist] [--backward] [--threads T] [--layer]

Shells ``3 k_f`` wide from ``1.5 k_f`` (``k_f = 2 pi / L``, a typical binning of the
literature): up to two thirds of the Nyquist frequency (``--reach two-thirds``: no
configuration reaches past the grid, one inverse FFT per shell) or up to the Nyquist
frequency (``nyquist``: the configurations of the larger shells are evaluated with
half-cell shifts too, up to 8 transforms per shell); every configuration ``i <= j <= l``
with the triangle condition on the shell centres. ``--backward`` also times the gradient
of a loss of B in the field. ``--layer``: the function against
:class:`torchpm.nn.BispectrumEstimator` (built once, then called), in the same process,
their calls alternating; the layer's construction time and both peaks.

Each measurement runs in a fresh process after one warm-up call: on the CPU the peak
memory is the growth of the resident set (Linux ``VmHWM``, reset, with the heap's freed
blocks released, before the call) over the call, on CUDA
``torch.cuda.max_memory_allocated``; both also in units of the float64 field. Times: the
median of ``--repeats`` calls after the warm-up, synchronised on CUDA. (Run from a
source checkout with ``PYTHONPATH=.``.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from harness import (ROOT, ChildFailed, PeakMemory, Table, child_report, print_header, time_call, timed,
                     timed_together)

BOX = 1000.0


def edges(size: int, reach: str) -> list[float]:
    """Shells 3 k_f wide from 1.5 k_f, up to 2/3 of the Nyquist frequency or to it."""
    k_fundamental = 2 * math.pi / BOX
    top = size / 2 * (2 / 3 if reach == "two-thirds" else 1.0)  # in k_f
    count = int((top - 1.5) // 3)
    return [k_fundamental * (1.5 + 3 * j) for j in range(count + 1)]


def measure(size: int, reach: str, backward: bool, repeats: int, device: str, threads: int | None) -> dict:
    import torch

    from torchpm.bispectrum import bispectrum

    if threads:
        torch.set_num_threads(threads)
    bins = edges(size, reach)
    field = torch.randn(1, size, size, size, generator=torch.Generator().manual_seed(0)).to(device)

    def call():
        if not backward:
            return bispectrum(field, BOX, bins=bins, window="cic")
        leaf = field.clone().requires_grad_()
        result = bispectrum(leaf, BOX, bins=bins, window="cic")
        (result.bispectrum**2).sum().backward()
        return result

    call()  # warm-up: libraries, FFT plans and the allocator's first blocks outside the measurement
    # On the CPU the heap's freed blocks go back to the system and the high-water mark
    # restarts first, so that VmHWM - VmRSS over the call is what the call itself allocates.
    with PeakMemory(device, host="high-water", reset_high_water=True, release_freed=True) as memory:
        result = call()
    peak = memory.peak
    timing = timed(call, device, repeats, warmup=0)
    return dict(size=size, reach=reach, backward=backward, device=device, threads=torch.get_num_threads(),
                shells=len(bins) - 1, configurations=int(result.shells.shape[0]),
                s=timing.median, s_min=timing.minimum, s_max=timing.maximum,
                peak_mib=peak / 2**20, peak_over_field=peak / (8 * size**3))


def measure_layer(size: int, reach: str, backward: bool, repeats: int, device: str, threads: int | None) -> dict:
    """The function and the layer on the same field: median times of ``repeats`` calls of
    each (alternating), the layer's construction time, and each one's peak over a call."""
    import torch

    from torchpm.bispectrum import bispectrum
    from torchpm.nn import BispectrumEstimator

    if threads:
        torch.set_num_threads(threads)
    bins = edges(size, reach)
    field = torch.randn(1, size, size, size, generator=torch.Generator().manual_seed(0)).to(device)

    construction, layer = time_call(lambda: BispectrumEstimator(size, BOX, bins=bins, window="cic", device=device),
                                    device)

    def call(measure):
        if not backward:
            return measure(field)
        leaf = field.clone().requires_grad_()
        result = measure(leaf)
        (result.bispectrum**2).sum().backward()
        return result

    calls = {"function": lambda x: bispectrum(x, BOX, bins=bins, window="cic"), "layer": layer}
    peaks = {}
    for name, measure in calls.items():
        call(measure)  # warm-up
        with PeakMemory(device, host="high-water", reset_high_water=True, release_freed=True) as memory:
            call(measure)
        peaks[name] = memory.peak
    timings = timed_together({name: (lambda measure=measure: call(measure)) for name, measure in calls.items()},
                             device, repeats, warmup=0)
    return dict(size=size, reach=reach, backward=backward, device=device, threads=torch.get_num_threads(),
                shells=len(bins) - 1, configurations=int(layer.shells.shape[0]), construction_s=construction,
                **{f"{name}_s": timing.median for name, timing in timings.items()},
                **{f"{name}_range": (timing.minimum, timing.maximum) for name, timing in timings.items()},
                **{f"{name}_peak_mib": peak / 2**20 for name, peak in peaks.items()})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--reach", nargs="+", default=["two-thirds", "nyquist"], choices=["two-thirds", "nyquist"])
    parser.add_argument("--backward", action="store_true", help="also time forward + backward")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--layer", action="store_true",
                        help="the function against torchpm.nn.BispectrumEstimator, in the same process")
    parser.add_argument("--one", nargs=3, metavar=("SIZE", "REACH", "BACKWARD"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.one:
        size, reach, backward = arguments.one
        run = measure_layer if arguments.layer else measure
        print(json.dumps(run(int(size), reach, backward == "1", arguments.repeats, arguments.device,
                             arguments.threads)))
        return
    print_header("bispectrum benchmark", arguments.device, [f"box {BOX} Mpc/h", "float32 field", "CIC window",
                                                            f"median of {arguments.repeats}"])
    if arguments.layer:
        table = Table(["n^3", "shells up to", "shells", "configurations", "pass", "function (s) [min-max]",
                       "layer (s) [min-max]", ("function / layer", ".2f"), ("layer built (s)", ".2f"),
                       "peak MiB function / layer"])
    else:
        table = Table(["n^3", "shells up to", "shells", "configurations", "pass", "time (s) [min-max]",
                       ("peak MiB", ".0f"), ("peak / float64 field", ".1f")])
    table.print_header()
    environment = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for size in arguments.sizes:
        for reach in arguments.reach:
            for backward in ([False, True] if arguments.backward else [False]):
                command = [sys.executable, os.path.abspath(__file__), "--one", str(size), reach,
                           "1" if backward else "0", "--repeats", str(arguments.repeats),
                           "--device", arguments.device]
                if arguments.threads:
                    command += ["--threads", str(arguments.threads)]
                if arguments.layer:
                    command += ["--layer"]
                try:
                    row = child_report(command, environment)
                except ChildFailed as error:
                    print(error.stderr, file=sys.stderr)
                    raise SystemExit(error.returncode or 1) from None
                label = "2/3 k_Nyq" if reach == "two-thirds" else "k_Nyq"
                step = "fwd+bwd" if backward else "fwd"
                if arguments.layer:
                    function, layer = row["function_range"], row["layer_range"]
                    table.print_row(size, label, row["shells"], row["configurations"], step,
                                    f"{row['function_s']:.3f} [{function[0]:.3f}-{function[1]:.3f}]",
                                    f"{row['layer_s']:.3f} [{layer[0]:.3f}-{layer[1]:.3f}]",
                                    row["function_s"] / row["layer_s"], row["construction_s"],
                                    f"{row['function_peak_mib']:.0f} / {row['layer_peak_mib']:.0f}")
                    continue
                table.print_row(size, label, row["shells"], row["configurations"], step,
                                f"{row['s']:.2f} [{row['s_min']:.2f}-{row['s_max']:.2f}]", row["peak_mib"],
                                row["peak_over_field"])


if __name__ == "__main__":
    main()
