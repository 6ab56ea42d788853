"""Exercise one_f_one_b_schedule(num_stages, num_microbatches) of lab 07.

Per stage s of p: min(p-s-1, m) forwards (warm-up), then one forward and one backward
alternating (steady state), then the backwards left (cool-down); micro-batches in
increasing order. The
cases and the execution are in pp_cases.py.
"""
from distlab import pp
from pp_cases import GRID, first_tests, last_tests, student_table

NOTEBOOK = "07_pipeline_parallel"
# The hint to open (lab 07, section 3) beside each test's failure: 1 the cool-down's
# backwards, 2 the recipe, 3 the sizes that must raise.
HINTS = {"test_returns_one_list_of_actions_per_stage": 2,
         "test_every_micro_batch_forward_then_backward_once": 1,
         "test_stages_agree_and_nothing_waits_forever": 2, "test_bad_sizes_raise_value_error": 3,
         "test_non_integers_raise_value_error": 3, "test_writes_its_own_answer": 2,
         "test_warm_up_forwards": 2, "test_steady_state_alternates": 1,
         "test_holds_at_most_p_minus_s_micro_batches": 2, "test_exact_order": 2,
         "test_idle_time_is_the_bubble": 2}
NAME = "one_f_one_b_schedule"
(test_returns_one_list_of_actions_per_stage, test_every_micro_batch_forward_then_backward_once,
 test_stages_agree_and_nothing_waits_forever, test_bad_sizes_raise_value_error,
 test_non_integers_raise_value_error, test_writes_its_own_answer) = first_tests(NAME)


def test_warm_up_forwards(student):
    for p, m in GRID:
        for s, row in enumerate(student_table(student, NAME, p, m)):
            first_b = next((k for k, a in enumerate(row) if a[0] == "B"), len(row))
            warmup = min(p - s - 1, m)
            want = min(warmup + 1, m)
            assert first_b == want, (
                f"one_f_one_b_schedule({p}, {m}), stage {s} runs {first_b} forward"
                f"{'s' * (first_b != 1)} before its first backward; stage s of p warms up "
                f"with min(p-s-1, m) = {warmup} forwards, then runs one more forward and its "
                f"first backward "
                f"({want} forward{'s' * (want != 1)} before B0)")


def test_steady_state_alternates(student):
    for p, m in GRID:
        for s, row in enumerate(student_table(student, NAME, p, m)):
            warmup = min(p - s - 1, m)
            kinds = "".join(a[0] for a in row)
            want = "F" * warmup + "FB" * (m - warmup) + "B" * warmup
            assert kinds == want, (
                f"one_f_one_b_schedule({p}, {m}), stage {s} runs {kinds}; expected {want}: "
                f"warm-up, {warmup} forwards; steady state, forward and backward alternating; "
                f"cool-down, the {warmup} backwards left")


def test_holds_at_most_p_minus_s_micro_batches(student):
    for p, m in GRID:
        table = student_table(student, NAME, p, m)
        peaks = [pp.peak_in_flight(row) for row in table]
        want = [min(p - s, m) for s in range(p)]
        assert peaks == want, (
            f"one_f_one_b_schedule({p}, {m}): the stages hold at most {peaks} micro-batches' "
            f"activations at once; 1F1B holds min(p-s, m) = {want} (stage 0 the most, never "
            f"more than p)")


test_exact_order, test_idle_time_is_the_bubble = last_tests(NAME)
