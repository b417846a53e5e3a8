"""Importing torchpm does not import torch._dynamo (about 2.5 s, more than ``import torch``):
the functions that talk to process groups get their ``torch.compiler.disable`` twins when
Dynamo is imported, before anything can trace them, however Dynamo comes to be imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from torchpm.distributed.groups import eager

REPORT = r"""
import importlib.machinery, importlib.util, json, sys
import torch
MODE = {mode!r}
if MODE == "dynamo first":
    import torch._dynamo
import torchpm
from torchpm.distributed import groups
report = {{"dynamo_after_torchpm": "torch._dynamo" in sys.modules, "waiting": len(groups._EAGER)}}
entries = list(groups._EAGER)

@groups.eager
def collective(x):
    return x + 1

if MODE == "find_spec first":  # a lookup that imports nothing
    report["spec"] = importlib.util.find_spec("torch._dynamo") is not None
if MODE == "finder in front":  # a finder put before torchpm's, which gives Dynamo's spec itself
    class Front:
        def find_spec(self, name, path, target=None):
            return importlib.machinery.PathFinder.find_spec(name, path) if name == "torch._dynamo" else None
    sys.meta_path.insert(0, Front())
if MODE == "config first":
    import torch._dynamo.config
if MODE == "compile first":  # torch.compile imports Dynamo itself
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
import torch._dynamo
report["loader"] = type(torch._dynamo.__loader__).__name__
report["spec_loader"] = type(torch._dynamo.__spec__.loader).__name__
report["path_loader"] = type(importlib.machinery.PathFinder.find_spec("torch._dynamo", torch.__path__).loader).__name__
report["finder_left"] = any(type(f).__name__ == "_AfterDynamo" for f in sys.meta_path)

def twins():
    return sum(bool(getattr(runs[0], "_torchdynamo_disable", False)) and runs[0] is not function
               for function, _, runs in entries)

report["twins_after_import"] = twins()
def loss(x):
    return collective(x * 2) * 3
try:
    torch.compile(loss, backend="eager", fullgraph=True)(torch.ones(2))
    report["fullgraph"] = "compiled through the collective"
except Exception as error:
    report["fullgraph"] = "refused" + (": process groups" if "process groups" in str(error) else "")
report["value"] = torch.compile(loss, backend="eager")(torch.ones(2)).tolist()
report["twins"] = twins()
print(json.dumps(report))
"""

MODES = ["plain", "dynamo first", "find_spec first", "finder in front", "config first", "compile first"]


def _report(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", REPORT.format(mode=mode)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", MODES)
def test_process_group_functions_get_their_twins_however_dynamo_is_imported(mode):
    report = _report(mode)
    if mode == "dynamo first":
        # The twins are made when the functions are wrapped: none waits.
        assert report["dynamo_after_torchpm"] and report["waiting"] == 0, report
    else:
        assert not report["dynamo_after_torchpm"], report
        # (the collectives of groups, the decomposition, the particles' migration, the simulation)
        assert report["waiting"] >= 20, report
        # Dynamo's import made every twin, except past a finder put before torchpm's: there
        # the first call of a wrapped function makes them (a trace of it too, which then
        # breaks its graph there; with fullgraph=True it is refused for that).
        assert report["twins_after_import"] == (0 if mode == "finder in front" else report["waiting"]), report
        assert report["twins"] == report["waiting"], report
    expected = "refused" if mode == "finder in front" else "refused: process groups"
    assert report["fullgraph"].startswith(expected), report
    assert report["value"] == [9.0, 9.0], report
    assert not report["finder_left"] or mode == "finder in front", report
    # Dynamo's module keeps the loader Python's own finders give it.
    assert report["loader"] == report["spec_loader"] == report["path_loader"], report


def test_a_compiled_call_breaks_its_graph_there_and_fullgraph_refuses_it():
    calls = []

    @eager
    def collective(x):
        calls.append(1)
        return x + 1

    def loss(x):
        return (collective(x * 2) * 3).sum()

    x = torch.arange(4.0)
    torch._dynamo.reset()
    assert torch.compile(loss, backend="eager")(x).item() == loss(x).item() == 3 * (2 * 6 + 4)
    assert len(calls) == 2
    explained = torch._dynamo.explain(loss)(x)
    assert explained.graph_break_count >= 1, explained
    with pytest.raises(Exception, match="process groups"):
        torch.compile(loss, backend="eager", fullgraph=True)(x)
    local = eager(lambda x: x + 1, local=lambda x: True)  # a 1 x 1 grid: traced like any code
    assert torch.compile(lambda x: local(x) * 2, backend="eager", fullgraph=True)(x).tolist() == [2, 4, 6, 8]
