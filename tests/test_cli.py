"""`python -m torchpm run` on a tiny config: outputs, units header, errors."""

import os
import subprocess
import sys

import numpy as np

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


def test_run_rejects_bad_config(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("n_particles = 8\nmesh_factor = 1.5\n")
    result = _run(["run", str(config)], cwd=tmp_path)
    assert result.returncode != 0 and "mesh_factor" in result.stderr
    config.write_text("n_particle = 8\n")
    result = _run(["run", str(config)], cwd=tmp_path)
    assert result.returncode != 0 and "unknown keys" in result.stderr
