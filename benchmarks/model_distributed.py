"""Bytes moved per rank per PM step on a process grid, and the step time they predict.

Usage::

    python benchmarks/model_distributed.py

A model, not a measurement: it prints, for 512^3, 1024^3 and 2048^3 particles (mesh
factor 1, float32) on 8, 64 and 512 H100s, the bytes each rank sends per step in the
FFT transposes, the halo exchanges and the migration, and a predicted step time =
local compute + communication (no overlap). Assumptions, stated so they can be changed:

* transposes: one forward rfftn (density) and, with the default real-space 4-point
  gradient (``gradient="fd4"``, blocks at least 2 planes thick), one inverse transform
  (the potential) per step; with a Fourier-space gradient (``"exact"``, or blocks
  thinner than 2 planes) three inverse transforms (the force components). The local
  complex block is ``4 N^3 / P`` bytes and a transpose over a grid axis of ``P_a``
  ranks sends ``(P_a - 1) / P_a`` of it;
* halos along each split axis (CIC): the paint adds one channel (one plane above the
  block); with the real-space gradient the potential's halo is then filled once for
  the gradient and the readout (one channel, two planes below and three above), with
  the Fourier gradient the readout fills the three components (one plane above);
* migration: 2 % of a rank's particles leave per step (late times, blocks >= 64
  cells thick), 32 bytes each (position, momentum, int64 id);
* bandwidth per GPU: NCCL all-to-all inside an 8-GPU NVLink node 150 GB/s; across nodes
  (one 400 Gb/s InfiniBand NIC per GPU) 40 GB/s; 20 us latency per collective in a node,
  50 us across nodes;
* local compute per rank: pmwd's measured 94.6 ms for a 512^3 step on one H100 PCIe,
  scaled by the particles per rank (torchpm's own GPU step time has not been measured
  yet: no GPU was lent to these sessions).

Grids: 8 GPUs = one node, 8 x 1 slabs; 64 GPUs = 8 nodes, 8 x 8 pencils with grid
axis 1 inside a node; 512 GPUs = 64 nodes, 64 x 8 with grid axis 1 inside a node.
"""

from harness import Table, print_header

NVLINK, INFINIBAND = 150e9, 40e9
LATENCY_NODE, LATENCY_NETWORK = 20e-6, 50e-6
PMWD_512_STEP = 94.6e-3
CONFIGS = {8: (8, 1), 64: (8, 8), 512: (64, 8)}


def model(n, gpus, gradient="fd4"):
    p0, p1 = CONFIGS[gpus]
    cells = n**3
    complex_block = 4 * cells / gpus  # bytes of the local rfft block (complex64)
    real_space = gradient == "fd4"
    transforms = 2 if real_space else 4
    # halo planes x channels moved per split axis, and halo exchanges per step
    halo_planes = 1 + (5 if real_space else 3)
    exchanges = 2
    # grid axis 1 (size p1) stays inside a node; axis 0 crosses nodes when there are several
    axis0_bandwidth = NVLINK if gpus <= 8 else INFINIBAND
    axis0_latency = LATENCY_NODE if gpus <= 8 else LATENCY_NETWORK
    transpose_bytes = transforms * complex_block * ((p0 - 1) / p0 + ((p1 - 1) / p1 if p1 > 1 else 0))
    transpose_time = transforms * (
        complex_block * (p0 - 1) / p0 / axis0_bandwidth + axis0_latency
        + ((complex_block * (p1 - 1) / p1 / NVLINK + LATENCY_NODE) if p1 > 1 else 0)
    )
    lx, ly = n / p0, n / p1
    halo_bytes = 4 * halo_planes * n * ((ly if p0 > 1 else 0) + (lx if p1 > 1 else 0))
    halo_time = halo_bytes / axis0_bandwidth + 2 * exchanges * axis0_latency
    migration_bytes = 0.02 * cells / gpus * 32
    migration_time = migration_bytes / axis0_bandwidth + 4 * axis0_latency
    compute = PMWD_512_STEP * cells / 512**3 / gpus
    total = compute + transpose_time + halo_time + migration_time
    return dict(transpose=transpose_bytes, halo=halo_bytes, migration=migration_bytes, compute=compute,
                communication=transpose_time + halo_time + migration_time, total=total)


def main():
    print_header("model of the distributed step (no measurement)")
    table = Table(["particles", "GPUs", "grid", ("transposes MB/rank", ".1f"), ("halos MB/rank", ".2f"),
                   ("migration MB/rank", ".2f"), ("compute ms", ".2f"), ("communication ms", ".2f"),
                   ("predicted step ms", ".1f"), "Fourier gradient: communication / step ms"])
    table.print_header()
    for n in (512, 1024, 2048):
        for gpus in (8, 64, 512):
            m = model(n, gpus)
            f = model(n, gpus, gradient="fourier")
            p0, p1 = CONFIGS[gpus]
            table.print_row(f"{n}^3", gpus, f"{p0} x {p1}", m["transpose"] / 1e6, m["halo"] / 1e6, m["migration"] / 1e6,
                            m["compute"] * 1e3, m["communication"] * 1e3, m["total"] * 1e3,
                            f"{f['communication'] * 1e3:.2f} / {f['total'] * 1e3:.1f}")


if __name__ == "__main__":
    main()
