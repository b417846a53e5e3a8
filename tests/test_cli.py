"""`python -m torchpm run` on a tiny config: outputs, units header, errors."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchpm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torchpm.__file__)))


def _run(args, cwd):
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "torchpm", *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=300
    )


def test_run_writes_table_and_figure(tmp_path):
    config = tmp_path / "small.toml"
    config.write_text(
        'n_particles = 16\nbox_size = 128.0\nmesh_factor = 2\nsteps = 3\nseed = 3\noutput = "result"\n'
        'cosmology = { Omega_c = 0.25, Omega_b = 0.05, h = 0.7, n_s = 0.96, sigma8 = 0.8 }\n'
    )
    result = _run(["run", str(config)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "time per step" in result.stdout
    table = tmp_path / "result" / "power_spectrum.txt"
    assert (tmp_path / "result" / "power_spectrum.png").stat().st_size > 1000
    header = [line for line in table.read_text().splitlines() if line.startswith("#")]
    assert any("k [h/Mpc]" in line and "(Mpc/h)^3" in line for line in header)
    data = np.loadtxt(table)
    assert data.shape[1] == 4 and np.all(np.diff(data[:, 0]) > 0) and np.all(data[:, 2] > 0)
    # the largest scales follow linear theory at a = 1 to within cosmic variance
    assert 0.3 < np.median(data[:3, 1] / data[:3, 3]) < 3


def test_small_box_reports_its_largest_scale(tmp_path):
    """A box under 2 pi / 0.1 h/Mpc has no mode below k = 0.1: the summary compares P(k)
    with linear theory at its lowest k instead of printing nan."""
    config = tmp_path / "tiny.toml"
    config.write_text('n_particles = 4\nbox_size = 40.0\nsteps = 2\n')
    result = _run(["run", str(config)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if "P/P_linear" in line]
    assert "its lowest k" in line and "no mode below 0.1" in line, line
    assert np.isfinite(float(line.rsplit(":", 1)[1])), line


def test_run_rejects_bad_config(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("n_particles = 8\nmesh_factor = 1.5\n")
    result = _run(["run", str(config)], cwd=tmp_path)
    assert result.returncode == 2 and "mesh_factor" in result.stderr
    # a user error in a real process: one line, no traceback
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0
    config.write_text("n_particle = 8\n")
    result = _run(["run", str(config)], cwd=tmp_path)
    assert result.returncode == 2 and "unknown keys" in result.stderr


# ----------------------------------------------------------------------------------
# User errors: one line on stderr, exit status 2, nothing run, no traceback.

from torchpm.__main__ import main  # noqa: E402

SMALL = 'n_particles = 4\nbox_size = 40.0\nsteps = 2\n'

BAD_VALUES = [
    ("batch = 0", "`batch`"),
    ("batch = 1.5", "`batch`"),
    ("seed = \"abc\"", "`seed`"),
    ("seed = 1.7", "`seed`"),
    ("seed = -1", "`seed`"),
    ("threads = -1", "`threads`"),
    ("device = \"bogus\"", "`device`"),
    ("device = \"cuda:99\"", "`device`"),
    ("dtype = [\"float32\"]", "`dtype`"),
    ("dtype = \"float16\"", "`dtype`"),
    ("cosmology = { Omega_c = \"x\", Omega_b = 0.05, h = 0.7, n_s = 0.96, sigma8 = 0.8 }", "`cosmology.Omega_c`"),
    ("cosmology = { Omega_c = 0.3 }", "missing parameters"),
    ("cosmology = { Omega_c = 0.3, Omega_b = 0.05, h = 0.7, n_s = 0.96, sigma8 = 0.8, Omega_nu = 0.1 }", "unknown parameters"),
    ("cosmology = { Omega_c = 0.9, Omega_b = 0.5, h = 0.7, n_s = 0.96, sigma8 = 0.8 }", "dark-energy"),
    ("cosmology = \"Planck99\"", "`cosmology`"),
    ("n_particles = \"644\"", "`n_particles`"),
    ("box_size = \"256\"", "`box_size`"),
    ("box_size = inf", "`box_size`"),
    ("cic_compensation = \"false\"", "`cic_compensation`"),
    ("steps = \"\"", "`steps`"),
    ("steps = 1000000000", "`steps`"),
    ("mesh_factor = 1.5", "`mesh_factor`"),
    ("a_start = 0", "`a_start`"),
    ("output = \"\"", "`output`"),
    ("snapshots = [0.56]", "not one of the scale factors"),
    ("snapshots = [1.0, 0.5]", "`snapshots`"),
    ("grid = [2]", "`grid`"),
    ("grid = [2, 1]", "`grid`"),
    ("lpt_normalisation = \"pmwd\"", "`lpt_normalisation`"),
    ("collective_timeout = -1", "`collective_timeout`"),
    ("paint_order = \"quadratic\"", "`paint_order`"),
    ("shot_noise = \"none\"", "`shot_noise`"),
    ("shot_noise = false", "`shot_noise`"),
    ("fixed_amplitude = \"true\"", "`fixed_amplitude`"),
    ("paired = 1", "`paired`"),
    ("power_spectrum = \"missing_table.txt\"", "`power_spectrum`"),
    ("n_particle = 8", "unknown keys"),
    ("n_particles = [8, 8", "not valid TOML"),
    ("n_particles = 512\nmesh_factor = 2", "needs about"),
    # cosmologies the settings' checks pass but the physics refuses: before the run too
    ("cosmology = {Omega_c = 0.25, Omega_b = 0.05, h = 0.7, n_s = 0.96, sigma8 = 0.8, w0 = -0.5, wa = 0.6}",
     "`cosmology`: growth_table: needs w0 + wa < 0"),
    ("cosmology = {Omega_c = 0.25, Omega_b = 0.05, h = 0.7, n_s = 0.96, sigma8 = 0.8, Omega_k = -5.0}",
     "this closed universe has no expanding history"),
]


def _line_count(text):
    return len([line for line in text.splitlines() if line.strip()])


@pytest.mark.parametrize("text,match", BAD_VALUES, ids=[v[0].split("\n")[0][:40] for v in BAD_VALUES])
def test_bad_value_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, text, match):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "bad.toml"
    # the small base config, less the keys the bad text sets (TOML refuses duplicate keys)
    keys = {line.split("=")[0].strip() for line in text.splitlines()}
    base = "".join(line + "\n" for line in SMALL.splitlines() if line.split("=")[0].strip() not in keys)
    config.write_text(base + text + "\n")
    assert main(["run", str(config)]) == 2
    error = capsys.readouterr().err
    assert match in error and _line_count(error) == 1, error
    assert "Traceback" not in error
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_an_error_message_with_a_newline_is_printed_on_one_line(tmp_path, capsys, monkeypatch):
    """h5py's errors hold a newline (its time stamp): the one-line promise holds for them."""
    import torchpm.io

    def failing(path, *args, **kwargs):
        raise OSError("Unable to synchronously create file (file write failed: time = Sat Nov 28 17:18:01 2026\n"
                      ", filename = 'x.tmp', errno = 27)")

    monkeypatch.setattr(torchpm.io, "write_snapshot", failing)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(SMALL + "snapshots = [1.0]\n")
    assert main(["run", str(config)]) == 2
    error = capsys.readouterr().err.split("torchpm run: ")[-1]  # (after the progress bar)
    assert _line_count(error) == 1 and "cannot write" in error and "2026 , filename" in error, error


def test_bad_value_names_the_line(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(SMALL + "# a comment\nbatch = 1.5\n")
    assert main(["run", str(config)]) == 2
    assert f"{config}:5: `batch`" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["directory", "not_utf8", "missing", "binary_power", "empty_output",
                                  "output_is_file", "output_under_file", "resume_missing", "resume_not_hdf5"])
def test_bad_paths_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(SMALL)
    arguments = ["run", str(config)]
    match = {"directory": "is a directory", "not_utf8": "not UTF-8", "missing": "not found",
             "binary_power": "not a UTF-8 text table", "empty_output": "`output`",
             "output_is_file": "not a folder", "output_under_file": "cannot create",
             "resume_missing": "cannot resume", "resume_not_hdf5": "cannot resume"}[case]
    if case == "directory":
        arguments = ["run", str(tmp_path)]
    elif case == "not_utf8":
        config.write_bytes(b"n_particles = 4\nseed = \"\xff\xfe\"\n")
    elif case == "missing":
        arguments = ["run", str(tmp_path / "nothing.toml")]
    elif case == "binary_power":
        (tmp_path / "power.bin").write_bytes(bytes(range(256)) * 4)
        config.write_text(SMALL + 'power_spectrum = "power.bin"\n')
    elif case == "empty_output":
        arguments += ["--output", ""]
    elif case == "output_is_file":
        (tmp_path / "taken").write_text("x")
        arguments += ["--output", "taken"]
    elif case == "output_under_file":
        (tmp_path / "taken").write_text("x")
        arguments += ["--output", "taken/run"]
    elif case == "resume_missing":
        arguments += ["--resume", str(tmp_path / "snap_000.hdf5")]
    elif case == "resume_not_hdf5":
        (tmp_path / "snap_000.hdf5").write_text("not hdf5")
        arguments += ["--resume", str(tmp_path / "snap_000.hdf5")]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert match in error and _line_count(error) == 1, error


# ----------------------------------------------------------------------------------
# --check, info, outputs, snapshots and --resume.


def test_check_prints_settings_and_memory_without_running(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(SMALL + 'output = "never"\nbatch = 2\n')
    assert main(["run", "--check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "batch = 2" in out and "n_particles = [4, 4, 4]" in out and "memory estimate" in out
    assert "GiB" in out or "MiB" in out
    assert not (tmp_path / "never").exists()


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "CUDA kernels built" in out and "h5py:" in out


def test_snapshots_resume_and_overwrite(tmp_path, capsys, monkeypatch):
    import h5py

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(
        'n_particles = 8\nbox_size = 64.0\nsteps = [0.3, 0.5, 0.7, 1.0]\nsnapshots = [0.5, 1.0]\n'
        'output = "first"\nseed = 2\n'
    )
    assert main(["run", str(config)]) == 0
    first = tmp_path / "first"
    assert sorted(p.name for p in first.iterdir()) == [
        "config.toml", "power_spectrum.png", "power_spectrum.txt", "power_spectrum_000.txt", "power_spectrum_001.txt",
        "snap_000.hdf5", "snap_001.hdf5"]
    # The spectra at each snapshot: that of the snapshot's particles (read back here), and
    # at a = 1 the run's final table.
    def body(path):
        return [line for line in path.read_text().splitlines() if not line.startswith("#")]

    assert "at a = 0.5000" in (first / "power_spectrum_000.txt").read_text().splitlines()[0]
    assert body(first / "power_spectrum_001.txt") == body(first / "power_spectrum.txt")
    from torchpm.analysis import power_spectrum

    sim = torchpm.Simulation(8, 64.0, mesh_factor=2, steps=[0.3, 0.5, 0.7, 1.0])
    density = sim.density(_snapshot_state(first / "snap_000.hdf5", sim))
    expected = power_spectrum(density[0] - 1.0, 64.0, compensate_cic=True, n_particles=512)
    table = np.loadtxt(first / "power_spectrum_000.txt")
    np.testing.assert_allclose(table[:, 1], expected.power.numpy(), rtol=1e-5, atol=1e-6 * float(expected.power.max()))
    # Not overwritten silently; --overwrite replaces.
    assert main(["run", str(config)]) == 2
    assert "already holds outputs" in capsys.readouterr().err
    assert main(["run", str(config), "--overwrite"]) == 0
    # Resume from a = 0.5 into another folder: the final snapshot is bit-identical.
    assert main(["run", str(config), "--resume", str(first / "snap_000.hdf5"), "--output", "second"]) == 0
    second = tmp_path / "second"
    assert not (second / "snap_000.hdf5").exists() and not (second / "power_spectrum_000.txt").exists()
    assert body(second / "power_spectrum_001.txt") == body(first / "power_spectrum_001.txt")
    with h5py.File(first / "snap_001.hdf5", "r") as a, h5py.File(second / "snap_001.hdf5", "r") as b:
        for name in ("torchpm/MeshPositions", "torchpm/MeshMomenta", "PartType1/Coordinates", "PartType1/ParticleIDs"):
            np.testing.assert_array_equal(a[name][:], b[name][:])
        assert b["Header"].attrs["Time"] == 1.0
    body = [line for line in (first / "power_spectrum.txt").read_text().splitlines() if not line.startswith("#")]
    assert body == [line for line in (second / "power_spectrum.txt").read_text().splitlines() if not line.startswith("#")]
    # --check validates the snapshot too, without running
    capsys.readouterr()
    assert main(["run", str(config), "--check", "--resume", str(first / "snap_000.hdf5")]) == 0
    assert "resumes from" in capsys.readouterr().out
    # An incompatible config is refused with one line.
    config.write_text(config.read_text().replace("box_size = 64.0", "box_size = 65.0"))
    assert main(["run", str(config), "--check", "--resume", str(first / "snap_000.hdf5")]) == 2
    assert "box_size" in capsys.readouterr().err
    assert main(["run", str(config), "--resume", str(first / "snap_000.hdf5"), "--output", "third"]) == 2
    assert "box_size" in capsys.readouterr().err


def test_overwrite_removes_the_earlier_runs_snapshots_and_resume_refuses_another_runs(tmp_path, capsys, monkeypatch):
    """--overwrite leaves no snapshot of the earlier run beside the new outputs (one it
    does not write would stay, and --resume from it continued the other run under this
    one's name); a resumed run keeps the snapshots it continues; a snapshot written with
    another seed, a_start, LPT or power spectrum is refused by --resume, naming them."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    base = 'n_particles = 8\nbox_size = 64.0\nsteps = [0.3, 0.5, 0.7, 1.0]\noutput = "out"\n'
    config.write_text(base + "snapshots = [0.5, 0.7]\nseed = 0\n")
    assert main(["run", str(config)]) == 0
    out = tmp_path / "out"
    (out / "snap_000.0.hdf5").write_bytes((out / "snap_000.hdf5").read_bytes())  # a stale set's file
    other = tmp_path / "other.toml"
    other.write_text(base + "snapshots = [0.5]\nseed = 7\n")
    assert main(["run", str(other), "--overwrite"]) == 0
    assert sorted(p.name for p in out.glob("snap_*")) == ["snap_000.hdf5"]
    # (and the earlier run's spectrum at its snapshot 001, which this run does not write)
    assert sorted(p.name for p in out.glob("power_spectrum_*")) == ["power_spectrum_000.txt"]
    # seed 7's snapshot resumed under seed 0's configuration: refused, naming the seed
    capsys.readouterr()
    assert main(["run", str(config), "--resume", str(out / "snap_000.hdf5"), "--output", "again"]) == 2
    error = capsys.readouterr().err
    assert "seed 7 (this configuration: 0)" in error and "snap_000.hdf5" in error, error
    config.write_text(base + "snapshots = [0.5]\nseed = 7\nlpt_order = 1\n")
    assert main(["run", str(config), "--check", "--resume", str(out / "snap_000.hdf5")]) == 2
    assert "lpt_order 2 (this configuration: 1)" in capsys.readouterr().err
    config.write_text(base + 'snapshots = [0.5]\nseed = 7\npower_spectrum = "eisenstein_hu_nowiggle"\n')
    assert main(["run", str(config), "--check", "--resume", str(out / "snap_000.hdf5")]) == 2
    assert "power_spectrum 'eisenstein_hu' (this configuration: 'eisenstein_hu_nowiggle')" in capsys.readouterr().err
    # resuming into the same folder keeps the history it continues (the snapshot it resumes
    # from), and removes the rest: a set of a later snapshot left by a run on 2 ranks
    # would stand beside the single file this run writes under its name
    other.write_text(base + "snapshots = [0.5, 1.0]\nseed = 7\n")
    for stale in ("snap_001.0.hdf5", "snap_001.1.hdf5", "snap_004.hdf5"):
        (out / stale).write_bytes((out / "snap_000.hdf5").read_bytes())
    first_table = (out / "power_spectrum_000.txt").read_text()
    assert main(["run", str(other), "--resume", str(out / "snap_000.hdf5"), "--overwrite"]) == 0
    assert sorted(p.name for p in out.glob("snap_*")) == ["snap_000.hdf5", "snap_001.hdf5"]
    # the history's spectrum kept as it was, the new snapshot's written
    assert (out / "power_spectrum_000.txt").read_text() == first_table
    assert (out / "power_spectrum_001.txt").exists()
    torchpm.io.read_snapshot(str(out / "snap_001.hdf5"))  # not ambiguous
    # resuming from another folder keeps none of this folder's earlier snapshots
    assert main(["run", str(other), "--resume", str(out / "snap_000.hdf5"), "--output", "elsewhere"]) == 0
    (tmp_path / "elsewhere" / "snap_000.hdf5").write_bytes((out / "snap_000.hdf5").read_bytes())
    assert main(["run", str(other), "--resume", str(out / "snap_000.hdf5"), "--output", "elsewhere",
                 "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "elsewhere").glob("snap_*")) == ["snap_001.hdf5"]


def test_batch_run_resumes_every_member_bit_for_bit(tmp_path, capsys, monkeypatch):
    """A batch of 2 writes one snapshot per member; --resume with either member's file
    finds the other and continues both, bit for bit; a name without the member, or a
    missing member, is one clear line."""
    import h5py

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(
        'n_particles = 8\nbox_size = 64.0\nsteps = [0.3, 0.5, 0.7, 1.0]\nsnapshots = [0.5, 1.0]\n'
        'output = "first"\nseed = 5\nbatch = 2\n'
    )
    assert main(["run", str(config)]) == 0
    first = tmp_path / "first"
    assert sorted(p.name for p in first.glob("snap_*")) == [
        "snap_000_member0.hdf5", "snap_000_member1.hdf5", "snap_001_member0.hdf5", "snap_001_member1.hdf5"]
    with h5py.File(first / "snap_001_member0.hdf5", "r") as a, h5py.File(first / "snap_001_member1.hdf5", "r") as b:
        assert not np.array_equal(a["torchpm/MeshPositions"][:], b["torchpm/MeshPositions"][:]), "members differ"
    # The P(k) table holds every member's column (it held member 0's alone): each equals the
    # spectrum of that member's final snapshot.
    from torchpm.io import read_snapshot, restart_state

    table = np.loadtxt(first / "power_spectrum.txt")
    assert table.shape[1] == 5, table.shape  # k, P of members 0 and 1, modes, P_linear
    sim = torchpm.Simulation(8, 64.0, mesh_factor=2, a_start=0.1, steps=[0.3, 0.5, 0.7, 1.0])
    for member in range(2):
        final = restart_state(read_snapshot(first / f"snap_001_member{member}.hdf5"), sim)
        density = sim.density(sim.to_physical(final.positions, final.momenta, final.a, final.ids))
        expected = torchpm.analysis.power_spectrum(density - 1.0, 64.0, compensate_cic=True, n_particles=512)
        np.testing.assert_allclose(table[:, 1 + member], expected.power[0].numpy(), rtol=2e-6)
    assert not np.allclose(table[:, 1], table[:, 2])
    assert main(["run", str(config), "--resume", str(first / "snap_000_member1.hdf5"), "--output", "second"]) == 0
    second = tmp_path / "second"
    for member in range(2):
        name = f"snap_001_member{member}.hdf5"
        with h5py.File(first / name, "r") as a, h5py.File(second / name, "r") as b:
            for key in ("torchpm/MeshPositions", "torchpm/MeshMomenta", "PartType1/ParticleIDs"):
                np.testing.assert_array_equal(a[key][:], b[key][:])
    capsys.readouterr()
    assert main(["run", str(config), "--check", "--resume", str(first / "snap_000.hdf5")]) == 2
    assert "batch = 2" in capsys.readouterr().err
    (first / "snap_000_member1.hdf5").unlink()
    assert main(["run", str(config), "--check", "--resume", str(first / "snap_000_member0.hdf5")]) == 2
    assert "snap_000_member1.hdf5" in capsys.readouterr().err


def test_stacking_members_pads_the_shorter_ones_with_empty_slots():
    from torchpm import SimulationState
    from torchpm.__main__ import stack_members

    a = SimulationState(torch.ones(1, 3, 3), torch.full((1, 3, 3), 2.0), 0.5, torch.tensor([[4, 5, 6]]))
    b = SimulationState(torch.full((1, 1, 3), 7.0), torch.full((1, 1, 3), 8.0), 0.5, torch.tensor([[9]]))
    stacked = stack_members([a, b], [16.0, 0.0, 0.0])
    assert stacked.ids.tolist() == [[4, 5, 6], [9, -1, -1]]
    # empty slots at the centre of the cell of the particle before them, as a migration leaves them
    assert stacked.positions[1].tolist() == [[7.0] * 3, [7.5] * 3, [7.5] * 3]
    assert stacked.momenta[1].tolist() == [[8.0] * 3, [0.0] * 3, [0.0] * 3]
    assert torch.equal(stacked.positions[0], a.positions[0])
    with pytest.raises(ValueError, match="different scale factors"):
        stack_members([a, SimulationState(b.positions, b.momenta, 0.7, b.ids)], [0.0, 0.0, 0.0])


@pytest.mark.distributed
def test_torchrun_snapshots_and_bit_identical_resume(tmp_path):
    """2 gloo ranks write a Gadget multi-file set; a 2-rank --resume (each rank its own
    file) reproduces the uninterrupted run's final snapshot and P(k) bit for bit."""
    import h5py

    config = tmp_path / "run.toml"
    config.write_text(
        'n_particles = 12\nbox_size = 96.0\nmesh_factor = 2\nsteps = 4\ndtype = "float64"\nthreads = 1\n'
        'seed = 4\nsnapshots = [0.55, 1.0]\ncollective_timeout = 120\n'
    )
    environment = dict(os.environ, OMP_NUM_THREADS="1",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def torchrun(*arguments):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "-m", "torchpm", "run", str(config), *arguments]
        result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return result

    torchrun("--output", "first")
    torchrun("--output", "second", "--resume", str(tmp_path / "first" / "snap_000.hdf5"))
    first, second = tmp_path / "first", tmp_path / "second"
    assert sorted(p.name for p in first.glob("snap_*")) == [
        "snap_000.0.hdf5", "snap_000.1.hdf5", "snap_001.0.hdf5", "snap_001.1.hdf5"]
    for rank in range(2):
        with h5py.File(first / f"snap_001.{rank}.hdf5", "r") as a, h5py.File(second / f"snap_001.{rank}.hdf5", "r") as b:
            assert a["Header"].attrs["NumFilesPerSnapshot"] == 2 and a["Header"].attrs["NumPart_Total"][1] == 12**3
            for name in ("torchpm/MeshPositions", "torchpm/MeshMomenta", "PartType1/ParticleIDs"):
                np.testing.assert_array_equal(a[name][:], b[name][:])

    def table(folder):
        return [line for line in (folder / "power_spectrum.txt").read_text().splitlines() if not line.startswith("#")]

    assert table(first) == table(second)


def test_config_window_compensation_reaches_the_simulation(tmp_path):
    """`window_compensation` is a config key (the error for `cic_compensation` with another
    paint order recommends it); the CLI's simulation divides by that window."""
    from torchpm.__main__ import UserError, build_simulation
    from torchpm.config import load_config

    path = tmp_path / "tsc.toml"
    path.write_text('n_particles = 8\nbox_size = 64.0\npaint_order = "tsc"\nwindow_compensation = true\n')
    sim = build_simulation(load_config(str(path)))
    assert sim.paint_order == "tsc" and sim.window_compensation and not sim.cic_compensation
    plain = build_simulation(load_config(str(path), {"window_compensation": False}))
    cells = torch.rand(1, 200, 3, generator=torch.Generator().manual_seed(0)) * 8.0  # 8^3 force mesh (B = 1)
    cells[0, :60] = 2.0 + torch.rand(60, 3, generator=torch.Generator().manual_seed(1))  # a clump
    divided, undivided = (s.forces(cells, 0.5) for s in (sim, plain))
    assert float((divided - undivided).abs().max()) > 1e-3 * float(undivided.abs().max())
    path.write_text('n_particles = 8\nbox_size = 64.0\npaint_order = "tsc"\ncic_compensation = true\n')
    with pytest.raises(UserError, match="use `window_compensation=True` alone"):
        build_simulation(load_config(str(path)))
    # the advice works from a config
    path.write_text('n_particles = 8\nbox_size = 64.0\npaint_order = "tsc"\nwindow_compensation = true\n')
    assert build_simulation(load_config(str(path))).window_compensation


# ----------------------------------------------------------------------------------
# Paired-and-fixed initial conditions and the shot noise of the P(k) table.


def _snapshot_state(path, sim):
    from torchpm.io import read_snapshot, restart_state

    return restart_state(read_snapshot(path), sim)


def test_fixed_and_paired_keys_reach_the_white_noise(tmp_path, capsys, monkeypatch):
    """`fixed_amplitude` and `paired` make the run's white noise (its 1LPT particles at
    a_start are those of sim.white_noise(seed, fixed_amplitude=..., paired=...)); the
    P(k) header names them; a paired run's 1LPT displacements are the partner's negated."""
    monkeypatch.chdir(tmp_path)
    base = ('n_particles = 6\nbox_size = 60.0\nmesh_factor = 1\nsteps = 0\nlpt_order = 1\n'
            'dtype = "float64"\nseed = 3\nsnapshots = [0.1]\n')
    sim = torchpm.Simulation(6, 60.0, mesh_factor=1, steps=0, lpt_order=1, dtype=torch.float64)
    states = {}
    for fixed in (False, True):
        for paired in (False, True):
            name = f"run_{int(fixed)}{int(paired)}"
            config = tmp_path / f"{name}.toml"
            config.write_text(base + f'output = "{name}"\nfixed_amplitude = {str(fixed).lower()}\n'
                              f'paired = {str(paired).lower()}\n')
            assert main(["run", str(config)]) == 0
            header = (tmp_path / name / "power_spectrum.txt").read_text().splitlines()[1]
            assert ("fixed amplitudes" in header) == fixed and ("paired" in header) == paired, header
            states[fixed, paired] = _snapshot_state(tmp_path / name / "snap_000.hdf5", sim)
            expected = sim(sim.white_noise(seed=3, fixed_amplitude=fixed, paired=paired), return_mesh_units=True)
            torch.testing.assert_close(states[fixed, paired].positions, expected.positions, rtol=0, atol=1e-12)
    grid = torchpm.ic.grid_positions((6, 6, 6), 1, dtype=torch.float64, device="cpu")
    for fixed in (False, True):
        displacement = states[fixed, False].positions[0] - grid
        torch.testing.assert_close(states[fixed, True].positions[0] - grid, -displacement, rtol=0, atol=1e-12)
    assert not torch.allclose(states[True, False].positions, states[False, False].positions)


def test_resume_refuses_a_snapshot_of_other_fixed_or_paired_initial_conditions(tmp_path, capsys, monkeypatch):
    """A snapshot is a run's history: one written with other `fixed_amplitude` or `paired`
    is refused by --resume, naming the key; so is a snapshot from before the keys existed
    (its config has `seed` but not them: a run at their defaults) under a fixed or paired
    configuration."""
    import h5py

    monkeypatch.chdir(tmp_path)
    base = 'n_particles = 6\nbox_size = 60.0\nsteps = [0.3, 0.6]\nsnapshots = [0.3]\noutput = "out"\n'
    config = tmp_path / "run.toml"
    config.write_text(base + "fixed_amplitude = true\n")
    assert main(["run", str(config)]) == 0
    snapshot = str(tmp_path / "out" / "snap_000.hdf5")
    assert main(["run", str(config), "--check", "--resume", snapshot]) == 0
    capsys.readouterr()
    for text, named in [("fixed_amplitude = false\n", "fixed_amplitude True (this configuration: False)"),
                        ("fixed_amplitude = true\npaired = true\n", "paired False (this configuration: True)")]:
        config.write_text(base + text)
        assert main(["run", str(config), "--check", "--resume", snapshot]) == 2
        error = capsys.readouterr().err
        assert named in error and _line_count(error) == 1, error
    # the same snapshot as written before the keys existed (its config without them)
    with h5py.File(snapshot, "r+") as handle:
        text = handle["torchpm"].attrs["config"]
        text = text.decode() if isinstance(text, bytes) else text
        kept = [line for line in text.splitlines() if not line.startswith(("fixed_amplitude", "paired"))]
        assert "seed = 0" in kept and len(kept) == len(text.splitlines()) - 2
        handle["torchpm"].attrs["config"] = "\n".join(kept) + "\n"
    config.write_text(base)
    assert main(["run", str(config), "--check", "--resume", snapshot]) == 0
    capsys.readouterr()
    for text, named in [("fixed_amplitude = true\n", "fixed_amplitude False (this configuration: True)"),
                        ("paired = true\n", "paired False (this configuration: True)")]:
        config.write_text(base + text)
        assert main(["run", str(config), "--check", "--resume", snapshot]) == 2
        assert named in capsys.readouterr().err


def test_shot_noise_key_keeps_or_subtracts_poisson_noise(tmp_path, capsys, monkeypatch):
    """A coarse lattice start (8^3 particles in 128 Mpc/h) has far less small-scale power
    than Poisson noise: subtracting V/N makes P(k) negative at high k. `shot_noise = "keep"`
    writes the measured spectrum, which is the subtracted one plus V/N; the header says which."""
    monkeypatch.chdir(tmp_path)
    base = 'n_particles = 8\nbox_size = 128.0\nsteps = 3\nseed = 1\n'
    tables, headers = {}, {}
    for choice in ("subtract", "keep", None):
        name = choice or "default"
        config = tmp_path / f"{name}.toml"
        config.write_text(base + f'output = "{name}"\n' + (f'shot_noise = "{choice}"\n' if choice else ""))
        assert main(["run", str(config)]) == 0
        path = tmp_path / name / "power_spectrum.txt"
        headers[name] = [line for line in path.read_text().splitlines() if line.startswith("#")]
        tables[name] = np.loadtxt(path)
    shot = 128.0**3 / 8**3
    assert any(f"V/N_particles = {shot:.6e} (Mpc/h)^3 subtracted" in line for line in headers["subtract"])
    assert any(f"V/N_particles = {shot:.6e} (Mpc/h)^3 kept (not subtracted)" in line for line in headers["keep"])
    assert headers["default"] == headers["subtract"] and np.array_equal(tables["default"], tables["subtract"])
    subtracted, kept = tables["subtract"][:, 1], tables["keep"][:, 1]
    assert np.any(subtracted < 0), subtracted  # the reason for the key
    assert np.all(kept >= 0)  # a mean of |delta(k)|^2 over a positive window
    # the file's 7 significant digits
    np.testing.assert_array_less(np.abs(kept - (subtracted + shot)), 1e-6 * (np.abs(kept) + np.abs(subtracted) + shot))
    for column in (0, 2, 3):  # k, modes, linear P: the same
        np.testing.assert_array_equal(tables["keep"][:, column], tables["subtract"][:, column])


def test_redshift_space_multipoles_and_density_outputs(tmp_path, capsys, monkeypatch):
    """`redshift_space = "x"` writes power_multipoles.txt (the multipoles of the final
    redshift-space density, Kaiser's linear theory beside them) and `write_density = true`
    density.hdf5 (the real- and redshift-space densities of the Python API's run); a later
    --overwrite run without them removes both, and without --overwrite they are refused."""
    import h5py

    from torchpm.analysis import power_multipoles

    monkeypatch.chdir(tmp_path)
    base = ('n_particles = 8\nbox_size = 64.0\nmesh_factor = 2\nsteps = 2\ndtype = "float64"\nseed = 2\n'
            'batch = 2\n')
    config = tmp_path / "rsd.toml"
    config.write_text(base + 'redshift_space = "x"\nwrite_density = true\nsnapshots = [0.55]\n')
    assert main(["run", str(config)]) == 0
    snapshot_table = (tmp_path / "out" / "power_multipoles_000.txt").read_text().splitlines()
    assert "redshift-space power multipoles at a = 0.5500" in snapshot_table[0]
    assert np.loadtxt(tmp_path / "out" / "power_multipoles_000.txt").shape[1] == 1 + 3 * 2 + 1 + 3
    output = capsys.readouterr().out
    assert "redshift space along x: P_2/P_0" in output and "density.hdf5" in output, output
    sim = torchpm.Simulation(8, 64.0, mesh_factor=2, steps=2, dtype=torch.float64)
    state = sim(sim.white_noise(2, seed=2))
    density = sim.density(state)
    moved = sim.density(sim.redshift_space(state, axis="x"))
    with h5py.File(tmp_path / "out" / "density.hdf5", "r") as handle:
        assert set(handle) == {"density", "density_redshift_space_x"}
        np.testing.assert_allclose(handle["density"][...], density.numpy(), rtol=0, atol=1e-12)
        np.testing.assert_allclose(handle["density_redshift_space_x"][...], moved.numpy(), rtol=0, atol=1e-12)
        assert handle.attrs["Time"] == 1.0
    table = np.loadtxt(tmp_path / "out" / "power_multipoles.txt")
    spectrum = np.loadtxt(tmp_path / "out" / "power_spectrum.txt")
    assert table.shape == (spectrum.shape[0], 1 + 3 * 2 + 1 + 3)
    np.testing.assert_array_equal(table[:, 0], spectrum[:, 0])
    for member in range(2):
        expected = power_multipoles(moved[member] - 1.0, 64.0, axis=0, compensate_cic=True, n_particles=512).power
        np.testing.assert_allclose(table[:, 1 + 3 * member: 4 + 3 * member], expected.T.numpy(), rtol=1e-6,
                                   atol=1e-6 * float(expected.abs().max()))
    # Kaiser's factors of P_linear, with f = dlnD/dlna at a = 1 from colossus (Planck15, no
    # radiation; its spline derivative is good to a few 1e-4 there)
    colossus = pytest.importorskip("colossus.cosmology.cosmology")
    reference = colossus.setCosmology("torchpm-cli", params=dict(
        flat=True, H0=67.74, Om0=0.2589 + 0.0486, Ob0=0.0486, sigma8=0.8159, ns=0.9667, relspecies=False,
        Tcmb0=2.7255))
    f = float(-reference.growthFactor(0.0, derivative=1) / reference.growthFactor(0.0))
    factors = (1 + 2 * f / 3 + f**2 / 5, 4 * f / 3 + 4 * f**2 / 7, 8 * f**2 / 35)
    for column, factor in zip((8, 9, 10), factors):
        np.testing.assert_allclose(table[:, column], factor * spectrum[:, 4], rtol=2e-3)
    # Without --overwrite the folder's outputs are refused; with it, a run without the
    # options leaves no multipoles or density from the run before.
    config.write_text(base)
    assert main(["run", str(config)]) == 2
    assert "already holds outputs" in capsys.readouterr().err
    assert main(["run", str(config), "--overwrite"]) == 0
    assert not (tmp_path / "out" / "power_multipoles.txt").exists() and not (tmp_path / "out" / "density.hdf5").exists()
    assert not list((tmp_path / "out").glob("power_multipoles_*")) and not list((tmp_path / "out").glob("snap_*"))


def test_correlation_function_output(tmp_path, capsys, monkeypatch):
    """`correlation_function = true` writes correlation_function.txt (and one per snapshot):
    the library's xi(r) of the final density of each member (CIC-compensated, Poisson
    self-pairs off), the lags per shell, and linear theory, the Hankel transform of the
    linear P(k) integrated here with numpy on a grid of its own; `shot_noise = "keep"` keeps
    the self-pairs; a later --overwrite run without the key removes the tables."""
    from torchpm.analysis import correlation_function

    monkeypatch.chdir(tmp_path)
    base = 'n_particles = 8\nbox_size = 64.0\nmesh_factor = 2\nsteps = 2\ndtype = "float64"\nseed = 2\nbatch = 2\n'
    config = tmp_path / "xi.toml"
    config.write_text(base + "correlation_function = true\nsnapshots = [0.55]\n")
    assert main(["run", str(config)]) == 0
    output = capsys.readouterr().out
    assert "correlation function: xi = " in output and "correlation_function.txt" in output, output
    out = tmp_path / "out"
    assert "correlation function at a = 0.5500" in (out / "correlation_function_000.txt").read_text().splitlines()[0]
    table = np.loadtxt(out / "correlation_function.txt")
    sim = torchpm.Simulation(8, 64.0, mesh_factor=2, steps=2, dtype=torch.float64)
    density = sim.density(sim(sim.white_noise(2, seed=2)))
    assert table.shape[1] == 1 + 2 + 1 + 1
    for member in range(2):
        expected = correlation_function(density[member] - 1.0, 64.0, window="cic", n_particles=512)
        np.testing.assert_allclose(table[:, 0], expected.r.numpy(), rtol=1e-6)
        np.testing.assert_allclose(table[:, 1 + member], expected.xi.numpy(), rtol=1e-6, atol=1e-9)
        np.testing.assert_array_equal(table[:, 3], expected.lags.numpy())
    # Shells one cell (4 Mpc/h) wide centred on its multiples, up to half the box: 7, the
    # first holding the 6 separations of one cell and the 12 of sqrt(2) cells.
    assert table.shape[0] == 7 and table[0, 3] == 18
    np.testing.assert_allclose(table[0, 0], 4.0 * (6 + 12 * 2**0.5) / 18, rtol=1e-6)
    k = np.linspace(1e-5, 100.0, 2_000_001)
    power = sim.linear_power(torch.from_numpy(k)).numpy()
    linear = [np.trapezoid(k**2 * power * np.sinc(k * r / np.pi), k) / (2 * np.pi**2) for r in table[:, 0]]
    np.testing.assert_allclose(table[:, 4], linear, rtol=2e-3, atol=1e-4 * abs(linear[0]))
    # Kept self-pairs: the first shell differs, the far ones hardly.
    config.write_text(base + 'correlation_function = true\nshot_noise = "keep"\n')
    assert main(["run", str(config), "--overwrite"]) == 0
    kept = np.loadtxt(out / "correlation_function.txt")
    assert abs(kept[0, 1] - table[0, 1]) > 1e-3 and "kept" in (out / "correlation_function.txt").read_text()
    assert not list(out.glob("correlation_function_*")), "the earlier run's snapshot table was left"
    config.write_text(base)
    assert main(["run", str(config)]) == 2
    assert "already holds outputs" in capsys.readouterr().err
    assert main(["run", str(config), "--overwrite"]) == 0
    assert not (out / "correlation_function.txt").exists()


def test_a_power_table_short_of_the_force_mesh_leaves_nan_in_the_linear_columns(tmp_path, capsys, monkeypatch):
    """A power table must cover the particle grid's modes; the tables' bins on the twice finer
    force mesh reach further (here the last, 0.694 h/Mpc, past a table ending at 0.685): the
    linear column there is NaN instead of a traceback at the first snapshot, and without the
    1e-4 to 10 h/Mpc that xi needs, the linear xi is NaN with the header saying why."""
    from torchpm.cosmology import linear_power

    monkeypatch.chdir(tmp_path)
    k = np.logspace(-2.5, np.log10(0.685), 200)
    power = linear_power(torch.from_numpy(k), torchpm.Planck15()).numpy()
    np.savetxt(tmp_path / "table.txt", np.column_stack([k, power]))
    config = tmp_path / "table.toml"
    config.write_text('n_particles = 8\nbox_size = 64.0\nmesh_factor = 2\nsteps = 2\npower_spectrum = "table.txt"\n'
                      'correlation_function = true\nsnapshots = [0.55]\n')
    assert main(["run", str(config)]) == 0
    assert "(linear nan)" in capsys.readouterr().out
    for name in ("power_spectrum.txt", "power_spectrum_000.txt"):
        table = np.loadtxt(tmp_path / "out" / name)
        inside = table[:, 0] <= 0.685
        assert not inside.all() and np.isnan(table[~inside, 3]).all() and np.isfinite(table[inside, 3]).all()
    xi = np.loadtxt(tmp_path / "out" / "correlation_function.txt")
    assert np.isnan(xi[:, -1]).all() and np.isfinite(xi[:, 1]).all()
    assert "not computed (nan): the power table covers" in (tmp_path / "out" / "correlation_function.txt").read_text()


# ----------------------------------------------------------------------------------
# Weak lensing from the command line.

LENSING = ('n_particles = [8, 8, 24]\nbox_size = [64.0, 64.0, 600.0]\nmesh_factor = 1\nsteps = 6\ndtype = "float64"\n'
           'seed = 5\nlensing_planes = 4\nlensing_pixels = 16\nlensing_field = 3.0\nlensing_sources = [0.1, 0.2]\n'
           'snapshots = [0.55]\n')


def test_lensing_outputs_are_the_library_light_cone(tmp_path):
    """`lensing_planes` puts the planes' scale factors among the steps (keeping a_end and
    the snapshots) and writes the planes the library's lightcone takes from the same run
    (bit for bit), their Born maps and C_ell, and linear Limber's."""
    import h5py

    from torchpm import lensing
    from torchpm.__main__ import build_simulation, lens_planes
    from torchpm.config import load_config

    path = tmp_path / "lensing.toml"
    path.write_text(LENSING + f'output = "{tmp_path / "out"}"\n')
    assert main(["run", str(path)]) == 0
    config = load_config(str(path))
    sim = build_simulation(config)
    planes = lens_planes(config, sim.cosmology)
    steps = sim.scale_factors
    for a in (*planes.scale_factors, 0.55, 1.0):
        assert any(abs(a - s) <= 1e-12 * s for s in steps), (a, steps)
    linear = [0.1 + 0.9 * i / 6 for i in range(7)]  # steps = 6 from a_start = 0.1 to a_end = 1
    # a linear step end within a quarter step of a plane is dropped; every other one stays
    for a in linear:
        near = min(abs(a - p) for p in planes.scale_factors) <= 0.25 * 0.15
        kept = any(abs(a - s) <= 1e-12 for s in steps)
        assert kept or (near and abs(a - 0.55) > 1e-9 and a != 1.0), a
    assert len(steps) < len(linear) + len(planes.scale_factors)  # 0.85 (next to a plane) is gone
    taken = lensing.lightcone(sim, sim.white_noise(seed=5), planes=planes, resolution=8, order=sim.paint_order)
    angles = lensing.angular_grid(3.0, 16, dtype=torch.float64)
    kappa = lensing.convergence_born(taken, planes, sim.box_size, angles, [0.1, 0.2], sim.cosmology)
    depth = 600.0
    with h5py.File(tmp_path / "out" / "lensing.hdf5", "r") as handle:
        assert torch.equal(torch.from_numpy(handle["planes"][...]), taken)
        written = torch.from_numpy(handle["convergence"][...])
        assert written.shape == (1, 2, 16, 16)
        assert float((written - kappa.movedim(-1, 1)).abs().max()) <= 1e-12 * float(kappa.abs().max())
        ell = torch.from_numpy(handle["ell"][...])
        power = torch.from_numpy(handle["convergence_power"][...])
        spectrum = lensing.angular_power_spectrum(kappa[..., 1], 3.0)
        assert torch.allclose(power[:, 1], spectrum.power, rtol=1e-12, atol=0)
        limber = lensing.limber_convergence_power(ell, 0.2, sim.cosmology, chi_max=depth)
        assert torch.allclose(torch.from_numpy(handle["limber_power"][1]), limber, rtol=1e-12, atol=0)
        np.testing.assert_allclose(handle.attrs["plane_scale_factors"], planes.scale_factors, rtol=0, atol=0)
        assert handle.attrs["axis"] == "z"
    assert (tmp_path / "out" / "snap_000.hdf5").exists()


def test_lensing_default_source_and_resolution(tmp_path):
    """Without `lensing_sources` the map is of sources at the far end of the planes; the
    planes have the force mesh's cells across by default."""
    import h5py

    path = tmp_path / "lensing.toml"
    path.write_text(LENSING.replace("lensing_sources = [0.1, 0.2]\n", "").replace("mesh_factor = 1", "mesh_factor = 2")
                    + 'lensing_axis = "z"\n' + f'output = "{tmp_path / "out"}"\n')
    assert main(["run", str(path)]) == 0
    with h5py.File(tmp_path / "out" / "lensing.hdf5", "r") as handle:
        assert handle["planes"].shape == (1, 4, 16, 16)
        (z,) = handle.attrs["source_redshifts"]
        a = torchpm.Planck15().scale_factor_at_distance(torch.tensor(600.0, dtype=torch.float64))
        assert abs(z - (1 / float(a) - 1)) < 1e-12


@pytest.mark.parametrize("pixels", [1, 4])
def test_lensing_small_maps_finish_the_run(tmp_path, capsys, pixels):
    """`lensing_pixels` accepts 1 and up: maps with fewer than three multipole bins (the
    summary's C_ell / Limber ratio takes the first three) still finish the run."""
    path = tmp_path / "lensing.toml"
    path.write_text(LENSING.replace("lensing_pixels = 16", f"lensing_pixels = {pixels}").replace("steps = 6", "steps = 3")
                    .replace("snapshots = [0.55]\n", "") + f'output = "{tmp_path / "out"}"\n')
    assert main(["run", str(path)]) == 0
    assert (tmp_path / "out" / "lensing.hdf5").exists()
    assert "lensing: 4 planes" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    ("a_start = 0.98\n", "the farthest plane"),
    ("a_end = 0.9\n", "the nearest plane is taken at a ="),
    ("lensing_sources = [0.0]\n", "`lensing_sources` must be a list of redshifts in (0, 1100] (item 0 is not)"),
    ("lensing_sources = 0.5\n", "`lensing_sources`"),
    ("lensing_axis = \"w\"\n", "`lensing_axis`"),
    ("lensing_planes = -1\n", "`lensing_planes`"),
    ("lensing_field = 0\n", "`lensing_field`"),
])
def test_lensing_config_errors(tmp_path, capsys, change, message):
    key = change.split("=")[0].strip()
    lines = [line for line in LENSING.splitlines(keepends=True) if line.split("=")[0].strip() not in (key, "snapshots")]
    text = "".join(lines) + change
    path = tmp_path / "bad.toml"
    path.write_text(text + f'output = "{tmp_path / "out"}"\n')
    assert main(["run", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_lensing_run_does_not_resume(tmp_path, capsys):
    path = tmp_path / "lensing.toml"
    path.write_text(LENSING + f'output = "{tmp_path / "out"}"\n')
    assert main(["run", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--overwrite", "--resume", str(tmp_path / "out" / "snap_000.hdf5")]) == 2
    assert "cannot resume" in capsys.readouterr().err


HALOS = ('n_particles = 16\nbox_size = 32.0\nmesh_factor = 2\nsteps = 6\ndtype = "float64"\nseed = 2\n'
         'snapshots = [0.55]\nhalos_linking_length = 0.2\nhalos_min_members = 5\n')


def test_halos_outputs_are_the_library_catalogue(tmp_path, capsys):
    """`halos_linking_length` writes halos.hdf5 (the final state) and halos_000.hdf5 (the
    snapshot): the catalogues `find_halos` makes of the library run stopped there, bit for
    bit, with the masses the particle count times the particle mass written beside them;
    the summary names the count and the heaviest. A rerun with --overwrite and no halos
    leaves no catalogue of the earlier run behind (nor an earlier run's lensing.hdf5)."""
    import h5py

    from torchpm.__main__ import build_simulation
    from torchpm.config import load_config
    from torchpm.halos import spherical_overdensity_masses

    path = tmp_path / "halos.toml"
    out = tmp_path / "out"
    path.write_text(HALOS + f'output = "{out}"\nf_nl = 50.0\n')  # (non-Gaussian: the attribute names it)
    assert main(["run", str(path)]) == 0
    report = capsys.readouterr().out
    config = load_config(str(path))
    sim = build_simulation(config)
    with torch.no_grad():
        states = sim.trajectory(sim.white_noise(seed=2), at=[0.55, 1.0])
    for name, state in (("halos_000.hdf5", states[0]), ("halos.hdf5", states[1])):
        expected = torchpm.find_halos(sim, state, linking_length=0.2, min_members=5)
        with h5py.File(out / name, "r") as handle:
            assert handle.attrs["a"] == state.a and handle.attrs["min_members"] == 5 and handle.attrs["f_nl"] == 50.0
            for key, field in (("label", "labels"), ("members", "members"), ("mass", "masses"),
                               ("position", "positions"), ("velocity", "velocities")):
                assert torch.equal(torch.from_numpy(handle[key][...]), getattr(expected, field)), (name, key)
            # M_200m and M_200c about the centres: the library's, halo by halo (its own test
            # checks it against a brute force over every particle)
            for suffix, reference in (("200m", "mean"), ("200c", "critical")):
                so = spherical_overdensity_masses(sim, state, expected, reference=reference)
                assert torch.equal(torch.from_numpy(handle[f"m{suffix}"][...]), so.masses), (name, suffix)
                assert torch.equal(torch.from_numpy(handle[f"r{suffix}"][...]), so.radii), (name, suffix)
            assert (handle["m200c"][...] <= handle["m200m"][...]).all() and handle["m200m"][0, 0] > 0
            members, masses = handle["members"][...], handle["mass"][...]
            assert members.shape[1] > 0 and members.min() >= 5, (name, members)
            np.testing.assert_allclose(masses, members * handle.attrs["particle_mass_msun_h"], rtol=1e-12)
            box = handle.attrs["box_size"]
            assert (handle["position"][...] >= 0).all() and (handle["position"][...] < box).all()
            # b = 0.2 mean separations: 0.2 * 32 Mpc/h / 16
            assert abs(handle.attrs["linking_distance_mpc_h"] - 0.4) < 1e-12
    (line,) = [line for line in report.splitlines() if "halos (friends-of-friends" in line]
    with h5py.File(out / "halos.hdf5", "r") as handle:
        count, heaviest = int((handle["label"][0] >= 0).sum()), float(handle["mass"][0, 0])
    assert f": {count} found; heaviest {heaviest:.3e} Msun/h" in line and ">= 5 particles" in line, line
    (out / "lensing.hdf5").write_bytes(b"an earlier run's light cone")
    path.write_text(HALOS.replace("halos_linking_length = 0.2\n", "") + f'output = "{out}"\n')
    assert main(["run", str(path), "--overwrite"]) == 0
    assert "halos (" not in capsys.readouterr().out
    left = sorted(p.name for p in out.iterdir())
    assert not [name for name in left if name.startswith(("halos", "lensing"))], left
    assert "snap_000.hdf5" in left


def test_halos_files_make_a_folder_hold_outputs(tmp_path, capsys):
    """A folder holding only an earlier run's halo catalogue is refused without
    --overwrite, like its other outputs."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "halos_002.hdf5").write_bytes(b"")
    path = tmp_path / "run.toml"
    path.write_text('n_particles = 4\nbox_size = 40.0\nsteps = 2\n' + f'output = "{out}"\n')
    assert main(["run", str(path)]) == 2
    assert "halos_002.hdf5" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ("halos_linking_length = 1.0\n", "`halos_linking_length` must be 0 (no halos) or a linking length in (0, 1)"),
    ("halos_linking_length = -0.2\n", "`halos_linking_length` must be 0"),
    ("halos_linking_length = \"0.2\"\n", "`halos_linking_length` must be 0"),
    ("halos_linking_length = true\n", "`halos_linking_length` must be 0"),
    ("halos_min_members = 1\n", "`halos_min_members`"),
    ("halos_min_members = 2.5\n", "`halos_min_members`"),
])
def test_halos_config_errors(tmp_path, capsys, change, message):
    key = change.split("=")[0].strip()
    lines = [line for line in HALOS.splitlines(keepends=True) if line.split("=")[0].strip() != key]
    path = tmp_path / "bad.toml"
    path.write_text("".join(lines) + change + f'output = "{tmp_path / "out"}"\n')
    assert main(["run", str(path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("key", ["snapshots", "halos_linking_length", "write_density", "lensing_planes"])
def test_hdf5_outputs_without_h5py_are_one_line(tmp_path, capsys, monkeypatch, key):
    """A run asking for HDF5 outputs where h5py is missing stops before running, naming the key."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "h5py" else real(name, *args))
    monkeypatch.setitem(sys.modules, "h5py", None)  # (as if not installed: importing it fails)
    text = HALOS if key == "halos_linking_length" else HALOS.replace("halos_linking_length = 0.2\n", "")
    if key != "snapshots":
        text = text.replace("snapshots = [0.55]\n", "")
    if key == "write_density":
        text += "write_density = true\n"
    if key == "lensing_planes":
        text = LENSING.replace("snapshots = [0.55]\n", "")
    path = tmp_path / "run.toml"
    path.write_text(text + f'output = "{tmp_path / "out"}"\n')
    assert main(["run", str(path)]) == 2
    assert f"`{key}` needs h5py" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("packages,line", [
    (["matplotlib"], "the run needs matplotlib (the figure power_spectrum.png): pip install matplotlib"),
    (["tqdm"], "the run needs tqdm (the progress bar): pip install tqdm"),
    (["tqdm", "matplotlib"], "the run needs tqdm (the progress bar) and matplotlib (the figure "
                             "power_spectrum.png): pip install tqdm matplotlib"),
])
def test_figure_without_matplotlib_is_one_line_before_the_run(tmp_path, capsys, monkeypatch, packages, line):
    """Where matplotlib (or tqdm) is missing, the run stops before it starts (one line, exit
    2), not with a traceback at its end, after the steps, where rank 0 draws
    power_spectrum.png (or at its start, where the progress bar is made)."""
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)  # (as if not installed: importing it fails)
    path = tmp_path / "run.toml"
    path.write_text(SMALL + f'output = "{tmp_path / "out"}"\n')
    assert main(["run", str(path)]) == 2
    error = capsys.readouterr().err
    assert error.splitlines()[-1] == "torchpm run: " + line, error
    assert not (tmp_path / "out").exists()


def test_halos_linking_distance_past_a_third_of_the_box_is_refused_before_the_run(tmp_path, capsys):
    """b = 0.2 (V / N)^(1/3) must be at most a third of the shortest side (the halo finder's
    cells): a flat box is refused before any step runs, naming the key and both lengths."""
    path = tmp_path / "flat.toml"
    out = tmp_path / "out"
    # b = 0.2 * (1000 * 1000 * 10 / 512)^(1/3) = 5.39 Mpc/h > 10 / 3
    path.write_text('n_particles = 8\nbox_size = [1000.0, 1000.0, 10.0]\nsteps = 2\n'
                    f'halos_linking_length = 0.2\noutput = "{out}"\n')
    assert main(["run", str(path)]) == 2
    error = capsys.readouterr().err
    assert "`halos_linking_length` = 0.2 links within 5.38" in error and "(3.33333 Mpc/h)" in error, error
    assert not out.exists()


def test_a_halo_catalogue_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch):
    """A failed write of halos.hdf5 (a full disk, faked) is a one-line error naming the
    file (raised together on a grid: the other ranks do not wait for rank 0)."""
    import errno

    import torchpm.__main__ as cli

    def full(path, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(cli, "_write_halos", full)
    path = tmp_path / "run.toml"
    out = tmp_path / "out"
    path.write_text(HALOS.replace("snapshots = [0.55]\n", "").replace("steps = 6", "steps = 2")
                    + f'output = "{out}"\n')
    assert main(["run", str(path)]) == 2
    error = capsys.readouterr().err
    assert f"cannot write {str(out / 'halos.hdf5')!r}: No space left on device" in error, error


@pytest.mark.parametrize("output", ["snapshot", "table", "halos"])
def test_an_output_at_a_snapshot_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch, output):
    """A write at a snapshot that fails (a full disk, faked) inside the run's observer: the
    snapshot itself, its P(k) table or its halo catalogue. One line naming the file, exit
    2, and the run stops there (the same on a process grid: test_cli_distributed)."""
    import errno

    import h5py

    import torchpm.__main__ as cli

    def full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))

    out = tmp_path / "out"
    failing = {"snapshot": "snap_000.hdf5", "table": "power_spectrum_000.txt", "halos": "halos_000.hdf5"}[output]
    if output == "snapshot":  # (write_snapshot writes a temporary file, then renames it)
        real_file = h5py.File
        monkeypatch.setattr(h5py, "File", lambda name, *args, **kwargs: full(name) if os.path.basename(
            os.fspath(name)).startswith(".snap_000") else real_file(name, *args, **kwargs))
    elif output == "table":
        real_savetxt = np.savetxt
        monkeypatch.setattr(np, "savetxt", lambda name, *args, **kwargs: full(name) if os.path.basename(
            os.fspath(name)) == failing else real_savetxt(name, *args, **kwargs))
    else:
        real_halos = cli._write_halos
        monkeypatch.setattr(cli, "_write_halos", lambda name, *args: full(name) if os.path.basename(
            name) == failing else real_halos(name, *args))
    path = tmp_path / "run.toml"
    path.write_text(HALOS + f'output = "{out}"\n')
    assert main(["run", str(path)]) == 2
    error = capsys.readouterr().err
    assert error.splitlines()[-1] == f"torchpm run: cannot write {str(out / failing)!r}: No space left on device", \
        error
    assert "Traceback" not in error
    assert not (out / "power_spectrum.txt").exists()  # (stopped at the snapshot)


# The outputs written after the run: config.toml before it, rank 0's tables, figure and
# lens planes' file after it, and density.hdf5 (every rank's block, in turn).
FINAL = (LENSING.replace("snapshots = [0.55]\n", "").replace("steps = 6", "steps = 3")
         + 'redshift_space = "x"\nwrite_density = true\n')


@pytest.mark.parametrize("output", ["config.toml", "power_spectrum.txt", "power_multipoles.txt", "power_spectrum.png",
                                    "lensing.hdf5", "density.hdf5"])
def test_a_final_output_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch, output):
    """A final output whose write fails (a full disk, faked): one line naming the file and
    exit 2, not an OSError traceback (the same on a process grid: test_cli_distributed)."""
    import errno

    import h5py

    import torchpm.__main__ as cli

    matplotlib_figure = pytest.importorskip("matplotlib.figure")

    def full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))

    def failing(name):  # (write_fields writes a temporary file, then renames it)
        return os.path.basename(os.fspath(name)) in (output, f".{output}.partial")

    if output == "config.toml":  # (the CLI's own open: the module's name first, then the builtin)
        monkeypatch.setattr(cli, "open", lambda name, *args, **kwargs: full(name) if failing(name) else open(
            name, *args, **kwargs), raising=False)
    elif output.endswith(".txt"):
        real_savetxt = np.savetxt
        monkeypatch.setattr(np, "savetxt", lambda name, *args, **kwargs: full(name) if failing(name) else real_savetxt(
            name, *args, **kwargs))
    elif output.endswith(".png"):
        real_savefig = matplotlib_figure.Figure.savefig
        monkeypatch.setattr(matplotlib_figure.Figure, "savefig", lambda figure, name, *args, **kwargs: full(
            name) if failing(name) else real_savefig(figure, name, *args, **kwargs))
    else:
        real_file = h5py.File
        monkeypatch.setattr(h5py, "File", lambda name, *args, **kwargs: full(name) if failing(name) else real_file(
            name, *args, **kwargs))
    out = tmp_path / "out"
    path = tmp_path / "run.toml"
    path.write_text(FINAL + f'output = "{out}"\n')
    assert main(["run", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1] == \
        f"torchpm run: cannot write {str(out / output)!r}: No space left on device", captured.err
    assert "Traceback" not in captured.err
    assert "wrote " not in captured.out  # (no report of outputs written)
    assert not (out / f".{output}.partial").exists()
    if output == "config.toml":  # (before the run: nothing ran)
        assert not (out / "power_spectrum.txt").exists()


def test_a_run_that_fails_is_one_line_and_leaves_no_earlier_table(tmp_path, capsys, monkeypatch):
    """What the run itself refuses (initial conditions that overflow: sigma8 = 1e20) is
    one line and status 2, not a traceback; an --overwrite run that fails leaves no
    table of the earlier run beside its own config.toml."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(SMALL + 'output = "out"\n')
    assert main(["run", str(config)]) == 0
    assert (tmp_path / "out" / "power_spectrum.txt").exists()
    capsys.readouterr()
    config.write_text(SMALL + 'output = "out"\n'
                      "cosmology = {Omega_c = 0.25, Omega_b = 0.05, h = 0.7, n_s = 0.96, sigma8 = 1e20}\n")
    assert main(["run", str(config), "--check"]) == 0  # (a setting like any other: only the run can tell)
    capsys.readouterr()
    assert main(["run", str(config), "--overwrite"]) == 2
    error = capsys.readouterr().err
    assert "the LPT initial conditions are not finite" in error and "Traceback" not in error, error
    assert _line_count(error.split("torchpm run:")[-1]) == 1, error
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.toml"]


def test_a_defect_in_the_command_lines_own_code_during_the_run_keeps_its_traceback(tmp_path, monkeypatch):
    """Only what the simulation refuses becomes the one-line error: a ValueError raised by
    the command line's own code at a snapshot (here a failed unpack in the P(k) tables)
    propagates as it is, not as a configuration mistake with status 2."""
    import torchpm.__main__ as cli

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(SMALL + 'output = "out"\nsnapshots = [1.0]\n')

    def broken(self, state):
        _, _ = [1, 2, 3]

    monkeypatch.setattr(cli._Tables, "measure", broken)
    with pytest.raises(ValueError, match="too many values to unpack"):
        main(["run", str(config)])
