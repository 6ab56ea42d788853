"""Lab 12's core exercises, first_divergence and fault_tolerant_step, graded on wrong
answers a student plausibly writes: each must lose points, with a first failing check
that names the mistake.

Each mutant is the solution's cell with a few lines changed, graded by the real grader
(``runner.grade(path, only=[exercise], first_failure=True)``), stopped at its first
failing check. fault_tolerant_step's are graded with real kills, each a grading run of
its replicas at 2 to 4 ranks (about 25 s on 2 cores): two of them, the commit rule and
the rejoin (a mean over replicas instead of rows, and a ReplicaLost let out of the step,
fail too, at the losses and at the survivors' test).
"""
import pytest

from mutants import assert_named, grade_mutant

LAB = "12_failures_at_scale"

DIVERGENCE = {
    # an entry the ring buffer dropped taken for one the rank never issued
    "dropped_entries_are_missing": [
        ('min(mine[r], default=math.inf) if records[r]["dropped"] else 1', "1")],
    # every rank compared in every group, members or not
    "compares_every_rank": [
        ("(parting(name, members) for name, members in groups.items())",
         "(parting(name, list(range(len(records)))) for name in groups)")],
    # a tie goes to the highest rank's kind
    "ties_to_the_highest_rank": [
        ("expected = kinds[min(r for r in here if counts[kinds[r]] == top)]",
         "expected = kinds[max(r for r in here if counts[kinds[r]] == top)]")],
    # the earliest parting, even one that another caused
    "a_consequence_can_be_first": [
        ("min([p for p in found if not waits_in_another(p)] or found, key=",
         "min(found, key=")],
}

RECOVERY = {
    # the vote taken, and ignored: a step whose all-reduce broke is applied
    "commits_a_broken_step": [
        ("    if not quorum.agree(ok):\n        optimizer.zero_grad(set_to_none=True)\n"
         "        return top, None\n", "    quorum.agree(ok)\n")],
    # the weights copied, the optimizer's state not
    "rejoins_with_the_weights_only": [
        ('        model.load_state_dict(state["model"])\n'
         '        optimizer.load_state_dict(state["optimizer"])',
         '        model.load_state_dict(state["model"])')],
}

MAX_POINTS = {"first_divergence": 7, "fault_tolerant_step": 9}
# name -> (verdict, what its first failing check must say)
EXPECTED = {
    "dropped_entries_are_missing": ("fail", ["test_runs_that_agree_give_none",
                                                "buffers of 2 entries",
                                                "every group's members agree"]),
    "compares_every_rank": ("fail", ["test_runs_that_agree_give_none", "no fault"]),
    "ties_to_the_highest_rank": ("partial", ["test_the_rank_and_the_collective_where_the_"
                                             "ranks_part", "2 ranks, rank 1"]),
    "a_consequence_can_be_first": ("partial", ["test_a_hang_that_another_caused_is_not_the_"
                                               "first", "resizes tp's first all-reduce"]),
    "commits_a_broken_step": ("partial", ["test_the_step_a_replica_died_in_is_discarded",
                                          "is discarded on every member"]),
    "rejoins_with_the_weights_only": ("partial", ["test_the_rejoined_replica_equals_its_",
                                                  "takes both from a healthy peer"]),
}


@pytest.mark.parametrize("name", list(DIVERGENCE) + list(RECOVERY))
def test_a_mutant_fails_and_its_mistake_is_named(tmp_path, name):
    exercise, changes = (("first_divergence", DIVERGENCE) if name in DIVERGENCE
                         else ("fault_tolerant_step", RECOVERY))
    result = grade_mutant(tmp_path, LAB, exercise, name, changes[name])
    assert_named(result, name, exercise, MAX_POINTS[exercise], *EXPECTED[name])
