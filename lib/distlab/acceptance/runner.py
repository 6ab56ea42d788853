"""Run checks: skip those that need more GPUs than present, give each its time limit,
judge it, and write ``<check>.json`` with the goal, the verdict, the figures and the
environment they were measured in."""
from __future__ import annotations

import json
import os
import shutil
import time
import traceback
from pathlib import Path

from distlab.acceptance.environment import now
from distlab.acceptance.registry import LIB, Check, CheckError, Context


def kit_root() -> Path:
    """The checkout the kit runs from (solutions/, tests/): the one holding this
    distlab, else the current folder."""
    here = LIB.parent
    return here if (here / "solutions").is_dir() else Path.cwd()


def skip_reason(check: Check, gpus: int) -> str | None:
    if check.gpus > gpus:
        return f"skipped: needs {check.gpus} GPU{'s' * (check.gpus > 1)}, this machine has {gpus}"
    return None


def run_check(check: Check, environment: dict, work: Path, root: Path,
              deadline: float | None = None) -> dict:
    """Run ``check`` (which must not be skipped) and return its result (not yet written);
    everything it starts ends by its time limit, or by ``deadline`` (a time.monotonic()
    value: the whole run's budget) where that comes first."""
    scratch = work / check.name
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    start = time.monotonic()
    limit = start + check.time_limit
    ctx = Context(gpus=environment["gpus"], scratch=scratch, root=root,
                  deadline=min(limit, deadline or limit), environment=environment)
    status, misses, figures = "pass", [], {}
    try:
        verdict = check.run(ctx)
        misses, figures = list(verdict.misses), verdict.figures
        status = "fail" if misses else "pass"
    except CheckError as exc:
        status, misses = "error", [str(exc)]
    except Exception:  # a check's own bug must not cost the others their results
        status, misses = "error", [traceback.format_exc(limit=5)]
    seconds = time.monotonic() - start
    if status != "pass" and time.monotonic() >= ctx.deadline:
        misses.append(f"the check's time limit of {check.time_limit:g} s was reached" if
                      ctx.deadline == limit else "the run's --budget was reached")
    env = dict(environment, date=now())
    return {"check": check.name, "goal": check.goal, "gpus_needed": check.gpus,
            "time_limit_s": check.time_limit, "status": status, "passed": status == "pass",
            "misses": misses, "figures": figures, "seconds": round(seconds, 1),
            "commands": ctx.commands, "environment": env}


def write(result: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['check']}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def run(checks: list[Check], out: Path, work: Path, environment: dict,
        root: Path | None = None, echo=None, budget: float | None = None) -> int:
    """Run ``checks``, all within ``budget`` seconds if given; 0 when every one that
    ran met its goals (skipped ones count as met), else 1."""
    root = root or kit_root()
    deadline = None if budget is None else time.monotonic() + budget
    echo = echo or (lambda text: print(text, flush=True))
    bad = []
    for check in checks:
        reason = skip_reason(check, environment["gpus"])
        if reason:
            echo(f"{check.name}: {reason}")
            continue
        echo(f"{check.name}: running (limit {check.time_limit:g} s) ...")
        result = run_check(check, environment, work, root, deadline)
        path = write(result, out)
        echo(f"{check.name}: {result['status']} in {result['seconds']:.0f} s -> {path}")
        for miss in result["misses"]:
            echo("  " + miss.replace("\n", "\n  "))
        if result["status"] != "pass":
            bad.append(check.name)
    if bad:
        echo(f"goals missed or checks failed: {', '.join(bad)}")
    return 1 if bad else 0
