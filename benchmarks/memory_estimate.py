"""Peak host memory of a run without gradients against ``Simulation.memory_estimate``.

Each case runs in a fresh process: the peak resident set (VmHWM, reset through
/proc/self/clear_refs after a warm-up run) minus the resident set before the run.
Linux only. ``python benchmarks/memory_estimate.py``.
"""

import subprocess
import sys

CASES = [(64, 2, "float32"), (96, 1, "float32"), (64, 2, "float64"), (32, 4, "float32"), (96, 1, "float64"),
         (128, 1, "float32"), (128, 2, "float32"), (160, 1, "float32"), (192, 1, "float32")]

CHILD = r"""
import sys, torch, torchpm

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

n, factor, dtype = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3])
sim = torchpm.Simulation(n_particles=n, mesh_factor=factor, box_size=4.0 * n, steps=2, dtype=dtype,
                         memory_check="off")
small = torchpm.Simulation(n_particles=4, mesh_factor=factor, steps=1, dtype=dtype)
with torch.no_grad():
    small(small.white_noise())  # libraries and thread pools warmed up
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # reset the peak
with torch.no_grad():
    sim.density(sim(sim.white_noise(seed=0)))
print(status("VmHWM") - base, sim.memory_estimate().peak)
"""


def main():
    print(f"{'particles':>10} {'factor':>6} {'dtype':>8} {'measured MiB':>13} {'estimate MiB':>13} {'ratio':>6}")
    for n, factor, dtype in CASES:
        out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(factor), dtype],
                             capture_output=True, text=True, check=True).stdout.split()
        measured, estimate = int(out[0]), int(out[1])
        print(f"{n:>8}^3 {factor:>6} {dtype:>8} {measured / 2**20:>13.1f} {estimate / 2**20:>13.1f} "
              f"{estimate / measured:>6.2f}")


if __name__ == "__main__":
    main()
