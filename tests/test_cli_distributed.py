"""The command line under torchrun: 4 gloo ranks write the same P(k) table as one process."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.distributed

CONFIG = """\
n_particles = 12
box_size = 96.0
mesh_factor = 2
a_start = 0.1
steps = 3
dtype = "float64"
threads = 1
seed = 4
collective_timeout = 120
"""


def _run(command, tmp_path):
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_torchrun_four_ranks_matches_single_process(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG + 'redshift_space = "y"\nwrite_density = true\nlensing_planes = 3\nlensing_pixels = 8\n'
                      'halos_linking_length = 0.3\nhalos_min_members = 2\ncorrelation_function = true\n')
    _run([sys.executable, "-m", "torchpm", "run", str(config), "--output", str(tmp_path / "single")], tmp_path)
    result = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
         "-m", "torchpm", "run", str(config), "--output", str(tmp_path / "grid")],
        tmp_path,
    )
    single = np.loadtxt(tmp_path / "single" / "power_spectrum.txt")
    grid = np.loadtxt(tmp_path / "grid" / "power_spectrum.txt")
    assert single.shape == grid.shape and single.shape[0] > 3
    np.testing.assert_array_equal(grid[:, 2], single[:, 2])  # mode counts
    relative = np.abs(grid[:, :2] - single[:, :2]) / np.abs(single[:, :2])
    assert relative.max() <= 1e-10, f"P(k) tables differ by {relative.max():.3e} (relative)"
    # The redshift-space multipoles, and the densities the 4 ranks wrote into one file in turn.
    single = np.loadtxt(tmp_path / "single" / "power_multipoles.txt")
    grid = np.loadtxt(tmp_path / "grid" / "power_multipoles.txt")
    assert single.shape == grid.shape == (single.shape[0], 8)
    scale = np.abs(single[:, 1:4]).max(axis=1, keepdims=True)
    assert (np.abs(grid[:, 1:4] - single[:, 1:4]) / scale).max() <= 1e-10
    # The correlation function, binned over every rank's separations.
    single = np.loadtxt(tmp_path / "single" / "correlation_function.txt")
    grid = np.loadtxt(tmp_path / "grid" / "correlation_function.txt")
    assert single.shape == grid.shape == (single.shape[0], 4) and single.shape[0] > 3
    np.testing.assert_array_equal(grid[:, 2], single[:, 2])  # lags per shell
    assert (np.abs(grid[:, :2] - single[:, :2]) / np.abs(single[:, :2]).max(axis=0)).max() <= 1e-10
    import h5py

    with h5py.File(tmp_path / "single" / "density.hdf5", "r") as one, \
            h5py.File(tmp_path / "grid" / "density.hdf5", "r") as four:
        assert set(one) == set(four) == {"density", "density_redshift_space_y"}
        for name in one:
            np.testing.assert_allclose(four[name][...], one[name][...], rtol=0, atol=1e-10)
    # The light cone's planes (summed over the grid), its convergence maps and their C_ell.
    with h5py.File(tmp_path / "single" / "lensing.hdf5", "r") as one, \
            h5py.File(tmp_path / "grid" / "lensing.hdf5", "r") as four:
        assert one["planes"].shape == (1, 3, 24, 24)
        for name in ("planes", "convergence", "convergence_power"):
            scale = np.abs(one[name][...]).max()
            assert scale > 0 and np.abs(four[name][...] - one[name][...]).max() <= 1e-10 * scale, name
    # The halo catalogue, found across the grid's blocks: the same groups (labels are their
    # smallest particle ids), masses and centres, and spherical-overdensity masses about them.
    with h5py.File(tmp_path / "single" / "halos.hdf5", "r") as one, \
            h5py.File(tmp_path / "grid" / "halos.hdf5", "r") as four:
        assert one["label"].shape[1] > 0
        for name in ("label", "members"):
            np.testing.assert_array_equal(four[name][...], one[name][...])
        for name in ("mass", "position", "velocity", "m200m", "r200m", "m200c", "r200c"):
            scale = np.abs(one[name][...]).max()
            assert np.abs(four[name][...] - one[name][...]).max() <= 1e-10 * scale, name
    # Only rank 0 prints the summary and writes the outputs.
    assert result.stdout.count("torchpm run:") == 1, result.stdout
    assert (tmp_path / "grid" / "power_spectrum.png").exists()
    assert "grid=(2, 2)" in result.stdout, result.stdout


def test_nccl_runs_get_a_blocking_wait_unless_the_user_chose():
    # README "When a rank fails": with NCCL, a dead peer must make wait() raise after the
    # timeout (as with gloo), which needs TORCH_NCCL_BLOCKING_WAIT=1 when the group is made.
    from torchpm.distributed.launch import nccl_failure_settings

    environ = {"OTHER": "x"}
    assert nccl_failure_settings(environ) == {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert environ == {"OTHER": "x", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        chosen = {name: "0"}
        assert nccl_failure_settings(chosen) == {}
        assert chosen == {name: "0"}


def test_torchrun_resume_refused_by_one_rank_is_one_error_on_every_rank(tmp_path):
    """A 2-rank run writes a snapshot set; rank 1's file is then made incompatible (another
    h). ``--resume`` must stop every rank with the one-line error (naming the file and the
    rank), before the new output folder is made: no traceback of a rank left waiting, no
    config.toml that a rerun would refuse to overwrite."""
    import h5py

    config = tmp_path / "run.toml"
    config.write_text(CONFIG + "snapshots = [0.4]\n")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "torchpm"]
    _run([*launch, "run", str(config), "--output", str(tmp_path / "first")], tmp_path)
    with h5py.File(tmp_path / "first" / "snap_000.1.hdf5", "r+") as handle:
        handle["torchpm"].attrs["cosmology_h"] = 0.5
    command = [*launch, "run", str(config), "--output", str(tmp_path / "second"),
               "--resume", str(tmp_path / "first" / "snap_000.0.hdf5")]
    result = subprocess.run(command, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    # Both ranks print the one line (rank 1's reason) and exit; neither is left waiting.
    assert output.count("torchpm run: rank 1 (grid (1, 0)): cannot resume from") == 2, output[-3000:]
    assert "cosmology_h: snapshot 0.5" in output, output[-3000:]
    assert "[rank0]: Traceback" not in output and "Connection closed" not in output, output[-3000:]
    assert not (tmp_path / "second" / "config.toml").exists()


def test_torchrun_initial_conditions_that_overflow_are_one_line_on_every_rank(tmp_path):
    """sigma8 = 1e20 (or a power table in the wrong units): the LPT particles are not
    finite. Every rank prints the one line naming them, not the migration's refusal of
    non-finite particles as a traceback."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.replace("seed = 4", "seed = 4\ncosmology = {Omega_c = 0.25, Omega_b = 0.05, h = 0.7, "
                                                "n_s = 0.96, sigma8 = 1e20}"))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "torchpm"]
    result = subprocess.run([*launch, "run", str(config), "--output", str(tmp_path / "out")], cwd=tmp_path,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    # (counted in the whole output: the two ranks' lines may arrive interleaved on one)
    # (both ranks raise the same message: it names them once)
    line = "torchpm run: rank 0 (grid (0, 0)), rank 1 (grid (1, 0)): the LPT initial conditions are not finite"
    assert output.count(line) == 2 and output.count("torchpm run: ") == 2, output[-3000:]
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output, output[-3000:]


def test_torchrun_ranks_with_different_configs_stop_with_one_error(tmp_path):
    """Each rank reads its own config file: a rank whose seed differs (it would make its
    block of another field: the run mixed two, exit 0) stops every rank with one line
    naming the key and each rank's value, before any output is written."""
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text(CONFIG)
    second.write_text(CONFIG.replace("seed = 4", "seed = 5"))
    launcher = tmp_path / "per_rank.py"
    launcher.write_text(
        "import os, sys\n"
        "from torchpm.__main__ import main\n"
        "configs = sys.argv[1].split(',')\n"
        "sys.exit(main(['run', configs[int(os.environ['RANK'])], *sys.argv[2:]]))\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(launcher),
               f"{first},{second}", "--output", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    line = "the ranks disagree on `seed` (rank 0 (grid (0, 0)): 4, rank 1 (grid (1, 0)): 5)"
    assert output.count(line) == 2, output[-3000:]
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output, output[-3000:]
    assert not (tmp_path / "out").exists()
    # a rank's own threads and collective timeout (and device, which the CLI sets per rank
    # on CUDA) may differ
    second.write_text(CONFIG.replace("threads = 1", "threads = 2").replace("collective_timeout = 120",
                                                                         "collective_timeout = 150"))
    second.write_text(second.read_text() + "snapshots = [0.4]\n")
    first.write_text(first.read_text() + "snapshots = [0.4]\n")
    _run(command, tmp_path)
    assert (tmp_path / "out" / "power_spectrum.txt").exists()
    # the ranks' files (their configs differ in threads) read back as one set
    from torchpm.io import read_snapshot

    assert read_snapshot(str(tmp_path / "out" / "snap_000")).total == 12**3


def test_torchrun_check_names_the_grid_and_the_per_rank_estimate(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    result = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "-m", "torchpm", "run", str(config), "--check"], tmp_path)
    assert result.stdout.count("# process grid 2 x 1 (2 ranks)") == 1, result.stdout
    assert "# memory estimate per rank:" in result.stdout, result.stdout
    assert not (tmp_path / "out").exists()


# Each rank runs the CLI with one output made to fail on one rank (a full disk, faked):
# `python failing.py FAILING_RANK OUTPUT run cfg.toml ...` (OUTPUT: snapshot or halos at a
# snapshot; table or density, the final power_spectrum.txt or density.hdf5), printing its
# exit status.
FAILING_LAUNCHER = """\
import errno, os, signal, sys

import h5py
import numpy as np

import torchpm.__main__ as cli

failing_rank, output = int(sys.argv[1]), sys.argv[2]
rank = int(os.environ.get("RANK", "0"))
# torchrun stops the other ranks once one exits: each rank is to finish on its own here (a
# rank that hangs instead is killed 30 s later and prints no status)
signal.signal(signal.SIGTERM, signal.SIG_IGN)


def full(path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))


if rank == failing_rank and output == "snapshot":  # (write_snapshot writes a temporary file first)
    real_file = h5py.File
    h5py.File = lambda name, *args, **kwargs: (full(name) if os.path.basename(os.fspath(name)).startswith(
        ".snap_000") else real_file(name, *args, **kwargs))
if rank == failing_rank and output == "halos":
    real_halos = cli._write_halos
    cli._write_halos = lambda name, *args: (full(name) if os.path.basename(name) == "halos_000.hdf5"
                                            else real_halos(name, *args))
if rank == failing_rank and output == "table":
    real_savetxt = np.savetxt
    np.savetxt = lambda name, *args, **kwargs: (full(name) if os.path.basename(os.fspath(name)) == "power_spectrum.txt"
                                                else real_savetxt(name, *args, **kwargs))
if rank == failing_rank and output == "density":  # (write_fields writes a temporary file first)
    real_file = h5py.File
    h5py.File = lambda name, *args, **kwargs: (full(name) if os.path.basename(os.fspath(name)) == (
        ".density.hdf5.partial") else real_file(name, *args, **kwargs))
if rank == failing_rank and output == "defect":  # (not a write error: a defect in rank 0's figure)
    def plot(*args, **kwargs):
        raise ValueError("a defect in the figure")
    cli.plot = plot
status = cli.main(sys.argv[3:])
print(f"rank {rank} exits with status {status}", file=sys.stderr, flush=True)
sys.exit(status)
"""


MESSAGE = "cannot write {!r}: No space left on device"


def _fail_alone_and_on_a_grid(tmp_path, config_text, output, failing_rank, single_name, grid_name):
    """Run the CLI with ``output`` failing (a full disk, faked by FAILING_LAUNCHER) in one
    process, then on rank ``failing_rank`` of a 2 x 1 grid under torchrun. Checks the one
    process's one line, exit status 2 and no traceback, and that every rank prints the
    grid's line naming the failing rank and the file, exits with status 2, and shows no
    traceback. Returns the grid run's output and its folder."""
    config = tmp_path / "run.toml"
    config.write_text(config_text)
    launcher = tmp_path / "failing.py"
    launcher.write_text(FAILING_LAUNCHER)
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    single = subprocess.run([sys.executable, str(launcher), "0", output, "run", str(config), "--output",
                             str(tmp_path / "single")], cwd=tmp_path, env=environment, capture_output=True,
                            text=True, timeout=300)
    assert single.returncode == 2, single.stderr[-3000:]
    assert f"torchpm run: {MESSAGE.format(str(tmp_path / 'single' / single_name))}\n" in single.stderr, \
        single.stderr[-3000:]
    assert "Traceback" not in single.stderr, single.stderr[-3000:]

    grid = tmp_path / "grid"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(launcher),
         str(failing_rank), output, "run", str(config), "--output", str(grid)],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)  # (no hang)
    output_text = result.stdout + result.stderr
    assert result.returncode != 0
    line = (f"torchpm run: rank {failing_rank} (grid ({failing_rank}, 0)): {MESSAGE.format(str(grid / grid_name))} "
            "[every rank of the 2 x 1 grid raises this error together]")
    # (the ranks share the pipe: one rank's line may run into the other's)
    assert output_text.count(line) == 2, output_text[-3000:]
    for rank in range(2):
        assert f"rank {rank} exits with status {single.returncode}" in output_text, output_text[-3000:]
        assert f"[rank{rank}]: Traceback" not in output_text, output_text[-3000:]
    return result, grid


@pytest.mark.parametrize("output, failing_rank, single_file, grid_file", [
    ("snapshot", 1, "snap_000.hdf5", "snap_000.1.hdf5"),  # write_snapshot, collective
    ("halos", 0, "halos_000.hdf5", "halos_000.hdf5"),  # rank 0's write, raised together as a UserError
])
def test_torchrun_output_at_a_snapshot_failing_on_one_rank_is_one_line_on_every_rank(
        tmp_path, output, failing_rank, single_file, grid_file):
    """A write inside the run's observer that fails on one rank (its file of the snapshot
    set, or rank 0's halo catalogue of the snapshot) stops every rank with the one line
    and the exit status of one process with the same failure (2), naming the file and the
    rank: not a RuntimeError traceback on every rank, not a rank left waiting."""
    result, grid = _fail_alone_and_on_a_grid(
        tmp_path, CONFIG + "snapshots = [0.4]\nhalos_linking_length = 0.3\nhalos_min_members = 2\n", output,
        failing_rank, single_file, grid_file)
    assert "RuntimeError" not in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]
    # the run stopped there: no final table (and of a failed snapshot set, no file: each rank's removed)
    assert not (grid / "power_spectrum.txt").exists()
    assert output != "snapshot" or not list(grid.glob("snap_000*"))


@pytest.mark.parametrize("output, failing_rank, name", [
    ("table", 0, "power_spectrum.txt"),  # rank 0's, after the other ranks finished
    ("density", 1, "density.hdf5"),  # torchpm.io.write_fields, collective: the ranks write in turn
])
def test_torchrun_final_output_failing_on_one_rank_is_one_line_on_every_rank(tmp_path, output, failing_rank, name):
    """A final output whose write fails on one rank (rank 0's P(k) table, or a rank's block
    of density.hdf5) stops every rank with the one line and the exit status of one
    process with the same failure (2), naming the file and the rank: no traceback, no
    rank left waiting for rank 0, no rank exiting 0."""
    result, grid = _fail_alone_and_on_a_grid(tmp_path, CONFIG + "write_density = true\n", output, failing_rank,
                                             name, name)
    assert "OSError" not in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]
    assert "wrote " not in result.stdout  # (rank 0 reports no outputs written)
    # a failed density.hdf5 leaves no file (nor its temporary), and the run stopped there
    assert not (grid / ".density.hdf5.partial").exists()
    assert output != "density" or not (grid / "density.hdf5").exists() and not (grid / "power_spectrum.txt").exists()


def test_torchrun_a_defect_in_rank_0s_final_outputs_stops_every_rank_at_once(tmp_path):
    """Any other exception of rank 0 while it writes the final outputs (here a ValueError of
    the figure: a defect, not a full disk) is its traceback on rank 0 and a RuntimeError
    naming it on the others, at once: not a wait until the collective timeout (120 s)."""
    import time

    config = tmp_path / "run.toml"
    config.write_text(CONFIG)  # (collective_timeout = 120)
    launcher = tmp_path / "failing.py"
    launcher.write_text(FAILING_LAUNCHER)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(launcher), "0",
         "defect", "run", str(config), "--output", str(tmp_path / "out")],
        cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    output_text = result.stdout + result.stderr
    assert result.returncode != 0
    assert "ValueError: a defect in the figure" in output_text, output_text[-3000:]
    assert "RuntimeError: rank 0 (grid (0, 0)): ValueError: a defect in the figure" in output_text, output_text[-3000:]
    assert elapsed < 100, f"the ranks took {elapsed:.0f} s: the other rank waited for the collective timeout"
