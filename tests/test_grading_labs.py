"""The autograder on every notebook: untouched labs score zero, counted without
running. (Apart from tests/test_grading.py so that `make test`'s workers, which take
whole files, share the long runs.)"""
import re
import time
from pathlib import Path

import nbformat
import pytest
import torch

from distlab.grading import runner

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "labs").glob("*.ipynb"))


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_untouched_labs_score_zero_without_running_them(path):
    start = time.monotonic()
    results = runner.grade(path)
    assert results, f"{path.name} has no exercises"
    listed = listed_points(nbformat.read(path, as_version=4))
    assert sorted(listed) == sorted(r.exercise for r in results), (path.name, listed)
    for r in results:
        assert (r.points, r.verdict) == (0, "not attempted"), (path.name, r)
        assert r.max_points > 0, f"{path.name}: {r.exercise} has no runnable tests"
        cpu, gpu = listed[r.exercise]  # the lab's own first cell agrees with the grader
        assert r.max_points + r.blocked == cpu + gpu, (path.name, r, listed[r.exercise])
        if not torch.cuda.is_available():
            assert r.max_points == cpu, (path.name, r, listed[r.exercise])
    assert time.monotonic() - start < 120, "counting the tests must not hang"


# a row of the graded-exercises block in a lab's first cell (distlab.grading.labs.render)
_ROW = re.compile(r"^\| `(\w+)`(?: \(core\))? \| (\d+)(?: \(\+(\d+) with GPUs\))? \|$", re.M)


def listed_points(nb) -> dict[str, tuple[int, int]]:
    """Exercise → (points on a CPU, points GPUs add), as the lab's first cell lists them."""
    return {name: (int(cpu), int(gpu or 0)) for name, cpu, gpu in _ROW.findall(
        nb.cells[0].source)}
