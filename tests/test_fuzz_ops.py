"""Property-based fuzzing of the public surfaces with hypothesis: the mass-assignment ops
(``paint``, ``readout``, ``cic_paint``, ``cic_readout``), the analysis functions and
``Simulation``'s constructor.

Every example ends in one of two outcomes, and anything else fails:

* a result equal to the float64 pure-torch reference (:mod:`torchpm.ops._reference`
  for the ops; for the spectra, Parseval's identity over an independent ``torch.fft.fftn``
  of the whole field), or
* a ``ValueError`` / ``TypeError`` whose message names the argument that was wrong.

Inputs: random shapes (empty batches and particle sets included), float32 and float64,
the meta device, non-contiguous and stride-0 (expanded) tensors, NaN / Inf / huge
values, and for every argument a list of wrong values (other types, numpy arrays,
strings, bools where numbers are expected, non-integer floats, out-of-range values).

The op properties call C++ kernels with odd inputs, so they run in one subprocess
(``python tests/test_fuzz_ops.py``) that runs a batch of them and reports each: a
segfault or abort fails the tests instead of killing pytest. Profiles: ``ci`` (default,
derandomised, bounded) and ``long`` for local runs (``HYPOTHESIS_PROFILE=long``).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import traceback

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
EXAMPLES = {"ci": 1, "long": 25}.get(PROFILE, 1)
_HERE = os.path.dirname(os.path.abspath(__file__))


def fuzz(examples):
    """hypothesis settings: ``examples`` in the ci profile (derandomised, so CI sees the
    same examples every run), 25 times more and random in the long profile."""
    return settings(
        max_examples=examples * EXAMPLES, deadline=None, derandomize=PROFILE == "ci", database=None,
        suppress_health_check=list(HealthCheck), print_blob=True,
    )


class Mutation:
    """A wrong (or unusual but valid) value for one argument: ``error`` is the argument
    name the error must contain, or None when the value is valid."""

    def __init__(self, value, error):
        self.value, self.error = value, error

    def __repr__(self):
        return f"Mutation({self.value!r}, error={self.error!r})"


def names(error: BaseException, allowed) -> bool:
    text = str(error)
    for name in allowed:
        if name == "positions" and re.search(r"particles? .*(deposited|position)", text):
            return True  # the block / non-finite position errors of the kernels
        if f"`{name}`" in text:
            return True
    return False


def expect_outcome(call, allowed, check_result):
    """Run ``call``: an error must be a ValueError/TypeError naming one of ``allowed``
    (an empty set: no error allowed); a result goes to ``check_result``."""
    try:
        result = call()
    except (ValueError, TypeError) as error:
        assert allowed, f"unexpected {type(error).__name__}: {error}"
        assert names(error, allowed), f"{type(error).__name__} does not name any of {sorted(allowed)}: {error}"
        return error
    except Exception as error:  # noqa: BLE001 - any other class is a finding
        raise AssertionError(f"undocumented {type(error).__name__} (expected ValueError/TypeError): {error}") from error
    check_result(result)
    return None


# ----------------------------------------------------------------------------
# Strategies: tensors with values, layouts and wrong arguments.

SPECIALS = [float("nan"), float("inf"), -float("inf")]


def huge(dtype):
    return 1e30 if dtype == torch.float32 else 1e300


def big_position(dtype):
    # Largest magnitude at which float32 positions still round like the float64 reference.
    return 2.0**20 if dtype == torch.float32 else 2.0**39


@st.composite
def values_tensor(draw, shape, dtype, low, high, specials=(), extra=()):
    """A tensor of ``shape`` from a drawn seed in ``[low, high)``, with a few drawn entries
    replaced by special values (NaN, Inf, huge, exact integers...)."""
    seed = draw(st.integers(0, 2**31 - 1))
    t = torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * (high - low) + low
    if t.numel():
        pool = list(specials) + list(extra)
        if pool:
            for index, value in draw(st.lists(st.tuples(st.integers(0, t.numel() - 1), st.sampled_from(pool)),
                                              max_size=3)):
                t.view(-1)[index] = value
        if draw(st.booleans()):  # some exact nodes and half-integers
            t = torch.where(t.abs() < 1e6, torch.round(t * 2) / 2, t) if draw(st.booleans()) else t
    return t.to(dtype)


def layout(draw, t, expandable_dims):
    """The same values (or, for stride 0, values made constant along a dimension) in a
    non-contiguous or expanded layout."""
    kind = draw(st.sampled_from(["contiguous", "strided", "transposed", "expanded"]))
    if kind == "strided" and t.dim():
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == "expanded":
        for dim in expandable_dims:
            if t.shape[dim] > 0:
                index = [slice(None)] * t.dim()
                index[dim] = slice(0, 1)
                return t[tuple(index)].expand(t.shape)
    return t


def ints(*values):
    return [Mutation(v, None) for v in values]


POSITION_MUTATIONS = lambda p: [  # noqa: E731
    Mutation(p.numpy(), "positions"), Mutation(p.tolist(), "positions"), Mutation(None, "positions"),
    Mutation(p.to(torch.int64), "positions"), Mutation(p.to(torch.float16), "positions"),
    Mutation(p.to(torch.complex64), "positions"), Mutation(p[..., :2], "positions"), Mutation(p.reshape(-1, 3), "positions"),
    Mutation(p.unsqueeze(0), "positions"), Mutation("positions", "positions"),
]
SHAPE_MUTATIONS = [
    Mutation(None, "shape"), Mutation("444", "shape"), Mutation((4.7, 4, 4), "shape"), Mutation((4, 4), "shape"),
    Mutation((0, 4, 4), "shape"), Mutation((-1, 4, 4), "shape"), Mutation((True, 4, 4), "shape"),
    Mutation((2**31, 4, 4), "shape"), Mutation(4, "shape"), Mutation((4, 4, 4, 4), "shape"),
    Mutation((float("nan"), 4, 4), "shape"), Mutation((4.0, 4, 4), "shape"),
    Mutation((np.int64(3), np.int32(4), 2), None), Mutation([torch.tensor(3), 4, 2], None),
    Mutation(np.array([3, 4, 2]), None),
]
OFFSET_MUTATIONS = [
    Mutation(0, "offset"), Mutation((0.5, 0, 0), "offset"), Mutation((float("nan"), 0, 0), "offset"),
    Mutation((float("inf"), 0, 0), "offset"), Mutation("000", "offset"), Mutation((0, 0), "offset"),
    Mutation((2**40, 0, 0), "offset"), Mutation((True, 0, 0), "offset"), Mutation((1.0, 0, 0), "offset"),
    Mutation((np.int64(1), 0, -1), None), Mutation([0, 0, 0], None),
]
PERIODIC_MUTATIONS = [
    Mutation("FFF", "periodic"), Mutation(None, "periodic"), Mutation(0, "periodic"), Mutation(1, "periodic"),
    Mutation((1, 0, 1), "periodic"), Mutation((True, False), "periodic"), Mutation("True", "periodic"),
    Mutation((np.bool_(True), True, np.bool_(False)), None), Mutation(np.bool_(True), None),
]
ORDER_MUTATIONS = [
    Mutation(0, "order"), Mutation(5, "order"), Mutation(2.0, "order"), Mutation(True, "order"),
    Mutation("foo", "order"), Mutation(None, "order"), Mutation("CIC", None), Mutation(np.int64(3), None),
]
FINITE_MUTATIONS = [
    Mutation("false", "check_finite"), Mutation(0, "check_finite"), Mutation(None, "check_finite"),
    Mutation(np.bool_(False), None),
]


def weight_mutations(w, p):
    other = torch.float32 if p.dtype == torch.float64 else torch.float64
    batch, count = p.shape[:2]
    return [
        Mutation(w.numpy(), "weights"), Mutation(w.tolist(), "weights"), Mutation(w.to(other), "weights"),
        Mutation(w.to(torch.int64), "weights"), Mutation(torch.ones(batch, count + 1, dtype=p.dtype), "weights"),
        Mutation(torch.ones(batch, count, 0, dtype=p.dtype), "weights"),
        Mutation(torch.ones(batch, count, 1, 1, dtype=p.dtype), "weights"), Mutation(1.0, "weights"),
    ]


def mesh_mutations(m, p):
    other = torch.float32 if p.dtype == torch.float64 else torch.float64
    batch = p.shape[0]
    return [
        Mutation(m.numpy(), "mesh"), Mutation(m.tolist(), "mesh"), Mutation(m.to(other), "mesh"),
        Mutation(m.to(torch.int64), "mesh"), Mutation(torch.ones(batch + 1, 3, 3, 3, dtype=p.dtype), "mesh"),
        Mutation(torch.ones(batch, 0, 3, 3, 3, dtype=p.dtype), "mesh"),
        Mutation(torch.ones(batch, 3, 3, 0, dtype=p.dtype), "mesh"), Mutation(torch.ones(3, 3, 3, dtype=p.dtype), "mesh"),
        Mutation(None, "mesh"),
    ]


@st.composite
def particle_case(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    batch, count = draw(st.integers(0, 2)), draw(st.integers(0, 10))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(3))
    order = draw(st.sampled_from(["ngp", "cic", "tsc", "pcs", 1, 2, 3, 4]))
    periodic = draw(st.one_of(st.booleans(), st.tuples(st.booleans(), st.booleans(), st.booleans())))
    offset = draw(st.one_of(st.none(), st.tuples(*[st.integers(-6, 6)] * 3)))
    span = max(shape)
    low = (min(offset) if offset else 0) - span
    positions = draw(values_tensor(
        (batch, count, 3), dtype, low, low + 3 * span + 1, specials=SPECIALS if draw(st.booleans()) else (),
        extra=[big_position(dtype), -big_position(dtype), 2.0**41, -1e-30, 0.0],
    ))
    positions = layout(draw, positions, expandable_dims=(0, 1))
    check_finite = draw(st.booleans())
    return dict(dtype=dtype, positions=positions, shape=shape, order=order, periodic=periodic, offset=offset,
                check_finite=check_finite)


def order_value(order):
    return {"ngp": 1, "cic": 2, "tsc": 3, "pcs": 4}.get(str(order).lower(), order) if isinstance(order, str) else int(order)


def periodic_value(periodic):
    return bool(periodic) if isinstance(periodic, (bool, np.bool_)) else tuple(bool(p) for p in periodic)


def shape_value(shape):
    return tuple(int(s) for s in shape)


def position_error(positions, shape, offset, periodic, order):
    """Whether the reference rejects the positions (non-finite, beyond 2^40, outside a block)."""
    from torchpm.ops._reference import paint_reference

    try:
        paint_reference(positions.to(torch.float64), None, shape, tuple(offset or (0, 0, 0)), periodic, order)
    except ValueError:
        return True
    return False


def close(result, expected, scale, dtype, what, positions, magnitude):
    """``|result - expected| <= tol * scale + floor`` elementwise, with equal non-finite
    patterns. ``scale``: the reference applied to absolute values. ``floor``: the rounding
    of the stencil fraction ``t`` in ``dtype`` (``eps (|x| + 2)`` per axis, weights'
    derivatives at most 1) times ``magnitude`` (the total |weight| of a batch member for
    paint, the largest |mesh| value for readout), which matters where the weights are tiny."""
    result = result.to(torch.float64)
    assert result.shape == expected.shape, f"{what}: shape {tuple(result.shape)} != {tuple(expected.shape)}"
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(result), finite), f"{what}: NaN/Inf pattern differs from the reference"
    tolerance = 2e-5 if dtype == torch.float32 else 1e-12
    reach = float(positions.abs().max()) + 2 if positions.numel() else 2.0
    floor = 4 * torch.finfo(dtype).eps * reach * magnitude
    error = (result - expected).abs()[finite]
    bound = (tolerance * (scale[finite] + 1e-30)) + floor
    assert bool((error <= bound).all()), f"{what}: max error {float((error - bound).max()):.3e} above the bound"


def cpu_and_meta(call_with, arguments, allowed_cpu, structural, check_result):
    """The call on CPU (checked with ``check_result``), then on the meta device: a
    wrong argument (``structural``: the names of the arguments given wrong values)
    must raise on meta too; a CPU result must have the shape and dtype of the meta
    result; only value errors (NaN, positions outside a block) may pass on meta."""
    outcome = {}

    def keep(result):
        outcome["result"] = result
        check_result(result)

    error = expect_outcome(lambda: call_with(arguments), allowed_cpu, keep)
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in arguments.items()}
    try:
        result = call_with(meta)
    except (ValueError, TypeError) as meta_error:
        assert error is not None, f"meta raised although CPU succeeded: {meta_error}"
        assert names(meta_error, allowed_cpu), f"meta error names none of {sorted(allowed_cpu)}: {meta_error}"
        return
    except Exception as meta_error:  # noqa: BLE001
        raise AssertionError(f"undocumented {type(meta_error).__name__} on meta: {meta_error}") from meta_error
    assert not structural, f"meta accepted a wrong {sorted(structural)} that CPU rejected: {error}"
    if "result" in outcome:
        assert result.device.type == "meta" and result.shape == outcome["result"].shape \
            and result.dtype == outcome["result"].dtype, "meta result differs in shape or dtype"


def choose(draw, mutations, forced):
    """The argument to replace and its wrong (or unusual) value: drawn, or in a sweep
    ``forced = (argument, index)``. ``(None, None)``: every argument as generated."""
    if forced is not None:
        target, index = forced
        return target, mutations[target][index]
    target = draw(st.sampled_from([None, None, *mutations]))
    if target is None:
        return None, None
    return target, draw(st.sampled_from(mutations[target]))


def bind(example, forced):
    """``example(case, data, forced)`` as a two-argument function for ``@given``."""
    def run(case, data):
        example(case, data, forced)

    return run


def sweep(example, case_strategy, counts):
    """Every wrong value of every argument, each on two generated cases: the bounded
    random search may miss some of them; this may not."""
    for target, count in counts.items():
        for index in range(count):
            settings(max_examples=2, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))(
                given(case=case_strategy, data=st.data())(bind(example, (target, index))))()


# ----------------------------------------------------------------------------
# Op properties (run in the subprocess).


def paint_example(case, data, forced):
    import torchpm
    from torchpm.ops._reference import paint_reference

    draw = data.draw
    dtype, positions = case["dtype"], case["positions"]
    batch, count = positions.shape[:2]
    channels = draw(st.sampled_from([None, None, 1, 2]))
    weight_shape = (batch, count) if channels is None else (batch, count, channels)
    weights = None
    if (forced and forced[0] == "weights") or draw(st.booleans()):
        scale = huge(dtype) if draw(st.booleans()) else 1.0
        weights = draw(values_tensor(weight_shape, dtype, -scale, scale,
                                     specials=SPECIALS if draw(st.booleans()) else ()))
        weights = layout(draw, weights, expandable_dims=(0, 1))
    arguments = dict(positions=positions, weights=weights, shape=case["shape"], order=case["order"],
                     offset=case["offset"], periodic=case["periodic"], check_finite=case["check_finite"])
    # At most one argument replaced by a wrong (or unusual but valid) value.
    mutations = {
        "positions": POSITION_MUTATIONS(positions), "shape": SHAPE_MUTATIONS, "offset": OFFSET_MUTATIONS,
        "periodic": PERIODIC_MUTATIONS, "order": ORDER_MUTATIONS, "check_finite": FINITE_MUTATIONS,
    }
    if weights is not None:
        mutations["weights"] = weight_mutations(weights, positions)
    target, mutation = choose(draw, mutations, forced)
    allowed = set()
    if target is not None:
        arguments[target] = mutation.value
        if mutation.error:
            allowed.add(mutation.error)
    structural = set(allowed)
    valid = not allowed
    shape = shape_value(arguments["shape"]) if valid else None
    if valid:
        order = order_value(arguments["order"])
        periodic = periodic_value(arguments["periodic"])
        offset = tuple(int(o) for o in arguments["offset"]) if arguments["offset"] is not None else (0, 0, 0)
        if position_error(positions, shape, offset, periodic, order):
            allowed.add("positions")
        if bool(arguments["check_finite"]) and weights is not None and not bool(torch.isfinite(weights).all()):
            allowed.add("weights")

    def check(result):
        assert valid and "positions" not in allowed and "weights" not in allowed, \
            f"accepted although an error naming {sorted(allowed)} was expected"
        p64 = positions.to(torch.float64)
        w64 = None if weights is None else weights.to(torch.float64)
        expected = paint_reference(p64, w64, shape, offset, periodic, order)
        scale = paint_reference(p64, None if w64 is None else w64.abs(), shape, offset, periodic, order)
        # finite weights only: a NaN/Inf weight leaves its cells non-finite, checked by pattern
        total = float(torch.nan_to_num(w64, nan=0.0, posinf=0.0, neginf=0.0).abs().flatten(1).sum(1).max()) \
            if w64 is not None and w64.numel() else float(p64.shape[1])
        close(result, expected, scale, dtype, "paint", p64, total)
        assert result.dtype == dtype and result.is_contiguous()

    use_cic = order_value(case["order"]) == 2 and target != "order" and draw(st.booleans())

    def call(a):
        if use_cic:
            return torchpm.cic_paint(a["positions"], a["weights"], a["shape"], offset=a["offset"],
                                     periodic=a["periodic"], check_finite=a["check_finite"])
        return torchpm.paint(a["positions"], a["weights"], a["shape"], order=a["order"], offset=a["offset"],
                             periodic=a["periodic"], check_finite=a["check_finite"])

    cpu_and_meta(call, arguments, allowed, structural, check)


def readout_example(case, data, forced):
    import torchpm
    from torchpm.ops._reference import readout_reference

    draw = data.draw
    dtype, positions = case["dtype"], case["positions"]
    batch = positions.shape[0]
    channels = draw(st.sampled_from([None, None, 1, 3]))
    mesh_shape = (batch, *case["shape"]) if channels is None else (batch, channels, *case["shape"])
    scale = huge(dtype) if draw(st.booleans()) else 1.0
    mesh = draw(values_tensor(mesh_shape, dtype, -scale, scale, specials=SPECIALS if draw(st.booleans()) else ()))
    mesh = layout(draw, mesh, expandable_dims=(0, mesh.dim() - 1))
    arguments = dict(mesh=mesh, positions=positions, order=case["order"], offset=case["offset"],
                     periodic=case["periodic"], check_finite=case["check_finite"])
    mutations = {
        "mesh": mesh_mutations(mesh, positions), "positions": POSITION_MUTATIONS(positions),
        "offset": OFFSET_MUTATIONS, "periodic": PERIODIC_MUTATIONS, "order": ORDER_MUTATIONS,
        "check_finite": FINITE_MUTATIONS,
    }
    target, mutation = choose(draw, mutations, forced)
    allowed = set()
    if target is not None:
        arguments[target] = mutation.value
        if mutation.error:
            allowed.add(mutation.error)
    structural = set(allowed)
    valid = not allowed
    if valid:
        order = order_value(arguments["order"])
        periodic = periodic_value(arguments["periodic"])
        offset = tuple(int(o) for o in arguments["offset"]) if arguments["offset"] is not None else (0, 0, 0)
        expected = scale_values = None
        if position_error(positions, case["shape"], offset, periodic, order):
            allowed.add("positions")
        else:
            p64, m64 = positions.to(torch.float64), mesh.to(torch.float64)
            expected = readout_reference(m64, p64, offset, periodic, order)
            scale_values = readout_reference(m64.abs(), p64, offset, periodic, order)
            if bool(arguments["check_finite"]) and not bool(torch.isfinite(expected).all()):
                allowed.add("mesh")

    def check(result):
        assert valid and not allowed, f"accepted although an error naming {sorted(allowed)} was expected"
        finite_mesh = mesh.to(torch.float64)[torch.isfinite(mesh)]
        largest = float(finite_mesh.abs().max()) if finite_mesh.numel() else 0.0
        close(result, expected, scale_values, dtype, "readout", positions.to(torch.float64), largest)
        assert result.dtype == dtype

    use_cic = order_value(case["order"]) == 2 and target != "order" and draw(st.booleans())

    def call(a):
        if use_cic:
            return torchpm.cic_readout(a["mesh"], a["positions"], offset=a["offset"], periodic=a["periodic"],
                                       check_finite=a["check_finite"])
        return torchpm.readout(a["mesh"], a["positions"], order=a["order"], offset=a["offset"],
                               periodic=a["periodic"], check_finite=a["check_finite"])

    cpu_and_meta(call, arguments, allowed, structural, check)


OP_COUNTS = dict(positions=10, shape=len(SHAPE_MUTATIONS), offset=len(OFFSET_MUTATIONS),
                 periodic=len(PERIODIC_MUTATIONS), order=len(ORDER_MUTATIONS), check_finite=len(FINITE_MUTATIONS))
property_paint = fuzz(120)(given(case=particle_case(), data=st.data())(bind(paint_example, None)))
property_readout = fuzz(120)(given(case=particle_case(), data=st.data())(bind(readout_example, None)))


def routed_to(op_name, example):
    """``example`` with torchpm.paint sent to ``torch.ops.torchpm.<op_name>`` on every
    device: the paints CUDA takes (tiled, node by node) on the same inputs here."""
    def run(case, data, forced):
        from torchpm.ops import mass_assignment

        route = mass_assignment._paint_op
        mass_assignment._paint_op = lambda tensor, order, weights: getattr(torch.ops.torchpm, op_name)
        try:
            example(case, data, forced)
        finally:
            mass_assignment._paint_op = route

    return run


property_paint_tiled = fuzz(60)(given(case=particle_case(), data=st.data())(bind(routed_to("_paint_tiled", paint_example), None)))
property_paint_node = fuzz(60)(given(case=particle_case(), data=st.data())(
    bind(routed_to("_paint_deterministic", paint_example), None)))


def property_paint_every_wrong_argument():
    sweep(paint_example, particle_case(), dict(OP_COUNTS, weights=8))


def property_readout_every_wrong_argument():
    counts = {key: count for key, count in OP_COUNTS.items() if key != "shape"}
    sweep(readout_example, particle_case(), dict(counts, mesh=9))


@fuzz(40)
@given(case=particle_case(), data=st.data())
def property_gradients(case, data):
    """Gradients of paint and readout in positions, weights and mesh equal the reference's
    (valid periodic inputs; float64 so the check is tight)."""
    import torchpm
    from torchpm.ops._reference import paint_reference, readout_reference

    draw = data.draw
    positions = case["positions"].to(torch.float64)
    if not bool(torch.isfinite(positions).all()) or bool((positions.abs() > 1e6).any()):
        positions = torch.nan_to_num(positions, nan=0.5, posinf=1.5, neginf=-2.5).clamp(-1e6, 1e6)
    order, shape = order_value(case["order"]), case["shape"]
    batch, count = positions.shape[:2]
    weights = draw(values_tensor((batch, count), torch.float64, -1, 1))
    mesh = draw(values_tensor((batch, *shape), torch.float64, -1, 1))
    seed = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    cotangent_mesh = torch.randn(batch, *shape, generator=seed, dtype=torch.float64)
    cotangent_values = torch.randn(batch, count, generator=seed, dtype=torch.float64)
    grads = []
    for paint, readout in ((torchpm.paint, torchpm.readout),
                           (lambda p, w, s, order: paint_reference(p, w, s, (0, 0, 0), True, order),
                            lambda m, p, order: readout_reference(m, p, (0, 0, 0), True, order))):
        p = positions.clone().requires_grad_(True)
        w = weights.clone().requires_grad_(True)
        m = mesh.clone().requires_grad_(True)
        loss = (paint(p, w, shape, order=order) * cotangent_mesh).sum() \
            + (readout(m, p, order=order) * cotangent_values).sum()
        leaves = (p, w, m)
        # NGP's reference does not depend on positions at all: its gradient is zero.
        grads.append([torch.zeros_like(leaf) if g is None else g
                      for leaf, g in zip(leaves, torch.autograd.grad(loss, leaves, allow_unused=True))])
    for name, ours, reference in zip(("positions", "weights", "mesh"), *grads):
        assert torch.allclose(ours, reference, rtol=1e-10, atol=1e-10), f"gradient in {name} differs"


# ----------------------------------------------------------------------------
# Analysis properties (subprocess too: paint_density runs the kernels).

FIELD_MUTATIONS = lambda f, name: [  # noqa: E731
    Mutation(f.numpy(), name), Mutation(f.tolist(), name), Mutation(f.to(torch.int64), name),
    Mutation(f.to(torch.complex128), name), Mutation(f.reshape(f.shape[-3], -1), name),
    Mutation(f[None, None], name), Mutation("field", name), Mutation(None, name),
]
BOX_MUTATIONS = [
    Mutation("256", "box_size"), Mutation(True, "box_size"), Mutation(0.0, "box_size"), Mutation(-1, "box_size"),
    Mutation(float("nan"), "box_size"), Mutation(float("inf"), "box_size"), Mutation((1.0, 2.0), "box_size"),
    Mutation(None, "box_size"), Mutation(np.float64(100.0), None), Mutation([10, 20.5, 30], None),
]
BINS_MUTATIONS = [
    Mutation(0, "bins"), Mutation(-1, "bins"), Mutation(2.5, "bins"), Mutation([0.1, float("nan")], "bins"),
    Mutation([2.0, 1.0], "bins"), Mutation("abc", "bins"), Mutation(True, "bins"), Mutation([1.0], "bins"),
    Mutation(np.int64(2), None),
]
WINDOW_MUTATIONS = [Mutation("foo", "window"), Mutation(0, "window"), Mutation(5, "window"), Mutation(True, "window")]
COMPENSATE_MUTATIONS = [Mutation("false", "compensate_cic"), Mutation(1, "compensate_cic"),
                        Mutation(None, "compensate_cic")]
NOISE_MUTATIONS = [
    Mutation(("shot_noise", "abc"), "shot_noise"), Mutation(("shot_noise", float("nan")), "shot_noise"),
    Mutation(("shot_noise", float("inf")), "shot_noise"), Mutation(("shot_noise", True), "shot_noise"),
    Mutation(("n_particles", 0), "n_particles"), Mutation(("n_particles", -1), "n_particles"),
    Mutation(("n_particles", 1.5), "n_particles"), Mutation(("n_particles", "5"), "n_particles"),
    Mutation(("n_particles", True), "n_particles"), Mutation(("n_particles", float("nan")), "n_particles"),
    Mutation(("both", 1.0), "shot_noise"), Mutation(("n_particles", np.int64(7)), None),
]


def spectrum_oracle(a, b, box, bins, window):
    """Shell means of ``V/N^2 Re(DFT a conj(DFT b)) / W^2`` over the full complex DFT,
    with the binning the docstrings describe: (edges, k mean, modes, power per batch)."""
    shape = a.shape[-3:]
    cells = math.prod(shape)
    a_k = torch.fft.fftn(a.to(torch.float64), dim=(-3, -2, -1))
    b_k = torch.fft.fftn(b.to(torch.float64), dim=(-3, -2, -1))
    product = (a_k * b_k.conj()).real * math.prod(box) / cells**2
    frequencies = [torch.fft.fftfreq(n, dtype=torch.float64) for n in shape]
    k = torch.sqrt(sum((2 * math.pi * f * n / L).reshape([-1 if i == d else 1 for i in range(3)]) ** 2
                       for d, (f, n, L) in enumerate(zip(frequencies, shape, box))))
    if window is not None:
        p = order_value(window)
        w = 1.0
        for d, f in enumerate(frequencies):
            w = w * torch.from_numpy(np.sinc(f.numpy())).reshape([-1 if i == d else 1 for i in range(3)]) ** p
        product = product / w**2
    k_fundamental = min(2 * math.pi / L for L in box)
    if bins is None:
        k_nyquist = min(math.pi * n / L for n, L in zip(shape, box))
        count = max(1, int(math.floor(k_nyquist / k_fundamental - 0.5)))
        edges = [k_fundamental * (i + 0.5) for i in range(count + 1)]
    else:
        k_max = float(k.max())
        edges = torch.linspace(0.5 * k_fundamental, k_max * (1 + 1e-12), int(bins) + 1, dtype=torch.float64).tolist()
    rows = []
    for low, high in zip(edges[:-1], edges[1:]):
        shell = (k >= low) & (k < high) & (k > 0)
        if bool(shell.any()):
            rows.append((float(k[shell].mean()), int(shell.sum()), product[..., shell].mean(-1)))
    return rows


def spectra_example(case, data, forced):
    """power_spectrum, cross_power, correlation_coefficient and transfer_function against
    shell means of an independent full-DFT computation, or errors naming the argument."""
    import torchpm.analysis as analysis

    draw = data.draw
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    shape = tuple(draw(st.integers(2, 6)) for _ in range(3))
    batch = draw(st.sampled_from([(), (1,), (2,)]))
    field = draw(values_tensor((*batch, *shape), dtype, -1, 1, specials=SPECIALS if draw(st.booleans()) else ()))
    field = layout(draw, field, expandable_dims=(field.dim() - 1,))
    other = draw(values_tensor((*batch, *shape), dtype, -1, 1))
    function = draw(st.sampled_from(["power_spectrum", "cross_power", "correlation_coefficient", "transfer_function"]))
    box = draw(st.one_of(st.floats(1.0, 1000.0), st.tuples(*[st.floats(1.0, 1000.0)] * 3)))
    bins = draw(st.sampled_from([None, 1, 3, 7]))
    window = draw(st.sampled_from([None, "ngp", "cic", "tsc", "pcs", 2]))
    compensate = window in (None, "cic") and draw(st.booleans())
    noise = draw(st.sampled_from([None, ("shot_noise", 3.5), ("n_particles", 1000)])) \
        if function == "power_spectrum" else None
    arguments = dict(field=field, box_size=box, bins=bins, window=window, compensate_cic=compensate, noise=noise)
    from torchpm.mesh import LocalMesh

    arguments["mesh"] = LocalMesh(shape) if draw(st.booleans()) else None
    mutations = {"field": FIELD_MUTATIONS(field, "field"), "box_size": BOX_MUTATIONS, "bins": BINS_MUTATIONS,
                 "window": WINDOW_MUTATIONS, "compensate_cic": COMPENSATE_MUTATIONS,
                 "mesh": [Mutation("mesh", "mesh"), Mutation(42, "mesh"),
                          Mutation(LocalMesh(tuple(n + 1 for n in shape)), "field")]}
    if function == "power_spectrum":
        mutations["noise"] = NOISE_MUTATIONS
    if forced and forced[0] == "noise" and function != "power_spectrum":
        function = "power_spectrum"
        mutations["noise"] = NOISE_MUTATIONS
    target, mutation = choose(draw, mutations, forced)
    allowed = set()
    if target is not None:
        arguments[target] = mutation.value
        if mutation.error:
            allowed.add(mutation.error)
    if target in ("field", "mesh") and allowed:
        allowed |= {"field_a", "field_b", "reference"}
    if not bool(torch.isfinite(field).all()):  # whatever else is wrong, this may be named first
        allowed |= {"field", "field_a", "field_b"}
    options = dict(bins=arguments["bins"], window=arguments["window"], compensate_cic=arguments["compensate_cic"],
                   mesh=arguments["mesh"])
    if arguments["noise"] is not None:
        key, value = arguments["noise"]
        options.update({"shot_noise": value, "n_particles": 10} if key == "both" else {key: value})

    def call():
        f, b = arguments["field"], arguments["box_size"]
        if function == "power_spectrum":
            return analysis.power_spectrum(f, b, **options)
        try:
            return getattr(analysis, function)(f, other, b, **options)
        except ValueError as error:
            if "has no power in" not in str(error) or allowed:
                raise
            return error  # a ratio to a shell of zero power: checked against the oracle below

    def check(result):
        assert not allowed, f"accepted although an error naming {sorted(allowed)} was expected"
        box3 = analysis.as_box_size(arguments["box_size"])
        used_window = "cic" if compensate and window is None else window
        bins_value = None if arguments["bins"] is None else int(arguments["bins"])
        aa = spectrum_oracle(field, field, box3, bins_value, used_window)
        if function != "power_spectrum":
            bb = spectrum_oracle(other, other, box3, bins_value, used_window)
            ab = spectrum_oracle(field, other, box3, bins_value, used_window)
        if isinstance(result, ValueError):
            # Refused only where a denominator's shell has no power (to rounding) in the oracle.
            names = {"field_a": aa, "field_b": bb, "reference": bb}
            (name,) = [n for n in names if f"`{n}` has no power" in str(result)]
            autos = torch.stack([row[2] for row in names[name]], -1)
            assert bool((autos.abs() <= 1e-8 * float(autos.abs().max()) + 1e-300).any()), \
                f"refused although every shell of `{name}` has power: {result}"
            return
        shot, used_noise = 0.0, arguments["noise"]
        if used_noise is not None:
            shot = used_noise[1] if used_noise[0] == "shot_noise" else math.prod(box3) / int(used_noise[1])
        k_expected = torch.tensor([row[0] for row in aa], dtype=torch.float64)
        modes_expected = torch.tensor([row[1] for row in aa], dtype=torch.float64)
        expected = {
            "power_spectrum": lambda i: aa[i][2] - shot,
            "cross_power": lambda i: ab[i][2],
            "correlation_coefficient": lambda i: ab[i][2] / torch.sqrt(aa[i][2] * bb[i][2]),
            "transfer_function": lambda i: torch.sqrt(aa[i][2] / bb[i][2]),
        }[function]
        power = torch.stack([expected(i) for i in range(len(aa))], -1) if aa else torch.zeros(*batch, 0)
        assert torch.allclose(result.k, k_expected, rtol=1e-12, atol=0), "k of the bins"
        assert torch.equal(result.modes.to(torch.float64), modes_expected), "modes per bin"
        assert result.power.shape == power.shape, f"power shape {tuple(result.power.shape)} != {tuple(power.shape)}"
        if not power.numel():
            return
        compare = torch.ones_like(power, dtype=torch.bool)
        if function in ("correlation_coefficient", "transfer_function"):
            # Ratios of shell powers: only where both are well above rounding (a field that is
            # constant along an axis, from a stride-0 layout, has shells of zero power).
            autos = torch.stack([torch.stack([aa[i][2], bb[i][2]]) for i in range(len(aa))], -1)
            compare = (autos.abs() > 1e-8 * float(autos.abs().max())).all(0)
        scale = float(power[compare].abs().max()) if bool(compare.any()) else 0.0
        assert torch.allclose(result.power.to(torch.float64)[compare], power[compare], rtol=1e-9,
                              atol=1e-12 * scale), "power per bin"

    expect_outcome(call, allowed, check)


def paint_density_example(case, data, forced):
    """paint_density: rho / mean - 1 from the reference paint (and, interlaced, the
    phase-shifted average of two paints), or an error naming the argument."""
    import torchpm.analysis as analysis
    from torchpm.mesh import LocalMesh
    from torchpm.ops._reference import paint_reference

    draw = data.draw
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    shape = tuple(draw(st.integers(2, 5)) for _ in range(3))
    batch, count = draw(st.integers(1, 2)), draw(st.integers(0, 12))
    positions = draw(values_tensor((batch, count, 3), dtype, -2, max(shape) + 2,
                                   specials=SPECIALS if draw(st.booleans()) else ()))
    positions = layout(draw, positions, expandable_dims=(0, 1))
    weights = draw(values_tensor((batch, count), dtype, 0.1, 2.0)) if draw(st.booleans()) else None
    order = draw(st.sampled_from(["ngp", "cic", "tsc", "pcs"]))
    interlacing = draw(st.booleans())
    use_mesh = draw(st.booleans())
    arguments = dict(positions=positions, weights=weights, order=order, interlacing=interlacing,
                     shape=None if use_mesh else shape, mesh=LocalMesh(shape) if use_mesh else None)
    mutations = {
        "positions": [Mutation(positions.numpy(), "positions"), Mutation(positions.tolist(), "positions"),
                      Mutation(positions.to(torch.int64), "positions"), Mutation(positions[..., :2], "positions")],
        "weights": [Mutation(torch.ones(batch, count).tolist(), "weights"),
                    Mutation(torch.ones(batch, count, dtype=torch.int64), "weights"),
                    Mutation(torch.ones(batch, count + 1, dtype=dtype), "weights"),
                    Mutation(torch.zeros(batch, count, dtype=dtype), "weights"),
                    Mutation(torch.full((batch, count), float("nan"), dtype=dtype), "weights")],
        "order": ORDER_MUTATIONS,
        "interlacing": [Mutation("yes", "interlacing"), Mutation(1, "interlacing"), Mutation(None, "interlacing")],
        "shape": [Mutation((0, 4, 4), "shape"), Mutation("444", "shape"), Mutation((4.5, 4, 4), "shape")],
        "mesh": [Mutation("mesh", "mesh"), Mutation(42, "mesh")],
    }
    target, mutation = choose(draw, mutations, forced)
    allowed = set()
    if target is not None:
        arguments[target] = mutation.value
        if target in ("shape", "mesh"):  # the other one must be None for the mutation to matter
            arguments["mesh" if target == "shape" else "shape"] = None
        if mutation.error:
            allowed.add(mutation.error)
    order_used = arguments["order"]
    if not allowed:
        p = order_value(order_used)
        if position_error(positions, shape, (0, 0, 0), True, p):
            allowed.add("positions")
        if count == 0:
            allowed |= {"positions", "weights"}  # no particles: the overdensity is undefined

    def check(delta):
        assert not allowed, f"accepted although an error naming {sorted(allowed)} was expected"
        p = order_value(order_used)
        p64 = positions.to(torch.float64)
        w64 = None if weights is None else weights.to(torch.float64)
        total = float(count) if w64 is None else w64.sum(1)
        scale = (math.prod(shape) / torch.as_tensor(total, dtype=torch.float64)).reshape(-1, 1, 1, 1)
        rho = paint_reference(p64, w64, shape, (0, 0, 0), True, p)
        if interlacing:
            shifted = paint_reference(p64 + 0.5, w64, shape, (0, 0, 0), True, p)
            frequencies = [torch.fft.fftfreq(n, dtype=torch.float64) for n in shape]
            phase_arg = sum(math.pi * f.reshape([-1 if i == d else 1 for i in range(3)])
                            for d, f in enumerate(frequencies))
            combined = 0.5 * (torch.fft.fftn(rho, dim=(-3, -2, -1))
                              + torch.fft.fftn(shifted, dim=(-3, -2, -1)) * torch.exp(1j * phase_arg))
            # The real-to-complex transform keeps the real part of each Hermitian pair;
            # at even Nyquist planes the phase breaks the symmetry, so compare the real part.
            rho = torch.fft.ifftn(combined, dim=(-3, -2, -1)).real
        expected = rho * scale - 1.0
        tolerance = 1e-4 if dtype == torch.float32 else 1e-10
        assert delta.shape == expected.shape, f"shape {tuple(delta.shape)} != {tuple(expected.shape)}"
        if interlacing and any(n % 2 == 0 for n in shape):
            # Nyquist planes: rfft/irfft drop the imaginary part differently; compare the mean only.
            assert torch.allclose(delta.to(torch.float64).mean((-3, -2, -1)), expected.mean((-3, -2, -1)),
                                  atol=tolerance * float(scale.max())), "mean overdensity"
        else:
            assert torch.allclose(delta.to(torch.float64), expected, atol=tolerance * float(scale.max()),
                                  rtol=tolerance), "overdensity"

    expect_outcome(lambda: analysis.paint_density(
        arguments["positions"], arguments["mesh"], weights=arguments["weights"], order=arguments["order"],
        interlacing=arguments["interlacing"], shape=arguments["shape"]), allowed, check)


property_spectra = fuzz(40)(given(case=st.none(), data=st.data())(bind(spectra_example, None)))
property_paint_density = fuzz(40)(given(case=st.none(), data=st.data())(bind(paint_density_example, None)))


def property_spectra_every_wrong_argument():
    sweep(spectra_example, st.none(), dict(
        field=8, box_size=len(BOX_MUTATIONS), bins=len(BINS_MUTATIONS), window=len(WINDOW_MUTATIONS),
        compensate_cic=len(COMPENSATE_MUTATIONS), noise=len(NOISE_MUTATIONS), mesh=3))


def property_paint_density_every_wrong_argument():
    sweep(paint_density_example, st.none(), dict(
        positions=4, weights=5, order=len(ORDER_MUTATIONS), interlacing=3, shape=3, mesh=2))


def property_issue_cic_cases():
    """The cic_paint / cic_readout defects of issue 11, one by one (regressions): each is
    now the documented error naming the argument, and the NaN cases raise by default."""
    import torchpm

    x = torch.rand(1, 6, 3) * 4
    w = torch.ones(1, 6)
    mesh = torch.rand(1, 4, 4, 4)
    meta = torch.device("meta")
    cases = [
        (lambda: torchpm.cic_paint(x, w, (4, 4, 4), offset=(0.5, 0, 0)), TypeError, "offset"),
        (lambda: torchpm.cic_paint(x, w, (4.7, 4, 4)), TypeError, "shape"),
        (lambda: torchpm.cic_paint(x, w, (4, 4, 4), periodic="FFF"), TypeError, "periodic"),
        (lambda: torchpm.cic_paint(x, w.clone().fill_(float("nan")), (4, 4, 4)), ValueError, "weights"),
        (lambda: torchpm.cic_paint(x, w.clone().fill_(float("inf")), (4, 4, 4)), ValueError, "weights"),
        (lambda: torchpm.cic_readout(mesh.clone().fill_(float("nan")), x), ValueError, "mesh"),
        (lambda: torchpm.cic_paint(x.numpy(), w, (4, 4, 4)), TypeError, "positions"),
        (lambda: torchpm.cic_paint(x.tolist(), w, (4, 4, 4)), TypeError, "positions"),
        (lambda: torchpm.cic_readout(mesh, x.numpy()), TypeError, "positions"),
        (lambda: torchpm.cic_paint(x, w, (4, 4, 4), offset=0), TypeError, "offset"),
        (lambda: torchpm.cic_paint(x, w, (4, 4, 4), periodic=None), TypeError, "periodic"),
        (lambda: torchpm.cic_paint(x, w, (4, 4, 4), offset=(float("inf"), 0, 0)), TypeError, "offset"),
        (lambda: torchpm.cic_paint(x, w, (4, 4, 4), offset=(float("nan"), 0, 0)), TypeError, "offset"),
        (lambda: torchpm.cic_paint(x, w, (2**31,) * 3), ValueError, "shape"),
        (lambda: torchpm.cic_paint(x.to(meta, torch.float16), None, (4, 4, 4)), ValueError, "positions"),
        (lambda: torchpm.cic_readout(torch.empty(1, 4, 4, 0, device=meta), x.to(meta)), ValueError, "mesh"),
        (lambda: torchpm.cic_readout(torch.empty(4, 4, 4, device=meta), x.to(meta)), ValueError, "mesh"),
    ]
    for index, (call, exception, argument) in enumerate(cases):
        try:
            call()
        except exception as error:
            assert f"`{argument}`" in str(error), f"case {index}: {error}"
        else:
            raise AssertionError(f"case {index} ({argument}) was accepted")
    # The fixed cases still compute: check_finite=False propagates NaN instead of raising.
    assert torch.isnan(torchpm.cic_paint(x, w.clone().fill_(float("nan")), (4, 4, 4), check_finite=False)).any()


PROPERTIES = {name: obj for name, obj in dict(globals()).items() if name.startswith("property_")}


def run_properties(names_to_run, report_path):
    """Subprocess entry: run each property, write {name: None or the failure} to ``report_path``
    after each (so a crash still leaves the earlier reports)."""
    import torchpm  # noqa: F401

    torch.set_num_threads(1)
    report = {}
    for name in names_to_run:
        try:
            PROPERTIES[name]()
            report[name] = None
        except BaseException:  # noqa: BLE001 - reported to pytest
            report[name] = traceback.format_exc()[-6000:]
        with open(report_path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(report_path + ".tmp", report_path)


# ----------------------------------------------------------------------------
# Simulation's constructor (pure Python until the first forward: run in-process).

SIMULATION_KEYWORDS = {
    "a_end": "float", "cosmology": "object", "power_spectrum": "string", "lpt_order": "int",
    "lpt_normalisation": "string", "integrator": "string", "gradient": "string", "laplacian": "string",
    "force_correction": "object", "paint_order": "string", "window_compensation": "bool", "dtype": "object",
    "checkpoint": "bool", "adjoint": "bool", "grid": "object", "mesh": "object", "particle_capacity": "int",
    "memory_check": "string",
}
ANY_VALUE = st.one_of(
    st.sampled_from([None, True, False, 0, 1, 2, -1, 1.5, 2.0, float("nan"), float("inf"), "", "1", "abc", "float32",
                     "Planck15", "cic", "exact", "fastpm", "off", [1], (1, 2), {}, np.float64(0.5), np.int64(2),
                     np.bool_(True), torch.tensor(1.0), torch.float64, object()]),
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**40), 2**40), st.text(max_size=6),
)


def accepted_kind(kind, value) -> bool:
    """Whether an accepted ``value`` is of a kind the argument documents (no string read
    as a number, no bool as a number, no non-integer float as an int, nothing non-finite)."""
    is_bool = isinstance(value, (bool, np.bool_))
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if kind == "bool":
        return is_bool
    if is_bool:
        return False
    if kind == "string":
        return isinstance(value, str) or (value in (1, 2, 3, 4) and not isinstance(value, float))  # paint orders
    if isinstance(value, str):
        return False
    if kind == "int":
        return value is None or isinstance(value, (int, np.integer))
    if kind == "float":
        return isinstance(value, (int, float, np.integer, np.floating)) and 0 < float(value) <= 1
    return True


@settings(max_examples=150 * EXAMPLES, deadline=None, derandomize=PROFILE == "ci", database=None,
          suppress_health_check=list(HealthCheck))
@given(keyword=st.sampled_from(sorted(SIMULATION_KEYWORDS)), value=ANY_VALUE)
def test_simulation_keyword_arguments(keyword, value):
    """Any value of any keyword argument of Simulation either builds a simulation (and is
    of the documented kind) or raises ValueError/TypeError naming the keyword."""
    import torchpm

    try:
        torchpm.Simulation(n_particles=4, box_size=32.0, steps=2, **dict({"memory_check": "off"}, **{keyword: value}))
    except (ValueError, TypeError) as error:
        assert f"`{keyword}`" in str(error), f"{type(error).__name__} does not name `{keyword}`: {error}"
        return
    assert accepted_kind(SIMULATION_KEYWORDS[keyword], value), f"`{keyword}` accepted {value!r}"


# ----------------------------------------------------------------------------
# The pytest side: the op properties in one subprocess.

_REPORT: dict = {}


@pytest.fixture(scope="module")
def subprocess_report(tmp_path_factory):
    """Run the properties in a subprocess; after a crash, the one that crashed is reported
    as such and a new subprocess runs the rest."""
    if not _REPORT:
        folder = tmp_path_factory.mktemp("fuzz_ops")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(_HERE), _HERE,
                                                           os.environ.get("PYTHONPATH", "")]))
        remaining = list(PROPERTIES)
        while remaining:
            path = str(folder / f"report{len(PROPERTIES) - len(remaining)}.json")
            try:
                completed = subprocess.run([sys.executable, os.path.abspath(__file__), path, *remaining], env=env,
                                           capture_output=True, text=True, timeout=600 * EXAMPLES)
                tail = f"exit status {completed.returncode}\n{completed.stderr[-4000:]}"
            except subprocess.TimeoutExpired as expired:
                tail = f"timed out after {expired.timeout} s"
            report = json.load(open(path)) if os.path.exists(path) else {}
            _REPORT.update(report)
            remaining = [name for name in remaining if name not in report]
            if remaining:  # the first unreported one crashed (or hung) the subprocess
                _REPORT[remaining.pop(0)] = f"the subprocess crashed or hung in this property: {tail}"
    return _REPORT


@pytest.mark.parametrize("name", sorted(PROPERTIES))
def test_ops_fuzz(subprocess_report, name):
    if subprocess_report[name]:
        pytest.fail(subprocess_report[name], pytrace=False)


if __name__ == "__main__":
    run_properties(sys.argv[2:], sys.argv[1])
