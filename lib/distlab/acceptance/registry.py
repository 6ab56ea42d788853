"""The registry of acceptance checks, and what a check is given and gives back.

A :class:`Check` names what it needs (``gpus``), how long it may take (``time_limit``,
seconds, for everything it starts), the goal in words, and ``run(ctx)``, which starts
its bench through :meth:`Context.run` (a subprocess, killed with everything it started
when the check's time is up) and returns a :class:`Verdict`: the goals it missed, in
words, and the measured figures. ``run`` raises :class:`CheckError` when the bench
itself failed (crashed, timed out, wrote no results): no figures, an error.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import distlab

# NVLink multicast stays off on machines whose GPUs others share (NCCL, torch's symmetric
# memory, NVSHMEM): set in every process a check starts, whatever the caller's environment.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
LIB = Path(distlab.__file__).resolve().parents[1]      # the folder holding distlab/


class CheckError(RuntimeError):
    """The bench of a check did not give figures (it failed, hung or wrote nothing)."""


@dataclasses.dataclass
class Verdict:
    """What a check measured: ``misses``, each goal missed in words (empty: passed), and
    ``figures``, plain JSON data; ``figures["table"]`` (``{"columns": [...], "rows":
    [[...]]}``), when there, is what ``render`` shows."""

    misses: list[str]
    figures: dict


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    gpus: int                       # GPUs needed; fewer present: skipped
    time_limit: float               # seconds for the whole check
    goal: str
    run: Callable[["Context"], Verdict]


@dataclasses.dataclass
class Proc:
    argv: list[str]
    returncode: int | None          # None: killed at the time limit
    seconds: float
    log: Path

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-lines:])

    def check(self) -> "Proc":
        """Raise :class:`CheckError` (with the end of its output) unless it exited 0."""
        if self.returncode != 0:
            raise CheckError(f"{self.describe()}\n{self.tail()}")
        return self

    def describe(self) -> str:
        what = " ".join(self.argv[:6]) + (" ..." if len(self.argv) > 6 else "")
        if self.returncode is None:
            return f"`{what}` was stopped at the time limit after {self.seconds:.0f} s"
        return f"`{what}` exited with status {self.returncode} after {self.seconds:.0f} s"


@dataclasses.dataclass
class Context:
    """What a check runs in: the GPUs present, a scratch folder of its own, the kit's
    checkout (``root``: solutions/, tests/), and the moment its time is up."""

    gpus: int
    scratch: Path
    root: Path
    deadline: float                 # time.monotonic() value
    environment: dict = dataclasses.field(default_factory=dict)
    commands: list[str] = dataclasses.field(default_factory=list)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def python(self, *args: str, **kw) -> Proc:
        """``python ARGS...`` with this interpreter (see :meth:`run`)."""
        return self.run([sys.executable, *args], **kw)

    def run(self, argv: list[str], limit: float | None = None, env: dict | None = None,
            log: Path | None = None, cwd: Path | None = None) -> Proc:
        """Run ``argv`` in a session of its own, its output in ``log`` (default: a file in
        the scratch folder), for at most ``limit`` seconds and never past the deadline;
        at the limit the whole process group is stopped (SIGTERM, then SIGKILL)."""
        argv = [str(a) for a in argv]
        self.commands.append(" ".join(argv))
        log = log or self.scratch / f"log{len(self.commands):02d}.txt"
        log.parent.mkdir(parents=True, exist_ok=True)
        budget = self.remaining() if limit is None else min(limit, self.remaining())
        start = time.monotonic()
        if budget <= 0:
            log.write_text("not started: the check's time was up\n")
            return Proc(argv, None, 0.0, log)
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env=child_env(env), cwd=cwd or self.root)
            try:
                code = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                stop(proc)
                code = None
        return Proc(argv, code, time.monotonic() - start, log)


def child_env(extra: dict | None = None) -> dict:
    """The environment of every process a check starts: ours, this distlab importable,
    output unbuffered, ``extra``, and :data:`SAFE_ENV` over everything."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    path = env.get("PYTHONPATH", "")
    if str(LIB) not in path.split(os.pathsep):
        env["PYTHONPATH"] = str(LIB) + (os.pathsep + path if path else "")
    env.update(extra or {})
    env.update(SAFE_ENV)
    return env


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop ``proc`` and its process group: SIGTERM, then SIGKILL after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


REGISTRY: dict[str, Check] = {}


def register(check: Check) -> Check:
    """Add ``check`` to :data:`REGISTRY` (a second check of the same name replaces it)."""
    REGISTRY[check.name] = check
    return check


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)


def select(names: list[str] | None) -> list[Check]:
    """The checks named (all, in registry order, for None); ValueError naming the
    choices for an unknown name."""
    if not names:
        return list(REGISTRY.values())
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(REGISTRY)}")
    return [REGISTRY[n] for n in names]
