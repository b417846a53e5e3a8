"""Run test cases inside a pool of gloo processes spawned once per world size.

``run_world(world_size, module, case_ids, tmp_path)`` starts ``world_size``
processes, joins them into one gloo process group (a FileStore under
``tmp_path``), imports ``module`` in each and runs ``module.run_case(case_id, ctx)``
for every id in order, recording on each rank either ``None`` or the error's
traceback. Returns ``{case_id: {rank: error or None}}``; a rank that never
reported (it hung or died) reports an error saying so.

The grid test modules share the helpers below that run inside the processes:
``grid_context`` (the groups of each process grid), ``run_grid_case`` (case ids
``kind-P0xP1`` to ``case_kind((P0, P1), ctx)``) and ``expect_error_everywhere``.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import time
import traceback

import pytest
import torch.multiprocessing as mp

# Bound on every collective of the pool's main group: a case that breaks the
# lock-step of the ranks fails after this long instead of hanging the suite.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def _worker(rank, world_size, module_name, case_ids, store_path, result_dir):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = {}
    result_path = os.path.join(result_dir, f"rank{rank}.json")

    def flush():
        with open(result_path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(result_path + ".tmp", result_path)

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        module = importlib.import_module(module_name)
        ctx = module.make_context(world_size)
        for case_id in case_ids:
            start = time.perf_counter()
            try:
                module.run_case(case_id, ctx)
                results[case_id] = None
            except BaseException:  # noqa: BLE001 - reported to the parent
                results[case_id] = traceback.format_exc()
            results[case_id + "#seconds"] = time.perf_counter() - start
            flush()
    finally:
        flush()
    # Some cases leave broken groups behind (the fail-fast case), so skip the
    # collective teardown and let process exit close the sockets.
    os._exit(0)


def run_world(world_size, module_name, case_ids, tmp_path, timeout_s=600):
    store_path = os.path.join(str(tmp_path), f"store_{world_size}")
    result_dir = os.path.join(str(tmp_path), f"results_{world_size}")
    os.makedirs(result_dir, exist_ok=True)
    context = mp.start_processes(
        _worker,
        args=(world_size, module_name, list(case_ids), store_path, result_dir),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                break
    except mp.ProcessRaisedException:
        pass
    except mp.ProcessExitedException:
        pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    outcome = {case_id: {} for case_id in case_ids}
    for rank in range(world_size):
        path = os.path.join(result_dir, f"rank{rank}.json")
        reported = {}
        if os.path.exists(path):
            with open(path) as f:
                reported = json.load(f)
        for case_id in case_ids:
            outcome[case_id][rank] = reported.get(
                case_id, f"rank {rank} never reported this case (it hung, died or an earlier case broke the pool)"
            )
            if case_id + "#seconds" in reported:
                outcome[case_id][f"{rank}#seconds"] = reported[case_id + "#seconds"]
    return outcome


def grid_context(world_size, grids) -> dict:
    """Inside a pool's process: ``{"rank", "world", "groups"}``, ``groups`` the two
    process groups of each ``(P0, P1)`` of ``grids[world_size]`` (a collective: every
    rank builds the same grids in the same order)."""
    import torch.distributed as dist

    from torchpm.distributed import process_grid_groups

    return {"rank": dist.get_rank(), "world": world_size,
            "groups": {grid: process_grid_groups(grid) for grid in grids[world_size]}}


def run_grid_case(cases, case_id, ctx) -> None:
    """Run the case ``kind-P0xP1`` as ``cases["case_kind"]((P0, P1), ctx)`` (``cases``: the
    test module's ``globals()``)."""
    kind, grid_text = case_id.rsplit("-", 1)
    cases[f"case_{kind}"](tuple(int(p) for p in grid_text.split("x")), ctx)


def expect_error_everywhere(function, *fragments, exception=ValueError):
    """``function()`` must raise ``exception`` on this rank, its message holding every
    fragment (each rank of a grid calls this: the error must reach every rank)."""
    try:
        function()
    except exception as error:
        text = str(error)
        assert all(fragment in text for fragment in fragments), text
        return
    raise AssertionError(f"no {exception.__name__}; expected one with {fragments}")


def rank_errors(outcome) -> str:
    """The errors of one case's ``{rank: error or None}`` (timing entries left out), one
    block per failing rank; empty when every rank passed."""
    errors = {rank: error for rank, error in outcome.items() if not str(rank).endswith("#seconds") and error}
    return "\n".join(f"--- rank {rank} ---\n{error}" for rank, error in sorted(errors.items()))


def world_results_fixture(module_name, case_ids, prefix, timeout_s=600):
    """A module-scoped pytest fixture ``world_results``: ``world_results(world_size)``
    runs every case of ``case_ids(world_size)`` in one pool the first time and returns
    the :func:`run_world` outcome (cached for the module)."""
    results = {}

    @pytest.fixture(scope="module")
    def world_results(tmp_path_factory):
        def get(world_size):
            if world_size not in results:
                tmp = tmp_path_factory.mktemp(f"{prefix}{world_size}")
                results[world_size] = run_world(world_size, module_name, case_ids(world_size), tmp, timeout_s=timeout_s)
            return results[world_size]

        return get

    return world_results
