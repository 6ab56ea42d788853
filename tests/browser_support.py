"""JupyterLab served as ``make lab`` serves it, and headless Chromium to look at it.

Used by ``tests/test_browser.py``. The server is the environment's own ``jupyter lab``
(the kernel is then this Python, which imports distlab) on a free port with a token,
over a temporary copy of the notebooks, outputs stripped so that what the browser
shows comes from running them. Settings, workspaces and runtime files go to the
temporary directory too, so a developer's own JupyterLab set-up plays no part.
The browser is the system's Chromium (Debian's ``chromium`` package), driven by
Playwright: nothing is downloaded at test time.
"""
from __future__ import annotations

import ast
import http.client
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat

from distlab import jupyter

REPO = Path(__file__).resolve().parents[1]

# Chromium flags for a closed network: without the background-networking ones,
# Chromium's own connections are refused and slow it down.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """``$DISTLAB_CHROMIUM`` if set, else the first of CHROMIUM_NAMES on the PATH."""
    if os.environ.get("DISTLAB_CHROMIUM"):
        return shutil.which(os.environ["DISTLAB_CHROMIUM"])
    return next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)


def missing() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is missing (pip install -e '.[dev]')"
    if os.environ.get("DISTLAB_CHROMIUM") and find_chromium() is None:
        return f"DISTLAB_CHROMIUM={os.environ['DISTLAB_CHROMIUM']} is not an executable"
    if find_chromium() is None:
        return (f"no browser found (none of {', '.join(CHROMIUM_NAMES)} on the PATH): "
                "apt-get install chromium, or set DISTLAB_CHROMIUM to a Chromium or Chrome")
    if not shutil.which("jupyter", path=str(Path(sys.executable).parent)):
        return f"jupyter is not installed beside {sys.executable}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_without_outputs(src: Path, dst: Path) -> None:
    """``src`` as a student first opens it: no outputs, no saved widget state."""
    nb = nbformat.read(src, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, dst)


# The widgets of labs 05, 07 and 08, displayed as the labs display them (the last line
# of each display cell is the lab's own), over stand-ins for the runs the labs record:
# running the labs themselves takes minutes.
WIDGET_PRELUDE = '''\
from distlab import pp
from distlab.bench.trace import Span, Timeline
from distlab.viz.pipeline import PipelineExplorer
from distlab.viz.timeline import TimelinePicker
from distlab.viz.zero import MemoryCalculator
from distlab.zero.memory import zero_bytes as zero_bytes_per_rank  # for lab 05's answer
import dataclasses
from distlab import planner
from distlab.viz.planner import Planner

P, M = 4, 8      # lab 07's measured step: the ideal clock at 30 ms per forward
SCHEDULES = {"gpipe": pp.gpipe_schedule, "1f1b": pp.one_f_one_b_schedule}  # lab 07's answers
measured = {pp.TITLES[name]: [dict(e, start=0.03 * e["start"], end=0.03 * e["end"])
                              for e in pp.simulate(SCHEDULES[name](P, M))]
            for name in ("gpipe", "1f1b")}


def step(sizes, backward=0.02, latency=0.0015, per_mib=0.008):
    """Lab 08's shape of a step on 2 ranks: one all-reduce per bucket of ``sizes`` bytes,
    each issued as backward reaches it, queued on one link."""
    spans, marks = [], []
    for rank in (0, 1):
        done = 0.01 + backward
        spans += [Span(rank, "compute", "forward", 0.0, 0.01),
                  Span(rank, "compute", "backward", 0.01, done)]
        end = 0.0
        for i, size in enumerate(sizes):
            issued = 0.01 + backward * (i + 1) / len(sizes)
            end = max(issued, end) + latency + per_mib * size / 2**20
            spans.append(Span(rank, "comm", "all_reduce", issued, end, size))
            marks.append((rank, f"bucket {i}", issued))
        spans += [Span(rank, "wait", "wait", done, end),
                  Span(rank, "compute", "step", end, end + 0.002)]
    return Timeline(spans, marks)


timelines = {"per parameter": step([4096] * 60 + [2**20]), "1/4 MiB": step([2**18] * 17),
             "1 MiB": step([2**20] * 4 + [2**17]), "naive": step([int(4.1 * 2**20)])}

# lab 09's planner on its first run, Llama 3.1 405B (the lab's cell: Meta's 8K setting)
LLAMA = planner.Plan(planner.Model(layers=126, d_model=16384, heads=128, vocab=128256, kv_heads=8,
                                   ffn=53248, gated=True, tied=False),
                     seq_len=8192, global_batch=2048, gpus=16384, gpu_bytes=80e9,
                     peak_flops=989.4e12, intra_bw=370e9, inter_bw=50e9, efficiency=0.52,
                     sequence_parallel=True, virtual_stages=8)'''
WIDGET_CELLS = {
    "MemoryCalculator": ("MemoryCalculator(num_params=7.5e9, world_size=64, "
                         "zero_bytes=zero_bytes_per_rank)"),
    "PipelineExplorer": (
        "BY_TITLE = {title: name for name, title in pp.TITLES.items()}\n"
        "PipelineExplorer(lambda title, stages, m: pp.simulate(SCHEDULES[BY_TITLE[title]]("
        "stages, m)),\n                 measured, p=P, m=M)"),
    "TimelinePicker": 'TimelinePicker(timelines, description="buckets")',
    "Planner": "Planner(LLAMA)",
}


def widget_notebook(path: Path) -> Path:
    """Write the notebook of the widgets (no outputs) to ``path``."""
    cells = [nbformat.v4.new_markdown_cell("The widgets of labs 05, 07, 08 and 09."),
             nbformat.v4.new_code_cell(WIDGET_PRELUDE)]
    cells += [nbformat.v4.new_code_cell(source) for source in WIDGET_CELLS.values()]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3",
                              "language": "python"}
    nbformat.write(nb, path)
    return path


def widgets_in_process() -> dict:
    """The widgets as the notebook of :func:`widget_notebook` makes them, made in
    this process (for the static checks): name -> widget."""
    namespace: dict = {}
    exec(WIDGET_PRELUDE, namespace)
    made = {}
    for name, source in WIDGET_CELLS.items():
        *body, last = ast.parse(source).body          # the widget is the last expression
        exec(compile(ast.Module(body, []), name, "exec"), namespace)
        made[name] = eval(compile(ast.Expression(last.value), name, "eval"), namespace)
    return made


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process, from Linux's /proc."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(stat.parent.name)] = (int(fields[1]), int(fields[19]))
    return found


def descendants(pid: int) -> dict[int, int]:
    """pid -> start time of every process below ``pid``. Kernels and their ranks live in
    sessions of their own, so killing the server's process group would miss them."""
    procs = _processes()
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, start) in procs.items():
            if ppid == parent and child not in found:
                found[child] = start
                todo.append(child)
    return found


def kill_leftovers(processes: dict[int, int]) -> None:
    """SIGKILL each of ``processes`` still alive (the same pid *and* start time)."""
    alive = _processes()
    for pid, start in processes.items():
        if alive.get(pid, (0, None))[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class JupyterLab:
    """``jupyter lab`` over copies of ``notebooks`` in ``root``; a context manager.

    ``url(name)`` opens a notebook; ``log`` is the server's output.
    """

    def __init__(self, notebooks: list[Path], root: Path, log: Path, start_timeout: float = 90,
                 make_lab: bool = False, user: tuple[int, int] | None = None):
        """``make_lab``: start it with the kit's ``make lab``; ``user``: (uid, gid) to run it
        as, from root."""
        self.root, self.log, self.start_timeout = root, log, start_timeout
        self.make_lab, self.user = make_lab, user
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        (root / "notebooks").mkdir(parents=True)
        for nb in notebooks:
            copy_without_outputs(nb, root / "notebooks" / nb.name)
        if user:
            for path in [root, *root.rglob("*")]:
                os.chown(path, *user)

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{notebook}?token={self.token}"

    def path(self, notebook: str) -> Path:
        return self.root / "notebooks" / notebook

    def _command(self) -> list[str]:
        options = ["--ServerApp.open_browser=False", "--ServerApp.ip=127.0.0.1",
                   "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}"]
        if self.make_lab:
            return ["make", "-s", "-C", str(REPO), "lab", f"LAB_DIR={self.root / 'notebooks'}",
                    f"LAB_ARGS=--port={self.port} {' '.join(options)}"]
        return jupyter.command(self.root / "notebooks", self.port, *options)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, HOME=str(self.root))
        home = self.root / "jupyter"
        for name, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                          ("JUPYTER_DATA_DIR", "data"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                          ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")):
            (home / sub).mkdir(parents=True, exist_ok=True)
            if self.user:
                os.chown(home / sub, *self.user)
            env[name] = str(home / sub)
        # as make lab does: no news or update toast over the notebook (the environment's
        # overrides.json), and the notebooks given this kernel's metadata
        jupyter.write_overrides()
        jupyter.match_kernel(self.root / "notebooks")
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.pop("JUPYTER_TOKEN", None)
        return env

    def start(self) -> "JupyterLab":
        for _ in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            uid, gid = self.user or (None, None)
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self._env(),
                                             cwd=self.root, start_new_session=True, user=uid,
                                             group=gid, extra_groups=[] if self.user else None)
            if self._wait_ready():
                return self
            self.stop()
            if "in use" not in self.log.read_text():
                break
        raise RuntimeError(f"JupyterLab did not start; its log: {self.log}\n"
                           + self.log.read_text()[-3000:])

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/status",
                                         headers={"Authorization": f"token {self.token}"})
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(request, timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except (OSError, http.client.HTTPException):   # not listening, or starting
                time.sleep(0.3)
        return False

    def stop(self) -> None:
        """Stop the server (SIGTERM: it shuts its kernels down), then kill what is left."""
        if self.proc is None:
            return
        below = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                below.update(descendants(self.proc.pid))
                self.proc.kill()
                self.proc.wait()
        kill_leftovers(below)
        self.proc = None

    def __enter__(self) -> "JupyterLab":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
