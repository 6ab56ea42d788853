"""What the three ring exercises of lab 03 are tested on, and how their findings come back.

One launch per world size runs every case (lengths 0, 1, < K, prime, large; float32,
float16, bfloat16, int64) and keeps, per rank, the first wrong answer and the first sign
that the communication was not a ring (from CommLog); the tests read them.
"""
import sys

import cloudpickle
import pytest
import torch

from distlab import launch, ring
from distlab.comm import CommLog

TIMEOUT = 30
WORLD_SIZES = (1, 2, 3, 4)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers


def lengths(world_size):
    """Empty, one element, fewer than K, primes, large."""
    return sorted({0, 1, max(world_size - 1, 1), 7, 13, 100_003})


def inputs(numel, dtype, world_size, seed=0):
    """Every rank's input, the same on every rank: integers that every dtype sums
    exactly (large ones for int64, so that a detour through float shows), and normal
    floats for float32."""
    g = torch.Generator().manual_seed(1000 * numel + seed)
    if dtype == torch.int64:
        return [torch.randint(-2**40, 2**40, (numel,), generator=g) for _ in range(world_size)]
    if dtype == torch.float32:
        return [torch.randn(numel, generator=g) for _ in range(world_size)]
    return [torch.randint(-8, 8, (numel,), generator=g).to(dtype) for _ in range(world_size)]


def describe(numel, dtype, world_size):
    return f"{numel} {str(dtype).removeprefix('torch.')} elements on {world_size} ranks"


def call(name, fn, what, *args):
    """The student's function on one case; its exception says which case it was."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as exc:
        raise AssertionError(f"{name} raised {type(exc).__name__}: {exc} ({what})") from exc


def findings(name, fn, op, cases):
    """Run the student's ``fn`` on ``cases`` — (what, args, numel, check), where
    ``check(result)`` raises AssertionError — and keep the first wrong answer and the first
    sign, from CommLog, that the communication was not a ring."""
    wrong = comm = None
    for what, args, numel, check in cases:
        with CommLog() as log:
            result = call(name, fn, what, *args)
        if wrong is None:
            try:
                check(result)
            except AssertionError as exc:
                wrong = str(exc)
        problem = ring.check_traffic(log, op, numel, args[0].element_size())
        if comm is None and problem:
            comm = f"{what}: {problem}"
    return {"wrong": wrong, "comm": comm}


_runs = {}


def outcome(name, run_cases, student, world_size):
    """The ranks' findings for exercise ``name`` at ``world_size``, from one launch shared
    by that world size's tests (errors and deadlocks too)."""
    key = (name, world_size)
    if key not in _runs:
        try:
            _runs[key] = launch.run(run_cases, world_size, getattr(student, name),
                                    backend="gloo", timeout=TIMEOUT)
        except launch.LaunchError as exc:
            _runs[key] = exc
    if isinstance(_runs[key], Exception):
        raise _runs[key]
    return _runs[key]


def make_tests(name, run_cases):
    """The two tests every ring exercise has, per world size: the answers, the traffic."""
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_answer(student, world_size):
        for found in outcome(name, run_cases, student, world_size):
            assert found["wrong"] is None, found["wrong"]

    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_ring_traffic(student, world_size):
        for found in outcome(name, run_cases, student, world_size):
            assert found["comm"] is None, found["comm"]

    return test_answer, test_ring_traffic
