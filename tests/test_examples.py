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


def test_weak_lensing_example_matches_limber_on_the_largest_scales(tmp_path):
    """examples/weak_lensing.py at 16 particles across runs and writes its outputs; the
    maps' angular power in the three largest rings (36 modes) is Limber's linear
    prediction cut at the light cone's depth within their cosmic variance and the coarse
    particle grid's loss of power (0.58 measured; 0.85 at 32 particles across), and the
    map's rms is plausible. (The normalisation itself is checked exactly in
    test_lensing.py: hand cases and JaxPM's convergence_Born.)"""
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "weak_lensing.py"), "--particles", "16", "--planes", "5",
         "--steps", "4", "--pixels", "32", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "convergence.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "result.json").read_text())
    ratio = summary["ratio_first_rings"]
    assert 0.4 < ratio < 1.6, (ratio, summary["ratio"][:4])
    assert 1e-3 < summary["kappa_std"] < 1e-2, summary["kappa_std"]
