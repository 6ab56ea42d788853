"""The student's view: the labs opened in JupyterLab in headless Chromium, run with Run All.

nbval proves that cells run; this proves what a student sees. JupyterLab is started as
``make lab`` starts it (tests/browser_support.py), each notebook (a solution, outputs
stripped) is opened and run from the Run menu, and the page is checked: every cell ran,
no error output, each plot the solution has is drawn as an image, each widget is drawn
as a widget (not as its text stand-in), no image is broken, the browser logs no error,
and the ring stepper of lab 03 moves a step when "next" is clicked. The labs' widgets
are tests/test_browser_widgets.py's, on this module's fixtures. Screenshots go to
artifacts/browser/.

Skipped, with the reason, where Playwright or a Chromium executable is missing
(``apt-get install chromium``; ``.ci/run`` does it in CI). ``make test-browser`` runs
it alone, with tests/test_browser_widgets.py.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest

import browser_support

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts" / "browser"
SOLUTIONS = ROOT / "solutions"
SETUP, RING = "00_setup.ipynb", "03_ring_allreduce.ipynb"
WIDGETS = "widgets_05_07_08.ipynb"     # written by browser_support.widget_notebook
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
RUN_TIMEOUT_S = 120        # per notebook; lab 03's measurement is the longest part

MISSING = browser_support.missing()
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(MISSING is not None, reason=f"browser test: {MISSING}")]

# The notebook on show (JupyterLab hides the others' panels).
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
# Per cell of the notebook on show: its prompt, and what each output shows.
CELLS_JS = """panel => [...document.querySelectorAll(panel + ' .jp-Cell')]
  .map(cell => ({
    code: cell.classList.contains('jp-CodeCell'),
    prompt: (cell.querySelector('.jp-InputPrompt')?.textContent || '').trim(),
    outputs: [...cell.querySelectorAll('.jp-OutputArea-output')].map(out => ({
      mime: out.getAttribute('data-mime-type'),
      text: out.textContent,
      widget: out.querySelector('.jupyter-widgets') !== null,
      images: [...out.querySelectorAll('img')].map(img => img.complete ? img.naturalWidth : 0),
    })),
  }))"""
# Images that finished loading with nothing to show: a 404, or bytes that are no picture.
BROKEN_IMAGES_JS = """panel => [...document.querySelectorAll(panel + ' img')]
  .filter(img => img.complete && img.naturalWidth === 0)
  .map(img => img.getAttribute('src')?.slice(0, 120) || '(no src)')"""
# JupyterLab shows an error as a stderr output holding the traceback.
STDERR = "application/vnd.jupyter.stderr"
TRACEBACK = "Traceback (most recent call last)"


_SERVED: dict = {}  # name -> the notebook served, with its outputs, where not the solution


def stored(name: str):
    return _SERVED.get(name) or nbformat.read(SOLUTIONS / name, as_version=4)


def ring_without_measurements(path: Path) -> Path:
    """Lab 03 without its measurement cells (the rings against gloo's, which nbval's
    replay of the lab runs already: about 40 CPU-seconds), written to ``path``: every
    kind of output the lab draws is still there (plots, the stepper, printed checks)."""
    nb = nbformat.read(SOLUTIONS / RING, as_version=4)
    nb.cells = [c for c in nb.cells if c.cell_type != "code" or not any(
        call in c.source for call in ("ring_bench.measure(", "in_words("))]
    nbformat.write(nb, path)
    _SERVED[RING] = nb
    return path


def expected_outputs(nb):
    """Per cell of the solution: (number of plots, number of widgets, any output at all)."""
    counts = []
    for cell in nb.cells:
        outs = [o.get("data", {}) for o in cell.get("outputs", [])]
        counts.append((sum("image/png" in d and WIDGET_MIME not in d for d in outs),
                       sum(WIDGET_MIME in d for d in outs), bool(cell.get("outputs"))))
    return counts


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    notebooks = [SOLUTIONS / SETUP,
                 ring_without_measurements(tmp_path_factory.mktemp("ring") / RING),
                 browser_support.widget_notebook(tmp_path_factory.mktemp("widgets") / WIDGETS)]
    root = tmp_path_factory.mktemp("jupyterlab")
    # started by `make lab`, as a student starts it (as root in CI and containers)
    with browser_support.JupyterLab(notebooks, root, ARTIFACTS / "jupyterlab.log",
                                    make_lab=True) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=browser_support.find_chromium(),
                                     args=browser_support.CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, request):
    """A fresh browser tab; its console errors go to artifacts/browser/<test>.console.log
    and a screenshot of where it stood to <test>.end.png."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    tab.set_default_timeout(30_000)
    console: list[str] = []
    tab.on("console", lambda m: m.type == "error" and console.append(f"error: {m.text}"))
    tab.on("pageerror", lambda e: console.append(f"uncaught: {e}"))
    tab.console_errors = console
    try:
        yield tab
    finally:
        name = request.node.name
        try:
            tab.screenshot(path=ARTIFACTS / f"{name}.end.png")
        finally:
            (ARTIFACTS / f"{name}.console.log").write_text("\n".join(console) + "\n")
            context.close()


def open_notebook(page, lab, name: str, cells: int) -> None:
    """Open ``name`` and wait until its ``cells`` cells show and its kernel is idle."""
    page.goto(lab.url(name))
    # this notebook's own kernel indicator: the status bar may still show another tab's
    page.wait_for_function(
        """([panel, n]) => document.querySelectorAll(panel + ' .jp-Cell').length === n
             && (document.querySelector('#jp-main-statusbar')?.innerText || '').includes('| Idle')
             && document.querySelector(panel + ' .jp-Notebook-ExecutionIndicator')
                  ?.getAttribute('data-status') === 'idle'""",
        arg=[PANEL, cells], timeout=60_000, polling=250)


def menu(page, title: str, command: str) -> None:
    """Click ``title`` in the menu bar, then the item that runs ``command``."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(rf"^\s*{title}\s*$")).click()
    page.click(f'.lm-Menu-item[data-command="{command}"]')


def run_all(page, timeout_s: float) -> list[dict]:
    """Run > Run All Cells, as a student does; wait until no cell is queued or running."""
    prompts = "[...document.querySelectorAll(panel + ' .jp-InputPrompt')].map(p => p.textContent)"
    started = ("panel => [...document.querySelectorAll(panel + ' .jp-CodeCell .jp-InputPrompt')]"
               ".some(p => p.textContent.trim() !== '[ ]:')")
    for attempt in (1, 2):  # a Run All issued while the kernel still connects runs nothing
        menu(page, "Run", "runmenu:run-all")
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            page.wait_for_function(started, arg=PANEL, timeout=15_000)
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
    page.wait_for_function(
        f"""panel => !{prompts}.some(p => p.includes('*'))
             && document.querySelector(panel + ' .jp-Notebook-ExecutionIndicator')
                  ?.getAttribute('data-status') === 'idle'""",
        arg=PANEL, timeout=timeout_s * 1000, polling=500)
    return page.evaluate(CELLS_JS, PANEL)


def save_and_read(page, lab, name: str):
    """File > Save, then the notebook as JupyterLab wrote it (outputs included)."""
    before = lab.path(name).stat().st_mtime_ns
    menu(page, "File", "docmanager:save")
    deadline = time.monotonic() + 20
    while lab.path(name).stat().st_mtime_ns == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lab.path(name).stat().st_mtime_ns != before, f"JupyterLab did not save {name}"
    time.sleep(0.5)                   # let the write finish
    return nbformat.read(lab.path(name), as_version=4)


def shot(page, target, name: str) -> None:
    """Screenshot of the page with ``target`` (a locator) scrolled to the top of the view."""
    target.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(300)        # content-visibility: let the browser paint it
    page.screenshot(path=ARTIFACTS / f"{name}.png")


def assert_opens_unchanged(page, lab, name: str) -> None:
    """Fail if opening ``name`` changed it: where the tab shows it modified, save it and
    name what JupyterLab rewrote (metadata entries, cells, format). A tab marked modified
    whose save writes the same notebook is JupyterLab's passing state, not a change."""
    page.wait_for_timeout(500)
    if page.evaluate("document.querySelector('.lm-TabBar-tab.jp-mod-dirty') === null"):
        return
    before = nbformat.read(lab.path(name), as_version=4)
    after = save_and_read(page, lab, name)
    keys = sorted(set(before.metadata) | set(after.metadata))
    changed = {k: (before.metadata.get(k), after.metadata.get(k)) for k in keys
               if before.metadata.get(k) != after.metadata.get(k)}
    cells = [i for i, (a, b) in enumerate(zip(before.cells, after.cells)) if a != b]
    form = [(before.nbformat, before.nbformat_minor), (after.nbformat, after.nbformat_minor)]
    assert not (changed or cells or len(before.cells) != len(after.cells)
                or form[0] != form[1]), (
        f"{name} shows as modified as soon as it opens, and saving it writes: metadata "
        f"(before, after) {changed}, cells changed {cells}, cells {len(before.cells)} -> "
        f"{len(after.cells)}, format {form}")


def check_student_view(page, lab, name: str, expected=None) -> list[dict]:
    """Open ``name``, Run All, and check what shows against the solution's outputs, or
    against ``expected`` (as :func:`expected_outputs` gives), for a notebook with no
    solution."""
    expected = expected or expected_outputs(stored(name))
    open_notebook(page, lab, name, len(expected))
    assert_opens_unchanged(page, lab, name)
    cells = run_all(page, RUN_TIMEOUT_S)
    assert len(cells) == len(expected), (
        f"JupyterLab shows {len(cells)} cells, the notebook has {len(expected)}")

    shown = [o["text"] for c in cells for o in c["outputs"]
             if o["mime"] == STDERR and TRACEBACK in o["text"]]
    assert not shown, f"{name}: the student sees an error:\n" + "\n".join(shown)[:3000]
    not_run = {i: c["prompt"] for i, c in enumerate(cells)
               if c["code"] and not re.fullmatch(r"\[\d+\]:", c["prompt"])}
    assert not not_run, f"{name}: cells did not run (cell: prompt): {not_run}"

    for i, (cell, (plots, widgets, output)) in enumerate(zip(cells, expected)):
        where = f"{name}, cell {i}"
        if output and cell["code"]:
            assert cell["outputs"], f"{where}: the solution has output here, the student sees none"
        drawn = [o for o in cell["outputs"] if o["mime"] == "image/png"]
        assert len(drawn) >= plots, (
            f"{where}: {plots} plot(s) expected, {len(drawn)} shown as images")
        assert all(o["images"] and min(o["images"]) > 0 for o in drawn), (
            f"{where}: a plot's image did not load (natural widths {[o['images'] for o in drawn]})")
        live = [o for o in cell["outputs"] if o["widget"]]
        assert len(live) >= widgets, (
            f"{where}: {widgets} widget(s) expected, {len(live)} drawn as widgets; it shows "
            f"(type, text): {[(o['mime'], o['text'][:200]) for o in cell['outputs']]}")
        for o in live:
            assert "Error displaying widget" not in o["text"], f"{where}: {o['text'][:300]}"

    saved = save_and_read(page, lab, name)
    errors = [f"cell {i}: {o.ename}: {o.evalue}" for i, c in enumerate(saved.cells)
              for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{name}: error outputs in the run: {errors}"
    assert not page.console_errors, f"{name}: the browser logged errors: {page.console_errors}"
    broken = page.evaluate(BROKEN_IMAGES_JS, PANEL)
    assert not broken, f"{name}: broken images (a student sees an empty frame): {broken}"
    plots = page.locator(f'{PANEL} .jp-OutputArea-output[data-mime-type="image/png"]')
    for k in range(plots.count()):
        shot(page, plots.nth(k), f"{Path(name).stem}.plot{k}")
    return cells


def test_setup_lab_as_a_student_sees_it(lab, page):
    check_student_view(page, lab, SETUP)


@pytest.mark.skipif(not (SOLUTIONS / RING).exists(), reason=f"no solutions/{RING} yet")
def test_ring_stepper_as_a_student_sees_it(lab, page):
    from playwright.sync_api import expect

    cells = check_student_view(page, lab, RING)  # its plots too, cell by cell

    stepper = page.locator(".jp-OutputArea-output").filter(
        has=page.locator('.widget-button:text-is("next")')).first
    shows = [[(o["mime"], o["text"][:100]) for o in cells[i]["outputs"]]
             for i, c in enumerate(stored(RING).cells) if "RingStepper(" in c.source]
    assert stepper.count() == 1, (
        f"no 'next' button: the ring stepper is not drawn as a widget; its cell shows {shows}")
    assert stepper.locator(".jupyter-widgets img").count() == 1, "the stepper shows no picture"
    label = stepper.locator(".widget-html").first
    image = stepper.locator(".jupyter-widgets img").first
    expect(label).to_contain_text(re.compile(r"step \d+"))
    before_text, before_src = label.text_content(), image.get_attribute("src")
    step = int(re.search(r"step (\d+)", before_text).group(1))
    shot(page, stepper, "03_ring_allreduce.stepper-before")

    stepper.locator('.widget-button:text-is("next")').click()
    expect(label).to_contain_text(f"step {step + 1}")
    expect(image).not_to_have_attribute("src", before_src)
    shot(page, stepper, "03_ring_allreduce.stepper-after")
    assert label.text_content() != before_text

    # Drawn at its own size: a VBox stretches its children to its width by default,
    # which blurs the picture and makes it taller than the window.
    shown, natural = image.evaluate("img => [img.getBoundingClientRect().width, img.naturalWidth]")
    assert shown <= 1.1 * natural, (
        f"the stepper's picture is stretched from {natural} to {shown:.0f} px wide "
        "(give its VBox layout=Layout(align_items='flex-start'))")
