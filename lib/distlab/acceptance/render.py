"""Results as markdown: one small table per ``<check>.json`` with its verdict, goal,
date, hardware and commit, and a line naming the checks that have no result; and the
README's block between the markers rewritten with it, so that no GPU figure in the
README is typed by hand or outlives the results it came from; and, for the notebooks'
GPU sections, :func:`show` (one check's table, or what to run to get it)."""
from __future__ import annotations

import json
from pathlib import Path

BEGIN, END = "<!-- acceptance:begin -->", "<!-- acceptance:end -->"


def _cell(value) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value).lower()
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


VERDICTS = {"pass": "goals met", "fail": "goals missed",
            "error": "did not finish (an error, below)"}


def heading(check: str, verdict: str) -> str:
    """"#### GPU acceptance check `fp8` (committed result): goals missed": a reader of a
    notebook sees a check run on a GPU machine, not a failure of their own."""
    return f"#### GPU acceptance check `{check}` (committed result): {verdict}"


def render_result(result: dict) -> str:
    env = result.get("environment", {})
    commit = f"`{str(env.get('git_commit') or 'unknown')[:12]}`"
    changes = env.get("git_changes")
    commit += (" (changes not known)" if changes is None else
               f" plus uncommitted changes to {len(changes)} file{'s' * (len(changes) != 1)}"
               if changes else "")
    versions = ", ".join(f"{name} {env[key]}" for name, key in (
        ("torch", "torch"), ("CUDA", "cuda_runtime"), ("NCCL", "nccl"), ("driver", "cuda_driver"))
        if env.get(key))
    lines = [heading(result["check"], VERDICTS.get(result["status"], result["status"])),
             "",
             f"Goal: {result['goal']}. Measured {env.get('date', 'at an unknown date')} on "
             f"{env.get('hardware', 'unknown hardware')}; {versions}; commit "
             f"{commit}; {result.get('seconds', 0):.0f} s.",
             ""]
    table = result.get("figures", {}).get("table")
    if table and table.get("rows"):
        lines.append("| " + " | ".join(_cell(c) for c in table["columns"]) + " |")
        lines.append("|" + " --- |" * len(table["columns"]))
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table["rows"]]
        lines.append("")
    for miss in result.get("misses", []):
        lines.append(f"- missed: {_cell(miss.splitlines()[0] if miss else miss)}")
    return "\n".join(lines).rstrip() + "\n"


def load(results: Path) -> list[dict]:
    """The results in ``results``, in the registry's order, then any others by name."""
    from distlab.acceptance import checks  # noqa: F401  (the checks register on import)
    from distlab.acceptance.registry import REGISTRY

    found = {}
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "check" in data and "status" in data:
            found[data["check"]] = data
    order = [n for n in REGISTRY if n in found] + sorted(set(found) - set(REGISTRY))
    return [found[n] for n in order]


def render(results: Path) -> str:
    """The markdown for every result in ``results``, then the checks without one."""
    from distlab.acceptance.registry import REGISTRY

    done = load(results)
    parts = [render_result(r) for r in done]
    names = {r["check"] for r in done}
    missing = [f"`{c.name}` (needs {c.gpus} GPU{'s' * (c.gpus > 1)})" for c in REGISTRY.values()
               if c.name not in names]
    if missing:
        parts.append("No result yet for " + ", ".join(missing) + ".\n")
    header = ("Written by `python -m distlab.acceptance render` from the result files of "
              "`python -m distlab.acceptance` (docs/results/); do not edit by hand.\n")
    return "\n".join([header, *parts])


def replace_block(text: str, block: str) -> str:
    """``text`` with what lies between :data:`BEGIN` and :data:`END` replaced by
    ``block``; ValueError where the markers are missing or out of order."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} pair")
    return text[:start + len(BEGIN)] + "\n" + block.strip("\n") + "\n" + text[end:]


def block_of(text: str) -> str | None:
    """What lies between the markers (None without them)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start + len(BEGIN):end]


RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"  # a checkout's committed results


def result(check: str, results: Path = RESULTS) -> dict | None:
    """The committed result of ``check`` (``docs/results/<check>.json``), or None."""
    path = Path(results) / f"{check}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) and data.get("check") == check else None


def show(check: str, results: Path = RESULTS):
    """Display ``check``'s committed result as markdown in a notebook (its verdict, goal,
    date, hardware, versions, commit and table), or, without one, what to run to get it;
    returns the result (None without one), for cells that compute from its figures."""
    from IPython.display import Markdown, display

    from distlab.acceptance import checks  # noqa: F401  (the checks register on import)
    from distlab.acceptance.registry import REGISTRY

    if check not in REGISTRY:
        raise ValueError(f"no acceptance check named {check!r}; the checks: "
                         f"{', '.join(REGISTRY)}")
    found = result(check, results)
    if found is not None:
        title, _, body = render_result(found).partition("\n")
        display(Markdown(f"{title}\n\nMeasured by `python -m distlab.acceptance --only "
                         f"{check}` on a GPU machine and committed to `docs/results/`; nothing "
                         f"in this notebook ran it.\n{body}"))
        return found
    needs = REGISTRY[check].gpus
    display(Markdown(
        f"#### GPU acceptance check `{check}`: no result yet\n\nGoal: "
        f"{REGISTRY[check].goal}.\n\nNo run of this "
        f"check is committed in `docs/results/`. On a machine with {needs} GPU"
        f"{'s' * (needs > 1)}: `python -m distlab.acceptance --only {check} --out docs/results`, "
        f"then re-run this cell."))
    return None
