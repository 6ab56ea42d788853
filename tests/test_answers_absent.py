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
