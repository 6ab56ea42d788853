"""The labs as an nbgrader course, with the kit's grader as nbgrader's autograder.

    python -m distlab.grading.course COURSE_DIR [--lab 00_setup --lab 04_data_parallel]
    python -m distlab.grading.course release OUT --through NN   # the student edition

writes each solution notebook as the nbgrader assignment of the same name,
``COURSE_DIR/source/NN_name/NN_name.ipynb``, with an autograder cell after each exercise
cell: locked, ``"grade": true``, worth one point per test of that exercise's CPU tier
(the tests ``make grade`` runs on any machine). The cell runs the kit's grader on the
notebook file (nbgrader runs it in the notebook's folder) and its value is the cell's
score, which nbgrader takes as partial credit; so ``nbgrader autograde`` records the
points ``make grade`` gives. On a machine with GPUs the grader also runs the gpu tiers:
the cell then scores the share of the tests run that passed, scaled to its points.

It also writes ``COURSE_DIR/nbgrader_config.py`` when the course has none: the kit's
stub (so ``nbgrader generate_assignment`` gives exactly ``labs/`` plus the autograder
cells) and a cell timeout a whole lab fits in.

nbgrader's ``autograde`` runs the student's code in the same kernel as the autograder
cell, as it does for every nbgrader test: code in the notebook can change what the cell
does (``distlab.grading.course.autograde = lambda *a, **k: None`` leaves the cell
without output, which nbgrader scores as full credit). The path that cannot be tampered
with grades through the kit's contained grader, which runs student code only in
sandboxed processes, and writes the scores into nbgrader's gradebook:

    python -m distlab.grading.course COURSE_DIR --grade NN_name   # after nbgrader collect

(:func:`grade_submissions`; each autograder cell's grade gets the contained grader's
score as its manual score, which nbgrader's total uses over any auto score.) With
``--hidden-tests DIR`` the instructor's own tests (:func:`distlab.grading.hidden.hidden_tests`)
run too: each cell keeps its points, and scores the share of all its exercise's tests
run, the kit's and the hidden ones, that passed.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import nbformat

from distlab.grading import edition, labs, notebook, output, runner
from distlab.grading.hidden import hidden_tests as instructors_tests

SOLUTIONS = Path(__file__).resolve().parents[3] / "solutions"  # in a checkout of the kit
CONFIG = '''\
c = get_config()  # noqa: F821  (written by python -m distlab.grading.course)
# The kit's stub, as in labs/: the release equals labs/ plus the autograder cells.
c.ClearSolutions.code_stub = {"python": "raise NotImplementedError"}
# A lab runs for minutes, and each autograder cell runs that exercise's tests.
c.Execute.timeout = 1800
'''


def cpu_test_counts(names: list[str], tests_dir: Path = runner.TESTS) -> dict[str, int]:
    """Exercise name → its points on a CPU machine (one per test outside the GPU tiers)."""
    return {name: cpu for name, (cpu, _) in labs.test_counts(names, tests_dir).items()}


def autograder_cell(notebook_file: str, name: str, points: int):
    """The locked nbgrader test cell that grades exercise ``name``."""
    source = (f"# AUTOGRADER: the tests of {name}, as `make grade` runs them "
              f"(one point each)\n"
              f"from distlab.grading.course import autograde\n\n"
              f"autograde({notebook_file!r}, {name!r}, points={points})")
    return nbformat.v4.new_code_cell(source, metadata={"nbgrader": {
        "grade": True, "grade_id": f"{name}_tests", "locked": True, "points": points,
        "schema_version": 3, "solution": False, "task": False}})


def source_notebook(nb, notebook_file: str, points: dict[str, int]):
    """A copy of solution notebook ``nb`` with an autograder cell after each exercise."""
    out = nbformat.v4.new_notebook(metadata=nb.metadata)
    for cell in nb.cells:
        out.cells.append(cell)
        name = notebook.grade_id(cell)
        if name:
            out.cells.append(autograder_cell(notebook_file, name, points[name]))
    return out


def write_course(course: Path, labs: list[str] | None = None, solutions: Path = SOLUTIONS,
                 points: dict[str, int] | None = None) -> list[Path]:
    """Write the source notebooks (all of ``solutions``, or the ``labs`` named by their
    stem) into nbgrader course directory ``course``, and its config when it has none.
    ``points`` (exercise → points) defaults to each exercise's number of CPU tests."""
    every = sorted(solutions.glob("*.ipynb"))
    paths = [solutions / f"{lab}.ipynb" for lab in labs] if labs else every
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; the labs are "
                                    f"{', '.join(p.stem for p in every)}")
    books = {path: nbformat.read(path, as_version=4) for path in paths}
    if points is None:
        points = cpu_test_counts([name for nb in books.values()
                                  for name in notebook.exercises(nb)])
    written = []
    for path, nb in books.items():
        dest = course / "source" / path.stem / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(source_notebook(nb, path.name, points), dest)
        written.append(dest)
    config = course / "nbgrader_config.py"
    if not config.exists():
        config.write_text(CONFIG)
    return written


def autograde(notebook_file: str, name: str, points: int) -> float:
    """The autograder cell's work: grade exercise ``name`` of the notebook file with the
    kit's grader, print its verdict, and return the score out of ``points``."""
    [result] = runner.grade(Path(notebook_file), only=[name])
    print(output.table([result]))
    if not result.max_points:
        return 0.0
    return round(points * result.points / result.max_points, 3)


def grade_submissions(course: Path, assignment: str, db_url: str | None = None,
                      students: list[str] | None = None,
                      hidden_tests: Path | None = None
                      ) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Grade every submission of ``assignment`` in nbgrader's course ``course``
    (``submitted/STUDENT/ASSIGNMENT/*.ipynb``) with the kit's contained grader
    (:func:`distlab.grading.runner.grade`, which never runs the student's code in this
    process), and write each exercise's score into the gradebook (``db_url``, default
    the course's ``gradebook.db``): the grade of its autograder cell ``NAME_tests`` gets
    the score as its manual score, scaled to the cell's points. Returns student →
    "notebook/cell" → score, and what could not be graded: a submission that cannot be
    read or graded scores 0 in each of its cells, marked as needing a person's grade, and
    the batch goes on. The assignment must be in the gradebook
    (``nbgrader generate_assignment``). ``hidden_tests``: a folder of the instructor's
    own tests for the assignment's lab, counted with the kit's (a ValueError naming the
    fix for a file that is not one)."""
    from nbgrader.api import Gradebook, MissingEntry

    db_url = db_url or f"sqlite:///{Path(course).resolve() / 'gradebook.db'}"
    scores: dict[str, dict[str, float]] = {}
    errors: list[str] = []
    with (instructors_tests(hidden_tests, {assignment}) if hidden_tests else
          contextlib.nullcontext()) as hidden, Gradebook(db_url) as gb:
        gb.find_assignment(assignment)  # MissingEntry: generate the assignment first
        folder = Path(course) / "submitted"
        for student_dir in sorted(p for p in folder.glob("*") if p.is_dir()):
            student = student_dir.name
            if students and student not in students:
                continue
            paths = sorted((student_dir / assignment).glob("*.ipynb"))
            if not paths:
                continue
            gb.update_or_create_student(student)
            try:
                gb.find_submission(assignment, student)
            except MissingEntry:
                gb.add_submission(assignment, student)
            for path in paths:
                try:
                    results = [(r.exercise, r.points, r.max_points)
                               for r in runner.grade(path, hidden=hidden)]
                    problem = None
                except Exception as exc:  # noqa: BLE001 — one submission never stops the batch
                    problem = (f"{student}/{path.name} could not be graded "
                               f"({type(exc).__name__}: {str(exc)[:300]})")
                    results = [(name, 0, 0) for name in labs.exercises().get(labs.lab_of(path), ())]
                    errors.append(problem)
                for exercise, points, max_points in results:
                    try:
                        grade = gb.find_grade(f"{exercise}_tests", path.stem, assignment, student)
                    except MissingEntry:
                        continue  # not an exercise of this notebook in the gradebook
                    score = round(grade.max_score * points / max_points, 3) if max_points else 0.0
                    # a submission that could not be graded scores 0 and waits for a person
                    grade.manual_score, grade.needs_manual_grade = score, problem is not None
                    scores.setdefault(student, {})[f"{path.stem}/{grade.name}"] = score
            gb.db.commit()
    return scores, errors


def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["release"]:
        return edition.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m distlab.grading.course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("course", type=Path, help="the nbgrader course directory")
    parser.add_argument("--lab", action="append", help="only this lab (e.g. 00_setup)")
    parser.add_argument("--grade", metavar="ASSIGNMENT",
                        help="instead: grade the collected submissions of ASSIGNMENT with "
                             "the contained grader and write the scores into the gradebook")
    parser.add_argument("--hidden-tests", type=Path, metavar="DIR",
                        help="with --grade: the instructor's own test files for the "
                             "assignment's lab, counted with the kit's")
    args = parser.parse_args(argv)
    if args.hidden_tests and not args.grade:
        parser.error("--hidden-tests goes with --grade ASSIGNMENT")
    if args.grade:
        try:
            graded, errors = grade_submissions(args.course, args.grade,
                                               hidden_tests=args.hidden_tests)
        except ValueError as exc:
            parser.error(str(exc))
        for student, got in graded.items():
            print(f"{student}: " + ", ".join(f"{k} {v:g}" for k, v in got.items()))
        for problem in errors:
            print(f"error: {output.shown(problem)}", file=sys.stderr)
        return 1 if errors else 0
    try:
        written = write_course(args.course, args.lab)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    for path in written:
        print(f"wrote {path}")
    print(f"next, in {args.course}: nbgrader generate_assignment NN_name")
    return 0


if __name__ == "__main__":
    sys.exit(main())
