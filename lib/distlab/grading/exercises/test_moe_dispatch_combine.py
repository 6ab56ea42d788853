"""Exercise moe_dispatch_combine(x, expert_ids, weights, experts, capacity=None,
group=None) of lab 10.

E = 2W experts over W ranks (2 each), k = 2, tokens of 5 features, a different number
of tokens on each rank. One launch per world size (1 to 4) runs every case and returns
plain data: outputs, the gradients of x, of the weights and of this rank's experts, what
each expert was called on (experts that record their inputs), and the CommLog records
of forward and backward. The expected values come from one process running all the
experts on each rank's tokens, written here with its own loops (fp64). One more launch
runs every capacity on the group of global ranks 1, 2, 3 of 4, rank 0 outside it.

Traffic: the CommLog gives the calls and their bytes (self-reported); the bytes on the
wire during each launch are bounded by what the rows that leave their rank weigh (a
rank's rows for its own experts need not cross), forward and backward, plus the counts
and gloo's headers of a message between every pair of ranks per call (measured: at 4
ranks an all-to-all of a few hundred bytes moves about twice its payload).
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close, wire
import lab10_cases

NOTEBOOK = "10_long_context_experts"
CORE = True  # one of its lab's core exercises (listed so in the lab and the README)
# the hint to open (1: what each rank must learn; 2: who keeps what; 3: the order of the
# rows; 4: gradients; 5: the recipe)
HINTS = {"test_identity_experts_with_weights_one_over_k_give_back_the_input": 1,
         "test_each_expert_runs_once_on_its_rows_in_rank_order": 3,
         "test_capacity_is_never_exceeded_and_the_right_assignments_drop": 2,
         "test_the_output_is_one_process_moe": 1,
         "test_the_gradients_are_one_process_gradients": 4,
         "test_rows_cross_once_each_way": 5,
         "test_bad_inputs_raise_before_any_communication": 2,
         "test_the_experts_are_spread_over_the_ranks_of_group": 1}
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

WORLDS = (1, 2, 3, 4)
LOCAL, K, DIM, HIDDEN = 2, 2, 5, 7
CAPACITIES = (None, 2, 0)   # no limit, a tight one (drops on every rank), everything dropped
SUBGROUP, SUB_WORLD = (1, 2, 3), 4   # group ranks 0, 1, 2 are global ranks 1, 2, 3; 0 is outside


def tokens(world, rank):
    return 6 + 2 * rank + world


class Expert(nn.Module):
    """An MLP that records what it was called on (its input's first two features tag
    the source rank and the token)."""

    def __init__(self, seed, identity=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.identity = identity
        self.up = nn.Parameter(torch.randn(DIM, HIDDEN, generator=g, dtype=torch.float64) / 2)
        self.down = nn.Parameter(torch.randn(HIDDEN, DIM, generator=g, dtype=torch.float64) / 2)
        self.calls = []

    def forward(self, x):
        self.calls.append(x.detach()[:, :2].round().long().tolist())
        return x if self.identity else torch.tanh(x @ self.up) @ self.down


def routing(world, rank, seed=0):
    """x (tags in the first two features), expert ids (distinct per row) and weights."""
    n, experts = tokens(world, rank), LOCAL * world
    g = torch.Generator().manual_seed(100 * seed + 10 * world + rank)
    x = torch.randn(n, DIM, generator=g, dtype=torch.float64)
    x[:, 0], x[:, 1] = rank, torch.arange(n)
    ids = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(n)])
    weights = torch.rand(n, K, generator=g, dtype=torch.float64)
    return x, ids, weights


# ---------------------------------------------------------------------- in the ranks


def one_case(fn, world, rank, capacity, group):
    """One call on this rank (rank ``rank`` of ``world`` in ``group``) and its backward:
    plain data, or {"raised": what happened}."""
    experts = [Expert(rank * LOCAL + i) for i in range(LOCAL)]
    x, ids, weights = routing(world, rank)
    x.requires_grad_(), weights.requires_grad_()
    with CommLog() as forward:
        try:
            y = fn(x, ids, weights, nn.ModuleList(experts), capacity, group)
        except NotImplementedError:
            raise
        except Exception as exc:
            return {"raised": f"raised {type(exc).__name__}: {exc}"}
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return {"raised": f"returned {type(y).__name__} of shape "
                          f"{tuple(getattr(y, 'shape', ()))}; expected x's shape"}
    calls = [list(e.calls) for e in experts]
    with CommLog() as backward:
        try:
            if y.requires_grad:  # every assignment dropped: y may be a constant
                (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
        except Exception as exc:
            return {"raised": f"backward raised {type(exc).__name__}: {exc}"}
    return {"y": y.detach(), "dx": x.grad, "dw": weights.grad,
            "dexperts": [[p.grad for p in (e.up, e.down)] for e in experts],
            "calls": calls, "forward": forward.records(), "backward": backward.records()}


def run_cases(fn):
    world, rank = dist.get_world_size(), dist.get_rank()
    found = [one_case(fn, world, rank, capacity, None) for capacity in CAPACITIES]
    # identity experts, weights 1/k, no capacity
    experts = nn.ModuleList(Expert(0, identity=True) for _ in range(LOCAL))
    x, ids, _ = routing(world, rank, seed=1)
    try:
        y = fn(x, ids, torch.full(ids.shape, 1.0 / K, dtype=x.dtype), experts, None, None)
        identity = {"x": x, "y": y.detach() if isinstance(y, torch.Tensor) else repr(y)}
    except Exception as exc:
        identity = {"raised": f"raised {type(exc).__name__}: {exc}"}
    return {"cases": found, "identity": identity}


def on_a_subgroup(fn):
    """Members: every capacity on group = ranks SUBGROUP of SUB_WORLD (group rank r plays
    rank r of a world of len(SUBGROUP)). The rank outside: one call with group rank 0's
    inputs, and what it did, the calls it made, whether x or an expert was touched."""
    rank = dist.get_rank()
    group = dist.new_group(list(SUBGROUP))
    members = len(SUBGROUP)
    if rank in SUBGROUP:
        return {"cases": [one_case(fn, members, SUBGROUP.index(rank), capacity, group)
                          for capacity in CAPACITIES]}
    experts = [Expert(i) for i in range(LOCAL)]
    x, ids, weights = routing(members, 0)
    before = x.clone()
    with CommLog() as log:
        try:
            out = fn(x, ids, weights, nn.ModuleList(experts), None, group)
            did = f"returned {type(out).__name__}"
        except NotImplementedError:
            raise
        except Exception as exc:
            did = f"raised {type(exc).__name__}: {exc}"
    touched = not torch.equal(x, before) or any(e.calls for e in experts)
    return {"outside": (did, len(log.records()), touched)}


def run_errors(fn):
    world, rank = dist.get_world_size(), dist.get_rank()
    experts = nn.ModuleList(Expert(i) for i in range(LOCAL))
    x, ids, weights = routing(world, rank)
    repeated = ids.clone()
    repeated[0, 1] = repeated[0, 0]
    bad = {"a token routed twice to the same expert": (x, repeated, weights, None),
           "an expert id out of range": (x, ids + LOCAL * world, weights, None),
           "weights not shaped like expert_ids": (x, ids, weights[:, :1], None),
           "a negative capacity": (x, ids, weights, -1)}
    found = {}
    for what, (a, b, c, capacity) in bad.items():
        with CommLog() as log:
            try:
                fn(a, b, c, experts, capacity, None)
                found[what] = ("returned", len(log.records()))
            except Exception as exc:
                found[what] = (type(exc).__name__, len(log.records()))
    return found


# ----------------------------------------------------------------- in the test process

_outcomes = lab10_cases.Outcomes(run_cases)


def outcome(student, world):
    return _outcomes(student, "moe_dispatch_combine", world)


def kept_here(ids, capacity, experts):
    """The contract's rule, written plainly: per expert, first choices before second
    ones, then token order; the first ``capacity`` stay."""
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    taken = [0] * experts
    for j in range(ids.shape[1]):
        for n in range(ids.shape[0]):
            e = int(ids[n, j])
            if capacity is None or taken[e] < capacity:
                keep[n, j], taken[e] = True, taken[e] + 1
    return keep


_one_process = {}


def one_process(world, capacity):
    """Every rank's y and gradients from one process holding every expert (computed
    once per world size and capacity)."""
    if (world, capacity) not in _one_process:
        _one_process[world, capacity] = _compute(world, capacity)
    return _one_process[world, capacity]


def _compute(world, capacity):
    experts = [Expert(e) for e in range(LOCAL * world)]
    out = []
    for rank in range(world):
        x, ids, weights = routing(world, rank)
        x.requires_grad_(), weights.requires_grad_()
        keep = kept_here(ids, capacity, len(experts))
        rows = []
        for n in range(x.shape[0]):
            row = torch.zeros(DIM, dtype=x.dtype)
            for j in range(K):
                if keep[n, j]:
                    row = row + weights[n, j] * experts[int(ids[n, j])](x[n:n + 1])[0]
            rows.append(row)
        y = torch.stack(rows)
        if y.requires_grad:
            (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
        out.append({"y": y.detach(), "keep": keep, "ids": ids,
                    "dx": x.grad if x.grad is not None else torch.zeros_like(x),
                    "dw": weights.grad if weights.grad is not None else torch.zeros_like(weights)})
    grads = [[p.grad if p.grad is not None else torch.zeros_like(p) for p in (e.up, e.down)]
             for e in experts]
    return out, grads


def each_case(runs, world):
    for i, capacity in enumerate(CAPACITIES):
        for rank in range(world):
            found = runs[rank]["cases"][i]
            what = (f"rank {rank} of {world}, capacity {capacity}")
            assert "raised" not in found, f"{what}: moe_dispatch_combine {found['raised']}"
            yield i, capacity, rank, found, what


def test_identity_experts_with_weights_one_over_k_give_back_the_input(student):
    for world in WORLDS:
        for rank, found in enumerate(outcome(student, world)):
            got = found["identity"]
            assert "raised" not in got, f"rank {rank} of {world}: {got.get('raised')}"
            expect_close(got["y"], got["x"], f"rank {rank} of {world}: identity experts, weights "
                         f"1/{K}, no capacity: y must be x", rtol=0, atol=0)


def test_each_expert_runs_once_on_its_rows_in_rank_order(student):
    for world in WORLDS:
        runs = outcome(student, world)
        for i, capacity, rank, found, what in each_case(runs, world):
            refs = one_process(world, capacity)[0]
            for local, calls in enumerate(found["calls"]):
                e = rank * LOCAL + local
                if capacity is not None:   # which rows: the capacity's test
                    assert len(calls) == 1, (f"{what}: expert {e} was called {len(calls)} "
                                             f"times; call each expert exactly once")
                    continue
                assert len(calls) == 1, (f"{what}: expert {e} was called {len(calls)} times; "
                                         f"call each expert exactly once, on all of its rows")
                want = [[src, n] for src in range(world) for n in range(tokens(world, src))
                        for j in range(K)
                        if int(refs[src]["ids"][n, j]) == e and bool(refs[src]["keep"][n, j])]
                assert calls[0] == want, (
                    f"{what}: expert {e} got the rows (source rank, token) {calls[0]}, expected "
                    f"{want}: every kept assignment routed to it, source ranks in order, "
                    f"tokens in order within each")


def test_capacity_is_never_exceeded_and_the_right_assignments_drop(student):
    for world in WORLDS:
        runs = outcome(student, world)
        for i, capacity, rank, found, what in each_case(runs, world):
            if capacity is None:
                continue
            refs = one_process(world, capacity)[0]
            for local, calls in enumerate(found["calls"]):
                e = rank * LOCAL + local
                rows = calls[0] if calls else []
                for src in range(world):
                    mine = [n for s, n in rows if s == src]
                    assert len(mine) <= capacity, (
                        f"{what}: expert {e} took {len(mine)} of rank {src}'s assignments, "
                        f"above the capacity {capacity}")
                    want = sorted(n for n in range(tokens(world, src)) for j in range(K)
                                  if int(refs[src]["ids"][n, j]) == e
                                  and bool(refs[src]["keep"][n, j]))
                    assert sorted(mine) == want, (
                        f"{what}: expert {e} kept rank {src}'s tokens {sorted(mine)}, expected "
                        f"{want}: first choices before second choices, then token order")


@pytest.mark.parametrize("world", WORLDS)
def test_the_output_is_one_process_moe(student, world):
    runs = outcome(student, world)
    for i, capacity, rank, found, what in each_case(runs, world):
        want = one_process(world, capacity)[0][rank]["y"]
        expect_close(found["y"], want, f"{what}: y (against one process running every expert "
                     f"on this rank's tokens)", rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
def test_the_gradients_are_one_process_gradients(student, world):
    runs = outcome(student, world)
    refs = {c: one_process(world, c) for c in CAPACITIES}
    for i, capacity, rank, found, what in each_case(runs, world):
        per_rank, grads = refs[capacity]
        for name in ("dx", "dw"):
            got = found[name]
            if got is None and capacity == 0:  # nothing kept: no gradient is zero gradient
                got = torch.zeros_like(per_rank[rank][name])
            assert got is not None, f"{what}: {name[1:]}.grad is None: y must be differentiable " \
                                    f"in x and in the weights"
            expect_close(got, per_rank[rank][name], f"{what}: the gradient of "
                         f"{'x' if name == 'dx' else 'the weights'}", rtol=0, atol=1e-12)
        for local, pair in enumerate(found["dexperts"]):
            e = rank * LOCAL + local
            for pname, got, want in zip(("up", "down"), pair, grads[e]):
                got = torch.zeros_like(want) if got is None else got
                expect_close(got, want, f"{what}: the gradient of expert {e}'s {pname} "
                             f"(every rank's tokens routed to it)", rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
def test_rows_cross_once_each_way(student, world):
    """Forward: one all_to_all_single of counts (at most E integers; on every call), one of
    the rows out (exactly the kept assignments), one back (exactly the rows this rank's
    experts computed); backward: the gradients the same two ways; nothing else."""
    runs = outcome(student, world)
    row = DIM * 8
    crossing = 0
    for i, capacity, rank, found, what in each_case(runs, world):
        refs = one_process(world, capacity)[0]
        out_rows = int(refs[rank]["keep"].sum())
        in_rows = sum(len(calls[0]) for calls in found["calls"] if calls)
        fwd = CommLog.from_records(found["forward"], rank)
        bwd = CommLog.from_records(found["backward"], rank)
        if world == 1:
            assert not fwd.select() and not bwd.select(), (
                f"{what}: on one rank nothing needs to be communicated, but it called "
                f"{fwd.ops() + bwd.ops()}")
            continue
        others = [e.op for e in fwd.select() + bwd.select() if e.op != "all_to_all_single"]
        assert not others, f"{what}: called {others}; between ranks only all_to_all_single"
        rows = [e.nbytes for e in fwd.select() if e.dtype == "float64"]
        counts = [e for e in fwd.select() if e.dtype != "float64"]
        assert sorted(rows) == sorted([out_rows * row, in_rows * row]) and len(rows) == 2, (
            f"{what}: forward's all-to-alls of rows carried {rows} bytes; expected two: "
            f"{out_rows * row} out (this rank's {out_rows} kept assignments x {DIM} features x "
            f"8 bytes) and {in_rows * row} back (the rows its experts computed)")
        assert len(counts) == 1 and sum(e.nbytes for e in counts) <= LOCAL * world * 8, (
            f"{what}: forward exchanged {[e.describe() for e in counts]} besides the rows; one "
            f"exchange of at most E = {LOCAL * world} integers per rank, on every call (also "
            f"when no row is kept: every rank of the group enters it)")
        back = [e.nbytes for e in bwd.select()]
        assert sorted(back) == sorted(rows), (
            f"{what}: backward's all-to-alls carried {back} bytes; the gradients of the rows "
            f"go back the same two ways ({sorted(rows)})")
        ids, keep = refs[rank]["ids"], refs[rank]["keep"]
        away = int((keep & (ids // LOCAL != rank)).sum())
        crossing += 2 * away * row * 2 + LOCAL * world * 8  # out and back, forward and backward
    # gloo's all-to-all sends a message (with its headers) between every pair of ranks:
    # five calls per case by the contract (counts, rows out and back, their gradients)
    crossing += len(CAPACITIES) * 5 * world * (world - 1) * wire.MESSAGE
    wire.at_most(_outcomes.reading[world], crossing,
                 f"moe_dispatch_combine on {world} ranks, all cases (each row that leaves its "
                 f"rank crosses once out and once back, forward and backward)")


def test_bad_inputs_raise_before_any_communication(student):
    lab10_cases.check_errors(student, "moe_dispatch_combine", run_errors, "a token routed twice "
                             "to one expert, an id out of range, weights shaped unlike the ids, "
                             "a negative capacity")


def test_the_experts_are_spread_over_the_ranks_of_group(student):
    """group=dist.new_group([1, 2, 3]) of 4 ranks: W is the group's size (3, so E = 6), r
    the rank in it; every capacity's output and gradients as one process's (a collective
    over the world waits for rank 0: a timeout). Rank 0, outside, makes no call and
    returns None at once (DESIGN.md's rule for every exercise that takes a group)."""
    on = f"group=dist.new_group({list(SUBGROUP)}) of {SUB_WORLD} ranks"
    fix = (" The experts are spread over the ranks of group: W is dist.get_world_size(group) "
           "(E = W·L), expert e lives on group rank e // L, every all_to_all_single gets "
           "group=group")
    try:
        runs = launch.run(on_a_subgroup, SUB_WORLD, student.moe_dispatch_combine,
                          backend="gloo", timeout=30)
    except launch.LaunchTimeout:
        pytest.fail(f"with {on} the ranks did not finish within 30 s: a rank waited in a "
                    f"collective that a rank never entered.{fix}; a rank outside the group "
                    f"returns at once")
    members = len(SUBGROUP)
    for me, rank in enumerate(SUBGROUP):
        for capacity, found in zip(CAPACITIES, runs[rank]["cases"]):
            what = f"rank {rank} (rank {me} of the group), {on}, capacity {capacity}"
            assert "raised" not in found, f"{what}: moe_dispatch_combine {found['raised']}.{fix}"
            per_rank, grads = one_process(members, capacity)
            expect_close(found["y"], per_rank[me]["y"], f"{what}: y (against one process "
                         f"running the group's {LOCAL * members} experts on group rank {me}'s "
                         f"tokens).{fix}", rtol=0, atol=1e-12)
            for name in ("dx", "dw"):
                got = found[name]
                if got is None and capacity == 0:
                    got = torch.zeros_like(per_rank[me][name])
                expect_close(got, per_rank[me][name], f"{what}: the gradient of "
                             f"{'x' if name == 'dx' else 'the weights'}.{fix}", rtol=0, atol=1e-12)
            for local, pair in enumerate(found["dexperts"]):
                for pname, got, want in zip(("up", "down"), pair, grads[me * LOCAL + local]):
                    expect_close(torch.zeros_like(want) if got is None else got, want,
                                 f"{what}: the gradient of expert {me * LOCAL + local}'s "
                                 f"{pname}.{fix}", rtol=0, atol=1e-12)
    for rank in range(SUB_WORLD):
        if rank in SUBGROUP:
            continue
        did, calls, touched = runs[rank]["outside"]
        assert calls == 0 and did == "returned NoneType", (
            f"rank {rank} is not a member of {on}; moe_dispatch_combine {did} after {calls} "
            f"communication call(s). A rank outside the group holds none of the experts: it "
            f"makes no call and returns None at once (dist.get_rank(group) is -1 there)")
        assert not touched, (f"rank {rank}, outside {on}: moe_dispatch_combine changed x or "
                             f"called an expert; outside the group it touches nothing")
