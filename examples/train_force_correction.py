"""Train a learned force correction end to end through the simulation (hybrid PM).

A :class:`torchpm.nn.NeuralSplineCorrection` (an MLP of the scale factor giving a
spline filter over k that multiplies the PM potential) is trained so that cheap runs
(force mesh B = 1, few steps) match expensive reference runs of the same white noise.

Reference runs: the same particles and white noise with a force mesh B = 4 and four
times as many steps. Keeping the particle grid (rather than refining it) keeps every
particle's Lagrangian label, so positions can be compared particle by particle, and
keeps the same initial modes and shot noise; what the cheap run misses is then only
force resolution (B = 1 smooths forces below ~2 cells) and time resolution, which is
what a force correction can learn.

The loss on a batch is ``mean_k (P / P_ref - 1)^2`` over the bins up to the particle
Nyquist frequency ``k_N = pi n / L`` plus ``position_weight * <|x - x_ref|^2> / cell^2``
(periodic differences), averaged over ``--snapshots`` scale factors (default 1: a = 1
alone; with more, evenly spaced step ends of the cheap run, the last a = 1, taken from
one run of each simulation by ``Simulation.trajectory``, as Lanzieri et al. 2023 train on
every snapshot). Evaluation on seeds never used in training reports the mean
``|P / P_ref - 1|`` up to ``k_N / 2`` before and after training, and r(k).

    python examples/train_force_correction.py                 # a few CPU minutes
    python examples/train_force_correction.py --size large    # 64^3, for a GPU
    torchrun --nproc-per-node=2 examples/train_force_correction.py   # DDP, seeds split over ranks

Writes ``out/train_force_correction/``: ``loss.json`` (curve and metrics), ``loss.png``,
``power.png`` (P_corr/P_ref, P_uncorr/P_ref and r(k)) and ``correction.safetensors``
(``correction.pt`` when safetensors is missing; read it with ``torchpm.nn.load_weights``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

import torchpm
from torchpm.analysis import correlation_coefficient
from torchpm.nn import CICPaint, NeuralSplineCorrection, PowerSpectrum, save_weights


@dataclass
class Config:
    particles: int = 24  # per side
    box_size: float = 96.0  # Mpc/h
    steps: int = 10  # cheap runs, linear in a from a_start to 1
    mesh_factor: int = 1  # cheap runs
    reference_steps: int = 40
    reference_mesh_factor: int = 4
    a_start: float = 0.1
    train_seeds: int = 4  # per process
    test_seeds: int = 2
    batch: int = 2
    iterations: int = 100
    learning_rate: float = 1e-2
    position_weight: float = 0.1
    knots: int = 12
    hidden: tuple = (32, 32)
    dtype: str = "float32"
    adjoint: bool = False
    snapshots: int = 1  # scale factors the loss is averaged over (the last a = 1)


SIZES = {
    "small": Config(),
    "large": Config(particles=64, box_size=256.0, train_seeds=8, test_seeds=4, batch=4, iterations=300),
    "medium": Config(particles=32, box_size=128.0, iterations=150),
    "tiny": Config(particles=8, box_size=64.0, steps=4, reference_steps=8, reference_mesh_factor=2,
                   train_seeds=2, test_seeds=1, batch=2, iterations=4, knots=6, hidden=(8,), dtype="float64"),
}


def k_nyquist(config: Config) -> float:
    """Nyquist frequency of the particle grid (and of the B = 1 force mesh), h/Mpc."""
    return math.pi * config.particles / config.box_size


def snapshot_times(config: Config) -> list[float]:
    """The scale factors of the loss: ``config.snapshots`` step ends of the cheap run,
    evenly spaced, the last ``a = 1`` (step ends of the reference run too: its steps
    split the cheap run's)."""
    if not 1 <= config.snapshots <= config.steps:
        raise ValueError(f"snapshots must be in [1, steps = {config.steps}], got {config.snapshots}")
    if config.reference_steps % config.steps:
        raise ValueError("reference_steps must be a multiple of steps (the snapshots are step ends of both runs)")
    ends = [config.a_start + (1.0 - config.a_start) * i / config.steps for i in range(config.steps + 1)]
    return [ends[round(config.steps * (j + 1) / config.snapshots)] for j in range(config.snapshots)]


def make_correction(config: Config, device=None) -> NeuralSplineCorrection:
    dtype = getattr(torch, config.dtype)
    # The spline must cover every |k| of the cheap run's force mesh: sqrt(3) k_N B.
    k_max = math.sqrt(3) * k_nyquist(config) * config.mesh_factor
    return NeuralSplineCorrection(k_max, knots=config.knots, hidden=config.hidden, dtype=dtype, device=device)


def make_simulation(config: Config, reference: bool, correction=None, device=None) -> torchpm.Simulation:
    return torchpm.Simulation(
        config.particles,
        config.box_size,
        mesh_factor=config.reference_mesh_factor if reference else config.mesh_factor,
        a_start=config.a_start,
        steps=config.reference_steps if reference else config.steps,
        dtype=getattr(torch, config.dtype),
        force_correction=correction,
        adjoint=config.adjoint and not reference,
    ).to(device)


class HybridLoss(nn.Module):
    """The cheap simulation (holding the trainable correction) scored against references.

    ``forward(noise, target_positions, target_power)``: white noise ``(B, n, n, n)``,
    reference positions ``(B, S, n^3, 3)`` in Mpc/h and reference spectra ``(B, S, bins)``
    at the ``S`` scale factors of :func:`snapshot_times`; returns the scalar loss (mean
    over the batch and the snapshots). One ``forward`` per iteration, so the module can
    be wrapped in ``DistributedDataParallel`` as it is.
    """

    def __init__(self, config: Config, simulation: torchpm.Simulation):
        super().__init__()
        self.config = config
        self.simulation = simulation
        dtype = getattr(torch, config.dtype)
        # P(k) on a mesh of 2n cells: the particle Nyquist frequency is well inside it.
        self.mesh_cells = 2 * config.particles
        self.paint = CICPaint(self.mesh_cells)
        self.power = PowerSpectrum(self.mesh_cells, config.box_size, dtype=dtype)
        self.register_buffer("fit_bins", self.power.k <= k_nyquist(config), persistent=False)
        self.times = snapshot_times(config)

    def spectrum(self, positions: torch.Tensor) -> torch.Tensor:
        """P(k) ``(B, bins)`` of the CIC density of positions ``(B, N, 3)`` in Mpc/h."""
        cell = self.config.box_size / self.mesh_cells
        density = self.paint(positions / cell) * (self.mesh_cells**3 / positions.shape[1])
        return self.power(density - 1)

    def forward(self, noise, target_positions, target_power):
        # one run; each snapshot's loss is taken as the run passes it (no state kept)
        snapshots = iter(range(len(self.times)))

        def observe(state):
            index = next(snapshots)
            return self.score(state.positions, target_positions[:, index], target_power[:, index])

        losses = self.simulation.trajectory(noise, at=self.times, observe=observe)
        return sum(losses) / len(losses)

    def score(self, positions, target_positions, target_power):
        """The loss of positions ``(B, N, 3)`` against one snapshot's references."""
        power = self.spectrum(positions)
        power_loss = ((power[:, self.fit_bins] / target_power[:, self.fit_bins] - 1) ** 2).mean()
        box = self.config.box_size
        difference = positions - target_positions
        difference = difference - box * torch.round(difference / box)
        cell = box / self.config.particles
        position_loss = (difference**2).sum(-1).mean() / cell**2
        return power_loss + self.config.position_weight * position_loss


def reference_data(config: Config, seeds, device=None, batch: int = 2):
    """White noise ``(S, n, n, n)``, positions ``(S, snapshots, N, 3)`` (Mpc/h) and P(k)
    ``(S, snapshots, bins)`` of the reference runs of ``seeds`` at :func:`snapshot_times`."""
    reference = make_simulation(config, reference=True, device=device)
    scorer = HybridLoss(config, reference).to(device)
    noises, positions, powers = [], [], []
    with torch.no_grad():
        for start in range(0, len(seeds), batch):
            chunk = seeds[start : start + batch]
            noise = torch.cat([reference.white_noise(seed=s) for s in chunk])
            states = reference.trajectory(noise, at=scorer.times)
            noises.append(noise)
            positions.append(torch.stack([state.positions for state in states], dim=1))
            powers.append(torch.stack([scorer.spectrum(state.positions) for state in states], dim=1))
    return torch.cat(noises), torch.cat(positions), torch.cat(powers)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> float:
    """One optimiser step on ``batch = (noise, target_positions, target_power)``; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def power_error(config: Config, power: torch.Tensor, reference: torch.Tensor, k: torch.Tensor) -> float:
    """Mean ``|P / P_ref - 1|`` over the bins with ``k <= k_N / 2`` and over the batch."""
    keep = k <= 0.5 * k_nyquist(config)
    return float((power[:, keep] / reference[:, keep] - 1).abs().mean())


def evaluate(config: Config, model: HybridLoss, data):
    """Errors and spectra of the cheap runs with and without the correction on held-out data."""
    noise, target_positions, target_power = data
    target_positions, target_power = target_positions[:, -1], target_power[:, -1]  # a = 1
    simulation = model.simulation
    correction = simulation.force_correction
    results = {}
    with torch.no_grad():
        for name, hook in (("corrected", correction), ("uncorrected", None)):
            simulation.force_correction = hook
            try:
                positions = simulation(noise).positions
            finally:
                simulation.force_correction = correction
            power = model.spectrum(positions)
            cell = config.box_size / model.mesh_cells
            painted = model.paint(positions / cell)
            reference = model.paint(target_positions / cell)
            r = correlation_coefficient(painted, reference, config.box_size)
            results[name] = dict(
                error=power_error(config, power, target_power, model.power.k),
                ratio=(power / target_power).mean(0),
                r=r.power.mean(0),
                r_k=r.k,
            )
    return results


def plot(results, k, losses, directory, config):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.5))
    axis.semilogy(losses)
    axis.set(xlabel="iteration", ylabel="training loss", title="force-correction training")
    figure.tight_layout()
    figure.savefig(os.path.join(directory, "loss.png"), dpi=120)
    plt.close(figure)

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    k = k.cpu()
    for name, style in (("uncorrected", "C1--"), ("corrected", "C0-")):
        label = {"uncorrected": "P_uncorr / P_ref", "corrected": "P_corr / P_ref"}[name]
        top.semilogx(k, results[name]["ratio"].cpu(), style, label=label)
        bottom.semilogx(results[name]["r_k"].cpu(), results[name]["r"].cpu(), style, label=name)
    for axis in (top, bottom):
        axis.axvline(0.5 * k_nyquist(config), color="grey", lw=0.8, ls=":")
        axis.axvline(k_nyquist(config), color="grey", lw=0.8)
        axis.legend()
    top.axhline(1.0, color="k", lw=0.5)
    top.set(ylabel="P / P_ref", title=f"held-out seeds, {config.particles}^3 particles, B={config.mesh_factor}")
    bottom.set(xlabel="k [h/Mpc]", ylabel="r(k) with the reference")
    figure.tight_layout()
    figure.savefig(os.path.join(directory, "power.png"), dpi=120)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="problem size (small: CPU minutes)")
    parser.add_argument("--iterations", type=int, help="override the number of training iterations")
    parser.add_argument("--adjoint", action="store_true", help="gradients by the adjoint method")
    parser.add_argument("--snapshots", type=int, default=1,
                        help="scale factors the loss is averaged over, evenly spaced step ends ending at a = 1")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() and torchpm.has_cuda_kernels() else "cpu")
    parser.add_argument("--out", default="out/train_force_correction")
    parser.add_argument("--seed", type=int, default=0, help="seed of the network initialisation")
    args = parser.parse_args()
    config = SIZES[args.size]
    if args.iterations is not None:
        config.iterations = args.iterations
    config.adjoint = args.adjoint
    config.snapshots = args.snapshots
    snapshot_times(config)  # (a clear error for a bad --snapshots before any run)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    device = torch.device(args.device)
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank = dist.get_rank()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    say = print if rank == 0 else (lambda *a, **k: None)

    start = time.perf_counter()
    # Different training seeds on every rank; held-out seeds are never trained on.
    train_seeds = [rank * config.train_seeds + i for i in range(config.train_seeds)]
    test_seeds = [10_000 + i for i in range(config.test_seeds)]
    train = reference_data(config, train_seeds, device, config.batch)
    test = reference_data(config, test_seeds, device, config.batch) if rank == 0 else None
    say(f"references: {len(train_seeds)} training seeds per rank x {world} ranks, {len(test_seeds)} held out, "
        f"B={config.reference_mesh_factor}, {config.reference_steps} steps ({time.perf_counter() - start:.1f} s)")

    torch.manual_seed(args.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    correction = make_correction(config, device)
    model = HybridLoss(config, make_simulation(config, reference=False, correction=correction, device=device)).to(device)
    trainer = model
    if world > 1:
        trainer = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(correction.parameters(), lr=config.learning_rate)

    losses = []
    generator = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for iteration in range(config.iterations):
        pick = torch.randperm(len(train_seeds), generator=generator)[: config.batch].to(train[0].device)
        loss = train_step(trainer, optimizer, tuple(t[pick] for t in train))
        losses.append(loss)
        if iteration % max(1, config.iterations // 10) == 0 or iteration == config.iterations - 1:
            say(f"iteration {iteration:4d}  loss {loss:.5f}  ({time.perf_counter() - start:.1f} s)")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        results = evaluate(config, model, test)
        before, after = results["uncorrected"]["error"], results["corrected"]["error"]
        say(f"held-out mean |P/P_ref - 1| for k <= k_N/2 = {0.5 * k_nyquist(config):.3f} h/Mpc: "
            f"uncorrected {before:.4f}, corrected {after:.4f} ({before / after:.1f}x smaller)")
        try:
            import safetensors  # noqa: F401

            weights = os.path.join(args.out, "correction.safetensors")
        except ImportError:
            weights = os.path.join(args.out, "correction.pt")
        save_weights(correction, weights)
        summary = dict(
            config={k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
            world_size=world, device=str(device), losses=losses,
            error_uncorrected=before, error_corrected=after, improvement=before / after,
            k=model.power.k.tolist(),
            **{f"{name}_{key}": results[name][key].tolist() for name in results for key in ("ratio", "r")},
            r_k=results["corrected"]["r_k"].tolist(),
            train_seconds=time.perf_counter() - start,
        )
        with open(os.path.join(args.out, "loss.json"), "w") as f:
            json.dump(summary, f, indent=1)
        plot(results, model.power.k, losses, args.out, config)
        say(f"wrote {args.out}/loss.json, loss.png, power.png and {os.path.basename(weights)}")
    if world > 1:
        # Free the DDP wrapper first: its reducer holds the process group, and a gloo group
        # whose last holder is the reducer is destroyed with Python's lock held while
        # gloo's worker threads may still need that lock to free their last work (a
        # deadlock inside torch, seen at exit in 1 run of 2 on 2 CPU ranks).
        del trainer
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
