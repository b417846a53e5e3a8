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
                      'halos_linking_length = 0.3\nhalos_min_members = 2\n')
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
    # smallest particle ids), masses and centres.
    with h5py.File(tmp_path / "single" / "halos.hdf5", "r") as one, \
            h5py.File(tmp_path / "grid" / "halos.hdf5", "r") as four:
        assert one["label"].shape[1] > 0
        for name in ("label", "members"):
            np.testing.assert_array_equal(four[name][...], one[name][...])
        for name in ("mass", "position", "velocity"):
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
