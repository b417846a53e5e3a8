"""Command line: ``python -m torchpm run [config.toml]``.

Runs one simulation (default: 64^3 particles on a 128^3 mesh in a 256 Mpc/h box,
Planck15, 2LPT at a = 0.1, 10 FastPM steps to a = 1), shows a progress bar over
the steps, and writes to the output folder (default ``out/``):

* ``power_spectrum.txt``: k [h/Mpc], P(k) [(Mpc/h)^3] (CIC-compensated, shot noise
  subtracted), the number of modes, and the linear P(k) at the final a;
* ``power_spectrum.png``: P(k) against linear theory, and a slice of the density.

A TOML config may set any of these keys (units as in :class:`torchpm.Simulation`)::

    n_particles = 64          # per side, or [nx, ny, nz]
    box_size = 256.0          # Mpc/h
    mesh_factor = 2
    a_start = 0.1
    a_end = 1.0
    steps = 10                # or a list of scale factors
    lpt_order = 2
    integrator = "fastpm"     # or "leapfrog"
    gradient = "fd4"          # or "exact"
    laplacian = "exact"       # or "fd"
    cic_compensation = false
    power_spectrum = "eisenstein_hu"   # or "eisenstein_hu_nowiggle" or a table path
    cosmology = "Planck15"    # or "Planck18", or a table {Omega_c = ..., Omega_b = ..., ...}
    seed = 0
    batch = 1
    dtype = "float32"
    device = "cpu"
    threads = 0               # torch.set_num_threads; 0 leaves torch's default
    output = "out"
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

DEFAULTS = dict(
    n_particles=64,
    box_size=256.0,
    mesh_factor=2,
    a_start=0.1,
    a_end=1.0,
    steps=10,
    lpt_order=2,
    integrator="fastpm",
    gradient="fd4",
    laplacian="exact",
    cic_compensation=False,
    power_spectrum="eisenstein_hu",
    cosmology="Planck15",
    seed=0,
    batch=1,
    dtype="float32",
    device="cpu",
    threads=0,
    output="out",
)


def load_config(path: str | None) -> dict:
    """Defaults updated by the TOML file at ``path``; unknown keys are an error."""
    config = dict(DEFAULTS)
    if path is None:
        return config
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise SystemExit("torchpm run: reading a config needs Python >= 3.11 or `pip install tomli`") from None

    try:
        with open(path, "rb") as handle:
            user = tomllib.load(handle)
    except FileNotFoundError:
        raise SystemExit(f"torchpm run: config file {path!r} not found") from None
    except tomllib.TOMLDecodeError as error:
        raise SystemExit(f"torchpm run: {path!r} is not valid TOML: {error}") from None
    unknown = sorted(set(user) - set(DEFAULTS))
    if unknown:
        raise SystemExit(f"torchpm run: unknown keys {unknown} in {path!r}; known keys: {sorted(DEFAULTS)}")
    config.update(user)
    return config


def make_cosmology(value):
    import torchpm

    if isinstance(value, dict):
        return torchpm.Cosmology(**value)
    presets = {"planck15": torchpm.Planck15, "planck18": torchpm.Planck18}
    if str(value).lower() not in presets:
        raise SystemExit(f"torchpm run: `cosmology` must be 'Planck15', 'Planck18' or a table, got {value!r}")
    return presets[str(value).lower()]()


def run(config: dict) -> dict:
    """Run the simulation of ``config`` and write the outputs; returns a summary dict."""
    import numpy as np
    from tqdm import tqdm

    import torchpm
    from torchpm.analysis import power_spectrum

    if config["threads"]:
        torch.set_num_threads(int(config["threads"]))
    dtype = {"float32": torch.float32, "float64": torch.float64}.get(config["dtype"])
    if dtype is None:
        raise SystemExit(f"torchpm run: `dtype` must be 'float32' or 'float64', got {config['dtype']!r}")
    device = torch.device(config["device"])
    cosmology = make_cosmology(config["cosmology"])
    try:
        simulation = torchpm.Simulation(
            n_particles=config["n_particles"],
            box_size=config["box_size"],
            mesh_factor=config["mesh_factor"],
            a_start=config["a_start"],
            steps=config["steps"],
            a_end=config["a_end"],
            cosmology=cosmology,
            power_spectrum=config["power_spectrum"],
            lpt_order=config["lpt_order"],
            integrator=config["integrator"],
            gradient=config["gradient"],
            laplacian=config["laplacian"],
            cic_compensation=config["cic_compensation"],
            dtype=dtype,
        ).to(device)
    except ValueError as error:
        raise SystemExit(f"torchpm run: {error}") from None
    print(simulation, flush=True)

    noise = simulation.white_noise(batch=int(config["batch"]), seed=int(config["seed"]))
    step_times = []
    bar = tqdm(total=simulation.steps, desc="PM steps", unit="step", disable=simulation.steps == 0)
    marks = {}

    def callback(step, a):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        if step == 0:
            marks["lpt"] = now
        else:
            step_times.append(now - marks["last"])
            bar.update(1)
            bar.set_postfix(a=f"{a:.3f}")
        marks["last"] = now

    start = time.perf_counter()
    with torch.no_grad():
        state = simulation(noise, callback=callback)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = time.perf_counter() - start
        bar.close()
        density = simulation.density(state)

    box = simulation.box_size
    n_particles = simulation.n_total
    spectrum = power_spectrum(density[0] - 1.0, box, compensate_cic=True, n_particles=n_particles)
    growth = cosmology.growth(state.a)
    linear = simulation.linear_power(spectrum.k) * growth.D1**2

    output = config["output"]
    os.makedirs(output, exist_ok=True)
    table_path = os.path.join(output, "power_spectrum.txt")
    header = (
        f"torchpm {torchpm.__version__}: matter power spectrum at a = {state.a:.4f}\n"
        f"{simulation.particle_shape} particles, mesh {simulation.mesh_shape}, box {box} Mpc/h, "
        f"{simulation.steps} {simulation.integrator} steps from a = {simulation.a_start}, "
        f"{cosmology!r}, seed {config['seed']}\n"
        "P(k): CIC-compensated, Poisson shot noise V/N_particles subtracted\n"
        "columns: k [h/Mpc]  P(k) [(Mpc/h)^3]  modes  P_linear(k) [(Mpc/h)^3]"
    )
    np.savetxt(
        table_path,
        np.column_stack([spectrum.k.cpu(), spectrum.power.cpu(), spectrum.modes.cpu(), linear.detach().cpu()]),
        header=header,
        fmt=["%.6e", "%.6e", "%d", "%.6e"],
    )
    figure_path = os.path.join(output, "power_spectrum.png")
    plot(spectrum, linear, density[0], simulation, state.a, figure_path)

    per_step = float(np.median(step_times)) if step_times else float("nan")
    lpt_time = marks["lpt"] - start
    summary = dict(
        total_s=total, lpt_s=lpt_time, step_s=per_step, steps=simulation.steps, table=table_path, figure=figure_path
    )
    low = spectrum.k < 0.1
    ratio = float((spectrum.power[low] / linear[low]).mean()) if bool(low.any()) else float("nan")
    threads = torch.get_num_threads()
    print(
        f"torchpm run: {n_particles} particles, mesh {'x'.join(map(str, simulation.mesh_shape))}, "
        f"{simulation.steps} steps a = {simulation.a_start} -> {state.a:.3f} on {device} ({threads} threads)\n"
        f"  initial conditions (linear field + {simulation.lpt_order}LPT): {lpt_time:.2f} s\n"
        f"  time per step (median): {per_step * 1e3:.1f} ms; total {total:.2f} s\n"
        f"  density: std {float(density.std()):.3f}, max {float(density.max()):.1f}; "
        f"P/P_linear at k < 0.1 h/Mpc: {ratio:.3f}\n"
        f"  wrote {table_path} and {figure_path}",
        flush=True,
    )
    return summary


def plot(spectrum, linear, density, simulation, a, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    k = spectrum.k.cpu().numpy()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    left.loglog(k, spectrum.power.cpu().numpy(), "o-", ms=3, label=f"torchpm, a = {a:.2f}")
    left.loglog(k, linear.detach().cpu().numpy(), "k--", label="linear theory")
    left.set_xlabel("k [h/Mpc]")
    left.set_ylabel("P(k) [(Mpc/h)$^3$]")
    left.legend()
    left.set_title("matter power spectrum")
    # A slice a few cells thick: a single plane of a CIC mesh is noisy.
    thickness = max(1, density.shape[2] // 8)
    slab = density[:, :, :thickness].mean(-1).cpu().numpy()
    box = simulation.box_size
    image = right.imshow(
        np.log10(np.maximum(slab, 0.1)).T, origin="lower", extent=(0, box[0], 0, box[1]), cmap="magma"
    )
    right.set_xlabel("x [Mpc/h]")
    right.set_ylabel("y [Mpc/h]")
    right.set_title(f"log10(1 + delta), slab {thickness * simulation.cell_size[2]:.0f} Mpc/h thick")
    figure.colorbar(image, ax=right)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchpm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run a simulation and write P(k) and a figure")
    run_parser.add_argument("config", nargs="?", help="TOML config file (optional)")
    run_parser.add_argument("--output", help="output folder (overrides the config)")
    arguments = parser.parse_args(argv)
    config = load_config(arguments.config)
    if arguments.output:
        config["output"] = arguments.output
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
