"""Exercise gpipe_schedule(num_stages, num_microbatches) of lab 07.

Per stage, the ordered list of actions: F0 ... F(m-1), then B0 ... B(m-1) (first in,
first out, as torch's ScheduleGPipe). The cases and the execution are in pp_cases.py.
"""
from distlab import pp
from pp_cases import GRID, first_tests, last_tests, student_table

NOTEBOOK = "07_pipeline_parallel"
# The hint to open (lab 07, section 3) beside each test's failure: 1 the sizes that must
# raise, 2 the table.
HINTS = {"test_returns_one_list_of_actions_per_stage": 2,
         "test_every_micro_batch_forward_then_backward_once": 2,
         "test_stages_agree_and_nothing_waits_forever": 2, "test_bad_sizes_raise_value_error": 1,
         "test_non_integers_raise_value_error": 1, "test_writes_its_own_answer": 2,
         "test_all_forwards_before_the_first_backward": 2,
         "test_backwards_first_in_first_out": 2, "test_holds_every_micro_batch_at_its_peak": 2,
         "test_exact_order": 2, "test_idle_time_is_the_bubble": 2}
NAME = "gpipe_schedule"
(test_returns_one_list_of_actions_per_stage, test_every_micro_batch_forward_then_backward_once,
 test_stages_agree_and_nothing_waits_forever, test_bad_sizes_raise_value_error,
 test_non_integers_raise_value_error, test_writes_its_own_answer) = first_tests(NAME)


def test_all_forwards_before_the_first_backward(student):
    for p, m in GRID:
        for s, row in enumerate(student_table(student, NAME, p, m)):
            kinds = [a[0] for a in row]
            assert kinds == ["F"] * m + ["B"] * m, (
                f"gpipe_schedule({p}, {m}), stage {s} runs {''.join(kinds)}: GPipe runs the "
                f"{m} forwards of the batch, then its {m} backwards")


def test_backwards_first_in_first_out(student):
    for p, m in GRID:
        for s, row in enumerate(student_table(student, NAME, p, m)):
            order = [a[1] for a in row if a[0] == "B"]
            assert order == list(range(m)), (
                f"gpipe_schedule({p}, {m}), stage {s} runs its backwards in the order {order}: "
                f"GPipe here runs them first in, first out (B0 first), as torch's ScheduleGPipe")


def test_holds_every_micro_batch_at_its_peak(student):
    for p, m in GRID:
        table = student_table(student, NAME, p, m)
        peaks = [pp.peak_in_flight(row) for row in table]
        assert peaks == [m] * p, (
            f"gpipe_schedule({p}, {m}): the stages hold at most {peaks} micro-batches' "
            f"activations at once; GPipe holds all {m} on every stage before its first backward")


test_exact_order, test_idle_time_is_the_bubble = last_tests(NAME)
