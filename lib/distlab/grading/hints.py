"""The hint a student should open beside an exercise's first failing check.

An exercise test file (``exercises/test_<exercise>.py``) may declare ``HINTS``, read from
the kit's copy of the test file, statically (:func:`declared`, with ``ast``): never
imported by the grader, never taken from the student's notebook. The pointer is chosen by
what failed, not by the test's name alone:

- ``{"test_name": {"phrase of the check's message": N, ...}}``: the hint N of the first
  phrase that the failing check's message contains; no pointer when none does;
- ``{"test_name": N}`` (older files): hint N for any failure of that test;
- ``{"*": {...}}``: the phrases of every test the file does not list by name (tests
  neither listed nor covered by ``"*"`` point to Hint 1).

A failure that is the student's own exception inside their code (the message says "your
code raised", :func:`distlab.grading.output.rank_error`) gets no pointer: no hint is about
it, and the message names the student's line.

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


def _number(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def declared(test_file: Path) -> dict[str, int | dict[str, int]]:
    """``HINTS`` of a kit's exercise test file ({} when it declares none, or not as a
    literal dict of test names to positive numbers or to dicts of phrases to them)."""
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
                return {k: v if _number(v) else {p: n for p, n in v.items()
                                                  if isinstance(p, str) and _number(n)}
                        for k, v in value.items() if isinstance(k, str)
                        and (_number(v) or isinstance(v, dict))}
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


def pointer(hints: dict, found: dict[int, str], test_id: str, exercise: str,
            message: str = "") -> str:
    """"open Hint 2 (q and k) under ZeRO3Unit" for a student whose first failure is
    ``test_id`` with ``message``, or "" when the exercise has no hints in the notebook,
    the failure is the student's own exception, or no declared phrase names it."""
    from distlab.grading.output import RAISED

    if not found or RAISED in message:
        return ""
    number = hints.get(test_name(test_id), hints.get("*", 1))
    if isinstance(number, dict):
        number = next((n for phrase, n in number.items() if phrase in message), None)
        if number is None:
            return ""
    title = found.get(number)
    return f"open Hint {number}" + (f" ({title})" if title else "") + f" under {exercise}"
