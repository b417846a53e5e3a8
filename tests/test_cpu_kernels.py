"""The two builds of the CPU mass-assignment kernels (csrc/cpu/kernel_variant.h).

On x86-64 the kernels are compiled for the baseline instruction set and again
for AVX2, and the library registers the AVX2 build where the CPU has AVX2. The
AVX2 build must give the same bits: the oracle of each op is the baseline build,
run in another process (the build is chosen when the library loads, from
TORCHPM_CPU_KERNELS). Cases cover every order, 1 and 3 channels, the planar and
the interleaved force layout, float32 and float64, particles wrapped around
periodic axes, a non-periodic block with an offset, and more particles than the
serial paint takes, so the binned parallel paint runs too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torchpm

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


AVX2_CPU = {"avx2", "bmi1", "bmi2", "abm", "popcnt"} <= _cpu_flags()  # abm: LZCNT
needs_avx2 = pytest.mark.skipif(not AVX2_CPU, reason="the AVX2 kernels need a CPU with AVX2 (this one has none)")

# Runs every CPU mass-assignment op on fixed inputs and saves the results.
SCRIPT = r"""
import sys, torch, torchpm
torch.set_num_threads(2)
ops = torch.ops.torchpm
print(torchpm.cpu_kernels())
g = torch.Generator().manual_seed(11)
results = {}
shape = (24, 20, 28)
for dtype in (torch.float32, torch.float64):
    n = 40000
    x = torch.rand(1, n, 3, generator=g, dtype=dtype) * torch.tensor(shape, dtype=dtype) * 3 - torch.tensor(shape, dtype=dtype)
    w = torch.rand(1, n, generator=g, dtype=dtype)
    w3 = torch.rand(1, n, 3, generator=g, dtype=dtype)
    planar = torch.randn(1, 3, *shape, generator=g, dtype=dtype)
    interleaved = torch.randn(1, *shape, 3, generator=g, dtype=dtype).permute(0, 4, 1, 2, 3)
    # a block of a larger mesh: non-periodic in x and z, offset, particles inside it
    block = (12, 20, 14)
    offset = [5, -3, 7]
    xb = torch.rand(1, n, 3, generator=g, dtype=dtype) * torch.tensor([b - 4 for b in block], dtype=dtype) \
        + torch.tensor([o + 1.5 for o in offset], dtype=dtype)
    fb = torch.randn(1, 3, *block, generator=g, dtype=dtype)
    for order in (1, 2, 3, 4):
        key = f"{dtype}-{order}"
        periodic = [True, True, True]
        results[f"paint {key}"] = ops.paint(x, w, list(shape), [0, 0, 0], periodic, order, True)
        results[f"paint unit {key}"] = ops.paint(x, None, list(shape), [0, 0, 0], periodic, order, True)
        results[f"paint 3 {key}"] = ops.paint(x, w3, list(shape), [0, 0, 0], periodic, order, True)
        results[f"paint node {key}"] = ops._paint_deterministic(x, w, list(shape), [0, 0, 0], periodic, order, True)
        results[f"paint tiled {key}"] = ops._paint_tiled(x, w, list(shape), [0, 0, 0], periodic, order, True)
        results[f"paint block {key}"] = ops.paint(xb, w, list(block), offset, [False, True, False], order, True)
        results[f"readout {key}"] = ops.readout(planar[:, 0], x, [0, 0, 0], periodic, order, True)
        results[f"readout 3 {key}"] = ops.readout(planar, x, [0, 0, 0], periodic, order, True)
        results[f"readout interleaved {key}"] = ops.readout(interleaved, x, [0, 0, 0], periodic, order, True)
        results[f"readout block {key}"] = ops.readout(fb, xb, offset, [False, True, False], order, True)
        results[f"gradient {key}"] = ops._position_gradient(planar, x, w3, [0, 0, 0], periodic, order)
        values, gradient = ops._readout_and_position_gradient(planar, x, w3, 2, [0, 0, 0], periodic, order)
        results[f"readout and gradient {key}"] = torch.cat([values.flatten(), gradient.flatten()])
        for name, field in (("planar", planar), ("interleaved", interleaved)):
            positions, momenta = x.clone(), w3.clone()
            ops._readout_kick_drift_(field, positions, momenta, [0, 0, 0], periodic, order, [0.3, 0.7], 0.9, True)
            results[f"kick drift {name} {key}"] = torch.cat([positions.flatten(), momenta.flatten()])
torch.save(results, sys.argv[1])
"""


def _run(kernels: str, path) -> str:
    env = dict(os.environ, TORCHPM_CPU_KERNELS=kernels)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(HERE))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@needs_avx2
def test_avx2_kernels_give_the_baseline_bits(tmp_path):
    assert _run("baseline", tmp_path / "baseline.pt") == "baseline"
    assert _run("avx2", tmp_path / "avx2.pt") == "avx2"
    baseline = torch.load(tmp_path / "baseline.pt")
    avx2 = torch.load(tmp_path / "avx2.pt")
    assert baseline.keys() == avx2.keys() and len(baseline) == 2 * 4 * 14
    for key, expected in baseline.items():
        assert torch.isfinite(expected).all(), key
        assert torch.equal(avx2[key], expected), f"{key}: largest difference {(avx2[key] - expected).abs().max()}"
    # the comparison can fail: the cases differ from each other
    assert not torch.equal(baseline["paint torch.float32-2"], baseline["paint torch.float32-3"])


def test_this_process_runs_the_kernels_its_cpu_supports():
    if os.environ.get("TORCHPM_CPU_KERNELS", "auto") in ("", "auto"):
        assert torchpm.cpu_kernels() == ("avx2" if AVX2_CPU else "baseline")
    else:
        assert torchpm.cpu_kernels() == os.environ["TORCHPM_CPU_KERNELS"]


def test_a_bad_choice_fails_the_import_naming_the_variable():
    code = "import torchpm"
    env = dict(os.environ, TORCHPM_CPU_KERNELS="fastest")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(HERE))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError") and "TORCHPM_CPU_KERNELS must be" in last and '"fastest"' in last, last
