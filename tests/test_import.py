"""Importing torchpm does not import torch._dynamo (about 2.5 s, twice ``import torch``):
the functions that talk to process groups get their ``torch.compiler.disable`` twins when
Dynamo is imported, before anything can trace them, whichever of the two comes first."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from torchpm.distributed.groups import eager

REPORT = r"""
import json, sys
{first}
import torchpm
from torchpm.distributed import groups
report = {{"dynamo_after_torchpm": "torch._dynamo" in sys.modules}}
import torch._dynamo
report["wrapped"] = len(groups._EAGER)
report["twins"] = sum(getattr(runs[0], "_torchdynamo_disable", False) and runs[0] is not function
                      for function, _, runs in groups._EAGER)
report["finder_left"] = any(type(f).__name__ == "_AfterDynamo" for f in sys.meta_path)
report["loader"] = type(torch._dynamo.__loader__).__name__
report["spec_loader"] = type(torch._dynamo.__spec__.loader).__name__
print(json.dumps(report))
"""


def _report(first: str) -> dict:
    done = subprocess.run([sys.executable, "-c", REPORT.format(first=first)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first", ["import torch", "import torch._dynamo"])
def test_process_group_functions_get_their_twins_when_dynamo_is_imported(first):
    report = _report(first)
    assert report["dynamo_after_torchpm"] == (first == "import torch._dynamo"), report
    assert report["wrapped"] >= 20, report  # the collectives of groups, decomposition, particles, simulation
    assert report["twins"] == report["wrapped"], report
    assert not report["finder_left"], report
    # Dynamo's module keeps the loader Python chose for it.
    assert report["loader"] == report["spec_loader"] == "SourceFileLoader", report


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
