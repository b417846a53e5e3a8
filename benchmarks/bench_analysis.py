"""Time and peak memory of the spectra of a mesh field: ``power_spectrum`` and
``power_multipoles`` (P_0, P_2, P_4) of a float32 ``n^3`` field with the CIC window.

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
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(key: str) -> int:
    """A ``/proc/self/status`` value in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def measure(size: int, function: str, repeats: int, device: str) -> dict:
    import torch

    from torchpm.analysis import power_multipoles, power_spectrum

    call = {"power_spectrum": lambda f: power_spectrum(f, 500.0, window="cic"),
            "power_multipoles": lambda f: power_multipoles(f, 500.0, ells=(0, 2, 4), window="cic")}[function]
    field = torch.randn(1, size, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    call(torch.randn(1, 8, 8, 8, device=device))  # libraries loaded outside the measurement
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _status("VmRSS")
    call(field)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status("VmHWM") - base
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call(field)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    field_bytes = field.numel() * field.element_size()
    return dict(size=size, function=function, device=device, ms=1e3 * statistics.median(times),
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
    import torch

    import torchpm

    print(f"torchpm from {os.path.dirname(torchpm.__file__)}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {arguments.device}")
    print("| n^3 | function | median ms | peak MiB | peak / field |")
    print("|---|---|---|---|---|")
    for size in arguments.sizes:
        for function in ("power_spectrum", "power_multipoles"):
            result = subprocess.run([sys.executable, __file__, "--one", str(size), function, "--repeats",
                                     str(arguments.repeats), "--device", arguments.device],
                                    capture_output=True, text=True, check=True, env=dict(os.environ))
            row = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"| {size}^3 | {function} | {row['ms']:.1f} | {row['peak_mib']:.0f} | "
                  f"{row['peak_over_field']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
