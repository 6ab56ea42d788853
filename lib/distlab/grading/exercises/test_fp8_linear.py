"""Exercise fp8_linear(x, weight, bias=None, group=None) of lab 10.

``x @ weight.T + bias`` whose three matmuls (forward, the input's gradient, the weight's
gradient) take FP8 operands, emulated: x and weight cast to e4m3, the output's gradient
to e5m2, each with one dynamic scale per tensor, ``max_f / amax``, dequantized and
multiplied in float32; the bias and its gradient stay float32. With ``group``, x's rows
(and so the gradient's) are split over the group's ranks, and the amax of each cast of
them is the whole tensor's (all-reduced with MAX), so that a sharded call gives, row for
row, bit for bit, what one process gives on the whole batch.

Probes make the casts visible exactly: with the identity as weight, the output is x as
e4m3 sees it and the input's gradient is the output's gradient as e5m2 sees it (a
product with 1 and 0 is exact); with the identity as input, the output is the weight as
e4m3 sees it. One launch per world size (1, and 2 with 25 rows split 13 + 12) computes every case, forward and
backward, and logs the collectives; one more runs the identity probe on the group of
global ranks 1 and 2 of 3, rank 0 in a group of its own with a louder probe. The expected
values are computed here, and a wrong value is compared with what the usual mistakes
give, so that the message names the mistake.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import launch
from distlab.comm import CommLog
from distlab.fp8.formats import sqnr

NOTEBOOK = "10_long_context_experts"
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAMES = {E4M3: "e4m3", E5M2: "e5m2"}
IN, OUT, ROWS = 64, 48, 25
SQNR_GOAL = 20.0   # dB, on the output and both gradients (torchao's float8 tests)
# A wrong cast moves most elements by a step of the FP8 grid (2^-3 or 2^-2 relative);
# float32 rounding moves an element by 2^-24. A right answer may differ where x·s fell
# within rounding of a tie between two FP8 values (vanishingly rare): so a cast is right
# when at most MISS_FRACTION of its elements are off by more than REL.
REL, MISS_FRACTION = 1e-5, 0.01
# The weight's gradient sums IN*ROWS products in float32: its rounding is far below
# 1e-5 of its norm, and FP8's error is above 1e-2 (an SQNR near 30 dB).
NORM_REL = 1e-5
WORLDS, MULTI = (1, 2), (2,)
TIMEOUT = 60
# the subgroup case: the identity probe's rows split over global ranks 1 and 2 of 3, while
# rank 0, alone in a group of its own, casts the same probe LOUDER times larger (a larger
# amax: reduced over the world instead of group, it changes the pair's scales)
PAIR, PAIR_WORLD, LOUDER = (1, 2), 3, 4.0

# The hint under the exercise a student failing each test opens (1: what backward
# keeps, 2: where a rank's scale differs from one process's, 3: a tensor of zeros,
# 4: the whole sequence).
HINTS = {
    "test_the_output_multiplies_the_e4m3_casts_of_x_and_weight": 4,
    "test_the_input_gradient_casts_the_output_gradient_to_e5m2": 1,
    "test_the_weight_gradient_multiplies_the_casts": 1,
    "test_the_bias_and_its_gradient_stay_float32": 4,
    "test_sqnr_against_the_float32_layer_is_at_least_20_db": 4,
    "test_all_zero_tensors_give_zeros_not_nan": 3,
    "test_a_sharded_call_equals_the_unsharded_one_bit_for_bit": 2,
    "test_one_max_all_reduce_of_one_number_per_sharded_cast": 2,
    "test_the_amax_is_reduced_over_group": 2,
    "test_the_output_is_float32": 4,
}


def data(case):
    """(x, weight, bias or None, output gradient) of ``case``, the same everywhere."""
    g = torch.Generator().manual_seed({"dense": 1, "identity": 2, "probe_w": 3,
                                       "zeros": 4, "rows": 5}[case])

    def randn(*shape, std=1.0):
        return std * torch.randn(*shape, generator=g)

    if case == "dense":      # a 3-D input: (batch, time, features)
        return randn(2, 12, IN), randn(OUT, IN, std=0.1), randn(OUT), randn(2, 12, OUT)
    if case == "rows":
        return randn(ROWS, IN), randn(OUT, IN, std=0.1), randn(OUT), randn(ROWS, OUT)
    if case == "identity":   # the output is x cast; the input's gradient is the gradient cast
        return randn(ROWS, IN, std=3.0), torch.eye(IN), None, randn(ROWS, IN, std=0.01)
    if case == "probe_w":    # the output is the weight cast, transposed
        return torch.eye(IN), randn(OUT, IN, std=0.1), None, randn(IN, OUT)
    return torch.zeros(6, IN), randn(OUT, IN, std=0.1), randn(OUT), torch.zeros(6, OUT)


SHARDED = ("identity", "rows")


# ----------------------------------------------------------------- inside the ranks


def rank_cases(fn):
    """Every case on this rank, forward and backward; at world size 1 the whole batch
    without a group, else this rank's rows with the default group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for case in (("dense", "identity", "probe_w", "zeros", "rows") if world == 1 else SHARDED):
        x, w, b, g = data(case)
        if world > 1:
            x, g = x.tensor_split(world)[rank], g.tensor_split(world)[rank]
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        b = b.clone().requires_grad_() if b is not None else None
        with CommLog() as fwd:
            y = fn(x, w, b) if world == 1 else fn(x, w, b, dist.group.WORLD)
        found = {"type": type(y).__name__, "y": None, "backward": [], "forward": fwd.records()}
        if isinstance(y, torch.Tensor):
            found.update(y=y.detach().clone(), requires_grad=y.requires_grad)
            if y.requires_grad and y.shape == g.shape:
                with CommLog() as bwd:
                    y.backward(g)
                found["backward"] = bwd.records()
        for name, t in (("grad_x", x), ("grad_w", w), ("grad_b", b)):
            found[name] = t.grad.clone() if t is not None and t.grad is not None else None
        out[case] = found
    return out


def pair_case(fn):
    """The identity probe, forward and backward: on PAIR, this rank's rows with their group;
    on rank 0, in a group of its own, the whole probe times LOUDER."""
    rank = dist.get_rank()
    pair, alone = dist.new_group(list(PAIR)), dist.new_group([0])   # every rank makes both
    x, w, _, g = data("identity")
    if rank in PAIR:
        me = PAIR.index(rank)
        x, g = x.tensor_split(len(PAIR))[me], g.tensor_split(len(PAIR))[me]
    else:
        x, g = LOUDER * x, LOUDER * g
    x = x.clone().requires_grad_()
    y = fn(x, w, None, pair if rank in PAIR else alone)
    if not isinstance(y, torch.Tensor):
        return {"type": type(y).__name__, "y": None, "grad_x": None}
    y.backward(g)
    return {"type": type(y).__name__, "y": y.detach().clone(), "grad_x": x.grad}


# --------------------------------------------------------------- in the test process

_runs = {}


def run(student, world):
    if world not in _runs:
        try:
            _runs[world] = launch.run(rank_cases, world, student.fp8_linear, backend="gloo",
                                      timeout=TIMEOUT)
        except launch.LaunchError as exc:
            _runs[world] = exc
    if isinstance(_runs[world], Exception):
        raise _runs[world]
    return _runs[world]


def one(student, case):
    """The single-process run of ``case``."""
    found = run(student, 1)[0][case]
    assert isinstance(found["y"], torch.Tensor), (
        f"{case} case: fp8_linear returned {found['type']}, not a tensor")
    return found


def rt(t, dtype, scaled=True):
    """``t`` as ``dtype`` sees it, by the contract: one scale max/amax (float32), the
    cast saturated, back in float32. ``scaled=False``: cast without any scale."""
    t = t.float()
    top = torch.finfo(dtype).max
    scale = top / t.abs().amax().clamp(min=1e-12) if scaled else torch.tensor(1.0)
    return (t * scale).clamp(-top, top).to(dtype).float() / scale


def misses(a, b):
    """The fraction of elements of ``a`` more than REL (relative) away from ``b``."""
    if a is None or a.shape != b.shape:
        return 1.0
    a, b = a.double(), b.double()
    return float(((a - b).abs() > REL * b.abs() + 1e-30).double().mean())


def check_cast(got, t, dtype, what, role):
    """``got`` must be ``t`` as ``dtype`` sees it (:func:`rt`); else name the mistake."""
    assert got is not None, f"{what}: no value (the tensor got no gradient)"
    assert got.shape == t.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(t.shape)}"
    assert bool(torch.isfinite(got).all()), f"{what}: holds nan or inf"
    if misses(got, rt(t, dtype)) <= MISS_FRACTION:
        return
    other = E5M2 if dtype == E4M3 else E4M3
    for wrong, why in (
            (t.float(), f"{role} was not cast at all: it is exactly the float32 input"),
            (rt(t, other), f"{role} was cast to {NAMES[other]}, not {NAMES[dtype]}"),
            (rt(t, dtype, scaled=False), f"{role} was cast to {NAMES[dtype]} WITHOUT a scale: "
             f"multiply by max/amax before the cast (amax = the largest |value| of the tensor) "
             f"and divide by it after, so that the tensor uses the format's whole range"),
            (t.float().to(torch.bfloat16).float(), f"{role} went through bfloat16, not "
             f"{NAMES[dtype]}")):
        if misses(got, wrong) <= MISS_FRACTION:
            raise AssertionError(f"{what}: {why}")
    share = misses(got, rt(t, dtype))
    raise AssertionError(f"{what}: {share:.0%} of the elements are not {role} as {NAMES[dtype]} "
                         f"sees it (scale = max/amax of the whole tensor, float32; the cast "
                         f"saturated at ±max; divided by the scale after)")


def test_the_output_multiplies_the_e4m3_casts_of_x_and_weight(student):
    x, _, _, _ = data("identity")
    check_cast(one(student, "identity")["y"], x, E4M3,
               "the output with the identity as weight (it is x as FP8 sees it)", "x")
    _, w, _, _ = data("probe_w")
    got = one(student, "probe_w")["y"]
    check_cast(None if got is None else got.t(), w, E4M3, "the output with the identity as "
               "input (it is the weight as FP8 sees it, transposed)", "the weight")


def test_the_input_gradient_casts_the_output_gradient_to_e5m2(student):
    found = one(student, "identity")
    assert found.get("requires_grad"), ("the output does not require a gradient: fp8_linear "
                                        "must be differentiable in x, weight and bias")
    _, _, _, g = data("identity")
    check_cast(found["grad_x"], g, E5M2, "x's gradient with the identity as weight (it is the "
               "output's gradient as FP8 sees it)", "the output's gradient")


def test_the_weight_gradient_multiplies_the_casts(student):
    x, w, _, g = data("dense")
    got = one(student, "dense")["grad_w"]
    assert got is not None, "the weight got no gradient"
    assert got.shape == w.shape, f"the weight's gradient has shape {tuple(got.shape)}, not {tuple(w.shape)}"
    flat_x, flat_g = x.reshape(-1, IN), g.reshape(-1, OUT)
    want = rt(flat_g, E5M2).t() @ rt(flat_x, E4M3)

    def near(ref):
        return float((got.double() - ref.double()).norm() / ref.double().norm()) <= NORM_REL

    if near(want):
        return
    for ref, why in ((flat_g.t() @ flat_x, "neither operand was cast"),
                     (rt(flat_g, E5M2).t() @ flat_x, "x entered it in float32: use x as e4m3 "
                      "sees it, the cast forward made"),
                     (flat_g.t() @ rt(flat_x, E4M3), "the output's gradient entered it in "
                      "float32: cast it to e5m2")):
        if near(ref):
            raise AssertionError(f"the weight's gradient (a (2, 12, {IN}) input): {why}")
    raise AssertionError(f"the weight's gradient (a (2, 12, {IN}) input) is not (gradient as "
                         f"e5m2)ᵀ · (x as e4m3), summed over every leading dimension")


def test_the_bias_and_its_gradient_stay_float32(student):
    x, w, b, g = data("dense")
    found = one(student, "dense")
    product = rt(x.reshape(-1, IN), E4M3) @ rt(w, E4M3).t()
    got = found["y"].reshape(-1, OUT) - product
    assert torch.allclose(got.double(), b.double().expand_as(got), rtol=1e-5, atol=1e-5), (
        "the output minus the product of the casts is not the bias (in float32): add the bias "
        "as it is, after the matmul")
    assert found["grad_b"] is not None, "the bias got no gradient"
    want = g.reshape(-1, OUT).sum(0)
    if not torch.allclose(found["grad_b"].double(), want.double(), rtol=1e-5, atol=1e-5):
        cast = rt(g.reshape(-1, OUT), E5M2).sum(0)
        why = (": it was summed from the gradient as e5m2 sees it; the bias's gradient is the "
               "float32 gradient summed" if torch.allclose(found["grad_b"], cast, rtol=1e-5,
                                                           atol=1e-5) else "")
        raise AssertionError(f"the bias's gradient is not the output's gradient summed over "
                             f"every row{why}")


def test_sqnr_against_the_float32_layer_is_at_least_20_db(student):
    x, w, b, g = (t.clone().requires_grad_() for t in data("dense"))
    y = F.linear(x, w, b)
    y.backward(g.detach())
    found = one(student, "dense")
    for name, got, want in (("the output", found["y"], y), ("x's gradient", found["grad_x"], x.grad),
                            ("the weight's gradient", found["grad_w"], w.grad)):
        assert got is not None and got.shape == want.shape, f"{name}: missing or of the wrong shape"
        db = sqnr(want, got)
        assert db >= SQNR_GOAL, (f"{name}: SQNR {db:.1f} dB against the float32 layer, below "
                                 f"{SQNR_GOAL:g} dB")


def test_all_zero_tensors_give_zeros_not_nan(student):
    _, _, b, _ = data("zeros")
    found = one(student, "zeros")
    for name in ("y", "grad_x", "grad_w", "grad_b"):
        t = found[name]
        assert t is not None, f"a zero input and a zero gradient: {name} is missing"
        assert bool(torch.isfinite(t).all()), (
            f"a zero input and a zero gradient: {name} holds nan or inf. The amax of a tensor "
            f"of zeros is 0, and max/0 is inf: keep the scale finite")
    assert torch.equal(found["y"], b.expand_as(found["y"])), "x of zeros: the output is not the bias"
    for name in ("grad_x", "grad_w", "grad_b"):
        assert not found[name].any(), f"a zero output gradient: {name} is not zero"


def local_rt(t, dtype, world, rank):
    return rt(t.tensor_split(world)[rank], dtype)


@pytest.mark.parametrize("world", MULTI)
def test_a_sharded_call_equals_the_unsharded_one_bit_for_bit(student, world):
    whole = {case: one(student, case) for case in SHARDED}
    ranks = run(student, world)
    for rank, found in enumerate(ranks):
        what = f"rank {rank} of {world} (rows {'+'.join(str(len(p)) for p in torch.arange(ROWS).tensor_split(world))})"
        for case in SHARDED:
            x, _, _, g = data(case)
            mine = found[case]
            assert isinstance(mine["y"], torch.Tensor), f"{what}: returned {mine['type']}"
            for name, t, dtype in (("y", x, E4M3), ("grad_x", g, E5M2)):
                got, want = mine[name], whole[case][name].tensor_split(world)[rank]
                label = "the output" if name == "y" else "x's gradient"
                assert got is not None, f"{what}, {case} case: {label} is missing"
                if torch.equal(got, want):
                    continue
                if case == "identity" and misses(got, local_rt(t, dtype, world, rank)) <= MISS_FRACTION:
                    role = "x" if name == "y" else "the output's gradient"
                    raise AssertionError(
                        f"{what}: {label} differs from the unsharded call's rows: {role} was "
                        f"scaled by the amax of this rank's rows only. Each rank must use the "
                        f"amax of the whole tensor: all-reduce it with MAX over group")
                if case == "rows" and torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                    continue  # the casts agree; the matmul of fewer rows may round differently
                raise AssertionError(f"{what}, {case} case: {label} differs from the rows of "
                                     f"the unsharded call (group=None on the whole batch)")
    for name, label in (("grad_w", "weight's"), ("grad_b", "bias's")):
        parts = [r["rows"][name] for r in ranks]
        assert all(p is not None for p in parts), f"at {world} ranks the {label} gradient is missing"
        total, want = torch.stack(parts).sum(0), whole["rows"][name]
        assert torch.allclose(total, want, rtol=1e-5, atol=1e-5), (
            f"at {world} ranks the {label} gradients, summed over the ranks, are not the "
            f"unsharded call's: each rank's is its own rows' contribution (the all-reduce of "
            f"data parallelism comes after, not inside fp8_linear)")


@pytest.mark.parametrize("world", WORLDS)
def test_one_max_all_reduce_of_one_number_per_sharded_cast(student, world):
    for rank, found in enumerate(run(student, world)):
        for case, mine in found.items():
            for when, records in (("forward", mine["forward"]), ("backward", mine["backward"])):
                calls = [(e.op, e.nbytes) for e in CommLog.from_records(records).events]
                what = f"rank {rank} of {world}, {case} case, {when}"
                if world == 1:
                    assert not calls, f"{what} (group=None): made {calls}; without a group, no collective"
                    continue
                assert calls == [("all_reduce", 4)], (
                    f"{what}: made {calls or 'no collective'}; exactly one all-reduce of one "
                    f"float32 (the amax of the row-sharded {'x' if when == 'forward' else 'gradient'}) "
                    f"is needed. The weight is the same on every rank: its amax needs none")


def test_the_amax_is_reduced_over_group(student):
    """The identity probe's rows split over the group of global ranks 1 and 2 of 3, bit
    for bit the unsharded call's rows, while rank 0, in a group of its own, casts a louder
    probe: the amax of x and of the output's gradient is the group's, not the world's."""
    on = f"group=dist.new_group({list(PAIR)}) of {PAIR_WORLD} ranks"
    whole = one(student, "identity")
    try:
        ranks = launch.run(pair_case, PAIR_WORLD, student.fp8_linear, backend="gloo",
                           timeout=TIMEOUT)
    except launch.LaunchTimeout:
        pytest.fail(f"with {on} (and rank 0 in a group of its own) the ranks did not finish "
                    f"within {TIMEOUT} s: all-reduce the amax over group (group=group)")
    x, _, _, g = data("identity")
    for me, rank in enumerate(PAIR):
        found = ranks[rank]
        what = f"rank {rank} (rank {me} of {on})"
        assert isinstance(found["y"], torch.Tensor), f"{what}: returned {found['type']}"
        for name, t in (("y", x), ("grad_x", g)):
            label, role = (("the output", "x") if name == "y"
                           else ("x's gradient", "the output's gradient"))
            got, want = found[name], whole[name].tensor_split(len(PAIR))[me]
            assert got is not None, f"{what}: {label} is missing"
            if torch.equal(got, want):
                continue
            world_amax = LOUDER * t.abs().amax()
            louder = rt(torch.cat([t.tensor_split(len(PAIR))[me].reshape(-1), world_amax[None]]),
                        E4M3 if name == "y" else E5M2)[:-1].reshape(got.shape)
            why = (f"{role} was scaled by the amax over every rank (rank 0, outside the group, "
                   f"holds a larger one): all-reduce the amax over group (group=group), the "
                   f"ranks whose rows make the tensor" if torch.equal(got, louder) else
                   f"each rank's casts must equal its rows of the unsharded call's (the amax "
                   f"all-reduced with MAX over group)")
            raise AssertionError(f"{what}: {label} differs from the rows of the unsharded call "
                                 f"(group=None on the whole probe): {why}")


def test_the_output_is_float32(student):
    found = one(student, "dense")
    x, w, _, _ = data("dense")
    want = (*x.shape[:-1], w.shape[0])
    assert tuple(found["y"].shape) == want and found["y"].dtype == torch.float32, (
        f"a {tuple(x.shape)} input through a {IN} → {OUT} layer returned a "
        f"{found['y'].dtype} tensor of shape {tuple(found['y'].shape)}; the contract's "
        f"output is float32 of shape {want}: multiply the casts read back in float32")
