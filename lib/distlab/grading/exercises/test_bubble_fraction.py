"""Exercise bubble_fraction(num_stages, num_microbatches) of lab 07: the idle fraction
(p-1)/(m+p-1) of GPipe and 1F1B on equal stages. Expected values: the GPipe paper's
formula (Huang et al. 2019), and, for the tables written out in
pp_cases.TABLES, the idle time of the library's ideal clock (distlab.pp.simulate),
computed here; the student's function runs with the library's bubble_fraction and
schedules refused (pp_cases.answers)."""
import pytest

from distlab import pp
from pp_cases import (NOT_INTS, TABLES, answer, check_bad_sizes, check_not_ints,
                      check_own_answer, expected_table)

NOTEBOOK = "07_pipeline_parallel"
# The hint to open (lab 07, section 3) beside each test's failure: 1 the formula's two
# counts, 2 the sizes that must raise.
HINTS = {"test_matches_the_ideal_schedule": 1, "test_one_stage_has_no_bubble": 1,
         "test_many_micro_batches_shrink_the_bubble": 1, "test_returns_a_float": 1,
         "test_bad_sizes_raise_value_error": 2, "test_non_integers_raise_value_error": 2,
         "test_writes_its_own_answer": 1}
NAME = "bubble_fraction"
GRID = [(p, m) for p in (4, 2, 8, 3, 1, 5, 6, 7) for m in (8, 1, 3, 16, 2, 4, 5, 7, 12)]
LIMITS = [(p, m) for p in (2, 4, 8) for m in (1, 4, 16, 64, 1024)]
BAD_SIZES = [(0, 4), (2, 0), (-2, 5)]
PLAYED = sorted({(p, m) for _, p, m in TABLES})  # the sizes of the written-out tables
CASES = sorted(set(GRID + LIMITS + PLAYED + BAD_SIZES + [(1, 1), (1, 2), (1, 7)])) + NOT_INTS
SLIPS = {  # common slips, recognised to say what went wrong
    "the denominator is m+p-1 slots (m micro-batches plus p-1 to fill and drain the "
    "pipeline), not m+p": lambda p, m: (p - 1) / (m + p),
    "the numerator is the p-1 slots a stage waits, not p": lambda p, m: p / (m + p - 1),
    "that is idle time over busy time (p-1)/m; the bubble is idle time over the whole "
    "step, (p-1)/(m+p-1)": lambda p, m: (p - 1) / m,
    "stages and micro-batches are swapped": lambda p, m: (m - 1) / (m + p - 1),
}


def bubble(student, p, m):
    """The student's bubble_fraction(p, m) (all cases run once, in a sandboxed rank)."""
    return answer(student.bubble_fraction, NAME, (p, m), CASES)


def published(p, m):
    """The bubble of the GPipe paper: p-1 of the m+p-1 slots of a step idle."""
    return (p - 1) / (m + p - 1)


def played(schedule, p, m):
    """The idle fraction of a written-out table on the ideal clock (backward = 2 x forward)."""
    return pp.idle_fraction(pp.simulate(expected_table(schedule, p, m)), p)


def test_matches_the_ideal_schedule(student):
    cases = [(p, m, published(p, m)) for p, m in GRID]
    cases += [(p, m, played(schedule, p, m)) for schedule, p, m in TABLES]
    for p, m, want in cases:
        got = bubble(student, p, m)
        if got != pytest.approx(want, abs=1e-12):
            hint = next((why for why, slip in SLIPS.items()
                         if want != pytest.approx(slip(p, m)) and
                         got == pytest.approx(slip(p, m), abs=1e-12)), "")
            raise AssertionError(
                f"bubble_fraction({p}, {m}) is {got!r}; a pipeline of {p} stage"
                f"{'s' * (p != 1)} and {m} micro-batch{'es' * (m != 1)} is idle {want:.6f} of "
                f"the step" + (f": {hint}" if hint else ""))


def test_one_stage_has_no_bubble(student):
    for m in (1, 2, 7):
        assert bubble(student, 1, m) == 0, (
            f"bubble_fraction(1, {m}) is {bubble(student, 1, m)!r}: one stage never "
            f"waits for another")


def test_many_micro_batches_shrink_the_bubble(student):
    for p in (2, 4, 8):
        values = [bubble(student, p, m) for m in (1, 4, 16, 64, 1024)]
        assert values == sorted(values, reverse=True) and values[-1] < 0.01, (
            f"bubble_fraction({p}, m) for m = 1, 4, 16, 64, 1024 gives {values}: more "
            f"micro-batches must shrink the bubble towards 0")
        assert values[0] == pytest.approx((p - 1) / p), (
            f"bubble_fraction({p}, 1) is {values[0]!r}: with one micro-batch only one of the "
            f"{p} stages works at a time")


def test_returns_a_float(student):
    for p, m in ((1, 1), (4, 8)):
        got = bubble(student, p, m)
        assert isinstance(got, float), (f"bubble_fraction({p}, {m}) returned "
                                        f"{type(got).__name__}; return a float")


def test_bad_sizes_raise_value_error(student):
    check_bad_sizes(student.bubble_fraction, NAME, CASES, BAD_SIZES)


def test_non_integers_raise_value_error(student):
    check_not_ints(student.bubble_fraction, NAME, CASES)


def test_writes_its_own_answer(student):
    check_own_answer(student.bubble_fraction, NAME, CASES)
