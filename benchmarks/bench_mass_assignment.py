"""Mass-assignment (NGP, CIC, TSC, PCS) paint / readout throughput.

For n^3 particles painted into an n^3 mesh (float32), times paint, paint
forward+backward, 3-channel readout and 3-channel readout forward+backward, and
the adjoint's fused readout + position gradient of a 4-channel mesh, for every
order (the reads from a planar and from an interleaved mesh, ``--mesh-layouts``), for uniformly random positions, for a lattice plus small
displacements (the layout of an early N-body step) and for the particles of an
evolved run ("late", clustered), each also in spatial order ("-sorted"). Reports particles per second
(median of repeats after a warm-up, with device synchronisation), the time per
particle relative to CIC measured in the same run (orders timed round-robin, the
median of the per-round ratios) (targets: TSC within 3x, PCS
within 6x: 27 and 64 nodes per particle against 8), and for CIC the ratio against
the pure-torch twin (``--reference``, all orders; the twin of PCS needs ~10 GB at
256^3).

    python benchmarks/bench_mass_assignment.py                      # cpu: 64^3, 128^3
    python benchmarks/bench_mass_assignment.py --device cuda        # adds 256^3, 512^3
    python benchmarks/bench_mass_assignment.py --sizes 128 --orders cic tsc pcs --repeats 5

``--deterministic`` times instead, per order, the three ways to paint: the scatter
kernel (atomics on CUDA), the node-by-node paint that CUDA takes under
``torch.use_deterministic_algorithms(True)`` (``_paint_deterministic``, called
directly, so it is timed on the CPU too) and the pure-torch twin (the earlier
deterministic path), interleaved, with the peak memory of each on CUDA:

    python benchmarks/bench_mass_assignment.py --deterministic --device cuda --sizes 256 512 --orders cic tsc

``--tiled`` times the scatter kernel against the tiled paint
(``torchpm.ops.set_paint_method("tiled")``, ``_paint_tiled``: shared-memory
sums per tile of 8^3 nodes), with unit mass and with 3-channel weights (the
paint of readout's backward); on the CPU the tiled op is the CUDA passes run in
order (a check of their cost, not a fast path):

    python benchmarks/bench_mass_assignment.py --tiled --device cuda --sizes 256 512 --orders cic tsc --layouts uniform late late-sorted
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torchpm  # noqa: E402
from harness import PeakMemory, Table, print_header, timed, timed_together  # noqa: E402
from torchpm.ops import paint_reference, position_gradient_reference, readout_reference  # noqa: E402

WIDTH = {"ngp": 1, "cic": 2, "tsc": 3, "pcs": 4}


def make_positions(n, layout, device, generator):
    """``(1, n^3, 3)`` positions in an n^3 mesh.

    ``uniform``: random; ``lattice``: a lattice plus small displacements (an early
    step); ``late``: the particles of an evolved run (a = 0.1 -> 1 in 10 steps, box
    2n Mpc/h, as in bench_pm.py), clustered, in the order the simulation leaves them
    (Lagrangian order on one device). A ``-sorted`` suffix puts them in spatial order
    (torchpm.ordering, what ``Simulation(sort_every=...)`` does).
    """
    base, _, suffix = layout.partition("-")
    if base == "uniform":
        x = (torch.rand(1, n**3, 3, generator=generator) * n).to(device)
    elif base == "lattice":
        axis = torch.arange(n, dtype=torch.float32)
        q = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(1, -1, 3)
        x = ((q + 0.5 * torch.randn(q.shape, generator=generator)) % n).to(device)
    elif base == "late":
        # on the benchmarked device (a 512^3 run on the host CPU would take minutes)
        sim = torchpm.Simulation(n_particles=n, box_size=float(2 * n), mesh_factor=1, a_start=0.1, steps=10,
                                 sort_every=0).to(device)
        with torch.no_grad():
            x = sim(sim.white_noise(seed=0), return_mesh_units=True).positions % n
    else:
        raise ValueError(f"unknown layout {layout!r}")
    if suffix == "sorted":
        from torchpm.mesh import LocalMesh
        from torchpm.ordering import sort_particles

        x = sort_particles(LocalMesh(n), x, torch.arange(x.shape[1], device=x.device).unsqueeze(0))[0]
    elif suffix:
        raise ValueError(f"unknown layout {layout!r}")
    return x.contiguous().to(device)


def cases(n, x, order, device, reference, mesh_layouts=("planar",)):
    """The timed calls. Per mesh layout (``planar``: torch's contiguous format;
    ``interleaved``: channels_last_3d, a node's channels side by side, the fd4 force
    field's layout; rows marked ``il``): the 3-channel readout, its forward+backward,
    and the adjoint's fused readout of 3 channels + position gradient of 4
    (``_readout_and_position_gradient``)."""
    shape = (n, n, n)
    mesh1 = torch.randn(1, *shape, device=device)
    mesh3 = torch.randn(1, 3, *shape, device=device)
    mesh4 = torch.randn(1, 4, *shape, device=device)
    values4 = torch.randn(1, x.shape[1], 4, device=device)
    p = WIDTH[order]
    geometry = ([0, 0, 0], [True] * 3, p)
    if reference:
        paint = lambda x, w: paint_reference(x, w, shape, order=p)  # noqa: E731
        read = lambda m, x: readout_reference(m, x, order=p)  # noqa: E731
        fused = lambda m, x, v: (read(m[:, :3], x), position_gradient_reference(m, x, v, *geometry))  # noqa: E731
    else:
        paint = lambda x, w: torchpm.paint(x, w, shape, order=order)  # noqa: E731
        read = lambda m, x: torchpm.readout(m, x, order=order)  # noqa: E731
        fused = lambda m, x, v: torch.ops.torchpm._readout_and_position_gradient(m, x, v, 3, *geometry)  # noqa: E731

    def paint_backward():
        xr = x.detach().requires_grad_(True)
        w = torch.ones(x.shape[:2], device=device, requires_grad=True)
        paint(xr, w).backward(mesh1)

    def readout_backward(mesh):
        xr = x.detach().requires_grad_(True)
        m = mesh.detach().requires_grad_(True)
        out = read(m, xr)
        out.backward(torch.ones_like(out))

    rows = [
        ("paint", lambda: paint(x, None)),
        ("paint fwd+bwd", paint_backward),
    ]
    for layout in mesh_layouts:
        fmt = torch.channels_last_3d if layout == "interleaved" else torch.contiguous_format
        m3, m4 = mesh3.contiguous(memory_format=fmt), mesh4.contiguous(memory_format=fmt)
        tag = " il" if layout == "interleaved" else ""
        rows += [
            ("readout 3ch" + tag, lambda m3=m3: read(m3, x)),
            ("readout 3ch fwd+bwd" + tag, lambda m3=m3: readout_backward(m3)),
            ("read+grad 4ch" + tag, lambda m4=m4: fused(m4, x, values4)),
        ]
    return rows


PAINTS = {
    "scatter": lambda x, w, shape, p: torch.ops.torchpm.paint(x, w, shape, [0, 0, 0], [True] * 3, p, True),
    "node": lambda x, w, shape, p: torch.ops.torchpm._paint_deterministic(x, w, shape, [0, 0, 0], [True] * 3, p, True),
    "tiled": lambda x, w, shape, p: torch.ops.torchpm._paint_tiled(x, w, shape, [0, 0, 0], [True] * 3, p, True),
    "twin": lambda x, w, shape, p: paint_reference(x, w, shape, order=p),
}


def paints_table(sizes, layouts, orders, channel_counts, variants, device, repeats, generator):
    """Ways to paint the same particles (PAINTS: the scatter kernel, the
    node-by-node paint, the tiled paint, the pure-torch twin), timed round-robin
    (ms, medians), their ratios to the first, and on CUDA the peak memory each
    allocates beyond its inputs (GB). Channels 0: unit mass; C: random (1, N, C)
    weights (3: readout's backward, 4: the adjoint's paint)."""
    head = variants[0]
    columns = [("n", ">5"), ("layout", ">14"), ("order", ">5"), ("ch", ">3")]
    columns += [(f"{v} ms", ">10.2f") for v in variants] + [(f"{v}/{head}", ">14.2f") for v in variants[1:]]
    if device.type == "cuda":
        columns.append(("peak GB " + "/".join(variants), ">28"))
    table = Table(columns, style="aligned")
    table.print_header()
    for n in sizes:
        for layout in layouts:
            x = make_positions(n, layout, device, generator)
            shape = [n, n, n]
            for channels in channel_counts:
                w = torch.rand(1, x.shape[1], channels, generator=generator).to(device) if channels else None
                for order in orders:
                    p = WIDTH[order]
                    fns = {key: (lambda key=key: PAINTS[key](x, w, shape, p)) for key in variants}
                    peak = {}
                    for key, fn in list(fns.items()):
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                        try:
                            # the warm-up, and on CUDA the peak memory of a call
                            with PeakMemory(device) if device.type == "cuda" else contextlib.nullcontext() as memory:
                                fn()
                        except torch.OutOfMemoryError:  # the twin at 512^3
                            del fns[key]
                            peak[key] = float("nan")
                            continue
                        if device.type == "cuda":
                            peak[key] = memory.peak / 1e9
                    timings = timed_together(fns, device, repeats, warmup=0)  # warmed up above
                    nan = float("nan")  # out of memory
                    t = {key: 1e3 * timings[key].median if key in timings else nan for key in variants}
                    cells = [n, layout, order, channels] + [t[v] for v in variants]
                    cells += [t[v] / t[head] for v in variants[1:]]
                    if device.type == "cuda":
                        cells.append("/".join(f"{peak[v]:.2f}" for v in variants))
                    table.print_row(*cells)
                del w
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="*")
    parser.add_argument("--orders", nargs="*", default=["ngp", "cic", "tsc", "pcs"])
    parser.add_argument("--layouts", nargs="*", default=["uniform", "lattice", "late", "late-sorted"],
                        help="uniform, lattice, late; with -sorted: in spatial order")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per measurement before stopping repeats")
    parser.add_argument("--reference", action="store_true", help="also time the pure-torch twin")
    parser.add_argument("--deterministic", action="store_true",
                        help="time the scatter paint, the node-by-node paint and the twin instead")
    parser.add_argument("--tiled", action="store_true", help="time the scatter paint and the tiled paint instead")
    parser.add_argument("--mesh-layouts", nargs="*", default=["planar", "interleaved"],
                        choices=["planar", "interleaved"],
                        help="memory layouts of the read meshes (interleaved: channels_last_3d, rows marked il)")
    parser.add_argument("--channels", type=int, nargs="*",
                        help="with --deterministic / --tiled: weight channels (0: unit mass); default 0, and 3 for --tiled")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = args.sizes or ([64, 128, 256, 512] if device.type == "cuda" else [64, 128])
    orders = list(dict.fromkeys(["cic"] + args.orders))  # CIC first: the reference of the ratios
    print_header("mass-assignment benchmark", device, ["float32", f"CPU kernels {torchpm.cpu_kernels()}"])
    if args.deterministic or args.tiled:
        variants = ["scatter", "node", "twin"] if args.deterministic else ["scatter", "tiled"]
        channels = args.channels if args.channels is not None else ([0] if args.deterministic else [0, 3])
        paints_table(sizes, args.layouts, orders, channels, variants, device, args.repeats, torch.Generator().manual_seed(0))
        return
    columns = [("n", ">5"), ("layout", ">14"), ("order", ">5"), ("op", "<24"), ("Mpart/s", ">9.2f"),
               ("x CIC time", ">10.2f")]
    if args.reference:
        columns += [("twin Mpart/s", ">13.2f"), ("speedup", ">8.2f")]
    table = Table(columns, style="aligned")
    table.print_header()
    generator = torch.Generator().manual_seed(0)
    for n in sizes:
        for layout in args.layouts:
            x = make_positions(n, layout, device, generator)
            # Orders are timed round-robin, one repeat of each in turn, so that a
            # busy spell of a shared machine hits all of them alike; the ratio to
            # CIC is the median of the per-round ratios.
            per_order = {order: cases(n, x, order, device, False, args.mesh_layouts) for order in orders}
            for index, (label, _) in enumerate(per_order["cic"]):
                fns = {order: per_order[order][index][1] for order in orders}
                timings = timed_together(fns, device, args.repeats, budget=args.budget * len(orders))
                for order in orders:
                    times = timings[order].times
                    t = statistics.median(times)
                    ratio = statistics.median(a / b for a, b in zip(times, timings["cic"].times))
                    cells = [n, layout, order, label, n**3 / t / 1e6, ratio]
                    if args.reference:
                        ref = cases(n, x, order, device, True, args.mesh_layouts)[index][1]
                        t_ref = timed(ref, device, args.repeats, budget=args.budget).median
                        cells += [n**3 / t_ref / 1e6, t_ref / t]
                    table.print_row(*cells)
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
