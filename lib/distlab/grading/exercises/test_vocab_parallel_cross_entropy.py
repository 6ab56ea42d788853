"""Exercise vocab_parallel_cross_entropy(logits, targets, vocab_size, group=None) of lab 06.

Each rank of ``group`` holds the logits of its ``torch.tensor_split`` slice of a
vocabulary of ``vocab_size`` tokens (a column-parallel head's output); the function
returns the mean cross-entropy over the tokens, the same on every rank, equal to
``F.cross_entropy`` of the whole logits, without gathering them: all-reduces of one
number per token (the largest logit, with ReduceOp.MAX, for a stable exponent; the sum
of the exponentials; the target's logit, held by one rank and 0 on the others).
Backward gives each rank its slice of the full gradient, without a collective.

Tested at 1, 2, 3 and 4 ranks on a vocabulary of 53 tokens (prime: uneven at every
size) and 24 tokens whose targets include every shard's first and last token: logits
of a few units in float64, then logits near 1e4 in float32 (where exp overflows unless
the global max is subtracted first), then float32 logits of a few units with one of 200
(where any shift below the global max, such as the mean of the ranks' maxima, overflows);
the gradient of the logits; the collectives
CommLog saw; a group of ranks 0 and 2 of 3 and 4 (a rank outside it returns None at
once); logits of the wrong width (ValueError). One launch per case and size; every
check runs here. A wrong value is compared with what the usual mistakes give (a local
max, an unreduced sum, unmasked targets, V // t shards, a sum for a mean) so that the
message names the mistake.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close
from tp_cases import PAIR

NOTEBOOK = "06_tensor_parallel"
CORE = True  # one of its lab's core exercises (listed so in the lab and the README)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

V, N = 53, 24          # vocabulary (prime: uneven over 2, 3 and 4 ranks), tokens
SIZES, MULTI = (1, 2, 3, 4), (2, 3, 4)
TIMEOUT = 30
F64 = torch.float64
LARGE = 1e4            # the large case's logits: exp overflows in float32 (and float64)
PER_TOKEN_BYTES = 16   # the most one collective may move per token: two float64 numbers

WIDE = 200.0           # the wide case: one logit of 200 among logits of a few units

# The hint to open, by the words of the check that failed (1: which parts need the other
# ranks, 2: the shift of the exponent, 3: the target's logit, 4: the gradient through a
# sum over ranks, 5: the whole recipe, whose first step is the group and the width).
HINTS = {
    "test_the_loss_equals_cross_entropy_of_the_whole_logits": {
        "OWN largest logit": 2, "sum of the exponentials is this rank's only": 1,
        "target's logit was taken on EVERY rank": 3, "r * (vocab_size // t)": 3,
        "is the SUM over the tokens": 1, "per-token losses": 1, "raised ValueError": 5,
        "does not hold gives an index outside": 3, "F.cross_entropy of the whole logits": 1},
    "test_logits_near_1e4_do_not_overflow": {"Overflow": 2, "OWN largest logit": 2,
                                             "F.cross_entropy of the whole logits": 2},
    "test_one_wide_logit_does_not_overflow": {"below the largest logit": 2,
                                              "F.cross_entropy of the whole logits": 2},
    "test_the_gradient_is_this_ranks_slice_of_the_full_one": {
        "does not depend on the logits": 4, "inside autograd's graph": 2,
        "times too large": 4, "gradient of this rank's logits": 4, "got no gradient": 4},
    "test_all_reduces_of_one_number_per_token_nothing_backward": {
        "more than two numbers per token": 1, "all-reduces (MAX": 1, "collectives": 1,
        "not the group's": 5, "backward made": 4},
    "test_a_group_of_two_ranks": {"deadlock with group": 5, "not in the group": 5,
                                  "OWN largest logit": 2, "target's logit": 3,
                                  "F.cross_entropy of the whole logits": 1},
    "test_a_rank_outside_the_group_returns_none_at_once": {"outside the group": 5},
    "test_logits_of_the_wrong_width_raise_value_error": {"ValueError": 5},
}


def spans(size):
    """(start, length) of each rank's tokens: torch.tensor_split's rule."""
    sizes = [len(p) for p in torch.arange(V).tensor_split(size)]
    return [(sum(sizes[:r]), n) for r, n in enumerate(sizes)]


def data(case):
    """The whole logits (N, V) and the targets (N,): the same on every rank and here.
    The first targets are every shard's first and last token at 2, 3 and 4 ranks."""
    g = torch.Generator().manual_seed(625 if case == "large" else 25)
    if case == "large":
        logits = (LARGE + 3 * torch.randn(N, V, generator=g, dtype=F64)).float()
    else:
        logits = 3 * torch.randn(N, V, generator=g, dtype=F64)
    if case == "wide":               # on the last rank's tokens at every size
        logits = logits.float()
        logits[1, V - 1] = WIDE
    targets = torch.randint(0, V, (N,), generator=g)
    edges = sorted({i for size in MULTI for s, n in spans(size) for i in (s, s + n - 1)})
    targets[:len(edges)] = torch.tensor(edges)
    return logits, targets


# ----------------------------------------------------------------- inside the ranks


def _plain(t):
    return t.detach().clone() if isinstance(t, torch.Tensor) else None


def rank_case(fn, case):
    """Run the student's function on this rank's slice of ``case``'s logits, forward and
    backward; return what happened as plain data. Its exceptions stop the launch."""
    group = dist.new_group(list(PAIR)) if case == "pair" else None
    logits, targets = data("small" if case == "pair" else case)
    grank = dist.get_rank(group)
    if grank < 0:  # not a member of the group: anything may come in, nothing may happen
        mine, before = logits[:, :5].clone().requires_grad_(), logits[:, :5].clone()
        with CommLog() as log:
            out = fn(mine, targets, V, group)
        return dict(member=False, returned=type(out).__name__, calls=log.records(),
                    unchanged=bool(torch.equal(mine.detach(), before)))
    shard = logits.tensor_split(dist.get_world_size(group), -1)[grank]
    mine, before, tgt = shard.clone().requires_grad_(), shard.clone(), targets.clone()
    with CommLog() as fwd:
        loss = fn(mine, tgt, V, group) if case == "pair" else fn(mine, tgt, V)
    r = dict(member=True, returned=type(loss).__name__, loss=_plain(loss), forward=fwd.records(),
             backward=[], grad=None, requires_grad=bool(getattr(loss, "requires_grad", False)),
             unchanged=bool(torch.equal(mine.detach(), before) and torch.equal(tgt, targets)))
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        with CommLog() as bwd:
            loss.backward()
        r.update(backward=bwd.records(), grad=_plain(mine.grad))
    return r


def rank_wrong_width(fn):
    """Every rank passes one logit column too many."""
    logits, targets = data("small")
    shard = logits.tensor_split(dist.get_world_size(), -1)[dist.get_rank()]
    out = fn(torch.cat([shard, shard[:, :1]], -1), targets, V)
    return type(out).__name__


# --------------------------------------------------------------- in the test process

_runs = {}


def run(fn, size, case):
    """Every rank's findings for ``case`` at ``size`` ranks. The first call for a size
    runs all of its cases, one launch each, while those ranks are warm (the tests go
    through the sizes once per aspect; a new size costs new ranks)."""
    key = (repr(fn), size)  # the student's function comes as a reference
    if key not in _runs:
        _runs[key] = {c: _launch(fn, size, c)
                      for c in ("small", "large", "wide", "pair")[:3 + (size >= 3)]}
    found = _runs[key][case]
    if isinstance(found, Exception):
        raise found
    return found


def _launch(fn, size, case):
    """One case's launch; an exception is kept, with advice where it is typical."""
    try:
        return launch.run(rank_case, size, fn, case, backend="gloo", timeout=TIMEOUT)
    except launch.LaunchTimeout as exc:
        waits = "; ".join(f"rank {r} {w}" for r, w in sorted(exc.where.items()))
        if case != "pair":
            return exc
        return AssertionError(
            f"deadlock with group = ranks {list(PAIR)} of {size}: no answer within {TIMEOUT} s "
            f"({waits}). Pass group=group to every collective, and on a rank outside the group "
            f"return None before any collective")
    except launch.RankError as exc:
        if case == "pair" and exc.rank not in PAIR:
            return AssertionError(
                f"rank {exc.rank}, which is not in the group of ranks {list(PAIR)}, raised "
                f"{exc.exc_type}: {exc.message}. On a rank outside the group, "
                f"dist.get_rank(group) is -1: return None at once")
        if exc.exc_type == "ValueError":
            start, n = spans(size if case != "pair" else len(PAIR))[
                exc.rank if case != "pair" else PAIR.index(exc.rank)]
            return AssertionError(
                f"rank {exc.rank} of {size}: raised ValueError ({exc.message}) for logits of the "
                f"right width: this rank holds {n} of the {V} tokens ({start}..{start + n - 1}); "
                f"the shards are torch.tensor_split's (tp.shard_sizes(vocab_size, t)): the first "
                f"vocab_size % t ranks hold one token more than vocab_size // t")
        if "out of bounds" in exc.message or "out of range" in exc.message:
            return AssertionError(
                f"rank {exc.rank} of {size}: {exc.exc_type}: {exc.message}. A target this rank "
                f"does not hold gives an index outside its slice of the logits: mask it (local "
                f"index = target - start of this rank's tokens; outside 0..n-1 use any valid "
                f"index and make the contribution 0 before the sum)")
        return exc
    except launch.LaunchError as exc:
        return exc


def members(case, out):
    """(rank, group size, rank in group, finding) of every member of the case's group."""
    for rank, found in enumerate(out):
        if case != "pair":
            yield rank, len(out), rank, found
        elif rank in PAIR:
            yield rank, len(PAIR), PAIR.index(rank), found


def where(case, rank, size, gsize, grank):
    start, n = spans(gsize)[grank]
    split = "+".join(str(m) for _, m in spans(gsize))
    group = f", group = ranks {list(PAIR)}" if case == "pair" else ""
    logits = {"large": "logits near 1e4, float32",
              "wide": f"float32 logits of a few units and one of {WIDE:g}"}.get(
        case, "logits of a few units, float64")
    return (f"rank {rank} of {size}{group} ({logits}; {V} tokens split {split}: this rank "
            f"holds tokens {start}..{start + n - 1})")


def close(a, b, rtol=1e-6, atol=1e-6):
    return a is not None and b is not None and a.shape == b.shape and \
        bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol))


def reference(case):
    """The loss per token, the mean, and the gradient of the mean, from the whole logits
    (float64, autograd)."""
    logits, targets = data(case)
    z = logits.double().requires_grad_()
    per_token = F.cross_entropy(z, targets, reduction="none")
    per_token.mean().backward()
    return per_token.detach(), per_token.detach().mean(), z.grad


def mistakes(case, gsize):
    """(message, value on each rank of the group) of the usual wrong answers, computed
    here from the whole logits in float64."""
    logits, y = data(case)
    z = logits.double()
    shards, places = z.tensor_split(gsize, -1), spans(gsize)
    peak = z.amax(-1, keepdim=True)
    lse = z.logsumexp(-1)
    target = z.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    right = (lse - target).mean()
    owner = torch.tensor([next(r for r, (s, n) in enumerate(places) if s <= int(t) < s + n)
                          for t in y])
    found = []

    def same(value):
        return [value] * gsize

    if gsize > 1:
        local = torch.stack([s.amax(-1) for s in shards], -1)              # (N, t)
        sum_exp = sum(torch.exp(s - local[:, r:r + 1]).sum(-1) for r, s in enumerate(shards))
        picked = target - local.gather(-1, owner.unsqueeze(-1)).squeeze(-1)
        found.append((
            "each rank subtracted its OWN largest logit: the exponentials of different ranks "
            "then have different shifts, and their sum is not exp(z) summed times one factor, "
            "so the log-sum-exp is wrong. All-reduce the max with op=dist.ReduceOp.MAX first "
            "and subtract that one global max on every rank",
            same((sum_exp.log() - picked).mean())))
        found.append((
            "the sum of the exponentials is this rank's only (the loss differs from rank to "
            "rank): all-reduce it (a sum) over the group before the log",
            [(s.logsumexp(-1) - target).mean() for s in shards]))

        def picked_with(starts, widths, index_when_outside=None, clamp=False):
            """The summed target logits (shifted by the global max) when rank r takes its
            tokens to be starts[r].. (widths[r] of them); ``clamp``: every rank's value at
            the clamped index; ``index_when_outside``: that column's value where the
            target is not the rank's, not 0."""
            total = torch.zeros(N, dtype=F64)
            for r, (s, (_, n)) in enumerate(zip(shards, places)):
                loc = y - starts[r]
                inside = (loc >= 0) & (loc < widths[r])
                idx = loc if clamp else loc.masked_fill(~inside, index_when_outside or 0)
                val = s.gather(-1, idx.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) - peak[:, 0]
                unmasked = clamp or index_when_outside is not None
                total += val if unmasked else val.masked_fill(~inside, 0.0)
            return total

        starts = [s for s, _ in places]
        widths = [n for _, n in places]
        unmasked = ("the target's logit was taken on EVERY rank, also where the target is not "
                    "one of its tokens, and those wrong logits were summed in: on a rank that "
                    "does not hold the target (local index = target - start outside 0..n-1) "
                    "the contribution must be 0 before the all-reduce")
        for picked in (picked_with(starts, widths, clamp=True),
                       picked_with(starts, widths, index_when_outside=0)):
            found.append((unmasked, same((lse - peak[:, 0] - picked).mean())))
        q, sizes = V // gsize, "+".join(str(n) for n in widths)
        uneven = (f"the tokens of rank r were taken to start at r * (vocab_size // t) or r * "
                  f"(this rank's width), which is wrong when {V} does not divide by {gsize}: the "
                  f"shards are torch.tensor_split's ({sizes}), so rank r's first token is "
                  f"sum(sizes[:r]) (here {', '.join(str(s) for s in starts)}); "
                  f"tp.shard_sizes(vocab_size, t) gives the sizes")
        for guess_starts, guess_widths in (([r * q for r in range(gsize)], [q] * gsize),
                                           ([r * q for r in range(gsize)], widths),
                                           ([r * n for r, n in enumerate(widths)], widths)):
            if guess_starts != starts or guess_widths != widths:
                found.append((uneven, same((lse - peak[:, 0]
                                            - picked_with(guess_starts, guess_widths)).mean())))
    found.append(("the loss is the SUM over the tokens; return the mean, as F.cross_entropy "
                  "does", same(N * right)))
    return found


def check_loss(case, out):
    """Every member's loss against F.cross_entropy of the whole logits, naming the
    mistake where a usual one gives the value found."""
    per_token, right, _ = reference(case)
    tol = dict(rtol=1e-5, atol=1e-5) if case in ("large", "wide") else dict(rtol=1e-9, atol=1e-9)
    for rank, gsize, grank, found in members(case, out):
        what = where(case, rank, len(out), gsize, grank)
        loss = found["loss"]
        assert loss is not None, (f"{what}: returned {found['returned']}; a member of the group "
                                  f"returns the mean loss, a 0-d tensor")
        if loss.dim() != 0:
            if close(loss.flatten(), per_token, **tol):
                raise AssertionError(f"{what}: returned the {N} per-token losses; return their "
                                     f"mean (a 0-d tensor), as F.cross_entropy does")
            raise AssertionError(f"{what}: returned a tensor of shape {tuple(loss.shape)}; return "
                                 f"the mean loss, a 0-d tensor")
        if not torch.isfinite(loss):
            if case == "large":
                raise AssertionError(
                    f"{what}: the loss is {float(loss)}. Overflow: subtract the global max "
                    f"before exp. exp of a logit near 1e4 is inf (float32's exp overflows past "
                    f"88.7, float64's past 709); with m the largest logit of the whole "
                    f"vocabulary (each rank's max, all-reduced with op=dist.ReduceOp.MAX), "
                    f"log sum exp(z - m) - (z_target - m) is the loss and no exponent is above 0")
            if case == "wide":
                raise AssertionError(
                    f"{what}: the loss is {float(loss)} where F.cross_entropy gives "
                    f"{float(right):.6g}: the shift of the exponent is below the largest logit "
                    f"of the whole vocabulary (a mean or sum of the ranks' maxima?), so "
                    f"exp({WIDE:g} - shift) overflows float32 (past 88.7). Shift by the largest "
                    f"logit itself: each rank's max, all-reduced with op=dist.ReduceOp.MAX")
            raise AssertionError(f"{what}: the loss is {float(loss)}, not a finite number")
        if close(loss, right, **tol):
            continue
        for message, values in mistakes(case, gsize):
            if close(loss, values[grank], **tol):
                raise AssertionError(f"{what}: the loss is {float(loss):.6g}, not "
                                     f"{float(right):.6g}: {message}")
        raise AssertionError(f"{what}: the loss is {float(loss):.6g}, but F.cross_entropy of the "
                             f"whole logits gives {float(right):.6g}")
    for rank, _, _, found in members(case, out):
        assert found["unchanged"], (f"rank {rank} of {len(out)}: the logits or the targets passed "
                                    f"in were changed; work on new tensors (no in-place edits)")


def check_gradient(case, out):
    """Every member's gradient of its logits against its slice of the full gradient."""
    _, right, full = reference(case)
    for rank, gsize, grank, found in members(case, out):
        what = where(case, rank, len(out), gsize, grank)
        want = full.tensor_split(gsize, -1)[grank]
        if found["loss"] is None or found["loss"].numel() != 1:
            raise AssertionError(f"{what}: returned {found['returned']}, not one number to "
                                 f"back-propagate (a 0-d tensor)")
        if not found["requires_grad"]:
            raise AssertionError(f"{what}: the loss does not depend on the logits for autograd "
                                 f"(it was built from .detach()-ed tensors, .item() or under "
                                 f"no_grad); only the max may be detached")
        grad = found["grad"]
        assert grad is not None, f"{what}: the logits got no gradient"
        if close(grad, want, rtol=1e-6, atol=1e-9):
            continue
        shard = data(case)[0].double().tensor_split(gsize, -1)[grank]
        at_max = torch.zeros_like(shard, dtype=torch.bool).scatter_(
            -1, shard.argmax(-1, keepdim=True), True)
        finite = bool(torch.isfinite(grad).all())
        off = ~torch.isfinite(grad) | ((grad.double() - want).abs() > 1e-9)
        if close(found["loss"], right) and gsize > 1 and (
                not finite or bool((off & ~at_max).sum() == 0)):
            raise AssertionError(
                f"{what}: the loss is right but its gradient is "
                + ("nan in places" if not finite else "wrong at this rank's largest logits")
                + ": the max went through dist.all_reduce inside autograd's graph, and "
                  "dist.all_reduce has no gradient. Take the max of logits.detach(): the loss "
                  "does not depend on the shift, so the max needs no gradient")
        assert finite, (f"{what}: the gradient of the logits holds "
                        f"{int((~torch.isfinite(grad)).sum())} nan or inf of {grad.numel()}")
        if gsize > 1 and close(grad, gsize * want, rtol=1e-6, atol=1e-9):
            raise AssertionError(
                f"{what}: the gradient is {gsize} times too large: the sums' backward must be the "
                f"identity (Megatron's g, your ReduceFromGroup): every rank already holds the "
                f"whole loss, so its gradient must not be summed over the group again")
        expect_close(grad.double(), want, f"{what}: the gradient of this rank's logits "
                     f"(softmax - one_hot of the target, divided by {N}, on this rank's tokens)",
                     rtol=1e-6, atol=1e-9)


def check_communication(case, out):
    """Forward: all-reduces only, of at most two numbers per token each, over the group;
    at most four. Backward: nothing. Self-reported (CommLog only): the whole logits are
    10 KB, so even gathering them stays near the wire's slack and its headers (wire.py)."""
    for rank, gsize, grank, found in members(case, out):
        what = where(case, rank, len(out), gsize, grank)
        forward = CommLog.from_records(found["forward"]).events
        calls = [(e.op, e.nbytes) for e in forward]
        big = [c for c in calls if c[1] > PER_TOKEN_BYTES * N]
        assert not big, (
            f"{what}: forward made {big}: more than two numbers per token. The loss needs no "
            f"logits from the other ranks, only all-reduces of one number per token (the max, "
            f"the sum of the exponentials, the target's logit): gathering b*s*V logits is "
            f"what this method avoids")
        others = [c for c in calls if c[0] != "all_reduce"]
        assert not others, (f"{what}: forward made {others}; all-reduces (MAX for the max, sums "
                            f"for the rest) are all it needs")
        assert 1 <= len(calls) <= 4, (
            f"{what}: forward made {len(calls)} collectives ({calls}); three all-reduces of one "
            f"number per token suffice (the max, the sum of the exponentials, the target's logit)")
        wrong_group = [e.group_size for e in forward if e.group_size != gsize]
        assert not wrong_group, (f"{what}: a collective ran over {wrong_group[0]} ranks, not the "
                                 f"group's {gsize}: pass group=group to every collective")
        back = [(e.op, e.nbytes) for e in CommLog.from_records(found["backward"]).events]
        assert not back, (f"{what}: backward made {back}; it needs no communication: each rank's "
                          f"gradient is softmax - one_hot on its own tokens, from the global sums "
                          f"forward already computed (the sums' backward is the identity)")


def check_outside(case, out):
    for rank, found in enumerate(out):
        if rank in PAIR:
            continue
        what = f"rank {rank} of {len(out)}, not in the group of ranks {list(PAIR)}"
        assert found["returned"] == "NoneType", (
            f"{what}: returned {found['returned']}; on a rank outside the group "
            f"(dist.get_rank(group) is -1 there) return None at once")
        calls = [e.op for e in CommLog.from_records(found["calls"]).events]
        assert not calls, (f"{what}: made {calls}; a rank outside the group makes no call (test "
                           f"dist.get_rank(group) < 0 first, and return None)")
        assert found["unchanged"], f"{what}: changed the logits passed in; leave them alone"


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("size", SIZES)
def test_the_loss_equals_cross_entropy_of_the_whole_logits(student, size):
    check_loss("small", run(student.vocab_parallel_cross_entropy, size, "small"))


@pytest.mark.parametrize("size", SIZES)
def test_logits_near_1e4_do_not_overflow(student, size):
    check_loss("large", run(student.vocab_parallel_cross_entropy, size, "large"))


@pytest.mark.parametrize("size", SIZES)
def test_one_wide_logit_does_not_overflow(student, size):
    check_loss("wide", run(student.vocab_parallel_cross_entropy, size, "wide"))


@pytest.mark.parametrize("size", SIZES)
def test_the_gradient_is_this_ranks_slice_of_the_full_one(student, size):
    check_gradient("small", run(student.vocab_parallel_cross_entropy, size, "small"))


@pytest.mark.parametrize("size", MULTI)
def test_all_reduces_of_one_number_per_token_nothing_backward(student, size):
    check_communication("small", run(student.vocab_parallel_cross_entropy, size, "small"))


@pytest.mark.parametrize("size", [3, 4])
def test_a_group_of_two_ranks(student, size):
    out = run(student.vocab_parallel_cross_entropy, size, "pair")
    check_loss("pair", out)
    check_gradient("pair", out)


@pytest.mark.parametrize("size", [3, 4])
def test_a_rank_outside_the_group_returns_none_at_once(student, size):
    check_outside("pair", run(student.vocab_parallel_cross_entropy, size, "pair"))


def test_logits_of_the_wrong_width_raise_value_error(student):
    widths = "+".join(str(n) for _, n in spans(3))
    what = (f"at 3 ranks ({V} tokens split {widths}), every rank passed one logit more than its "
            f"share")
    try:
        returned = launch.run(rank_wrong_width, 3, student.vocab_parallel_cross_entropy,
                              backend="gloo", timeout=TIMEOUT)
    except launch.RankError as exc:
        assert exc.exc_type == "ValueError", (
            f"{what}: rank {exc.rank} raised {exc.exc_type} ({exc.message}); check the width "
            f"against this rank's share of vocab_size first, and raise ValueError saying both")
        return
    except launch.LaunchTimeout:
        raise AssertionError(f"{what}: no answer within {TIMEOUT} s; check the width before any "
                             f"collective and raise ValueError") from None
    raise AssertionError(f"{what}: it returned {returned[0]}; it should raise ValueError saying "
                         f"which width was expected")
