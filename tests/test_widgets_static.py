"""Widgets seen without a widget front end: a static HTML export, GitHub's notebook view.

There a widget output shows its fallback instead of the widget: the first of the
output's other types that the viewer can draw. Each widget output stored in
solutions/*.ipynb must carry a picture (image/png) or a text that says something
(not ipywidgets' default ``HBox(children=(...))`` repr), and nbconvert's HTML export
without the widget state must show that fallback. The ring stepper of lab 03 must
fall back to a picture of its steps.

Progress bars (``launch.progress``) must be stored finished: a stored tqdm widget shows
its first frame ("0%") in a static view, so the bar's widget gives way to a plain line
with the final count when it closes, and a re-run under nbval prints the same line.
"""
from __future__ import annotations

import base64
import html
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "solutions").glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# ipywidgets' own repr: the class and its traits, e.g. "Button(description='next', ...)".
DEFAULT_REPR = re.compile(r"\s*[A-Z]\w*\((\w+=[\s\S]*)?\)\s*")
# a tqdm frame: "desc:  45%|████▌     | 270/600 [...]"
TQDM_FRAME = re.compile(r"(\d+)%\|[^|\n]*\|\s*(\d+)/(\d+)")


def widget_outputs(nb):
    """(cell index, output data) of each output that holds a widget."""
    return [(i, out["data"]) for i, cell in enumerate(nb.cells)
            for out in cell.get("outputs", []) if WIDGET_VIEW in out.get("data", {})]


def fallback_problem(data) -> str | None:
    """What is wrong with a widget output's static fallback, or None when it is fine."""
    if "image/png" in data:
        png = base64.b64decode(data["image/png"])
        return None if png.startswith(b"\x89PNG") else "its image/png is not a PNG"
    text = data.get("text/plain", "")
    if not text.strip():
        return "it has neither a picture nor a text: a static view shows nothing"
    if DEFAULT_REPR.fullmatch(text):
        return f"its only fallback is ipywidgets' default repr {text[:80]!r}"
    return None


WITH_WIDGETS = [p for p in NOTEBOOKS if widget_outputs(nbformat.read(p, as_version=4))]


def test_the_solutions_have_widget_outputs_to_check():
    assert WITH_WIDGETS, "no widget output in solutions/: the checks below would check nothing"


def test_the_default_repr_is_recognised():
    ipywidgets = pytest.importorskip("ipywidgets")
    box = ipywidgets.HBox([ipywidgets.Button(description="next")])
    assert fallback_problem(box._repr_mimebundle_()) is not None
    assert fallback_problem({WIDGET_VIEW: {}, "text/plain": "ring: step 0 of 6"}) is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_widget_output_has_a_static_fallback(path):
    nb = nbformat.read(path, as_version=4)
    problems = [f"cell {i}: {p}" for i, data in widget_outputs(nb)
                if (p := fallback_problem(data))]
    assert not problems, f"{path.name}: widget outputs a static view cannot show:\n" + \
        "\n".join(problems)
    # GitHub refuses to render a notebook whose widget metadata lacks its "state".
    for key, value in nb.metadata.get("widgets", {}).items():
        assert "state" in value, f"{path.name}: metadata.widgets[{key!r}] has no 'state'"


@pytest.mark.parametrize("path", WITH_WIDGETS, ids=lambda p: p.stem)
def test_html_export_without_widget_state_shows_the_fallbacks(path):
    """nbconvert, as for a page without widget JavaScript: widget state dropped, each
    widget output must come out as its picture or its text."""
    from nbconvert import HTMLExporter

    nb = nbformat.read(path, as_version=4)
    outputs = widget_outputs(nb)
    nb.metadata.pop("widgets", None)
    page, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    assert f'type="{WIDGET_VIEW}"' not in page, "a widget view was exported with no state"
    for i, data in outputs:
        if "image/png" in data:
            shown = f'src="data:image/png;base64,{data["image/png"][:200]}'
        else:
            shown = data["text/plain"].splitlines()[0][:60]
        assert shown in html.unescape(page), (
            f"{path.name}, cell {i}: the HTML export does not show the widget's fallback")


def test_ring_stepper_falls_back_to_a_picture():
    path = ROOT / "solutions" / "03_ring_allreduce.ipynb"
    if not path.exists():
        pytest.skip("solutions/03_ring_allreduce.ipynb is not written yet")
    nb = nbformat.read(path, as_version=4)
    cells = [(i, c) for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and "RingStepper(" in c.source]
    assert cells, "lab 03 shows no RingStepper"
    if not any(c.get("outputs") for c in nb.cells):
        pytest.skip("solutions/03_ring_allreduce.ipynb has not been executed yet")
    for i, cell in cells:
        stepper = [d for _, d in widget_outputs(nbformat.v4.new_notebook(cells=[cell]))
                   if d.get("text/plain", "").startswith("RingStepper(")]
        assert stepper, f"cell {i}: no stored RingStepper output"
        assert fallback_problem(stepper[0]) is None and "image/png" in stepper[0], (
            f"cell {i}: the stepper's output has no picture for a static view")


def output_texts(cell):
    """Every text a static view shows for ``cell``'s outputs."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            yield out["text"]
        else:
            yield out.get("data", {}).get("text/plain", "")


def unfinished_bars(nb) -> list[str]:
    """The stored progress-bar frames that a static view shows short of their total."""
    return [f"cell {i}: {m.group(0)!r}" for i, cell in enumerate(nb.cells)
            for text in output_texts(cell) for m in TQDM_FRAME.finditer(text)
            if m.group(2) != m.group(3)]


def test_an_unfinished_bar_is_recognised():
    first_frame = "steps:   0%|          | 0/600 [00:00<?, ?it/s]"
    cell = nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output(
        "display_data", {WIDGET_VIEW: {}, "text/plain": first_frame})])
    assert unfinished_bars(nbformat.v4.new_notebook(cells=[cell]))
    last = "steps: 100%|██████████| 600/600\n"
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=last)]
    assert not unfinished_bars(nbformat.v4.new_notebook(cells=[cell]))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_progress_bars_are_finished(path):
    bad = unfinished_bars(nbformat.read(path, as_version=4))
    assert not bad, (f"{path.name} stores progress bars short of their end, as GitHub would "
                     f"show them; re-execute it with `python -m distlab.grading.notebook execute "
                     f"{path.relative_to(ROOT)}`:\n" + "\n".join(bad))


BAR_NOTEBOOK = [
    "from distlab import launch",
    "def loop(n):\n    return sum(launch.progress(range(n), desc='steps'))\n\n"
    "print(launch.run(loop, 2, 30, backend='gloo'))",
    "print(sum(launch.progress(range(7), desc='in the kernel')))",
]


# nbconvert warns about the output a closed bar leaves, which has nothing to show
@pytest.mark.filterwarnings("ignore:Your element with mimetype")
def test_a_bar_is_stored_finished_and_passes_nbval(tmp_path):
    """Execute a notebook with a bar from launched ranks and one in the kernel as
    solutions/ are executed: each bar's output holds no widget any more and its final
    line reads finished, in an HTML export too; nbval, which sees the widget's first
    display and not its later update, passes on the stored file."""
    pytest.importorskip("nbval")
    from nbconvert import HTMLExporter

    from distlab.grading import notebook

    path = tmp_path / "bars.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in BAR_NOTEBOOK])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3",
                              "language": "python"}
    nbformat.write(nb, path)
    notebook.execute(path, timeout=120)
    nb = nbformat.read(path, as_version=4)
    shown = ["".join(output_texts(cell)) for cell in nb.cells[1:]]
    assert shown == ["steps: 100%|██████████| 30/30\n[435, 435]\n",
                     "in the kernel: 100%|██████████| 7/7\n21\n"], shown
    assert not widget_outputs(nb), "a bar's widget is still stored after it closed"
    page, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    assert "30/30" in html.unescape(page) and not unfinished_bars(nb)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--nbval", "--nbval-current-env", str(path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"nbval fails on the stored bars:\n{run.stdout[-3000:]}"
