"""Exercise one_f_one_b_schedule(num_stages, num_microbatches) of lab 07.

Per stage s of p: min(p-s-1, m) warm-up forwards, then one forward and one backward
alternating, then the remaining backwards; micro-batches in increasing order. The
cases and the execution are in pp_cases.py.
"""
import pytest

from distlab import pp
from pp_cases import (GRID, RUNS, as_actions, check_bad_sizes, check_dependencies,
                      check_each_once_forward_first, check_execution, check_format, check_order,
                      table_of)

NOTEBOOK = "07_pipeline_parallel"
NAME = "one_f_one_b_schedule"


def test_returns_one_list_of_actions_per_stage(student):
    check_format(student.one_f_one_b_schedule, NAME)


def test_every_micro_batch_forward_then_backward_once(student):
    check_each_once_forward_first(student.one_f_one_b_schedule, NAME)


def test_stages_agree_and_nothing_waits_forever(student):
    check_dependencies(student.one_f_one_b_schedule, NAME)


def test_warm_up_forwards(student):
    for p, m in GRID:
        for s, row in enumerate(as_actions(table_of(student.one_f_one_b_schedule, p, m))):
            first_b = next((k for k, a in enumerate(row) if a[0] == "B"), len(row))
            warmup = min(p - s - 1, m)
            want = min(warmup + 1, m)
            assert first_b == want, (
                f"one_f_one_b_schedule({p}, {m}), stage {s} runs {first_b} forward"
                f"{'s' * (first_b != 1)} before its first backward; stage s of p warms up with min(p-s-1, m) = {warmup} "
                f"forwards, then runs one more forward and its first backward "
                f"({want} forward{'s' * (want != 1)} before B0)")


def test_steady_state_alternates(student):
    for p, m in GRID:
        for s, row in enumerate(as_actions(table_of(student.one_f_one_b_schedule, p, m))):
            warmup = min(p - s - 1, m)
            kinds = "".join(a[0] for a in row)
            want = "F" * warmup + "FB" * (m - warmup) + "B" * warmup
            assert kinds == want, (
                f"one_f_one_b_schedule({p}, {m}), stage {s} runs {kinds}; expected {want}: "
                f"{warmup} warm-up forwards, then forward and backward alternating, then the "
                f"{warmup} backwards left")


def test_exact_order(student):
    check_order(student.one_f_one_b_schedule, NAME, pp.one_f_one_b_schedule)


def test_holds_at_most_p_minus_s_micro_batches(student):
    for p, m in GRID:
        table = as_actions(table_of(student.one_f_one_b_schedule, p, m))
        peaks = [pp.peak_in_flight(row) for row in table]
        want = [min(p - s, m) for s in range(p)]
        assert peaks == want, (
            f"one_f_one_b_schedule({p}, {m}): the stages hold at most {peaks} micro-batches' "
            f"activations at once; 1F1B holds min(p-s, m) = {want} (stage 0 the most, never "
            f"more than p)")


def test_bad_sizes_raise_value_error(student):
    check_bad_sizes(student.one_f_one_b_schedule, NAME)


@pytest.mark.parametrize("p, m", RUNS)
def test_runs_and_trains_like_one_process(student, p, m):
    check_execution(student.one_f_one_b_schedule, NAME, p, m)
