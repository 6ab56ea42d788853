"""Student editions for the tests: each built once per process, in a folder removed at
exit (:func:`edition`), and the kernel of each solution notebook under nbval run inside
the edition its students work in (:class:`EditionKernels`): lab k's solution runs with
the library of the edition through lab k-1, so every cell after an exercise must run on
the notebook's own answer (docs/design.md, "The student edition")."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from distlab.grading import edition as editions

ROOT = Path(__file__).resolve().parents[1]
THROUGH = (-1, 0, 4, 9)  # the editions the tests check: through none, 00, 04 and 09
_BUILT: dict[int, Path] = {}
_HOME = Path(tempfile.mkdtemp(prefix="distlab-editions-"))
atexit.register(shutil.rmtree, _HOME, True)


def edition(through: int) -> Path:
    """The student edition through lab ``through`` (-1: none), built on first use."""
    if through not in _BUILT:
        out = _HOME / ("none" if through < 0 else f"{through:02d}")
        editions.release(out, through, kit=ROOT)
        _BUILT[through] = out
    return _BUILT[through]


class EditionKernels:
    """Under nbval, ``solutions/NN_*.ipynb``'s kernel (and the ranks it launches) import
    the library of the edition through lab NN-1: PYTHONPATH
    names it while the kernel starts, in the setup of the notebook's first cell."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        notebook = item.parent
        path = Path(str(getattr(notebook, "path", "")))
        starting = (type(notebook).__name__ == "IPyNbFile" and path.parent.name == "solutions"
                    and getattr(notebook, "kernel", None) is None)
        if not starting:
            yield
            return
        saved = os.environ.get("PYTHONPATH")
        lib = edition(editions.lab_number(path.stem) - 1) / "lib"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(lib), saved]))
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
