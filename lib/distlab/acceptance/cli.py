"""``python -m distlab.acceptance``: run the GPU acceptance checks, or render their results.

    python -m distlab.acceptance --list                  # every check: GPUs, time limit, goal
    python -m distlab.acceptance                         # every check this machine can run
    python -m distlab.acceptance --only ring,zero --out results/
    python -m distlab.acceptance render [--results docs/results] [--readme README.md]

A check that needs more GPUs than the machine has is reported "skipped: needs N GPUs,
this machine has M" and writes nothing. The exit status is 1 when a check that ran
missed a goal or failed, else 0.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from distlab.acceptance import registry


def listing() -> str:
    lines = [f"{'check':<21}{'GPUs':>5}{'limit':>8}  goal"]
    for c in registry.REGISTRY.values():
        goal = textwrap.wrap(c.goal, 70) or [""]
        lines.append(f"{c.name:<21}{c.gpus:>5}{c.time_limit:>7.0f}s  {goal[0]}")
        lines += [" " * 36 + more for more in goal[1:]]
    return "\n".join(lines)


def _run_main(argv: list[str]) -> int:
    from distlab.acceptance import environment, runner

    p = argparse.ArgumentParser(prog="python -m distlab.acceptance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--only", default="", help="comma-separated checks (default: all)")
    p.add_argument("--out", type=Path, default=Path("results"),
                   help="folder for <check>.json (default: %(default)s)")
    p.add_argument("--work", type=Path, default=Path("build/acceptance"),
                   help="scratch folder for the benches' own output (default: %(default)s)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run: no check runs past it (default: each "
                        "check's own limit)")
    args = p.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    try:
        checks = registry.select([n.strip() for n in args.only.split(",") if n.strip()])
    except ValueError as exc:
        p.error(str(exc))
    root = runner.kit_root()
    env = environment.describe(root)
    print(f"# {env.get('hardware')}; torch {env.get('torch')}, NCCL {env.get('nccl')}, driver "
          f"{env.get('cuda_driver')}; commit {env.get('git_commit')}", flush=True)
    if env.get("probe_error"):
        print(f"# the environment probe failed: {env['probe_error']}", flush=True)
    return runner.run(checks, args.out, args.work, env, root, budget=args.budget)


def _render_main(argv: list[str]) -> int:
    from distlab.acceptance import render

    p = argparse.ArgumentParser(prog="python -m distlab.acceptance render",
                                description="Render result files as markdown; with --readme, "
                                            "rewrite the README's block between "
                                            f"{render.BEGIN} and {render.END}.")
    p.add_argument("--results", type=Path, default=Path("docs/results"))
    p.add_argument("--readme", type=Path, default=None,
                   help="rewrite this file's acceptance block (else print the markdown)")
    args = p.parse_args(argv)
    text = render.render(args.results)
    if args.readme is None:
        print(text, end="")
        return 0
    old = args.readme.read_text()
    try:
        new = render.replace_block(old, text)
    except ValueError as exc:
        print(f"{args.readme}: {exc}; nothing written", file=sys.stderr)
        return 1
    if new != old:
        args.readme.write_text(new)
    print(f"{args.readme}: acceptance block {'rewritten' if new != old else 'already current'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from distlab.acceptance import checks  # noqa: F401  (registers the checks)

    if argv[:1] == ["render"]:
        return _render_main(argv[1:])
    return _run_main(argv)
