"""Exercise zero2_step(flat_params, flat_grads, state, group=None, **adamw) of lab 05.

One ZeRO-2 step, in place: reduce-scatter (mean) of ``flat_grads``, AdamW on this rank's
shard of ``flat_params`` (``torch.tensor_split``'s pieces) with moments kept in
``state`` for that shard only, then all-gather of the updated shards. The buffer has
1001 elements (uneven over 2, 3 and 4 ranks); each rank has its own gradients. One
launch per world size runs three steps and returns, per step, every rank's parameters,
state and CommLog records; the expected values come from ``torch.optim.AdamW`` on the
mean gradient, computed here.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close

NOTEBOOK = "05_zero"
# the hint a student failing each test should open (Hint 1: the three moves; 2: equal
# pieces from uneven shards; 3: which calls; 4: the recipe)
HINTS = {"test_the_parameters_follow_adamw_on_the_mean_gradient": 1,
         "test_the_moments_are_those_of_the_mean_gradient": 1,
         "test_the_state_holds_this_ranks_shard_only": 4,
         "test_one_reduce_scatter_and_one_all_gather_per_step": 3,
         "test_the_remainder_is_updated": 2,
         "test_every_rank_holds_every_updated_shard": 2,
         "test_a_group_steps_between_its_own_ranks": 3,
         "test_float64_buffers_are_stepped_in_float64": 2,
         "test_flat_grads_is_left_as_it_was": 2}
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

NUMEL, STEPS = 1001, 3
ADAMW = dict(lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
RS_OPS = ("reduce_scatter_tensor", "reduce_scatter")
AG_OPS = ("all_gather_into_tensor", "all_gather")


def start_params(dtype=torch.float32):
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(0), dtype=dtype)


def grads_of(step, rank, dtype=torch.float32):
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank + 1),
                       dtype=dtype)


def plain(state):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def steps(zero2_step, group_ranks=None, dtype=torch.float32):
    """Three steps on this rank; with ``group_ranks``, over that subgroup (its members
    use their index in it as their rank)."""
    rank = dist.get_rank()
    group = dist.new_group(group_ranks) if group_ranks else None
    me = group_ranks.index(rank) if group_ranks and rank in group_ranks else rank
    params, state, out = start_params(dtype), {}, []
    for step in range(STEPS):
        grads = grads_of(step, me, dtype)
        with CommLog() as log:
            result = zero2_step(params, grads, state, group, **ADAMW)
        out.append({"params": params.clone(), "state": plain(state), "log": log.records(),
                    "returned": result is None, "grads_untouched": torch.equal(
                        grads, grads_of(step, me, dtype))})
    return out


_runs = {}


def run(student, world, group_ranks=None, dtype=torch.float32):
    key = (world, tuple(group_ranks or ()), dtype)
    if key not in _runs:
        try:
            _runs[key] = launch.run(steps, world, student.zero2_step, group_ranks, dtype,
                                    backend="gloo", timeout=60)
        except launch.LaunchError as e:
            _runs[key] = e
    if isinstance(_runs[key], Exception):
        raise _runs[key]
    return _runs[key]


def reference(world, grad_scale=1.0, dtype=torch.float32):
    """torch.optim.AdamW on the mean (times ``grad_scale``) of the ranks' gradients:
    per step the parameters and the whole moments."""
    p = torch.nn.Parameter(start_params(dtype))
    opt = torch.optim.AdamW([p], **ADAMW)
    out = []
    for step in range(STEPS):
        p.grad = grad_scale * torch.stack([grads_of(step, r, dtype)
                                           for r in range(world)]).mean(0)
        opt.step()
        s = opt.state[p]
        out.append({"params": p.detach().clone(), "exp_avg": s["exp_avg"].clone(),
                    "exp_avg_sq": s["exp_avg_sq"].clone()})
    return out


def moments(state):
    """AdamW's two moments in a student's state, under torch.optim.AdamW's names."""
    found = [state.get(k) for k in ("exp_avg", "exp_avg_sq")]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in found):
        raise AssertionError(f"state holds {sorted(state)}; keep AdamW's two moments in it as "
                             f"1-D tensors state['exp_avg'] and state['exp_avg_sq'] (and the "
                             f"step count in state['step'])")
    return found


def shard_bounds(rank, world):
    """``(start, end)`` of ``rank``'s shard of the buffer: torch.tensor_split's piece."""
    pieces = torch.arange(NUMEL).tensor_split(world)
    return sum(map(len, pieces[:rank])), sum(map(len, pieces[:rank + 1]))


WORLDS = [1, 2, 3, 4]
MULTI = [2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
def test_the_parameters_follow_adamw_on_the_mean_gradient(student, world):
    ref = reference(world)
    for rank, out in enumerate(run(student, world)):
        for step, (got, want) in enumerate(zip(out, ref)):
            expect_close(got["params"], want["params"], f"rank {rank} of {world}, step {step}: "
                         f"the parameters after zero2_step, against torch.optim.AdamW on the "
                         f"mean gradient", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", MULTI)
def test_the_moments_are_those_of_the_mean_gradient(student, world):
    """AdamW's update hardly changes when every gradient is scaled (the moments scale
    with it), so a summed gradient shows in the state, not in the parameters."""
    ref, summed = reference(world), reference(world, grad_scale=world)
    for rank, out in enumerate(run(student, world)):
        start, end = shard_bounds(rank, world)
        m, v = moments(out[0]["state"])
        if m.numel() != end - start:
            continue              # the size is the next test's business
        first = ref[0]["exp_avg"][start:end]
        if torch.allclose(m, summed[0]["exp_avg"][start:end], rtol=1e-4) and world > 1:
            raise AssertionError(f"rank {rank} of {world}: the momentum is that of the SUM of the "
                                 f"ranks' gradients, not of their mean: divide the reduce-scattered "
                                 f"gradient by the number of ranks in the group")
        expect_close(m, first, f"rank {rank} of {world}: the momentum (state) after the first "
                     f"step, (1 - beta1) times this rank's shard of the mean gradient",
                     rtol=1e-5, atol=1e-7)
        for step, (got, want) in enumerate(zip(out, ref)):
            m, v = moments(got["state"])
            expect_close(v, want["exp_avg_sq"][start:end], f"rank {rank} of {world}, step "
                         f"{step}: the second moment in state", rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("world", MULTI)
def test_the_state_holds_this_ranks_shard_only(student, world):
    for rank, out in enumerate(run(student, world)):
        start, end = shard_bounds(rank, world)
        for m in moments(out[-1]["state"]):
            assert m.numel() == end - start, (
                f"rank {rank} of {world}: a moment in state has {m.numel()} elements, but this "
                f"rank's shard has {end - start} (elements {start}..{end - 1}): ZeRO keeps the "
                f"optimizer state of its own shard only, that is the memory it saves"
                + (" (here it is full-size on every rank)" if m.numel() == NUMEL else ""))


@pytest.mark.parametrize("world", MULTI)
def test_one_reduce_scatter_and_one_all_gather_per_step(student, world):
    """CommLog counts a reduce-scatter by its input and an all-gather by its output
    (nccl-tests' convention): each of the two moves the buffer once, padded to equal
    pieces; an all-reduce would move it twice. Self-reported (CommLog only): under gloo a
    reduce_scatter moves as many bytes as an all_reduce (wire.py), so the wire cannot
    tell the mistake this test is about."""
    padded = world * -(-NUMEL // world) * 4
    for rank, out in enumerate(run(student, world)):
        for step, got in enumerate(out):
            log = CommLog.from_records(got["log"])
            where = f"rank {rank} of {world}, step {step}"
            if log.count("all_reduce"):
                raise AssertionError(
                    f"{where}: all_reduce of {log.nbytes('all_reduce')} bytes; each rank needs "
                    f"only its shard of the mean gradient, so a reduce-scatter (half the "
                    f"traffic of an all-reduce) belongs there")
            others = sorted(set(log.ops()) - set(RS_OPS + AG_OPS))
            assert not others, f"{where}: called {others}; one reduce-scatter and one all-gather " \
                               f"are all a ZeRO-2 step needs"
            for ops, what in ((RS_OPS, "reduce-scatter of the gradients"),
                              (AG_OPS, "all-gather of the updated shards")):
                assert log.count(ops) == 1, f"{where}: {log.count(ops)} calls for the {what}, " \
                                            f"expected one"
                assert NUMEL * 4 <= log.nbytes(ops) <= padded, (
                    f"{where}: the {what} moved {log.nbytes(ops)} bytes; the buffer is "
                    f"{NUMEL * 4} bytes ({padded} padded to {world} equal pieces)")


@pytest.mark.parametrize("world", [3, 4])
def test_the_remainder_is_updated(student, world):
    """1001 = 3·333 + 2 = 4·250 + 1: the last elements belong to the first ranks' longer
    shards, and must change as AdamW changes them."""
    ref = reference(world)
    tail = world * (NUMEL // world)
    for rank, out in enumerate(run(student, world)):
        got = out[0]["params"][tail:]
        if torch.equal(got, start_params()[tail:]):
            raise AssertionError(
                f"rank {rank} of {world}: elements {tail}..{NUMEL - 1} were never updated: with "
                f"shards of numel // world_size elements the remainder belongs to no rank; use "
                f"shard_range's pieces (the first numel % world_size ranks one element longer)")
        expect_close(got, ref[0]["params"][tail:], f"rank {rank} of {world}: the last "
                     f"{NUMEL - tail} element(s) after one step", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", MULTI)
def test_every_rank_holds_every_updated_shard(student, world):
    out = run(student, world)
    for step in range(STEPS):
        for rank in range(world):
            for other in range(world):
                start, end = shard_bounds(other, world)
                got, want = out[rank][step]["params"], out[other][step]["params"]
                if not torch.equal(got[start:end], want[start:end]):
                    raise AssertionError(
                        f"step {step}: rank {rank}'s elements {start}..{end - 1} differ from those "
                        f"rank {other} updated: after the local update, all-gather the shards so "
                        f"that every rank has the whole updated buffer")


@pytest.mark.parametrize("world", [3, 4])
def test_a_group_steps_between_its_own_ranks(student, world):
    """group=dist.new_group([0, 2]): ranks 0 and 2 are a ZeRO group of two (their index in
    the group is their rank); the others are not members and must return at once,
    touching nothing (no collective, no change to their buffers or state)."""
    two = run(student, 2)
    out = run(student, world, [0, 2])
    for rank in range(world):
        for step, got in enumerate(out[rank]):
            where = f"rank {rank} of {world}, group [0, 2], step {step}"
            if rank in (0, 2):
                expect_close(got["params"], two[[0, 2].index(rank)][step]["params"],
                             f"{where}: the parameters (pass group= to every collective and use "
                             f"dist.get_rank(group) and dist.get_world_size(group))",
                             rtol=1e-6, atol=1e-7)
            else:
                assert not got["log"], f"{where}: a rank outside the group called a collective"
                assert torch.equal(got["params"], start_params()) and not got["state"], (
                    f"{where}: a rank outside the group changed its parameters or state; "
                    f"return at once when dist.get_rank(group) is -1")
                assert got["returned"] and got["grads_untouched"], (
                    f"{where}: a rank outside the group must return None and leave its inputs")


def test_float64_buffers_are_stepped_in_float64(student):
    """The contract's buffers are float32 or float64 (lab 05's proof trains in float64):
    every buffer the step makes follows the inputs' dtype, and the result is AdamW's in
    float64, to float64's rounding, not float32's."""
    ref = reference(3, dtype=torch.float64)
    for rank, out in enumerate(run(student, 3, dtype=torch.float64)):
        for step, (got, want) in enumerate(zip(out, ref)):
            where = f"rank {rank} of 3, float64 buffers, step {step}"
            assert got["params"].dtype == torch.float64, (
                f"{where}: the parameters became {got['params'].dtype}; build every buffer "
                f"in the inputs' dtype (new_zeros, new_empty, zeros_like)")
            expect_close(got["params"], want["params"], f"{where}: the parameters against "
                         f"torch.optim.AdamW in float64", rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
def test_flat_grads_is_left_as_it_was(student, world):
    """Every member's flat_grads after each step equals the gradients it passed in."""
    for rank, out in enumerate(run(student, world)):
        for step, got in enumerate(out):
            assert got["grads_untouched"], (
                f"rank {rank} of {world}, step {step}: zero2_step changed the caller's "
                f"flat_grads (compared with the gradients passed in); it is read, never "
                f"written: pad or divide a copy (new_zeros, then copy the shards in)")
