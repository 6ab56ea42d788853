"""Exercise cells, the student release, and its staleness check."""
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from distlab.grading import notebook, runner

ROOT = Path(__file__).resolve().parents[1]

ANSWER = '''import math

# EXERCISE
def area(r):
    """Area of a circle."""
    ### BEGIN SOLUTION
    squared = r * r
    return math.pi * squared
    ### END SOLUTION
'''


def _nb(*sources):
    cells = [new_markdown_cell("# A lab"), new_code_cell("import math\n%matplotlib inline")]
    for name, source in sources:
        cell = new_code_cell(source, outputs=[new_output("stream", name="stdout", text="x")],
                             execution_count=3)
        cell.metadata["nbgrader"] = {"solution": True, "grade_id": name}
        cells.append(cell)
    return new_notebook(cells=cells)


def test_release_replaces_answers_with_stubs_at_their_indentation():
    released = notebook.clear_solutions(ANSWER)
    assert "    raise NotImplementedError" in released
    assert "squared" not in released and "BEGIN SOLUTION" not in released
    assert '"""Area of a circle."""' in released and released.startswith("import math")
    assert notebook.is_untouched(released) and not notebook.is_untouched(ANSWER)


def test_release_drops_outputs_and_keeps_metadata():
    solved = _nb(("area", ANSWER))
    solved.cells[2].metadata["execution"] = {"iopub.status.idle": "2026-12-02T00:30:38Z"}
    nb = notebook.release(solved)
    cell = nb.cells[2]
    assert cell.outputs == [] and cell.execution_count is None
    assert notebook.grade_id(cell) == "area" and "execution" not in cell.metadata


def test_module_source_has_the_notebook_imports_and_survives_a_broken_cell():
    nb = _nb(("area", ANSWER), ("broken", "def broken(:\n    pass"))
    namespace = {}
    exec(notebook.module_source(nb), namespace)
    assert namespace["area"](1.0) == pytest.approx(3.14159, rel=1e-5)
    with pytest.raises(SyntaxError, match="the cell of broken does not compile"):
        namespace["broken"]()


def test_labs_are_the_release_of_the_solutions():
    assert notebook.stale(ROOT / "solutions", ROOT / "labs") == [], "run `make labs`"
    solutions = sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))
    assert solutions == sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))


def test_stale_detects_a_changed_solution(tmp_path):
    (tmp_path / "s").mkdir()
    nbformat.write(_nb(("area", ANSWER)), tmp_path / "s" / "01.ipynb")
    notebook.release_dir(tmp_path / "s", tmp_path / "l")
    assert notebook.stale(tmp_path / "s", tmp_path / "l") == []
    nbformat.write(_nb(("area", ANSWER.replace("pi", "tau"))), tmp_path / "s" / "01.ipynb")
    assert notebook.stale(tmp_path / "s", tmp_path / "l") == ["01.ipynb"]


def test_every_solution_exercise_has_autograder_tests():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for name in notebook.exercises(nbformat.read(path, as_version=4)):
            assert (runner.TESTS / f"test_{name}.py").exists(), (path.name, name)


# The autograder imports a lab's exercise cells with the notebook's imports: that must not
# need ipywidgets (nor matplotlib where the lab's cells do not import it). Labs that block
# the same packages are checked in one interpreter, each module in a namespace of its own.
WITHOUT = {"01_primitives": ("ipywidgets",), "02_parameter_server": ("ipywidgets",),
           "03_ring_allreduce": ("ipywidgets", "matplotlib"),
           "05_zero": ("ipywidgets", "matplotlib"), "07_pipeline_parallel": ("ipywidgets",)}

BLOCK = """
import importlib.abc, sys, traceback
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked")
sys.meta_path.insert(0, Block())
for lab, source in {sources!r}.items():
    try:
        exec(compile(source, lab, "exec"), {{"__name__": "student"}})
        print(lab, "imports")
    except BaseException:
        print(lab, "fails:", traceback.format_exc()[-2000:].replace("\\n", " | "))
"""


@pytest.fixture(scope="module")
def imported_without():
    """Lab → what importing its exercise module printed, with its packages blocked."""
    sets: dict[tuple, dict] = {}
    for lab, blocked in WITHOUT.items():
        nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", 4)
        sets.setdefault(blocked, {})[lab] = notebook.module_source(nb)
    said = {}
    for blocked, sources in sets.items():
        run = subprocess.run([sys.executable, "-c", BLOCK.format(blocked=set(blocked),
                                                                  sources=sources)],
                             capture_output=True, text=True, timeout=120)
        for lab in sources:
            line = next((x for x in run.stdout.splitlines() if x.startswith(lab + " ")),
                        f"{lab} not reached: {run.stderr[-2000:]}")
            said[lab] = line
    return said


@pytest.mark.parametrize("lab", WITHOUT)
def test_the_exercise_modules_import_without_widgets(lab, imported_without):
    assert imported_without[lab] == f"{lab} imports", imported_without[lab]
