"""Exercise ring_attention(q, k, v, seq_len, group=None, *, causal=False,
layout="contiguous") of lab 10.

Each rank holds its tokens of one sequence (``distlab.cp.layout.shard``); the answer is
its rows of ``F.scaled_dot_product_attention`` on the whole sequence, and backward its
rows of the whole sequence's dq, dk, dv. One launch per world size (1 to 4) runs every
case (both layouts, causal and not, fp64, a length that is not a multiple of 2W, and
one fp32 case) and returns plain data: outputs, gradients, the CommLog records of
forward and of backward, and which of the caller's tensors (q, k, v, the output's
gradient) a phase changed. The expected values are computed here, in fp64, from the whole
sequence. Launches of their own (a wrong answer there could hang or abort the ranks, and
would take the other cases with it): bad inputs; a wrong length; a subgroup (global ranks
1, 2, 3 of 4, rank 0 outside); bf16 on CPU, per world size.

Traffic: the CommLog says who sent what to whom (self-reported); the bytes counted on
the wire during each launch (:mod:`distlab.grading.wire`) bound the whole by what the
ring sends forward plus backward's allowance, so a second trip or extra copies show. An
all-gather of every block costs gloo exactly what the ring's W-1 steps cost, so only the
CommLog tells the ring's shape.
"""
import functools
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import launch
from distlab.collectives.p2p_check import nccl_deadlock
from distlab.comm import COLLECTIVES, CommLog, SENDS
from distlab.cp.layout import positions, shard
from distlab.grading import expect_close, wire
import lab10_cases

NOTEBOOK = "10_long_context_experts"
CORE = True  # one of its lab's core exercises (listed so in the lab and the README)
# the hint to open (1: the partial softmax; 2: the merge; 3: the mask and the skipped
# blocks; 4: backward; 5: a ring step)
HINTS = {"test_an_even_split": 4,
         "test_no_nan_where_a_block_is_masked": 2,
         "test_the_output_is_whole_sequence_attention": 3,
         "test_the_gradients_are_whole_sequence_gradients": 4,
         "test_forward_sends_each_block_once_around_the_ring": 5,
         "test_backward_stays_on_the_ring": 4,
         "test_would_not_hang_on_nccl": 5,
         "test_bad_inputs_raise_before_any_communication": 5,
         "test_a_wrong_length_raises_before_any_communication": 3,
         "test_the_ring_runs_over_the_ranks_of_group": 5,
         "test_the_inputs_are_left_as_they_were": 2,
         "test_bf16_accumulates_in_fp32_on_cpu": 2}
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

WORLDS = (1, 2, 3, 4)
B, H, D = 2, 2, 3
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}  # the goals, far above rounding


def cases(world):
    """(layout, causal, dtype, seq_len): 4W+1 tokens, never a multiple of 2W."""
    n = 4 * world + 1
    return [(layout, causal, torch.float64, n) for layout in ("contiguous", "zigzag")
            for causal in (False, True)] + [("zigzag", True, torch.float32, n + 2)]


def whole(seq_len, dtype, seed=0):
    """q, k, v and the output's gradient of the whole sequence."""
    g = torch.Generator().manual_seed(seed + seq_len)
    return [torch.randn(B, H, seq_len, D, generator=g, dtype=torch.float64).to(dtype)
            for _ in range(4)]


def describe(layout, causal, dtype, seq_len, world):
    return (f"{'causal' if causal else 'full'} attention, {layout} layout, {seq_len} tokens "
            f"on {world} ranks, {str(dtype).removeprefix('torch.')}")


# ---------------------------------------------------------------------- in the ranks


INPUTS = ("q", "k", "v", "do (the output's gradient given to backward)")


def changed(before, now):
    """The names of the caller's tensors ``now`` that differ from their copies ``before``
    (values, shape or dtype)."""
    return [name for name, a, b in zip(INPUTS, before, now)
            if not (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.detach()))]


def run_cases(fn):
    world, rank = dist.get_world_size(), dist.get_rank()
    found = []
    for layout, causal, dtype, seq_len in cases(world):
        q, k, v, do = (shard(t, world, rank, layout) for t in whole(seq_len, dtype))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        before = [t.detach().clone() for t in (q, k, v, do)]
        with CommLog() as forward:
            try:
                out = fn(q, k, v, seq_len, None, causal=causal, layout=layout)
            except NotImplementedError:
                raise
            except Exception as exc:
                found.append({"raised": f"forward raised {type(exc).__name__}: {exc}"})
                continue
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            found.append({"raised": f"returned {type(out).__name__} of shape "
                                    f"{tuple(getattr(out, 'shape', ()))}; expected a tensor "
                                    f"shaped like q, {tuple(q.shape)}"})
            continue
        entry = {"out": out.detach(), "forward": forward.records(),
                 "changed": {"forward": changed(before, (q, k, v, do))}}
        with CommLog() as backward:
            try:
                out.backward(do)
            except Exception as exc:
                entry["backward raised"] = f"{type(exc).__name__}: {exc}"
        entry["changed"]["backward"] = [name for name in changed(before, (q, k, v, do))
                                        if name not in entry["changed"]["forward"]]
        found.append({**entry, "grads": [t.grad for t in (q, k, v)],
                      "backward": backward.records()})
    return found


def run_errors(fn):
    """Bad inputs, the same on every rank: each must raise ValueError before any call."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = 4 * world + 1
    q = shard(whole(n, torch.float64)[0], world, rank, "contiguous")
    return raised_before_any_call(fn, {
        "q one token short of this rank's share": (q[:, :, 1:], q, q, n, "contiguous"),
        "k and v not shaped like q": (q, q[:, :1], q[:, :1], n, "contiguous"),
        "an unknown layout": (q, q, q, n, "striped")})


WRONG_LENGTH = ("q, k and v alike, (B, H, T_r, D), but T_r one token short of this rank's "
                "share of seq_len (a check that q, k and v agree is not enough: T_r must be "
                "positions(seq_len, W, r, layout).numel())")


def run_wrong_length(fn):
    """q, k and v of one shape, each one token short of this rank's share, on every rank:
    shorter, so that an answer which goes on into the ring sends less than its peer
    expects (gloo takes that; a longer message would abort the ranks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = 4 * world + 1
    q, k, v = (shard(t, world, rank, "contiguous")[:, :, 1:] for t in whole(n, torch.float64)[:3])
    return raised_before_any_call(fn, {WRONG_LENGTH: (q, k, v, n, "contiguous")})


def raised_before_any_call(fn, bad):
    """{what: (the exception's name or "returned", communication calls made)}."""
    found = {}
    for what, (a, b, c, seq_len, layout) in bad.items():
        with CommLog() as log:
            try:
                fn(a, b, c, seq_len, None, causal=True, layout=layout)
                found[what] = ("returned", len(log.records()))
            except Exception as exc:
                found[what] = (type(exc).__name__, len(log.records()))
    return found


# ----------------------------------------------------------------- in the test process

_outcomes = lab10_cases.Outcomes(run_cases)


def outcome(student, world):
    return _outcomes(student, "ring_attention", world)


def expected(layout, causal, dtype, seq_len, world, rank):
    q, k, v, do = (t.double().requires_grad_(i < 3)
                   for i, t in enumerate(whole(seq_len, dtype)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(do)
    return [shard(t, world, rank, layout).to(dtype) for t in (out.detach(), q.grad, k.grad, v.grad)]


def each_case(runs, world, backward=False):
    """Every (rank, case); with ``backward``, a backward that raised fails here."""
    for rank in range(world):
        for case, found in zip(cases(world), runs[rank]):
            what = f"rank {rank}, {describe(*case, world)}"
            assert "raised" not in found, f"{what}: ring_attention {found['raised']}"
            if backward and "backward raised" in found:
                right = torch.allclose(found["out"].double(),
                                       expected(*case, world, rank)[0].double(), rtol=0,
                                       atol=TOLERANCE[case[2]])
                raise AssertionError(
                    f"{what}: backward raised {found['backward raised']}"
                    + (" (the forward is right: does each backward step use the K/V block it "
                       "holds at that step?)" if right else ""))
            yield rank, case, found, what


def kv_bytes(seq_len, world, rank, layout, element_size):
    """Bytes of rank ``rank``'s K and V."""
    return 2 * B * H * D * element_size * positions(seq_len, world, rank, layout).numel()


def ring_peers(world, rank, members=None):
    """The global ranks ``rank`` receives from and sends to on the ring of ``members``
    (global ranks; all ``world`` of them by default)."""
    members = list(range(world)) if members is None else list(members)
    i = members.index(rank)
    return members[(i - 1) % len(members)], members[(i + 1) % len(members)]


def on_the_ring(found, phase, rank, world, what, members=None):
    """The CommLog of ``phase``, after checking it holds only sends to the next rank and
    receives from the previous one (global ranks; of ``members`` when given)."""
    prev, nxt = ring_peers(world, rank, members)
    which = "ring_neighbours" if members is None else "ring_neighbours(group), global ranks"
    log = CommLog.from_records(found[phase], rank)
    collectives = [e.op for e in log.select(COLLECTIVES)]
    assert not collectives, f"{what}: {phase} called {collectives}; point to point only"
    for e in log.select():
        right = nxt if e.op in SENDS else prev
        assert e.peer == right, (
            f"{what}: {phase}'s {e.describe()}: in the ring rank {rank} sends only to rank "
            f"{nxt} and receives only from rank {prev} ({which})")
    return log


def even_split(fn):
    """Three ranks, 12 tokens: every block has the same shape, so a backward that uses
    the wrong block computes (wrong) numbers instead of failing on a shape."""
    world, rank = dist.get_world_size(), dist.get_rank()
    found = []
    for layout, causal in (("contiguous", True), ("zigzag", True), ("zigzag", False)):
        q, k, v, do = (shard(t, world, rank, layout) for t in whole(12, torch.float64))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(q, k, v, 12, None, causal=causal, layout=layout)
        out.backward(do)
        found.append((layout, causal, out.detach(), [t.grad for t in (q, k, v)]))
    return found


def assert_finite(what, tensors):
    """The output and the gradients (where there are any) hold no NaN or inf."""
    for name, t in zip(("output", "q.grad", "k.grad", "v.grad"), tensors):
        if t is None and name != "output":
            continue                       # no gradient at all: the gradients' test says so
        assert torch.isfinite(t).all(), (
            f"{what}: the {name} holds NaN or inf; a block (or a row of one) whose every "
            f"score is masked must add nothing, not exp(-inf - (-inf))")


def test_an_even_split(student):
    world = 3
    runs = launch.run(even_split, world, student.ring_attention, backend="gloo",
                      timeout=lab10_cases.TIMEOUT)
    for rank, per in enumerate(runs):
        for layout, causal, out, grads in per:
            what = f"rank {rank}, {describe(layout, causal, torch.float64, 12, world)}"
            want = expected(layout, causal, torch.float64, 12, world, rank)
            if causal:
                assert_finite(what, [out, *grads])
            expect_close(out, want[0], f"{what}: the output", rtol=0, atol=1e-12)
            for name, got, ref in zip(("dq", "dk", "dv"), grads, want[1:]):
                assert got is not None, f"{what}: {name[1]}.grad is None after backward"
                expect_close(got, ref, f"{what}: {name} (the forward is right: does each backward "
                             f"step use the K/V block it holds at that step, and does each "
                             f"block's dK/dV reach its owner?)", rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS[1:])
def test_no_nan_where_a_block_is_masked(student, world):
    """Causal, contiguous: rank 0's queries see none of the later ranks' keys, and in the
    zigzag layout many rows see none of a block's keys."""
    for rank, (layout, causal, dtype, n), found, what in each_case(outcome(student, world), world):
        if causal:
            assert_finite(what, [found["out"], *found["grads"]])


@pytest.mark.parametrize("world", WORLDS)
def test_the_output_is_whole_sequence_attention(student, world):
    for rank, case, found, what in each_case(outcome(student, world), world):
        want = expected(*case, world, rank)[0]
        tol = TOLERANCE[case[2]]
        expect_close(found["out"], want, f"{what}: this rank's rows of the output (against "
                     f"scaled_dot_product_attention on the whole sequence)", rtol=0, atol=tol)


@pytest.mark.parametrize("world", WORLDS)
def test_the_gradients_are_whole_sequence_gradients(student, world):
    for rank, case, found, what in each_case(outcome(student, world), world, backward=True):
        want = expected(*case, world, rank)
        out_right = torch.allclose(found["out"].double(), want[0].double(), rtol=0,
                                   atol=TOLERANCE[case[2]])
        for name, got, ref in zip(("dq", "dk", "dv"), found["grads"], want[1:]):
            if got is None:
                raise AssertionError(f"{what}: {name[1]}.grad is None after backward: the "
                                     f"output must be differentiable in q, k and v")
            note = (" (the forward is right: does each backward step use the K/V block it "
                    "holds at that step, and does each block's dK/dV reach its owner?)"
                    if out_right and name != "dq" else "")
            expect_close(got, ref, f"{what}: this rank's rows of {name}{note}", rtol=0,
                         atol=TOLERANCE[case[2]])


def test_the_inputs_are_left_as_they_were(student):
    """Every case at every world size: q, k, v after forward, and they and the output's
    gradient after backward, equal (bit for bit) copies taken before the call."""
    for world in WORLDS:
        for rank, case, found, what in each_case(outcome(student, world), world):
            for phase in ("forward", "backward"):
                touched = found["changed"][phase]
                assert not touched, (
                    f"{what}: {'ring_attention' if phase == 'forward' else 'backward'} changed "
                    f"the caller's {' and '.join(touched)} (compared with a copy taken before "
                    f"the call). The inputs are read, never written: q.to(torch.float32) "
                    f"returns q itself when q is already float32 (float64 likewise), so an "
                    f"in-place op on what it returns (q.mul_(scale), *=, masked_fill_) writes "
                    f"the caller's tensor. Scale a copy (q * scale) or the scores instead")


BF16_STEP = 2.0 ** -8   # one bf16 step at a value's binade (8 significant bits)
BF16_TOKENS = 33   # odd, so the zigzag split is uneven at every W of 1 to 4 (issue 51)


@functools.lru_cache(maxsize=None)
def bf16_reference(seq_len):
    """The output and q, k, v's gradients of fp64 attention on the whole sequence's inputs
    rounded to bf16 (causal)."""
    whole_bf16 = [t.to(torch.bfloat16).double() for t in whole(seq_len, torch.float64)]
    q, k, v, do = (t.requires_grad_(i < 3) for i, t in enumerate(whole_bf16))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def within_a_bf16_step(got, seq_len, world, where):
    """``got[rank]``: (output, dq, dk, dv) in float32 of zigzag, causal ring attention in
    bf16; each within one bf16 step at that tensor's largest value of fp64 attention."""
    for name, ref, *mine in zip(("output", "dq", "dk", "dv"), bf16_reference(seq_len), *got):
        bound = BF16_STEP * ref.abs().max().item()
        for rank in range(world):
            want = shard(ref, world, rank, "zigzag")
            err = (mine[rank].double() - want).abs().max().item()
            assert err <= bound, (
                f"rank {rank}, {where}: the {name} is off by {err:.3g} from fp64 attention "
                f"on the same bf16 inputs, more than one bf16 step at its largest value "
                f"({bound:.3g}): accumulate in fp32 and round to bf16 once, at the end")


def in_bf16(fn, seq_len):
    """Causal, zigzag, on the CPU in bf16: (output, dq, dk, dv) in float32, or what went
    wrong."""
    world, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, do = (shard(t, world, rank, "zigzag").to(torch.bfloat16)
                   for t in whole(seq_len, torch.float64))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    try:
        out = fn(q, k, v, seq_len, None, causal=True, layout="zigzag")
    except NotImplementedError:
        raise
    except Exception as exc:
        return f"ring_attention raised {type(exc).__name__}: {exc}"
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
        return (f"ring_attention returned {type(out).__name__} of shape "
                f"{tuple(getattr(out, 'shape', ()))} and dtype {getattr(out, 'dtype', None)}; "
                f"expected one shaped and typed like q, {tuple(q.shape)}, torch.bfloat16 (the "
                f"softmax accumulates in fp32; the output is rounded to q's dtype once, at "
                f"the end)")
    try:
        out.backward(do)
    except Exception as exc:
        return f"backward raised {type(exc).__name__}: {exc}"
    if any(t.grad is None for t in (q, k, v)):
        return "a gradient of q, k or v is None after backward"
    return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("world", WORLDS)
def test_bf16_accumulates_in_fp32_on_cpu(student, world):
    """bf16 on CPU, zigzag and causal, BF16_TOKENS tokens: the GPU test's bound. Measured
    (2026-12-07, this seed, W = 1 to 4): the solution (fp32 throughout, rounded once) used
    0.62 of it; an answer computing in bf16 (acc = q.dtype) missed it 3.7 to 5.5 times,
    one keeping only the running output and log-sum-exp in bf16 2.3 to 7.3 times. Over 8
    seeds and 17 to 129 tokens the solution stayed under 0.94 of it; from 33 tokens on,
    those answers missed it at least 2.6 and 1.6 times. The length hardly matters beyond
    that: a row's log-sum-exp, about log n, rounded to bf16 is off by up to half a step
    (2^-7 between 2 and 4, 2^-6 from 4 to 8), which exp turns into weights off by 0.8 and
    1.6 %, against a bound of 0.4 % of the largest value."""
    got = launch.run(in_bf16, world, student.ring_attention, BF16_TOKENS, backend="gloo",
                     timeout=lab10_cases.TIMEOUT)
    where = f"bf16 on CPU, causal, zigzag, {BF16_TOKENS} tokens on {world} rank(s)"
    for rank, found in enumerate(got):
        assert not isinstance(found, str), f"rank {rank}, {where}: {found}"
    within_a_bf16_step(got, BF16_TOKENS, world, where)


@pytest.mark.parametrize("world", WORLDS)
def test_forward_sends_each_block_once_around_the_ring(student, world):
    """Forward: point to point only, to the next rank and from the previous one; the
    bytes sent are the K and V of every rank but the next one, each once."""
    runs = outcome(student, world)
    expected_wire = 0
    for rank, case, found, what in each_case(runs, world):
        layout, causal, dtype, n = case
        es = torch.empty((), dtype=dtype).element_size()
        nxt = (rank + 1) % world
        log = on_the_ring(found, "forward", rank, world, what)
        want = sum(kv_bytes(n, world, r, layout, es) for r in range(world) if r != nxt) \
            if world > 1 else 0
        sent = log.nbytes(SENDS)
        assert sent == want, (
            f"{what}: forward sent {sent} bytes, expected {want}: the K and V of every rank "
            f"but the next one ({world - 1} blocks), each once")
        expected_wire += want + backward_limit(n, world, rank, layout, dtype)
    wire.at_most(_outcomes.reading[world], expected_wire,
                 f"ring_attention on {world} ranks, all cases, forward and backward (a ring "
                 f"moves W-1 K/V blocks forward per rank)")


def backward_limit(n, world, rank, layout, dtype):
    """What a rank's backward may send: forward's blocks once more, and one dK/dV of
    every block (accumulated in fp64 at most)."""
    if world == 1:
        return 0
    nxt = (rank + 1) % world
    es = torch.empty((), dtype=dtype).element_size()
    return (sum(kv_bytes(n, world, r, layout, 8) for r in range(world))
            + sum(kv_bytes(n, world, r, layout, es) for r in range(world) if r != nxt))


@pytest.mark.parametrize("world", WORLDS[1:])
def test_backward_stays_on_the_ring(student, world):
    for rank, (layout, causal, dtype, n), found, what in each_case(outcome(student, world), world,
                                                                   backward=True):
        log = on_the_ring(found, "backward", rank, world, what)
        limit = backward_limit(n, world, rank, layout, dtype)
        assert log.nbytes(SENDS) <= limit, (
            f"{what}: backward sent {log.nbytes(SENDS)} bytes, more than {limit}: forward's "
            f"blocks once more and one dK/dV of every block")


def test_would_not_hang_on_nccl(student):
    for world in WORLDS[1:]:
        runs = outcome(student, world)
        for i, case in enumerate(cases(world)):
            for phase in ("forward", "backward"):
                logs = [runs[r][i].get(phase) for r in range(world)]
                if any(log is None for log in logs):
                    continue
                problem = nccl_deadlock(logs)
                assert problem is None, (f"{describe(*case, world)}, {phase}: runs on gloo, "
                                         f"but on GPUs it would not: {problem}")


def test_bad_inputs_raise_before_any_communication(student):
    lab10_cases.check_errors(student, "ring_attention", run_errors, "a q one token short, k and "
                             "v shaped unlike q, an unknown layout")


def test_a_wrong_length_raises_before_any_communication(student):
    """q, k and v agree with each other, but not with seq_len: ValueError before any call."""
    lab10_cases.check_errors(student, "ring_attention", run_wrong_length,
                             "q, k and v alike but one token short of this rank's share")


SUBGROUP, SUB_WORLD = (1, 2, 3), 4   # group ranks 0, 1, 2 are global ranks 1, 2, 3; 0 is outside


def sub_cases():
    """19 tokens: an uneven split, and one at which no member's share of the group's split
    (7, 6, 6 tokens) is its share of the world's (5, 5, 5, 4), in either layout, so an
    answer that splits by the world raises at its own check rather than entering a ring
    its peers never join (with 4W+1 = 13, global rank 3 holds 4 zigzag tokens of both)."""
    n = 19
    return [("contiguous", True, torch.float64, n), ("zigzag", True, torch.float64, n),
            ("zigzag", False, torch.float64, n)]


def on_a_subgroup(fn):
    """Members: every case of ``sub_cases`` on the group, as in ``run_cases``. The rank
    outside: one call with tensors shaped like group rank 0's (a share of neither the
    group's nor the world's split), and what it did, the calls it made, and whether its
    tensors were left alone."""
    rank = dist.get_rank()
    group = dist.new_group(list(SUBGROUP))
    members = len(SUBGROUP)
    if rank not in SUBGROUP:
        layout, causal, dtype, n = sub_cases()[0]
        q, k, v = (shard(t, members, 0, layout) for t in whole(n, dtype)[:3])
        before = [t.clone() for t in (q, k, v)]
        with CommLog() as log:
            try:
                out = fn(q, k, v, n, group, causal=causal, layout=layout)
                did = f"returned {type(out).__name__}"
            except NotImplementedError:
                raise
            except Exception as exc:
                did = f"raised {type(exc).__name__}: {exc}"
        return {"outside": (did, len(log.records()), changed(before, (q, k, v)))}
    me = SUBGROUP.index(rank)
    found = []
    for layout, causal, dtype, n in sub_cases():
        q, k, v, do = (shard(t, members, me, layout) for t in whole(n, dtype))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with CommLog() as forward:
            try:
                out = fn(q, k, v, n, group, causal=causal, layout=layout)
                if not isinstance(out, torch.Tensor) or out.shape != q.shape:
                    raise TypeError(f"it returned {type(out).__name__} of shape "
                                    f"{tuple(getattr(out, 'shape', ()))}; expected a tensor "
                                    f"shaped like q, {tuple(q.shape)}")
            except NotImplementedError:
                raise
            except Exception as exc:
                found.append({"raised": f"forward raised {type(exc).__name__}: {exc}"})
                continue
        with CommLog() as backward:
            try:
                out.backward(do)
            except Exception as exc:
                found.append({"raised": f"backward raised {type(exc).__name__}: {exc}"})
                continue
        found.append({"out": out.detach(), "grads": [t.grad for t in (q, k, v)],
                      "forward": forward.records(), "backward": backward.records()})
    return {"cases": found}


def test_the_ring_runs_over_the_ranks_of_group(student):
    """group=dist.new_group([1, 2, 3]) of 4 ranks: W is the group's size (3), r the rank in
    it, the ring 1 -> 2 -> 3 -> 1 in global ranks; the answers, the forward's bytes and
    NCCL's rules as on the default group. Rank 0, outside, makes no call and returns None
    at once."""
    on = f"group=dist.new_group({list(SUBGROUP)}) of {SUB_WORLD} ranks"
    try:
        with wire.measure(SUB_WORLD) as reading:
            runs = launch.run(on_a_subgroup, SUB_WORLD, student.ring_attention, backend="gloo",
                              timeout=30)
    except launch.LaunchTimeout:
        pytest.fail(f"with {on} the ranks did not finish within 30 s: a rank waited for a "
                    f"peer that never came. The ring runs over the ranks of group: W is "
                    f"dist.get_world_size(group), r is dist.get_rank(group), the peers are "
                    f"ring_neighbours(group) (global ranks), and a rank outside the group "
                    f"returns at once")
    members = len(SUBGROUP)
    fix = (" The ring runs over the ranks of group: W is dist.get_world_size(group), r is "
           "dist.get_rank(group) (not the global rank), the peers are ring_neighbours(group)")
    logs, expected_wire = {}, 0
    for me, rank in enumerate(SUBGROUP):
        for case, found in zip(sub_cases(), runs[rank]["cases"]):
            layout, causal, dtype, n = case
            what = (f"rank {rank} (rank {me} of the group), {on}, "
                    f"{'causal' if causal else 'full'} attention, {layout} layout, {n} tokens")
            assert "raised" not in found, f"{what}: ring_attention's {found['raised']}.{fix}"
            want = expected(*case, members, me)
            expect_close(found["out"], want[0], f"{what}: this rank's rows of the output (group "
                         f"rank {me}'s tokens of the whole sequence).{fix}", rtol=0, atol=1e-12)
            for name, got, ref in zip(("dq", "dk", "dv"), found["grads"], want[1:]):
                assert got is not None, f"{what}: {name[1]}.grad is None after backward"
                expect_close(got, ref, f"{what}: this rank's rows of {name}.{fix}", rtol=0,
                             atol=1e-12)
            for phase in ("forward", "backward"):
                on_the_ring(found, phase, rank, SUB_WORLD, what, SUBGROUP)
            sent = CommLog.from_records(found["forward"], rank).nbytes(SENDS)
            wanted = sum(kv_bytes(n, members, r, layout, 8) for r in range(members)
                         if r != (me + 1) % members)
            assert sent == wanted, (
                f"{what}: forward sent {sent} bytes, expected {wanted}: the K and V of every "
                f"rank of the group but the next one ({members - 1} blocks), each once.{fix}")
            logs.setdefault(case, {})[rank] = found
            expected_wire += wanted + backward_limit(n, members, me, layout, dtype)
    for case, per in logs.items():
        for phase in ("forward", "backward"):
            problem = nccl_deadlock([per[r][phase] if r in per else None
                                     for r in range(SUB_WORLD)])
            assert problem is None, (f"{on}, {describe(*case, members)}, {phase}: runs on "
                                     f"gloo, but on GPUs it would not: {problem}")
    wire.at_most(reading, expected_wire, f"ring_attention on {on}, all cases, forward and "
                 f"backward (a ring moves W-1 K/V blocks forward per rank)")
    outside = [r for r in range(SUB_WORLD) if r not in SUBGROUP]
    for rank in outside:
        did, calls, touched = runs[rank]["outside"]
        quiet = did == "returned NoneType"
        assert calls == 0 and quiet, (
            f"rank {rank} is not a member of {on}; ring_attention {did} after {calls} "
            f"communication call(s). A rank outside the group holds none of the sequence: it "
            f"makes no call and returns None at once (dist.get_rank(group) is -1 there)")
        assert not touched, (f"rank {rank}, outside {on}: ring_attention changed the caller's "
                             f"{' and '.join(touched)}; outside the group it touches nothing")


def on_gpus(fn, seq_len):
    world, rank = dist.get_world_size(), dist.get_rank()
    from distlab import backend

    dev = backend.device()
    q, k, v, do = (shard(t, world, rank, "zigzag").to(dev, torch.bfloat16)
                   for t in whole(seq_len, torch.float64))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, seq_len, None, causal=True, layout="zigzag")
    out.backward(do)
    return [t.float().cpu() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.multigpu
def test_on_gpus(student):
    """bf16 on 2 GPUs, zigzag and causal: every element of the output and of the gradients
    within one bf16 step at that tensor's largest value (2^-8 of it) of fp64 attention on
    the same bf16 inputs. The result is rounded to bf16 once, which alone is half a step.
    Measured on a CPU (2 gloo ranks, this shape, 2026-12-05): the library's ring used 0.5
    to 0.75 of this bound; against fp64 on the unrounded inputs even torch's own bf16 SDPA
    missed the issue's first goal, 1e-3·W of the largest value, by 3 to 5 times."""
    world, n = 2, 4099
    got = launch.run(on_gpus, world, student.ring_attention, n, backend="nccl", timeout=lab10_cases.TIMEOUT)
    within_a_bf16_step(got, n, world, "bf16 on GPUs")
