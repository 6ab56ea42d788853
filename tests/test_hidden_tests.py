"""An instructor's hidden tests (``--hidden-tests DIR``): they count for their exercise
in the report (and in nbgrader's gradebook: tests/test_nbgrader.py), a file that is not
one is an error naming it, and no graded rank can open them."""
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

from distlab.grading import cli, labs, notebook, sandbox

ROOT = Path(__file__).resolve().parents[1]
LAB = "00_setup"
SECRET = "SECRET-2f9c"  # in the hidden tests' source only

# one test the solution passes, using the kit's fixture and a kit helper module
PASSES = f'''"""{SECRET}"""
import torch
import torch.distributed as dist
from rounding import MULTIPLE  # a helper module of the kit's tests

from distlab import launch

NOTEBOOK = "{LAB}"


def _mean_of_ranks(all_reduce_mean):
    t = torch.full((3,), float(dist.get_rank()))
    all_reduce_mean(t)
    return t


def test_hidden_mean_of_two_ranks(student):
    a, b = launch.run(_mean_of_ranks, 2, student.all_reduce_mean, backend="gloo", timeout=30)
    assert MULTIPLE and torch.equal(a, torch.full((3,), 0.5)) and torch.equal(b, a), (
        "the mean of ranks 0 and 1")
'''
# one test the solution fails
FAILS = f'''NOTEBOOK = "{LAB}"


def test_hidden_no_answer(student):
    # {SECRET}
    assert student.all_reduce_mean(__import__("torch").ones(2)) is None, "a check it fails"
'''


def hidden_folder(parent: Path, files: dict[str, str]) -> Path:
    folder = parent / "hidden"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    for name, text in files.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o644)
    return folder


@functools.cache
def _kit_points() -> int:
    return labs.test_counts(["all_reduce_mean"])["all_reduce_mean"][0]


@pytest.mark.parametrize("name, text, says", [
    ("test_all_reduce_mean.py", "def test_x(student):\n    pass\n", "declares no lab: declare"),
    ("test_all_reduce_mean.py", 'NOTEBOOK = "03_ring_allreduce"\n',
     "is for 03_ring_allreduce, but the notebooks graded are of 00_setup"),
    ("test_all_reduce_mean.py", 'NOTEBOOK = "00_set"\n', "which is no lab"),
    ("test_ring_allreduce.py", f'NOTEBOOK = "{LAB}"\n',
     "00_setup has no exercise that its name names; name it test_<exercise>.py"),
    ("test_all_reduce_mean.py", f'NOTEBOOK = "{LAB}"\ndef (:\n', "does not compile"),
    ("test_all_reduce_mean.py", f'import no_such_module_x\nNOTEBOOK = "{LAB}"\n',
     "cannot be collected (ModuleNotFoundError: No module named 'no_such_module_x')"),
    ("helpers.py", "X = 1\n", "helpers.py is not a test file"),
    ("test_all_reduce_mean.py", None, "is a symbolic link: put the file itself there"),
])
def test_a_hidden_file_that_is_not_one_is_an_error_naming_it(tmp_path, capsys, name, text,
                                                             says):
    hidden = hidden_folder(tmp_path, {name: text} if text is not None else {})
    if text is None:
        target = tmp_path / "elsewhere.py"
        target.write_text(f'NOTEBOOK = "{LAB}"\n')
        (hidden / name).symlink_to(target)
    report = tmp_path / "report.json"
    code = cli.main([str(ROOT / "solutions" / f"{LAB}.ipynb"), "--hidden-tests",
                        str(hidden), "--json", str(report)])
    err = capsys.readouterr().err
    assert code == 2 and says in err and str(hidden / name if name != "helpers.py" else hidden) \
        in err, err
    assert not report.exists()


def test_a_hidden_folder_inside_one_the_ranks_read_is_refused(tmp_path, capsys, monkeypatch):
    hidden = hidden_folder(tmp_path, {"test_all_reduce_mean.py": FAILS})
    monkeypatch.setattr(sandbox, "_readable_paths", lambda kit: [str(tmp_path.resolve())])
    code = cli.main([str(ROOT / "solutions" / f"{LAB}.ipynb"), "--hidden-tests",
                        str(hidden)])
    err = capsys.readouterr().err
    assert code == 2 and f"{hidden.resolve()} is inside {tmp_path.resolve()}, which graded " \
        f"ranks can read" in err and "keep hidden tests elsewhere" in err, err


STUDENT_PEEKS = '''

def peek(paths):
    """What this rank can read of ``paths``."""
    import os
    seen = {}
    for path in paths:
        try:
            seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
        except OSError:
            pass
    return seen
'''

PEEKING_TEST = f'''import os

NOTEBOOK = "{LAB}"
INSTRUCTOR = "FOLDER"


def test_no_rank_reads_the_hidden_tests(student):
    mine = os.path.dirname(os.path.abspath(__file__))
    paths = [INSTRUCTOR, os.path.join(INSTRUCTOR, "test_all_reduce_mean.py"), mine, __file__,
             os.path.dirname(mine)]
    seen = student.peek(paths)
    assert seen == {{}}, f"a rank read {{sorted(seen)}}"
'''


class TestOneGradingWithHiddenTests:
    """Lab 00's solution graded once (one unit of make test's workers, tests/durations.py)
    with hidden tests: one it passes, one it fails and, where graded ranks are confined,
    one through which the student's code looks for the hidden tests."""

    @pytest.fixture(scope="class")
    @classmethod
    def graded(cls, tmp_path_factory):
        """(the grader's run, its JSON report, whether the looking test is among them). As
        root the instructor's folder is world-readable outside /tmp, and so is the grader's
        TMPDIR; the student's cell adds a function that reads what it can of given paths."""
        tmp = tmp_path_factory.mktemp("graded")
        peeks = os.geteuid() == 0 and not sandbox.confinement()
        outside = Path(tempfile.mkdtemp(prefix="distlab-hidden-test-", dir="/var/lib")) \
            if peeks else tmp
        try:
            outside.chmod(0o755)
            files = {"test_all_reduce_mean.py": PASSES, "test_all_reduce_mean_strict.py": FAILS}
            env = None
            if peeks:
                files["test_all_reduce_mean_peek.py"] = PEEKING_TEST.replace(
                    "FOLDER", str(outside / "hidden"))
                (outside / "tmp").mkdir(mode=0o755)
                env = dict(os.environ, TMPDIR=str(outside / "tmp"))
            hidden = hidden_folder(outside, files)
            nb = nbformat.read(ROOT / "solutions" / f"{LAB}.ipynb", as_version=4)
            [cell] = [c for c in nb.cells if notebook.grade_id(c) == "all_reduce_mean"]
            cell.source += STUDENT_PEEKS
            path = tmp / f"{LAB}.ipynb"
            nbformat.write(nb, path)
            report = tmp / "report.json"
            run = subprocess.run([sys.executable, "-m", "distlab.grading", str(path),
                                  "--hidden-tests", str(hidden), "--json", str(report)],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300,
                                 env=env)
            yield run, report, peeks
        finally:
            if peeks:
                shutil.rmtree(outside)

    def test_hidden_tests_count_for_their_exercise_and_their_source_is_not_shown(self, graded):
        run, report, peeks = graded
        assert run.returncode == 0, run.stdout + run.stderr
        [got] = json.loads(report.read_text()).values()
        kit = _kit_points()
        result = got["all_reduce_mean"]
        assert (result["points"], result["max"]) == (kit + 1 + peeks, kit + 2 + peeks), result
        assert result["verdict"] == "partial", result
        assert result["message"] == "test_hidden_no_answer: a check it fails", result
        assert f"{kit + 1 + peeks}/{kit + 2 + peeks}" in run.stdout, run.stdout
        assert SECRET not in run.stdout + run.stderr + report.read_text()

    def test_a_graded_rank_cannot_open_the_hidden_tests(self, graded):
        """The instructor's folder and the grader's copy of it are absent from the
        filesystem of the ranks that run the student's code: the student's function that
        lists and reads them finds nothing (the hidden test that fails is the only one)."""
        run, report, peeks = graded
        if not peeks:
            pytest.skip("as root only (a world-readable folder under /var/lib), where graded "
                        f"ranks are confined: {sandbox.confinement() or 'not root'}")
        assert run.returncode == 0, run.stdout + run.stderr
        [got] = json.loads(report.read_text()).values()
        result, kit = got["all_reduce_mean"], _kit_points()
        assert (result["points"], result["max"]) == (kit + 2, kit + 3) \
            and result["message"] == "test_hidden_no_answer: a check it fails", result
