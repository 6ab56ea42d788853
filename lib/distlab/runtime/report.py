"""What a launch shows the caller: each rank's output grouped by rank, the progress bar
driven by rank 0, and rank errors and stacks tidied for reading."""
from __future__ import annotations

import os
import re
import sys
import time

class Shown:
    """The output of one launch, per rank and stream, printed grouped by rank and tagged
    ``[rank r]``; what a terminal would show of carriage-return progress lines."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.pending = {(r.rank, s): b"" for r in self.ranks for s in ("out", "err")}
        self.kept = {key: [] for key in self.pending}

    def collect(self, wait_s: float = 0.0) -> None:
        """Read what every rank has written so far (waiting ``wait_s`` for stragglers)."""
        if wait_s:
            time.sleep(wait_s)
        for r in self.ranks:
            for s in ("out", "err"):
                self.pending[r.rank, s] += getattr(r, s).take(drain=True)

    def lines(self, rank: int, stream: str) -> list[str]:
        data = self.pending[rank, stream]
        return self.kept[rank, stream] + [as_displayed(line) for line in _lines(
            data.decode(errors="replace"))]

    def show(self, partial: bool, wait_s: float = 0.0) -> None:
        """Print the complete lines read so far (and a last unfinished one if
        ``partial``), stdout first, grouped by rank."""
        self.collect(wait_s)
        for s, target in (("out", sys.stdout), ("err", sys.stderr)):
            for r in self.ranks:
                data = self.pending[r.rank, s]
                cut = len(data) if partial else data.rfind(b"\n") + 1
                text, self.pending[r.rank, s] = data[:cut].decode(errors="replace"), data[cut:]
                for line in map(as_displayed, _lines(text)):
                    self.kept[r.rank, s].append(line)
                    target.write(f"[rank {r.rank}] {line}\n")
            target.flush()


def _lines(text: str) -> list[str]:
    """``text`` cut at line feeds only: a carriage return redraws its line (a progress
    bar's 50 steps are one line), it does not start another, as ``str.splitlines`` has it."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def as_displayed(line: str) -> str:
    """A line with carriage returns as a terminal leaves it: the last thing drawn."""
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


# ------------------------------------------------------------- errors and stacks


def error_field(e, key: str) -> str:
    """A field of a rank's error report, as text whatever the rank sent."""
    value = e.get(key, "") if isinstance(e, dict) else ""
    return value if isinstance(value, str) else repr(value)


def reported(iterable, total, desc, task):
    n = 0
    for item in iterable:
        yield item
        n += 1
        task.progress(desc, n, total)
    task.progress(desc, n, total, final=True)


def drawn(iterable, total, desc):
    bar = Bar(desc, total)
    try:
        for n, item in enumerate(iterable, 1):
            yield item
            bar.update(n)
    finally:
        bar.close()


def update_bar(bar, desc, n, total):
    if bar is None or bar.desc != desc:
        if bar is not None:
            bar.close()
        bar = Bar(desc, total)
    bar.update(n)
    return bar


class Bar:
    """A progress bar in the caller: tqdm's text bar in a terminal, its widget in a
    notebook.

    A notebook stores a widget's output as it was first drawn ("0%"), and that is what
    GitHub and other static views show. So in a notebook the widget is displayed with no
    text of its own, and when the bar closes it is replaced by nothing and its final
    state is printed as a plain line, without timings: ``desc: 100%|██████████| 600/600``.
    A re-run prints the same line (nbval compares it; it skips the widget's view)."""

    WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

    def __init__(self, desc: str, total: int | None):
        from tqdm.auto import tqdm

        self.desc, self.handle = desc, None
        if "tqdm.notebook" not in {cls.__module__ for cls in tqdm.__mro__}:
            self.tqdm = tqdm(total=total, desc=desc)  # a terminal, or no ipywidgets
            return
        from IPython.display import display

        self.tqdm = tqdm(total=total, desc=desc, display=False)
        view = {"version_major": 2, "version_minor": 0, "model_id": self.tqdm.container.model_id}
        self.handle = display({self.WIDGET_VIEW: view}, raw=True, display_id=True)

    def update(self, n: int) -> None:
        self.tqdm.update(n - self.tqdm.n)

    def close(self) -> None:
        self.tqdm.close()
        if self.handle is None:
            return
        self.handle.update({}, raw=True)
        self.tqdm.container.close()
        n, total = self.tqdm.n, self.tqdm.total
        print(self.tqdm.format_meter(n, total, 0, prefix=self.desc,
                                     bar_format="{l_bar}{bar:10}| {n_fmt}/{total_fmt}")
              if total else f"{self.desc}: {n}it")


_PACKAGE_FOR = {"cupy": "cupy-cuda13x (or: pip install -e '.[gpu]')", "cv2": "opencv-python",
                "yaml": "pyyaml", "sklearn": "scikit-learn", "PIL": "pillow"}


def missing_package_hint(text: str) -> str:
    m = re.search(r"No module named '([\w.]+)'", text)
    if not m:
        return ""
    top = m.group(1).split(".")[0]
    return (f"\nThe package {top!r} is missing in the environment the ranks run in "
            f"({sys.executable}). Install it: {sys.executable} -m pip install "
            f"{_PACKAGE_FOR.get(top, top)}")


def tidy_stack(text: str) -> str:
    """faulthandler's dump, without the launcher's own frames."""
    keep = [line for line in text.splitlines() if line.strip() and not _machinery(line)]
    return "\n".join(keep) or "(empty stack)"


MACHINERY = ("distlab/runtime/worker.py", "distlab/comm.py", "<frozen runpy>", "c10d_logger.py")


def _machinery(frame: str) -> bool:
    """A frame of the launcher's own (or of runpy, or torch's c10d logger wrapper)."""
    return any(part in frame for part in MACHINERY)


def innermost(stack: str) -> str:
    """The innermost frame of the user's own code (not torch's, not the launcher's)."""
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith("File")]
    own = [f for f in frames if f"{os.sep}torch{os.sep}" not in f]
    return (own or frames or ["(unknown)"])[0]


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
