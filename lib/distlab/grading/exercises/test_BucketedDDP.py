"""Exercise BucketedDDP(module, bucket_cap_mb=25, group=None) of lab 08.

The contract (docs/design.md): shaped like DataParallel (``.module``, rank 0's weights
broadcast at construction, ``finish_gradient_synchronization()`` after backward); the
averaged gradients equal plain data parallel's; the all-reduces are launched from
backward hooks, asynchronously, one per bucket, buckets in reverse parameter order (a
bucket closes once it holds at least ``bucket_cap_mb`` MiB); ``bucket_cap_mb=None`` is
one per parameter.

The test model is the course's small GPT in float64 with the awkward cases: the head
tied to the token embedding, a frozen parameter (``ln_f.bias``), one the loss never uses
(``unused``), 10 sequences a step (uneven over 3 and 4 ranks). A second model,
``Branchy``, has a middle layer that only some ranks use in a step: buckets launched in
a different order on different ranks then hang, crash or mix up gradients. The subgroup
case uses ``[1, 3]`` of 4 ranks, whose rank 0 is global rank 1 (``src`` of a broadcast is
a global rank). A second backward before ``finish_gradient_synchronization()`` must raise
a RuntimeError (its gradients would land in buckets whose all-reduce is in flight).
After ``finish_gradient_synchronization()`` each bucket's gradients are views into one
flat buffer, the same in every step; training matches one process whether
``zero_grad()`` sets ``.grad`` to None or zeroes it in place; with every parameter used
(the tied weight's hook runs once), every bucket is launched before backward returns.
``TiedPair`` shares one weight between two modules: counted twice (hooks registered
module by module), its bucket would launch before its other gradients are in. Each rank
gives the model a buffer of its own (rank 0's must reach every rank), and a bad
``bucket_cap_mb`` (0, -1, "25", True) must be refused as ``plan_buckets`` refuses it.

Every check runs here, in the test process, on what the ranks returned (plain data); the
expected values are computed here, in one process.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dp_cases import (Branchy, branchy_backward, branchy_means, local_loss, make_model,
                      one_process, snapshot)

from distlab import launch
from distlab.comm import CommLog
from distlab.dp import plan_buckets
from distlab.grading import expect_close

NOTEBOOK = "08_overlap"
RANK_IMPORTS = ("torch._dynamo",)  # its ranks import it (a traced grading): the fork server, once
# The hint to open, by the words of the check that failed (1: where code runs as a
# gradient completes, 2: the group, 3: gradients in the bucket, 4: when a bucket is
# complete and which launches, 5: what is left for finish, 6: the recipe).
HINTS = {'test_gradients_are_the_mean_over_ranks': {'SUM over the ranks': 2,
                                                    'different orders': 4,
                                                    'zero the bucket slots': 5,
                                                    'is None after': 5,
                                                    'should be the mean': 4,
                                                    'frozen': 1},
         'test_training_matches_one_process': {'SUM over the ranks': 2,
                                               'different orders': 4,
                                               'zero the bucket slots': 5,
                                               'is None after': 5,
                                               'should be the mean': 4,
                                               'frozen': 1,
                                               'against one process': 5},
         'test_training_matches_one_process_when_zero_grad_zeroes_in_place': {'SUM over the ranks': 2,
                                                                              'different orders': 4,
                                                                              'zero the bucket slots': 5,
                                                                              'is None after': 5,
                                                                              'should be the mean': 4,
                                                                              'frozen': 1,
                                                                              'against one process': 3},
         'test_gradients_are_views_into_one_buffer_per_bucket': {'separate tensors': 3,
                                                                 'overlap': 3,
                                                                 'share one buffer': 3,
                                                                 'other buffers than in step 0': 3},
         'test_rank_0_weights_are_broadcast_and_module_is_kept': {'.module': 1, 'broadcast': 2},
         'test_one_all_reduce_per_bucket_in_reverse_order': {'need all_reduce only': 1,
                                                             'one all-reduce per parameter': 1,
                                                             'all-reduces in': 4,
                                                             'expected': 1},
         'test_cap_none_is_one_all_reduce_per_parameter_and_large_cap_one': {'expected': 1,
                                                                             'SUM over the ranks': 2,
                                                                             'different orders': 4,
                                                                             'zero the bucket slots': 5,
                                                                             'is None after': 5,
                                                                             'should be the mean': 4,
                                                                             'frozen': 1},
         'test_all_reduces_are_asynchronous': {'async_op=False': 4},
         'test_the_first_all_reduce_starts_before_the_last_gradient': {'no overlap': 1,
                                                                       'no all-reduce': 4},
         'test_every_bucket_is_launched_during_backward': {'after backward returned': 4},
         'test_a_weight_shared_by_two_modules_counts_once': {'shared by two modules': 4},
         'test_same_bucket_order_on_every_rank_when_a_layer_is_skipped': {'launched different buckets': 4,
                                                                          'same order': 4,
                                                                          'has no gradient': 5,
                                                                          'contribute zeros': 5},
         'test_a_group_starts_from_its_own_rank_0': {'group_src': 2},
         'test_a_group_averages_over_its_own_ranks': {'group': 2,
                                                      'SUM over the ranks': 2,
                                                      'different orders': 4,
                                                      'zero the bucket slots': 5,
                                                      'is None after': 5,
                                                      'should be the mean': 4,
                                                      'frozen': 1},
         'test_a_rank_outside_the_group_is_left_alone': {'outside the group': 2,
                                                         'is not in the group': 2},
         'test_a_second_backward_before_finish_raises': {'second backward': 4},
         'test_rank_0_buffers_are_broadcast': {'buffer': 1},
         'test_a_bad_bucket_cap_mb_is_refused': {'bucket_cap_mb': 1}}
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

STEPS, LR = 3, 0.5
CAP = 0.002          # MiB: the small GPT's gradients make 9-10 buckets
WORLDS = [1, 2, 3, 4]
TIMEOUT = 30           # seconds a launch may take: a deadlock is reported within it
PAIR, PAIR_WORLD = [1, 3], 4   # a subgroup whose rank 0 is not global rank 0
BAD_CAPS = (0, -1, "25", True)   # refused as plan_buckets refuses them


# The traffic checks are self-reported (a CommLog a rank returned): bucket sizes, their
# order, whether a call is asynchronous and when it starts are not in the bytes on the wire
# (one all-reduce per parameter moves what the buckets move), wire.py.
def calls(records):
    """The calls of a CommLog's records, as a rank returned them: (op, bytes, async,
    start). Rebuilt through CommLog.from_records, so that the grader counts the test
    that reads them as resting on self-reported traffic."""
    return [(e.op, e.nbytes, e.async_op, e.start) for e in CommLog.from_records(records).events]


def rank_cases(BucketedDDP):
    """Every case but the branchy one, on this rank; returns plain data only."""
    import time

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # every parameter used: construction from rank-specific weights, one backward timed
    model = make_model(seed=rank, unused=False)
    model.register_buffer("stat", torch.full((3,), float(rank), dtype=torch.float64))
    marks = []
    for p in model.parameters():  # registered first: they run before the student's hooks
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _: marks.append(time.perf_counter()))
    with CommLog() as log:
        ddp = BucketedDDP(model, CAP)
    out["build"] = {"start": snapshot(model), "module": getattr(ddp, "module", None) is model,
                    "calls": log.records(),
                    "buffers": {n: b.clone() for n, b in model.named_buffers()}}
    with CommLog() as log:
        local_loss(ddp, 0, rank, world).backward()
        backward_end = time.perf_counter()
        ddp.finish_gradient_synchronization()
    out["overlap"] = {"calls": log.records(), "marks": marks, "backward_end": backward_end}
    # training (with the never-used parameter), zero_grad() setting .grad to None, then
    # zeroing it in place (the views stay .grad)
    out["train"] = train(BucketedDDP, set_to_none=True)
    out["train in place"] = train(BucketedDDP, set_to_none=False)
    # one bucket per parameter, and one bucket for everything
    for cap in (None, 25):
        model = make_model()
        ddp = BucketedDDP(model, cap)
        with CommLog() as log:
            local_loss(model, 0, rank, world).backward()
            ddp.finish_gradient_synchronization()
        out[f"cap={cap}"] = {"grads": snapshot(model, "grad"), "calls": log.records()}
    out["bad caps"] = {}
    for cap in BAD_CAPS:
        try:
            BucketedDDP(make_model(), cap)
            out["bad caps"][repr(cap)] = "accepted"
        except Exception as e:  # noqa: BLE001 - the class name is the result
            out["bad caps"][repr(cap)] = type(e).__name__
    return out


def train(BucketedDDP, set_to_none):
    """SGD steps on the model with the never-used parameter, the student's
    synchronisation between backward and step; keeps the first step's gradients and, in
    every step, where each gradient lives (plain data)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    ddp = BucketedDDP(model, CAP)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, places = [], []
    with CommLog() as log:
        for step in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            loss = local_loss(ddp, step, rank, world)
            loss.backward()
            ddp.finish_gradient_synchronization()
            if step == 0:
                first = snapshot(model, "grad")
            places.append(grad_places(model))
            opt.step()
            losses.append(loss.detach())
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    return {"losses": losses / world, "params": snapshot(model), "calls": log.records(),
            "grads": first, "places": places}


def grad_places(model):
    """Where each .grad lives: (address of its storage, byte offset in it, bytes), or
    None for no gradient."""
    return {n: None if p.grad is None else (
        p.grad.untyped_storage().data_ptr(), p.grad.data_ptr()
        - p.grad.untyped_storage().data_ptr(), p.grad.numel() * p.grad.element_size())
        for n, p in model.named_parameters()}


def pair_case(BucketedDDP):
    """group=dist.new_group(PAIR): its ranks start from the weights of the group's rank 0
    (global rank PAIR[0]) and average between themselves; the others must be left alone
    (a launch of its own: code that ignores the group hangs)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group(PAIR)
    model = make_model(seed=rank)
    before = snapshot(model)
    with CommLog() as log:
        ddp = BucketedDDP(model, CAP, group=pair)
        built = snapshot(model)
        local_loss(model, 0, rank, world).backward()
        ddp.finish_gradient_synchronization()
    return {"before": before, "built": built, "after": snapshot(model),
            "grads": snapshot(model, "grad"), "calls": log.records()}


def twice_case(BucketedDDP):
    """Two backward passes without finish_gradient_synchronization() in between: the
    second one's gradients reach buckets whose all-reduces are in flight. Returns the
    class name of what the second backward raised, or None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(unused=False)
    ddp = BucketedDDP(model, CAP)
    local_loss(ddp, 0, rank, world).backward()
    try:
        local_loss(ddp, 1, rank, world).backward()
        raised = None
    except Exception as e:  # noqa: BLE001 - the class name is the result
        raised = type(e).__name__
    dist.barrier()          # gloo's barrier waits for the first backward's all-reduces
    return raised


class TiedPair(nn.Module):
    """``b`` reuses ``a``'s weight (one parameter in two modules), applied after ``pre``:
    backward completes the shared weight's gradient before ``pre``'s, in one bucket."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.pre = nn.Linear(3, 4)
        self.double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(torch.tanh(self.pre(x)))))


def tied_backward(model, rank):
    torch.manual_seed(rank)
    model(torch.randn(5, 3, dtype=torch.float64)).pow(2).sum().backward()


def tied_case(BucketedDDP):
    """One backward of TiedPair, everything in one bucket."""
    model = TiedPair()
    ddp = BucketedDDP(model, 25)
    with CommLog() as log:
        tied_backward(ddp, dist.get_rank())
        ddp.finish_gradient_synchronization()
    return {"grads": snapshot(model, "grad"), "calls": log.records()}


def branchy_case(BucketedDDP):
    """Two steps of Branchy, one bucket per parameter (its middle layer's buckets sit
    between the others)."""
    model = Branchy()
    ddp = BucketedDDP(model, None)
    steps = []
    with CommLog() as log:
        for step in range(2):
            model.zero_grad()
            branchy_backward(model, dist.get_rank(), step)
            ddp.finish_gradient_synchronization()
            steps.append(snapshot(model, "grad"))
    return {"grads": steps, "calls": log.records()}


_runs = {}


def run(student, world, case=rank_cases):
    """``case`` at ``world`` ranks, launched once and shared by the tests."""
    key = (case.__name__, world)
    if key not in _runs:
        try:
            _runs[key] = launch.run(case, world, student.BucketedDDP, backend="gloo",
                                    timeout=TIMEOUT)
        except launch.LaunchError as e:
            _runs[key] = e
    if isinstance(_runs[key], Exception):
        raise _runs[key]
    return _runs[key]


def run_pair(student):
    """The subgroup case; a hang there is a collective issued outside the group."""
    try:
        return run(student, PAIR_WORLD, pair_case)
    except launch.LaunchTimeout as e:
        raise AssertionError(
            f"with group=dist.new_group({PAIR}) of {PAIR_WORLD} ranks the ranks did not finish "
            f"within {e.timeout:g} s: a collective issued on the default group waits for the "
            f"ranks outside the group. Pass group= to the broadcast and to every all-reduce"
        ) from None
    except (launch.RankCrashed, launch.RankError) as e:
        raise AssertionError(
            f"with group=dist.new_group({PAIR}) of {PAIR_WORLD} ranks a rank failed "
            f"({str(e).splitlines()[0]}). That group's rank 0 is global rank {PAIR[0]}, and "
            f"dist.broadcast's src is a global rank: pass src=dist.get_global_rank(group, 0) "
            f"(or group_src=0). A rank outside the group must return at once "
            f"(dist.get_rank(group) < 0): no broadcast, no hooks") from None


def local_grads(world, unused=True, seed=0):
    """Each rank's own gradients (on the weights of global rank ``seed``), computed here
    in one process."""
    grads = []
    for rank in range(world):
        model = make_model(seed=seed, unused=unused)
        local_loss(model, 0, rank, world).backward()
        grads.append(snapshot(model, "grad"))
    return grads


def expected_buckets(cap, unused=True):
    """Bytes of each bucket, in launch order (the rule of dp.plan_buckets)."""
    params = [p for p in make_model(unused=unused).parameters() if p.requires_grad]
    return [sum(params[i].numel() * 8 for i in idx) for idx in plan_buckets(params, cap)]


def check_mean(grads, local, ranks, where):
    """Every gradient some rank has is the mean over ``ranks``; ``ln_f.bias`` (frozen)
    has none; ``unused`` (no rank used it) has none or zeros."""
    for name, want in local[ranks[0]].items():
        got = grads[name]
        if name == "ln_f.bias":
            assert got is None, (f"{where}: ln_f.bias is frozen (requires_grad=False) and must "
                                 f"keep .grad None; leave frozen parameters out of the buckets")
            continue
        if want is None:
            assert got is None or not got.any(), (
                f"{where}: {name} got no gradient on any rank, so its .grad must stay None or "
                f"zero; got {got}: zero the bucket slots of gradients a backward did not produce")
            continue
        assert got is not None, (f"{where}: the gradient of {name} is None after "
                                 f"finish_gradient_synchronization()")
        stack = torch.stack([local[r][name] for r in ranks])
        mean = stack.mean(0)
        if len(ranks) > 1 and torch.allclose(got, stack.sum(0)) and not torch.allclose(got, mean):
            raise AssertionError(f"{where}: the gradient of {name} is the SUM over the ranks, not "
                                 f"the mean: divide each bucket by the group's size (or use "
                                 f"ReduceOp.AVG)")
        expect_close(got, mean, f"{where}: gradient of {name} (should be the mean over "
                                f"{len(ranks)} rank(s); if it holds another parameter's values, "
                                f"the ranks launched their buckets in different orders)")


def all_reduces(records):
    return [c for c in calls(records) if c[0] == "all_reduce"]


def describe_buckets(sizes):
    return f"{len(sizes)} all-reduce(s) of {sizes} bytes"


@pytest.mark.parametrize("world", WORLDS)
def test_gradients_are_the_mean_over_ranks(student, world):
    """After one backward and finish_gradient_synchronization(), every gradient is the
    mean over the ranks (tied, frozen and never-used parameters included)."""
    out = run(student, world)
    local = local_grads(world)
    for rank, r in enumerate(out):
        check_mean(r["train"]["grads"], local, list(range(world)), f"rank {rank} of {world}")


@pytest.mark.parametrize("world", [2, 3])
def test_training_matches_one_process(student, world):
    """The correctness rule: 3 SGD steps on ``world`` ranks give the weights and losses
    of one process on the whole batch (zero_grad() sets .grad to None between steps)."""
    losses, want = one_process(make_model(), STEPS, LR)
    for rank, r in enumerate(run(student, world)):
        for name, value in r["train"]["params"].items():
            expect_close(value, want[name], f"rank {rank} of {world}: weights of {name} after "
                         f"{STEPS} SGD steps, against one process on the whole batch (a stale "
                         f"bucket from the previous step? each step must start afresh)")
        expect_close(r["train"]["losses"], losses,
                     f"rank {rank} of {world}: the loss of each step")


@pytest.mark.parametrize("world", [2])
def test_training_matches_one_process_when_zero_grad_zeroes_in_place(student, world):
    """zero_grad(set_to_none=False) zeroes each .grad in place: it stays the bucket's
    view, and autograd adds the next gradient into it."""
    losses, want = one_process(make_model(), STEPS, LR)
    for rank, r in enumerate(run(student, world)):
        for name, value in r["train in place"]["params"].items():
            expect_close(value, want[name], f"rank {rank} of {world}, zero_grad(set_to_none="
                         f"False) between steps: weights of {name} after {STEPS} SGD steps, "
                         f"against one process. Here each .grad is already your view when its "
                         f"hook runs and holds this backward's gradient: leave it, and never "
                         f"zero a bucket in a hook (that erases gradients already in it)")
        expect_close(r["train in place"]["losses"], losses,
                     f"rank {rank} of {world}, zero_grad(set_to_none=False): the loss of each "
                     f"step")


@pytest.mark.parametrize("world", [2])
def test_gradients_are_views_into_one_buffer_per_bucket(student, world):
    """After finish_gradient_synchronization() the gradients of one bucket are views into
    one flat buffer (disjoint pieces of one storage), one buffer per bucket, the same
    buffers in every step."""
    names = [n for n, p in make_model().named_parameters() if p.requires_grad]
    params = [p for p in make_model().parameters() if p.requires_grad]
    plan = [[names[i] for i in idx] for idx in plan_buckets(params, CAP)]
    for rank, r in enumerate(run(student, world)):
        for case in ("train", "train in place"):
            first = None
            for step, places in enumerate(r[case]["places"]):
                where = f"rank {rank} of {world}, {case}, step {step}"
                buffers = []
                for bucket in plan:
                    held = {n: places[n] for n in bucket if places[n] is not None}
                    storages = {place[0] for place in held.values()}
                    assert len(storages) <= 1, (
                        f"{where}: the gradients of the bucket {bucket} live in {len(storages)}"
                        f" separate tensors after finish_gradient_synchronization(): make each "
                        f".grad a view into the bucket's flat buffer (in the hook, copy a fresh "
                        f".grad into the view and set p.grad = view; compare p.grad.data_ptr() "
                        f"with view.data_ptr() to tell)")
                    pieces = sorted((off, off + size) for _, off, size in held.values())
                    assert all(a[1] <= b[0] for a, b in zip(pieces, pieces[1:])), (
                        f"{where}: gradients of the bucket {bucket} overlap in its buffer")
                    buffers.append(storages)
                shared = [s for s in buffers if s]
                assert len(set().union(*shared)) == len(shared), (
                    f"{where}: two buckets share one buffer; give each bucket a flat buffer of "
                    f"its own")
                if first is None:
                    first = buffers
                assert buffers == first, (
                    f"{where}: the gradients live in other buffers than in step 0: allocate "
                    f"each bucket's flat buffer once, at construction, and reuse it")


@pytest.mark.parametrize("world", [2, 4])
def test_rank_0_weights_are_broadcast_and_module_is_kept(student, world):
    start = snapshot(make_model(unused=False))
    for rank, r in enumerate(run(student, world)):
        case = r["build"]
        assert case["module"], f"rank {rank}: BucketedDDP(model).module must be model itself"
        for name, value in case["start"].items():
            expect_close(value, start[name], f"rank {rank} of {world}: {name} right after "
                         f"BucketedDDP(...) (each rank built different weights; rank 0 of the "
                         f"group must broadcast its parameters and buffers at construction)")


@pytest.mark.parametrize("world", [2, 4])
def test_rank_0_buffers_are_broadcast(student, world):
    """Each rank registers a buffer ``stat`` of its own rank number: after construction
    every rank holds rank 0's (zeros)."""
    for rank, r in enumerate(run(student, world)):
        got = r["build"]["buffers"]["stat"]
        expect_close(got, torch.zeros(3, dtype=torch.float64), f"rank {rank} of {world}: the "
                     f"buffer stat right after BucketedDDP(...) (each rank registered its own "
                     f"rank number; every member ends with the parameters and buffers of the "
                     f"group's rank 0: broadcast module.buffers() too)")


def test_a_bad_bucket_cap_mb_is_refused(student):
    """bucket_cap_mb 0, -1, "25" and True: refused at construction with the exception
    plan_buckets raises for it (ValueError for a number not above 0, TypeError for what
    is not a number)."""
    found = run(student, 1)[0]["bad caps"]
    for cap in BAD_CAPS:
        got = found[repr(cap)]
        try:
            plan_buckets([], cap)
            want = "accepted"
        except Exception as e:  # noqa: BLE001 - the class name is the result
            want = type(e).__name__
        assert got == want, (
            f"BucketedDDP(model, bucket_cap_mb={cap!r}) "
            + ("built a wrapper" if got == "accepted" else f"raised {got}")
            + f"; bucket_cap_mb is a number > 0 (MiB) or None: refuse {cap!r} with {want}, as "
            f"plan_buckets does")


@pytest.mark.parametrize("world", [1, 3])
def test_one_all_reduce_per_bucket_in_reverse_order(student, world):
    want = expected_buckets(CAP)
    n_params = sum(1 for p in make_model().parameters() if p.requires_grad)
    for rank, r in enumerate(run(student, world)):
        made = calls(r["train"]["calls"])
        others = sorted({c[0] for c in made} - {"all_reduce"})
        assert not others, (f"rank {rank}: the training steps called {others}; the gradients "
                            f"need all_reduce only (the broadcast belongs to construction)")
        sizes = [c[1] for c in made if c[0] == "all_reduce"]
        where = f"rank {rank} of {world}, bucket_cap_mb={CAP}"
        if len(sizes) == STEPS * n_params and len(want) < n_params:
            raise AssertionError(f"{where}: one all-reduce per parameter ({n_params} a step); "
                                 f"expected {describe_buckets(want)}: collect the gradients in "
                                 f"buckets of at least bucket_cap_mb MiB")
        assert len(sizes) == STEPS * len(want), (
            f"{where}: {len(sizes)} all-reduces in {STEPS} steps, expected {len(want)} a step "
            f"(one per bucket): {describe_buckets(want)}")
        for step in range(STEPS):
            got = sizes[step * len(want):(step + 1) * len(want)]
            assert got == want, (
                f"{where}, step {step}: {describe_buckets(got)}, expected "
                f"{describe_buckets(want)}: walk the parameters that require grad in reverse "
                f"order of module.parameters() and close a bucket as soon as it holds "
                f">= bucket_cap_mb * 2**20 bytes")


@pytest.mark.parametrize("world", [2])
def test_cap_none_is_one_all_reduce_per_parameter_and_large_cap_one(student, world):
    for rank, r in enumerate(run(student, world)):
        for cap in (None, 25):
            want = expected_buckets(cap)
            sizes = [c[1] for c in all_reduces(r[f"cap={cap}"]["calls"])]
            assert sizes == want, (f"rank {rank}, bucket_cap_mb={cap}: {describe_buckets(sizes)},"
                                   f" expected {describe_buckets(want)}" +
                                   (" (None means one bucket per parameter)" if cap is None
                                    else ""))
            check_mean(r[f"cap={cap}"]["grads"], local_grads(world), [0, 1],
                       f"rank {rank}, bucket_cap_mb={cap}")


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduces_are_asynchronous(student, world):
    for rank, r in enumerate(run(student, world)):
        blocking = [c for c in all_reduces(r["overlap"]["calls"]) if not c[2]]
        assert not blocking, (
            f"rank {rank}: {len(blocking)} all-reduce(s) called with async_op=False: a blocking "
            f"all-reduce in a hook stops backward until it is done. Pass async_op=True and "
            f"wait for the handles in finish_gradient_synchronization()")


@pytest.mark.parametrize("world", [2, 4])
def test_the_first_all_reduce_starts_before_the_last_gradient(student, world):
    """Overlap: with every parameter used, the first bucket's all-reduce is issued while
    backward still computes the gradients of earlier layers."""
    for rank, r in enumerate(run(student, world)):
        case = r["overlap"]
        starts = [c[3] for c in all_reduces(case["calls"])]
        assert starts, f"rank {rank}: no all-reduce during the step"
        last = max(case["marks"])
        assert min(starts) < last, (
            f"rank {rank} of {world}: no overlap: the first all-reduce started "
            f"{1e3 * (min(starts) - last):.2f} ms after the last gradient was computed. Launch "
            f"each bucket from a backward hook (register_post_accumulate_grad_hook) as soon as "
            f"its gradients are all there, not in finish_gradient_synchronization()")


@pytest.mark.parametrize("world", [2])
def test_every_bucket_is_launched_during_backward(student, world):
    """With every parameter used, every bucket completes during backward and is launched
    from a hook, the last one included; the tied head/embedding weight is one parameter
    whose hook runs once, after both of its uses' gradients are summed."""
    for rank, r in enumerate(run(student, world)):
        case = r["overlap"]
        late = [c for c in all_reduces(case["calls"]) if c[3] >= case["backward_end"]]
        assert not late, (
            f"rank {rank} of {world}: {len(late)} all-reduce(s) of {[c[1] for c in late]} bytes "
            f"started after backward returned, though every parameter got its gradient: launch "
            f"a bucket from the hook that completes it. A parameter counts once: the hook of "
            f"the tied head/embedding weight runs once per backward, after autograd has "
            f"summed both of its uses (one hook per parameter of module.parameters(); keep a "
            f"set of ready parameters, not a count of hook calls)")


def test_a_weight_shared_by_two_modules_counts_once(student):
    """TiedPair: ``a`` and ``b`` share one weight. Its hook runs once per backward (twice
    only if registered twice, e.g. module by module); counted twice, the bucket would
    launch before ``pre``'s gradients are in."""
    hint = ("a weight shared by two modules is one parameter: register one hook per "
            "parameter of module.parameters() (not module by module, which registers two on "
            "it, and both run), and keep the ready parameters in a set, not a count of hook "
            "calls")
    try:
        out = run(student, 2, tied_case)
    except (launch.RankCrashed, launch.RankError) as e:
        raise AssertionError(f"with a weight shared by two modules a rank failed "
                             f"({str(e).splitlines()[0]}): {hint}") from None
    local = []
    for rank in range(2):
        model = TiedPair()
        tied_backward(model, rank)
        local.append(snapshot(model, "grad"))
    for rank, r in enumerate(out):
        sizes = [c[1] for c in all_reduces(r["calls"])]
        assert len(sizes) == 1, (f"rank {rank}: {describe_buckets(sizes)} for a model whose "
                                 f"3 gradients fit one bucket of 25 MiB")
        for name, want in local[0].items():
            expect_close(r["grads"][name], (want + local[1][name]) / 2,
                         f"rank {rank}: the gradient of {name} (not the mean: was the bucket "
                         f"launched before pre's gradients were in? {hint})")


@pytest.mark.parametrize("world", [2, 3])
def test_same_bucket_order_on_every_rank_when_a_layer_is_skipped(student, world):
    """Branchy's middle layer gets no gradient on some ranks: its bucket fills only in
    finish_gradient_synchronization() there. Launching buckets as they fill would pair
    different buckets across ranks (a crash, a hang, or mixed-up gradients)."""
    try:
        out = run(student, world, branchy_case)
    except (launch.RankCrashed, launch.RankError) as e:
        raise AssertionError(
            f"with a layer some ranks skip, the ranks failed in a collective "
            f"({str(e).splitlines()[0]}): they launched different buckets at the same time. "
            f"Launch bucket i only after buckets 0..i-1, and launch the ones backward left in "
            f"finish_gradient_synchronization(), in order") from None
    orders = [[c[1] for c in all_reduces(r["calls"])] for r in out]
    for rank, order in enumerate(orders):
        assert order == orders[0], (f"rank {rank} all-reduced buckets of {order} bytes, rank 0 "
                                    f"of {orders[0]}: every rank must launch the same buckets "
                                    f"in the same order")
    for step in range(2):
        means = branchy_means(world, step)
        for rank, r in enumerate(out):
            for name, want in means.items():
                got = r["grads"][step][name]
                assert got is not None, (f"rank {rank}, step {step}: {name} has no gradient; "
                                         f"a layer another rank used gets the mean (this rank "
                                         f"contributes zeros)")
                expect_close(got, want, f"rank {rank} of {world}, step {step}: gradient of {name} "
                             f"(ranks that skipped the layer contribute zeros, not last step's "
                             f"values)")


def test_a_group_starts_from_its_own_rank_0(student):
    """group=dist.new_group([1, 3]): both start from global rank 1's weights."""
    out = run_pair(student)
    want, group_rank_1 = snapshot(make_model(seed=PAIR[0])), snapshot(make_model(seed=PAIR[1]))
    for rank in PAIR:
        for name, value in out[rank]["built"].items():
            if rank == PAIR[0] and torch.allclose(value, group_rank_1[name]) and not (
                    torch.allclose(value, want[name])):
                raise AssertionError(
                    f"rank {rank} of {PAIR_WORLD}, in group {PAIR}: after BucketedDDP(...) its "
                    f"{name} is global rank {PAIR[1]}'s, the group's rank 1: group_src= counts "
                    f"ranks within the group, src= counts global ranks; the group's rank 0 is "
                    f"group_src=0, or src=dist.get_global_rank(group, 0)")
            expect_close(value, want[name], f"rank {rank} of {PAIR_WORLD}, in group {PAIR}: "
                         f"{name} right after BucketedDDP(...) must be the weights of the group's "
                         f"rank 0, global rank {PAIR[0]} (dist.broadcast's src is a global rank: "
                         f"src=dist.get_global_rank(group, 0), or group_src=0)")


def test_a_group_averages_over_its_own_ranks(student):
    """group=dist.new_group([1, 3]): ranks 1 and 3 average between the two of them."""
    out = run_pair(student)
    local = local_grads(PAIR_WORLD, seed=PAIR[0])
    for rank in PAIR:
        check_mean(out[rank]["grads"], local, PAIR,
                   f"rank {rank} of {PAIR_WORLD}, in group {PAIR} (pass group= to the broadcast "
                   f"and the all-reduces, divide by dist.get_world_size(group))")


def test_a_rank_outside_the_group_is_left_alone(student):
    out = run_pair(student)
    for rank in (r for r in range(PAIR_WORLD) if r not in PAIR):
        r = out[rank]
        made = calls(r["calls"])
        assert not made, (f"rank {rank} is not in the group {PAIR} but called "
                          f"{sorted({c[0] for c in made})}: a rank outside the group must "
                          f"return at once, as torch's collectives do")
        for name, value in r["after"].items():
            expect_close(value, r["before"][name], f"rank {rank} (outside the group): its "
                         f"weights of {name} changed")
        model = make_model(seed=rank)
        local_loss(model, 0, rank, PAIR_WORLD).backward()
        for name, g in snapshot(model, "grad").items():
            if g is not None:
                expect_close(r["grads"][name], g, f"rank {rank} (outside the group): the "
                             f"gradient of {name} must stay its own")


def test_a_second_backward_before_finish_raises(student):
    """Backward twice without finish_gradient_synchronization(): the second backward's
    gradients reach buckets whose all-reduce is in flight; the hook must raise."""
    for rank, raised in enumerate(run(student, 2, twice_case)):
        assert raised == "RuntimeError", (
            f"rank {rank}: a second backward before finish_gradient_synchronization() "
            + ("raised nothing" if raised is None else f"raised {raised}") +
            ": its gradients went into buckets whose all-reduce was already in flight. In the "
            "hook, raise a RuntimeError when the parameter's bucket has been launched, saying "
            "to call finish_gradient_synchronization() after every backward")

