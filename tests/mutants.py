"""Wrong answers graded as a student's would be: the solution notebook with its exercise
cell changed, through the real grader up to the first failing check (the message a
student reads first). Shared by tests/test_mutants_*.py."""
from pathlib import Path

import nbformat

from distlab.grading import notebook, runner

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"


def grade_mutant(folder: Path, lab: str, exercise: str, name: str, pairs) -> runner.Result:
    """Mutant ``name``'s :class:`~distlab.grading.runner.Result`: the solution's cell of
    ``exercise`` with the ``(old, new)`` replacements of ``pairs`` (each ``old`` must stand
    in it exactly once), written under ``folder`` and graded up to its first failure."""
    nb = nbformat.read(SOLUTIONS / f"{lab}.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if notebook.grade_id(c) == exercise]
    for old, new in pairs:
        assert cell.source.count(old) == 1, (
            f"the solution of {exercise} changed: mutant {name!r} no longer finds {old!r}")
        cell.source = cell.source.replace(old, new)
    path = folder / f"{lab}.ipynb"
    nbformat.write(nb, path)
    (result,) = runner.grade(path, only=[exercise], first_failure=True)
    return result


def lazy_grades(folder: Path, lab: str, exercise: str, changes: dict):
    """``grade(name)``: mutant ``name``'s Result (``changes[name]`` its replacements),
    graded when a test first asks for it, then kept. Each case of a mutant file is a unit
    of ``make test``'s workers of its own (tests/conftest.py), so a case grades only the
    mutant it names."""
    graded = {}

    def grade(name: str):
        if name not in graded:
            sub = folder / f"m{len(graded)}"
            sub.mkdir()
            graded[name] = grade_mutant(sub, lab, exercise, name, changes[name])
        return graded[name]
    return grade


def assert_named(result, name: str, exercise: str, max_points: int, verdict: str,
                 says: list) -> None:
    """Mutant ``name``'s ``result`` fails with ``verdict`` short of ``max_points`` of
    ``exercise``, its first failing check naming the mistake: every phrase of ``says``
    stands in its message."""
    assert result.exercise == exercise and result.points < result.max_points == max_points, \
        result
    assert result.verdict == verdict, result
    for words in says:
        assert words in result.message, f"{name}: {words!r} not in {result.message!r}"
