"""Command line: ``python -m torchpm run [config.toml]``, ``info``, ``config-table``.

``run`` runs one simulation (default: 64^3 particles on a 128^3 mesh in a
256 Mpc/h box, Planck15, 2LPT at a = 0.1, 10 FastPM steps to a = 1), shows a
progress bar over the steps, and writes into the run's output folder (default ``out/``):

* ``config.toml``: the resolved settings of the run;
* ``power_spectrum.txt``: k [h/Mpc], P(k) [(Mpc/h)^3] (CIC-compensated; the Poisson
  shot noise V/N_particles subtracted, or kept with ``shot_noise = "keep"``, as the
  header says; a batch run: one column per member), the number of modes, and the
  linear P(k) at the final a;
* ``power_spectrum.png``: P(k) against linear theory, and a slice of the density;
* ``power_spectrum_000.txt``, ... (and ``power_multipoles_000.txt``, ...): the same
  tables at each snapshot, numbered as the snapshots;
* ``power_multipoles.txt`` (with ``redshift_space = "x" | "y" | "z"``): the multipoles
  P_0, P_2, P_4 of the final density in redshift space along that axis
  (CIC-compensated; shot noise on P_0 as in the P(k) table), the number of modes, and
  linear theory (Kaiser);
* ``correlation_function.txt`` (with ``correlation_function = true``, and
  ``correlation_function_000.txt``, ... at the snapshots): xi(r) of the density in shells
  one force-mesh cell wide up to half the box (CIC-compensated; the particles' pairs
  with themselves subtracted as the shot noise is in the P(k) table), the number of cell
  separations per shell, and linear theory (:func:`torchpm.analysis.correlation_function`);
* ``density.hdf5`` (with ``write_density = true``): the final density (mean 1) on the
  force mesh, ``(batch, nx, ny, nz)``, and with ``redshift_space`` its redshift-space
  counterpart (:func:`torchpm.io.write_fields`);
* ``snap_000.hdf5``, ...: Gadget-4 HDF5 snapshots at the scale factors listed in
  ``snapshots`` (numbered in that order; see :mod:`torchpm.io`).
* ``lensing.hdf5`` (with ``lensing_planes`` > 0): the lens planes taken in the run,
  their Born convergence maps, C_ell and linear Limber's (the planes' scale factors
  join the steps; such a run cannot ``--resume``).
* ``halos.hdf5`` and ``halos_000.hdf5``, ... (with ``halos_linking_length`` > 0): the
  friends-of-friends halo catalogue of the final state and of each snapshot's
  (:func:`torchpm.find_halos`: mass in Msun/h, centre of mass in Mpc/h, mean
  velocity in km/s, heaviest first), with M_200m, R_200m, M_200c and R_200c about
  each centre (:func:`torchpm.halos.spherical_overdensity_masses`).

The folder is created and tested for writing before the run; a folder that
already holds outputs is refused unless ``--overwrite``. ``--resume snap.hdf5``
continues a run from one of its snapshots (bit for bit on the CPU; a batch run from
any one member's ``snap_003_member0.hdf5``, the others found next to it); ``--check``
validates the config and prints the resolved settings and the memory estimate
without running. Every key, its default, unit and meaning: the README table,
generated from :data:`torchpm.config.SETTINGS` (``python -m torchpm config-table``).

User errors print one line and exit with status 2; so does an output that cannot be
written (a full disk, a quota, permissions), on every rank of a process grid, and a
missing matplotlib (the figure) or h5py (HDF5 outputs), found before the run.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import inspect
import math
import os
import re
import sys
import tempfile
import time

import torch

from .config import SETTINGS, SettingError, defaults, load_config, markdown_table

DEFAULTS = defaults()
OUTPUT_NAMES = ("config.toml", "power_spectrum.txt", "power_spectrum.png")
# Written by some runs only. With --overwrite these and OUTPUT_NAMES are removed first, so
# none is left from another run.
OPTIONAL_OUTPUTS = ("power_multipoles.txt", "correlation_function.txt", "density.hdf5", "lensing.hdf5", "halos.hdf5")


class UserError(Exception):
    """A mistake in the command line, the config or the environment: one line, exit 2."""


def make_cosmology(value, f_nl: float = 0.0):
    import torchpm

    if isinstance(value, dict):
        return torchpm.Cosmology(**value, f_nl=f_nl)
    presets = {"planck15": torchpm.Planck15, "planck18": torchpm.Planck18}
    return presets[str(value).lower()](f_nl=f_nl)


def snapshot_name(index: int, member: int, batch: int) -> str:
    return f"snap_{index:03d}.hdf5" if batch == 1 else f"snap_{index:03d}_member{member}.hdf5"


def build_simulation(config: dict):
    """The :class:`torchpm.Simulation` of a validated config (on its device)."""
    import torchpm

    dtype = {"float32": torch.float32, "float64": torch.float64}[config["dtype"]]
    options = {}
    parameters = inspect.signature(torchpm.Simulation).parameters
    # Settings another part of torchpm wires: passed once Simulation takes them.
    if "lpt_normalisation" in parameters:
        options["lpt_normalisation"] = config["lpt_normalisation"]
    elif config["lpt_normalisation"] != "fastpm":
        raise UserError(f"`lpt_normalisation` = {config['lpt_normalisation']!r} is not available in this build")
    if "paint_order" in parameters:
        options["paint_order"] = config["paint_order"]
    elif config["paint_order"] != "cic":
        raise UserError(f"`paint_order` = {config['paint_order']!r} is not available in this build (only 'cic')")
    if "grid" in parameters:
        # [] = a balanced grid over the initialised world (one device when there is none).
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if config["grid"]:
            options["grid"] = tuple(config["grid"])
        elif distributed and torch.distributed.get_world_size() > 1:
            options["grid"] = "auto"
    elif config["grid"] not in ([], [1, 1]):
        raise UserError(f"`grid` = {config['grid']} needs a distributed run, which this build does not have")
    # `collective_timeout` is for torch.distributed.init_process_group, by whoever launches the ranks.
    try:
        # A closed universe that recollapses, a dark energy that does not vanish early
        # (w0 + wa >= 0): refused here, by --check too, rather than in the run.
        cosmology = make_cosmology(config["cosmology"], config["f_nl"])
        steps = config["steps"]
        if config["lensing_planes"]:
            steps = lensing_steps(config, lens_planes(config, cosmology))
        simulation = torchpm.Simulation(
            n_particles=config["n_particles"],
            box_size=config["box_size"],
            mesh_factor=config["mesh_factor"],
            a_start=config["a_start"],
            steps=steps,
            a_end=config["a_end"],
            cosmology=cosmology,
            power_spectrum=config["power_spectrum"],
            lpt_order=config["lpt_order"],
            integrator=config["integrator"],
            gradient=config["gradient"],
            laplacian=config["laplacian"],
            cic_compensation=config["cic_compensation"],
            window_compensation=config["window_compensation"],
            sort_every=config["sort_every"],
            primordial_kmax=config["primordial_kmax"],
            dtype=dtype,
            # Checked below on the run's device with the run's batch, not on the CPU with batch 1.
            memory_check="off",
            **options,
        )
    except (ValueError, TypeError, MemoryError) as error:
        raise UserError(str(error)) from None
    try:
        simulation.growth_table()  # (cached for the run)
    except (ValueError, TypeError) as error:  # the physics refuses the cosmology
        raise UserError(f"`cosmology`: {error}") from None
    device = torch.device(config["device"])
    simulation.memory_check = config["memory_check"]
    try:
        simulation._check_memory(device, config["batch"])
    except MemoryError as error:
        raise UserError(str(error)) from None
    return simulation.to(device)


def lens_planes(config: dict, cosmology):
    """The lens planes of a config with ``lensing_planes`` > 0 (in its cosmology)."""
    from torchpm import lensing

    return lensing.lens_planes(cosmology, config["box_size"], config["lensing_planes"], axis=config["lensing_axis"])


def lensing_steps(config: dict, planes) -> list[float]:
    """The configured steps (after ``a_start``) with the planes' scale factors among them:
    a step end closer than a quarter of its step to a plane is dropped, unless a snapshot
    or ``a_end`` is there. UserError when the run does not cover the planes."""
    from torchpm.config import as_steps

    grid = as_steps(config["steps"], config["a_start"], config["a_end"])
    far, near = min(planes.scale_factors), max(planes.scale_factors)
    depth = max(d + 0.5 * w for d, w in zip(planes.distances, planes.widths))
    if not grid[0] < far:
        raise UserError(f"`lensing_planes`: the farthest plane ({depth:.6g} Mpc/h away) is taken at a = {far:.6g}, "
                        f"not after a_start = {grid[0]}: start earlier or use a shorter box along `lensing_axis`")
    if grid[-1] < near * (1 - 1e-12):
        raise UserError(f"`lensing_planes`: the nearest plane is taken at a = {near:.6g}, after the run's end "
                        f"(a = {grid[-1]}): the run must reach it (`a_end`, `steps`)")
    kept = {grid[-1], *config["snapshots"]}
    merged = set(planes.scale_factors)
    for before, a in zip(grid, grid[1:]):
        if any(abs(a - k) <= 1e-9 * k for k in kept) or min(abs(a - p) for p in planes.scale_factors) > 0.25 * (a - before):
            merged.add(a)
    return sorted(merged)


_SNAPSHOT_FILE = re.compile(r"^snap_(?P<index>\d{3,})(_member\d+)?(\.\d+)?\.hdf5$")
# The spectra written at each snapshot (numbered as the snapshots).
_SNAPSHOT_TABLE = re.compile(r"^(power_spectrum|power_multipoles|correlation_function)_(?P<index>\d{3,})\.txt$|"
                             r"^halos_(?P<halos>\d{3,})\.hdf5$")


def prepare_output(folder: str, overwrite: bool, keep: frozenset = frozenset()) -> None:
    """Create ``folder``, prove it writable, and refuse to replace outputs without ``overwrite``.

    With ``overwrite`` the previous run's snapshots and the spectra written with them are
    removed (a snapshot this run does not write would otherwise stay beside this run's
    outputs, and ``--resume`` from it would continue the other run), and so are the
    optional outputs, except the snapshots numbered in ``keep``: the history up to
    the snapshot a run resumes from in this folder, which it does not rewrite (its
    ``--resume`` checked that the snapshot is of this run)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"output {folder!r} exists and is not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create the output folder {folder!r}: {error.strerror}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".torchpm-write-test-"):
            pass
    except OSError as error:
        raise UserError(f"output folder {folder!r} is not writable: {error.strerror}") from None
    existing = [name for name in OUTPUT_NAMES + OPTIONAL_OUTPUTS if os.path.exists(os.path.join(folder, name))]
    snapshots = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "snap_*.hdf5")))
    patterns = ("power_*_*.txt", "correlation_function_*.txt", "halos_*.hdf5")
    snapshots += sorted(name for name in (os.path.basename(p) for pattern in patterns
                                          for p in glob.glob(os.path.join(folder, pattern)))
                        if _SNAPSHOT_TABLE.match(name))
    existing += snapshots
    if existing and not overwrite:
        shown = ", ".join(existing[:4]) + (", ..." if len(existing) > 4 else "")
        raise UserError(
            f"output folder {folder!r} already holds outputs ({shown}); choose another folder "
            "(--output) or pass --overwrite to replace them"
        )
    if overwrite:
        # Every earlier output, the tables this run writes at its end too: a run that fails
        # must not leave the earlier run's P(k) beside its own config.toml.
        for name in OUTPUT_NAMES + OPTIONAL_OUTPUTS:
            try:
                os.remove(os.path.join(folder, name))
            except FileNotFoundError:
                pass
            except OSError as error:
                raise UserError(f"--overwrite: cannot remove the earlier run's {os.path.join(folder, name)!r}: "
                                f"{error.strerror}") from None
        for name in snapshots:
            match = _SNAPSHOT_FILE.match(name) or _SNAPSHOT_TABLE.match(name)
            if match and int(match["index"] or match["halos"]) not in keep:
                try:
                    os.remove(os.path.join(folder, name))
                except OSError as error:
                    raise UserError(f"--overwrite: cannot remove the earlier run's output "
                                    f"{os.path.join(folder, name)!r}: {error.strerror}") from None


_MEMBER_NAME = re.compile(r"^(?P<head>.*_member)(?P<member>\d+)(?P<tail>(\.\d+)?(\.hdf5)?)$")


def member_snapshots(path: str, batch: int) -> list[str]:
    """The snapshot of every batch member, from the name of any one of them: a batch run
    writes ``snap_003_member0.hdf5``, ``snap_003_member1.hdf5``, ... (multi-file sets
    ``snap_003_member0.0.hdf5``, ...); one simulation ``snap_003.hdf5``."""
    if batch == 1:
        return [path]
    folder, name = os.path.split(path)
    match = _MEMBER_NAME.match(name)
    if match is None:
        raise UserError(
            f"--resume {path!r}: a run with batch = {batch} resumes from one member's snapshot, named like "
            "snap_003_member0.hdf5 (the others are found next to it)"
        )
    return [os.path.join(folder, f"{match['head']}{member}{match['tail']}") for member in range(batch)]


def stack_members(states, padding_position):
    """One batch ``SimulationState`` from the batch-of-1 states of its members (same
    ``a``): members holding fewer slots are padded with empty slots (id -1, zero
    momentum, next to their neighbours as a migration leaves them)."""
    from .io import _in_slots

    if len({float(state.a) for state in states}) != 1:
        raise ValueError("the members' snapshots are at different scale factors: "
                         + ", ".join(str(state.a) for state in states))
    count = max(state.ids.shape[1] for state in states)
    members = [_in_slots(state.positions[0], state.momenta[0], state.ids[0],
                        torch.arange(state.ids.shape[1]), count, padding_position) for state in states]
    positions, momenta, ids = (torch.stack(parts) for parts in zip(*members))
    return type(states[0])(positions, momenta, states[0].a, ids)


def _read_for_resume(path, context, read_snapshot):
    """The snapshot for this rank: the whole of it on one process; on a process grid the
    rank's own file when the set has one file per rank (same order as the run: bit-exact),
    else a contiguous share (the particles then migrate to their owners)."""
    if context.world_size == 1:
        return read_snapshot(path)
    from .io import _resolve_files

    if len(_resolve_files(path)) == context.world_size:
        return read_snapshot(path, file_index=context.rank)
    return read_snapshot(path, share=(context.rank, context.world_size))


def describe(config: dict, simulation) -> str:
    """The resolved settings (TOML) and the memory estimate, for ``run --check``."""
    from .io import to_toml
    from .resources import available_memory

    estimate = simulation.memory_estimate(config["batch"])
    available = available_memory(config["device"])
    grid = simulation.scale_factors
    lines = ["# resolved settings", to_toml(config).rstrip(), "", "# run"]
    lines.append(f"# particles {simulation.particle_shape} = {simulation.n_total}, force mesh {simulation.mesh_shape}")
    lines.append(f"# {simulation.steps} steps, a = {grid[0]:.6g} -> {grid[-1]:.6g}")
    process_grid = simulation.force_mesh.grid_shape
    ranks = process_grid[0] * process_grid[1]
    if ranks > 1:
        lines.append(f"# process grid {process_grid[0]} x {process_grid[1]} ({ranks} ranks)")
    lines.append(f"# memory estimate{' per rank' if ranks > 1 else ''}: {estimate.describe()}")
    if available is not None:
        lines.append(f"# available on {config['device']}{' (rank 0)' if ranks > 1 else ''}: "
                     f"{available / 2**30:.2f} GiB")
    return "\n".join(lines)


def run(config: dict, *, overwrite: bool = False, resume: str | None = None, check: bool = False) -> dict:
    """Run the simulation of ``config`` and write the outputs; returns a summary dict.

    Raises :class:`UserError` for every mistake found before the run starts.
    """
    import torchpm
    from torchpm.analysis import power_spectrum
    from torchpm.distributed.launch import finish, gather_blocks, init_from_environment
    from torchpm.io import read_snapshot, restart_state, scale_factor_index, to_toml, write_fields, write_snapshot

    # Under torchrun (WORLD_SIZE > 1): join the process group; `grid = []` then means a
    # balanced grid over the ranks. Rank 0 prints and writes the shared outputs.
    try:
        context = init_from_environment(config["device"], config["collective_timeout"])
    except ValueError as error:
        raise UserError(str(error)) from None
    try:
        summary = _run(config, context, overwrite, resume, check, torchpm, power_spectrum, gather_blocks,
                       read_snapshot, restart_state, scale_factor_index, to_toml, write_snapshot, write_fields)
        # On CUDA bad particles are reported by the next torchpm op; after the last
        # one, only torchpm.check() can (torchpm.ops.error_checking).
        torchpm.check()
        return summary
    finally:
        finish(context)


def _agree(context, error: str | None) -> None:
    """Raise UserError on every rank when rank 0 found ``error`` (the others wait for its word)."""
    if context.world_size > 1:
        import torch.distributed as dist

        message = [error]
        dist.broadcast_object_list(message, src=0)
        error = message[0]
    if error:
        raise UserError(error)


# The settings that made a snapshot's particles before it was written, beyond those
# torchpm.io.check_restart compares with the simulation (box, mesh, cosmology, ...).
_HISTORY = ("seed", "fixed_amplitude", "paired", "a_start", "lpt_order", "lpt_normalisation", "power_spectrum",
            "primordial_kmax")
# Keys of _HISTORY added after snapshots were first written: a config written by the CLI
# (it records `seed`) without one of them was written by a run at its default.
_HISTORY_DEFAULTS = {"fixed_amplitude": False, "paired": False, "primordial_kmax": 0.0}


def _check_history(written: dict, config: dict) -> None:
    """ValueError naming each of :data:`_HISTORY` in which the run that wrote a snapshot
    (its stored config ``written``) differs from ``config``: resuming it would continue
    another run under this one's name. A power spectrum is compared by its built-in
    name; a table file is not compared (a path may name one table in two ways). A key of
    :data:`_HISTORY_DEFAULTS` missing from a CLI run's config (one with ``seed``) counts
    as its default: the snapshot was written before the key existed."""
    from .cosmology import _BUILTIN_POWER, builtin_power_name

    if "seed" in written:
        written = {**_HISTORY_DEFAULTS, **written}

    def differs(key):
        if key not in written:
            return False
        if key == "power_spectrum":
            names = [builtin_power_name(value) if isinstance(value, str) else None
                     for value in (written[key], config[key])]
            return all(name in _BUILTIN_POWER.values() for name in names) and names[0] != names[1]
        return written[key] != config[key]

    differences = [f"{key} {written[key]!r} (this configuration: {config[key]!r})" for key in _HISTORY if differs(key)]
    if differences:
        raise ValueError("it was written by a run with " + ", ".join(differences)
                         + "; resume with the configuration of the run that wrote it")


def _resume_state(resume, batch, context, simulation, read_snapshot, restart_state, config):
    """This rank's state to resume from (every batch member's snapshot); UserError naming
    the file that cannot be resumed from."""
    states = []
    for member, path in enumerate(member_snapshots(resume, batch)):
        try:
            snapshot = _read_for_resume(path, context, read_snapshot)
            if batch > 1 and int(snapshot.attributes.get("member", member)) != member:
                raise ValueError(f"it holds batch member {snapshot.attributes['member']}, not {member}")
            _check_history(snapshot.config, config)
            states.append(restart_state(snapshot, simulation))
        except (OSError, ValueError, KeyError) as error:
            raise UserError(f"cannot resume from {path!r}: {error}") from None
    try:
        return stack_members(states, simulation.force_mesh.padding_position)
    except ValueError as error:
        raise UserError(f"cannot resume from {resume!r}: {error}") from None


def _kept_history(resume, output, snapshots, start_state) -> frozenset:
    """The snapshot numbers an ``--overwrite`` run keeps in ``output``: when it resumes from a
    snapshot in that folder, those at or before the resumed scale factor (its history, which
    it does not rewrite); otherwise none."""
    if resume is None or start_state is None:
        return frozenset()
    try:
        same = os.path.samefile(os.path.dirname(os.path.abspath(resume)), output)
    except OSError:
        same = False
    return frozenset(index for index, a in enumerate(snapshots) if same and a <= start_state.a)


def _run(config, context, overwrite, resume, check, torchpm, power_spectrum, gather_blocks,
         read_snapshot, restart_state, scale_factor_index, to_toml, write_snapshot, write_fields):
    import numpy as np

    main_rank = context.is_main
    # Every rank reads its own config: the ranks agree on every key before the run
    # (a rank with another seed would paint its block of another field).
    # (not the device, which the CLI sets per rank on CUDA, nor the rank's threads or its
    # collective timeout)
    from .io import PER_RANK_SETTINGS

    agreed = [(f"`{key}`", repr(config[key])) for key in sorted(config) if key not in PER_RANK_SETTINGS]
    if context.device.type == "cuda":
        config = dict(config, device=str(context.device))
    simulation = build_simulation(config)
    try:
        simulation.force_mesh.agree("the configuration check (every rank reads its own config)", agreed)
    except ValueError as error:
        raise UserError(str(error)) from None
    device = simulation.device
    batch = config["batch"]
    snapshots = [simulation.scale_factors[scale_factor_index(simulation, a)] for a in config["snapshots"]]
    for key, used in (("snapshots", snapshots), ("halos_linking_length", config["halos_linking_length"]),
                      ("write_density", config["write_density"]), ("lensing_planes", config["lensing_planes"])):
        if used and importlib.util.find_spec("h5py") is None:
            raise UserError(f"`{key}` needs h5py (its outputs are HDF5 files): pip install h5py")
    # Rank 0 draws the figure after the run: without matplotlib the run stops before it
    # starts, not at its end (on every rank together: the others do not draw).
    # So does the progress bar without tqdm (every rank draws one).
    uses = {"tqdm": "the progress bar", "matplotlib": "the figure power_spectrum.png"}
    missing = [package for package, needed in (("tqdm", True), ("matplotlib", main_rank))
               if needed and importlib.util.find_spec(package) is None]
    simulation.force_mesh.raise_together(
        "the run needs " + " and ".join(f"{package} ({uses[package]})" for package in missing)
        + f": pip install {' '.join(missing)}" if missing else None, UserError, operation="torchpm run: packages")
    if config["halos_linking_length"]:
        # (friends_of_friends' own limit, checked before the run rather than at its end)
        from torchpm.halos import linking_distance

        b = linking_distance(simulation.box_size, simulation.n_total, config["halos_linking_length"])
        if 3 * b > min(simulation.box_size) * (1 + 1e-12):
            raise UserError(
                f"`halos_linking_length` = {config['halos_linking_length']:g} links within {b:.6g} Mpc/h, more than a "
                f"third of the shortest box side ({min(simulation.box_size) / 3:.6g} Mpc/h), which the halo finder's "
                "cells need: use a smaller linking length, or more particles or a longer shortest side")

    start_state = None
    if resume is not None and config["lensing_planes"]:
        # (the same config on every rank: every rank raises)
        raise UserError("--resume: a run with `lensing_planes` > 0 cannot resume, the planes taken before the "
                        "snapshot are not kept; run it from the start")
    if resume is not None:
        problem = None
        try:
            start_state = _resume_state(resume, batch, context, simulation, read_snapshot, restart_state, config)
        except UserError as error:
            problem = str(error)
        # Each rank reads its own file: one rank's refusal is raised by every rank (before
        # the output folder is touched), not by that rank alone with the others waiting.
        simulation.force_mesh.raise_together(problem, UserError, operation="torchpm run --resume")
    if check:
        if main_rank:
            print(describe(config, simulation), flush=True)
            if start_state is not None:
                print(f"# resumes from {resume} at a = {start_state.a:.6g}", flush=True)
        return {}

    output = config["output"]
    problem = None
    if main_rank:
        try:
            prepare_output(output, overwrite, _kept_history(resume, output, snapshots, start_state))
            config_path = os.path.join(output, "config.toml")
            with _writing(config_path), open(config_path, "w", encoding="utf-8") as handle:
                handle.write(to_toml(config))
        except UserError as error:
            problem = str(error)
    _agree(context, problem)
    if config["threads"]:
        torch.set_num_threads(config["threads"])
    if main_rank:
        print(simulation, flush=True)

    from tqdm import tqdm

    step_times = []
    first = 0 if start_state is None else scale_factor_index(simulation, start_state.a)
    bar = tqdm(total=simulation.steps - first, desc="PM steps", unit="step",
               disable=simulation.steps == first or not main_rank)
    marks = {}

    def callback(step, a):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        if step == 0:
            marks["lpt"] = now
        else:
            if "last" in marks:
                step_times.append(now - marks["last"])
            bar.update(1)
            bar.set_postfix(a=f"{a:.3f}")
        marks["last"] = now

    written, written_tables = [], []
    tables = _Tables(simulation, config, output, resume, power_spectrum)
    start = time.perf_counter()
    marks["last"] = start
    with torch.no_grad():
        # One run that writes each snapshot as it passes its scale factor (no force is
        # evaluated twice; each state is the one a run stopped there returns, bit for
        # bit). Snapshots reached already (or the one resumed from) are not rewritten.
        final = simulation.scale_factors[-1]
        due = {scale_factor_index(simulation, a): index for index, a in enumerate(snapshots)
               if start_state is None or scale_factor_index(simulation, a) > first}
        taker = _plane_taker(config, simulation)
        at = sorted({*(simulation.scale_factors[step] for step in due), final, *(taker.at if taker else ())})

        def observe(state):
            if taker is not None:
                taker.take(state)  # the lens planes at their scale factors (collective)
            index = due.get(scale_factor_index(simulation, state.a))
            if index is not None:
                # A write that fails (a full disk, a quota, permissions) is a UserError raised
                # on every rank together (the trajectory raises it again as its RuntimeError:
                # unwrapped below).
                for member in range(batch):
                    path = os.path.join(output, snapshot_name(index, member, batch))
                    _write_snapshot_together(write_snapshot, path, state, simulation, member=member,
                                             config=config, overwrite=overwrite)
                    written.append(path)
                # The spectra at the snapshot too (collective; rank 0 writes them).
                _, _, snapshot_spectra, snapshot_multipoles = tables.measure(state)
                problem = None
                if main_rank:
                    try:
                        written_tables.extend(
                            tables.write(f"_{index:03d}", state.a, snapshot_spectra, snapshot_multipoles)[:2])
                        written_tables.append(tables.correlation_path)
                    except UserError as error:  # (a table that cannot be written)
                        problem = str(error)
                simulation.force_mesh.raise_together(problem, UserError,
                                                     operation="torchpm run: the snapshot's P(k) tables")
                if config["halos_linking_length"]:  # (collective)
                    written_tables.append(_halos(simulation, state, config, output, f"_{index:03d}", main_rank)[0])
            return state if state.a == final else None

        # A ValueError from the CLI's own code in the run (the observer, the progress
        # callback) is a defect, shown with its traceback; not a setting the run refused.
        failed_in = []

        def guarded(function):
            def call(*args):
                try:
                    return function(*args)
                except ValueError:
                    failed_in.append(function.__name__)
                    raise
            return call

        observe, callback = guarded(observe), guarded(callback)
        try:
            if start_state is None:
                noise = simulation.white_noise(batch=batch, seed=config["seed"],
                                               fixed_amplitude=config["fixed_amplitude"], paired=config["paired"])
                state = simulation.trajectory(noise, at=at, observe=observe, callback=callback,
                                              return_mesh_units=True)[-1]
            else:
                state = simulation.trajectory(state=start_state, mesh_units=True,
                                              at=[a for a in at if scale_factor_index(simulation, a) >= first],
                                              observe=observe, callback=callback, return_mesh_units=True)[-1]
        except RuntimeError as error:
            # On a grid the trajectory raises what `observe` raised as a RuntimeError naming
            # it on every rank. The observer's own UserErrors are raised on every rank
            # together (so each rank's RuntimeError comes from one): the same one line as
            # on one process, not a traceback on every rank.
            if isinstance(error.__cause__, UserError):
                raise error.__cause__ from None
            raise
        except ValueError as error:
            # What the run itself refuses (raised on every rank together), e.g. initial
            # conditions that are not finite (a power table in the wrong units, sigma8 =
            # 1e20): one line and status 2, as a wrong setting found before the run.
            if failed_in:
                raise
            raise UserError(str(error)) from None
        finally:
            bar.close()  # (the error's line below the bar, not after it)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = time.perf_counter() - start
        # this rank's block of the force mesh (and of the redshift-space density), the spectra
        density, density_rsd, spectra, multipoles = tables.measure(state)

    box = simulation.box_size
    n_particles = simulation.n_total
    mesh = simulation.force_mesh
    axis = config["redshift_space"]
    spectrum = spectra[0]
    # Statistics of the whole mesh, and a slab a few cells thick for the figure (z is whole on every rank).
    sums = torch.stack([density.sum(), (density**2).sum()]).to(torch.float64)
    sums = mesh.all_reduce(sums)
    count = density.shape[0] * math.prod(simulation.mesh_shape)
    density_std = float(torch.sqrt(sums[1] / count - (sums[0] / count) ** 2))
    density_max = float(mesh.all_reduce(density.max().reshape(1), "max")[0])
    thickness = max(1, simulation.mesh_shape[2] // 8)
    slab = gather_blocks(density[0, :, :, :thickness].mean(-1), mesh.local_real_offset[:2],
                         simulation.mesh_shape[:2], mesh)
    summary = dict(steps=simulation.steps, snapshots=written)
    halos = None
    if config["halos_linking_length"]:  # (collective; rank 0 writes)
        with torch.no_grad():
            halos = _halos(simulation, state, config, output, "", main_rank)
    if config["write_density"]:
        # Collective on a grid: every rank writes its block of the file in turn.
        fields = {"density": density} if density_rsd is None else {"density": density,
                                                                   f"density_redshift_space_{axis}": density_rsd}
        density_path = os.path.join(output, "density.hdf5")
        _write_fields_together(
            write_fields, density_path, fields, box, mesh, a=state.a, overwrite=True, attributes=dict(
                content="density (mean 1) on the force mesh, CIC-painted" + (
                    f"; density_redshift_space_{axis}: the particles moved to redshift space along {axis}"
                    if density_rsd is not None else ""), seed=config["seed"]))
        summary["density"] = density_path
    # Rank 0 writes the tables, the figure and the lens planes' file; one that cannot be
    # written (a full disk, a quota, permissions) is the UserError of every rank, raised
    # together (the other ranks wait for rank 0's word rather than exit before it).
    problem, lensing_line, unexpected = None, "", None
    if main_rank:
        try:
            table_path, multipoles_path, linear, kaiser = tables.write("", state.a, spectra, multipoles)
            figure_path = os.path.join(output, "power_spectrum.png")
            with _writing(figure_path):
                plot(spectrum, linear, slab, thickness, simulation, state.a, figure_path,
                     shot_noise=config["shot_noise"])
            if taker is not None:
                summary["lensing"], lensing_line = _lensing_outputs(taker, simulation, config, output, main_rank)
        except UserError as error:
            problem = str(error)
        except Exception as error:  # noqa: BLE001 - any other failure: raised below, after the others learn of it
            if mesh.is_local:
                raise
            unexpected = error
    mesh.raise_together(problem, UserError, operation="torchpm run: the final outputs")
    if not mesh.is_local:
        # Any other exception of rank 0's (a defect, not a write) stops the other ranks now, as a
        # RuntimeError naming it, instead of leaving them to the collective timeout; rank 0
        # raises it chained to its own traceback.
        try:
            mesh.raise_together(None if unexpected is None else f"{type(unexpected).__name__}: {unexpected}",
                                RuntimeError, operation="torchpm run: rank 0's final outputs")
        except RuntimeError as failure:
            if unexpected is not None:
                raise failure from unexpected
            raise
    if not main_rank:
        return summary

    kaiser_line = ""
    if multipoles is not None:
        summary["multipoles"] = multipoles_path
        low = multipoles[0].k < 0.1
        label = "k < 0.1 h/Mpc"
        if not bool(low.any()):
            low = multipoles[0].k <= multipoles[0].k.min()
            label = f"its lowest k, {float(multipoles[0].k.min()):.3g} h/Mpc"
        measured = float((multipoles[0].power[1][low] / multipoles[0].power[0][low]).mean())
        kaiser_line = (f"  redshift space along {axis}: P_2/P_0 at {label}: {measured:.3f} "
                       f"(linear Kaiser {kaiser[1] / kaiser[0]:.3f})\n")
    summary["snapshot_tables"] = [path for path in written_tables if path is not None]
    correlation_line = ""
    if tables.correlation_path is not None:
        summary["correlation"] = tables.correlation_path
        xi = tables.correlations[0]
        near = int(torch.argmin((xi.r - 8.0).abs()))
        linear_xi = float(tables.correlation_linear[near])
        correlation_line = (f"  correlation function: xi = {float(xi.xi[near]):.4g} at r = {float(xi.r[near]):.3g} "
                            f"Mpc/h (linear {linear_xi:.4g})\n")
    halos_line = ""
    if halos is not None:
        summary["halos"], halos_line = halos

    per_step = float(np.median(step_times)) if step_times else float("nan")
    lpt_time = marks["lpt"] - start if "lpt" in marks else 0.0
    summary.update(total_s=total, lpt_s=lpt_time, step_s=per_step, table=table_path, figure=figure_path)
    low = spectrum.k < 0.1
    if bool(low.any()):
        ratio_label = "k < 0.1 h/Mpc"
    else:  # a box under 2 pi / 0.1 = 63 Mpc/h: its largest scale instead
        low = spectrum.k <= spectrum.k.min()
        ratio_label = f"its lowest k, {float(spectrum.k.min()):.3g} h/Mpc (no mode below 0.1 in this box)"
    ratio = float((spectrum.power[low] / linear[low]).mean())
    threads = torch.get_num_threads()
    print(
        f"torchpm run: {n_particles} particles, mesh {'x'.join(map(str, simulation.mesh_shape))}, "
        f"{simulation.steps} steps a = {simulation.a_start} -> {state.a:.3f} on {device} ({threads} threads"
        + (f", {context.world_size} ranks" if context.world_size > 1 else "") + ")\n"
        + (f"  resumed from {resume} at a = {start_state.a:.4g}\n" if start_state is not None else
           f"  initial conditions (linear field + {simulation.lpt_order}LPT): {lpt_time:.2f} s\n")
        + f"  time per step (median): {per_step * 1e3:.1f} ms; total {total:.2f} s\n"
        f"  density: std {density_std:.3f}, max {density_max:.1f}; "
        f"P/P_linear at {ratio_label}: {ratio:.3f}\n"
        + kaiser_line
        + correlation_line
        + lensing_line
        + halos_line
        + f"  wrote {table_path} and {figure_path}"
        + "".join(f", {summary[key]}" for key in ("multipoles", "correlation", "density", "lensing", "halos")
                  if key in summary)
        + (f" and {len(written)} snapshot(s)" if written else ""),
        flush=True,
    )
    return summary


def _cannot_write(path, error: OSError) -> str:
    """The one line of an output that could not be written."""
    return f"cannot write {os.fspath(path)!r}: {error.strerror or error}"


@contextlib.contextmanager
def _writing(path):
    """An OSError while writing ``path`` (a full disk, a quota, permissions) as the
    UserError naming it (on a grid: of the rank writing it; raise it together)."""
    try:
        yield
    except OSError as error:
        raise UserError(_cannot_write(path, error)) from None


def _write_fields_together(write_fields, path, fields, box, mesh, **options):
    """``write_fields(path, fields, box, mesh=mesh, ...)`` (collective on a grid: the ranks
    write their blocks in turn, and one rank's failure is an OSError on every rank). An
    OSError is a UserError on every rank naming the file (and, on a grid, the rank that
    failed) and what the failing write raised: its errno's text where it has one."""
    try:
        write_fields(path, fields, box, mesh=mesh, **options)
        return
    except OSError as error:
        text = str(error)
    # write_fields names the rank whose write failed: "rank R could not write 'path': KIND:
    # MESSAGE" (on a grid inside the error every rank raises together): that rank names it here.
    rank = 0 if mesh.is_local else mesh.grid.rank
    head = f"rank {rank} could not write {path!r}: "
    problem = None
    if head in text:
        reason = re.sub(r" \[every rank of the .* grid raises this error together\]$", "", text.split(head, 1)[1])
        number = re.match(r"\w+: \[Errno (\d+)\]", reason)
        problem = f"cannot write {path!r}: {os.strerror(int(number[1])) if number else reason}"
    elif rank == 0 and not re.search(r"rank \d+ could not write ", text):
        problem = f"cannot write {path!r}: {text}"  # (not a rank's write: rank 0 names it)
    mesh.raise_together(problem, UserError, operation="torchpm run: density.hdf5")
    raise UserError(f"cannot write {path!r}: {text}")  # (no rank named itself: the same on every rank)


def _write_snapshot_together(write_snapshot, path, state, simulation, **options):
    """``write_snapshot(path, ...)`` (collective on a grid: each rank writes its file of the
    set). An OSError on any rank (a full disk, a quota, permissions) is a UserError on
    every rank naming the file that failed (and, on a grid, its rank): the other ranks'
    write_snapshot only knows that another rank failed."""
    from torchpm.io import snapshot_files

    mesh = simulation.force_mesh
    own = path if mesh.is_local else snapshot_files(path, mesh.grid.size)[mesh.grid.rank]
    problem, other = None, None
    try:
        write_snapshot(path, state, simulation, mesh_units=True, **options)
    except OSError as error:
        problem = _cannot_write(own, error)
    except RuntimeError as error:  # ("another rank failed to write its file": named by that rank below)
        other = error
    try:
        mesh.raise_together(problem, UserError, operation="torchpm run: the snapshot")
    except RuntimeError as failure:  # (the exchange itself failed: a lost peer)
        raise failure from other
    if other is not None:
        raise other


def _halos(simulation, state, config, output, suffix, main_rank):
    """The friends-of-friends halos of ``state`` (collective on a grid: every rank finds
    the whole catalogue), written by rank 0 to ``halos{suffix}.hdf5``. Returns the path
    (None on the other ranks) and a line for the run's report."""
    from torchpm.halos import find_halos, simulation_particle_mass, spherical_overdensity_masses

    length, least = config["halos_linking_length"], config["halos_min_members"]
    catalog = find_halos(simulation, state, linking_length=length, min_members=least)
    overdensity = {name: spherical_overdensity_masses(simulation, state, catalog, delta=200.0, reference=reference)
                   for name, reference in (("200m", "mean"), ("200c", "critical"))}
    found = (catalog.labels >= 0).sum(1).tolist()
    heaviest = catalog.masses[:, 0].tolist() if catalog.masses.shape[1] else [0.0] * len(found)
    particle_mass = float(simulation_particle_mass(simulation))
    line = (f"  halos (friends-of-friends, b = {length:g} mean separations, >= {least} particles): "
            f"{', '.join(map(str, found))} found" + (" (per batch member)" if len(found) > 1 else "")
            + (f"; heaviest {max(heaviest):.3e} Msun/h" if max(found) else "") + "\n")
    path, problem = None, None
    if main_rank:
        path = os.path.join(output, f"halos{suffix}.hdf5")
        try:
            _write_halos(path, catalog, overdensity, simulation, config, state.a, particle_mass)
        except OSError as error:  # (disk full, quota, permissions: the other ranks must not wait)
            problem = _cannot_write(path, error)
    simulation.force_mesh.raise_together(problem, UserError, operation="torchpm run: the halo catalogue")
    return path, line


def _write_halos(path, catalog, overdensity, simulation, config, a, particle_mass):
    """The catalogue of :func:`_halos` as HDF5 (rank 0), with the spherical-overdensity
    masses and radii ``overdensity`` (``{"200m": ..., "200c": ...}``) about its centres."""
    import h5py
    import numpy as np

    from torchpm.halos import linking_distance

    length = config["halos_linking_length"]
    with h5py.File(path, "w") as handle:
        handle.attrs["content"] = (
            "friends-of-friends halos (torchpm.find_halos) of each batch member, heaviest first; rows past a "
            "member's last halo are padding (label -1, members 0); label: the smallest particle id of the halo, "
            "members: particles, mass [Msun/h], position: centre of mass [Mpc/h] in [0, box), velocity: mean "
            "peculiar velocity [km/s]; m200m, r200m and m200c, r200c: the spherical-overdensity mass [Msun/h] and "
            "comoving radius [Mpc/h] about the centre of mass, 200 times the mean matter density and the critical "
            "density at a (torchpm.halos.spherical_overdensity_masses: the outermost sphere about the centre, within "
            "twice the radius of the FoF mass at the threshold, whose mean density is at least the threshold; 0 "
            "where none is)")
        fields = [("label", catalog.labels), ("members", catalog.members), ("mass", catalog.masses),
                  ("position", catalog.positions), ("velocity", catalog.velocities)]
        for name, values in overdensity.items():
            fields += [(f"m{name}", values.masses), (f"r{name}", values.radii)]
        for name, values in fields:
            handle.create_dataset(name, data=values.detach().cpu().numpy())
        handle.attrs["a"] = float(a)
        handle.attrs["linking_length"] = length
        handle.attrs["linking_distance_mpc_h"] = linking_distance(simulation.box_size, simulation.n_total, length)
        handle.attrs["min_members"] = config["halos_min_members"]
        handle.attrs["particle_mass_msun_h"] = particle_mass
        handle.attrs["box_size"] = np.asarray(simulation.box_size, dtype=np.float64)
        handle.attrs["seed"] = config["seed"]
        handle.attrs["f_nl"] = config["f_nl"]


def _plane_taker(config, simulation):
    """The lens planes' taker of a run with ``lensing_planes`` > 0, else None."""
    if not config["lensing_planes"]:
        return None
    from torchpm.lensing import _PlaneTaker

    planes = lens_planes(config, simulation.cosmology)
    across = tuple(simulation.mesh_shape[axis] for axis in range(3) if axis != planes.axis)
    return _PlaneTaker(simulation, planes, config["lensing_resolution"] or across, simulation.paint_order)


def _lensing_outputs(taker, simulation, config, output, main_rank):
    """The Born convergence maps of the planes taken, their angular power and linear
    Limber's, written by rank 0 to ``lensing.hdf5`` (every rank computes them: the planes
    are the same everywhere). Returns the path and a line for the run's report."""
    import numpy as np

    from torchpm import lensing

    planes, cosmology = taker.lens, simulation.cosmology
    taken = taker.planes()
    depth = max(d + 0.5 * w for d, w in zip(planes.distances, planes.widths))
    sources = config["lensing_sources"]
    if not sources:  # the far end of the planes
        a_far = float(cosmology.scale_factor_at_distance(torch.tensor(depth, dtype=torch.float64)))
        sources = [1.0 / a_far - 1.0]
    field = config["lensing_field"]
    angles = lensing.angular_grid(field, config["lensing_pixels"], dtype=taken.dtype, device=taken.device)
    with torch.no_grad():
        kappa = lensing.convergence_born(taken, planes, simulation.box_size, angles, sources, cosmology)
        kappa = kappa.movedim(-1, 1)  # (B, P0, P1, sources) -> (B, sources, P0, P1)
        spectrum = lensing.angular_power_spectrum(kappa.flatten(0, 1), field)
        spectrum = spectrum._replace(power=spectrum.power.reshape(*kappa.shape[:2], -1))
        limber = torch.stack([lensing.limber_convergence_power(spectrum.ell, z, cosmology, chi_max=depth)
                              for z in sources])
    path = os.path.join(output, "lensing.hdf5")
    if main_rank:
        import h5py

        with _writing(path), h5py.File(path, "w") as handle:
            handle.attrs["content"] = ("lens planes (projected overdensity of each slab, nearest first), Born "
                                       "convergence maps of each source redshift, their angular power and linear "
                                       "Limber's; torchpm.lensing conventions")
            for name, values in (("planes", taken), ("convergence", kappa), ("ell", spectrum.ell),
                                 ("convergence_power", spectrum.power), ("ell_modes", spectrum.modes),
                                 ("limber_power", limber)):
                handle.create_dataset(name, data=values.detach().cpu().numpy())
            for name, values in (("plane_distances", planes.distances), ("plane_widths", planes.widths),
                                 ("plane_scale_factors", planes.scale_factors), ("source_redshifts", sources)):
                handle.attrs[name] = np.asarray(values, dtype=np.float64)
            handle.attrs["axis"] = "xyz"[planes.axis]
            handle.attrs["field_deg"] = field
            handle.attrs["seed"] = config["seed"]
            handle.attrs["f_nl"] = config["f_nl"]
    # C_ell / linear Limber over the first three multipole bins (the largest scales), first
    # source (a map of few pixels may have fewer bins, or none)
    bins = min(3, int(spectrum.ell.numel()))
    ratio_text = "no multipole bin (too few `lensing_pixels`)"
    if bins:
        ratio = float((spectrum.power[:, 0, :bins].mean(0) / limber[0, :bins]).mean())
        ratio_text = f"C_ell / linear Limber at ell <= {float(spectrum.ell[bins - 1]):.0f}: {ratio:.2f}"
    line = (f"  lensing: {len(planes.distances)} planes to {depth:.0f} Mpc/h along {'xyz'[planes.axis]}, "
            f"convergence rms {float(kappa[:, 0].std()):.4g} at z_s = {sources[0]:.3g}; {ratio_text}\n")
    return path, line


def _linear_power(sim, k):
    """The run's linear power at ``k``; NaN where a power table does not reach (it covers the
    particle grid's modes, which the tables' bins on the force mesh may pass)."""
    from torchpm.cosmology import PowerTable

    k = torch.as_tensor(k, dtype=torch.float64)
    if not isinstance(sim.power, PowerTable):
        return sim.linear_power(k)
    low, high = sim.power.k_range
    inside = (k >= low * (1 - 1e-9)) & (k <= high * (1 + 1e-9))
    values = sim.linear_power(k.clamp(low, high))
    return torch.where(inside.to(values.device), values, torch.full_like(values, float("nan")))


class _Tables:
    """The P(k) (and, with ``redshift_space``, multipoles) tables of a run: measured on
    every rank (collective), written by rank 0 alone, at the end (``power_spectrum.txt``)
    and at each snapshot (``power_spectrum_000.txt``, ...)."""

    def __init__(self, simulation, config, output, resume, power_spectrum):
        self.simulation, self.config, self.output, self.resume = simulation, config, output, resume
        self.power_spectrum = power_spectrum
        self.axis = config["redshift_space"]
        self.subtract = config["shot_noise"] == "subtract"
        # (the last measure's xi, and the last table written of it with its linear theory)
        self.correlations = self.correlation_path = self.correlation_linear = None

    def measure(self, state):
        """``(density, redshift-space density or None, spectra, multipoles or None)`` of a
        state (this rank's blocks; every member's spectra, one at a time: the transforms of
        the whole batch at once would raise the run's peak memory)."""
        sim, box = self.simulation, self.simulation.box_size
        noise = sim.n_total if self.subtract else None
        density = sim.density(state)
        spectra = [self.power_spectrum(density[member] - 1.0, box, compensate_cic=True, n_particles=noise,
                                       mesh=sim.force_mesh) for member in range(density.shape[0])]
        self.correlations = None
        if self.config["correlation_function"]:
            from torchpm.analysis import correlation_function

            self.correlations = [correlation_function(density[member] - 1.0, box, window="cic", n_particles=noise,
                                                      mesh=sim.force_mesh) for member in range(density.shape[0])]
        if self.axis == "none":
            return density, None, spectra, None
        from torchpm.analysis import power_multipoles

        density_rsd = sim.density(sim.redshift_space(state, axis=self.axis))
        multipoles = [power_multipoles(density_rsd[member] - 1.0, box, ells=(0, 2, 4), axis=self.axis,
                                       compensate_cic=True, n_particles=noise, mesh=sim.force_mesh)
                      for member in range(density_rsd.shape[0])]
        return density, density_rsd, spectra, multipoles

    def write(self, suffix: str, a: float, spectra, multipoles):
        """Writes ``power_spectrum{suffix}.txt`` (and ``power_multipoles{suffix}.txt``; rank 0
        only); returns their paths (None for the multipoles when not measured), the linear
        P(k) at ``a`` and Kaiser's three factors."""
        import numpy as np

        import torchpm

        sim, config, batch = self.simulation, self.config, len(spectra)
        box, n_particles, cosmology = sim.box_size, sim.n_total, sim.cosmology
        growth = cosmology.growth(a)
        linear = _linear_power(sim, spectra[0].k) * growth.D1**2
        f = float(growth.f1)
        kaiser = (1 + 2 * f / 3 + f**2 / 5, 4 * f / 3 + 4 * f**2 / 7, 8 * f**2 / 35)
        describe = (
            f"{sim.particle_shape} particles, mesh {sim.mesh_shape}, box {box} Mpc/h, "
            f"{sim.steps} {sim.integrator} steps from a = {sim.a_start}, {cosmology!r}, seed {config['seed']}"
            + (", fixed amplitudes" if config["fixed_amplitude"] else "")
            + (", paired (white noise negated)" if config["paired"] else "")
            + (f", resumed from {self.resume}" if self.resume else ""))
        header = (
            f"torchpm {torchpm.__version__}: matter power spectrum at a = {a:.4f}\n{describe}\n"
            + "P(k): CIC-compensated, "
            + f"Poisson shot noise V/N_particles = {math.prod(box) / n_particles:.6e} (Mpc/h)^3 "
            + ("subtracted" if self.subtract else "kept (not subtracted)") + "\n"
            + ("columns: k [h/Mpc]  P(k) [(Mpc/h)^3]  modes  P_linear(k) [(Mpc/h)^3]" if batch == 1 else
               f"columns: k [h/Mpc]  P(k) [(Mpc/h)^3] of batch member 0, ..., of member {batch - 1} (one column "
               "each)  modes  P_linear(k) [(Mpc/h)^3]")
        )
        table_path = os.path.join(self.output, f"power_spectrum{suffix}.txt")
        with _writing(table_path):  # (a UserError naming the file that cannot be written)
            np.savetxt(
                table_path,
                np.column_stack([spectra[0].k.cpu(), *(member.power.cpu() for member in spectra),
                                 spectra[0].modes.cpu(), linear.detach().cpu()]),
                header=header,
                fmt=["%.6e"] * (1 + batch) + ["%d", "%.6e"],
            )
        self.correlation_path = self._write_correlation(suffix, a, growth, describe)
        if multipoles is None:
            return table_path, None, linear, kaiser
        # Linear theory in redshift space (Kaiser): P_0, P_2, P_4 = (1 + 2f/3 + f^2/5,
        # 4f/3 + 4f^2/7, 8f^2/35) P_linear, with f = dlnD/dlna at a.
        linear_rsd = _linear_power(sim, multipoles[0].k).detach().cpu() * float(growth.D1) ** 2
        multipoles_path = os.path.join(self.output, f"power_multipoles{suffix}.txt")
        member_columns = "P_0 P_2 P_4 [(Mpc/h)^3]" + ("" if batch == 1 else
                                                     f" of batch member 0, ..., of member {batch - 1} (three each)")
        axis = self.axis
        with _writing(multipoles_path):
            np.savetxt(
                multipoles_path,
                np.column_stack([multipoles[0].k.cpu(), *(m.power[i].cpu() for m in multipoles for i in range(3)),
                                 multipoles[0].modes.cpu(), *(factor * linear_rsd for factor in kaiser)]),
                header=f"torchpm {torchpm.__version__}: redshift-space power multipoles at a = {a:.4f}\n{describe}\n"
                f"line of sight: the {axis} axis (plane-parallel: x + p_{axis} / (a^2 E(a))); P_ell = (2 ell + 1) "
                f"<|delta_k|^2 L_ell(mu)> over the shells of power_spectrum{suffix}.txt, CIC-compensated; shot "
                "noise " + ("subtracted from P_0\n" if self.subtract else "kept\n")
                + f"columns: k [h/Mpc]  {member_columns}  modes  linear (Kaiser, f = {f:.5f}) P_0 P_2 P_4",
                fmt=["%.6e"] * (1 + 3 * batch) + ["%d"] + ["%.6e"] * 3,
            )
        return table_path, multipoles_path, linear, kaiser

    def _write_correlation(self, suffix, a, growth, describe):
        """Writes ``correlation_function{suffix}.txt`` from the last :meth:`measure` (rank 0);
        returns its path, or None when the run does not write it."""
        import numpy as np

        import torchpm
        from torchpm.analysis import correlation_from_power
        from torchpm.cosmology import PowerTable

        correlations = self.correlations
        if not correlations:
            return None
        sim, batch = self.simulation, len(correlations)
        r = correlations[0].r
        power = sim.power
        # Linear theory over 1e-5 to 100 h/Mpc, or a table's own range if it spans 1e-4 to 10
        # (what xi above a few Mpc/h needs; NaN, and the header says why, if it does not).
        k_min, k_max = power.k_range if isinstance(power, PowerTable) else (1e-5, 100.0)
        if k_min <= 1e-4 * (1 + 1e-9) and k_max >= 10.0 * (1 - 1e-9):
            linear = correlation_from_power(r, lambda k: sim.linear_power(k).detach(), k_min=k_min, k_max=k_max) \
                * float(growth.D1) ** 2
            about = f"over [{k_min:.3g}, {k_max:.3g}] h/Mpc"
        else:
            linear = torch.full_like(r, float("nan"))
            about = (f"not computed (nan): the power table covers [{k_min:.3g}, {k_max:.3g}] h/Mpc, not 1e-4 to "
                     "10 h/Mpc")
        self.correlation_linear = linear
        noise = ("the particles' pairs with themselves subtracted (Poisson, CIC window)" if self.subtract
                 else "the particles' pairs with themselves kept")
        path = os.path.join(self.output, f"correlation_function{suffix}.txt")
        with _writing(path):
            np.savetxt(
                path,
                np.column_stack([r.cpu(), *(c.xi.detach().cpu() for c in correlations), correlations[0].lags.cpu(),
                                 linear.cpu()]),
                header=f"torchpm {torchpm.__version__}: matter correlation function at a = {a:.4f}\n{describe}\n"
                "xi(r) = <delta(x) delta(x + r)> over every cell and cell separation in the shell (minimum image), "
                f"CIC-compensated, {noise}; linear: 1/(2 pi^2) int k^2 P_linear(k) j0(k r) dk {about}\n"
                + ("columns: r [Mpc/h]  xi  lags  xi_linear" if batch == 1 else
                   f"columns: r [Mpc/h]  xi of batch member 0, ..., of member {batch - 1} (one column each)  lags  "
                   "xi_linear"),
                fmt=["%.6e"] * (1 + batch) + ["%d", "%.6e"],
            )
        return path


def plot(spectrum, linear, slab, thickness, simulation, a, path, shot_noise="subtract"):
    """P(k) against linear theory, and ``slab`` (the density averaged over ``thickness`` cells in z).
    ``shot_noise``: the config's choice (``"subtract"`` or ``"keep"``), named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    k = spectrum.k.cpu().numpy()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    left.loglog(k, spectrum.power.cpu().numpy(), "o-", ms=3, label=f"torchpm, a = {a:.2f}, shot noise "
                + ("subtracted" if shot_noise == "subtract" else "kept"))
    left.loglog(k, linear.detach().cpu().numpy(), "k--", label="linear theory")
    left.set_xlabel("k [h/Mpc]")
    left.set_ylabel("P(k) [(Mpc/h)$^3$]")
    left.legend()
    left.set_title("matter power spectrum")
    # A slice a few cells thick: a single plane of a CIC mesh is noisy.
    slab = slab.cpu().numpy()
    box = simulation.box_size
    image = right.imshow(
        np.log10(np.maximum(slab, 0.1)).T, origin="lower", extent=(0, box[0], 0, box[1]), cmap="magma"
    )
    right.set_xlabel("x [Mpc/h]")
    right.set_ylabel("y [Mpc/h]")
    right.set_title(f"log10(1 + delta), slab {thickness * simulation.cell_size[2]:.0f} Mpc/h thick")
    figure.colorbar(image, ax=right)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    finally:  # (closed too when it cannot be saved)
        plt.close(figure)


def info() -> str:
    """torch, torchpm, devices, threads and the optional dependencies, as text."""
    from importlib import metadata

    import torchpm

    lines = [
        f"torchpm {torchpm.__version__} ({os.path.dirname(torchpm.__file__)})",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        f"torchpm CUDA kernels built: {'yes' if torchpm.has_cuda_kernels() else 'no'}; "
        f"CPU kernels: {torchpm.cpu_kernels()}",
        f"threads: {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op; "
        f"{os.cpu_count()} CPUs",
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            lines.append(f"cuda:{index}: {properties.name}, {properties.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("CUDA devices: none")
    lines.append(f"distributed: gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}, "
                 f"nccl {'yes' if torch.distributed.is_nccl_available() else 'no'}")
    for package in ("numpy", "h5py", "tqdm", "matplotlib", "psutil", "scipy", "tomli", "pynbody", "hypothesis",
                    "astropy", "colossus", "jax", "jaxpm"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "not installed"
        lines.append(f"{package}: {version}")
    return "\n".join(lines)


def update_readme(path: str) -> int:
    """Replace the text between ``<!-- config-table:begin -->`` and ``<!-- config-table:end -->``."""
    import re

    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    pattern = re.compile(r"(<!-- config-table:begin -->\n).*?(<!-- config-table:end -->)", re.S)
    if not pattern.search(text):
        print(f"torchpm config-table: {path!r} has no config-table markers", file=sys.stderr)
        return 2
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(pattern.sub(lambda m: m.group(1) + markdown_table() + m.group(2), text))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchpm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run a simulation and write P(k), a figure and snapshots")
    run_parser.add_argument("config", nargs="?", help="TOML config file (optional)")
    run_parser.add_argument("--output", help="output folder (overrides the config)")
    run_parser.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run")
    run_parser.add_argument("--resume", metavar="SNAPSHOT", help="continue the run from one of its snapshots")
    run_parser.add_argument("--check", action="store_true",
                            help="validate the config, print the resolved settings and memory estimate, do not run")
    commands.add_parser("info", help="torch, CUDA kernels, devices, threads, optional dependencies")
    table_parser = commands.add_parser("config-table", help="the README table of every config key (markdown)")
    table_parser.add_argument("--readme", metavar="PATH",
                              help="replace the table between the config-table markers of this file instead of printing")
    arguments = parser.parse_args(argv)
    if arguments.command == "info":
        print(info())
        return 0
    if arguments.command == "config-table":
        if arguments.readme is None:
            print(markdown_table(), end="")
            return 0
        return update_readme(arguments.readme)
    overrides = {} if arguments.output is None else {"output": arguments.output}
    try:
        config = load_config(arguments.config, overrides)
        run(config, overwrite=arguments.overwrite, resume=arguments.resume, check=arguments.check)
    except (SettingError, UserError) as error:
        # one line, whatever the message carries (h5py's errors hold a newline)
        line = re.sub(r" *[\r\n]+ *", " ", str(error))
        print(f"torchpm run: {line}", file=sys.stderr)
        return 2
    return 0


__all__ = ["main", "run", "info", "load_config", "DEFAULTS", "SETTINGS"]

if __name__ == "__main__":
    sys.exit(main())
