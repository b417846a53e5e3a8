"""The process groups of a grid (torchpm.distributed.groups.process_grid_groups), on 2
gloo processes: they bound their collectives by the world's timeout (not torch's
30-minute default of ``new_group``), and they are made once per world, so building a
``Simulation`` per sample does not open new connections each time."""

from __future__ import annotations

import datetime
import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed

WORLD_TIMEOUT = datetime.timedelta(seconds=3)
STALL_SECONDS = 12.0


def _worker(rank, tmp):
    import torch
    import torch.distributed as dist

    import torchpm
    from torchpm.distributed.groups import process_grid_groups

    torch.set_num_threads(1)
    report = {}
    report_groups = None
    try:
        for world in range(2):  # a second world after destroy_process_group makes new groups
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store{world}", rank=rank, world_size=2,
                                    timeout=WORLD_TIMEOUT if world else datetime.timedelta(seconds=60))
            groups = process_grid_groups((2, 1))
            sims = [torchpm.Simulation(n_particles=4, box_size=8.0, steps=1, grid=(2, 1)) for _ in range(3)]
            report[f"same{world}"] = all(
                process_grid_groups((2, 1))[0] is groups[0] and sim.force_mesh.grid.axes[0].group is groups[0]
                for sim in sims)
            report[f"new_after_destroy{world}"] = world == 0 or groups[0] is not report_groups[0]
            report_groups = groups
            if world:
                break
            dist.destroy_process_group()
        # World 1 has a 3 s timeout: rank 0 waits for a rank 1 that stalls 12 s.
        if rank == 1:
            time.sleep(STALL_SECONDS)
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=groups[0])
            report["raised"] = None
        except RuntimeError as error:  # gloo: "Timed out waiting 3000ms for recv"
            report["raised"] = str(error)
        report["seconds"] = time.monotonic() - start
    finally:
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        os._exit(0)  # the timed-out group is broken: no collective teardown


def test_grid_groups_take_the_world_timeout_and_are_made_once(tmp_path):
    context = mp.start_processes(_worker, args=(str(tmp_path),), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not context.join(timeout=1.0) and time.monotonic() < deadline:
        pass
    reports = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            reports.append(json.load(f))
    for report in reports:
        assert report["same0"] and report["same1"], reports
        assert report["new_after_destroy1"], reports
    # Rank 0 fails after about the world's 3 s, not after rank 1's 12 s stall.
    assert "timed out" in (reports[0]["raised"] or "").lower(), reports
    assert reports[0]["seconds"] < STALL_SECONDS - 4, reports


class _FakeGroup:
    def __init__(self, *types):
        self._device_types = [torch.device(kind) for kind in types]


def test_control_tensors_go_where_the_groups_can_reduce_them():
    """The grid's own small reductions (agreement descriptors, counts) use the CPU when
    every group has a CPU backend (gloo, "cpu:gloo,cuda:nccl") and the groups' device when
    one has none (NCCL alone cannot reduce a CPU tensor): checked here on stand-in groups,
    a device type without a current-device notion standing in for CUDA."""
    from torchpm.distributed.groups import _control_device, _to_control

    assert _control_device([]) == torch.device("cpu")
    assert _control_device([_FakeGroup("cuda", "cpu"), _FakeGroup("cpu")]) == torch.device("cpu")
    assert _control_device([_FakeGroup("cpu"), _FakeGroup("meta")]) == torch.device("meta")
    moved = _to_control(torch.arange(3), [_FakeGroup("meta")])
    assert moved.device.type == "meta" and moved.shape == (3,)
    kept = torch.arange(3)
    assert _to_control(kept, [_FakeGroup("cuda", "cpu")]) is kept


def _nccl_worker(rank, store):
    import torch.distributed as dist

    from torchpm.distributed.groups import GridGroups

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        grid = GridGroups((dist.new_group([0]), None))
        grid.agree("an operation", [("a value", 3), ("a name", "x")])
        counts = grid.all_gather_counts([5, 7])
        assert counts.device.type == "cuda" and counts.tolist() == [[5, 7]]
        grid.raise_together(None)
        for op in ("sum", "max"):
            reduced = grid.all_reduce(torch.tensor([2.0, -1.0]), op)
            assert reduced.device.type == "cpu" and reduced.tolist() == [2.0, -1.0]
        try:
            grid.raise_together("this rank's error")
        except ValueError as error:
            assert "this rank's error" in str(error)
        else:
            raise AssertionError("raise_together did not raise")
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
                    reason="needs a CUDA device and NCCL")
def test_grid_reductions_of_cpu_values_on_an_nccl_group(tmp_path):
    """On a real NCCL group (one rank: the one GPU there is), the grid's own reductions of
    CPU values (agreement, counts, error flags, max and sum) run on the GPU and come back."""
    mp.start_processes(_nccl_worker, args=(str(tmp_path / "store"),), nprocs=1, join=True, start_method="spawn")
