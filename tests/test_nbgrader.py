"""nbgrader, for real: the course that ``python -m distlab.grading.course`` writes goes through
nbgrader's own ``generate_assignment`` and ``autograde`` (command line, as an instructor
runs them).

- The release nbgrader generates from solutions/ is labs/ plus one autograder cell after
  each exercise: every other cell's source equal, no outputs.
- ``nbgrader autograde`` of a lab filled in with a partly wrong answer records, in its
  gradebook, the points the kit's grader (``make grade``) gives the same notebook: the
  autograder cell prints the kit's verdict row, and the gradebook must agree with it.
- The contained path (``python -m distlab.grading.course COURSE --grade``) writes the
  gradebook, with the instructor's hidden tests counted.

The release check and the contained path share one release of every lab
(``TestTheReleaseOfEveryLab``), each grading in its own copy of that course.

Skipped where nbgrader is not installed (it comes with the ``[dev]`` extra).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytest.importorskip("nbgrader")

from distlab.grading import course
from distlab.grading import notebook  # noqa: E402
from test_hidden_tests import FAILS, hidden_folder  # noqa: E402  (tests/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
# lab 00's exercise, with the mistake the lab warns about: a rank outside the group
# divides by dist.get_world_size(group), which is -1 there
PARTLY_WRONG = '''def all_reduce_mean(tensor, group=None):
    dist.all_reduce(tensor, group=group)
    tensor.div_(dist.get_world_size(group))
    return tensor
'''


def nbgrader(course_dir: Path, *args: str) -> str:
    # nbgrader runs the `alembic` command of its environment to set up the gradebook
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    run = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course_dir, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{run.stdout}{run.stderr}"
    return run.stdout + run.stderr


def points_of(labs: list[str]) -> dict[str, int]:
    """Exercise of ``labs`` → its number of CPU tests, what its autograder cell is worth."""
    return course.cpu_test_counts([name for lab in labs for name in notebook.exercises(
        nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4))])


def release(root: Path, labs: list[str]) -> tuple[Path, dict[str, int]]:
    """A course of ``labs`` in ``root``, nbgrader's release of it, and its points."""
    points = points_of(labs)
    course.write_course(root, labs=labs, points=points)
    nbgrader(root, "generate_assignment", "*")
    return root, points


def test_autograde_records_the_points_of_make_grade(tmp_path):
    """nbgrader autograde of lab 00 with a partly wrong answer: the autograder cell prints
    the kit's verdict (the row `make grade` prints) and nbgrader's gradebook holds the
    same points."""
    released, points = release(tmp_path, ["00_setup"])
    lab = "00_setup"
    submission = nbformat.read(released / "release" / lab / f"{lab}.ipynb", as_version=4)
    [cell] = [c for c in submission.cells if notebook.grade_id(c) == "all_reduce_mean"]
    cell.source = PARTLY_WRONG
    path = released / "submitted" / "alice" / lab / f"{lab}.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(submission, path)
    nbgrader(released, "autograde", lab, "--create")

    graded = nbformat.read(released / "autograded" / "alice" / lab / f"{lab}.ipynb",
                           as_version=4)
    [cell] = [c for c in graded.cells if notebook.is_test_cell(c)]
    printed = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    row = re.search(r"^all_reduce_mean +(\d+)/(\d+)", printed, re.MULTILINE)
    assert row, f"the autograder cell did not print the kit's verdict:\n{printed}"
    kit_points, kit_max = map(int, row.groups())
    assert 0 < kit_points < kit_max, f"the kit should give part marks:\n{printed}"

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{released / 'gradebook.db'}") as gb:
        graded = gb.find_submission(lab, "alice")
        score, max_score = graded.score, graded.max_score
    assert max_score == points["all_reduce_mean"]
    assert score == pytest.approx(max_score * kit_points / kit_max), (
        f"nbgrader recorded {score}/{max_score}, the kit's grader gives {kit_points}/{kit_max}")


# nbgrader's autograde runs this in the grading cell's kernel: the cell then has no output,
# which nbgrader scores as full credit
OVERRIDE = '''import distlab.grading.course as _course
_course.autograde = lambda *args, **kwargs: None

def all_reduce_mean(tensor, group=None):
    raise NotImplementedError
'''


class TestTheReleaseOfEveryLab:
    """nbgrader's release of every lab, made once (one unit of make test's workers,
    tests/durations.py): compared with labs/, and graded through the contained path, each
    test in a copy of the course."""

    @pytest.fixture(scope="class")
    @classmethod
    def released(cls, tmp_path_factory):
        return release(tmp_path_factory.mktemp("course"), LABS)

    @pytest.fixture
    def course_copy(self, released, tmp_path):
        """A copy of the released course (its gradebook included) to grade in."""
        root, points = released
        shutil.copytree(root, tmp_path / "course")
        return tmp_path / "course", points

    def test_the_release_is_labs_plus_one_autograder_cell_per_exercise(self, released):
        released, points = released
        for lab in LABS:
            given = nbformat.read(released / "release" / lab / f"{lab}.ipynb", as_version=4)
            labs = nbformat.read(ROOT / "labs" / f"{lab}.ipynb", as_version=4)
            kept = [c for c in given.cells if not notebook.is_test_cell(c)]
            assert [(c.cell_type, c.source) for c in kept] == \
                [(c.cell_type, c.source) for c in labs.cells], (
                f"{lab}: nbgrader's release differs from labs/ beyond the autograder cells")
            # the autograder cell's import of the grader would cost every graded rank seconds
            assert notebook.imports(given) == notebook.imports(labs), (
                f"{lab}: the autograder cells add to the graded module's imports")
            assert not any(c.get("outputs") for c in given.cells), f"{lab}: outputs released"
            for i, cell in enumerate(given.cells):
                name = notebook.grade_id(cell)
                if name:
                    after = given.cells[i + 1]
                    assert notebook.is_test_cell(after), f"{lab}: no autograder cell after {name}"
                    assert after.metadata.nbgrader["points"] == points[name] and \
                        f"autograde({lab + '.ipynb'!r}, {name!r}, points={points[name]})" \
                        in after.source, f"{lab}: the autograder cell of {name} is wrong"
                    assert after.metadata.nbgrader["locked"], "students must not edit it"

    def test_the_contained_path_writes_scores_a_cell_override_cannot_change(self, course_copy):
        """`python -m distlab.grading.course COURSE --grade 00_setup` grades with the kit's
        contained grader and writes the gradebook: the notebook that overrides the autograder
        cell (and answers nothing) scores 0 there; the solution's answer scores full marks;
        a submission that cannot be read scores 0, waiting for a person, and the batch goes on."""
        released, points = course_copy
        lab = "00_setup"
        given = nbformat.read(released / "release" / lab / f"{lab}.ipynb", as_version=4)
        solution = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
        answer = next(c.source for c in solution.cells if notebook.grade_id(c) == "all_reduce_mean")
        for student, source in (("mallory", OVERRIDE), ("bob", answer)):
            submission = nbformat.from_dict(given)
            [cell] = [c for c in submission.cells if notebook.grade_id(c) == "all_reduce_mean"]
            cell.source = source
            path = released / "submitted" / student / lab / f"{lab}.ipynb"
            path.parent.mkdir(parents=True)
            nbformat.write(submission, path)
        # a submission that is not a notebook, graded first: the batch goes on past it
        broken = released / "submitted" / "alan" / lab / f"{lab}.ipynb"
        broken.parent.mkdir(parents=True)
        broken.write_text("not JSON")
        scores, errors = course.grade_submissions(released, lab,
                                                  students=["alan", "mallory", "bob"])
        full = points["all_reduce_mean"]
        assert scores == {"alan": {f"{lab}/all_reduce_mean_tests": 0.0},
                          "mallory": {f"{lab}/all_reduce_mean_tests": 0.0},
                          "bob": {f"{lab}/all_reduce_mean_tests": full}}, scores
        assert len(errors) == 1 and errors[0].startswith(f"alan/{lab}.ipynb could not be graded")

        from nbgrader.api import Gradebook

        with Gradebook(f"sqlite:///{released / 'gradebook.db'}") as gb:
            got = {s: gb.find_submission(lab, s).score for s in ("alan", "mallory", "bob")}
            waiting = gb.find_grade("all_reduce_mean_tests", lab, lab, "alan").needs_manual_grade
        assert got == {"alan": 0.0, "mallory": 0.0, "bob": full}, got
        assert waiting, "a submission that could not be graded waits for a person's grade"

    def test_the_gradebook_gets_the_share_of_kit_and_hidden_tests_passed(self, course_copy,
                                                                          tmp_path):
        """`python -m distlab.grading.course COURSE --grade 00_setup --hidden-tests DIR`: the
        solution's answer fails one hidden test; its autograder cell keeps its points and
        scores the share of all the tests passed."""
        released, points = course_copy
        lab = "00_setup"
        given = nbformat.read(released / "release" / lab / f"{lab}.ipynb", as_version=4)
        solution = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
        [cell] = [c for c in given.cells if notebook.grade_id(c) == "all_reduce_mean"]
        cell.source = next(c.source for c in solution.cells
                           if notebook.grade_id(c) == "all_reduce_mean")
        path = released / "submitted" / "bob" / lab / f"{lab}.ipynb"
        path.parent.mkdir(parents=True)
        nbformat.write(given, path)
        hidden = hidden_folder(tmp_path, {"test_all_reduce_mean_extra.py": FAILS})
        assert course.main([str(released), "--grade", lab, "--hidden-tests", str(hidden)]) == 0
        full = points["all_reduce_mean"]

        from nbgrader.api import Gradebook

        with Gradebook(f"sqlite:///{released / 'gradebook.db'}") as gb:
            graded = gb.find_submission(lab, "bob")
            score, max_score = graded.score, graded.max_score
        assert max_score == full
        assert score == pytest.approx(round(full * full / (full + 1), 3)), (score, full)
