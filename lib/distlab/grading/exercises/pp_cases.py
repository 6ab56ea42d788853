"""What the three exercises of lab 07 are tested on.

The student's function runs once per case in one sandboxed rank (:func:`answer`), where
the library's reference answers (distlab.pp.tables) are absent, every name of them a
stand-in that raises the grader's refusal: an answer that merely calls them fails. Its
tables come
back as plain data and are checked here against the reference, then executed, as plain
data, by the library's runtime on gloo ranks beside the reference table; the losses,
weights and CommLogs come back to be checked here.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab import launch, pp
from distlab.comm import CommLog
from distlab.data import NGramLanguage
from distlab.grading import expect_close
from distlab.grading.answers import REFUSAL
from distlab.model import GPT, config
from distlab.collectives.p2p_check import nccl_deadlock

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

GRID = [(p, m) for p in (4, 2, 3, 5, 1) for m in (6, 3, 1, 2, 4, 5, 7, 8)]  # typical first
RUNS = [(2, 3), (4, 3)]  # executed: m not a multiple of p, and m < p
TIMEOUT = 45
VOCAB, BATCH, SEQ, STEPS, LR = 13, 6, 8, 2, 0.5
LANG = NGramLanguage(VOCAB, 3, seed=0)
CFG = config("test", vocab_size=VOCAB, n_layer=2)


def answers(fn, cases):
    """In a rank: ``fn(*args)`` for every case, each as {"value", "error"} (the
    exception's class name and message, or None)."""
    out = []
    for args in cases:
        try:
            value = fn(*args)
            out.append({"value": value, "error": None})
        except Exception as exc:
            out.append({"value": None, "error": [type(exc).__name__, str(exc)]})
    return out


_answers = {}


def _key(args):
    """``args`` told apart by type too: (True, 4) and (2.0, 4) are not (1, 4) and (2, 4)."""
    return tuple((type(a).__name__, a) for a in args)


def outcome(fn, name, args, cases):
    """What ``fn(*args)`` gave. The student's code runs once per exercise, on every one
    of ``cases``, in a one-rank launch; never in this process."""
    if name not in _answers:
        out = launch.run(answers, 1, fn, [list(c) for c in cases], backend="gloo",
                         timeout=TIMEOUT)[0]
        _answers[name] = {_key(c): o for c, o in zip(cases, out)}
    return _answers[name][_key(args)]


def answer(fn, name, args, cases):
    """``fn(*args)``; a NotImplementedError stays one (the exercise is not attempted),
    any other exception becomes a failure that says which call raised it."""
    got = outcome(fn, name, args, cases)
    if got["error"]:
        kind, message = got["error"]
        if kind == "NotImplementedError":
            raise NotImplementedError(message)
        raise AssertionError(f"{name}{tuple(args)} raised {kind}: {message}")
    return got["value"]


BAD_SIZES = [(0, 4), (2, 0), (-1, 3)]
NOT_INTS = [(2.0, 4), (4, 3.0), (True, 4), (3, True), ("2", 4)]  # each must raise ValueError
CASES = GRID + BAD_SIZES + NOT_INTS


def table_of(fn, name, p, m):
    """The student's table for (p, m)."""
    return answer(fn, name, (p, m), CASES)


def student_table(student, name, p, m):
    """The student's table for (p, m) as lists of (kind, micro-batch) tuples."""
    return as_actions(table_of(getattr(student, name), name, p, m))


def as_actions(table):
    """The table as lists of (kind, micro-batch) tuples (lists of two also accepted)."""
    return [[tuple(a) if isinstance(a, (list, tuple)) else a for a in row] for row in table]


def first_difference(got, want, name, p, m) -> str | None:
    if len(got) != len(want):
        return f"{name}({p}, {m}) has {len(got)} rows; one row per stage, {p} in all"
    for s, (g, w) in enumerate(zip(got, want)):
        if g != w:
            k = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            show = lambda row: " ".join(f"{a[0]}{a[1]}" if isinstance(a, tuple) and len(a) == 2
                                        else repr(a) for a in row)
            return (f"{name}({p}, {m}), stage {s}: {show(g)}; expected {show(w)} (first "
                    f"difference at position {k})")
    return None


def check_format(fn, name):
    for p, m in GRID:
        table = table_of(fn, name, p, m)
        assert isinstance(table, (list, tuple)) and len(table) == p, (
            f"{name}({p}, {m}) should return a list of {p} lists (one per stage), got "
            f"{type(table).__name__}" + (f" of length {len(table)}"
                                         if isinstance(table, (list, tuple)) else ""))
        for s, row in enumerate(table):
            bad = [a for a in row if not (isinstance(a, tuple) and len(a) == 2 and
                                          a[0] in ("F", "B") and type(a[1]) is int)]
            assert not bad, (f"{name}({p}, {m}), stage {s}: {bad[0]!r} is not an action; "
                             f"an action is a tuple (\"F\", i) or (\"B\", i) with i an int")


def check_each_once_forward_first(fn, name):
    for p, m in GRID:
        table = as_actions(table_of(fn, name, p, m))
        for s, row in enumerate(table):
            for i in range(m):
                for kind in ("F", "B"):
                    n = row.count((kind, i))
                    assert n == 1, (f"{name}({p}, {m}), stage {s} runs {kind}{i} {n} times; "
                                    f"every stage runs the forward and the backward of each of "
                                    f"the {m} micro-batches exactly once")
                assert row.index(("F", i)) < row.index(("B", i)), (
                    f"{name}({p}, {m}), stage {s} runs B{i} before F{i}: a backward needs "
                    f"the activations its forward saved")
            assert len(row) == 2 * m, (f"{name}({p}, {m}), stage {s} has {len(row)} actions; "
                                       f"{m} micro-batches make {2 * m}")


def check_dependencies(fn, name):
    for p, m in GRID:
        problem = pp.check_schedule(as_actions(table_of(fn, name, p, m)), p, m)
        assert problem is None, f"{name}({p}, {m}) cannot run: {problem}"


def check_order(fn, name, reference):
    for p, m in GRID:
        table = as_actions(table_of(fn, name, p, m))
        problem = first_difference(table, reference(p, m), name, p, m)
        assert problem is None, problem


def _raised(fn, name, args, cases):
    """The class name of the exception ``fn(*args)`` raised, None if it returned, and
    what it did in words."""
    got = outcome(fn, name, args, cases)
    kind = got["error"][0] if got["error"] else None
    if kind == "NotImplementedError":
        raise NotImplementedError(got["error"][1])
    return kind, f"raised {kind}" if kind else f"returned {got['value']!r}"


def check_bad_sizes(fn, name, cases=CASES, bad_sizes=BAD_SIZES):
    for args in bad_sizes:
        kind, did = _raised(fn, name, args, cases)
        assert kind == "ValueError", (
            f"{name}{args} {did}; raise ValueError when num_stages or num_microbatches is "
            f"below 1")


def check_not_ints(fn, name, cases=CASES, not_ints=NOT_INTS):
    for args in not_ints:
        kind, did = _raised(fn, name, args, cases)
        assert kind == "ValueError", (
            f"{name}({', '.join(map(repr, args))}) {did}; raise ValueError for a size that "
            f"is not an int: a float such as 2.0, a bool (True is an int to isinstance, so "
            f"test type(x) is int) or a string")


def check_own_answer(fn, name, cases=CASES):
    """No case reached the library's reference (absent while the student's code runs)."""
    for args in cases:
        got = outcome(fn, name, args, cases)
        if got["error"] and got["error"][0] == "NotImplementedError":
            raise NotImplementedError(got["error"][1])
        assert not (got["error"] and REFUSAL in got["error"][1]), (
            f"{name}({', '.join(map(repr, args))}): {got['error'][1]} (the lab's "
            f"pp.{name} is the answer the grader compares with, not part of yours)")


# ------------------------------------------------------- executing a table for real


def sgd(module, lr=None):
    """One SGD step of ``module`` (``lr``: default the cases' LR), gradients cleared."""
    lr = LR if lr is None else lr
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def execute(tables):
    """The library's runtime trains the GPT with each table as it is (no check first: a
    table that cannot run hangs until the launch's timeout). Plain data back."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for table in tables:
        torch.manual_seed(0)
        stage = pp.Stage(GPT(CFG), rank, world)
        runner = pp.PipelineRunner(stage, table, check=False)
        losses = []
        with CommLog() as log:
            for step in range(STEPS):
                loss = runner.step(*LANG.batch(step, BATCH, SEQ))
                sgd(stage)
                losses.append(None if loss is None else loss.item())
        out.append({"losses": losses, "log": log.records(),
                    "params": {n: p.detach().clone()
                               for n, p in stage.module.named_parameters(remove_duplicate=False)}})
    return out


def check_execution(fn, name, p, m, reference):
    """The student's table and the reference one, trained in the same launch: the same
    losses and weights (the library's tests hold the reference to one process), and
    transfers that NCCL would run."""
    table = as_actions(table_of(fn, name, p, m))
    ranks = launch.run(execute, p, [table, reference(p, m)], backend="gloo", timeout=TIMEOUT)
    (got, want) = ([r[k] for r in ranks] for k in (0, 1))
    expect_close(torch.tensor(got[-1]["losses"]), torch.tensor(want[-1]["losses"]),
                 f"{name}({p}, {m}) run by the pipeline runtime: the loss of each of {STEPS} "
                 f"SGD steps, against the reference schedule", rtol=1e-5, atol=1e-6)
    for s, (g, w) in enumerate(zip(got, want)):
        for n, value in g["params"].items():
            expect_close(value, w["params"][n], f"{name}({p}, {m}) run by the pipeline "
                         f"runtime, stage {s}: {n} after {STEPS} SGD steps", rtol=1e-5, atol=1e-6)
    problem = nccl_deadlock([r["log"] for r in got])
    assert problem is None, f"{name}({p}, {m}) ran on gloo but would hang on NCCL: {problem}"


def first_tests(name):
    """The tests both schedule exercises start with: the format, each action once, a
    table that can run, bad sizes, sizes that are not ints, no call of the reference."""
    def test_returns_one_list_of_actions_per_stage(student):
        check_format(getattr(student, name), name)

    def test_every_micro_batch_forward_then_backward_once(student):
        check_each_once_forward_first(getattr(student, name), name)

    def test_stages_agree_and_nothing_waits_forever(student):
        check_dependencies(getattr(student, name), name)

    def test_bad_sizes_raise_value_error(student):
        check_bad_sizes(getattr(student, name), name)

    def test_non_integers_raise_value_error(student):
        check_not_ints(getattr(student, name), name)

    def test_writes_its_own_answer(student):
        check_own_answer(getattr(student, name), name)

    return (test_returns_one_list_of_actions_per_stage,
            test_every_micro_batch_forward_then_backward_once,
            test_stages_agree_and_nothing_waits_forever, test_bad_sizes_raise_value_error,
            test_non_integers_raise_value_error, test_writes_its_own_answer)


def last_tests(name, reference):
    """The tests both end with, after their own: the exact order, and runs on 2 and 4
    ranks beside the reference."""
    def test_exact_order(student):
        check_order(getattr(student, name), name, reference)

    @pytest.mark.parametrize("p, m", RUNS)
    def test_runs_and_trains_like_the_reference(student, p, m):
        check_execution(getattr(student, name), name, p, m, reference)

    return test_exact_order, test_runs_and_trains_like_the_reference
