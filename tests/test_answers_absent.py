"""The library's answers are absent from the ranks that grade them (issue "answers out
of the students' reach"). The walk of :mod:`absence` runs in every exercise's graded
ranks while the solutions are graded (tests/test_grading_solutions.py): it finds no code
object whose bytecode, constants and names equal one of that exercise's answers. Here:
the walk can fail, finding every answer where the library is loaded. The ways a cheating
cell would reach an answer are tests/test_grader_security.py's."""
from __future__ import annotations

from absence import WALK, answer_codes

from distlab.grading import answers


def test_the_walk_finds_the_answers_where_they_are_loaded():
    """The walk can fail: in this process, where the library is loaded, it finds every
    code object of every exercise's answers."""
    namespace: dict = {}
    exec(WALK, namespace)
    wanted = {exercise: answer_codes(exercise) for exercise in answers.ANSWERS}
    codes = namespace["_codes"]()
    assert len(codes) > 1000
    for exercise, refs in answers.ANSWERS.items():
        assert bool(wanted[exercise]) == bool(refs), exercise
        missed = [q for f, (q, _) in wanted[exercise].items() if f not in codes]
        assert not missed, (exercise, missed)


def test_exercises_share_a_run_only_when_their_answers_are_the_same_modules():
    """A run makes its exercises' answers absent together: only exercises answered by the
    same modules share one, and never one whose ranks import those modules."""
    from distlab.grading import labs, runner

    every = labs.exercises()
    needs = {n: set(labs.rank_imports(labs.TESTS / f"test_{n}.py"))
             for names in every.values() for n in names}
    assert runner.run_groups(list(every["03_ring_allreduce"]), needs) == [
        ["ring_reduce_scatter", "ring_all_gather", "ring_allreduce"]]
    assert runner.run_groups(list(every["06_tensor_parallel"]), needs) == [
        ["ColumnParallelLinear", "RowParallelLinear"], ["vocab_parallel_cross_entropy"]]
    assert len(runner.run_groups(list(every["05_zero"]), needs)) == 4
    held = answers.modules_of(["ring_allreduce"])
    assert runner.run_groups(["ring_reduce_scatter", "ring_allreduce"],
                             {"ring_reduce_scatter": set(), "ring_allreduce": {held[0]}}) == [
        ["ring_reduce_scatter"], ["ring_allreduce"]]
