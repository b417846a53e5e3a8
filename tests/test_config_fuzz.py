"""Property-based checks of the settings layer: any value for any key either
validates (and stays the same when validated again) or raises SettingError
naming a key; Simulation's plain arguments likewise never pass through a value
of the wrong type. Bounded for CI (set HYPOTHESIS_PROFILE=long for more examples)."""

import math
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import torchpm
from torchpm import config
from torchpm.io import to_toml

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["float32", "cpu", "fastpm", "Planck15", "cic", "error", "exact", "1", "false"]),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(st.sampled_from(config.COSMOLOGY_KEYS + ("Omega_nu",)), scalars, max_size=6),
)
KEYS = [s.name for s in config.SETTINGS]


def _named(error, key):
    """The error names ``key`` (or one of its entries: `cosmology.Omega_c`)."""
    return re.search(r"`" + re.escape(key) + r"[`.]", str(error)) is not None


@given(key=st.sampled_from(KEYS), value=values)
def test_config_value_validates_or_names_a_key(tmp_path_factory, key, value):
    path = tmp_path_factory.mktemp("fuzz") / "run.toml"
    path.write_text(to_toml({key: value}), encoding="utf-8")
    try:
        result = config.load_config(str(path))
    except config.SettingError as error:
        assert _named(error, key), str(error)
        assert "\n" not in str(error)
        return
    assert config.validate(result) == result  # normalised values pass again, unchanged
    checked = result[key]
    if isinstance(checked, float):
        assert math.isfinite(checked)
    if key in ("batch", "seed", "threads", "mesh_factor"):
        assert type(checked) is int
    if key == "cic_compensation":
        assert type(checked) is bool


@given(
    n_particles=values, box_size=values, mesh_factor=values, steps=values, a_start=values, cic_compensation=values
)
def test_simulation_arguments_are_checked(n_particles, box_size, mesh_factor, steps, a_start, cic_compensation):
    arguments = dict(n_particles=n_particles, box_size=box_size, mesh_factor=mesh_factor, steps=steps,
                     a_start=a_start, cic_compensation=cic_compensation)
    try:
        sim = torchpm.Simulation(memory_check="off", **arguments)
    except (ValueError, TypeError) as error:
        # It names an argument that is wrong on its own: passed alone (the others at
        # their defaults), that argument is refused too.
        named = [name for name in arguments if _named(error, name)]
        assert named, str(error)
        refused = []
        for name in named:
            try:
                torchpm.Simulation(memory_check="off", **{name: arguments[name]})
            except (ValueError, TypeError):
                refused.append(name)
        assert refused, f"{named} named, but each is accepted alone: {error}"
        return
    # Accepted: every value is of the documented type, finite and in range.
    assert all(type(n) is int and n >= 1 for n in sim.particle_shape)
    assert all(type(b) is float and math.isfinite(b) and b > 0 for b in sim.box_size)
    assert type(sim.mesh_factor) is int and sim.mesh_factor >= 1
    assert type(sim.cic_compensation) is bool
    assert all(0 < a <= 1 for a in sim.scale_factors) and sim.steps <= config.MAX_STEPS
    assert not isinstance(n_particles, (str, bool)) and not isinstance(box_size, (str, bool))
    assert isinstance(cic_compensation, bool)


def test_fuzz_catches_a_reintroduced_bug(monkeypatch, tmp_path):
    """The property above fails when a check is loosened back to the old behaviour
    (a string read as a shape), so the suite can fail."""
    def loose_shape(name, value):
        if isinstance(value, str):
            return tuple(int(c) for c in value)
        return config.as_shape(name, value)

    monkeypatch.setattr("torchpm.config.as_shape", loose_shape)
    with pytest.raises(AssertionError):
        test_simulation_arguments_are_checked.hypothesis.inner_test(
            n_particles="644", box_size=40.0, mesh_factor=1, steps=1, a_start=0.1, cic_compensation=False
        )


def test_fuzz_catches_an_error_naming_the_wrong_key(monkeypatch, tmp_path_factory):
    """An error that names another setting than the wrong one fails the first property."""
    monkeypatch.setattr("torchpm.config._fail",
                        lambda name, expected, value: config.SettingError(f"`seed` must be {expected}"))
    with pytest.raises(AssertionError):
        test_config_value_validates_or_names_a_key.hypothesis.inner_test(tmp_path_factory, key="box_size",
                                                                        value="large")


def test_fuzz_catches_a_simulation_error_naming_the_wrong_argument(monkeypatch):
    """A Simulation error that names an argument which is fine on its own fails the second
    property (it used to accept any setting's name)."""
    monkeypatch.setattr("torchpm.config._fail",
                        lambda name, expected, value: config.SettingError(f"`steps` must be {expected}"))
    with pytest.raises(AssertionError, match="accepted alone"):
        test_simulation_arguments_are_checked.hypothesis.inner_test(
            n_particles=64, box_size="large", mesh_factor=1, steps=1, a_start=0.1, cic_compensation=False
        )
