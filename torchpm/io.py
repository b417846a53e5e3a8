"""Snapshots in the Gadget-4 / SWIFT HDF5 layout, and what an exact restart needs.

A snapshot file holds

* ``Header`` attributes as Gadget writes them: ``BoxSize`` (Mpc/h), ``Time`` (= a),
  ``Redshift``, ``NumPart_ThisFile``, ``NumPart_Total`` / ``NumPart_Total_HighWord``
  (low and high 32 bits of the count over all files), ``MassTable``,
  ``NumFilesPerSnapshot``, ``Omega0``, ``OmegaLambda``, ``OmegaBaryon``,
  ``HubbleParam``, ``Flag_*``; the same cosmology and the unit system in
  ``Parameters`` (Gadget-4 keeps them there): length Mpc, mass 1e10 Msun,
  velocity km/s, all with Gadget's factors of h. ``BoxSize`` is one number, as Gadget
  readers expect: the side of a cubic box, and for a box with unequal sides the
  longest one, the sides being ``BoxSize`` times ``LONG_X``, ``LONG_Y``, ``LONG_Z``
  (attributes of a ``Config`` group, as Gadget-4 records its compile-time options;
  Gadget's stretched-box factors, here at most 1), so every coordinate lies in
  ``[0, BoxSize)`` for a reader that ignores them; ``torchpm/box_size`` holds the sides
  exactly, and :func:`read_snapshot` gives them as ``Snapshot.box_size``.
* ``PartType1`` (dark matter): ``Coordinates`` (comoving, Mpc/h, wrapped into the
  box), ``Velocities`` in Gadget's convention — the peculiar velocity in km/s
  divided by sqrt(a), i.e. ``100 p / a^1.5`` for the momentum ``p = a^3 E dx/da``
  in Mpc/h — and ``ParticleIDs`` (uint64, the Lagrangian index
  ``(i ny + j) nz + k``). Every particle has the mass ``MassTable[1] =
  27.7536627 Omega_m V / N`` (1e10 Msun/h; ``27.7536627`` is the critical density
  in 1e10 h^2 Msun / Mpc^3).
* ``torchpm``: the configuration as TOML text (``config``), the cosmology, the
  scale factor and step index (float64, exact), the simulation's shape and dtype,
  and the raw particles in force-mesh units (``MeshPositions``, unwrapped, and
  ``MeshMomenta``, with the exact bits of the run) from which
  :meth:`torchpm.Simulation.resume` continues bit for bit.

Padding slots (``ids < 0``) are not written. A distributed run (``torch.distributed``
initialised with world size > 1) writes one file per rank in Gadget's multi-file
convention, ``snap_005.0.hdf5``, ``snap_005.1.hdf5``, ..., with the total count
all-reduced; :func:`read_snapshot` reads a single file or a whole set, whole or a
contiguous share per reader. Writing streams: one chunk of particles at a time is
copied to the host. A write goes to a temporary name and is renamed at the end,
so a failed write leaves nothing under the final name.

Mesh fields (densities on the force mesh) go to their own HDF5 file, one dataset
``(B, nx, ny, nz)`` per field (:func:`write_fields`, :func:`read_fields`); on a process
grid the ranks write their blocks into it in turn.

h5py is needed by this module only (``pip install h5py``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import torch

__all__ = [
    "Snapshot",
    "write_snapshot",
    "read_snapshot",
    "check_restart",
    "restart_state",
    "simulation_config",
    "scale_factor_index",
    "snapshot_files",
    "to_toml",
    "write_fields",
    "read_fields",
    "CRITICAL_DENSITY",
]

# Critical density in 1e10 h^2 Msun / Mpc^3 (Gadget's unit of mass per (Mpc/h)^3 for Omega = 1).
CRITICAL_DENSITY = 27.7536627
FORMAT_VERSION = 1
CHUNK = 1 << 20  # particles per chunk copied to the host
_UNITS = dict(UnitLength_in_cm=3.085678e24, UnitMass_in_g=1.989e43, UnitVelocity_in_cm_per_s=1e5)
# Attributes added after snapshots were first written, with the value a run had before.
_ATTRIBUTE_DEFAULTS = {"cosmology_f_nl": 0.0}


def _h5py():
    try:
        import h5py
    except ImportError:
        raise ImportError("torchpm snapshots need h5py: `pip install h5py` (or `make deps`)") from None
    return h5py


# ----------------------------------------------------------------------------------
# Configuration as TOML text.


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)  # shortest text that round-trips exactly
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(key)} = {_toml_value(item)}" for key, item in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _toml_string(text: str) -> str:
    """A TOML basic string: quote, backslash and control characters (DEL included) escaped,
    everything else (non-BMP characters too) written as itself."""
    out = []
    for character in text:
        code = ord(character)
        if character in '"\\':
            out.append("\\" + character)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(character)
    return '"' + "".join(out) + '"'


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def to_toml(config: dict) -> str:
    """A flat config dict (scalars, lists, one-level tables) as TOML text."""
    return "".join(f"{_toml_key(key)} = {_toml_value(value)}\n" for key, value in config.items())


def simulation_config(sim) -> dict:
    """The settings of ``sim`` as a config dict (steps as the exact list of scale factors;
    ``f_nl`` a key of its own, as the CLI's config has it)."""
    cosmology = {key: float(value.detach()) for key, value in sim.cosmology.parameters().items()}
    f_nl = cosmology.pop("f_nl")
    power = getattr(sim.power, "path", None)
    return dict(
        n_particles=list(sim.particle_shape),
        box_size=list(sim.box_size),
        mesh_factor=sim.mesh_factor,
        a_start=sim.scale_factors[0],
        steps=list(sim.scale_factors[1:]) if sim.steps else 0,
        lpt_order=sim.lpt_order,
        **({"lpt_normalisation": sim.lpt_normalisation} if hasattr(sim, "lpt_normalisation") else {}),
        integrator=sim.integrator,
        gradient=sim.kernel_options["gradient"],
        laplacian=sim.kernel_options["laplacian"],
        cic_compensation=sim.cic_compensation,
        paint_order=sim.paint_order,
        window_compensation=sim.window_compensation,
        cosmology=cosmology,
        f_nl=f_nl,
        primordial_kmax=getattr(sim, "primordial_kmax", 0.0),
        dtype=str(sim.dtype).replace("torch.", ""),
        **({"power_spectrum": power} if power else {}),
    )


def scale_factor_index(sim, a: float) -> int:
    """The index of ``a`` in ``sim.scale_factors`` (0: ``a_start``), or a ValueError:
    a run stops, writes and resumes only at the end of a step."""
    a = float(a)
    for index, value in enumerate(sim.scale_factors):
        if abs(a - value) <= 1e-9 * value:
            return index
    raise ValueError(
        f"scale factor {a} is not one of this simulation's scale factors "
        f"({sim.scale_factors[0]:.6g} to {sim.scale_factors[-1]:.6g}, {len(sim.scale_factors) - 1} steps): "
        "a run can stop and resume only at the end of a step"
    )


# ----------------------------------------------------------------------------------
# Writing.


def snapshot_files(path: str, num_files: int) -> list[str]:
    """The file names of a snapshot: ``path`` itself for one file, else Gadget's
    ``<base>.<i>.hdf5`` with ``<base>`` = ``path`` less its ``.hdf5``."""
    path = os.fspath(path)
    if num_files == 1:
        return [path]
    base = path[: -len(".hdf5")] if path.endswith(".hdf5") else path
    return [f"{base}.{i}.hdf5" for i in range(num_files)]


def _distributed():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def write_snapshot(
    path,
    state,
    sim,
    *,
    mesh_units: bool = False,
    member: int = 0,
    step: int | None = None,
    config: dict | None = None,
    file_index: int | None = None,
    num_files: int | None = None,
    num_part_total: int | None = None,
    overwrite: bool = False,
    chunk_size: int = CHUNK,
) -> str:
    """Write one member of a batch of particles as a Gadget-4 HDF5 snapshot.

    Args:
        path: ``.../snap_005.hdf5``; a multi-file snapshot writes ``.../snap_005.<i>.hdf5``.
        state: a :class:`torchpm.SimulationState` in Mpc/h, or in force-mesh units
            with ``mesh_units=True`` or as a :class:`torchpm.MeshUnitsState` (as
            returned with ``return_mesh_units=True``; only then does the snapshot hold
            the exact bits a restart needs).
            ``(B, N, 3)`` positions and momenta; ``ids`` ``(B, N)`` integers (default: the
            Lagrangian order ``0 .. N-1``, valid on a single device); ``-1`` ids are skipped.
            Refused before any file is written (on every rank of a set): a non-finite
            position or momentum, an id at or beyond the simulation's N, an id twice
            (on a rank, or over the ranks of a set: one all-reduce of power sums, or with
            fewer than N particles over the set, one all-to-all of the ids).
        sim: the :class:`torchpm.Simulation` that produced ``state``.
        member: which batch member to write.
        step: the index of ``state.a`` in ``sim.scale_factors`` (found when omitted).
        config: the run's configuration, stored as TOML (default: :func:`simulation_config`).
        file_index, num_files: this file's place in a multi-file snapshot (default:
            the rank and world size of an initialised ``torch.distributed``, else 0 and 1).
            A simulation on a process grid takes its grid's rank and size instead (the
            grid may be a part of the world, e.g. one grid per data-parallel replica:
            each replica writes its own set). On several ranks the call is collective
            over them, whatever these arguments: every rank calls it with its own
            particles, and the ranks first agree on ``path``, ``member``, the step,
            ``num_files`` (the ranks' number), ``overwrite`` and ``num_part_total`` and
            that each file index is written once, so a rank's bad or different argument
            makes every rank raise the same ValueError (a rank calling alone waits for
            the others until the process group's timeout). The one exception: with
            ``file_index=0, num_files=1`` a rank writes a whole file alone, without any
            collective (e.g. ``sim.gather(state)`` from rank 0). A rank cannot tell that
            call from its part in a set, so if the other ranks call it for a set at the
            same time they wait: they raise at that rank's next collective torchpm call
            (as a mismatch naming both calls, or both paths when it is the next
            ``write_snapshot``), or at the process group's timeout.
        num_part_total: particles in all files (default: all-reduced over the ranks
            (the grid's, or the world's), or this file's count for a single file).
        overwrite: replace an existing file (default: refuse).
        chunk_size: particles copied to the host at a time.

    Returns:
        The name of the file written.
    """
    h5py = _h5py()
    from .distributed.particles import _count_non_finite, duplicate_ids_error, members_not_each_once
    from .simulation import MeshUnitsState, SimulationState

    mesh_units = bool(mesh_units) or isinstance(state, MeshUnitsState)
    # The ranks that write a set together: a simulation's process grid (which may be a part
    # of the world: a grid per data-parallel replica), else the world as a P x 1 grid.
    mesh = getattr(sim, "force_mesh", None)
    grid = None if mesh is None or mesh.is_local else mesh.grid
    if grid is None and _distributed() is not None:
        import torch.distributed as dist

        from .distributed.groups import GridGroups

        grid = GridGroups((dist.group.WORLD, None))
    if num_files is None and file_index is None:
        file_index, num_files = (grid.rank, grid.size) if grid is not None else (0, 1)
    # (integers of other types, e.g. numpy's, as ints: an int64 `num_files` must not make a
    # rank write alone while the others wait for it)
    num_files, file_index, num_part_total = (
        int(v) if _is_int(v) else v for v in (num_files, file_index, num_part_total))
    # Under torch.distributed every call is collective over the ranks of the set but one:
    # file_index=0, num_files=1, a whole file written by a rank alone (e.g. a gathered
    # state from rank 0). Any other arguments, bad ones included, take part in the
    # agreement below, so one rank's bad or different argument makes every rank raise
    # instead of leaving the others waiting in it.
    together = grid is not None and not (_is_int(num_files) and _is_int(file_index) and num_files == 1
                                         and file_index == 0)
    error = None
    try:
        if not isinstance(state, SimulationState):
            raise TypeError(f"`state` must be a torchpm.SimulationState, got {type(state).__name__}")
        positions, momenta = state.positions, state.momenta
        if positions.dim() != 3 or positions.shape[-1] != 3 or momenta.shape != positions.shape:
            raise ValueError(f"`state` positions and momenta must both be (B, N, 3), got {tuple(positions.shape)} "
                             f"and {tuple(momenta.shape)}")
        a = float(state.a)
        if step is None:  # (before the other checks: a rank refused for another argument agrees on it)
            step = scale_factor_index(sim, a)
        batch, count, _ = positions.shape
        if isinstance(member, bool) or not isinstance(member, int) or not 0 <= member < batch:
            raise ValueError(f"`member` must be an int in [0, {batch}), got {member!r}")
        if not (_is_int(num_files) and _is_int(file_index) and 0 <= file_index < num_files):
            raise ValueError(f"`file_index` and `num_files` must be given together as ints with 0 <= file_index < "
                             f"num_files, got {file_index!r} and {num_files!r}")
        if num_part_total is not None and not (_is_int(num_part_total) and num_part_total >= 0):
            raise ValueError(f"`num_part_total` must be None or an int >= 0, got {num_part_total!r}")
        ids = state.ids
        if ids is None:
            if num_files > 1 or count != sim.n_total:
                raise ValueError("`state.ids` is needed for a multi-file snapshot or a partial particle set")
            ids = torch.arange(count, device=positions.device).expand(batch, count)
        if ids.shape != positions.shape[:2]:
            raise ValueError(f"`state.ids` must be (B, N) = {tuple(positions.shape[:2])}, got {tuple(ids.shape)}")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"`state.ids` must be integers (-1 for an empty slot), got {ids.dtype}")
        # The particles written: ids in range and each once, finite values (a reader
        # would refuse the file as damaged; on a grid the other ranks' files with it).
        row = ids[member].to(torch.int64)
        if row.numel() and int(row.max()) >= sim.n_total:
            raise ValueError(f"`state.ids` must be below the simulation's {sim.n_total} particles, got {int(row.max())}")
        for name, values in (("positions", positions), ("momenta", momenta)):
            # (the empty slots' values are not read)
            if _count_non_finite(values[member:member + 1], row.unsqueeze(0)):
                raise ValueError(f"the state's {name} of member {member} are not finite (NaN or inf, or beyond "
                                 "+-2^40)")
        if not together or grid.size == 1:  # (on a grid: checked over the ranks below)
            # (one flag per particle of the file: O(N), no sort)
            seen = torch.zeros(sim.n_total + 1, dtype=torch.bool, device=row.device)
            seen[torch.where(row >= 0, row, sim.n_total)] = True
            if int(seen[:-1].sum()) != int((row >= 0).sum()):
                twice = int(torch.nonzero(torch.bincount(row[row >= 0], minlength=sim.n_total) > 1)[0, 0])
                raise ValueError(f"`state.ids` of member {member} hold the id {twice} twice")
    except (TypeError, ValueError, RuntimeError) as exc:  # (RuntimeError: e.g. out of memory for the checks)
        if not together:
            raise
        error = exc
    if together:
        try:
            name = os.path.abspath(os.fspath(path))
        except TypeError:
            name = repr(path)
        # What every file of the set must share (a bad rank's values are placeholders: its
        # error is named first).
        shared = [("`path`", name), ("`member`", member), ("`step` (the state's scale factor)", step),
                  ("`num_files`", num_files), ("`overwrite`", bool(overwrite)), ("`num_part_total`", num_part_total)]
        try:
            grid.agree("write_snapshot", shared, error)
        except (TypeError, ValueError) as refused:
            raise type(refused)(f"{refused}. No file of the set {path!r} was written") from None
        except RuntimeError as failure:  # most often the timeout: a rank that never called it
            raise type(failure)(
                f"write_snapshot {path!r}: under torch.distributed the call is collective (each rank writes its "
                "file of the set), and the ranks' first exchange failed: did every rank call it? A rank that passes "
                "file_index=0, num_files=1 writes a whole file alone and takes no part. "
                f"({failure})"
            ) from failure
        if num_files != grid.size:  # (agreed: every rank raises)
            raise ValueError(f"snapshot {path!r}: num_files={num_files}, but {grid.size} ranks write the set (one "
                             "file each). No file of the set was written")
    ids = ids[member]
    positions, momenta = positions[member], momenta[member]
    valid = int((ids >= 0).sum())
    if together:
        # Which file each rank writes, and its particles (the total, unless given).
        table = grid.all_gather_counts([file_index, valid]).cpu()
        missing = sorted(set(range(num_files)) - set(table[:, 0].tolist()))
        if missing:
            raise ValueError(f"snapshot {path!r}: the ranks' file_index are not each of 0 .. {num_files - 1} once "
                             f"(no rank writes {missing}). No file of the set was written")
        if num_part_total is None:
            num_part_total = int(table[:, 1].sum())
    elif num_part_total is None:
        if num_files == 1:
            num_part_total = valid
        else:
            raise ValueError("`num_part_total` is needed for a multi-file snapshot written without torch.distributed")
    if num_part_total > sim.n_total:
        # (the same total on every rank of a set: every rank raises)
        raise ValueError(
            f"snapshot {path!r}: {'the files would hold' if num_files > 1 else 'it would hold'} {num_part_total} "
            f"particles, but the simulation has {sim.n_total}"
            + (": does every rank hold the whole state (e.g. sim.gather(state))? Give each rank its own "
               "particles, or write the whole state from one rank with file_index=0, num_files=1"
               if num_files > 1 else "")
        )
    if together and grid.size > 1:
        # An id held twice, on a rank or on two (each rank's were only checked to be in
        # range): every rank raises, none writes. With every particle held, power sums;
        # a partial set routes its ids.
        nothing_written = f". No file of the set {path!r} was written"
        if int(table[:, 1].sum()) == sim.n_total:
            if members_not_each_once(ids.unsqueeze(0), sim.n_total, grid):
                raise ValueError(f"write_snapshot: `ids` of member {member} must be unique over all ranks, but an "
                                 f"id is held twice (and another by no rank){nothing_written}")
        else:
            try:
                grid.raise_together(duplicate_ids_error("write_snapshot", ids.unsqueeze(0).to(torch.int64), grid,
                                                        member), operation="write_snapshot (ids)")
            except ValueError as refused:
                raise ValueError(f"{refused}{nothing_written}") from None
    final = snapshot_files(path, num_files)[file_index]
    directory = os.path.dirname(os.path.abspath(final))
    temporary = os.path.join(directory, f".{os.path.basename(final)}.{os.getpid()}.tmp")

    cell = torch.tensor(sim.cell_size, dtype=positions.dtype, device=positions.device)
    box = sim.box_size
    volume = math.prod(box)
    omega_m = float(sim.cosmology.Omega_m.detach())
    mass = CRITICAL_DENSITY * omega_m * volume / sim.n_total
    cosmology = {key: float(value.detach()) for key, value in sim.cosmology.parameters().items()}
    hubble = cosmology["h"]
    omega_lambda = 1.0 - omega_m - cosmology["Omega_k"]
    dtype = positions.dtype
    numpy_dtype = "f8" if dtype == torch.float64 else "f4"
    failed = None
    try:
        if os.path.exists(final) and not overwrite:
            raise FileExistsError(f"snapshot {final!r} exists; pass overwrite=True (CLI: --overwrite) to replace it")
        with h5py.File(temporary, "w") as handle:
            header = handle.create_group("Header")
            counts = [0, valid, 0, 0, 0, 0]
            totals = [0, num_part_total, 0, 0, 0, 0]
            # One number (Gadget readers take no other: pynbody made a 3-vector an array of
            # units that its `in_units` and `wrap` refuse); a box with unequal sides is
            # Gadget's stretched box, its longest side times the LONG_* factors.
            longest = max(box)
            header.attrs["BoxSize"] = longest
            if not box[0] == box[1] == box[2]:
                stretch = handle.create_group("Config")
                for name, side in zip(("LONG_X", "LONG_Y", "LONG_Z"), box):
                    stretch.attrs[name] = side / longest
            header.attrs["Time"] = a
            header.attrs["Redshift"] = 1.0 / a - 1.0
            header.attrs["NumPart_ThisFile"] = _uint(counts, "u8")
            header.attrs["NumPart_Total"] = _uint([n & 0xFFFFFFFF for n in totals], "u4")
            header.attrs["NumPart_Total_HighWord"] = _uint([n >> 32 for n in totals], "u4")
            header.attrs["MassTable"] = [0.0, mass, 0.0, 0.0, 0.0, 0.0]
            header.attrs["NumFilesPerSnapshot"] = num_files
            header.attrs["Omega0"] = omega_m
            header.attrs["OmegaBaryon"] = cosmology["Omega_b"]
            header.attrs["OmegaLambda"] = omega_lambda
            header.attrs["HubbleParam"] = hubble
            header.attrs["Flag_DoublePrecision"] = int(dtype == torch.float64)
            for flag in ("Flag_Sfr", "Flag_Cooling", "Flag_StellarAge", "Flag_Metals", "Flag_Feedback", "Flag_Entropy_ICs"):
                header.attrs[flag] = 0
            parameters = handle.create_group("Parameters")
            for key, value in _UNITS.items():
                parameters.attrs[key] = value
            parameters.attrs["ComovingIntegrationOn"] = 1
            for key in ("BoxSize", "Omega0", "OmegaBaryon", "OmegaLambda", "HubbleParam"):
                parameters.attrs[key] = header.attrs[key]

            particles = handle.create_group("PartType1")
            datasets = dict(
                Coordinates=particles.create_dataset("Coordinates", (valid, 3), dtype=numpy_dtype),
                Velocities=particles.create_dataset("Velocities", (valid, 3), dtype=numpy_dtype),
                ParticleIDs=particles.create_dataset("ParticleIDs", (valid,), dtype="u8"),
            )
            datasets["Coordinates"].attrs["unit"] = "Mpc/h, comoving"
            datasets["Velocities"].attrs["unit"] = "km/s / sqrt(a): peculiar velocity divided by sqrt(a) (Gadget)"
            # Gadget-4's per-dataset unit attributes: value * to_cgs * a^a_scaling * h^h_scaling is in cgs.
            for name, (a_scaling, h_scaling, length, velocity, to_cgs) in dict(
                Coordinates=(1.0, -1.0, 1.0, 0.0, _UNITS["UnitLength_in_cm"]),
                Velocities=(0.5, 0.0, 0.0, 1.0, _UNITS["UnitVelocity_in_cm_per_s"]),
                ParticleIDs=(0.0, 0.0, 0.0, 0.0, 0.0),
            ).items():
                attributes = datasets[name].attrs
                attributes["a_scaling"], attributes["h_scaling"] = a_scaling, h_scaling
                attributes["length_scaling"], attributes["velocity_scaling"] = length, velocity
                attributes["mass_scaling"], attributes["to_cgs"] = 0.0, to_cgs
            ours = handle.create_group("torchpm")
            raw_positions = ours.create_dataset("MeshPositions", (valid, 3), dtype=numpy_dtype)
            raw_momenta = ours.create_dataset("MeshMomenta", (valid, 3), dtype=numpy_dtype)
            raw_positions.attrs["unit"] = "force-mesh cells, unwrapped"
            raw_momenta.attrs["unit"] = "force-mesh cells (p = a^3 E dx/da)"
            # Where each particle sat among the rank's slots, when some are empty: a
            # restart from this file rebuilds that layout, which the run's later
            # migrations (arrivals fill the empty slots in order) and so its bits depend
            # on. Without empty slots (always on one device) the file order is the layout.
            padded = mesh_units and valid < count
            raw_slots = ours.create_dataset("MeshSlots", (valid,), dtype="i8") if padded else None

            written = 0
            velocity_factor = 100.0 / a**1.5
            for begin in range(0, count, chunk_size):
                end = min(begin + chunk_size, count)
                keep = ids[begin:end] >= 0
                x, p = positions[begin:end][keep], momenta[begin:end][keep]
                if mesh_units:
                    mesh_x, mesh_p = x, p
                    physical = sim.to_physical(x.unsqueeze(0), p.unsqueeze(0), a)
                    x, p = physical.positions[0], physical.momenta[0]
                else:
                    mesh_x, mesh_p = x / cell, p / cell
                rows = slice(written, written + x.shape[0])
                datasets["Coordinates"][rows] = x.detach().cpu().numpy()
                datasets["Velocities"][rows] = (p.detach() * velocity_factor).cpu().numpy()
                datasets["ParticleIDs"][rows] = ids[begin:end][keep].cpu().numpy().astype("u8")
                raw_positions[rows] = mesh_x.detach().cpu().numpy()
                raw_momenta[rows] = mesh_p.detach().cpu().numpy()
                if raw_slots is not None:
                    raw_slots[rows] = torch.nonzero(keep.cpu()).reshape(-1).add_(begin).numpy()
                written += x.shape[0]

            ours.attrs["format_version"] = FORMAT_VERSION
            ours.attrs["config"] = to_toml(config if config is not None else simulation_config(sim))
            ours.attrs["a"] = a
            ours.attrs["step"] = int(step)
            ours.attrs["scale_factors"] = list(map(float, sim.scale_factors))
            ours.attrs["n_particles"] = list(sim.particle_shape)
            ours.attrs["box_size"] = list(box)
            ours.attrs["mesh_factor"] = sim.mesh_factor
            ours.attrs["dtype"] = str(dtype).replace("torch.", "")
            ours.attrs["exact_restart"] = bool(mesh_units)
            ours.attrs["slot_count"] = count  # the member's slots on this rank, empty ones included
            ours.attrs["member"] = member
            ours.attrs["file_index"] = file_index
            ours.attrs["integrator"] = sim.integrator
            ours.attrs["gradient"] = sim.kernel_options["gradient"]
            ours.attrs["laplacian"] = sim.kernel_options["laplacian"]
            ours.attrs["cic_compensation"] = sim.cic_compensation
            for key in ("paint_order", "window_compensation"):
                if hasattr(sim, key):
                    ours.attrs[key] = getattr(sim, key)
            for key, value in cosmology.items():
                ours.attrs[f"cosmology_{key}"] = value
            from . import __version__

            ours.attrs["torchpm_version"] = __version__
        if os.path.isdir(final):  # (the rename below would fail on this rank alone, after the others')
            raise IsADirectoryError(f"snapshot {path!r}: {final!r} is a directory; no file of the set was written")
    except BaseException as error:  # noqa: BLE001 - cleaned up, reported below
        failed = error
    # Every file of a set is renamed only when every rank wrote its own.
    ok = torch.tensor([0 if failed else 1], dtype=torch.int64)
    if together:
        ok = grid.all_reduce(ok, "min").cpu()
    if failed is not None or int(ok.item()) == 0:
        try:
            os.remove(temporary)
        except OSError:
            pass
        if failed is not None:
            raise failed
        raise RuntimeError(f"snapshot {path!r}: another rank failed to write its file; this rank's file was removed")
    os.replace(temporary, final)
    return final


def _is_int(value) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _uint(values, kind):
    import numpy as np

    return np.asarray(values, dtype=kind)


# ----------------------------------------------------------------------------------
# Reading.


@dataclasses.dataclass
class Snapshot:
    """A snapshot read back (whole or a contiguous share of its particles).

    Attributes:
        a: the scale factor (float64, as written).
        step: its index in the run's scale factors.
        header: the ``Header`` attributes of the first file (Python values).
        config: the run's configuration (parsed from ``config_text``).
        config_text: the TOML text stored in the snapshot.
        attributes: the ``torchpm`` group's attributes.
        positions: ``(N, 3)`` Mpc/h; velocities: ``(N, 3)`` km/s / sqrt(a) (Gadget);
        ids: ``(N,)`` int64; mesh_positions, mesh_momenta: ``(N, 3)`` in force-mesh
        units with the bits of the run; momenta: ``(N, 3)`` ``p`` in Mpc/h.
        files: the files read.
        total: particles in the whole snapshot (all files), of which these are a share or all.
        mesh_slots: ``(N,)`` int64, each particle's slot among the ``slot_count`` slots
            of the rank that wrote the file (empty slots included), when one whole file
            with that record (written when the rank held empty slots) was read; else None.
        box_size: the box's 3 sides in Mpc/h: ``torchpm/box_size`` (exact), else the
            header's ``BoxSize`` (one number, times ``Config/LONG_X`` ... when present,
            or 3 numbers); None without a ``BoxSize``.
    """

    a: float
    step: int
    header: dict
    config: dict
    config_text: str
    attributes: dict
    positions: torch.Tensor
    velocities: torch.Tensor
    momenta: torch.Tensor
    ids: torch.Tensor
    mesh_positions: torch.Tensor | None
    mesh_momenta: torch.Tensor | None
    files: list
    total: int = 0
    mesh_slots: torch.Tensor | None = None
    slot_count: int | None = None
    box_size: tuple | None = None

    def state(self):
        """The particles as a :class:`torchpm.SimulationState` in Mpc/h, batch of 1."""
        from .simulation import SimulationState

        return SimulationState(self.positions[None], self.momenta[None], self.a, self.ids[None])


def _python(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode()
    return value


def _open(name):
    """``h5py.File(name, "r")``, its failure (a truncated or damaged file) naming the file."""
    try:
        return _h5py().File(name, "r")
    except OSError as error:
        raise type(error)(f"cannot read {name!r}: {error}") from None


def _declares_set(name) -> bool:
    """Whether ``name`` is a file of a multi-file snapshot set."""
    if not os.path.isfile(name):
        return False
    try:
        with _open(name) as handle:
            return int(_python(handle["Header"].attrs.get("NumFilesPerSnapshot", 1))) > 1
    except (OSError, KeyError):
        return True  # unreadable: named in the error rather than passed over


def _resolve_files(path) -> list[str]:
    path = os.fspath(path)
    if os.path.isfile(path):
        with _open(path) as handle:
            if "Header" not in handle:
                raise ValueError(f"{path!r} is not a Gadget HDF5 snapshot (no Header group)")
            num_files = int(_python(handle["Header"].attrs.get("NumFilesPerSnapshot", 1)))
        if num_files == 1:
            if path.endswith(".hdf5") and _declares_set(path[: -len(".hdf5")] + ".0.hdf5"):
                # (a single file and a multi-file set of one name: one of them another run's)
                raise ValueError(
                    f"{path!r} is a single-file snapshot, but the multi-file set "
                    f"{path[: -len('.hdf5')] + '.0.hdf5'!r}, ... of the same name is beside it: one of them "
                    "was left by another run; remove it, or name a file of the set to read the set"
                )
            return [path]
        match = re.fullmatch(r"(.*)\.(\d+)\.hdf5", path)
        if not match:
            raise ValueError(f"{path!r} declares {num_files} files but is not named <base>.<i>.hdf5")
        files = snapshot_files(match.group(1), num_files)
        missing = [name for name in files if not os.path.isfile(name)]
        if missing:
            raise FileNotFoundError(f"snapshot {path!r} is one of {num_files} files, but {missing} are missing")
        return files
    base = path[: -len(".hdf5")] if path.endswith(".hdf5") else path
    for candidate in (base + ".hdf5", base + ".0.hdf5"):
        if os.path.isfile(candidate):
            return _resolve_files(candidate)
    raise FileNotFoundError(f"no snapshot at {path!r} (looked for {base}.hdf5 and {base}.0.hdf5)")


# Settings a rank of a run may hold on its own (the CLI's ranks agree on every other).
PER_RANK_SETTINGS = ("device", "threads", "collective_timeout")


def _file_counts(path, files, tomllib) -> list[int]:
    """The particle count of each file of a set, read from every file's header, which also
    shows whether the set was written by one run at one moment: a ValueError when their
    ``Time``, particle total or stored config differ (but for :data:`PER_RANK_SETTINGS`),
    also when only one file's particles are to be read."""
    marks, counts = [], []
    for name in files:
        with _open(name) as handle:
            header = handle["Header"].attrs
            counts.append(int(_python(header["NumPart_ThisFile"])[1]))
            config_text = _python(handle["torchpm"].attrs.get("config", "")) if "torchpm" in handle else ""
            mark = {"a (Time)": _python(header.get("Time")), "NumPart_Total": _python(header.get("NumPart_Total"))}
            config = tomllib.loads(config_text) if config_text else {}
            mark.update((f"config {key}", value) for key, value in config.items() if key not in PER_RANK_SETTINGS)
            marks.append(mark)
    for name, mark in zip(files[1:], marks[1:]):
        differing = [f"{key} {mark.get(key)!r} against {marks[0].get(key)!r}"
                     for key in sorted(set(mark) | set(marks[0]), key=str) if mark.get(key) != marks[0].get(key)]
        if differing:
            raise ValueError(
                f"snapshot {path!r}: its file {name!r} was written by another run or at another time than "
                f"{files[0]!r} ({'; '.join(differing)}): a set mixing two runs' files cannot be read"
            )
    return counts


def read_snapshot(path, *, share: tuple[int, int] | None = None, file_index: int | None = None) -> Snapshot:
    """Read a snapshot written by :func:`write_snapshot` (or any Gadget-4 HDF5 file
    with ``PartType1`` and, for the restart fields, the ``torchpm`` group).

    Args:
        path: one file, any file of a multi-file set, or the set's base name.
        share: ``(index, count)``: read only the ``index``-th of ``count`` contiguous,
            near-equal shares of the particles (in file order), e.g. ``(rank, world_size)``.
            Default: all.
        file_index: read only this file of a multi-file set (e.g. a rank its own file,
            which keeps the particles in the order the run held them: what a bit-exact
            restart on the same process grid needs).
    """
    _h5py()  # (a clear error now if h5py is missing)
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    files = _resolve_files(path)
    counts = _file_counts(path, files, tomllib)
    if file_index is not None:
        if isinstance(file_index, bool) or not isinstance(file_index, int) or not 0 <= file_index < len(files):
            raise ValueError(f"`file_index` must be an int in [0, {len(files)}) for {path!r}, got {file_index!r}")
        files, counts = [files[file_index]], [counts[file_index]]
    total = sum(counts)
    if share is not None and file_index is not None:
        raise ValueError("pass at most one of `share` and `file_index`")
    if share is None:
        begin, end = 0, total
    else:
        index, parts = share
        if not (isinstance(index, int) and isinstance(parts, int) and parts >= 1 and 0 <= index < parts):
            raise ValueError(f"`share` must be (index, count) with 0 <= index < count, got {share!r}")
        begin, end = total * index // parts, total * (index + 1) // parts

    with _open(files[0]) as handle:
        header = {key: _python(value) for key, value in handle["Header"].attrs.items()}
        attributes = {key: _python(value) for key, value in handle["torchpm"].attrs.items()} if "torchpm" in handle else {}
        has_raw = "torchpm" in handle and "MeshPositions" in handle["torchpm"]
        # The slot layout belongs to one file as its rank held it: only a whole single file.
        has_slots = has_raw and "MeshSlots" in handle["torchpm"] and len(files) == 1 and share is None
        float_dtype = handle["PartType1/Coordinates"].dtype if "PartType1" in handle else "f4"
        stretch = {key: _python(value) for key, value in handle["Config"].attrs.items()} if "Config" in handle else {}
    torch_dtype = torch.float64 if str(float_dtype) == "float64" else torch.float32
    n = end - begin
    arrays = dict(
        positions=torch.empty(n, 3, dtype=torch_dtype),
        velocities=torch.empty(n, 3, dtype=torch_dtype),
        ids=torch.empty(n, dtype=torch.int64),
    )
    sources = dict(positions="PartType1/Coordinates", velocities="PartType1/Velocities", ids="PartType1/ParticleIDs")
    if has_raw:
        arrays.update(mesh_positions=torch.empty(n, 3, dtype=torch_dtype), mesh_momenta=torch.empty(n, 3, dtype=torch_dtype))
        sources.update(mesh_positions="torchpm/MeshPositions", mesh_momenta="torchpm/MeshMomenta")
    if has_slots:
        arrays.update(mesh_slots=torch.empty(n, dtype=torch.int64))
        sources.update(mesh_slots="torchpm/MeshSlots")
    offset = 0
    for name, file_count in zip(files, counts):
        low, high = max(begin - offset, 0), min(end - offset, file_count)
        if low < high:
            with _open(name) as handle:
                for key, source in sources.items():
                    data = handle[source][low:high]
                    if key == "ids":
                        data = data.astype("i8")
                    arrays[key][offset + low - begin: offset + high - begin] = torch.from_numpy(data)
        offset += file_count
    a = float(header["Time"])
    config_text = attributes.get("config", "")
    config = tomllib.loads(config_text) if config_text else {}
    momenta = arrays["velocities"] * (a**1.5 / 100.0)
    return Snapshot(
        a=float(attributes.get("a", a)),
        step=int(attributes.get("step", -1)),
        header=header,
        config=config,
        config_text=config_text,
        attributes=attributes,
        positions=arrays["positions"],
        velocities=arrays["velocities"],
        momenta=momenta,
        ids=arrays["ids"],
        mesh_positions=arrays.get("mesh_positions"),
        mesh_momenta=arrays.get("mesh_momenta"),
        files=files,
        total=int(header["NumPart_Total"][1]) + (int(header.get("NumPart_Total_HighWord", [0, 0])[1]) << 32),
        mesh_slots=arrays.get("mesh_slots"),
        slot_count=int(attributes["slot_count"]) if has_slots and "slot_count" in attributes else None,
        box_size=_box_size(header, stretch, attributes),
    )


def _box_size(header: dict, config: dict, attributes: dict) -> tuple | None:
    """The box's 3 sides: torchpm's exact record, else the Gadget header's ``BoxSize`` with
    the stretched-box factors ``LONG_X``, ``LONG_Y``, ``LONG_Z`` of ``Config``, or its 3 numbers
    (as SWIFT writes them, and torchpm's earlier snapshots of a box with unequal sides)."""
    if "box_size" in attributes:
        return tuple(float(side) for side in attributes["box_size"])
    box = header.get("BoxSize")
    if box is None:
        return None
    if isinstance(box, list):
        return tuple(float(side) for side in box)
    return tuple(float(box) * float(config.get(name, 1.0)) for name in ("LONG_X", "LONG_Y", "LONG_Z"))


# ----------------------------------------------------------------------------------
# Restart.


def check_restart(snapshot: Snapshot, sim) -> None:
    """Raise a ValueError naming every setting in which ``sim`` differs from the run
    that wrote ``snapshot`` (particles, box, mesh factor, dtype, cosmology, force
    kernels, integrator), or when the snapshot's ``a`` is not on ``sim``'s step grid."""
    attributes = snapshot.attributes
    if not attributes or not attributes.get("exact_restart", False) or snapshot.mesh_positions is None:
        raise ValueError(
            f"snapshot {snapshot.files[0]!r} holds no exact restart data (the torchpm group with mesh-unit "
            "particles, written with mesh_units=True); it cannot be resumed. A snapshot to resume from is "
            "written from a state in force-mesh units: the MeshUnitsState of sim(..., return_mesh_units=True)"
        )
    ours = dict(
        n_particles=list(sim.particle_shape),
        box_size=list(sim.box_size),
        mesh_factor=sim.mesh_factor,
        dtype=str(sim.dtype).replace("torch.", ""),
        integrator=sim.integrator,
        gradient=sim.kernel_options["gradient"],
        laplacian=sim.kernel_options["laplacian"],
        cic_compensation=sim.cic_compensation,
    )
    # Settings of the force that not every build has (mass-assignment order, window).
    for key in ("paint_order", "window_compensation"):
        if hasattr(sim, key):
            ours[key] = getattr(sim, key)
    for key, value in sim.cosmology.parameters().items():
        ours[f"cosmology_{key}"] = float(value.detach())
    differences = []
    for key, value in ours.items():
        theirs = attributes.get(key, _ATTRIBUTE_DEFAULTS.get(key))
        if isinstance(value, float):
            same = theirs is not None and math.isclose(value, float(theirs), rel_tol=1e-12, abs_tol=1e-15)
        else:
            same = _python(theirs) == value
        if not same:
            differences.append(f"{key}: snapshot {theirs!r}, config {value!r}")
    if differences:
        raise ValueError(
            f"snapshot {snapshot.files[0]!r} is incompatible with this configuration ("
            + "; ".join(differences) + "); resume with the configuration that wrote it"
        )
    scale_factor_index(sim, snapshot.a)  # raises when a is not on the step grid


def restart_state(snapshot: Snapshot, sim):
    """The snapshot's particles in force-mesh units, in the order the file holds them (the
    run's own order, which a bit-exact restart needs), as a batch-of-1
    :class:`torchpm.MeshUnitsState` for ``sim.resume(state)``. From one
    whole file that records its slot layout (``mesh_slots``: a rank's own file of a
    process grid), every particle goes back to its slot among the rank's empty ones,
    since the run's later migrations fill empty slots in order.

    Checks compatibility first (:func:`check_restart`). A whole snapshot must hold every
    particle exactly once; a part of one (``read_snapshot(..., file_index=rank)`` or
    ``share=(rank, world)``, for a process grid whose ``resume`` sends the particles to
    their owners) must hold ids in ``[0, N)`` without repeats.
    """
    from .simulation import MeshUnitsState

    check_restart(snapshot, sim)
    ids = snapshot.ids
    n = sim.n_total
    if snapshot.total and snapshot.total != n:
        raise ValueError(f"snapshot holds {snapshot.total} particles, the simulation has {n}")
    ordered = torch.sort(ids).values
    if ids.numel() == n:
        if not torch.equal(ordered, torch.arange(n)):
            raise ValueError("snapshot particle ids are not exactly 0 .. N-1 (missing or repeated particles)")
    elif ids.numel() and (int(ordered[0]) < 0 or int(ordered[-1]) >= n or bool((ordered[1:] == ordered[:-1]).any())):
        raise ValueError(f"snapshot part holds ids outside [0, {n}) or repeated ids")
    # The snapshot's float64 a, snapped to the grid value the run uses.
    a = sim.scale_factors[scale_factor_index(sim, snapshot.a)]
    positions, momenta = snapshot.mesh_positions, snapshot.mesh_momenta
    # A damaged file's particles are refused here, not by the run's first paint or migration.
    from .distributed.particles import _within_reach

    bad = ~(_within_reach(positions).all(-1) & torch.isfinite(momenta).all(-1))
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0, 0])
        where = snapshot.files[0] if len(snapshot.files) == 1 else f"{snapshot.files[0]} (a set of {len(snapshot.files)} files)"
        raise ValueError(
            f"snapshot {where!r}: {int(bad.sum())} particles have a non-finite position or momentum, "
            f"or a position at or beyond +-2^40 cells; the first is id {int(ids[first])} at {positions[first].tolist()} "
            "(the file is damaged)"
        )
    if snapshot.mesh_slots is not None and snapshot.slot_count is not None:
        # One rank's file: the particles back in the slots the run held them in, the
        # empty slots as a migration leaves them (next to their neighbours, zero
        # momentum, id -1). The run's later migrations fill empty slots by position
        # and slot order, so this layout is what makes the resumed run bit-identical.
        slots, count = snapshot.mesh_slots, snapshot.slot_count
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= count
                              or torch.unique(slots).numel() != slots.numel()):
            raise ValueError(f"snapshot {snapshot.files[0]!r}: its slot layout (MeshSlots) is not "
                             f"{slots.numel()} distinct slots in [0, {count})")
        positions, momenta, ids = _in_slots(positions, momenta, ids, slots, count, sim.force_mesh.padding_position)
    return MeshUnitsState(positions[None], momenta[None], a, ids[None])


def _in_slots(positions, momenta, ids, slots, count: int, padding_position):
    """Particles ``(N, 3)``, ``(N, 3)``, ``(N,)`` placed at ``slots`` among ``count``
    slots; the other slots empty as a migration leaves them (next to their neighbours,
    :func:`torchpm.distributed.particles.place_empty_slots`, or at ``padding_position``
    when there is no particle; zero momentum, id -1)."""
    from .distributed.particles import place_empty_slots

    corner = torch.tensor(padding_position, dtype=positions.dtype, device=positions.device)
    ids = ids.new_full((count,), -1).index_copy(0, slots, ids)
    positions = corner.expand(count, 3).index_copy(0, slots, positions)
    return (place_empty_slots(positions[None], ids[None], corner)[0],
            momenta.new_zeros(count, 3).index_copy(0, slots, momenta), ids)


# ----------------------------------------------------------------------------------
# Mesh fields (densities) in HDF5.


def write_fields(
    path,
    fields: dict,
    box_size,
    *,
    mesh=None,
    a: float | None = None,
    attributes: dict | None = None,
    overwrite: bool = False,
) -> str:
    """Writes mesh fields (e.g. densities) to one HDF5 file, one dataset per field of shape
    ``(B, nx, ny, nz)`` (the global mesh) in the fields' dtype, with the attributes
    ``BoxSize`` (3 values, Mpc/h), ``Time`` and ``Redshift`` (when ``a`` is given), and
    ``attributes`` (numbers and strings) on the file.

    Args:
        path: the file; written under a temporary name and renamed once complete.
        fields: ``{name: (B, *local_real_shape) real tensor}``; on a process grid each
            rank passes its block of each field (e.g. ``sim.density(state)``).
        box_size: the box side(s) in Mpc/h.
        mesh: the mesh the fields live on (``sim.force_mesh``), or None for whole fields
            on this device. On a grid the call is collective: the ranks agree on the path,
            the fields' names, batch and dtype, the box, ``a`` and ``attributes`` (one
            rank's bad or different argument raises on every rank), then write their
            blocks into the one file in turn (the folder must be shared by the ranks), a
            failure on any rank raises on every rank and leaves no file. A rank passing
            None writes alone, like a single device.
        overwrite: replace an existing file.

    Returns the path. :func:`read_fields` reads the file whole or in blocks.
    """
    from .mesh import as_box_size

    h5py = _h5py()
    error = None
    try:
        path = os.fspath(path)
    except TypeError:
        path, error = None, f"`path` must be a file name, got {path!r}"
    if not isinstance(fields, dict) or not fields:
        error = error or f"`fields` must be a non-empty dict of name -> tensor, got {type(fields).__name__}"
    names = list(fields) if error is None else []
    local = tuple(mesh.local_real_shape) if mesh is not None else None
    shapes = []
    for name in names:
        field = fields[name]
        if isinstance(field, torch.Tensor):  # (what the ranks agree on: the bad one included)
            shapes.append((str(name), int(field.shape[0]) if field.dim() else -1, str(field.dtype)))
        if not isinstance(name, str) or not name or "/" in name:
            error = error or f"field names must be non-empty strings without '/', got {name!r}"
        elif not isinstance(field, torch.Tensor) or field.dim() != 4 or field.is_complex() \
                or not field.is_floating_point():
            error = error or (f"field {name!r} must be a real floating-point tensor (B, nx, ny, nz), got "
                              f"{getattr(field, 'shape', type(field).__name__)}")
        elif local is None and tuple(field.shape[1:]) != tuple(fields[names[0]].shape[1:]):
            error = error or (f"field {name!r} of shape {tuple(field.shape)} is on another mesh than field "
                              f"{names[0]!r} {tuple(fields[names[0]].shape)}")
        elif local is not None and tuple(field.shape[1:]) != local:
            error = error or (f"field {name!r} of shape {tuple(field.shape)} is not this rank's block "
                              f"(B, {', '.join(map(str, local))}) of the mesh {tuple(mesh.global_shape)}")
        elif not bool(torch.isfinite(field).all()):
            error = error or f"field {name!r} holds NaN or infinite values"
    try:
        box = as_box_size(box_size)
    except ValueError as exc:
        box, error = None, error or str(exc)
    if a is not None and (isinstance(a, bool) or not isinstance(a, numbers.Real) or not 0 < float(a) <= 1):
        error = error or f"`a` must be None or a scale factor in (0, 1], got {a!r}"
    if attributes is not None and not isinstance(attributes, dict):
        error = error or f"`attributes` must be None or a dict of strings to numbers or strings, got {attributes!r}"
        attributes = {}
    for key, value in (attributes or {}).items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
            error = error or f"`attributes` must map strings to numbers or strings, got {key!r}: {value!r}"
    if path is not None and os.path.exists(path) and not overwrite:
        error = error or f"{path!r} exists; pass overwrite=True to replace it"
    distributed = mesh is not None and not mesh.is_local
    if distributed:
        # The file's layout follows from these: the ranks must agree before writing.
        # (the attributes too: the first rank alone writes them)
        mesh.agree("write_fields", [("`path`", path and os.path.abspath(path)), ("the fields (name, batch, dtype)", shapes),
                                    ("`box_size`", box), ("`a`", None if a is None or error else repr(float(a))),
                                    ("`attributes`", sorted((str(key), repr(value)) for key, value in
                                                            (attributes or {}).items()))], error)
    elif error:
        raise ValueError(f"write_fields: {error}")
    global_shape = tuple(mesh.global_shape) if mesh is not None else tuple(fields[names[0]].shape[1:])
    offset = tuple(mesh.local_real_offset) if mesh is not None else (0, 0, 0)
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.partial")
    rank, size = (mesh.grid.rank, mesh.grid.size) if distributed else (0, 1)

    def write(create: bool):
        with h5py.File(temporary, "w" if create else "r+") as handle:
            for name in names:
                field = fields[name].detach()
                if create:
                    dataset = handle.create_dataset(name, (field.shape[0], *global_shape),
                                                    dtype="f8" if field.dtype == torch.float64 else "f4")
                else:
                    dataset = handle[name]
                index = (slice(None), *(slice(o, o + n) for o, n in zip(offset, field.shape[1:])))
                dataset[index] = field.to(torch.float64 if field.dtype == torch.float64 else torch.float32).cpu().numpy()
            if create:
                handle.attrs["BoxSize"] = list(box)
                handle.attrs["mesh_shape"] = list(global_shape)
                if a is not None:
                    handle.attrs["Time"] = float(a)
                    handle.attrs["Redshift"] = 1.0 / float(a) - 1.0
                for key, value in (attributes or {}).items():
                    handle.attrs[key] = value
                from . import __version__

                handle.attrs["torchpm_version"] = __version__

    for turn in range(size):
        failure = None
        if rank == turn:
            try:
                write(create=turn == 0)
                if turn == size - 1:
                    os.replace(temporary, path)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                failure = f"rank {rank} could not write {path!r}: {type(exc).__name__}: {exc}"
                try:
                    os.remove(temporary)
                except OSError:
                    pass
        if distributed:
            mesh.raise_together(failure, OSError, operation="write_fields")
        elif failure:
            raise OSError(f"write_fields: {failure}")
    return path


def read_fields(path, *, mesh=None, names=None) -> tuple[dict, dict]:
    """Reads a file of :func:`write_fields`: ``({name: (B, *block) tensor}, attributes)``,
    each field whole, or this rank's block of ``mesh`` (e.g. ``sim.force_mesh``; each
    rank reads only its block). ``names``: a field's name or the names to read (default: all)."""
    h5py = _h5py()
    with h5py.File(os.fspath(path), "r") as handle:
        attributes = {key: _python(value) for key, value in handle.attrs.items()}
        available = [name for name in handle if isinstance(handle[name], h5py.Dataset)]
        wanted = available if names is None else [names] if isinstance(names, str) else list(names)
        missing = [name for name in wanted if name not in available]
        if missing:
            raise KeyError(f"read_fields: {path!r} holds no field {missing[0]!r} (it holds {available})")
        result = {}
        for name in wanted:
            dataset = handle[name]
            if mesh is not None and tuple(dataset.shape[1:]) != tuple(mesh.global_shape):
                raise ValueError(f"read_fields: field {name!r} of {path!r} is on a {tuple(dataset.shape[1:])} mesh, "
                                 f"`mesh` is {tuple(mesh.global_shape)}")
            if mesh is None:
                values = dataset[...]
            else:
                block = tuple(slice(o, o + n) for o, n in zip(mesh.local_real_offset, mesh.local_real_shape))
                values = dataset[(slice(None), *block)]
            result[name] = torch.from_numpy(values)
    return result, attributes
