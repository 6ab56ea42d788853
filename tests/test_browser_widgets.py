"""The student's view of the labs' widgets (tests/test_browser.py's module, in a unit of
make test's workers of its own, so that neither file's unit, JupyterLab and Chromium
started once in each, runs past a minute): MemoryCalculator, PipelineExplorer,
TimelinePicker and the Planner run from a small notebook of their own
(tests/browser_support.py: the labs' display cells over stand-ins for their runs),
each clicked or dragged; what it shows must change, and its pictures must be drawn at
their own size, no wider than the cell."""
from __future__ import annotations

import re
import time

import pytest

import browser_support
from test_browser import (ARTIFACTS, PANEL, WIDGETS, browser, check_student_view,  # noqa: F401
                          lab, page, shot)

MISSING = browser_support.missing()
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(MISSING is not None, reason=f"browser test: {MISSING}")]

# Per picture of a widget output: its natural and shown widths, and the output's width.
PICTURES_JS = """out => [...out.querySelectorAll('img')].map(img => ({
  natural: img.naturalWidth, shown: img.getBoundingClientRect().width, cell: out.clientWidth}))"""
# Text cut short by its box (an ellipsis where the words do not fit).
CUT_LABELS_JS = """out => [...out.querySelectorAll('.widget-label, .widget-readout')]
  .filter(el => el.scrollWidth > el.clientWidth + 1).map(el => el.textContent)"""
# Per column of a table: the left edge of its heading and of each of its cells.
COLUMNS_JS = """table => [...table.rows].map(row =>
  [...row.cells].map(cell => Math.round(cell.getBoundingClientRect().left)))"""
LABEL_PX = 9          # the smallest a box label may be drawn on screen, in CSS pixels
LAG_S = 3.0           # a slider's release to the new picture (one redraw, a loaded machine)


def drawn_at_size(output, what: str) -> list[dict]:
    """Check ``output``'s pictures: loaded, shown at their own width, within the cell."""
    pictures = output.evaluate(PICTURES_JS)
    assert pictures, f"{what}: no picture"
    for p in pictures:
        assert p["natural"] > 0, f"{what}: a broken picture"
        assert p["natural"] <= p["cell"], (
            f"{what}: drawn {p['natural']} px wide, the cell is {p['cell']} px: it is shrunk")
        assert abs(p["shown"] - p["natural"]) <= 1, (
            f"{what}: a {p['natural']} px picture is shown {p['shown']:.0f} px wide")
    return pictures


def changes(image, act, what: str) -> float:
    """Run ``act`` and wait until ``image`` shows another picture; the seconds it took."""
    from playwright.sync_api import expect

    before = image.get_attribute("src")
    act()
    start = time.monotonic()
    expect(image).not_to_have_attribute("src", before, timeout=30_000)
    return time.monotonic() - start


def redraws(text, act, what: str) -> None:
    """Run ``act`` and wait until the element ``text`` shows other words."""
    from playwright.sync_api import expect

    before = text.inner_text()
    act()
    try:
        expect(text).not_to_have_text(before, timeout=30_000)
    except AssertionError:
        raise AssertionError(f"{what} did not change what the widget shows") from None


def drag_to_end(page, slider, image) -> None:
    """Drag the handle of ``slider`` (an ipywidgets slider) to its right end as a hand
    does, through every value on the way, and hold it there a moment: ``image`` must not
    be redrawn before the handle is released (a redraw per value passed is what made
    the picture trail the slider)."""
    handle = slider.locator(".noUi-handle").first
    track = slider.locator(".noUi-base").first.bounding_box()
    box = handle.bounding_box()
    y = box["y"] + box["height"] / 2
    before = image.get_attribute("src")
    page.mouse.move(box["x"] + box["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(track["x"] + track["width"] + 20, y, steps=12)
    page.wait_for_timeout(500)
    assert image.get_attribute("src") == before, "the picture is redrawn while the slider moves"
    page.mouse.up()


def test_widgets_of_labs_05_07_08_09_as_a_student_sees_them(lab, page):
    from distlab.viz.pipeline import LABEL_PT
    from playwright.sync_api import expect

    displays = [(0, 1, True)] * len(browser_support.WIDGET_CELLS)
    check_student_view(page, lab, WIDGETS, expected=[(0, 0, False), (0, 0, False), *displays])
    outputs = {name: page.locator(f"{PANEL} .jp-Cell").nth(2 + k).locator(".jp-OutputArea-output")
               for k, name in enumerate(browser_support.WIDGET_CELLS)}
    lags = {}

    # Lab 05: the table's headings over their columns; a new N redraws table and bars.
    calc = outputs["MemoryCalculator"]
    table, image = calc.locator(".widget-html table"), calc.locator("img").first
    columns = table.evaluate(COLUMNS_JS)
    assert all(row == columns[0] for row in columns), (
        f"the calculator's headings are not over their columns (left edges per row: {columns})")
    assert table.locator("th").all_text_contents() == [
        "strategy", "formula", "bytes per GPU", "in one H200 (141 GB)"]
    drawn_at_size(calc, "MemoryCalculator")
    shot(page, calc, "widgets.memory-before")
    gpus = calc.locator(".widget-inline-hbox", has_text="GPUs N").locator("input")
    changes(image, lambda: (gpus.fill("8"), gpus.press("Enter")), "MemoryCalculator")
    expect(table).to_contain_text("15.0 GB")           # ZeRO-3: 16 bytes × 7.5e9 / 8
    shot(page, calc, "widgets.memory-after")

    # Lab 07: sliders redraw on release, at one size; labels whole and readable.
    explorer = outputs["PipelineExplorer"]
    ideal, measured = explorer.locator("img").nth(0), explorer.locator("img").nth(1)
    box = explorer.locator(".widget-vbox").first
    assert not explorer.evaluate(CUT_LABELS_JS), (
        f"slider labels cut short: {explorer.evaluate(CUT_LABELS_JS)}")
    pictures = drawn_at_size(explorer, "PipelineExplorer")
    scale = pictures[0]["shown"] / pictures[0]["natural"]
    assert LABEL_PT * 100 / 72 * scale >= LABEL_PX, "the Gantt chart's box labels are too small"
    expect(explorer).to_contain_text("not the sliders")
    height = box.bounding_box()["height"]
    shot(page, explorer, "widgets.pipeline-before")
    m = explorer.locator(".widget-slider", has_text="micro-batches m")
    measured_src = measured.get_attribute("src")
    lags["m to 16"] = changes(ideal, lambda: drag_to_end(page, m, ideal), "PipelineExplorer")
    expect(explorer.locator(".widget-html").first).to_contain_text("m = 16")
    p = explorer.locator(".widget-slider", has_text="stages p")
    lags["p to 8"] = changes(ideal, lambda: drag_to_end(page, p, ideal), "PipelineExplorer")
    expect(explorer.locator(".widget-html").first).to_contain_text("p = 8, m = 16")
    assert measured.get_attribute("src") == measured_src, "the measured run moved with a slider"
    assert abs(box.bounding_box()["height"] - height) <= 2, (
        f"the explorer grew from {height:.0f} to {box.bounding_box()['height']:.0f} px with p")
    drawn_at_size(explorer, "PipelineExplorer at p = 8, m = 16")
    shot(page, explorer, "widgets.pipeline-after")
    changes(measured, lambda: explorer.locator(".widget-toggle-button", has_text="1F1B").click(),
            "PipelineExplorer's schedule")
    assert all(lag < LAG_S for lag in lags.values()), (
        f"the picture trails the slider: seconds from release to picture {lags}")

    # Lab 08: another bucket size, another timeline.
    picker = outputs["TimelinePicker"]
    drawn_at_size(picker, "TimelinePicker")
    changes(picker.locator("img").first,
            lambda: picker.locator(".widget-toggle-button", has_text=re.compile(r"^\s*1 MiB\s*$")).click(),
            "TimelinePicker")
    drawn_at_size(picker, "TimelinePicker, 1 MiB")
    shot(page, picker, "widgets.timeline-after")

    # Lab 09: every box and switch redraws the table of layouts; labels whole.
    plan = outputs["Planner"]
    table = plan.locator(".widget-html pre")
    expect(table).to_contain_text("suggested: dp=")
    assert not plan.evaluate(CUT_LABELS_JS), f"planner labels cut short: {plan.evaluate(CUT_LABELS_JS)}"
    shot(page, plan, "widgets.planner-before")
    gpus = plan.locator(".widget-inline-hbox", has_text="GPUs").locator("input")
    redraws(table, lambda: (gpus.fill("8192"), gpus.press("Enter")), "the planner's GPUs")
    expect(table).to_contain_text("on 8,192 GPUs")
    for switch in ("recompute activations", "FlashAttention", "sequence parallelism"):
        box = plan.locator(".widget-checkbox", has_text=switch).locator("input")
        redraws(table, box.click, f"the planner's {switch!r} switch")
    shot(page, plan, "widgets.planner-after")
    assert not page.console_errors, f"the browser logged errors: {page.console_errors}"
    (ARTIFACTS / "widgets.lags.txt").write_text(
        "".join(f"{k}: {v:.2f} s from release to picture\n" for k, v in lags.items()))
