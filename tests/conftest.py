"""Shared fixtures: every test runs on `cpu` and `cuda` (cuda skipped without a GPU)."""

import pytest
import torch

import torchpm

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not (torch.cuda.is_available() and torchpm.has_cuda_kernels()),
                reason="needs a CUDA device and a torchpm build with CUDA kernels",
            ),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def reproducible(device):
    """For tests that compare two runs bit for bit: on CUDA the paint's atomic adds sum
    in a varying order, so there the test runs under
    ``torch.use_deterministic_algorithms(True)`` (node-by-node paint, no atomics). The
    CPU kernels are deterministic as they are. ``warn_only``: a torch op without a
    deterministic CUDA kernel warns instead of raising (torchpm's paint is routed)."""
    if device.type != "cuda":
        yield
        return
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# ---------------------------------------------------------------------------------
# The independent oracles (scipy, astropy, colossus, pynbody, JaxPM) turn their tests
# into skips where they are missing. `make test` installs them and sets
# TORCHPM_REQUIRE_ORACLES=1: there such a skip fails the run instead of passing quietly.

_ORACLE_SKIPS = ("could not import", "JaxPM reference unavailable", "the adapter is written for")
_oracle_skips: list = []


def _note_oracle_skip(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if any(marker in reason for marker in _ORACLE_SKIPS):
            _oracle_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _note_oracle_skip(report)


def pytest_collectreport(report):
    _note_oracle_skip(report)


def pytest_sessionfinish(session, exitstatus):
    import os

    if os.environ.get("TORCHPM_REQUIRE_ORACLES") == "1" and _oracle_skips:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"TORCHPM_REQUIRE_ORACLES=1: {len(_oracle_skips)} test(s) skipped for a missing "
                                "oracle (make test-deps installs them):", red=True)
            for line in _oracle_skips[:20]:
                reporter.write_line(f"  {line}")
        if exitstatus == pytest.ExitCode.OK:  # (an interrupted or failed run keeps its own status)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
