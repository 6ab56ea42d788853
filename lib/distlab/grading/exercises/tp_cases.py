"""What lab 06's layer exercises (and the library's layers, in tests/test_tp.py) are
tested on, and the checks that turn a wrong answer into advice.

A float64 ``nn.Linear(7, 10)`` with a bias, whose shards are uneven over 3 and 4 ranks
(torch.tensor_split: 10 features are 4+3+3 and 3+3+2+2, 7 are 3+2+2 and 2+2+2+1), an
input of 3×5 tokens and an upstream gradient G: each rank's loss is ``sum(y * G)`` over
its output (its slice of G for a column-parallel layer without gather). One launch per
tensor-parallel size runs every case and returns plain data; the tests compare it here
with the full layer's output and gradients, computed by autograd in this process.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close

IN, OUT, BATCH, SEQ = 7, 10, 3, 5
SIZES = (1, 2, 3, 4)
PAIR = (0, 2)  # the subgroup of the group test
TIMEOUT = 30
F64 = torch.float64
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers


def reference(bias: bool = True):
    """The full layer, its input and the upstream gradient (the same on every rank)."""
    g = torch.Generator().manual_seed(6)
    weight, b = torch.randn(OUT, IN, generator=g, dtype=F64), torch.randn(OUT, generator=g, dtype=F64)
    x, up = (torch.randn(BATCH, SEQ, IN, generator=g, dtype=F64),
             torch.randn(BATCH, SEQ, OUT, generator=g, dtype=F64))
    linear = nn.Linear(IN, OUT, bias=bias, dtype=F64)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias:
            linear.bias.copy_(b)
    return linear, x, up


def cases(kind: str, size: int) -> list[str]:
    names = ["bias", "no bias"] + (["gather"] if kind == "column" else [])
    return names + (["pair"] if size >= 3 else []) + (
        ["gather pair"] if kind == "column" and size == 3 else [])


def grouped(case: str) -> bool:
    """The case runs on the group PAIR (the others on the default group)."""
    return case.endswith("pair")


def gathers(case: str) -> bool:
    """The case builds a ColumnParallelLinear with gather_output=True."""
    return case.startswith("gather")


# ----------------------------------------------------------------- inside the ranks


def _tensor(t):
    return t.detach().clone() if isinstance(t, torch.Tensor) else None


def rank_case(kind: str, cls, case: str, forward: bool = True):
    """Build the student's layer from the reference and, when ``forward``, run forward
    and backward; return what happened as plain data. An exception of the student's
    code stops the launch (the launcher reports it): catching it here would leave the
    other ranks waiting in a collective. The shards come from a launch without
    ``forward``, so that a broken forward does not hide them."""
    group = dist.new_group(list(PAIR)) if grouped(case) else None
    linear, x, up = reference(bias=case != "no bias")
    grank, gsize = dist.get_rank(group), dist.get_world_size(group)
    before = linear.weight.detach().clone()
    with CommLog() as build:
        layer = cls(linear, group, gather_output=gathers(case)) if kind == "column" \
            else cls(linear, group)
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    r = dict(weight=_tensor(weight), bias=_tensor(bias), build=build.records(),
             linear_unchanged=bool(torch.equal(linear.weight.detach(), before)),
             params=[(n, tuple(p.shape)) for n, p in layer.named_parameters()],
             weight_is_param=isinstance(weight, nn.Parameter),
             bias_is_param=bias is None or isinstance(bias, nn.Parameter))
    if not forward:
        return r
    xin = x if kind == "column" or grank < 0 else x.tensor_split(gsize, -1)[grank]
    xin = xin.clone().requires_grad_()
    with CommLog() as fwd:
        y = layer(xin)
    r.update(y=_tensor(y), y_type=type(y).__name__, backward=[], forward=fwd.records())
    if kind == "column" and not gathers(case) and grank >= 0:
        up = up.tensor_split(gsize, -1)[grank]
    if isinstance(y, torch.Tensor) and y.shape == up.shape and y.requires_grad and grank >= 0:
        with CommLog() as bwd:
            (y * up).sum().backward()
        r["backward"] = bwd.records()
    r.update(x_grad=_tensor(xin.grad), x_after=_tensor(xin),
             weight_grad=_tensor(getattr(weight, "grad", None)),
             bias_grad=_tensor(getattr(bias, "grad", None)))
    return r


# --------------------------------------------------------------- in the test process

_runs = {}


def run(kind: str, cls, size: int, case: str, forward: bool = True) -> list:
    """Every rank's findings for ``case`` at ``size`` ranks. The first call for a size
    runs all of its cases, one launch each, while those ranks are warm (the tests go
    through the sizes once per aspect; a new size costs new ranks)."""
    key = (kind, repr(cls), size)  # the student's class comes as a reference
    if key not in _runs:
        # "gather pair" is one launch: its shards are read from its forward's
        _runs[key] = {(c, fwd): _launch(kind, cls, size, c, fwd)
                      for c in cases(kind, size) for fwd in (False, True)
                      if fwd or c != "gather pair"}
    found = _runs[key][(case, forward)]
    if isinstance(found, Exception):
        raise found
    return found


def _launch(kind, cls, size, case, forward):
    """One case's launch; an exception is kept, with advice where it is typical."""
    try:
        return launch.run(rank_case, size, kind, cls, case, forward, backend="gloo",
                          timeout=TIMEOUT)
    except launch.LaunchTimeout as exc:
        if not grouped(case):
            return exc
        waits = "; ".join(f"rank {r} {w}" for r, w in sorted(exc.where.items()))
        return AssertionError(
            f"deadlock with group = ranks {list(PAIR)} of {size}: no answer within {TIMEOUT} s "
            f"({waits}). Pass group=group to every collective, and on a rank outside the group "
            f"return before any collective")
    except launch.RankError as exc:
        if grouped(case) and exc.rank not in PAIR:
            return AssertionError(
                f"rank {exc.rank}, which is not in the group of ranks {list(PAIR)}, raised "
                f"{exc.exc_type}: {exc.message}. On a rank outside the group, "
                f"dist.get_rank(group) is -1: keep no shard and return at once")
        if case == "gather pair":
            return AssertionError(
                f"rank {exc.rank} of {size}, gather_output=True on the group of ranks "
                f"{list(PAIR)}: {exc.exc_type}: {exc.message}. The whole output is gathered "
                f"over the group's ranks, each piece its shard: tp.shard_sizes(out_features, "
                f"dist.get_world_size(group))")
        return exc
    except launch.LaunchError as exc:
        return exc


def expected(kind: str, case: str, size: int, rank: int) -> dict:
    """What rank ``rank`` of ``size`` must hold, from the full layer run by autograd."""
    linear, x, up = reference(bias=case != "no bias")
    x = x.clone().requires_grad_()
    y = linear(x)
    (y * up).sum().backward()
    w, b = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    wg, bg = linear.weight.grad, None if linear.bias is None else linear.bias.grad
    if kind == "column":
        return dict(weight=w.tensor_split(size, 0)[rank], bias=None if b is None else b.tensor_split(size)[rank],
                    y=y.detach() if gathers(case) else y.detach().tensor_split(size, -1)[rank],
                    x_grad=x.grad, weight_grad=wg.tensor_split(size, 0)[rank],
                    bias_grad=None if bg is None else bg.tensor_split(size)[rank],
                    rows=_span(OUT, size, rank), x=x.detach(), up=up, w_full=w, b_full=b)
    return dict(weight=w.tensor_split(size, 1)[rank], bias=b, y=y.detach(),
                x_grad=x.grad.tensor_split(size, -1)[rank], weight_grad=wg.tensor_split(size, 1)[rank],
                bias_grad=bg, cols=_span(IN, size, rank), x=x.detach(), up=up, w_full=w, b_full=b)


def _span(n, size, rank):
    piece = torch.arange(n).tensor_split(size)[rank]
    return f"{int(piece[0])}..{int(piece[-1])}" if len(piece) else "none"


def members(case: str, out: list):
    """(rank, group size, rank in group, finding) of every member of the case's group."""
    for rank, found in enumerate(out):
        if not grouped(case):
            yield rank, len(out), rank, found
        elif rank in PAIR:
            yield rank, len(PAIR), PAIR.index(rank), found


def each(kind, case, out):
    """(what, group size, rank in group, finding, expected) of every member of the case."""
    for rank, gsize, grank, found in members(case, out):
        yield where(kind, case, rank, len(out)), gsize, grank, found, expected(kind, case, gsize, grank)


def where(kind, case, rank, size):
    group = f"group of ranks {list(PAIR)} of {size}" if grouped(case) else f"{size} ranks"
    bias = ", bias=False" if case == "no bias" else ""
    name = "ColumnParallelLinear" if kind == "column" else "RowParallelLinear"
    options = (", group" if grouped(case) else "") + (", gather_output=True" if gathers(case) else "")
    return f"{name}(nn.Linear({IN}, {OUT}{bias}){options}) on rank {rank}, {group}"


def allclose(a, b):
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b)


# --------------------------------------------------------------------------- the checks


def check_shards(kind, case, out):
    for what, gsize, grank, found, want in each(kind, case, out):
        axis = (f"rows {want['rows']} of linear.weight (torch.tensor_split(linear.weight, "
                f"{gsize}, dim=0)[{grank}]: PyTorch keeps the output features as rows)"
                if kind == "column" else
                f"columns {want['cols']} of linear.weight (torch.tensor_split(linear.weight, "
                f"{gsize}, dim=1)[{grank}]: the input features are columns)")
        assert found["weight"] is not None and found["weight_is_param"], (
            f"{what}: .weight must be an nn.Parameter holding {axis}")
        expect_close(found["weight"], want["weight"], f"{what}: .weight should be {axis}")
        if want["bias"] is None:
            assert found["bias"] is None, f"{what}: the linear has no bias, so .bias must be None"
        else:
            bias_what = (f"elements {want['rows']} of linear.bias, the same rows as the weight's "
                         f"shard" if kind == "column" else
                         "the whole linear.bias (it is added once, after the sum over the ranks)")
            assert found["bias"] is not None and found["bias_is_param"], (
                f"{what}: .bias must be an nn.Parameter holding {bias_what}")
            expect_close(found["bias"], want["bias"], f"{what}: .bias should be {bias_what}")
        held = sum(torch.Size(shape).numel() for _, shape in found["params"])
        shard = want["weight"].numel() + (0 if want["bias"] is None else want["bias"].numel())
        assert held == shard, (
            f"{what}: the layer's parameters hold {held} numbers ({[n for n, *_ in found['params']]}) "
            f"but its shard is {shard}: keep only this rank's shard as .weight and .bias (do not keep "
            f"the full nn.Linear as a submodule)")
        assert found["linear_unchanged"], (f"{what}: the nn.Linear passed in was modified; copy "
                                           f"your shard out of it (.detach() ... .clone())")


def check_output(kind, case, out):
    for what, gsize, grank, found, want in each(kind, case, out):
        y = found["y"]
        assert y is not None, f"{what}: forward returned {found['y_type']}, not a tensor"
        if kind == "column":
            if not gathers(case) and gsize > 1 and allclose(y, expected(kind, "gather", gsize, grank)["y"]):
                raise AssertionError(f"{what}: forward returned the whole output; without "
                                     f"gather_output each rank returns only its slice "
                                     f"(features {want['rows']})")
            expect_close(y, want["y"], f"{what}: the output (x @ weight.T + bias for this rank's "
                         f"features {want['rows']}" + (", all-gathered over the group in rank "
                                                       "order)" if gathers(case) else ")"))
            continue
        b = want["b_full"]
        partial = torch.nn.functional.linear(want["x"].tensor_split(gsize, -1)[grank], want["weight"], b)
        if gsize > 1 and b is not None and allclose(y, want["y"] + (gsize - 1) * b):
            raise AssertionError(f"{what}: the output holds the bias {gsize} times: every rank added "
                                 f"it before the all-reduce. Add it once, after the sum")
        if gsize > 1 and (allclose(y, partial) or allclose(y, partial - (b if b is not None else 0))):
            raise AssertionError(f"{what}: the output is this rank's partial product only: sum "
                                 f"x_r @ weight_r.T over the group with an all-reduce (Megatron's g)")
        expect_close(y, want["y"], f"{what}: the output (the full layer's, on every rank)")


def check_input_grad(kind, case, out):
    for what, gsize, grank, found, want in each(kind, case, out):
        g = found["x_grad"]
        assert g is not None, f"{what}: the input got no gradient; build the output from it"
        if kind == "column":
            up = want["up"].tensor_split(gsize, -1)[grank]
            local = up @ want["weight"]
            if gsize > 1 and allclose(g, local):
                raise AssertionError(
                    f"{what}: the input's gradient is only this rank's part (dy_r @ weight_r); in "
                    f"backward, all-reduce it over the group (Megatron's f: identity forward, "
                    f"all-reduce backward)")
            if gsize > 1 and allclose(g, gsize * want["x_grad"]):
                raise AssertionError(f"{what}: the input's gradient is {gsize} times too large: it was "
                                     f"summed more than once over the group")
            expect_close(g, want["x_grad"], f"{what}: the input's gradient (summed over the group)")
        else:
            if gsize > 1 and allclose(g, gsize * want["x_grad"]):
                raise AssertionError(
                    f"{what}: the gradient of the input slice is {gsize} times too large: g's "
                    f"backward is the identity (every rank already holds the whole output's "
                    f"gradient), so do not all-reduce it in backward")
            expect_close(g, want["x_grad"], f"{what}: the gradient of this rank's input slice")


def check_param_grads(kind, case, out):
    for what, gsize, grank, found, want in each(kind, case, out):
        assert found["weight_grad"] is not None, f"{what}: .weight got no gradient"
        expect_close(found["weight_grad"], want["weight_grad"], f"{what}: the gradient of .weight")
        if want["bias_grad"] is None:
            continue
        got = found["bias_grad"]
        assert got is not None, f"{what}: .bias got no gradient"
        if kind == "row" and gsize > 1 and allclose(got, want["bias_grad"] / gsize):
            raise AssertionError(f"{what}: the bias's gradient is 1/{gsize} of the full layer's: add "
                                 f"the whole bias once, after the all-reduce, not a share of it on "
                                 f"every rank before")
        expect_close(got, want["bias_grad"], f"{what}: the gradient of .bias")


def check_communication(kind, case, out):
    """Column: no collective forward (an all-gather with gather_output), one all-reduce
    of the input's size backward. Row: one all-reduce of the output forward, none
    backward. At one rank a layer may skip its collectives. Self-reported (CommLog
    only): a call here moves at most 1.2 KB, far inside the wire's slack (wire.py)."""
    elem = 8  # float64
    for what, gsize, grank, found, _ in each(kind, case, out):
        forward = CommLog.from_records(found["forward"]).events
        backward = CommLog.from_records(found.get("backward", [])).events
        fwd, bwd = [e.op for e in forward], [e.op for e in backward]
        if kind == "column":
            if gathers(case):
                assert set(fwd) <= {"all_gather", "all_gather_into_tensor"}, (
                    f"{what}: forward called {fwd}; with gather_output only an all-gather of the "
                    f"output slices is needed")
            else:
                assert not fwd, (f"{what}: forward called {fwd}; a column-parallel layer needs no "
                                 f"communication forward (each rank computes its features from the "
                                 f"full input)")
            step, calls, nbytes, of = "backward", backward, BATCH * SEQ * IN * elem, "input's gradient"
        else:
            assert not bwd, (f"{what}: backward called {bwd}; g's backward is the identity and needs "
                             f"no collective")
            step, calls, nbytes, of = "forward", forward, BATCH * SEQ * OUT * elem, "output"
        if gsize == 1 and not calls:
            continue
        ops = [e.op for e in calls]
        assert ops == ["all_reduce"] and calls[0].nbytes == nbytes, (
            f"{what}: {step} should make one all_reduce of the {of} ({nbytes} bytes: "
            f"{BATCH}x{SEQ}x{IN if kind == 'column' else OUT} float64), made "
            f"{[(e.op, e.nbytes) for e in calls]}")
        assert calls[0].group_size == gsize, (
            f"{what}: the all_reduce ran over {calls[0].group_size} ranks, not the layer's "
            f"group of {gsize}: pass group= to the collective")


def check_non_members(kind, case, out):
    """On a rank outside ``group`` the layer keeps no shard, returns None at once, makes
    no call and leaves its inputs (the nn.Linear and x) as they were."""
    x = reference()[1]
    for rank, found in enumerate(out):
        if rank in PAIR:
            continue
        what = where(kind, case, rank, len(out)) + " (not a member)"
        assert found["y_type"] == "NoneType", (
            f"{what}: forward returned {found['y_type']}; on a rank outside the group "
            f"(dist.get_rank(group) is -1 there) it returns None at once")
        calls = [e.op for e in CommLog.from_records(found["build"] + found["forward"]).events]
        assert not calls, (f"{what}: made {calls}; a rank outside the group makes no call "
                           f"(test dist.get_rank(group) < 0 first, and return)")
        assert torch.equal(found["x_after"], x), (f"{what}: forward changed its input x; on a rank "
                                                 f"outside the group return None without touching it")
        assert found["linear_unchanged"], (f"{what}: the nn.Linear passed in was modified; a rank "
                                           f"outside the group leaves it alone")
        held = [n for n, _ in found["params"]]
        assert not held, (f"{what}: the layer holds parameters {held}; a rank outside the group "
                          f"keeps no shard (self.weight = self.bias = None)")


def check_members(kind, case, out):
    """Every check on one case's members, in the order a student would fix them."""
    for check in (check_shards, check_output, check_input_grad, check_param_grads,
                  check_communication):
        check(kind, case, out)


def check_everything(kind, case, out):
    """Every check on one case: its members, then the ranks outside its group."""
    check_members(kind, case, out)
    if grouped(case):
        check_non_members(kind, case, out)


def make_tests(kind: str, name: str) -> dict:
    """The tests of exercise ``name`` (a layer of ``kind``), by aspect, each one point per
    size: a wrong bias, a missing all-reduce, a wrong slice or a rank outside the group
    that does not return None at once each lose the points of their own aspect. At one
    rank the collectives may be called or skipped."""
    def test(check, case_names=("bias", "no bias"), forward=True, sizes=SIZES):
        @pytest.mark.parametrize("size", sizes)
        def run_checks(student, size):
            for case in case_names:
                check(kind, case, run(kind, getattr(student, name), size, case, forward))
        return run_checks

    tests = {"shards": test(check_shards, forward=False), "output": test(check_output),
             "input_grad": test(check_input_grad), "param_grads": test(check_param_grads),
             "communication": test(check_communication),
             "group": test(check_members, ["pair"], sizes=[3, 4]),
             "outside": test(check_non_members, ["pair"], sizes=[3, 4])}
    if kind == "column":
        tests["gather"] = test(check_everything, ["gather"])
        tests["gather group"] = test(check_everything, ["gather pair"], sizes=[3])
    return tests
