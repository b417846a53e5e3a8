"""The declaration of settings: Simulation's argument checks, the README table,
the step-count guard and the up-front memory check."""

import os
import re
import time

import pytest
import torch

import torchpm
from torchpm import config
from torchpm.resources import MESH_COPIES, estimate_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torchpm.__file__)))
TINY = dict(n_particles=4, box_size=40.0, a_start=0.1, steps=2)


@pytest.mark.parametrize(
    "options,match",
    [
        # strings are not numbers or shapes (they used to be iterated character by character)
        (dict(n_particles="644"), r"`n_particles`.*'644' \(str\)"),
        (dict(box_size="256"), r"`box_size`.*'256' \(str\)"),
        (dict(steps=""), r"`steps`.*'' \(str\)"),
        (dict(steps="10"), r"`steps`"),
        (dict(a_start="0.1"), r"`a_start`"),
        (dict(mesh_factor="2"), r"`mesh_factor`"),
        # bools are not numbers, strings are not bools
        (dict(n_particles=True), r"`n_particles`.*True \(bool\)"),
        (dict(mesh_factor=True), r"`mesh_factor`"),
        (dict(steps=True), r"`steps`"),
        (dict(box_size=[True, 1.0, 1.0]), r"`box_size`"),
        (dict(cic_compensation="false"), r"`cic_compensation`.*bool"),
        (dict(checkpoint="false"), r"`checkpoint`.*bool"),
        (dict(cic_compensation=1), r"`cic_compensation`"),
        # non-integral floats where integers are expected, non-finite numbers
        (dict(n_particles=4.5), r"`n_particles`"),
        (dict(n_particles=(4, 4, 4.5)), r"`n_particles`"),
        (dict(steps=2.5), r"`steps`"),
        (dict(lpt_order=2.0), r"`lpt_order`"),
        (dict(box_size=float("inf")), r"`box_size`"),
        (dict(box_size=float("nan")), r"`box_size`"),
        (dict(a_start=float("nan")), r"`a_start`"),
        (dict(a_end=float("inf")), r"`a_end`"),
        (dict(steps=[0.5, float("nan")]), r"`steps`"),
        # options checked at construction (not on the first forward any more)
        (dict(laplacian="spectral"), r"`laplacian`"),
        (dict(gradient="sobel"), r"`gradient`"),
        (dict(integrator="Fastpm"), r"`integrator`"),
        (dict(memory_check="maybe"), r"`memory_check`"),
    ],
)
def test_simulation_rejects_wrong_types(options, match):
    settings = dict(TINY, **options)
    with pytest.raises((ValueError, TypeError), match=match):
        torchpm.Simulation(**settings)


def test_integral_floats_and_numpy_numbers_are_accepted():
    np = pytest.importorskip("numpy")
    sim = torchpm.Simulation(n_particles=4.0, box_size=np.float64(40.0), mesh_factor=np.int64(2), steps=2.0)
    assert sim.particle_shape == (4, 4, 4) and sim.mesh_factor == 2 and sim.steps == 2
    assert sim.box_size == (40.0, 40.0, 40.0) and all(type(b) is float for b in sim.box_size)


def test_huge_step_count_is_a_quick_error():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"`steps`.*{config.MAX_STEPS}"):
        torchpm.Simulation(n_particles=4, steps=10**9)
    assert time.perf_counter() - start < 1.0  # no list of 10**9 scale factors was built
    with pytest.raises(ValueError, match=r"`steps`"):
        config.as_steps(10**18, 0.1, 1.0)


def test_steps_grid_is_the_documented_one():
    # steps linear in a (hand-computed), and an explicit list kept as given
    assert config.as_steps(3, 0.1, 0.7) == pytest.approx([0.1, 0.3, 0.5, 0.7], abs=1e-15)
    assert config.as_steps([0.2, 0.4], 0.1, 1.0) == [0.1, 0.2, 0.4]
    assert config.as_steps(0, 0.5, 0.1) == [0.5]


def test_an_empty_steps_list_is_no_step_in_the_config_as_in_the_api(tmp_path):
    """`steps = []` is a run with no step (the LPT only) in a config file, as it is for
    `Simulation(steps=[])` and as `steps = 0` is: both check against one declaration."""
    path = tmp_path / "run.toml"
    path.write_text("n_particles = 4\nbox_size = 40.0\nsteps = []\na_start = 0.3\n")
    loaded = config.load_config(str(path))
    assert loaded["steps"] == []
    assert torchpm.Simulation(n_particles=4, box_size=40.0, steps=loaded["steps"], a_start=0.3).scale_factors == [0.3]
    assert config.as_steps([], 0.3, 1.0) == config.as_steps(0, 0.3, 1.0) == [0.3]


@pytest.mark.parametrize(
    "check,value,ok",
    [
        (lambda v: config.as_int("x", v, 1), 3, 3),
        (lambda v: config.as_int("x", v, 1), 3.0, 3),
        (lambda v: config.as_int("x", v, 1), 0, None),
        (lambda v: config.as_int("x", v, 1), 1.5, None),
        (lambda v: config.as_int("x", v, 1), "3", None),
        (lambda v: config.as_int("x", v, 1), float("inf"), None),
        (lambda v: config.as_float("x", v, 0.0, 1.0, low_open=True), 1.0, 1.0),
        (lambda v: config.as_float("x", v, 0.0, 1.0, low_open=True), 0.0, None),
        (lambda v: config.as_float("x", v), False, None),
        (lambda v: config.as_bool("x", v), False, False),
        (lambda v: config.as_bool("x", v), "true", None),
        (lambda v: config.as_choice("x", v, (1, 2)), 2, 2),
        (lambda v: config.as_choice("x", v, (1, 2)), "2", None),
        (lambda v: config.as_choice("x", v, ("a", "b")), ["a"], None),
    ],
)
def test_validators(check, value, ok):
    if ok is None:
        with pytest.raises(config.SettingError, match="`x`"):
            check(value)
    else:
        result = check(value)
        assert result == ok and type(result) is type(ok)


def test_setting_error_is_value_and_type_error():
    assert issubclass(config.SettingError, ValueError) and issubclass(config.SettingError, TypeError)


def test_every_setting_default_passes_its_own_check():
    checked = config.validate(config.defaults())
    assert set(checked) == {s.name for s in config.SETTINGS}
    assert len({s.name for s in config.SETTINGS}) == len(config.SETTINGS)


def test_readme_table_is_generated_from_the_declaration():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    match = re.search(r"<!-- config-table:begin -->\n(.*?)<!-- config-table:end -->", text, re.S)
    assert match, "README.md lacks the config-table markers"
    assert match.group(1) == config.markdown_table(), (
        "the README config table is out of date: run `python -m torchpm config-table --readme README.md`"
    )
    for setting in config.SETTINGS:
        assert f"| `{setting.name}` |" in match.group(1)


def test_memory_estimate_by_hand():
    # 8^3 particles, mesh factor 2, float32, batch 1: meshes 10 * 4 B * 16^3,
    # particles (3 * 3 * 4 + 8) B * 8^3, LPT fields 21 * 4 B * 8^3.
    estimate = estimate_memory((8, 8, 8), 2, torch.float32)
    assert MESH_COPIES == 10
    assert estimate.force_meshes == 10 * 4 * 16**3
    assert estimate.particles == 44 * 512
    assert estimate.lpt_fields == 21 * 4 * 512
    assert estimate.peak == int(1.2 * (44 * 512 + 10 * 4 * 16**3 + 21 * 4 * 512))
    # per rank and per batch member
    halves = estimate_memory((8, 8, 8), 2, torch.float64, batch=2, ranks=4)
    assert halves.force_meshes == 10 * 8 * 16**3 * 2 // 4


def test_memory_check_refuses_before_allocating_and_can_be_overridden():
    # 512^3 particles on a 1024^3 mesh: about 67 GiB, far more than this machine has.
    start = time.perf_counter()
    with pytest.raises(MemoryError, match=r"needs about .*GiB.*memory_check"):
        torchpm.Simulation(n_particles=512, mesh_factor=2, steps=1)
    assert time.perf_counter() - start < 1.0
    with pytest.warns(ResourceWarning, match="needs about"):
        torchpm.Simulation(n_particles=512, mesh_factor=2, steps=1, memory_check="warn")
    sim = torchpm.Simulation(n_particles=512, mesh_factor=2, steps=1, memory_check="off")
    assert sim.memory_estimate().peak > 40 * 2**30


def test_memory_check_counts_the_batch():
    sim = torchpm.Simulation(n_particles=96, mesh_factor=2, steps=1)  # ~0.44 GiB per member
    noise_shape = (100_000, 1, 1, 1)  # the check runs before the noise's shape is used
    with pytest.raises(MemoryError, match=r"batch 100000"):
        sim(torch.zeros(noise_shape))


@pytest.mark.parametrize("batch,seed,match", [(0, 0, "`batch`"), (1.5, 0, "`batch`"), ("2", 0, "`batch`"),
                                              (1, 1.7, "`seed`"), (1, "abc", "`seed`"), (1, -1, "`seed`")])
def test_white_noise_arguments(batch, seed, match):
    sim = torchpm.Simulation(**TINY)
    with pytest.raises(ValueError, match=match):
        sim.white_noise(batch=batch, seed=seed)


def test_binary_power_table_is_a_clear_error(tmp_path):
    path = tmp_path / "power.bin"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="`power_spectrum`.*not a UTF-8 text table"):
        torchpm.Simulation(power_spectrum=str(path), **TINY)


def test_huge_box_or_power_is_an_error_not_nan(tmp_path):
    with pytest.raises(ValueError, match=r"`box_size`.*1e\+300"):
        torchpm.Simulation(n_particles=4, box_size=1e300, steps=1)
    table = tmp_path / "power.txt"
    table.write_text("0.001 1e300\n100.0 1e300\n")
    sim = torchpm.Simulation(power_spectrum=str(table), **TINY)
    with pytest.raises(ValueError, match="LPT initial conditions are not finite.*power_spectrum"):
        sim(sim.white_noise())
