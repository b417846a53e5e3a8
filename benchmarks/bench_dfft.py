"""Benchmark of torchpm's distributed FFT (PencilDecomposition.rfftn / irfftn).

CPU (default): 1, 2 and 4 gloo ranks on this machine against the serial
torch.fft.rfftn / irfftn, float32, one thread per rank:

    python benchmarks/bench_dfft.py [--sizes 64 128 256] [--ranks 1 2 4]

GPU (--gpu): world size 1 with NCCL, overhead against torch.fft at 256^3 and
512^3, both for the 1 x 1 decomposition (the path a single-GPU run takes) and
for the staged pipeline (1-D FFTs + pack + NCCL all-to-all + unpack, forced
with always_transpose=True):

    python benchmarks/bench_dfft.py --gpu [--sizes 256 512]

Agreement check (--agreement): the cost of the per-collective check that the
ranks agree on the call (PencilDecomposition(check_agreement=...)), gloo CPU
ranks, rfftn / irfftn / fill_halo with the check on and off, alternated:

    python benchmarks/bench_dfft.py --agreement [--sizes 64] [--ranks 2] [--repeats 50]

Prints a table: median of --repeats after warm-up, the slowest rank's median
for distributed runs, and the ratio against the serial reference.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpm  # noqa: E402,F401
from harness import Table, print_header, timed  # noqa: E402
from torchpm.distributed import PencilDecomposition, process_grid_groups  # noqa: E402


def default_grid(world):
    p1 = max(d for d in range(1, int(math.isqrt(world)) + 1) if world % d == 0)
    return world // p1, p1


def median_time(fn, repeats, device="cpu", barrier=None):
    """Median of ``repeats`` calls after 2 warm-up calls, each after ``barrier()``."""
    return timed(fn, device, repeats, warmup=2, barrier=barrier).median


# ----------------------------------------------------------------------------
# CPU: gloo ranks spawned here.


def _cpu_worker(rank, world, grid, sizes, repeats, store, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    groups = process_grid_groups(grid)
    rows = []
    for n in sizes:
        d = PencilDecomposition((n, n, n), groups)
        field = torch.randn(1, *d.local_real_shape)
        field_k = d.rfftn(field)
        barrier = dist.barrier if world > 1 else None
        t_forward = median_time(lambda: d.rfftn(field), repeats, barrier=barrier)
        t_inverse = median_time(lambda: d.irfftn(field_k), repeats, barrier=barrier)
        # The two forward transposes alone, on tensors of the right layouts.
        p0, p1 = d.grid_shape
        lx, ly, nz = d.local_real_shape
        t1_in = torch.randn(1, lx, ly, nz // 2 + 1, dtype=torch.complex64)
        t0_in = torch.randn(1, lx, n, d.local_fourier_shape[2], dtype=torch.complex64)
        t_transposes = median_time(
            lambda: (d.transpose(t1_in, 1), d.transpose(t0_in, 0)), repeats, barrier=barrier
        ) if world > 1 else 0.0
        times = torch.tensor([t_forward, t_inverse, t_transposes], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        rows.append((n, *times.tolist()))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def run_cpu(args):
    torch.set_num_threads(1)
    print_header("distributed FFT benchmark", "cpu", ["gloo", "float32", "1 thread per rank"])
    serial = {}
    for n in args.sizes:
        x = torch.randn(1, n, n, n)
        xk = torch.fft.rfftn(x, dim=(-3, -2, -1))
        serial[n] = (
            median_time(lambda: torch.fft.rfftn(x, dim=(-3, -2, -1)), args.repeats),
            median_time(lambda: torch.fft.irfftn(xk, s=(n, n, n), dim=(-3, -2, -1)), args.repeats),
        )
    table = Table([("ranks", ">5"), ("grid", ">5"), ("n", ">5"), ("rfftn ms", "10.2f"), ("irfftn ms", "10.2f"),
                   ("transposes ms", "14.2f"), ("vs serial fwd", "14.2f"), ("vs serial inv", "14.2f")], style="aligned")
    table.print_header()
    for n in args.sizes:
        table.print_row("serial", "-", n, 1e3 * serial[n][0], 1e3 * serial[n][1], "-", 1.0, 1.0)
    context = mp.get_context("spawn")
    for world in args.ranks:
        grid = default_grid(world)
        grids = [grid] + ([(world, 1)] if grid != (world, 1) else [])
        for grid in grids:
            queue = context.Queue()
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(
                    _cpu_worker,
                    args=(world, grid, args.sizes, args.repeats, os.path.join(tmp, "store"), queue),
                    nprocs=world, start_method="spawn",
                )
                rows = queue.get()
            for n, forward, inverse, transposes in rows:
                table.print_row(world, f"{grid[0]}x{grid[1]}", n, 1e3 * forward, 1e3 * inverse, 1e3 * transposes,
                                forward / serial[n][0], inverse / serial[n][1])


# ----------------------------------------------------------------------------
# Cost of the agreement check: the same calls with check_agreement on and off.


def _agreement_worker(rank, world, grid, sizes, repeats, store, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    groups = process_grid_groups(grid)
    rows = []
    for n in sizes:
        checked = PencilDecomposition((n, n, n), groups, check_agreement=True)
        unchecked = PencilDecomposition((n, n, n), groups, check_agreement=False)
        field = torch.randn(1, *checked.local_real_shape)
        field_k = checked.rfftn(field)
        haloed = checked.pad_halo(field, 1)
        descriptor = [("dtype", field.dtype), ("batch", (1,)), ("width", (1, 1))]
        calls = {
            "rfftn": lambda d: d.rfftn(field),
            "irfftn": lambda d: d.irfftn(field_k),
            "fill_halo": lambda d: d.fill_halo(haloed, 1),
        }
        for name, call in calls.items():
            on, off = [], []
            # Alternate the two so that drift of the shared machine hits both alike.
            for _ in range(3):
                on.append(median_time(lambda: call(checked), repeats // 3 + 1, barrier=dist.barrier))
                off.append(median_time(lambda: call(unchecked), repeats // 3 + 1, barrier=dist.barrier))
            times = torch.tensor([statistics.median(on), statistics.median(off)], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            rows.append((n, name, *times.tolist()))
        alone = median_time(lambda: checked.grid.agree("bench", descriptor), repeats, barrier=dist.barrier)
        alone = torch.tensor([alone], dtype=torch.float64)
        dist.all_reduce(alone, op=dist.ReduceOp.MAX)
        rows.append((n, "agree() alone", float(alone), 0.0))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def run_agreement(args):
    print_header("distributed FFT benchmark: the agreement check", "cpu", ["gloo", "float32", "1 thread per rank"])
    table = Table([("ranks", ">5"), ("grid", ">5"), ("n", ">5"), ("call", ">14"), ("check on ms", "12.3f"),
                   ("check off ms", "13.3f"), ("cost ms", "8.3f"), ("cost %", ">7")], style="aligned")
    table.print_header()
    context = mp.get_context("spawn")
    for world in args.ranks:
        grid = (world, 1)
        queue = context.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(
                _agreement_worker,
                args=(world, grid, args.sizes, args.repeats, os.path.join(tmp, "store"), queue),
                nprocs=world, start_method="spawn",
            )
            rows = queue.get()
        for n, name, on, off in rows:
            if name == "agree() alone":
                table.print_row(world, f"{grid[0]}x{grid[1]}", n, name, 1e3 * on, "-", "-", "-")
                continue
            table.print_row(world, f"{grid[0]}x{grid[1]}", n, name, 1e3 * on, 1e3 * off, 1e3 * (on - off),
                            f"{100 * (on / off - 1):6.1f}%")


# ----------------------------------------------------------------------------
# GPU: world size 1, NCCL.


def run_gpu(args):
    if not torch.cuda.is_available():
        raise SystemExit("bench_dfft.py --gpu: no CUDA device")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        world = dist.group.WORLD
        print_header("distributed FFT benchmark", device, ["NCCL world size 1", "float32"])
        table = Table([("n", ">5"), ("path", ">22"), ("rfftn ms", "10.3f"), ("irfftn ms", "10.3f"),
                       ("overhead fwd", ">13"), ("overhead inv", ">13")], style="aligned")
        table.print_header()
        for n in args.sizes:
            x = torch.randn(1, n, n, n, device=device)
            xk = torch.fft.rfftn(x, dim=(-3, -2, -1))
            reference = (
                median_time(lambda: torch.fft.rfftn(x, dim=(-3, -2, -1)), args.repeats, device),
                median_time(lambda: torch.fft.irfftn(xk, s=(n, n, n), dim=(-3, -2, -1)), args.repeats, device),
            )
            table.print_row(n, "torch.fft", 1e3 * reference[0], 1e3 * reference[1], "-", "-")
            for label, d in (
                ("1x1 decomposition", PencilDecomposition((n, n, n), (world, world))),
                ("staged (forced a2a)", PencilDecomposition((n, n, n), (world, world), always_transpose=True)),
            ):
                forward = median_time(lambda: d.rfftn(x), args.repeats, device)
                inverse = median_time(lambda: d.irfftn(xk), args.repeats, device)
                table.print_row(n, label, 1e3 * forward, 1e3 * inverse, f"{100 * (forward / reference[0] - 1):12.1f}%",
                                f"{100 * (inverse / reference[1] - 1):12.1f}%")
            del x, xk
            torch.cuda.empty_cache()
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="world size 1 with NCCL on cuda:0")
    parser.add_argument("--agreement", action="store_true",
                        help="cost of the per-collective agreement check (gloo CPU ranks, check on vs off)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.agreement:
        args.sizes = args.sizes or [64]
        args.ranks = [r for r in args.ranks if r > 1] if args.ranks != [1, 2, 4] else [2]
        run_agreement(args)
    elif args.gpu:
        args.sizes = args.sizes or [256, 512]
        run_gpu(args)
    else:
        args.sizes = args.sizes or [64, 128, 256]
        run_cpu(args)


if __name__ == "__main__":
    main()
