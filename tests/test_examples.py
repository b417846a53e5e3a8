"""The examples run as users run them (small sizes) and show what they claim."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torchpm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torchpm.__file__)))


def test_paired_fixed_runs_remove_the_cosmic_variance_of_the_redshift_space_monopole(tmp_path):
    """examples/redshift_space_multipoles.py at 16^3: the seed-to-seed scatter of a fixed
    pair's mean P_0 on the largest scales is a small fraction of the ordinary runs' (their
    amplitudes are fixed, the phases' leading effect cancels in the pair), and it is near
    Kaiser's linear P_0 there (lattice starts: no shot noise subtracted)."""
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "redshift_space_multipoles.py"), "--particles", "16",
         "--steps", "3", "--seeds", "4", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "multipoles.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "result.json").read_text())
    for i in range(3):  # the three largest scales
        ordinary, fixed = summary["ordinary_scatter_P0"][i], summary["fixed_pair_scatter_P0"][i]
        assert fixed < 0.25 * ordinary, (i, fixed, ordinary)
        ratio = summary["fixed_pair_mean"][0][i] / summary["kaiser"][0][i]
        assert abs(ratio - 1) < 0.06, (i, ratio)
