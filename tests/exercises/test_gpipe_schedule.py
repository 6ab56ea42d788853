"""Exercise gpipe_schedule(num_stages, num_microbatches) of lab 07.

Per stage, the ordered list of actions: F0 ... F(m-1), then B0 ... B(m-1) (first in,
first out, as torch's ScheduleGPipe). The cases and the execution are in pp_cases.py.
"""
import pytest

from distlab import pp
from pp_cases import (GRID, RUNS, as_actions, check_bad_sizes, check_dependencies,
                      check_each_once_forward_first, check_execution, check_format, check_order,
                      table_of)

NOTEBOOK = "07_pipeline_parallel"
NAME = "gpipe_schedule"


def test_returns_one_list_of_actions_per_stage(student):
    check_format(student.gpipe_schedule, NAME)


def test_every_micro_batch_forward_then_backward_once(student):
    check_each_once_forward_first(student.gpipe_schedule, NAME)


def test_stages_agree_and_nothing_waits_forever(student):
    check_dependencies(student.gpipe_schedule, NAME)


def test_all_forwards_before_the_first_backward(student):
    for p, m in GRID:
        for s, row in enumerate(as_actions(table_of(student.gpipe_schedule, p, m))):
            kinds = [a[0] for a in row]
            assert kinds == ["F"] * m + ["B"] * m, (
                f"gpipe_schedule({p}, {m}), stage {s} runs {''.join(kinds)}: GPipe runs the "
                f"{m} forwards of the batch, then its {m} backwards")


def test_backwards_first_in_first_out(student):
    for p, m in GRID:
        for s, row in enumerate(as_actions(table_of(student.gpipe_schedule, p, m))):
            order = [a[1] for a in row if a[0] == "B"]
            assert order == list(range(m)), (
                f"gpipe_schedule({p}, {m}), stage {s} runs its backwards in the order {order}: "
                f"GPipe here runs them first in, first out (B0 first), as torch's ScheduleGPipe")


def test_exact_order(student):
    check_order(student.gpipe_schedule, NAME, pp.gpipe_schedule)


def test_holds_every_micro_batch_at_its_peak(student):
    for p, m in GRID:
        table = as_actions(table_of(student.gpipe_schedule, p, m))
        peaks = [pp.peak_in_flight(row) for row in table]
        assert peaks == [m] * p, (
            f"gpipe_schedule({p}, {m}): the stages hold at most {peaks} micro-batches' "
            f"activations at once; GPipe holds all {m} on every stage before its first backward")


def test_bad_sizes_raise_value_error(student):
    check_bad_sizes(student.gpipe_schedule, NAME)


@pytest.mark.parametrize("p, m", RUNS)
def test_runs_and_trains_like_one_process(student, p, m):
    check_execution(student.gpipe_schedule, NAME, p, m)
