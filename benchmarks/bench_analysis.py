"""Time and peak memory of the two-point statistics of a mesh field: ``power_spectrum``,
``power_multipoles`` (P_0, P_2, P_4), ``correlation_function`` and its multipoles
(xi_0, xi_2, xi_4) of a float32 ``n^3`` field with the CIC window, and the layers
``torchpm.nn.PowerSpectrum`` and ``CorrelationFunction`` (built once before the measurement;
their forward pass computes in the field's float32; on the CPU their peak is the process's
high-water mark, which their construction, in float64, may set).

    python benchmarks/bench_analysis.py [--sizes 128 192 256] [--repeats 5] [--device cpu|cuda]

Each measurement runs in a fresh process (peak memory is a process's high-water mark):
on the CPU the growth of the resident set (Linux ``VmHWM``) over the call, on CUDA
``torch.cuda.max_memory_allocated`` over the call; both are reported in units of the
field's own size. Times: the median of ``--repeats`` calls after one warm-up call,
synchronised on CUDA. (Run from a source checkout with ``PYTHONPATH=.``.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from harness import PeakMemory, Table, child_report, print_header, timed


FUNCTIONS = ("power_spectrum", "power_multipoles", "correlation_function", "correlation_multipoles", "power_layer",
             "correlation_layer")


def measure(size: int, function: str, repeats: int, device: str) -> dict:
    import torch

    from torchpm.analysis import correlation_function, power_multipoles, power_spectrum
    from torchpm.nn import CorrelationFunction, PowerSpectrum

    if function in ("power_layer", "correlation_layer"):  # built once, outside the measurement
        kind = PowerSpectrum if function == "power_layer" else CorrelationFunction
        options = dict(compensate_cic=True) if function == "power_layer" else dict(window="cic")
        layer = kind(size, 500.0, device=device, **options)
        return _measured(size, function, repeats, device, layer)
    call = {"power_spectrum": lambda f: power_spectrum(f, 500.0, window="cic"),
            "power_multipoles": lambda f: power_multipoles(f, 500.0, ells=(0, 2, 4), window="cic"),
            "correlation_function": lambda f: correlation_function(f, 500.0, window="cic"),
            "correlation_multipoles": lambda f: correlation_function(f, 500.0, ells=(0, 2, 4), window="cic")}[function]
    call(torch.randn(1, 8, 8, 8, device=device))  # libraries loaded outside the measurement
    return _measured(size, function, repeats, device, call)


def _measured(size, function, repeats, device, call):
    import torch

    field = torch.randn(1, size, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    # the high-water mark of the process (not reset): the field's call is its largest allocation
    with PeakMemory(device, host="high-water") as memory:
        call(field)  # also the warm-up of the timed calls
    peak = memory.peak
    milliseconds = 1e3 * timed(lambda: call(field), device, repeats, warmup=0).median
    field_bytes = field.numel() * field.element_size()
    return dict(size=size, function=function, device=device, ms=milliseconds,
                peak_mib=peak / 2**20, peak_over_field=peak / field_bytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 192, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "FUNCTION"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.one:
        print(json.dumps(measure(int(arguments.one[0]), arguments.one[1], arguments.repeats, arguments.device)))
        return
    print_header("two-point statistics benchmark", arguments.device, ["float32", "CIC window"])
    table = Table(["n^3", "function", ("median ms", ".1f"), ("peak MiB", ".0f"), "peak / field"])
    table.print_header()
    for size in arguments.sizes:
        for function in FUNCTIONS:
            row = child_report([sys.executable, os.path.abspath(__file__), "--one", str(size), function, "--repeats",
                                str(arguments.repeats), "--device", arguments.device])
            table.print_row(f"{size}^3", function, row["ms"], row["peak_mib"], f"{row['peak_over_field']:.1f}x")


if __name__ == "__main__":
    main()
