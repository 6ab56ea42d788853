"""Exercise allreduce_gradients(model, group=None) of lab 04.

Every ``.grad`` must become its mean over the ranks of the group; parameters without a
gradient stay untouched; a rank outside the group returns at once, changing nothing. The
test model is the course's small GPT in float64 with the awkward cases: its output head
tied to the token embedding, a frozen parameter (``ln_f.bias``), a parameter the loss
never uses (``unused``), and a global batch of 10 sequences (uneven over 3 and 4 ranks).
One launch per world size runs every case; the ranks return plain data (gradients,
weights, losses, the CommLog's records) and every check is made here, against the
single-process computation done here. The traffic point rests on the bytes counted on
the wire during that launch (:mod:`distlab.grading.wire`): at most gloo's all_reduce of
each gradient once, which all-reducing twice, or weights too, exceeds.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close, wire
from dp_cases import local_loss, make_model, one_process, snapshot

NOTEBOOK = "04_data_parallel"
RANK_IMPORTS = ("torch._dynamo",)  # its ranks import it (a traced grading): the fork server, once
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

STEPS, LR = 3, 0.5
WITHOUT_GRAD = ("ln_f.bias", "unused")
PAIR = [0, 2]  # the subgroup of the group tests
NONE_GRAD_HINT = ("the test model has a frozen parameter (ln_f.bias) and one the loss never "
                  "uses (unused); their .grad is None: skip parameters whose .grad is None")


def rank_cases(allreduce_gradients):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # one backward, then the exercise under a CommLog
    model = make_model()
    local_loss(model, 0, rank, world).backward()
    out["before"] = snapshot(model)
    with CommLog() as log:
        allreduce_gradients(model)
    out["grads"], out["after"] = snapshot(model, "grad"), snapshot(model)
    out["log"] = log.records()
    # training in float32: SGD steps with the exercise between backward and step
    model = make_model(dtype=torch.float32)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = local_loss(model, step, rank, world)
        loss.backward()
        allreduce_gradients(model)
        opt.step()
        losses.append(loss.detach())
    out["train"] = torch.stack(losses), snapshot(model)  # this rank's share of each loss
    # a subgroup: ranks 0 and 2 average between themselves; the others, which call the
    # function too, must return at once and change nothing
    if world >= 3:
        pair = dist.new_group(PAIR)
        model = make_model()
        local_loss(model, 0, rank, world).backward()
        returned = allreduce_gradients(model, group=pair)
        out["pair"] = snapshot(model, "grad")
        out["pair_returned"] = None if returned is None else type(returned).__name__
    return out


_runs, _readings = {}, {}


def run(student, world):
    """Every case at ``world`` ranks, launched once and shared by the tests; the bytes it
    put on the wire are kept in ``_readings``."""
    if world not in _runs:
        try:
            with wire.measure(world) as _readings[world]:
                _runs[world] = launch.run(rank_cases, world, student.allreduce_gradients,
                                          backend="gloo", timeout=30)
        except launch.RankError as e:
            hint = f" ({NONE_GRAD_HINT})" if "NoneType" in str(e) else ""
            _runs[world] = e if e.exc_type == "NotImplementedError" else AssertionError(
                f"allreduce_gradients at {world} rank(s): {str(e).splitlines()[0]}{hint}")
        except launch.LaunchError as e:
            _runs[world] = e
    if isinstance(_runs[world], Exception):
        raise _runs[world]
    return _runs[world]


def local_grads(world):
    """Each rank's own gradients, computed here in one process."""
    grads = []
    for rank in range(world):
        model = make_model()
        local_loss(model, 0, rank, world).backward()
        grads.append(snapshot(model, "grad"))
    return grads


def check_mean(actual, grads, ranks, where):
    """``actual`` holds, for each parameter with a gradient, the mean of ``grads`` over
    ``ranks``; say what it looks like instead when it does not."""
    for name, want_none in grads[ranks[0]].items():
        if want_none is None:
            continue
        got = actual[name]
        if got is None:
            raise AssertionError(f"{where}: the gradient of {name} became None")
        stack = torch.stack([grads[r][name] for r in ranks])
        mean = stack.mean(0)
        if len(ranks) > 1 and torch.allclose(got, stack.sum(0)) and not torch.allclose(got, mean):
            raise AssertionError(f"{where}: the gradient of {name} is the SUM over the ranks, "
                                 f"not the mean: divide by the number of ranks in the group")
        expect_close(got, mean, f"{where}: gradient of {name} (should be the mean over "
                                f"{len(ranks)} rank(s))")


WORLDS = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
def test_gradients_become_the_mean_over_ranks(student, world):
    out = run(student, world)
    grads = local_grads(world)
    for rank, r in enumerate(out):
        for name, g in r["grads"].items():
            if grads[rank][name] is None or g is None:
                continue  # parameters without a gradient: the next test's business
            if world > 1 and torch.equal(g, grads[rank][name]) and \
                    not torch.allclose(g, torch.stack([x[name] for x in grads]).mean(0)):
                raise AssertionError(f"rank {rank} of {world}: the gradient of {name} was not "
                                     f"changed: every parameter with a gradient must be averaged "
                                     f"(tied weights included: head.weight is tok_emb.weight)")
        check_mean(r["grads"], grads, list(range(world)), f"rank {rank} of {world}")


@pytest.mark.parametrize("world", WORLDS)
def test_parameters_without_gradient_are_untouched(student, world):
    for rank, r in enumerate(run(student, world)):
        for name in WITHOUT_GRAD:
            assert r["grads"][name] is None, (
                f"rank {rank} of {world}: {name} had no gradient (.grad None) but has one after "
                f"allreduce_gradients; leave parameters without a gradient alone")
        for name, value in r["after"].items():
            expect_close(value, r["before"][name], f"rank {rank} of {world}: the weights of "
                         f"{name} (allreduce_gradients must change gradients only)")


@pytest.mark.parametrize("world", WORLDS)
def test_one_all_reduce_of_each_gradient(student, world):
    """How the work was done: only all-reduces, and every gradient's bytes exactly once
    (a tied weight is one parameter; per-parameter calls or one flat buffer both pass)."""
    model = make_model()
    local_loss(model, 0, 0, world).backward()
    with_grad = [p for p in model.parameters() if p.grad is not None]
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in with_grad)
    for rank, r in enumerate(run(student, world)):
        log = CommLog.from_records(r["log"])
        others = sorted({e.op for e in log.events} - {"all_reduce"})
        assert not others, (f"rank {rank} of {world}: allreduce_gradients called {others}; "
                            f"one all_reduce (SUM) per gradient, then a division, is all it needs")
        count, nbytes = log.count("all_reduce"), log.nbytes("all_reduce")
        assert count >= 1, f"rank {rank} of {world}: no all_reduce was called"
        assert nbytes == grad_bytes, (
            f"rank {rank} of {world}: all-reduced {nbytes} bytes in {count} call(s), but the "
            f"gradients hold {grad_bytes} bytes in {len(with_grad)} tensors: reduce each gradient "
            f"exactly once (tied weights are one parameter; model.parameters() lists it once) "
            f"and nothing else (no weights, no parameters without a gradient)")
        assert count <= len(with_grad), (
            f"rank {rank} of {world}: {count} all_reduce calls for {len(with_grad)} gradients")
    # the launch: once in float64, STEPS times in float32 (half the bytes), once on PAIR;
    # the headers of one call per gradient (the most this test allows)
    calls = len(with_grad)
    once = (wire.gloo_bytes("all_reduce", grad_bytes, world, calls)
            + wire.gloo_bytes("all_reduce", grad_bytes // 2 * STEPS, world, calls * STEPS)
            + (wire.gloo_bytes("all_reduce", grad_bytes, len(PAIR), calls) if world >= 3 else 0))
    wire.at_most(_readings[world], once, f"allreduce_gradients at {world} rank(s), every "
                 f"step of the test (one all_reduce of each gradient)")


@pytest.mark.parametrize("world", WORLDS)
def test_training_matches_one_process_on_the_global_batch(student, world):
    """The correctness rule, in float32: SGD on ``world`` ranks with allreduce_gradients
    gives the losses and the weights of one process on the whole batch."""
    losses, want = one_process(make_model(dtype=torch.float32), STEPS, LR)
    out = run(student, world)
    got_losses = sum(r["train"][0] for r in out) / world  # the global batch's mean loss
    for rank, r in enumerate(out):
        weights = r["train"][1]
        for name, value in weights.items():
            expect_close(value, want[name], f"rank {rank} of {world}: weights of {name} after "
                         f"{STEPS} SGD steps, against one process on the whole batch",
                         rtol=1e-5, atol=1e-6)
        expect_close(got_losses, losses, f"rank {rank} of {world}: the loss of "
                     f"each step", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [3, 4])
def test_group_averages_over_its_own_ranks(student, world):
    """group=dist.new_group([0, 2]): ranks 0 and 2 average between the two of them."""
    out = run(student, world)
    grads = local_grads(world)
    for rank in PAIR:
        check_mean(out[rank]["pair"], grads, PAIR,
                   f"rank {rank} of {world}, in group {PAIR} (pass group= to the collective and "
                   f"divide by the size of the group, dist.get_world_size(group))")


@pytest.mark.parametrize("world", [3, 4])
def test_ranks_outside_the_group_change_nothing(student, world):
    """The ranks outside group=dist.new_group([0, 2]) call the function too: it must
    return at once (None) and leave their gradients as backward left them."""
    out = run(student, world)
    grads = local_grads(world)
    for rank in (r for r in range(world) if r not in PAIR):
        assert out[rank]["pair_returned"] is None, (
            f"rank {rank} of {world}: allreduce_gradients returned "
            f"{out[rank]['pair_returned']}; it returns nothing (None)")
        for name, want in grads[rank].items():
            got = out[rank]["pair"][name]
            if want is None:
                assert got is None, f"rank {rank} of {world}: {name} had no gradient and got one"
                continue
            if torch.allclose(got, -want) and not torch.allclose(got, want):
                raise AssertionError(
                    f"rank {rank} of {world} is not in the group {PAIR}, and the gradient of "
                    f"{name} came out with its sign flipped: there dist.get_world_size(group) "
                    f"is -1. A rank outside the group must return at once "
                    f"(dist.get_rank(group) < 0) and change nothing")
            expect_close(got, want, f"rank {rank} of {world}, not in the group {PAIR}: the "
                         f"gradient of {name} must stay as backward left it (return at once)")
