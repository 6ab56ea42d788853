"""No measured figure typed into a notebook's prose.

A figure, in a markdown cell of ``solutions/*.ipynb``, is a number followed by a unit of
time, size, bandwidth or a ratio (``42.8 ms``, ``3.6 GB/s``, ``168 KiB``, ``1.23×``). Each
must be one of:

- printed: the number, at the precision the prose gives it, occurs in an output of the
  same notebook (the cell that measured it printed it) or in a committed result file
  ``docs/results/*.json`` (GPU runs, with their date, hardware and commit);
- quoted: on a blockquote line (``> ...``), the course material's or a paper's words;
- declared not measured, in the same cell: ``<!-- not measured: 450 GB/s, 141 GB -->``,
  for datasheet and paper figures and for arithmetic the cell shows. Each figure listed
  there must occur in the cell, so that the list cannot go stale.

Code (fenced blocks, inline ``code``) is not prose and is not scanned.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "solutions").glob("*.ipynb"))
RESULTS = ROOT / "docs" / "results"

UNITS = r"(?:[nµu]s|ms|s|[KMGT]B|[KMGT]iB|[KMGT]iB/s|[MGT]B/s|Gb/s|TFLOP/s)"
# a number, then a unit (not a longer word), or a ratio sign not followed by a number (16 × 1024)
FIGURE = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?:\s?" + UNITS +
                    r"(?![\w/])|\s?[×x](?!\s?\d)(?![\w]))")
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
NOT_MEASURED = re.compile(r"<!--\s*not measured:(.*?)-->", re.S)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def _numbers(text: str) -> set[float]:
    return {float(m.group()) for m in NUMBER.finditer(text.replace(",", ""))}


def printed(nb) -> set[float]:
    """Every number in the notebook's outputs (text, markdown, HTML, streams)."""
    found: set[float] = set()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] + [v if isinstance(v, str) else "".join(v)
                                             for k, v in out.get("data", {}).items()
                                             if k.startswith("text/")]
            for text in texts:
                found |= _numbers(text)
    return found


def committed(results: Path = RESULTS) -> set[float]:
    found: set[float] = set()
    for path in sorted(results.glob("*.json")):
        found |= _numbers(json.dumps(json.loads(path.read_text())))
    return found


def _shown_as(value: float, text: str) -> bool:
    """``value`` written at the precision of ``text`` (rounded) is ``text``'s number."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(round(value, decimals) - float(text)) < 10 ** -(decimals + 3)


def unbacked(nb, known: set[float]) -> list[str]:
    """The figures of ``nb``'s markdown that nothing backs, as 'cell N: figure: line'."""
    problems = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        source = cell.source
        declared = []
        for block in NOT_MEASURED.findall(source):
            declared += [m.group(0).strip() for m in FIGURE.finditer(block)]
        prose = CODE.sub(" ", NOT_MEASURED.sub(" ", source))
        for figure in declared:
            if figure not in prose:
                problems.append(f"cell {index}: {figure!r} is declared not measured but the "
                                f"cell no longer says it")
        for line in prose.splitlines():
            if line.lstrip().startswith(">"):
                continue
            for m in FIGURE.finditer(line):
                figure, number = m.group(0).strip(), m.group(1).replace(",", "")
                if figure in declared or any(_shown_as(v, number) for v in known):
                    continue
                problems.append(f"cell {index}: {figure!r} in: {line.strip()[:120]}")
    return problems


def test_the_guard_catches_a_typed_figure():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("The step took 42.8 ms, 1.23× DDP's, over 16 × 1024 "
                                              "tokens; `x = 3 ms` is code."),
                nbformat.v4.new_markdown_cell("> the course says 99 GB/s\n\nNVLink: 450 GB/s.\n"
                                              "<!-- not measured: 450 GB/s, 7 TB -->"),
                nbformat.v4.new_code_cell("print(42.81)", outputs=[
                    nbformat.v4.new_output("stream", text="step: 42.81 ms\n")])]
    problems = unbacked(nb, printed(nb))
    assert len(problems) == 2, problems
    assert "'1.23×'" in problems[0] and "'7 TB' is declared" in problems[1]
    nb.cells[2].outputs[0].text += "ratio 1.2301\n"
    assert unbacked(nb, printed(nb)) == [problems[1]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_figure_in_prose_comes_from_a_run(path):
    nb = nbformat.read(path, as_version=4)
    problems = unbacked(nb, printed(nb) | committed())
    assert not problems, (
        f"{path.name}: figures typed into markdown that no output of the notebook and no "
        f"docs/results file shows (print them from the cell that measures them, quote them "
        f"on a '>' line, or list a datasheet/paper/arithmetic figure in "
        f"'<!-- not measured: ... -->'):\n  " + "\n  ".join(problems))
