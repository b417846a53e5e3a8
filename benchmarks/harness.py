"""What every benchmark script in ``benchmarks/`` shares: device synchronisation, timing
(warm-up, untimed setup, median of repeats, functions timed in alternation), peak
memory (CUDA's allocator, or the host's resident set sampled by a thread or read from
the kernel's high-water mark), the header that puts device, date, versions and command
above every result (RESULTS.md quotes them), tables printed row by row, and the
helpers of the measurements made in fresh child processes.

The scripts import it as ``harness`` (Python puts a script's own directory first on
``sys.path``). torch is imported only by the functions that need it, so that a script
that models rather than measures (``model_distributed.py``) starts at once.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# glibc's mmap threshold, fixed for the processes that measure the resident set: above
# it every block is its own mmap, given back to the system when freed, so the sampled
# resident set follows live memory (by default glibc raises the threshold as blocks are
# freed and keeps them in the heap). Timings are taken without it: fresh mmaps add page
# faults to every large allocation.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _nothing():
    return None


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def synchronize(device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device); nothing on the CPU."""
    if _is_cuda(device):
        import torch

        torch.cuda.synchronize(torch.device(device))


@dataclass
class Timing:
    """Durations (s) of the timed calls, in call order, and the last call's result."""

    times: list[float] = field(default_factory=list)
    result: Any = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def minimum(self) -> float:
        return min(self.times)

    @property
    def maximum(self) -> float:
        return max(self.times)


def time_call(function: Callable[[], Any], device="cpu", clock: Callable[[], float] = time.perf_counter):
    """``(seconds, result)`` of one call of ``function()``, the device synchronised before
    and after it, so that the time covers the work the call queued."""
    synchronize(device)
    start = clock()
    result = function()
    synchronize(device)
    return clock() - start, result


def _check_counts(repeats, warmup):
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1 (the timed calls), got {repeats!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0 (the untimed calls first), got {warmup!r}")


def timed(
    function: Callable[[], Any],
    device="cpu",
    repeats: int = 5,
    *,
    warmup: int = 1,
    setup: Callable[[], Any] | None = None,
    barrier: Callable[[], Any] | None = None,
    budget: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Time ``function()``: ``warmup`` untimed calls, then ``repeats`` timed ones.

    Before every call (warm-up ones too) ``setup()`` runs, untimed (e.g. restoring
    arrays the call updates in place), then ``barrier()`` (e.g. ``dist.barrier``, so
    that the ranks of a distributed call start together). Each call is timed with
    ``clock`` (wall time by default; ``time.process_time`` for this process's CPU time)
    between device synchronisations. With ``budget`` (seconds of ``clock``, counted
    from the first timed call), no further call starts once it is spent: at least one
    call is timed. ``.median`` of the result is the usual figure; ``.result`` is the
    last call's return value (each call's is let go before the next call, so that
    calls do not run beside the memory of the one before).
    """
    _check_counts(repeats, warmup)
    setup = setup or _nothing
    barrier = barrier or _nothing
    timing = Timing()
    for _ in range(warmup):
        timing.result = None
        setup()
        barrier()
        timing.result = function()
    synchronize(device)
    first = clock()
    for _ in range(repeats):
        timing.result = None
        setup()
        barrier()
        elapsed, timing.result = time_call(function, device, clock)
        timing.times.append(elapsed)
        if budget is not None and clock() - first > budget:
            break
    return timing


def timed_together(
    functions: dict[str, Callable[[], Any] | tuple[Callable[[], Any], Callable[[], Any]]],
    device="cpu",
    repeats: int = 5,
    *,
    warmup: int = 1,
    barrier: Callable[[], Any] | None = None,
    budget: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Time several functions in alternation, one call of each per round in the order
    given, so that each sees the same machine load (other processes share the CPU):
    ``{name: Timing}``, the ``times`` of the same round at the same index (for ratios
    of calls made back to back). An entry may be a ``(setup, function)`` pair:
    ``setup()`` runs untimed before each call of ``function``. Warm-up: ``warmup``
    calls of each function in turn, before the rounds. ``budget``: no round starts
    once that many seconds of ``clock`` have passed since the first; ``barrier``,
    ``clock``: as in :func:`timed`. The functions' return values are let go at once
    (no ``.result``).
    """
    _check_counts(repeats, warmup)
    barrier = barrier or _nothing
    pairs = {name: entry if isinstance(entry, tuple) else (_nothing, entry) for name, entry in functions.items()}
    timings = {name: Timing() for name in pairs}
    for name, (setup, function) in pairs.items():
        for _ in range(warmup):
            setup()
            barrier()
            function()
    synchronize(device)
    first = clock()
    for _ in range(repeats):
        for name, (setup, function) in pairs.items():
            setup()
            barrier()
            elapsed = time_call(function, device, clock)[0]
            timings[name].times.append(elapsed)
        if budget is not None and clock() - first > budget:
            break
    return timings


def restorer(*tensors):
    """``(copies, restore)``: private copies of ``tensors`` and a setup that copies the
    originals back into them, for timing calls that update their arrays in place (each
    timed call starts from the same values, as a run's step starts from the arrays the
    step before left)."""
    copies = tuple(tensor.clone() for tensor in tensors)

    def restore():
        for copy, tensor in zip(copies, tensors):
            copy.copy_(tensor)

    return copies, restore


# ----------------------------------------------------------------------------
# Peak memory


def _proc_status(key: str) -> int:
    """A ``/proc/self/status`` value (``VmRSS``, ``VmHWM``) in bytes (Linux)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def resident_set_bytes() -> int:
    """This process's resident set size (bytes), from ``/proc/self/statm`` (Linux)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory (bytes) above the baseline over a ``with`` block, in ``.peak``.

    CUDA: ``torch.cuda.max_memory_allocated`` above ``memory_allocated`` at entry (the
    peak statistics reset at entry). The CPU, by ``host``:

    * ``"sampled"``: the resident set size, sampled every ``interval`` seconds by a
      thread (and once more at exit), above its value at entry; run the process with
      :data:`FIXED_MMAP_THRESHOLD` so that freed blocks leave the resident set;
    * ``"high-water"``: the kernel's high-water mark of the resident set (``VmHWM``) at
      exit above the resident set at entry. ``reset_high_water`` restarts the mark at
      entry (``/proc/self/clear_refs``, Linux >= 4.0; else an earlier peak of the
      process, e.g. its imports, may stand in for the block's);
      ``release_freed`` first gives the heap's freed blocks back to the system
      (glibc's ``malloc_trim``), so that the block's own allocations count.
    """

    def __init__(self, device="cpu", *, host="sampled", interval=0.0005, reset_high_water=False,
                 release_freed=False):
        if host not in ("sampled", "high-water"):
            raise ValueError(f"host must be 'sampled' or 'high-water', got {host!r}")
        self.device = device
        self.host = host
        self.interval = interval
        self.reset_high_water = reset_high_water
        self.release_freed = release_freed
        self.peak = 0

    def _sample(self):
        while not self._stop.is_set():
            self._max = max(self._max, resident_set_bytes())
            time.sleep(self.interval)

    def __enter__(self):
        if _is_cuda(self.device):
            import torch

            device = torch.device(self.device)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._base = torch.cuda.memory_allocated(device)
        elif self.host == "high-water":
            if self.release_freed:
                import ctypes

                ctypes.CDLL("libc.so.6").malloc_trim(0)
            if self.reset_high_water:
                with open("/proc/self/clear_refs", "w") as handle:
                    handle.write("5")
            self._base = _proc_status("VmRSS")
        else:
            self._base = self._max = resident_set_bytes()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if _is_cuda(self.device):
            import torch

            device = torch.device(self.device)
            torch.cuda.synchronize(device)
            self.peak = torch.cuda.max_memory_allocated(device) - self._base
        elif self.host == "high-water":
            self.peak = _proc_status("VmHWM") - self._base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, resident_set_bytes()) - self._base
        return False


@contextlib.contextmanager
def fixed_mmap_threshold():
    """:data:`FIXED_MMAP_THRESHOLD` in ``os.environ`` inside the block (for the processes
    spawned there), the previous value restored after it."""
    saved = {key: os.environ.get(key) for key in FIXED_MMAP_THRESHOLD}
    os.environ.update(FIXED_MMAP_THRESHOLD)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


# ----------------------------------------------------------------------------
# Measurements in child processes


class ChildFailed(RuntimeError):
    """A child process failed or printed no JSON object on its last line of output."""

    def __init__(self, command, returncode, stdout, stderr):
        self.command, self.returncode, self.stdout, self.stderr = command, returncode, stdout, stderr
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        super().__init__(f"child failed (exit {returncode}): {last}")


def child_report(command: Sequence[str], environment: dict[str, str] | None = None) -> dict:
    """Run ``command`` (a fresh process, e.g. this script with a hidden child option)
    with ``environment`` added to this process's, and return the JSON object on the
    last line of its output; :class:`ChildFailed` if it fails or prints none."""
    result = subprocess.run(list(command), env=dict(os.environ, **(environment or {})), capture_output=True,
                            text=True)
    lines = result.stdout.strip().splitlines()
    try:
        if result.returncode:
            raise ValueError
        report = json.loads(lines[-1])
        if not isinstance(report, dict):
            raise ValueError
    except (IndexError, ValueError):
        raise ChildFailed(list(command), result.returncode, result.stdout, result.stderr) from None
    return report


# ----------------------------------------------------------------------------
# What is printed


def device_name(device) -> str:
    """The CUDA device's name, or the host's processor."""
    if _is_cuda(device):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def _commit() -> str | None:
    try:
        result = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else None


def header_lines(title: str, device=None, details: Iterable[str] = ()) -> list[str]:
    """The lines :func:`print_header` prints."""
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# torchpm {title}, {now:%Y-%m-%d %H:%M} UTC"]
    if device is not None:
        import torch

        import torchpm

        source = os.path.dirname(os.path.abspath(torchpm.__file__))
        parts = [f"# device: {device} ({device_name(device)})", f"torch {torch.__version__}",
                 f"{torch.get_num_threads()} threads", f"torchpm {getattr(torchpm, '__version__', '?')} from {source}"]
        lines.append(", ".join(parts + list(details)))
    elif details:
        lines.append("# " + ", ".join(details))
    commit = _commit()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines.append(f"# command: python {' '.join(sys.argv)}" + (f"; commit {commit}" if commit else "")
                 + f"; load average {load:.1f} on {os.cpu_count()} cores")
    return lines


def print_header(title: str, device=None, details: Iterable[str] = ()) -> None:
    """Print what a result needs beside it in RESULTS.md: ``# torchpm <title>, <date>
    UTC``; for a measurement (``device`` given) the device and its name, the torch and
    torchpm versions, torch's threads and ``details``; the command, the commit and the
    load average."""
    for line in header_lines(title, device, details):
        print(line)
    sys.stdout.flush()


# [[fill]align][sign][z][#][0][width]...: the alignment and width of a format spec
_SPEC = re.compile(r"^(?:.?(?P<align>[<>=^]))?[+\- ]?z?#?0?(?P<width>\d*)")


class Table:
    """A table printed row by row (flushed, so that a run cut short still shows its rows).

    ``columns``: names, or ``(name, spec)`` pairs where ``spec`` is a format spec for
    the column's values (``".1f"``, ``">10.2f"``, ``"<24"``); a string value is
    printed as it is, in the spec's width. ``style="markdown"``: ``| a | b |`` rows
    under a ``|---|`` rule. ``style="aligned"``: fixed-width columns joined by
    ``separator``, the names right-aligned in each spec's width (left-aligned where
    the spec says ``<``).
    """

    def __init__(self, columns: Sequence[str | tuple[str, str]], style: str = "markdown", separator: str = " ",
                 file=None):
        if style not in ("markdown", "aligned"):
            raise ValueError(f"style must be 'markdown' or 'aligned', got {style!r}")
        self.columns = [(column, "") if isinstance(column, str) else tuple(column) for column in columns]
        self.style = style
        self.separator = separator
        self.file = file

    @staticmethod
    def _text_spec(spec: str) -> str:
        """The spec a name or a string value takes in a column of ``spec``: its width,
        right-aligned unless the spec aligns left or centres."""
        match = _SPEC.match(spec)
        align = match.group("align") if match.group("align") in ("<", "^") else ">"
        return align + match.group("width")

    def _line(self, cells: list[str]) -> str:
        if self.style == "markdown":
            return "| " + " | ".join(cells) + " |"
        return self.separator.join(cells)

    def header(self) -> str:
        names = [name if self.style == "markdown" else format(name, self._text_spec(spec))
                 for name, spec in self.columns]
        line = self._line(names)
        if self.style == "markdown":
            line += "\n|" + "---|" * len(self.columns)
        return line

    def format_row(self, *values) -> str:
        if len(values) != len(self.columns):
            raise ValueError(f"a row needs {len(self.columns)} values (one per column), got {len(values)}")
        cells = [format(value, self._text_spec(spec) if self.style == "aligned" else "")
                 if isinstance(value, str) else format(value, spec)
                 for value, (_, spec) in zip(values, self.columns)]
        return self._line(cells)

    def print_header(self) -> None:
        print(self.header(), file=self.file or sys.stdout, flush=True)

    def print_row(self, *values) -> None:
        print(self.format_row(*values), file=self.file or sys.stdout, flush=True)
