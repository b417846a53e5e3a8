"""The benchmark harness (benchmarks/harness.py) on a fake clock, and every script in
benchmarks/ run once at its smallest size."""

from __future__ import annotations

import datetime
import importlib.util
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")

# benchmarks/ is no package: the harness loaded from its file, under a name of its own
_spec = importlib.util.spec_from_file_location("benchmarks_harness", os.path.join(BENCHMARKS, "harness.py"))
harness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness  # (dataclasses look their module up there)
_spec.loader.exec_module(harness)


class FakeClock:
    """A clock that moves only when told to: the time a fake call takes."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Worker:
    """A function whose n-th call takes ``durations[n]`` seconds of ``clock`` and is logged."""

    def __init__(self, clock, durations, log, name="call"):
        self.clock, self.durations, self.log, self.name = clock, list(durations), log, name
        self.calls = 0

    def __call__(self):
        self.clock.now += self.durations[self.calls]
        self.calls += 1
        self.log.append(self.name)
        return self.calls


def test_timed_takes_the_median_of_the_timed_calls_after_the_warm_up():
    clock, log = FakeClock(), []
    # two warm-up calls (100 s and 200 s, not timed), then 5, 1, 3, 9 s
    worker = Worker(clock, [100, 200, 5, 1, 3, 9], log)
    timing = harness.timed(worker, repeats=4, warmup=2, clock=clock)
    assert worker.calls == 6
    assert timing.times == [5, 1, 3, 9]
    assert timing.median == 4.0  # (3 + 5) / 2
    assert timing.minimum == 1 and timing.maximum == 9
    assert timing.result == 6  # the last call's


def test_timed_without_warm_up_times_every_call():
    clock, log = FakeClock(), []
    worker = Worker(clock, [7, 2, 4], log)
    timing = harness.timed(worker, repeats=3, warmup=0, clock=clock)
    assert worker.calls == 3 and timing.times == [7, 2, 4] and timing.median == 4


def test_setup_and_barrier_run_before_every_call_and_are_not_timed():
    clock, log = FakeClock(), []
    worker = Worker(clock, [1, 2, 3], log)

    def setup():
        clock.now += 50  # a slow setup must not enter the times
        log.append("setup")

    def barrier():
        clock.now += 20
        log.append("barrier")

    timing = harness.timed(worker, repeats=2, warmup=1, setup=setup, barrier=barrier, clock=clock)
    assert log == ["setup", "barrier", "call"] * 3
    assert timing.times == [2, 3]


class Result:
    pass


def test_no_call_runs_beside_the_result_of_the_one_before():
    made, seen_alive = [], []

    def function():
        seen_alive.append(any(ref() is not None for ref in made))
        result = Result()
        made.append(weakref.ref(result))
        return result

    timing = harness.timed(function, repeats=3, warmup=1)
    assert seen_alive == [False] * 4
    assert made[-1]() is timing.result  # the last one is kept
    made.clear(), seen_alive.clear()
    harness.timed_together({"a": function, "b": function}, repeats=2, warmup=1)
    assert seen_alive == [False] * 6


def test_budget_stops_the_repeats_once_spent_but_times_one_call_at_least():
    clock, log = FakeClock(), []
    # warm-up 50 s (not counted against the budget), then 1 s each: over 2.5 s after the third
    timing = harness.timed(Worker(clock, [50] + [1] * 10, log), repeats=10, budget=2.5, clock=clock)
    assert timing.times == [1, 1, 1]
    timing = harness.timed(Worker(clock, [50, 10, 10], log), repeats=2, budget=0.5, clock=clock)
    assert timing.times == [10]


def test_timed_together_alternates_the_functions_round_by_round():
    clock, log = FakeClock(), []
    a = Worker(clock, [100, 1, 2, 3], log, "a")
    b = Worker(clock, [100, 10, 20, 30], log, "b")
    setups = []

    def setup_b():
        setups.append(len(log))  # how many calls came before this setup
        clock.now += 1000

    timings = harness.timed_together({"a": a, "b": (setup_b, b)}, repeats=3, warmup=1, clock=clock)
    # warm-up of a, of b, then the rounds a b, a b, a b
    assert log == ["a", "b", "a", "b", "a", "b", "a", "b"]
    assert setups == [1, 3, 5, 7]  # before every call of b, warm-up included
    assert timings["a"].times == [1, 2, 3] and timings["b"].times == [10, 20, 30]
    assert timings["a"].median == 2 and timings["b"].median == 20


def test_timed_together_budget_counts_whole_rounds():
    clock, log = FakeClock(), []
    a, b = Worker(clock, [0] + [1] * 9, log, "a"), Worker(clock, [0] + [1] * 9, log, "b")
    timings = harness.timed_together({"a": a, "b": b}, repeats=9, budget=3.5, clock=clock)
    # rounds take 2 s: over 3.5 s after the second round
    assert timings["a"].times == [1, 1] and timings["b"].times == [1, 1]
    assert log == ["a", "b"] * 3


def test_process_clock_option_measures_cpu_time_not_sleep():
    timing = harness.timed(lambda: time.sleep(0.05), repeats=1, warmup=0, clock=time.process_time)
    assert timing.median < 0.04
    timing = harness.timed(lambda: time.sleep(0.05), repeats=1, warmup=0)
    assert timing.median >= 0.05


@pytest.mark.parametrize("repeats, warmup, name", [(0, 1, "repeats"), (2, -1, "warmup"), (1.5, 1, "repeats")])
def test_bad_counts_are_refused_by_name(repeats, warmup, name):
    with pytest.raises(ValueError, match=name):
        harness.timed(lambda: None, repeats=repeats, warmup=warmup)
    with pytest.raises(ValueError, match=name):
        harness.timed_together({"f": lambda: None}, repeats=repeats, warmup=warmup)


def test_cuda_calls_are_timed_between_synchronisations(monkeypatch):
    clock, log = FakeClock(), []

    def synchronize(device=None):
        log.append(f"sync {device}")
        clock.now += 4  # the queued work the call left, finished during the wait

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    elapsed, result = harness.time_call(Worker(clock, [1], log), "cuda:0", clock)
    assert log == ["sync cuda:0", "call", "sync cuda:0"]
    assert elapsed == 5 and result == 1  # the call and the wait for its work, not the wait before it
    log.clear()
    harness.time_call(Worker(clock, [1], log), "cpu", clock)
    assert log == ["call"]


def test_restorer_gives_every_call_the_same_starting_values():
    original = torch.arange(4.0)
    (copy,), restore = harness.restorer(original)
    copy.add_(10)
    restore()
    assert torch.equal(copy, torch.arange(4.0)) and torch.equal(original, torch.arange(4.0))


def _touch(megabytes):
    return b"\x01" * (megabytes << 20)  # written, so resident


def test_sampled_peak_memory_sees_a_block_freed_inside():
    with harness.PeakMemory("cpu") as memory:
        block = _touch(64)
        time.sleep(0.05)
        del block
    assert 60 * 2**20 <= memory.peak < 100 * 2**20


def test_high_water_peak_memory_sees_a_block_freed_inside_and_resets():
    held = _touch(64)
    del held  # a peak before the block: forgotten with reset_high_water
    with harness.PeakMemory("cpu", host="high-water", reset_high_water=True) as memory:
        pass
    assert memory.peak < 16 * 2**20
    with harness.PeakMemory("cpu", host="high-water", reset_high_water=True, release_freed=True) as memory:
        block = _touch(48)
        del block
    assert 44 * 2**20 <= memory.peak < 80 * 2**20


def test_cuda_peak_memory_is_the_allocator_peak_above_entry(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 350)
    with harness.PeakMemory("cuda") as memory:
        calls.append("block")
    assert memory.peak == 250
    assert calls == ["sync", "reset", "block", "sync"]


def test_peak_memory_refuses_an_unknown_host_method():
    with pytest.raises(ValueError, match="host"):
        harness.PeakMemory("cpu", host="rss")


def test_fixed_mmap_threshold_is_set_inside_and_restored(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with harness.fixed_mmap_threshold():
        assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "7")
    with harness.fixed_mmap_threshold():
        pass
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "7"


def test_child_report_reads_the_last_line_and_reports_failures():
    code = "import os, json; print('progress'); print(json.dumps({'value': os.environ['TORCHPM_TEST_VALUE']}))"
    assert harness.child_report([sys.executable, "-c", code], {"TORCHPM_TEST_VALUE": "x"}) == {"value": "x"}
    with pytest.raises(harness.ChildFailed, match="exit 3.*boom") as failure:
        harness.child_report([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"])
    assert failure.value.returncode == 3
    with pytest.raises(harness.ChildFailed, match="exit 0"):
        harness.child_report([sys.executable, "-c", "print('not json')"])


def test_markdown_table():
    table = harness.Table(["n", ("ms", ".1f"), "ratio"])
    assert table.header() == "| n | ms | ratio |\n|---|---|---|"
    assert table.format_row(64, 1.25, "-") == "| 64 | 1.2 | - |"
    with pytest.raises(ValueError, match="3 values"):
        table.format_row(1, 2)


def test_aligned_table():
    table = harness.Table([("n", ">5"), ("op", "<6"), ("rate", "8.2f"), ("cost", ">6")], style="aligned")
    assert table.header() == "    n op         rate   cost"
    assert table.format_row(64, "paint", 3.14159, "-") == "   64 paint      3.14      -"
    assert table.format_row(128, "read", "-", f"{12.5:5.1f}%") == "  128 read          -  12.5%"
    spaced = harness.Table([("a", "<3"), ("b", ">3")], style="aligned", separator="  ")
    assert spaced.header() == "a      b" and spaced.format_row(1, 2) == "1      2"


def test_print_row_flushes_each_row(capsys):
    table = harness.Table(["a"])
    table.print_header()
    table.print_row(1)
    assert capsys.readouterr().out == "| a |\n|---|\n| 1 |\n"


def test_header_names_device_date_versions_and_command():
    lines = harness.header_lines("test benchmark", "cpu", ["float32"])
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert lines[0].startswith(f"# torchpm test benchmark, {today}") and lines[0].endswith(" UTC")
    assert lines[1].startswith("# device: cpu (") and f"torch {torch.__version__}" in lines[1]
    assert lines[1].endswith(", float32")
    assert lines[2].startswith(f"# command: python {' '.join(sys.argv)}") and "load average" in lines[2]
    assert len(harness.header_lines("model")) == 2  # no device: nothing measured


# ----------------------------------------------------------------------------
# Every script once, at its smallest size (the gloo ones on 2 ranks). Each but the
# model starts at least one Python process with torch and torchpm (several seconds
# each on 2 cores), so together they take about 5 minutes: marked slow.


def _aligned(*cells):
    return " ".join(cells)


SMOKE = {
    "bench_anchors": (["--sizes", "8", "--mesh-factors", "1", "2", "--run-steps", "2", "--repeats", "1"],
                      ["| particles | mesh | step [ms] | pmwd step | 2LPT [ms] | pmwd 2LPT | run, 2 steps [s] |",
                       "| 8^3 | 16^3 | "]),
    "bench_pm": (["--no-jaxpm", "--sizes", "8", "--repeats", "1"],
                 ["| N^3 | torchpm step [ms] | JaxPM step [ms] | ratio |",
                  "| N^3 | particles | step unsorted | step sorted |"]),
    "bench_adjoint": (["--size", "8", "--steps", "2", "--timing-steps", "2", "--repeats", "1", "--modes", "adjoint"],
                      ["| mode | peak 2 steps [MiB] | peak ratio 2/2 | forward [s] | forward+backward [s] | ratio |",
                       "| adjoint | "]),
    "bench_halos": (["--particles", "16", "--repeats", "1"], ['"torchpm_fof_s"', '"same_partition": true']),
    "bench_lensing": (["--particles", "8", "--planes", "2", "--pixels", "16", "--repeats", "1"],
                      ['"lightcone_over_plain"']),
    "bench_mass_assignment": (["--sizes", "8", "--orders", "cic", "tsc", "--layouts", "lattice", "--repeats", "2",
                               "--mesh-layouts", "planar"],
                              [f"{'n':>5} {'layout':>14} {'order':>5} {'op':<24} {'Mpart/s':>9} {'x CIC time':>10}"]),
    "bench_dfft": (["--sizes", "16", "--ranks", "2", "--repeats", "1"],
                   [f"{'ranks':>5} {'grid':>5} {'n':>5} {'rfftn ms':>10} {'irfftn ms':>10} {'transposes ms':>14} "
                    f"{'vs serial fwd':>14} {'vs serial inv':>14}", "    2   2x1    16 "]),
    "bench_distributed": (["--sizes", "8", "--ranks", "2", "--repeats", "1"],
                          ["| size | ranks | grid | step ms | late steps ms | paint ms |", "| 8^3 | 2 | 2x1 |"]),
    "bench_jacrev": (["--sizes", "4", "--rows", "2", "--repeats", "1"],
                     ["| particles | rows | jacrev [s] | autograd.grad row by row [s] | forward [s] |"]),
    "bench_analysis": (["--sizes", "16", "--repeats", "1"],
                       ["| n^3 | function | median ms | peak MiB | peak / field |", "| 16^3 | power_multipoles |",
                        "| 16^3 | correlation_multipoles |", "| 16^3 | correlation_layer |"]),
    "bench_bispectrum": (["--sizes", "16", "--reach", "two-thirds", "--repeats", "1"],
                         ["| n^3 | shells up to | shells | configurations | pass | time (s) [min-max] |"]),
    "bench_growth": (["--repeats", "1"], [f"{'table':<28} {'what':<24} {'median / min ms':>19}",
                                          "Simulation(32^3, 10 steps)"]),
    "bispectrum_tree_level": (["--particles", "16", "--shells", "2", "--pairs", "1", "--scale-factors", "1.0",
                               "--samples", "1000"],
                              ["| shells | k1, k2, k3 (h/Mpc, measured) | k1, k2, k3 (theory's triangles) |"]),
    "memory_estimate": (["--case", "8", "1", "float32"],
                        [f"{'particles':>10} {'factor':>6} {'dtype':>8} {'measured MiB':>13} {'estimate MiB':>13} "
                         f"{'ratio':>6}", f"{'8^3':>10} {1:>6} {'float32':>8} "]),
    "model_distributed": ([], ["| particles | GPUs | grid | transposes MB/rank |", "| 2048^3 | 512 | 64 x 8 |"]),
}


def test_every_script_has_a_smoke_run():
    scripts = {name[:-3] for name in os.listdir(BENCHMARKS) if name.endswith(".py") and name != "harness.py"}
    assert scripts == set(SMOKE)


@pytest.mark.parametrize("script", [name if name == "model_distributed" else pytest.param(name, marks=pytest.mark.slow)
                                    for name in sorted(SMOKE)])
def test_script_runs_small(script):
    arguments, expected = SMOKE[script]
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, script + ".py"), *arguments], cwd=ROOT,
                            env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"# command: python {os.path.join(BENCHMARKS, script + '.py')}" in result.stdout
    for text in expected:
        assert text in result.stdout, result.stdout


@pytest.mark.slow
def test_distributed_halo_benchmark_runs_small():
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(BENCHMARKS, "bench_distributed.py")
    result = subprocess.run([sys.executable, script, "--halos", "--sizes", "16", "--ranks", "1", "2", "--repeats", "1",
                             "--steps", "5"], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| 16^3 |")]
    assert [row[2].strip() for row in rows] == ["1x1", "2x1"], result.stdout
    # the same catalogue and the same SO members on one process and on the grid
    assert rows[0][3] == rows[1][3] and rows[0][6] == rows[1][6] and int(rows[0][6]) > 0, result.stdout
