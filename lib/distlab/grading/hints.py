"""The hint a student should open beside an exercise's first failing check.

An exercise test file (``exercises/test_<exercise>.py``) may declare
``HINTS = {"test_function_name": N, ...}``: the 1-based number of the hint under that
exercise that a student failing that test should open; tests not listed point to Hint 1.
``HINTS`` is read from the kit's copy of the test file, statically (:func:`declared`,
with ``ast``): never imported by the grader, never taken from the student's notebook.

The hints themselves are the notebook's collapsed ``<summary>Hint N: title</summary>``
in the markdown cells between the exercise's statement and its code cell (the markdown
right above the exercise cell, :func:`titles`). An exercise without hints there gets no
pointer. The titles come from the student's notebook: the report prints them escaped.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

_SUMMARY = re.compile(r"<summary>\s*Hint\s+(\d+)\s*:\s*(.*?)\s*</summary>", re.S | re.I)


def declared(test_file: Path) -> dict[str, int]:
    """``HINTS`` of a kit's exercise test file ({} when it declares none, or not as a
    literal dict of test names to positive numbers)."""
    try:
        tree = ast.parse(Path(test_file).read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        if any(isinstance(t, ast.Name) and t.id == "HINTS" for t in targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return {}
            if isinstance(value, dict):
                return {k: v for k, v in value.items() if isinstance(k, str)
                        and isinstance(v, int) and not isinstance(v, bool) and v >= 1}
            return {}
    return {}


def titles(nb, exercise: str) -> dict[int, str]:
    """Hint number → title, from the markdown cells right above ``exercise``'s code
    cell (back to the previous code cell)."""
    from distlab.grading.notebook import grade_id

    above: list[str] = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            above.append(cell.source)
            continue
        if grade_id(cell) == exercise:
            found: dict[int, str] = {}
            for text in above:
                for number, title in _SUMMARY.findall(text):
                    found.setdefault(int(number), " ".join(title.split()))
            return found
        above = []
    return {}


def test_name(test_id: str) -> str:
    """``test_x.py::test_answer[2]`` → ``test_answer``."""
    return test_id.split("::")[-1].split("[")[0]


def pointer(hints: dict[str, int], found: dict[int, str], test_id: str, exercise: str) -> str:
    """"open Hint 2 (q and k) under ZeRO3Unit" for a student failing ``test_id``, or ""
    when the exercise has no hints in the notebook."""
    if not found:
        return ""
    number = hints.get(test_name(test_id), 1)
    title = found.get(number)
    return f"open Hint {number}" + (f" ({title})" if title else "") + f" under {exercise}"
