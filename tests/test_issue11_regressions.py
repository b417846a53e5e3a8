"""Regressions of issue 11's defect list that no other test file covered (see the audit in
the branch's report); the rest live next to the code they test (test_config.py,
test_cli.py, test_mass_assignment.py, test_precision.py, test_distributed_agreement.py,
test_fuzz_ops.py)."""

from __future__ import annotations

import os

import pytest
import torch

import torchpm
from torchpm.__main__ import main

SMALL = 'n_particles = 4\nbox_size = 40.0\nsteps = 2\n'


def unwritable_folder(tmp_path):
    """An existing folder this process cannot write into: /proc/self on Linux (even for
    root), else a folder without write permission."""
    if os.path.isdir("/proc/self"):
        return "/proc/self"
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    return str(folder)


def test_unwritable_output_folder_is_refused_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(SMALL)
    assert main(["run", str(config), "--output", unwritable_folder(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "not writable" in error and len(error.strip().splitlines()) == 1, error


@pytest.mark.parametrize("value", ["256", b"256", ["2", 5, 6]])
def test_string_box_sizes_and_shapes_are_not_read_digit_by_digit(value):
    """`box_size="256"` once meant (2, 5, 6) in the analysis functions and `LocalMesh("444")`
    a 4x4x4 mesh: strings are iterable."""
    from torchpm.analysis import power_spectrum
    from torchpm.mesh import LocalMesh

    with pytest.raises(ValueError, match="`box_size`"):
        power_spectrum(torch.rand(4, 4, 4), value)
    with pytest.raises(ValueError, match="`shape`"):
        LocalMesh(value if not isinstance(value, list) else ["4", 4, 4])


@pytest.mark.parametrize("options,match", [
    (dict(shot_noise="abc"), "`shot_noise`"), (dict(shot_noise=float("nan")), "`shot_noise`"),
    (dict(n_particles=1.5), "`n_particles`"), (dict(n_particles="5"), "`n_particles`"),
    (dict(n_particles=True), "`n_particles`"), (dict(bins=[0.1, float("nan")]), "`bins`"),
    (dict(bins="abc"), "`bins`"), (dict(bins=2.5), "`bins`"),
])
def test_spectrum_options_are_checked_not_truncated(options, match):
    from torchpm.analysis import power_spectrum

    with pytest.raises(ValueError, match=match):
        power_spectrum(torch.rand(4, 4, 4), 100.0, **options)


def test_missing_power_table_names_the_argument():
    with pytest.raises(ValueError, match=r"`power_spectrum`: power table: file 'no_such_table.txt' not found"):
        torchpm.Simulation(n_particles=4, steps=1, power_spectrum="no_such_table.txt")
