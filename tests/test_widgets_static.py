"""Widgets seen without a widget front end: a static HTML export, GitHub's notebook view.

There a widget output shows its fallback instead of the widget: the first of the
output's other types that the viewer can draw. Each widget output stored in
solutions/*.ipynb must carry a picture (image/png) or a text that says something
(not ipywidgets' default ``HBox(children=(...))`` repr), and nbconvert's HTML export
without the widget state must show that fallback. The ring stepper of lab 03 must
fall back to a picture of its steps.

The widgets of labs 05, 07 and 08, made as tests/browser_support.py makes them for the
browser test, are checked where no browser is needed: labels inside boxes fit their
boxes at their full font size; the memory calculator's labels and key stay clear of its
bars, its line and its frame, its log axis labels no minor tick, and its table has a
heading per column; the pipeline explorer's sliders redraw on release only, its
pictures keep one size whatever p and m, and its measured run does not follow the
sliders; the traffic plot's key covers no bar.

Progress bars (``launch.progress``) must be stored finished: a stored tqdm widget shows
its first frame ("0%") in a static view, so the bar's widget gives way to a plain line
with the final count when it closes, and a re-run under nbval prints the same line.

Lab 09's planner is stored as a snapshot that says to run its cell, without widget
state. No code cell shows nbval's comment markers (they are cell tags). The figures of
labs 09 and 10 that misled at a glance: timelines compared on one time axis, the FP8
check's figure readable with its keys off the curves, a committed GPU result headed as
one.
"""
from __future__ import annotations

import base64
import html
import re
import struct
import subprocess
import sys
from html.parser import HTMLParser
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
    # Only the cells that show widgets are exported (each output is rendered on its own,
    # and the rest of the page, highlighted code and cleaned HTML, costs seconds).
    nb.cells = [nb.cells[i] for i in sorted({i for i, _ in outputs})]
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


# ---- the widgets of labs 05, 07 and 08 ----------------------------------------------

@pytest.fixture(scope="module")
def lab_widgets():
    import browser_support

    pytest.importorskip("ipywidgets")
    return browser_support.widgets_in_process()


def png_size(data: bytes) -> tuple[int, int]:
    return struct.unpack(">II", bytes(data)[16:24])


def drawn(fig):
    """Draw ``fig`` (closed, as the viz functions return it) with Agg; its renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def drawn_box_labels(fig):
    """Draw ``fig``; every box label of its axes as (label, its extent, its box's width)."""
    from distlab.viz.labels import BoxLabel

    renderer = drawn(fig)
    return [(a, a.get_window_extent(renderer) if a.shown else None, a.box_width_px())
            for ax in fig.axes for a in ax.get_children() if isinstance(a, BoxLabel)]


def check_fitting(labels, minimum_pt: float = 7) -> None:
    assert labels, "no box label drawn: the check would check nothing"
    for label, extent, width in labels:
        assert label.get_fontsize() >= minimum_pt, f"{label.shown!r} drawn at {label.get_fontsize()} pt"
        if label.shown:
            assert label.shown in label.texts
            assert extent.width <= width, (
                f"{label.shown!r} is {extent.width:.0f} px wide in a {width:.0f} px box")


def test_a_label_too_wide_for_its_box_is_not_drawn():
    import matplotlib.pyplot as plt

    from distlab.viz.labels import box_label

    fig, ax = plt.subplots(figsize=(4, 1))
    ax.set_xlim(0, 100)
    wide, narrow = box_label(ax, 0, 50, 0, ["a long label"]), box_label(ax, 60, 62, 0, ["x"])
    short = box_label(ax, 70, 80, 0, ["a long label", "ok"])
    fig.canvas.draw()
    plt.close(fig)
    assert (wide.shown, narrow.shown, short.shown) == ("a long label", None, "ok")


@pytest.mark.parametrize("p, m", [(4, 8), (8, 16), (1, 16), (8, 1)])
def test_the_gantt_labels_fit_their_boxes(lab_widgets, p, m):
    explorer = lab_widgets["PipelineExplorer"]
    explorer.p.value, explorer.m.value = p, m
    labels = drawn_box_labels(explorer.ideal_figure())
    check_fitting(labels)
    backward = [label for label, _, _ in labels if label.texts[0].startswith("B")]
    assert all(label.shown for label in backward), (   # twice a forward's width: room
        f"backward boxes without a label: {[b.texts[0] for b in backward if not b.shown]}")
    if m <= 8:
        assert all(label.shown == label.texts[0] for label, _, _ in labels)
    check_fitting(drawn_box_labels(explorer.measured_figure()))


def test_the_timeline_labels_fit_their_bars(lab_widgets):
    picker = lab_widgets["TimelinePicker"]
    labels = [x for label in picker.timelines for x in drawn_box_labels(picker.figure(label))]
    check_fitting(labels)
    assert any(label.shown for label, _, _ in labels) and not all(
        label.shown for label, _, _ in labels), "the stand-ins have bars too narrow for a label"


def test_the_explorer_redraws_on_release_at_one_size(lab_widgets):
    explorer = lab_widgets["PipelineExplorer"]
    for slider in (explorer.p, explorer.m):
        assert slider.continuous_update is False, f"{slider.description} redraws at every value"
        assert slider.style.description_width == "initial", f"{slider.description}: label cut"
    measured, sizes = bytes(explorer.measured_image.value), set()
    for p, m in [(1, 1), (8, 16), (3, 5), (8, 1)]:
        explorer.p.value, explorer.m.value = p, m
        sizes.add(png_size(explorer.image.value))
        assert bytes(explorer.measured_image.value) == measured, "the measured run follows a slider"
    assert len(sizes) == 1, f"the ideal schedule's picture changes size with p and m: {sizes}"
    assert "not the sliders" in explorer.caption.value
    width = png_size(explorer.image.value)[0]
    assert width <= 900, f"the explorer's picture is {width} px wide: a notebook cell shrinks it"


class _Table(HTMLParser):
    """The rows of an HTML table: per row, ("th" or "td", text) per cell."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("th", "td"):
            self.rows[-1].append([tag, ""])

    def handle_data(self, data):
        if self.rows and self.rows[-1]:
            self.rows[-1][-1][1] += data


def test_the_calculators_table_has_a_heading_per_column(lab_widgets):
    calc = lab_widgets["MemoryCalculator"]
    table = _Table()
    table.feed(calc.table.value)
    head, *rows = table.rows
    assert [text for _, text in head] == ["strategy", "formula", "bytes per GPU",
                                          f"in one {calc.gpu.value}"]
    assert {tag for tag, _ in head} == {"th"} and all(len(row) == len(head) for row in rows)
    assert all(row[2][1].endswith("GB") and row[3][1] in ("fits", "does not fit") for row in rows)


@pytest.mark.parametrize("psi, n", [(7.5e9, 64), (7.5e9, 8), (1e6, 4), (70e9, 8), (1e12, 1024),
                                    (1e9, 1)])
def test_the_calculators_picture_keeps_its_labels_clear(psi, n):
    from matplotlib.lines import Line2D

    from distlab.units import decimal_bytes
    from distlab.viz.zero import GPUS, calculator_figure, calculator_table

    fig = calculator_figure(psi, n, GPUS["H200 (141 GB)"])
    renderer = drawn(fig)
    ax = fig.axes[0]
    frame = ax.get_window_extent(renderer)
    lines = [a.get_window_extent(renderer) for a in ax.get_children()
             if isinstance(a, Line2D) and a.get_linestyle() == "--"]
    assert lines, "no GPU line drawn"
    for text in [t for t in ax.texts if t.get_text()] + ax.get_xticklabels():
        box = text.get_window_extent(renderer)
        assert not any(box.overlaps(line) for line in lines), f"the line runs through {text.get_text()!r}"
        assert box.y1 < frame.y0 or (box.y0 > frame.y0 + 2 and box.y1 < frame.y1 - 2), (
            f"{text.get_text()!r} touches the frame")
    legend = ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(frame), "the key covers the bars"
    assert all(not t.get_text() for t in ax.yaxis.get_minorticklabels()), "minor ticks labelled"
    shown = [t.get_text() for t in ax.get_yticklabels()
             if frame.y0 - 1 <= t.get_window_extent(renderer).y0 <= frame.y1 + 1]
    assert len(shown) >= 2 and all(t.endswith("B") for t in shown), shown
    ticks = " ".join(t.get_text() for t in ax.get_xticklabels())
    assert all(decimal_bytes(b) in ticks for _, _, b in calculator_table(psi, n))


def test_the_traffic_plots_key_covers_no_bar():
    from matplotlib.patches import Rectangle

    from distlab.viz.zero import plot_traffic

    fig = plot_traffic({"data parallel": 2.0, "ZeRO-1": 2.0, "ZeRO-3": 3.0, "torch FSDP2": 2.95})
    renderer = drawn(fig)
    ax = fig.axes[0]
    key = ax.get_legend().get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for p in ax.patches if isinstance(p, Rectangle)]
    assert bars and not any(key.overlaps(bar) for bar in bars), "the key covers a bar"
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    assert not any(key.overlaps(label) for label in labels), "the key covers a bar's label"


@pytest.mark.parametrize("widget, lab", [("MemoryCalculator", "05_zero"),
                                         ("PipelineExplorer", "07_pipeline_parallel"),
                                         ("TimelinePicker", "08_overlap"),
                                         ("Planner", "09_capstone")])
def test_the_browser_test_displays_each_widget_as_its_lab_does(widget, lab):
    """The browser test's notebook (tests/browser_support.py) ends each display cell
    with the call its lab makes; a lab that calls the widget otherwise must be followed."""
    import ast

    import browser_support

    path = ROOT / "solutions" / f"{lab}.ipynb"
    if not path.exists():
        pytest.skip(f"no {path.name}")
    call = lambda source: ast.dump(ast.parse(source).body[-1])  # noqa: E731
    labs = [call(c.source) for c in nbformat.read(path, as_version=4).cells
            if c.cell_type == "code" and f"{widget}(" in c.source]
    assert labs, f"{path.name} no longer displays a {widget}"
    assert call(browser_support.WIDGET_CELLS[widget]) in labs, (
        f"{path.name} displays its {widget} with another call than tests/browser_support.py")


# ---- lab 09's planner, nbval's markers, and figures read at a glance -------------------

def test_the_planner_is_stored_as_a_snapshot_without_widget_state():
    """Opened without running it, lab 09 shows the planner's HTML fallback (a fresh
    JupyterLab does not draw the widgets of a notebook it has not trusted): it must say
    that the boxes come with a run. Widget state saved with it would only draw boxes
    that change nothing (no kernel behind them)."""
    path = ROOT / "solutions" / "09_capstone.ipynb"
    if not path.exists():
        pytest.skip(f"no {path.name}")
    nb = nbformat.read(path, as_version=4)
    stored = [data for i, data in widget_outputs(nb) if "Planner(" in nb.cells[i].source]
    assert stored, f"{path.name} stores no planner output"
    for data in stored:
        for kind in ("text/html", "text/plain"):
            assert "run this cell" in data.get(kind, ""), (
                f"the planner's {kind} does not say to run its cell")
    assert "widgets" not in nb.metadata, (
        f"{path.name} carries widget state (metadata.widgets), as nbclient stores it after "
        f"`python -m distlab.grading.notebook execute`: drop it (nbformat: "
        f"nb.metadata.pop('widgets'))")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_code_cell_shows_an_nbval_marker(path):
    """nbval's markers are cell tags (nbval-ignore-output, ...), not comments that
    students read in the code."""
    nbval = pytest.importorskip("nbval.plugin")
    nb = nbformat.read(path, as_version=4)
    found = [f"cell {i}: {line.strip()}" for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" for line in cell.source.splitlines()
             if line.strip().startswith("#")
             and line.strip().lstrip("#").strip() in nbval.comment_markers]
    assert not found, (f"{path.name}: move these markers into the cells' tags "
                       f"({', '.join(nbval.metadata_tags)}):\n" + "\n".join(found))


def test_timelines_compared_share_one_time_axis():
    """Two steps drawn one under the other: the longer draws longer."""
    from distlab.timeline import Span, Timeline
    from distlab.viz.timeline import timelines_figure

    def step(seconds):
        return Timeline([Span(0, "compute", "forward", 0.0, seconds / 2),
                         Span(0, "comm", "all_reduce", seconds / 2, seconds, 1024)], [])

    fig = timelines_figure({"short": step(0.05), "long": step(0.185)}, label_bytes=False)
    short, long = (ax.get_xlim() for ax in fig.axes)
    assert short == long and long[1] >= 185, (short, long)


FP8_FIGURES = {
    "linear": [{"shape": [1024, 2048, 1024], "gflop": 12.9, "speedup": 0.31},
               {"shape": [8192, 2048, 8192], "gflop": 825.0, "speedup": 0.79},
               {"shape": [4096, 8192, 16384], "gflop": 3299.0, "speedup": 1.52}],
    "gpt": [{"config": name, "speedup": 1.08, "loss_floor": 6.3,
             "bf16": {"losses": [10 - 3 * (1 - 0.9 ** i) for i in range(steps)]},
             "fp8": {"losses": [10 - 3 * (1 - 0.9 ** i) for i in range(steps)]}}
            for name, steps in (("98M", 40), ("1.25B", 200))],
}


def test_the_fp8_figure_reads_at_the_size_a_cell_shows_it():
    """At most 10.5 inches (a notebook cell shows it at its size, not shrunk), tick
    labels of 9 pt or more and level, a loss floor drawn as a black line that shows,
    and every key outside its curves' frame."""
    from distlab.viz.fp8 import plot_fp8

    fig = plot_fp8(FP8_FIGURES)
    assert fig.get_figwidth() <= 10.5, fig.get_figwidth()
    renderer = drawn(fig)
    for ax in fig.axes:
        for label in ax.get_xticklabels() + ax.get_yticklabels():
            if label.get_text():
                assert label.get_fontsize() >= 9 and label.get_rotation() == 0, label.get_text()
        if ax.get_legend():
            key = ax.get_legend().get_window_extent(renderer)
            assert not key.overlaps(ax.get_window_extent(renderer)), "a key covers the curves"
    floors = [line for ax in fig.axes for line in ax.get_lines()
              if line.get_label().startswith("loss floor")]
    assert len(floors) == 2 and all(line.get_linewidth() >= 1.2 and line.get_color() == "black"
                                    for line in floors)


def test_a_committed_gpu_result_is_headed_as_one():
    """"fp8: fail" read as the student's own failure; the heading says what failed."""
    from distlab.acceptance.render import render_result

    result = {"check": "fp8", "status": "fail", "goal": "FP8 >= 1.2x BF16", "environment": {},
              "misses": ["FP8 1.08x BF16's tokens/s, below 1.2x"]}
    first = render_result(result).splitlines()[0]
    assert first == "#### GPU acceptance check `fp8` (committed result): goals missed", first
    assert "- missed: FP8 1.08x" in render_result(result)
