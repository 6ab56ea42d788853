"""What the three ring exercises of lab 03 are tested on, and how.

One launch per exercise, world size and group runs the student's function on every
case (lengths 0, 1, < K, prime, large; float32, float16, bfloat16, int64) and returns
plain data only: per case, the answer, the input as it was left, and the CommLog
records. Every check runs here, in the test process: the answer against the sum
computed here, the traffic against a ring
(:func:`distlab.collectives.ring_traffic.check_traffic`), and all ranks' calls against
NCCL's rules (:func:`distlab.collectives.p2p_check.nccl_deadlock`).

ring_reduce_scatter's traffic points rest on the bytes counted on the wire during the
launch (:mod:`distlab.grading.wire`): a ring moves (K-1)/K of the buffer per rank, and
gloo's reduce_scatter or all_reduce, called behind the tracer's back under a forged log,
twice that. The other two stay self-reported: gloo's all_gather and all_reduce move
exactly what a ring all-gather and all-reduce move (measured), so no byte count tells a
forged ring from gloo's call; the ring's shape (who sends to whom) only the CommLog shows.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.collectives import ring_traffic
from distlab.comm import CommLog
from distlab.grading import expect_close, wire
from distlab.collectives.p2p_check import nccl_deadlock

TIMEOUT = 60
WORLD_SIZES = (1, 2, 3, 4)
SUBGROUP = (1, 2, 3)  # of 4 ranks: group ranks are not global ranks, and rank 0 is outside
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
OPS = {"ring_reduce_scatter": "reduce_scatter", "ring_all_gather": "all_gather",
       "ring_allreduce": "all_reduce"}
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers


def lengths(world_size):
    """Empty, one element, fewer than K, primes, large."""
    return sorted({0, 1, max(world_size - 1, 1), 7, 13, 100_003})


def inputs(numel, dtype, world_size, seed=0):
    """Every rank's input, the same on every rank and in the test process: integers that
    every dtype sums exactly (large ones for int64, so that a detour through float shows),
    and normal floats for float32."""
    g = torch.Generator().manual_seed(1000 * numel + seed)
    if dtype == torch.int64:
        return [torch.randint(-2**40, 2**40, (numel,), generator=g) for _ in range(world_size)]
    if dtype == torch.float32:
        return [torch.randn(numel, generator=g) for _ in range(world_size)]
    return [torch.randint(-8, 8, (numel,), generator=g).to(dtype) for _ in range(world_size)]


def cases(name, world_size):
    """(shape, dtype) of every case; ring_allreduce also takes a 2-D tensor."""
    shapes = [((n,), dt) for n in lengths(world_size) for dt in DTYPES]
    return shapes + ([((3, 5), torch.float32)] if name == "ring_allreduce" else [])


def argument(name, shape, dtype, members, rank):
    """The tensor rank ``rank`` (global) passes: its input, or for ring_all_gather its
    chunk of the full buffer."""
    K, numel = len(members), torch.Size(shape).numel()
    if name == "ring_all_gather":
        return torch.tensor_split(inputs(numel, dtype, 1)[0], K)[members.index(rank)].clone()
    return inputs(numel, dtype, K)[members.index(rank)].reshape(shape).clone()


def expected(name, shape, dtype, members, rank):
    K, numel = len(members), torch.Size(shape).numel()
    if name == "ring_all_gather":
        return inputs(numel, dtype, 1)[0]
    total = sum(x.double() for x in inputs(numel, dtype, K)).to(dtype) if dtype != torch.int64 \
        else sum(inputs(numel, dtype, K))
    if name == "ring_reduce_scatter":
        return torch.tensor_split(total, K)[members.index(rank)]
    return total.reshape(shape)


def where(members, world_size):
    return (f"on {len(members)} ranks" if len(members) == world_size
            else f"on the group of global ranks {list(members)}")


def describe(shape, dtype, members, world_size):
    return (f"{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')} elements "
            f"{where(members, world_size)}")


# ---------------------------------------------------------------------- in the ranks


def run_cases(fn, name, members):
    """Every case on this rank; plain data only. A rank outside ``members`` calls ``fn``
    once and reports what it returned and whether its tensor was left alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(members)) if len(members) < world else None
    if rank not in members:
        x = torch.arange(6.0)
        try:
            out = fn(*((x, 6) if name == "ring_all_gather" else (x,)), group=group)
        except NotImplementedError:
            raise
        except Exception as exc:
            return {"outside": (f"raised {type(exc).__name__}: {exc}", x)}
        return {"outside": (f"returned a {type(out).__name__}", x)}
    found = []
    for shape, dtype in cases(name, len(members)):
        x = argument(name, shape, dtype, list(members), rank)
        args = (x, torch.Size(shape).numel()) if name == "ring_all_gather" else (x,)
        with CommLog() as log:
            try:
                out = fn(*args, group=group)
            except NotImplementedError:
                raise
            except Exception as exc:  # the student's error, said for this case
                found.append({"raised": f"{type(exc).__name__}: {exc}", "log": log.records()})
                continue
        found.append({"out": out if isinstance(out, torch.Tensor) and out is not x else None,
                      "out_is_input": out is x, "type": type(out).__name__, "input": x,
                      "log": log.records()})
    return {"cases": found}


# ----------------------------------------------------------------- in the test process

_runs, _readings = {}, {}


def outcome(student, name, members, world_size):
    """Every rank's findings for exercise ``name`` on ``members`` of ``world_size`` ranks,
    from one launch shared by the tests that need it (errors and deadlocks too); the
    bytes it put on the wire are kept for :func:`check_wire`."""
    key = (name, tuple(members), world_size)
    if key not in _runs:
        with wire.measure(world_size) as _readings[key]:
            try:
                _runs[key] = launch.run(run_cases, world_size, getattr(student, name), name,
                                        tuple(members), backend="gloo", timeout=TIMEOUT)
            except launch.LaunchError as exc:
                _runs[key] = exc
    if isinstance(_runs[key], Exception):
        raise _runs[key]
    return _runs[key]


def check_answers(name, runs, members, world_size):
    for rank in members:
        for (shape, dtype), found in zip(cases(name, len(members)), runs[rank]["cases"]):
            what = describe(shape, dtype, members, world_size)
            assert "raised" not in found, f"{name} raised {found.get('raised')} ({what})"
            want = expected(name, shape, dtype, list(members), rank)
            if name == "ring_allreduce":
                assert found["out_is_input"], (
                    f"ring_allreduce of {what} returned a {found['type']}; return the tensor "
                    f"passed in, which holds the sum (in place)")
                got = found["input"]
                where = (f"rank {rank}'s tensor after ring_allreduce of {what} (the sum must "
                         f"land in the tensor passed in, in place)")
            else:
                got = found["out"] if found["out"] is not None else found["type"]
                where = (f"rank {rank}'s chunk of the sum of {what}" if name == "ring_reduce_scatter"
                         else f"rank {rank}'s gathered buffer of {what} (chunk r from rank r, 1-D)")
                if isinstance(got, torch.Tensor) and name == "ring_reduce_scatter" \
                        and got.numel() != want.numel():
                    raise AssertionError(
                        f"rank {rank}'s chunk of {what} has {got.numel()} elements, but should "
                        f"have {want.numel()}: chunks follow torch.tensor_split (the first n % K "
                        f"chunks are one element longer)")
                if not isinstance(got, torch.Tensor):
                    raise AssertionError(f"{where}: expected a tensor, got {got}")
            expect_close(got, want, where)


def check_traffic(name, runs, members, world_size):
    for rank in members:
        for (shape, dtype), found in zip(cases(name, len(members)), runs[rank]["cases"]):
            what = describe(shape, dtype, members, world_size)
            log = CommLog.from_records(found["log"], rank)
            problem = ring_traffic.check_traffic(log, OPS[name], torch.Size(shape).numel(),
                                                 torch.empty((), dtype=dtype).element_size(),
                                                 ranks=list(members))
            assert problem is None, f"{what}: {problem}"


def check_wire(name, members, world_size):
    """ring_reduce_scatter: the bytes counted on the wire during the launch, at most what
    a ring moves on every case (:func:`distlab.collectives.ring_traffic.bytes_sent`, summed
    over the members); a subgroup's handshakes fall within the wire's slack. The other two
    exercises are not checked: gloo's own all_gather and all_reduce move exactly what
    their rings move, so the bytes would pass a forged log (their points stay
    self-reported)."""
    if name != "ring_reduce_scatter":
        return
    op, K = OPS[name], len(members)
    ring_bytes = sum(ring_traffic.bytes_sent(op, torch.Size(shape).numel(),
                                             torch.empty((), dtype=dtype).element_size(), r, K)
                     for shape, dtype in cases(name, K) for r in range(K))
    wire.at_most(_readings[(name, tuple(members), world_size)], ring_bytes,
                 f"{name}, all cases {where(members, world_size)} (a ring moves (K-1)/K of "
                 f"the buffer per rank)")


def check_nccl(name, runs, members, world_size):
    order = sorted(enumerate(cases(name, len(members))),  # the largest first, in messages
                   key=lambda case: -torch.Size(case[1][0]).numel())
    for i, (shape, dtype) in order:
        logs = [runs[r]["cases"][i]["log"] if r in members else None for r in range(world_size)]
        problem = nccl_deadlock(logs)
        assert problem is None, (
            f"{name} of {describe(shape, dtype, members, world_size)} runs on gloo, but on "
            f"GPUs it would not: {problem}")


def make_tests(name):
    """The tests every ring exercise has."""

    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_answer(student, world_size):
        members = tuple(range(world_size))
        check_answers(name, outcome(student, name, members, world_size), members, world_size)

    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_ring_traffic(student, world_size):
        members = tuple(range(world_size))
        check_traffic(name, outcome(student, name, members, world_size), members, world_size)
        check_wire(name, members, world_size)

    def test_on_a_subgroup(student):
        """Ranks 1, 2, 3 of 4: group ranks 0, 1, 2 are global ranks 1, 2, 3."""
        runs = outcome(student, name, SUBGROUP, 4)
        check_answers(name, runs, SUBGROUP, 4)
        check_traffic(name, runs, SUBGROUP, 4)
        check_wire(name, SUBGROUP, 4)

    def test_outside_the_group(student):
        what, x = outcome(student, name, SUBGROUP, 4)[0]["outside"]
        assert what == "returned a NoneType", (
            f"rank 0 is not a member of the group {list(SUBGROUP)}; {name} should return None "
            f"at once there (as torch.distributed's collectives do), but it {what}")
        expect_close(x, torch.arange(6.0), "the tensor of rank 0, outside the group (it must "
                                           "be left as it was)")

    def test_would_not_hang_on_nccl(student):
        """NCCL's rules, checked from the calls every rank made (2, 3 and 4 ranks, and the
        subgroup)."""
        for world_size in WORLD_SIZES[1:]:
            members = tuple(range(world_size))
            check_nccl(name, outcome(student, name, members, world_size), members, world_size)
        check_nccl(name, outcome(student, name, SUBGROUP, 4), SUBGROUP, 4)

    return test_answer, test_ring_traffic, test_on_a_subgroup, test_outside_the_group, \
        test_would_not_hang_on_nccl


def on_gpus(fn, name, numel):
    """The student's function on GPUs, each rank's answer back on the CPU."""
    rank, K = dist.get_rank(), dist.get_world_size()
    from distlab import backend

    x = argument(name, (numel,), torch.float32, list(range(K)), rank).to(backend.device())
    out = fn(*((x, numel) if name == "ring_all_gather" else (x,)))
    return (x if name == "ring_allreduce" else out).cpu()


def check_on_gpus(student, name):
    numel, K = 1 << 20, 2
    answers = launch.run(on_gpus, K, getattr(student, name), name, numel, backend="nccl",
                         timeout=TIMEOUT)
    for rank, got in enumerate(answers):
        expect_close(got, expected(name, (numel,), torch.float32, list(range(K)), rank),
                     f"rank {rank}'s answer of {name} on {K} GPUs")
