"""Autograder tests: one file per exercise, named ``test_<grade_id>.py``.

Each file sets ``NOTEBOOK`` (e.g. ``"03_ring_allreduce"``) and takes the ``student``
fixture: the exercise cells that ``python -m distlab.grading`` extracted from the
student's notebook (path in ``DISTLAB_STUDENT``), or, when a developer runs
``pytest lib/distlab/grading/exercises``, the ones extracted from ``solutions/``.

The student's code is untrusted (see :mod:`distlab.grading.sandbox`), so this process never
imports it:

* ``student.NAME`` is a reference. Passed to ``launch.run`` it becomes the student's
  function or class inside the ranks; called here, it runs in a sandboxed one-rank
  launch (pure functions of plain data only).
* Launched functions return plain data (tensors, numbers, strings, lists/tuples/dicts
  of them; a CommLog as ``log.records()``); every check runs here, on what came back.
* A student's exception comes back as ``launch.RankError`` (``.exc_type``), or, from a
  direct call, as the builtin exception of the same class.

Tiers: unmarked tests run everywhere (gloo on CPU); ``@pytest.mark.gpu`` needs a GPU,
``@pytest.mark.multigpu`` two or more. Where the machine lacks them the test is
skipped (tests/conftest.py) with a reason that starts with "blocked", which the grader
reports as such. Assertion messages are what the student reads: say what was wrong in
plain words.
"""
from __future__ import annotations

import os
from pathlib import Path

import cloudpickle
import pytest

from distlab.grading.plugin import blocked_reason, exercise_of
from distlab.grading.student import Student

ROOT = Path(__file__).resolve().parents[4]  # a checkout of the kit: solutions/ is there


def pytest_runtest_setup(item):
    """Tests of the gpu and multigpu tiers are skipped, with a reason starting with
    "blocked", where the machine lacks the GPUs."""
    reason = blocked_reason(item)
    if reason:
        pytest.skip(reason)


@pytest.fixture(autouse=True, scope="module")
def _sandboxed():
    """Ranks answer in plain data, as when graded (only for these tests: other tests run
    in the same process keep their own launches)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DISTLAB_SANDBOX", "1")
        yield


def pytest_collection_finish(session):
    """The ranks get the tests' own helper functions by value (they may not be able to
    import the test files)."""
    for module in {item.module for item in session.items if hasattr(item, "module")}:
        cloudpickle.register_pickle_by_value(module)


@pytest.fixture(scope="module")
def student(request, tmp_path_factory):
    name = request.module.NOTEBOOK
    path = os.environ.get("DISTLAB_STUDENT")
    if path is None:
        import nbformat

        from distlab.grading import notebook

        nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
        folder = tmp_path_factory.mktemp("student")
        folder.chmod(0o755)
        path = folder / f"student_{name}.py"
        path.write_text(notebook.module_source(nb))
        path.chmod(0o644)
    exercise = exercise_of(str(request.module.__file__))
    student = Student(path, exercise)  # its ranks never hold the library's answers to it
    if (str(path), exercise) not in _imported:  # once per exercise, in a sandboxed rank
        student.check_import()
        _imported.add((str(path), exercise))
    return student


_imported: set[tuple[str, str]] = set()
