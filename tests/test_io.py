"""Gadget-4 HDF5 snapshots: the layout read by an independent reader (pynbody),
round trips, multi-file sets written by 2 gloo ranks, atomic writes, and exact restart."""

from __future__ import annotations

import math
import re
import os
import time

import numpy as np
import pytest
import torch

import torchpm
from torchpm.io import check_restart, read_snapshot, restart_state, simulation_config, write_snapshot

from _spawn import run_world

import h5py  # noqa: E402  (installed by `make deps`)

SCALE_FACTORS = [0.3, 0.5, 0.7, 1.0]


def _sim(dtype=torch.float32, **options):
    settings = dict(n_particles=(6, 5, 4), box_size=(60.0, 50.0, 40.0), mesh_factor=2, a_start=0.1,
                    steps=SCALE_FACTORS, cosmology=torchpm.Planck15(), dtype=dtype)
    settings.update(options)
    return torchpm.Simulation(**settings)


def _cubic_sim(dtype=torch.float32):
    return _sim(dtype, n_particles=6, box_size=60.0)


# ----------------------------------------------------------------------------------
# The layout, read by a reader we did not write.


def test_pynbody_reads_the_layout(tmp_path):
    pynbody = pytest.importorskip("pynbody")  # the independent reader (`make test-deps`)
    sim = _cubic_sim()
    state = sim(sim.white_noise(seed=4), until=0.5)
    path = str(tmp_path / "snap_000.hdf5")
    write_snapshot(path, state, sim)
    snap = pynbody.load(path)
    assert len(snap) == len(snap.dm) == sim.n_total
    order = np.argsort(np.asarray(snap.dm["iord"]))
    np.testing.assert_array_equal(np.asarray(snap.dm["iord"])[order], np.arange(sim.n_total))
    # Positions: the stored values are Mpc/h comoving; pynbody's physical Mpc is x a / h.
    h = float(sim.cosmology.h)
    a = 0.5
    np.testing.assert_array_equal(np.asarray(snap.dm["pos"])[order], state.positions[0].numpy())
    np.testing.assert_allclose(snap.dm["pos"].in_units("Mpc")[order], state.positions[0].numpy() * a / h, rtol=1e-5)
    # Velocities: Gadget's km/s / sqrt(a); pynbody's physical km/s is the peculiar velocity 100 p / a.
    expected = state.momenta[0].numpy().astype(np.float64) * 100.0 / a
    np.testing.assert_allclose(snap.dm["vel"].in_units("km s**-1")[order], expected, rtol=1e-5, atol=1e-4)
    # Header: time, cosmology, box.
    assert snap.properties["a"] == pytest.approx(a, rel=1e-12)
    assert snap.properties["h"] == pytest.approx(h, rel=1e-12)
    assert snap.properties["omegaM0"] == pytest.approx(float(sim.cosmology.Omega_m), rel=1e-12)
    # (Gadget's Mpc, 3.085678e24 cm, differs from pynbody's in the 7th digit)
    assert float(snap.properties["boxsize"].in_units("Mpc a h**-1")) == pytest.approx(60.0, rel=1e-6)
    # Mass: Omega_m rho_crit V / N, with rho_crit = 3 H0^2 / (8 pi G) from SI constants.
    G, megaparsec, solar_mass = 6.67430e-11, 3.0856775814913673e22, 1.988409870698051e30
    rho_crit = 3 * (1e5 / megaparsec) ** 2 / (8 * math.pi * G) * megaparsec**3 / solar_mass  # h^2 Msun / Mpc^3
    mass = float(sim.cosmology.Omega_m) * rho_crit * 60.0**3 / sim.n_total  # Msun / h
    # (Gadget's unit system, which the file declares, takes Msun = 1.989e33 g: 3e-4 from the SI value)
    np.testing.assert_allclose(snap.dm["mass"].in_units("Msol h**-1"), mass, rtol=5e-4)



def test_header_attributes_by_the_gadget_spec(tmp_path):
    sim = _cubic_sim(torch.float64)
    state = sim(sim.white_noise(seed=2), until=0.7)
    path = str(tmp_path / "snap.hdf5")
    write_snapshot(path, state, sim)
    with h5py.File(path, "r") as handle:
        header = dict(handle["Header"].attrs)
        assert list(header["NumPart_ThisFile"]) == [0, 216, 0, 0, 0, 0]
        assert list(header["NumPart_Total"]) == [0, 216, 0, 0, 0, 0]
        assert list(header["NumPart_Total_HighWord"]) == [0] * 6
        assert header["NumFilesPerSnapshot"] == 1
        assert header["Time"] == 0.7 and header["Redshift"] == pytest.approx(1 / 0.7 - 1, rel=1e-15)
        assert header["BoxSize"] == 60.0 and header["Flag_DoublePrecision"] == 1
        assert header["MassTable"][1] == pytest.approx(27.7536627 * float(sim.cosmology.Omega_m) * 60.0**3 / 216, rel=1e-12)
        assert header["Omega0"] + header["OmegaLambda"] == pytest.approx(1.0, abs=1e-12)
        assert handle["PartType1/Coordinates"].dtype == np.float64
        assert handle["PartType1/ParticleIDs"].dtype == np.uint64
        velocities = handle["PartType1/Velocities"][:]
    np.testing.assert_allclose(velocities, state.momenta[0].numpy() * 100 / 0.7**1.5, rtol=1e-14)


def test_round_trip_drops_padding_and_keeps_bits(tmp_path):
    sim = _sim()
    state = sim(sim.white_noise(batch=2, seed=1), until=0.5, return_mesh_units=True)
    ids = torch.arange(sim.n_total).expand(2, -1).clone()
    ids[:, ::7] = -1  # padding slots: not written
    padded = torchpm.SimulationState(state.positions, state.momenta, state.a, ids)
    path = str(tmp_path / "snap.hdf5")
    write_snapshot(path, padded, sim, mesh_units=True, member=1, chunk_size=17)
    snap = read_snapshot(path)
    keep = ids[1] >= 0
    assert torch.equal(snap.ids, ids[1][keep])
    assert torch.equal(snap.mesh_positions, state.positions[1][keep])  # the run's bits, unwrapped
    assert torch.equal(snap.mesh_momenta, state.momenta[1][keep])
    physical = sim.to_physical(state.positions, state.momenta, state.a)
    assert torch.equal(snap.positions, physical.positions[1][keep])
    torch.testing.assert_close(snap.momenta, physical.momenta[1][keep], rtol=1e-6, atol=1e-9)
    assert snap.a == 0.5 and snap.step == 2
    assert snap.config["n_particles"] == [6, 5, 4] and snap.config["steps"] == SCALE_FACTORS
    box = torch.tensor(sim.box_size)
    assert bool(((snap.positions >= 0) & (snap.positions < box)).all())
    # a share of the particles, in file order
    part = read_snapshot(path, share=(1, 3))
    n = int(keep.sum())
    assert torch.equal(part.ids, snap.ids[n // 3: 2 * n // 3])


def test_existing_file_is_kept_and_failed_write_leaves_nothing(tmp_path, monkeypatch):
    sim = _sim()
    state = sim(sim.white_noise(seed=1), until=0.3, return_mesh_units=True)
    path = str(tmp_path / "snap.hdf5")
    write_snapshot(path, state, sim, mesh_units=True)
    before = open(path, "rb").read()
    with pytest.raises(FileExistsError, match="overwrite"):
        write_snapshot(path, state, sim, mesh_units=True)
    calls = []

    def broken(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return torchpm.Simulation.to_physical(sim, *args)

    monkeypatch.setattr(sim, "to_physical", broken)
    with pytest.raises(OSError, match="No space"):
        write_snapshot(path, state, sim, mesh_units=True, overwrite=True, chunk_size=10)
    calls.clear()
    with pytest.raises(OSError, match="No space"):
        write_snapshot(str(tmp_path / "new.hdf5"), state, sim, mesh_units=True, chunk_size=10)
    assert len(calls) == 2
    assert open(path, "rb").read() == before  # the old snapshot is intact
    assert sorted(os.listdir(tmp_path)) == ["snap.hdf5"]  # no partial file, no temporary left


def test_missing_h5py_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_h5py(name, *args, **kwargs):
        if name == "h5py":
            raise ImportError("no h5py")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_h5py)
    with pytest.raises(ImportError, match="pip install h5py"):
        read_snapshot(str(tmp_path / "x.hdf5"))


def test_explicit_multifile_set_without_distributed(tmp_path):
    sim = _sim(torch.float64)
    whole = sim(sim.white_noise(seed=3), until=0.7, return_mesh_units=True)
    n = sim.n_total
    cuts = [0, 40, 41, n]  # uneven files, one holding a single particle
    for index in range(3):
        part = slice(cuts[index], cuts[index + 1])
        local = torchpm.SimulationState(whole.positions[:, part], whole.momenta[:, part], whole.a,
                                        torch.arange(n)[part][None])
        write_snapshot(str(tmp_path / "snap_003.hdf5"), local, sim, mesh_units=True, file_index=index,
                       num_files=3, num_part_total=n)
    assert sorted(os.listdir(tmp_path)) == [f"snap_003.{i}.hdf5" for i in range(3)]
    snap = read_snapshot(str(tmp_path / "snap_003"))
    assert torch.equal(snap.mesh_positions, whole.positions[0]) and torch.equal(snap.ids, torch.arange(n))
    for parts in (2, 5):
        pieces = [read_snapshot(str(tmp_path / "snap_003.2.hdf5"), share=(i, parts)) for i in range(parts)]
        assert torch.equal(torch.cat([p.mesh_momenta for p in pieces]), whole.momenta[0])
    # a reader's share, for a process grid whose resume sends particles to their owners
    share = restart_state(read_snapshot(str(tmp_path / "snap_003"), share=(1, 2)), sim)
    assert torch.equal(share.ids[0], torch.arange(n // 2, n))
    assert torch.equal(share.positions[0], whole.positions[0, n // 2:])
    os.rename(tmp_path / "snap_003.1.hdf5", tmp_path / "moved.hdf5")
    with pytest.raises(FileNotFoundError, match=r"one of 3 files.*snap_003\.1\.hdf5"):
        read_snapshot(str(tmp_path / "snap_003"))
    with pytest.raises(ValueError, match="num_part_total"):
        write_snapshot(str(tmp_path / "other.hdf5"), local, sim, file_index=0, num_files=2)
    with pytest.raises(ValueError, match="ids"):
        write_snapshot(str(tmp_path / "other.hdf5"), whole._replace(ids=None), sim, file_index=0, num_files=2,
                       num_part_total=n)
    # a single file beside a multi-file set of its name (one left by another run): refused
    os.rename(tmp_path / "moved.hdf5", tmp_path / "snap_003.1.hdf5")
    write_snapshot(str(tmp_path / "snap_003.hdf5"), whole, sim, mesh_units=True)
    for name in ("snap_003.hdf5", "snap_003"):
        with pytest.raises(ValueError, match=r"single-file snapshot, but the multi-file set .*snap_003\.0\.hdf5"):
            read_snapshot(str(tmp_path / name))
    assert read_snapshot(str(tmp_path / "snap_003.0.hdf5")).files[-1].endswith("snap_003.2.hdf5")


# ----------------------------------------------------------------------------------
# Exact restart.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_restart_from_snapshot_is_bit_identical(tmp_path, dtype):
    sim = _sim(dtype)
    noise = sim.white_noise(seed=11)
    whole = sim(noise, return_mesh_units=True)
    middle = sim(noise, until=0.5, return_mesh_units=True)
    path = str(tmp_path / "snap_000.hdf5")
    write_snapshot(path, middle, sim, mesh_units=True)
    fresh = _sim(dtype)  # a new process would build its own Simulation
    steps = []
    resumed = fresh.resume(restart_state(read_snapshot(path), fresh), mesh_units=True, return_mesh_units=True,
                           callback=lambda step, a: steps.append((step, a)))
    assert steps == [(3, 0.7), (4, 1.0)]
    assert resumed.a == whole.a == 1.0
    assert torch.equal(resumed.positions, whole.positions)
    assert torch.equal(resumed.momenta, whole.momenta)
    physical = fresh.resume(restart_state(read_snapshot(path), fresh), mesh_units=True)
    assert torch.equal(physical.positions, sim(noise).positions)


def test_forward_until_and_resume_in_memory():
    sim = _sim(torch.float64)
    noise = sim.white_noise(seed=5)
    whole = sim(noise, return_mesh_units=True)
    state = sim(noise, until=0.1, return_mesh_units=True)  # the LPT state
    for a in SCALE_FACTORS:
        state = sim.resume(state, mesh_units=True, until=a, return_mesh_units=True)
    assert torch.equal(state.positions, whole.positions)
    with pytest.raises(ValueError, match="not one of th(e|is) simulation's scale factors"):
        sim(noise, until=0.55)
    with pytest.raises(ValueError, match="before"):
        sim.resume(state, until=0.5)
    # a state of other particles: too few, too many, an id twice or out of range
    n = state.positions.shape[1]
    SimulationState = torchpm.SimulationState
    early = sim(noise, until=0.5, return_mesh_units=True)
    half = SimulationState(early.positions[:, : n // 2], early.momenta[:, : n // 2], early.a, None)
    with pytest.raises(ValueError, match=rf"resume: batch member 0 of the state holds {n // 2} particles, the simulation has {n}"):
        sim.resume(half, mesh_units=True)
    double = SimulationState(early.positions.repeat(1, 2, 1), early.momenta.repeat(1, 2, 1), early.a, None)
    with pytest.raises(ValueError, match=f"holds {2 * n} particles"):
        sim.resume(double, mesh_units=True)
    for bad in (0, n):
        ids = torch.arange(n).unsqueeze(0).clone()
        ids[0, 3] = bad
        with pytest.raises(ValueError, match=rf"(are not each of 0 \.\. {n - 1} once|the id {n}, outside 0 \.\. {n - 1})"):
            sim.resume(SimulationState(early.positions, early.momenta, early.a, ids), mesh_units=True)
    # one device gives every slot mass: an empty slot (id -1) besides the N particles is refused
    padded = SimulationState(torch.cat([early.positions, early.positions[:, :1]], 1),
                             torch.cat([early.momenta, early.momenta[:, :1]], 1), early.a,
                             torch.cat([torch.arange(n), torch.tensor([-1])]).unsqueeze(0))
    with pytest.raises(ValueError, match="empty slots"):
        sim.resume(padded, mesh_units=True)
    # density: more particles than the run has is refused on one device as on a grid
    with pytest.raises(ValueError, match=f"density: batch member 0 of the state holds {2 * n} particles"):
        sim.density(double.positions)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(box_size=(61.0, 50.0, 40.0)), "box_size"),
        (dict(n_particles=(6, 5, 5)), "n_particles"),
        (dict(mesh_factor=1), "mesh_factor"),
        (dict(dtype=torch.float64), "dtype"),
        (dict(cosmology=torchpm.Planck18()), "cosmology_"),
        (dict(gradient="exact"), "gradient"),
        (dict(steps=[0.3, 0.55, 1.0]), "not one of this simulation's scale factors"),
    ],
)
def test_restart_refuses_incompatible_snapshots(tmp_path, options, match):
    sim = _sim()
    state = sim(sim.white_noise(seed=1), until=0.5, return_mesh_units=True)
    path = str(tmp_path / "snap.hdf5")
    write_snapshot(path, state, sim, mesh_units=True)
    other = _sim(**options)
    with pytest.raises(ValueError, match=match):
        check_restart(read_snapshot(path), other)


def test_restart_needs_the_exact_fields(tmp_path):
    sim = _sim()
    state = sim(sim.white_noise(seed=1), until=0.5)  # Mpc/h only: no exact restart data
    path = str(tmp_path / "snap.hdf5")
    write_snapshot(path, state, sim)
    with pytest.raises(ValueError, match="no exact restart data"):
        restart_state(read_snapshot(path), sim)


def test_damaged_or_mixed_snapshots_are_refused_naming_the_file(tmp_path):
    """A particle with a NaN momentum or an absurd position is refused when the snapshot is
    restored (not by the run's first paint, or silently moved by a grid's wrap); a truncated
    file of a set is named; a set whose files come from two runs is refused."""
    import h5py

    sim = _sim(torch.float64)
    state = sim(sim.white_noise(seed=1), until=0.5, return_mesh_units=True)
    for field, row, value in (("MeshPositions", 5, 1e30), ("MeshMomenta", 7, float("nan")),
                              ("MeshPositions", 2, float("-inf"))):
        path = str(tmp_path / f"damaged_{field}_{row}.hdf5")
        write_snapshot(path, state, sim, mesh_units=True)
        with h5py.File(path, "r+") as handle:
            handle["torchpm"][field][row, 0] = value
        with pytest.raises(ValueError, match=rf"1 particles have a non-finite .* the first is id {row} .*damaged"):
            restart_state(read_snapshot(path), sim)
    n = sim.n_total
    for seed, folder in ((1, "one"), (2, "two")):
        (tmp_path / folder).mkdir()
        config = dict(simulation_config(sim), seed=seed)
        run = sim(sim.white_noise(seed=seed), until=0.5, return_mesh_units=True)
        for index in range(2):
            part = slice(index * n // 2, (index + 1) * n // 2)
            local = torchpm.SimulationState(run.positions[:, part], run.momenta[:, part], run.a,
                                            torch.arange(n)[part][None])
            write_snapshot(str(tmp_path / folder / "snap.hdf5"), local, sim, mesh_units=True, file_index=index,
                           num_files=2, num_part_total=n, config=config)
    os.replace(tmp_path / "two" / "snap.1.hdf5", tmp_path / "one" / "snap.1.hdf5")
    with pytest.raises(ValueError, match=r"its file .*snap\.1\.hdf5' was written by another run"):
        read_snapshot(str(tmp_path / "one" / "snap"))
    path = tmp_path / "two" / "snap.0.hdf5"
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)
    with pytest.raises(OSError, match=r"cannot read .*two/snap\.0\.hdf5"):
        read_snapshot(str(tmp_path / "two" / "snap.0.hdf5"))
    # one rank's own file of the mixed set (how a grid resumes) is refused too
    with pytest.raises(ValueError, match=r"its file .*snap\.1\.hdf5' was written by another run .*config seed 2 "
                                         r"against 1"):
        read_snapshot(str(tmp_path / "one" / "snap"), file_index=0)


def test_a_state_a_reader_would_refuse_is_not_written(tmp_path):
    """A NaN or infinite particle, an id out of range or an id twice: refused before any
    file is written (the snapshot was written, and its reader refused it as damaged). An
    empty slot (id -1) is not read: a NaN there is written as nothing."""
    sim = _sim(torch.float64)
    state = sim(sim.white_noise(seed=1), until=0.5, return_mesh_units=True)
    n = sim.n_total
    cases = []
    for name, value in (("positions", float("nan")), ("momenta", float("inf"))):
        broken = getattr(state, name).clone()
        broken[0, 3, 1] = value
        cases.append((state._replace(**{name: broken}), f"the state's {name} of member 0 are not finite"))
    twice = state.ids.clone()
    twice[0, 4] = 9
    cases += [(state._replace(ids=twice), "`state.ids` of member 0 hold the id 9 twice"),
              (state._replace(ids=state.ids.double()), "`state.ids` must be integers (-1 for an empty slot), got "
                                                       "torch.float64"),
              (state._replace(ids=state.ids + 1), f"`state.ids` must be below the simulation's {n} particles")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            write_snapshot(str(tmp_path / "bad.hdf5"), bad, sim, mesh_units=True)
        assert not os.listdir(tmp_path)
    # an empty slot with NaN values, and its particle's values: the file holds the others
    padded = torchpm.SimulationState(torch.cat([state.positions, torch.full((1, 1, 3), float("nan"))], 1),
                                     torch.cat([state.momenta, torch.full((1, 1, 3), float("nan"))], 1), state.a,
                                     torch.cat([state.ids, torch.full((1, 1), -1)], 1))
    write_snapshot(str(tmp_path / "padded.hdf5"), padded, sim, mesh_units=True)
    snap = read_snapshot(str(tmp_path / "padded.hdf5"))
    assert torch.equal(snap.ids, torch.arange(n)) and torch.equal(snap.mesh_positions, state.positions[0])
    # ids of any integer type, as before the checks
    write_snapshot(str(tmp_path / "int16.hdf5"), state._replace(ids=state.ids.to(torch.int16)), sim, mesh_units=True)
    assert torch.equal(read_snapshot(str(tmp_path / "int16.hdf5")).ids, torch.arange(n))


def test_restart_rebuilds_the_slot_layout_and_refuses_a_broken_one(tmp_path):
    """A state with empty slots (as a rank of a grid holds it) comes back from its file
    with every particle in its slot and the empty slots as a migration leaves them; a
    file whose slot record repeats a slot is refused."""
    sim = _sim(torch.float64)
    state = sim(sim.white_noise(seed=2), until=0.5, return_mesh_units=True)
    n = sim.n_total
    slots = torch.randperm(n + 7, generator=torch.Generator().manual_seed(3))[:n].sort().values
    spread = lambda values, fill: torch.full((1, n + 7, *values.shape[2:]), fill, dtype=values.dtype).index_copy(
        1, slots, values)
    padded = torchpm.SimulationState(spread(state.positions, 0.0), spread(state.momenta, 0.0), state.a,
                                     spread(state.ids, -1))
    path = str(tmp_path / "snap.hdf5")
    write_snapshot(path, padded, sim, mesh_units=True)
    snapshot = read_snapshot(path)
    assert snapshot.slot_count == n + 7 and torch.equal(snapshot.mesh_slots, slots)
    restored = restart_state(snapshot, sim)
    assert torch.equal(restored.ids, padded.ids) and torch.equal(restored.momenta, padded.momenta)
    # Empty slots as a migration leaves them: at the centre of the cell of the nearest
    # particle before them (after them at the start), written out slot by slot.
    expected = padded.positions.clone()
    occupied = [i for i in range(n + 7) if int(padded.ids[0, i]) >= 0]
    for i in range(n + 7):
        if int(padded.ids[0, i]) < 0:
            before = [j for j in occupied if j < i]
            j = before[-1] if before else occupied[0]
            expected[0, i] = torch.floor(padded.positions[0, j]) + 0.5
    assert torch.equal(restored.positions, expected)
    # Without empty slots nothing is recorded: the file order is the layout.
    unpadded = str(tmp_path / "full.hdf5")
    write_snapshot(unpadded, state, sim, mesh_units=True)
    assert read_snapshot(unpadded).mesh_slots is None
    assert torch.equal(restart_state(read_snapshot(unpadded), sim).positions, state.positions)
    with h5py.File(path, "r+") as handle:
        handle["torchpm/MeshSlots"][1] = handle["torchpm/MeshSlots"][0]
    with pytest.raises(ValueError, match="slot layout"):
        restart_state(read_snapshot(path), sim)


# ----------------------------------------------------------------------------------
# Multi-file sets from 2 gloo ranks.


def make_context(world_size):
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "world_size": world_size}


def _rank_share(sim, rank, world_size):
    """This rank's particles: a contiguous slice of the whole run, plus padding slots."""
    whole = sim(sim.white_noise(seed=9), until=0.5, return_mesh_units=True)
    n = sim.n_total
    begin, end = n * rank // world_size, n * (rank + 1) // world_size
    pad = 3 + rank
    positions = torch.cat([whole.positions[:, begin:end], torch.zeros(1, pad, 3)], 1)
    momenta = torch.cat([whole.momenta[:, begin:end], torch.zeros(1, pad, 3)], 1)
    ids = torch.cat([torch.arange(begin, end), torch.full((pad,), -1)])[None]
    return whole, torchpm.SimulationState(positions, momenta, whole.a, ids)


def _expect_together(call, *fragments):
    """``call`` raises a ValueError holding every fragment, well before the pool's
    collective timeout (60 s)."""
    start = time.monotonic()
    try:
        call()
    except ValueError as error:
        assert all(fragment in str(error) for fragment in fragments), str(error)
        assert time.monotonic() - start < 20, f"raised after {time.monotonic() - start:.0f} s: {error}"
    else:
        raise AssertionError(f"no error; expected one with {fragments}")


def run_case(case_id, ctx):
    import torch.distributed as dist

    kind, folder = case_id.split(":", 1)
    rank, world_size = ctx["rank"], ctx["world_size"]
    sim = _sim()
    whole, local = _rank_share(sim, rank, world_size)
    path = os.path.join(folder, "snap_000.hdf5")
    if kind == "write":
        written = write_snapshot(path, local, sim, mesh_units=True)
        assert written == os.path.join(folder, f"snap_000.{rank}.hdf5")
        dist.barrier()
        snap = read_snapshot(path)  # every rank reads the whole set
        assert torch.equal(snap.ids, torch.arange(sim.n_total))
        assert torch.equal(snap.mesh_positions, whole.positions[0])
        share = read_snapshot(path, share=(rank, world_size))
        n = sim.n_total
        assert torch.equal(share.ids, torch.arange(n * rank // world_size, n * (rank + 1) // world_size))
        # the whole state on every rank (a gathered one) would write each particle twice:
        # refused on every rank, nothing written; from one rank alone, with
        # file_index=0, num_files=1, it is one whole file
        gathered = os.path.join(folder, "gathered.hdf5")
        try:
            write_snapshot(gathered, whole, sim, mesh_units=True)
        except ValueError as error:
            assert f"would hold {2 * n} particles, but the simulation has {n}" in str(error), str(error)
            assert "file_index=0, num_files=1" in str(error), str(error)
        else:
            raise AssertionError("the whole state written by every rank was not refused")
        dist.barrier()
        assert not [name for name in os.listdir(folder) if name.startswith("gathered")]
        if rank == 0:
            write_snapshot(gathered, whole, sim, mesh_units=True, file_index=0, num_files=1)
            assert torch.equal(read_snapshot(gathered).mesh_positions, whole.positions[0])
        dist.barrier()
    elif kind == "fail":
        def fails_on_both(call, rank_1_reason):
            """``call`` fails on rank 1 for ``rank_1_reason`` and on rank 0 for it."""
            try:
                call()
            except (OSError, RuntimeError) as error:
                expected = rank_1_reason if rank == 1 else "another rank failed"
                assert expected in str(error), str(error)
            else:
                raise AssertionError("the write should have failed on every rank")
            dist.barrier()

        # rank 1's file exists already: it refuses, and rank 0 must not leave its own file behind
        if rank == 1:
            open(os.path.join(folder, "snap_000.1.hdf5"), "w").close()
        dist.barrier()
        fails_on_both(lambda: write_snapshot(path, local, sim, mesh_units=True), "exists")
        assert not os.path.exists(os.path.join(folder, "snap_000.0.hdf5"))
        assert not [name for name in os.listdir(folder) if name.endswith(".tmp")]
        # rank 1's file name is a directory, with overwrite=True: its rename failed after
        # rank 0's (a half set, success on rank 0); now both fail before any rename
        named = os.path.join(folder, "dir.hdf5")
        if rank == 1:
            os.makedirs(os.path.join(folder, "dir.1.hdf5"))
        dist.barrier()
        fails_on_both(lambda: write_snapshot(named, local, sim, mesh_units=True, overwrite=True), "is a directory")
        assert sorted(name for name in os.listdir(folder) if name.startswith(("dir", ".dir"))) == ["dir.1.hdf5"]
        # rank 1 asks for a batch member it does not have, or passes a scale factor off the
        # steps: both ranks raise, neither waits or writes
        other = os.path.join(folder, "other.hdf5")
        for arguments, reason in [(dict(member=rank), "`member` must be an int in [0, 1), got 1"),
                                  (dict(state=local._replace(a=0.37) if rank == 1 else local), "0.37")]:
            arguments = dict(dict(state=local, member=0), **arguments)
            # (rank 1's error, on both ranks)
            _expect_together(lambda: write_snapshot(other, arguments.pop("state"), sim, mesh_units=True, **arguments),
                             "rank 1", reason, "No file of the set")
            dist.barrier()
            assert not [name for name in os.listdir(folder) if name.startswith("other")]
        # a NaN particle on rank 1, ids of rank 0's on rank 1, or an id out of range: a reader
        # refused the set as damaged, which was written without a word
        positions, ids = local.positions.clone(), local.ids.clone()
        positions[0, 0, 1] = float("nan")
        from_zero = torch.where(ids >= 0, ids - ids[ids >= 0].min(), ids)  # each rank's from 0
        for state, reason in [(local._replace(positions=positions), "the state's positions of member 0 are not finite"),
                              (local._replace(ids=from_zero), "`ids` of member 0 must be unique over all ranks, but an id is held twice"),
                              (local._replace(ids=ids + sim.n_total), "must be below the simulation's"),
                              (local._replace(ids=torch.where(ids >= 0, 0, ids)), "an id is held twice"),
                              # a partial set (rank 1 leaves its last particle out) with rank 0's id 0
                              (local._replace(ids=torch.where(ids == ids.max(), -1, torch.where(ids == ids[0, 0],
                                                                                                 0, ids))),
                               "got id 0 of member 0 on two ranks")]:
            _expect_together(lambda: write_snapshot(other, state if rank == 1 else local, sim, mesh_units=True),
                             reason, "No file of the set")
            dist.barrier()
            assert not [name for name in os.listdir(folder) if name.startswith(("other", ".other"))]
    elif kind == "disagree":
        # Ranks passing different or bad file arguments: every rank raises the same error
        # at once (before the collective timeout), naming the rank and the argument, and
        # no file is written. A rank's bad num_files / file_index, or an explicit
        # num_part_total on one rank, used to make it raise (or write) alone while the
        # other waited for it until the timeout; different paths wrote two incomplete sets.
        other = os.path.join(folder, "other.hdf5")
        n = sim.n_total
        for arguments, fragments in [
            (dict(file_index=1, num_files=1), ["rank 1", "`file_index` and `num_files` must be given together"]),
            (dict(file_index=0, num_files=0), ["rank 1", "got 0 and 0"]),
            (dict(file_index=1, num_files="2"), ["rank 1", "got 1 and '2'"]),
            (dict(num_part_total=n), ["the ranks disagree on `num_part_total`", f"rank 1 (grid (1, 0)): {n}"]),
            (dict(path=os.path.join(folder, "other_elsewhere.hdf5")), ["the ranks disagree on `path`"]),
        ]:
            arguments = dict(dict(path=other), **arguments) if rank == 1 else dict(path=other)
            _expect_together(lambda: write_snapshot(arguments.pop("path"), local, sim, mesh_units=True, **arguments),
                             *fragments, "No file of the set")
            dist.barrier()
            assert not os.listdir(folder), os.listdir(folder)
            dist.barrier()  # (before rank 0 writes alone below)
        # file_index=0, num_files=1 is a whole file written by one rank alone: rank 0 writes
        # it while rank 1 waits for the set. The ranks meet at rank 0's next write (of
        # another snapshot, as a loop makes it), which they see as different paths:
        # both raise (it used to pair the two calls and write two incomplete sets).
        if rank == 0:
            write_snapshot(other, local, sim, mesh_units=True, file_index=0, num_files=1)
            following = os.path.join(folder, "following.hdf5")
            _expect_together(lambda: write_snapshot(following, local, sim, mesh_units=True),
                             "the ranks disagree on `path`", "following.hdf5", "other.hdf5")
        else:
            _expect_together(lambda: write_snapshot(other, local, sim, mesh_units=True),
                             "the ranks disagree on `path`", "following.hdf5", "other.hdf5")
        dist.barrier()
        assert sorted(os.listdir(folder)) == ["other.hdf5"], os.listdir(folder)
    elif kind == "restart":
        # A distributed run (grid 2x1) writes its per-rank files at a = 0.5; every rank
        # resumes from a share of the set; the result equals the uninterrupted run bit for bit.
        # 12^3 particles: enough that ranks hold empty slots between particles at a = 0.5,
        # which the later migrations fill in order (a resume that loses the slot layout
        # differs from the run by rounding).
        grid_sim = _sim(torch.float64, grid=(world_size, 1), n_particles=12, box_size=24.0)
        noise = grid_sim.white_noise(seed=13)
        whole = grid_sim(noise, return_mesh_units=True)
        middle = grid_sim(noise, until=0.5, return_mesh_units=True)
        write_snapshot(path, middle, grid_sim, mesh_units=True)
        dist.barrier()
        def owned(state):  # this rank's particles, by id
            keep = state.ids[0] >= 0
            order = torch.argsort(state.ids[0][keep])
            return state.ids[0][keep][order], state.positions[0][keep][order], state.momenta[0][keep][order]

        # Each rank its own file: the run's particles in the run's order, so the paint sums
        # in the same order and the resumed run is bit-identical.
        mine = read_snapshot(path, file_index=rank)
        if bool((middle.ids[0] < 0).any()):
            assert mine.slot_count == middle.ids.shape[1], "the file records the rank's slot count"
            assert torch.equal(mine.mesh_slots, torch.nonzero(middle.ids[0] >= 0).reshape(-1))
        else:  # no empty slots: the file order is the layout, and no record is written
            assert mine.mesh_slots is None
        empty = torch.tensor([int((middle.ids[0] < 0).sum())])
        dist.all_reduce(empty)
        assert int(empty) > 0, "no rank holds empty slots: the case tests nothing"
        own = grid_sim.resume(restart_state(mine, grid_sim), mesh_units=True, return_mesh_units=True)
        for expected, got in zip(owned(whole), owned(own)):
            assert torch.equal(expected, got)
        # Any other split of the set (here the other rank's file) resumes too: the particles
        # migrate to their owners; the paint then sums in another order (equal to rounding).
        other = read_snapshot(path, share=(world_size - 1 - rank, world_size))
        moved = grid_sim.resume(restart_state(other, grid_sim), mesh_units=True, return_mesh_units=True)
        expected, got = owned(whole), owned(moved)
        assert torch.equal(expected[0], got[0])
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-9)
        torch.testing.assert_close(got[2], expected[2], rtol=1e-9, atol=1e-12)
    elif kind == "fields":
        # The ranks of a 2x1 and a 1x2 grid write their blocks of the density into one file
        # in turn: the file holds the serial run's density (read with h5py, whole), each
        # rank reads its own block back; one rank's bad field raises on both, no file left.
        from torchpm.io import read_fields, write_fields

        for grid in ((world_size, 1), (1, world_size)):
            grid_sim = _sim(torch.float64, grid=grid, n_particles=(6, 5, 4), a_start=0.2, steps=2)
            serial = _sim(torch.float64, n_particles=(6, 5, 4), a_start=0.2, steps=2)
            density = grid_sim.density(grid_sim(grid_sim.white_noise(2, seed=5)))
            expected = serial.density(serial(serial.white_noise(2, seed=5)))
            fields_path = os.path.join(folder, f"density_{grid[0]}x{grid[1]}.hdf5")
            write_fields(fields_path, {"density": density, "twice": 2 * density}, grid_sim.box_size, a=1.0,
                         mesh=grid_sim.force_mesh)
            with h5py.File(fields_path, "r") as handle:
                whole_file = torch.from_numpy(handle["density"][...])
            torch.testing.assert_close(whole_file, expected, rtol=0, atol=1e-10 * float(expected.abs().max()))
            mine, _ = read_fields(fields_path, mesh=grid_sim.force_mesh)
            assert torch.equal(mine["density"], density) and torch.equal(mine["twice"], 2 * density)
            bad = density if rank == 0 else density[:, :-1]
            try:
                write_fields(os.path.join(folder, "bad.hdf5"), {"density": bad}, grid_sim.box_size,
                             mesh=grid_sim.force_mesh)
            except ValueError as error:  # rank 1's message, on both ranks
                assert "rank 1" in str(error) and "field 'density' of shape" in str(error), str(error)
            else:
                raise AssertionError("rank 1's block of another shape was written")
            dist.barrier()
            assert not [name for name in os.listdir(folder) if name.startswith(("bad", ".bad"))]
            # attributes, which the first rank writes alone: other ones on rank 1 (they were
            # dropped without a word), or not a dict (rank 1 raised alone, rank 0 waited)
            for attributes, fragments in [({"seed": 1 + rank}, ["the ranks disagree on `attributes`", "'seed'"]),
                                          ([("seed", 1)] if rank == 1 else {"seed": 1},
                                           ["rank 1", "`attributes` must be None or a dict"])]:
                _expect_together(lambda: write_fields(os.path.join(folder, "bad.hdf5"), {"density": density},
                                                      grid_sim.box_size, mesh=grid_sim.force_mesh,
                                                      attributes=attributes), *fragments)
                dist.barrier()
                assert not [name for name in os.listdir(folder) if name.startswith(("bad", ".bad"))]
    else:
        raise ValueError(case_id)


def test_fields_written_by_two_ranks(tmp_path):
    outcome = run_world(2, __name__, [f"fields:{tmp_path}"], tmp_path, timeout_s=240)
    for rank in range(2):
        assert outcome[f"fields:{tmp_path}"][rank] is None, f"rank {rank}:\n{outcome[f'fields:{tmp_path}'][rank]}"


def test_multifile_snapshot_from_two_ranks(tmp_path):
    good, bad, restart, disagree = (tmp_path / name for name in ("good", "bad", "restart", "disagree"))
    for folder in (good, bad, restart, disagree):
        folder.mkdir()
    cases = [f"write:{good}", f"restart:{restart}", f"fail:{bad}", f"disagree:{disagree}"]
    outcome = run_world(2, __name__, cases, tmp_path, timeout_s=240)
    for case in cases:
        for rank in range(2):
            assert outcome[case][rank] is None, f"{case} rank {rank}:\n{outcome[case][rank]}"
    # Read back here with one reader, with 3 readers, and from any file of the set.
    sim = _sim()
    whole = sim(sim.white_noise(seed=9), until=0.5, return_mesh_units=True)
    with h5py.File(good / "snap_000.1.hdf5", "r") as handle:
        assert handle["Header"].attrs["NumFilesPerSnapshot"] == 2
        assert handle["Header"].attrs["NumPart_Total"][1] == sim.n_total
        assert handle["Header"].attrs["NumPart_ThisFile"][1] == sim.n_total - sim.n_total // 2
    reference = read_snapshot(str(good / "snap_000.0.hdf5"))
    # (the ranks ran with 1 thread and compared bits; here the thread count may differ)
    torch.testing.assert_close(reference.mesh_positions, whole.positions[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(reference.ids, torch.arange(sim.n_total))
    for name in ("snap_000", "snap_000.hdf5", "snap_000.1.hdf5"):
        snap = read_snapshot(str(good / name))
        assert torch.equal(snap.mesh_positions, reference.mesh_positions) and torch.equal(snap.ids, reference.ids)
    parts = [read_snapshot(str(good / "snap_000"), share=(i, 3)) for i in range(3)]
    assert torch.equal(torch.cat([p.ids for p in parts]), torch.arange(sim.n_total))
    pynbody = pytest.importorskip("pynbody")  # the independent reader (`make test-deps`)
    snap = pynbody.load(str(good / "snap_000"))
    assert len(snap) == sim.n_total
    np.testing.assert_array_equal(np.sort(np.asarray(snap.dm["iord"])), np.arange(sim.n_total))


# ----------------------------------------------------------------------------
# Mesh fields.


def test_fields_written_and_read_back_exactly_as_h5py_sees_them(tmp_path):
    from torchpm.io import read_fields, write_fields

    sim = torchpm.Simulation(n_particles=(6, 5, 4), box_size=(60.0, 50.0, 40.0), mesh_factor=2, a_start=0.2,
                             steps=2)
    state = sim(sim.white_noise(2, seed=1))
    density = sim.density(state)
    moved = sim.density(sim.redshift_space(state, axis=2))
    path = tmp_path / "density.hdf5"
    assert write_fields(path, {"density": density, "density_rsd_z": moved.double()}, sim.box_size, a=state.a,
                        attributes={"seed": 1, "window": "cic"}) == str(path)
    with h5py.File(path, "r") as handle:  # the file as any HDF5 reader sees it
        assert set(handle) == {"density", "density_rsd_z"}
        assert handle["density"].dtype == np.float32 and handle["density_rsd_z"].dtype == np.float64
        assert handle["density"].shape == (2, 12, 10, 8)
        np.testing.assert_array_equal(handle["density"][...], density.numpy())
        np.testing.assert_array_equal(handle["density_rsd_z"][...], moved.double().numpy())
        np.testing.assert_array_equal(handle.attrs["BoxSize"], [60.0, 50.0, 40.0])
        assert handle.attrs["Time"] == state.a and handle.attrs["window"] == "cic" and handle.attrs["seed"] == 1
    fields, attributes = read_fields(path, names=["density"])
    assert list(fields) == ["density"] and torch.equal(fields["density"], density)
    assert attributes["mesh_shape"] == [12, 10, 8]
    assert [p.name for p in tmp_path.iterdir()] == ["density.hdf5"], "a temporary file was left"


def test_bad_fields_are_refused_and_leave_no_file(tmp_path):
    from torchpm.io import read_fields, write_fields

    field = torch.rand(1, 4, 4, 4)
    path = tmp_path / "f.hdf5"
    cases = [
        ({}, 10.0, "non-empty dict"),
        ({"a/b": field}, 10.0, "without '/'"),
        ({"d": field[0]}, 10.0, "(B, nx, ny, nz)"),
        ({"d": field.to(torch.complex64)}, 10.0, "real floating-point"),
        ({"d": field.masked_fill(field > 0.5, float("nan"))}, 10.0, "NaN or infinite"),
        ({"d": field}, -1.0, "box_size"),
    ]
    for fields, box, fragment in cases:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            write_fields(path, fields, box)
        assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="`a` must be None or a scale factor"):
        write_fields(path, {"d": field}, 10.0, a=2.0)
    with pytest.raises(ValueError, match="`path` must be a file name"):
        write_fields(None, {"d": field}, 10.0)
    write_fields(path, {"d": field}, 10.0)
    with pytest.raises(ValueError, match="exists; pass overwrite=True"):
        write_fields(path, {"d": 2 * field}, 10.0)
    write_fields(path, {"d": 2 * field}, 10.0, overwrite=True)
    assert torch.equal(read_fields(path)[0]["d"], 2 * field)
    with pytest.raises(KeyError, match="holds no field 'e'"):
        read_fields(path, names=["e"])
    assert list(read_fields(path, names="d")[0]) == ["d"]
    with pytest.raises(ValueError, match=re.escape("field 'e' of shape (1, 4, 4, 5) is on another mesh")):
        write_fields(tmp_path / "g.hdf5", {"d": field, "e": torch.rand(1, 4, 4, 5)}, 10.0)
    assert not (tmp_path / "g.hdf5").exists()
    with pytest.raises(ValueError, match=re.escape("is on a (4, 4, 4) mesh")):
        read_fields(path, mesh=torchpm.mesh.LocalMesh((4, 4, 5)))


def test_box_with_unequal_sides_reads_back_in_torchpm_and_pynbody(tmp_path):
    # Gadget's BoxSize is one number; a box with unequal sides is its stretched box: the
    # longest side, times the LONG_X, LONG_Y, LONG_Z factors of the Config group. (A
    # 3-vector BoxSize loaded in pynbody as an array of units, which `in_units` and `wrap`
    # refuse.)
    pynbody = pytest.importorskip("pynbody")
    sim = _sim(torch.float64)  # 60 x 50 x 40 Mpc/h
    state = sim(sim.white_noise(seed=4), until=0.5)
    path = str(tmp_path / "snap.hdf5")
    write_snapshot(path, state, sim)
    with h5py.File(path, "r") as handle:
        assert np.ndim(handle["Header"].attrs["BoxSize"]) == 0 and handle["Header"].attrs["BoxSize"] == 60.0
        assert handle["Parameters"].attrs["BoxSize"] == 60.0
        stretch = [handle["Config"].attrs[name] for name in ("LONG_X", "LONG_Y", "LONG_Z")]
        np.testing.assert_allclose(np.multiply(stretch, 60.0), [60.0, 50.0, 40.0], rtol=1e-15)
    # torchpm: the sides exactly (its own record), and the particles
    snap = read_snapshot(path)
    assert snap.box_size == (60.0, 50.0, 40.0)
    assert torch.equal(snap.positions, state.positions[0]) and torch.equal(snap.ids, torch.arange(sim.n_total))
    # ... and from the Gadget attributes alone (a file without the torchpm group)
    gadget = str(tmp_path / "gadget.hdf5")
    with h5py.File(path, "r") as source, h5py.File(gadget, "w") as target:
        for name in ("Header", "Parameters", "Config", "PartType1"):
            source.copy(name, target)
    np.testing.assert_allclose(read_snapshot(gadget).box_size, (60.0, 50.0, 40.0), rtol=1e-15)
    # pynbody: the box is the longest side, which holds every particle (wrapping into it moves none)
    loaded = pynbody.load(path)
    assert float(loaded.properties["boxsize"].in_units("Mpc a h**-1")) == pytest.approx(60.0, rel=1e-6)
    order = np.argsort(np.asarray(loaded.dm["iord"]))
    np.testing.assert_array_equal(np.asarray(loaded.dm["pos"])[order], state.positions[0].numpy())
    loaded.wrap(convention="upper")
    np.testing.assert_array_equal(np.asarray(loaded.dm["pos"])[order], state.positions[0].numpy())
