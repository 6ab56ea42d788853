"""Autograder tests: one file per exercise, named ``test_<grade_id>.py``.

Each file sets ``NOTEBOOK`` (e.g. ``"03_ring_allreduce"``) and takes the ``student``
fixture: the module of exercise cells that ``python -m distlab.grade`` extracted from
the student's notebook (path in ``DISTLAB_STUDENT``), or, when a developer runs
``pytest tests/exercises``, the one extracted from ``solutions/``.

Tiers: unmarked tests run everywhere (gloo on CPU); ``@pytest.mark.gpu`` needs a GPU,
``@pytest.mark.multigpu`` two or more. Where the machine lacks them the test is
skipped (tests/conftest.py) with a reason that starts with "blocked", which the grader
reports as such.
Assertion messages are what the student reads: say what was wrong in plain words.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import cloudpickle
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def student(request, tmp_path_factory):
    name = request.module.NOTEBOOK
    path = os.environ.get("DISTLAB_STUDENT")
    if path is None:
        import nbformat

        from distlab import notebook

        nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
        path = tmp_path_factory.mktemp("student") / f"student_{name}.py"
        path.write_text(notebook.module_source(nb))
    module_name = f"student_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # ranks get the student's code by value
    return module
