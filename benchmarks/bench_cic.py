"""CIC paint / readout throughput against the pure-torch reference.

For n^3 particles painted into an n^3 mesh (float32), times the forward and the
backward of paint, 1-channel readout and 3-channel readout, for uniformly random
positions and for a lattice plus small displacements (the layout of an early
N-body step). Reports particles per second (median of repeats after a warm-up,
with device synchronisation) and the ratio of torchpm to the reference measured
in the same process.

    python benchmarks/bench_cic.py                 # cpu: 64^3, 128^3, 256^3
    python benchmarks/bench_cic.py --device cuda   # adds 512^3
    python benchmarks/bench_cic.py --sizes 64 128 --repeats 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import torchpm
from torchpm.ops import cic_paint_reference, cic_readout_reference


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device, repeats, budget):
    fn()  # warm-up (allocator, caches, lazy init)
    synchronize(device)
    times = []
    start_all = time.perf_counter()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
        if time.perf_counter() - start_all > budget and len(times) >= 1:
            break
    return statistics.median(times)


def make_positions(n, layout, device, generator):
    if layout == "uniform":
        return (torch.rand(1, n**3, 3, generator=generator) * n).to(device)
    axis = torch.arange(n, dtype=torch.float32)
    q = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(1, -1, 3)
    return ((q + 0.5 * torch.randn(q.shape, generator=generator)) % n).to(device)


def cases(n, x, device):
    shape = (n, n, n)
    mesh1 = torch.randn(1, *shape, device=device)
    mesh3 = torch.randn(1, 3, *shape, device=device)

    def paint(impl):
        return lambda: impl(x, None, shape) if impl is cic_paint_reference else impl(x, None, shape)

    def paint_backward(impl):
        def run():
            xr = x.detach().requires_grad_(True)
            w = torch.ones(x.shape[:2], device=device, requires_grad=True)
            impl(xr, w, shape).backward(mesh1)
        return run

    def readout(impl, mesh):
        return lambda: impl(mesh, x)

    def readout_backward(impl, mesh):
        def run():
            xr = x.detach().requires_grad_(True)
            m = mesh.detach().requires_grad_(True)
            out = impl(m, xr)
            out.backward(torch.ones_like(out))
        return run

    ours_paint = torchpm.cic_paint
    ours_read = lambda m, p: torchpm.cic_readout(m, p)  # noqa: E731
    ref_read = lambda m, p: cic_readout_reference(m, p)  # noqa: E731
    return [
        ("paint", paint(ours_paint), paint(cic_paint_reference)),
        ("paint fwd+bwd", paint_backward(ours_paint), paint_backward(cic_paint_reference)),
        ("readout 1ch", readout(ours_read, mesh1), readout(ref_read, mesh1)),
        ("readout 3ch", readout(ours_read, mesh3), readout(ref_read, mesh3)),
        ("readout 3ch fwd+bwd", readout_backward(ours_read, mesh3), readout_backward(ref_read, mesh3)),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="*")
    parser.add_argument("--layouts", nargs="*", default=["uniform", "lattice"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per measurement before stopping repeats")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = args.sizes or ([64, 128, 256, 512] if device.type == "cuda" else [64, 128, 256])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    print(f"# torchpm {torchpm.__version__}, torch {torch.__version__}, {name}, float32")
    print(f"{'n':>5} {'layout':>8} {'op':<20} {'torchpm Mp/s':>13} {'reference Mp/s':>15} {'ratio':>7}")
    generator = torch.Generator().manual_seed(0)
    for n in sizes:
        for layout in args.layouts:
            x = make_positions(n, layout, device, generator)
            for label, ours, ref in cases(n, x, device):
                t_ours = median_time(ours, device, args.repeats, args.budget)
                t_ref = median_time(ref, device, args.repeats, args.budget)
                rate = lambda t: n**3 / t / 1e6  # noqa: E731
                print(
                    f"{n:>5} {layout:>8} {label:<20} {rate(t_ours):>13.1f} {rate(t_ref):>15.1f} {t_ref / t_ours:>7.2f}",
                    flush=True,
                )
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
