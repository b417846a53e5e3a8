"""Paint a random particle set onto a mesh, read it back, and report mass
conservation, the adjoint identity and timings.

    python examples/paint_readout.py [--particles 128] [--mesh 128] [--device cpu]
"""

import argparse
import time

import torch

import torchpm


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--particles", type=int, default=128, help="particles per side (n^3 in all)")
    parser.add_argument("--mesh", type=int, default=128, help="mesh cells per side")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() and torchpm.has_cuda_kernels() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    n, m = args.particles, args.mesh
    generator = torch.Generator().manual_seed(args.seed)

    positions = (torch.rand(1, n**3, 3, generator=generator) * m).to(device)
    masses = (0.5 + torch.rand(1, n**3, generator=generator)).to(device)
    torchpm.cic_paint(positions, masses, (m, m, m))  # warm-up

    density, t_paint = timed(lambda: torchpm.cic_paint(positions, masses, (m, m, m)), device)
    force = torch.randn(1, 3, m, m, m, generator=generator).to(device)
    values, t_read = timed(lambda: torchpm.cic_readout(force, positions), device)

    painted = density.double().sum().item()
    expected = masses.double().sum().item()
    # <paint(x, w), f> = <w, readout(f, x)> on the first force component
    lhs = (density.double() * force[:, 0].double()).sum().item()
    rhs = (masses.double() * values[..., 0].double()).sum().item()

    print(f"torchpm {torchpm.__version__} on {device} (CUDA kernels built: {torchpm.has_cuda_kernels()})")
    print(f"particles {n}^3 = {n**3:,}, mesh {m}^3, float32")
    print(f"mass painted {painted:.6e}, particles' mass {expected:.6e}, relative difference {abs(painted - expected) / expected:.2e}")
    print(f"adjoint identity <paint(x,w), f> vs <w, readout(f,x)>: relative difference {abs(lhs - rhs) / abs(lhs):.2e}")
    print(f"paint:            {t_paint * 1e3:8.1f} ms  ({n**3 / t_paint / 1e6:.1f} M particles/s)")
    print(f"readout 3 chans:  {t_read * 1e3:8.1f} ms  ({n**3 / t_read / 1e6:.1f} M particles/s)")


if __name__ == "__main__":
    main()
