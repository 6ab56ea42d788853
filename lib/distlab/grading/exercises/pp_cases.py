"""What the three schedule exercises of lab 07 (and run_stage's tables) are tested on.

The student's function runs once per case in one sandboxed rank (:func:`answer`), where
the library's answers to this lab (distlab.pp.tables) are absent, every name of them a
stand-in that raises the grader's refusal: an answer that merely calls them fails. Its
tables come back as plain data and are checked here: their format, each micro-batch
once each way, that they can run (:func:`distlab.pp.check_schedule`), the exact order of
the small tables written out in :data:`TABLES`, and the idle time of the ideal clock
(:func:`distlab.pp.simulate`) against the published bubble (p-1)/(m+p-1).
"""
import sys

import cloudpickle
import pytest

from distlab import launch, pp
from distlab.grading.answers import REFUSAL

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

GRID = [(p, m) for p in (4, 2, 3, 5, 1) for m in (6, 3, 1, 2, 4, 5, 7, 8)]  # typical first
RUNS = [(2, 3), (4, 3)]  # played on the ideal clock: m not a multiple of p, and m < p
TIMEOUT = 45

# The expected tables, written out (GPipe: the forwards, then the backwards; 1F1B: stage s
# of p warms up with min(p-s-1, m) forwards): (schedule, p, m) -> one line per stage. Also
# the tables run_stage is graded with.
TABLES = {
    ("gpipe", 1, 2): """F0 F1 B0 B1""",
    ("gpipe", 2, 1): """F0 B0
                        F0 B0""",
    ("gpipe", 2, 2): """F0 F1 B0 B1
                        F0 F1 B0 B1""",
    ("gpipe", 2, 3): """F0 F1 F2 B0 B1 B2
                        F0 F1 F2 B0 B1 B2""",
    ("gpipe", 3, 2): """F0 F1 B0 B1
                        F0 F1 B0 B1
                        F0 F1 B0 B1""",
    ("gpipe", 3, 4): """F0 F1 F2 F3 B0 B1 B2 B3
                        F0 F1 F2 F3 B0 B1 B2 B3
                        F0 F1 F2 F3 B0 B1 B2 B3""",
    ("gpipe", 4, 2): """F0 F1 B0 B1
                        F0 F1 B0 B1
                        F0 F1 B0 B1
                        F0 F1 B0 B1""",
    ("1f1b", 1, 2): """F0 B0 F1 B1""",
    ("1f1b", 2, 3): """F0 F1 B0 F2 B1 B2
                       F0 B0 F1 B1 F2 B2""",
    ("1f1b", 3, 2): """F0 F1 B0 B1
                       F0 F1 B0 B1
                       F0 B0 F1 B1""",
    ("1f1b", 3, 4): """F0 F1 F2 B0 F3 B1 B2 B3
                       F0 F1 B0 F2 B1 F3 B2 B3
                       F0 B0 F1 B1 F2 B2 F3 B3""",
    ("1f1b", 4, 3): """F0 F1 F2 B0 B1 B2
                       F0 F1 F2 B0 B1 B2
                       F0 F1 B0 F2 B1 B2
                       F0 B0 F1 B1 F2 B2""",
    ("1f1b", 4, 5): """F0 F1 F2 F3 B0 F4 B1 B2 B3 B4
                       F0 F1 F2 B0 F3 B1 F4 B2 B3 B4
                       F0 F1 B0 F2 B1 F3 B2 F4 B3 B4
                       F0 B0 F1 B1 F2 B2 F3 B3 F4 B4""",
    ("1f1b", 4, 6): """F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
                       F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5
                       F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5
                       F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5""",
}
SCHEDULE_OF = {"gpipe_schedule": "gpipe", "one_f_one_b_schedule": "1f1b"}


def expected_table(schedule: str, p: int, m: int) -> list:
    """The table of :data:`TABLES` for ``schedule`` on ``p`` stages and ``m`` micro-batches."""
    return [[(a[0], int(a[1:])) for a in line.split()]
            for line in TABLES[schedule, p, m].strip().splitlines()]


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


def check_order(fn, name):
    """The tables of :data:`TABLES`, action by action (their sizes are cases of GRID)."""
    for schedule, p, m in TABLES:
        if schedule == SCHEDULE_OF[name]:
            table = as_actions(table_of(fn, name, p, m))
            problem = first_difference(table, expected_table(schedule, p, m), name, p, m)
            assert problem is None, problem


def check_bubble(fn, name, p, m):
    """The table played on the ideal clock (:func:`distlab.pp.simulate`, backward twice a
    forward) keeps each stage idle (p-1)/(m+p-1) of the step: the bubble of the GPipe
    paper (Huang et al. 2019), which holds for 1F1B too."""
    table = as_actions(table_of(fn, name, p, m))
    idle, want = pp.idle_fraction(pp.simulate(table), p), (p - 1) / (m + p - 1)
    assert idle == pytest.approx(want, abs=1e-12), (
        f"{name}({p}, {m}) played on the ideal clock keeps the stages idle {idle:.4f} of the "
        f"step; the schedule's bubble is (p-1)/(m+p-1) = {want:.4f}: a stage waits where it "
        f"could already work")


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


def last_tests(name):
    """The tests both end with, after their own: the exact order of the written-out
    tables, and the bubble of the ideal clock on 2 and 4 stages."""
    def test_exact_order(student):
        check_order(getattr(student, name), name)

    @pytest.mark.parametrize("p, m", RUNS)
    def test_idle_time_is_the_bubble(student, p, m):
        check_bubble(getattr(student, name), name, p, m)

    return test_exact_order, test_idle_time_is_the_bubble
