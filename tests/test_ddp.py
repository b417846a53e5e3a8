"""Data-parallel training of a force correction with DistributedDataParallel.

Two gloo ranks each take one DDP step of the example's training loop on their own
seeds; the oracle is one single-process step (same initial weights, same optimiser)
on the union of the two ranks' batches, computed independently on every rank.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from _spawn import run_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

pytestmark = pytest.mark.distributed

CASES = ["ddp_step_equals_union_step"]


def make_context(world_size):
    return {"world_size": world_size}


def _model(training, config):
    torch.manual_seed(0)
    correction = training.make_correction(config)
    with torch.no_grad():  # off the identity, so every layer has a gradient
        for parameter in correction.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, dtype=parameter.dtype))
    model = training.HybridLoss(config, training.make_simulation(config, reference=False, correction=correction))
    return model, correction


def run_case(case_id, ctx):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import train_force_correction as training

    assert case_id == "ddp_step_equals_union_step"
    rank, world = dist.get_rank(), dist.get_world_size()
    config = training.SIZES["tiny"]
    seeds = {r: [2 * r, 2 * r + 1] for r in range(world)}

    # One DDP step on this rank's seeds.
    model, correction = _model(training, config)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(correction.parameters(), lr=0.5)
    training.train_step(ddp, optimizer, training.reference_data(config, seeds[rank]))

    # One single-process step on the union of every rank's seeds.
    reference, reference_correction = _model(training, config)
    union = training.reference_data(config, [s for r in range(world) for s in seeds[r]], batch=4)
    reference_optimizer = torch.optim.SGD(reference_correction.parameters(), lr=0.5)
    training.train_step(reference, reference_optimizer, union)

    moved = 0.0
    for (name, ours), (_, theirs), initial in zip(
        correction.named_parameters(), reference_correction.named_parameters(), _model(training, config)[1].parameters()
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13, msg=lambda m: f"{name}: {m}")
        moved = max(moved, float((theirs - initial).abs().max()))
        # identical weights on every rank
        gathered = [torch.empty_like(ours) for _ in range(world)]
        dist.all_gather(gathered, ours.detach().contiguous())
        for other in gathered:
            assert torch.equal(other, ours), name
    assert moved > 1e-6, "the step did not change the weights: the comparison would be empty"


def test_ddp_step_equals_single_process_step_on_the_union(tmp_path):
    outcome = run_world(2, "test_ddp", CASES, tmp_path, timeout_s=300)
    for case_id in CASES:
        errors = {rank: error for rank, error in outcome[case_id].items() if "#" not in str(rank) and error}
        assert not errors, f"{case_id}: " + "\n".join(f"rank {r}: {e}" for r, e in errors.items())
