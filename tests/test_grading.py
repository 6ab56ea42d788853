"""The autograder: full marks for solutions, zero for untouched labs, and a wrong, a
deadlocking or a runaway answer each reported for what it is, within its time limit."""
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from distlab import grading, notebook

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solutions_score_full_marks(path):
    results = grading.grade(path)
    assert results, f"{path.name} has no exercises"
    for r in results:
        assert r.verdict == "pass" and r.points == r.max_points > 0, (
            f"{path.name}: {r.exercise} scored {r.points}/{r.max_points} ({r.verdict}): {r.message}")


def test_untouched_labs_score_zero_quickly():
    start = time.monotonic()
    for path in sorted((ROOT / "labs").glob("*.ipynb")):
        for r in grading.grade(path):
            assert (r.points, r.verdict) == (0, "not attempted"), (path.name, r)
            assert r.max_points > 0, f"{path.name}: {r.exercise} has no runnable tests"
    assert time.monotonic() - start < 120


def _lab00_with(tmp_path, body: str) -> Path:
    """Lab 00 with the student's answer to all_reduce_mean replaced by ``body``."""
    nb = nbformat.read(ROOT / "solutions" / "00_setup.ipynb", as_version=4)
    for cell in nb.cells:
        if notebook.grade_id(cell) == "all_reduce_mean":
            cell.source = "def all_reduce_mean(tensor, group=None):\n" + body
    path = tmp_path / "00_setup.ipynb"
    nbformat.write(nb, path)
    return path


def test_a_wrong_answer_fails_with_the_first_check_in_plain_words(tmp_path):
    path = _lab00_with(tmp_path, "    dist.all_reduce(tensor, group=group)\n    return tensor\n")
    (r,) = grading.grade(path, only=["all_reduce_mean"])
    assert r.verdict in ("partial", "fail") and r.points < r.max_points
    assert r.points >= 1, "world size 1 is right even without dividing"
    assert "elements are wrong" in r.message and "mean over the" in r.message, r.message


def test_a_deadlock_is_reported_as_such_within_the_time_limit(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_all_reduce_mean.py").write_text(
        "import torch\nfrom distlab import launch\nNOTEBOOK = '00_setup'\n\n"
        "def _call(fn):\n    fn(torch.ones(3))\n\n"
        "def test_two_ranks(student):\n"
        "    launch.run(_call, 2, student.all_reduce_mean, backend='gloo', timeout=3)\n")
    (tests / "conftest.py").write_text((ROOT / "tests/exercises/conftest.py").read_text())
    path = _lab00_with(tmp_path, "    if dist.get_rank() == 0:\n"
                                 "        dist.all_reduce(tensor, group=group)\n    return tensor\n")
    start = time.monotonic()
    (r,) = grading.grade(path, tests_dir=tests)
    assert time.monotonic() - start < 60
    assert r.verdict == "deadlock" and r.points == 0
    assert "rank 0 waiting in all_reduce" in r.message, r.message


def test_a_runaway_answer_is_stopped_by_the_exercise_time_limit(tmp_path):
    path = _lab00_with(tmp_path, "    import time\n    time.sleep(3600)\n")
    start = time.monotonic()
    (r,) = grading.grade(path, timeout=15)
    assert time.monotonic() - start < 40
    assert r.verdict == "timeout" and r.points == 0 and "15 s" in r.message


def test_the_command_line_prints_a_table_and_writes_json(tmp_path):
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "distlab.grade", "labs/00_setup.ipynb",
                          "--json", str(report)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "all_reduce_mean" in out.stdout and "not attempted" in out.stdout
    data = json.loads(report.read_text())["labs/00_setup.ipynb"]["all_reduce_mean"]
    assert set(data) == {"points", "max", "verdict", "message", "blocked"}
    assert data["points"] == 0
