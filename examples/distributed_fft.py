"""Distributed real-to-complex FFT of a 3-D field with torchpm.

Run on CPUs (gloo) or GPUs (NCCL, one per rank):

    torchrun --nproc-per-node=4 examples/distributed_fft.py [--grid 2 2] [--size 128]

Each rank draws its own block of a random field (no rank ever holds the whole
field), transforms it, and the blocks are gathered on rank 0 at a small size to
check them against torch.fft.rfftn of the gathered field. Then the forward and
inverse transforms are timed at --size.
"""

import argparse
import datetime
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

import torchpm  # noqa: F401
from torchpm.distributed import PencilDecomposition, process_grid_groups


def default_grid(world):
    """The most square (P0, P1) with P0 * P1 = world, P0 >= P1."""
    p1 = max(d for d in range(1, int(math.isqrt(world)) + 1) if world % d == 0)
    return world // p1, p1


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_blocks(d, local, block_of, shape, device):
    """Rank 0 gets the whole tensor of `shape` assembled from every rank's block."""
    world = dist.get_world_size()
    grid_p1 = d.grid_shape[1]
    parts = [None] * world
    dist.gather_object(local.cpu(), parts if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    whole = torch.empty(*local.shape[:-3], *shape, dtype=local.dtype)
    for rank, part in enumerate(parts):
        (lx, ly, lz), (ox, oy, oz) = block_of(divmod(rank, grid_p1))
        whole[..., ox : ox + lx, oy : oy + ly, oz : oz + lz] = part
    return whole


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, nargs=2, help="process grid P0 P1 (default: most square)")
    parser.add_argument("--size", type=int, default=None, help="mesh side for the timing (default 128 CPU, 512 GPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120, help="seconds before a stuck collective raises")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    grid = tuple(args.grid) if args.grid else default_grid(world)
    groups = process_grid_groups(grid)

    # 1. Correctness at a small, uneven size, in float64.
    check_shape = (18, 14, 10)
    d = PencilDecomposition(check_shape, groups)
    generator = torch.Generator().manual_seed(1234 + rank)
    local = torch.randn(1, *d.local_real_shape, dtype=torch.float64, generator=generator).to(device)
    field_k = d.rfftn(local)
    back = d.irfftn(field_k)
    whole = gather_blocks(d, local, d.real_block, check_shape, device)
    whole_k = gather_blocks(d, field_k, d.fourier_block, d.fourier_shape, device)
    roundtrip = torch.tensor([(back - local).abs().max().item()], device=device)
    dist.all_reduce(roundtrip, op=dist.ReduceOp.MAX)
    if rank == 0:
        expected = torch.fft.rfftn(whole, dim=(-3, -2, -1))
        error = ((whole_k - expected).abs().max() / expected.abs().max()).item()
        print(f"grid {grid[0]} x {grid[1]} on {world} rank(s), {'NCCL' if use_cuda else 'gloo'}, mesh {check_shape}")
        print(f"  rfftn vs torch.fft.rfftn of the gathered field: max rel. error {error:.2e}")
        print(f"  irfftn(rfftn(x)) - x: max abs error {roundtrip.item():.2e}")
        if error > 1e-12 or roundtrip.item() > 1e-12:
            raise SystemExit("distributed FFT check FAILED")

    # 2. Timing, float32.
    n = args.size or (512 if use_cuda else 128)
    d = PencilDecomposition((n, n, n), groups)
    field = torch.randn(1, *d.local_real_shape, device=device)
    timings = {"rfftn": [], "irfftn": []}
    for repeat in range(args.repeats + 2):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        field_k = d.rfftn(field)
        synchronize(device)
        middle = time.perf_counter()
        d.irfftn(field_k)
        synchronize(device)
        end = time.perf_counter()
        if repeat >= 2:  # warm-up: plans, connections, allocator
            timings["rfftn"].append(middle - start)
            timings["irfftn"].append(end - middle)
    for name, values in timings.items():
        median = torch.tensor([statistics.median(values)], device=device)
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"  {name} {n}^3 float32: {1e3 * median.item():8.2f} ms (median of {args.repeats}, slowest rank)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
