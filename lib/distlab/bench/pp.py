"""Pipeline parallelism measured: the bubble against (p-1)/(m+p-1), the peak memory of
each stage under GPipe and 1F1B, and the step time against torch's own pipelining, for
a range of micro-batch counts.

    NCCL_NVLS_ENABLE=0 python -m distlab.bench.pp --out results/pp   # 2 GPUs, NCCL

It launches one rank per stage (``--stages``, NCCL when every rank can have a GPU),
cuts the GPT (``--model gpt-100m`` by default) into balanced stages
(:class:`distlab.pp.Stage`), and for each schedule and each m trains a few steps
(AdamW, ``--dtype`` autocast) on a fixed global batch: first with our runtime
(:class:`distlab.pp.PipelineRunner`) alone, for its step time, idle fraction, timeline
and peak memory; then step by step in alternation with ``torch.distributed.pipelining``
(``PipelineStage`` around a second copy of the same stage, ``ScheduleGPipe`` or
``Schedule1F1B``, the tied embedding's gradient summed as ours does): the same model,
micro-batches and stages in the same launch, a drifting machine slowing both alike
(not 1F1B with m < p, which torch's ``Schedule1F1B`` refuses). The first of the
``--warmup`` steps of ours also connects the neighbouring stages
(:meth:`distlab.pp.p2p.StageLink.connect`, NCCL's lazy connection setup), out of the
measurement. Per configuration it reports our median step time, torch's, and the
median over the alternated rounds of ours over torch's (the slowest stage's time in
each), the measured idle fraction of our last step (CUDA events on a GPU), the formula,
each stage's peak of live micro-batches and, on GPUs, each stage's peak memory under
our runtime (``torch.cuda.max_memory_allocated``). It writes ``pp_bench.json`` (rows,
rounds and the last step's timelines), ``pp_bubble.png``, ``pp_memory.png`` and
``pp_gantt.png`` to ``--out``, and prints the table. On NCCL it exits 1 when our step
takes more than :data:`GOAL` times torch's (:func:`goal_misses`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import backend, launch, pp
from distlab.bench.throughput import DTYPES
from distlab.bench.timing import sync
from distlab.model import GPT, PRESETS, config
from distlab.pp.p2p import StageLink
from distlab.pp.runtime import sum_tied_gradients

GOAL = 1.25  # our step time over torch.distributed.pipelining's, at most (every schedule, m)


def _trainer(step, params, device, cuda: bool):
    """A training step to time: ``step()`` (forward and backward), then AdamW; called, it
    returns its seconds, started on an idle device after a barrier."""
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)

    def timed() -> float:
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - start
    return timed


def torch_pipeline(stage, name: str, m: int, device):
    """``torch.distributed.pipelining``'s schedule ``name`` ("gpipe", "1f1b") of m
    micro-batches around ``stage``, and a step ``(inputs, targets) -> None`` that also
    sums the tied embedding's gradient (torch's pipelining knows nothing of tied weights;
    ours sums it in every step)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    schedule = cls(PipelineStage(stage, stage.index, stage.num_stages, device),
                   n_microbatches=m, loss_fn=pp.cross_entropy)
    link = StageLink()

    def step(inputs, targets):
        schedule.step(*([inputs] if stage.is_first else []),
                      **({"target": targets} if stage.is_last else {}))
        sum_tied_gradients(stage, link)
    return step


def measure(cfg, batch_size: int, seq_len: int, dtype: str, microbatches: list[int],
            schedules: list[str], steps: int, warmup: int, run_stage=None,
            tables=None) -> list[dict]:
    """On each rank (one stage each): every (schedule, m), trained ``warmup + steps``
    steps with our runtime, then ``warmup`` steps of torch's pipelining and ``steps``
    rounds of one step of each. Returns one row per configuration with this stage's
    figures. With ``run_stage`` (lab 07's exercise's contract) and ``tables`` (schedule
    name → its table function, ``(p, m) -> table``), "ours" is that function on those
    tables, timed by :func:`distlab.pp.traced_step`, and torch's pipelining is not run:
    its side sums the tied weight's gradient with the library's runtime, lab 07's answer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = backend.device()
    cuda = device.type == "cuda"
    autocast = contextlib.nullcontext() if dtype == "fp32" else torch.autocast(
        device.type, dtype=DTYPES[dtype])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(cfg.vocab_size, (batch_size, seq_len + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    rows = []
    configs = [(name, m) for name in schedules for m in microbatches]
    for name, m in launch.progress(configs, desc=f"{world} stages"):
        torch.manual_seed(0)
        with torch.device(device):  # initialised in place: faster on a GPU than on the host
            stage = pp.Stage(GPT(cfg), rank, world)
        last = {}
        if run_stage is None:
            runner = pp.PipelineRunner(stage, pp.build_schedule(name, world, m))

            def ours():
                with autocast:
                    runner.step(inputs, targets)
                last["timeline"] = runner.timeline
        else:
            table = tables[name](world, m)

            def ours():
                with autocast:
                    last["timeline"] = pp.traced_step(run_stage, stage, table, inputs, targets)[1]
        step_ours = _trainer(ours, stage.parameters(), device, cuda)
        times = []
        for n in range(warmup + steps):
            if n == warmup and cuda:
                torch.cuda.reset_peak_memory_stats(device)
            times.append(step_ours())
        row = {"schedule": name, "m": m, "stage": rank, "layers": stage.layer_names,
               "step_s": statistics.median(times[warmup:]),
               "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
               "timeline": last["timeline"], "rounds": None, "torch_error": None}
        # torch's Schedule1F1B refuses m < p
        if run_stage is None and not (name == "1f1b" and m < world):
            torch.manual_seed(0)
            with torch.device(device):
                other = pp.Stage(GPT(cfg), rank, world)
            try:
                step = torch_pipeline(other, name, m, device)

                def theirs():
                    with autocast:
                        step(inputs, targets)
                step_theirs = _trainer(theirs, other.parameters(), device, cuda)
                for _ in range(warmup):
                    step_theirs()
                # alternated, so that a drifting machine slows both alike
                row["rounds"] = [(step_ours(), step_theirs()) for _ in range(steps)]
            except Exception as exc:  # noqa: BLE001  (the API changes between torch versions)
                row["torch_error"] = f"{type(exc).__name__}: {(str(exc) or '-').splitlines()[0]}"
            del other
        del stage, ours
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def summarise(per_rank: list[list[dict]], batch_size: int, seq_len: int) -> list[dict]:
    """One row per (schedule, m) from every stage's rows."""
    p = len(per_rank)
    out = []
    for i, first in enumerate(per_rank[0]):
        mine = [rows[i] for rows in per_rank]
        events = [e for r in mine for e in r["timeline"]]
        step = max(r["step_s"] for r in mine)
        errors = [r["torch_error"] for r in mine if r["torch_error"]]
        rounds = None if errors or mine[0]["rounds"] is None else [
            [max(r["rounds"][k][j] for r in mine) for j in (0, 1)]  # the slowest stage's
            for k in range(len(mine[0]["rounds"]))]
        live = pp.peak_live(events)
        out.append({"schedule": first["schedule"], "m": first["m"], "p": p,
                    "step_ms": 1e3 * step, "tokens_per_s": batch_size * seq_len / step,
                    "torch_step_ms": None if rounds is None else 1e3 * statistics.median(
                        t for _, t in rounds),
                    "vs_torch": None if rounds is None else statistics.median(
                        o / t for o, t in rounds),
                    "rounds_ms": None if rounds is None else [[1e3 * o, 1e3 * t]
                                                              for o, t in rounds],
                    "torch_error": errors[0] if errors else None,
                    "idle": pp.idle_fraction(events, p),
                    "formula": pp.bubble_fraction(p, first["m"]),
                    "peak_live": [live[s] for s in range(p)],
                    "peak_gib": [None if r["peak_bytes"] is None else r["peak_bytes"] / 2**30
                                 for r in mine],
                    "layers": [r["layers"] for r in mine], "timeline": events})
    return out


def goal_misses(rows: list[dict]) -> list[str]:
    """Each configuration where our step took more than :data:`GOAL` times torch's, or
    where torch's pipelining did not run (1F1B with m < p is not compared: torch's
    ``Schedule1F1B`` refuses it)."""
    return [f"{pp.TITLES[r['schedule']]}, m = {r['m']}: " + (
        f"torch.distributed.pipelining did not run ({r['torch_error']})" if r["torch_error"] else
        f"our step {r['step_ms']:.1f} ms is {r['vs_torch']:.2f}x torch's {r['torch_step_ms']:.1f} "
        f"ms, above {GOAL}x") for r in rows
        if r["torch_error"] or (r["vs_torch"] is not None and r["vs_torch"] > GOAL)]


def table(rows: list[dict]) -> str:
    lines = [f"{'schedule':>8} {'m':>3} {'step ms':>8} {'torch ms':>8} {'/torch':>6} "
             f"{'tokens/s':>10} {'idle':>6} {'formula':>7}  {'peak live per stage':<20} "
             f"peak memory per stage (GiB)"]
    for r in rows:
        mem = ("n/a (no GPU)" if r["peak_gib"][0] is None else
               " ".join(f"{g:.2f}" for g in r["peak_gib"]))
        theirs = (f"{'failed':>8} {'-':>6}" if r["torch_error"] else
                  f"{'n/a':>8} {'-':>6}" if r["vs_torch"] is None else
                  f"{r['torch_step_ms']:8.1f} {r['vs_torch']:6.2f}")
        lines.append(f"{pp.TITLES[r['schedule']]:>8} {r['m']:>3} {r['step_ms']:8.1f} {theirs} "
                     f"{r['tokens_per_s']:10,.0f} {r['idle']:6.1%} {r['formula']:7.1%}  "
                     f"{str(r['peak_live']):<20} {mem}")
    return "\n".join(lines)


def draw(rows: list[dict], title: str) -> dict:
    """The bench's figures from its rows (``pp_bench.json``'s, or the ``pp`` acceptance
    check's): file name -> matplotlib figure. The bubble against the formula; the peak
    memory per stage (rows measured on GPUs); the Gantt charts of both schedules at the
    middle m (rows that kept their timeline)."""
    import matplotlib.pyplot as plt

    from distlab.viz.pipeline import compare_figure, plot_bubble

    figs = {"pp_bubble.png": plot_bubble(
        [{"label": f"{pp.TITLES[r['schedule']]} measured", "m": r["m"], "p": r["p"],
          "idle": r["idle"]} for r in rows], title=title)}
    ms = sorted({r["m"] for r in rows})
    if rows[0]["peak_gib"][0] is not None:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name in dict.fromkeys(r["schedule"] for r in rows):
            mine = [r for r in rows if r["schedule"] == name]
            for s in range(rows[0]["p"]):
                ax.plot([r["m"] for r in mine], [r["peak_gib"][s] for r in mine], marker="o",
                        ls="-" if name == "gpipe" else "--", color=f"C{s}",
                        label=f"{pp.TITLES[name]}, stage {s}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.minorticks_off()
        ax.set_xlabel("micro-batches m (same global batch)")
        ax.set_ylabel("peak memory (GiB)")
        ax.set_title(f"{title}: peak memory per stage", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        figs["pp_memory.png"] = fig
    middle = ms[len(ms) // 2]
    panels = {f"{pp.TITLES[r['schedule']]}, p={r['p']}, m={r['m']}": (r["timeline"], "ms")
              for r in rows if r["m"] == middle and r.get("timeline")}
    if panels:
        figs["pp_gantt.png"] = compare_figure(panels, columns=1)
    return figs


def figures(rows: list[dict], out: Path, title: str) -> list[Path]:
    """:func:`draw`'s figures written to ``out``; returns the files written (none, with a
    note, where matplotlib or ipywidgets is missing: ``--replot`` draws them elsewhere)."""
    try:
        import matplotlib.pyplot as plt

        figs = draw(rows, title)
    except ImportError as exc:
        print(f"figures skipped ({exc}); draw them where matplotlib and ipywidgets are "
              f"installed: python -m distlab.bench.pp --replot --out {out}")
        return []
    written = []
    for name, fig in figs.items():
        written.append(out / name)
        fig.savefig(written[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return written


def main(argv=None, run_stage=None, tables=None) -> int:
    """The command line; from a notebook, ``run_stage`` and ``tables`` time a student's
    runtime and schedules instead of the library's (:func:`measure`)."""
    p = argparse.ArgumentParser(prog="python -m distlab.bench.pp", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and PNGs")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = ranks")
    p.add_argument("--model", default="gpt-100m", choices=sorted(PRESETS))
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per global batch")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's seq_len")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--microbatches", default="1,2,4,8,16",
                   help="comma-separated micro-batch counts (each at most --batch-size)")
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--steps", type=int, default=8,
                   help="measured steps per configuration, and rounds against torch's")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=backend.BACKENDS)
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds before the launch is reported as hung, with each rank's stack")
    p.add_argument("--replot", action="store_true",
                   help="measure nothing: print the table and draw the figures of the "
                        "pp_bench.json already in --out")
    args = p.parse_args(argv)
    if args.replot:
        data = json.loads((args.out / "pp_bench.json").read_text())
        print(data["title"])
        print(table(data["rows"]))
        for path in figures(data["rows"], args.out, data["title"]):
            print(f"wrote {path}")
        return 0
    ms = [int(m) for m in args.microbatches.split(",")]
    if max(ms) > args.batch_size:
        p.error(f"--microbatches up to {max(ms)} need --batch-size >= {max(ms)}")
    cfg = config(args.model, args.vocab_size)
    seq_len = args.seq_len or cfg.seq_len
    args.out.mkdir(parents=True, exist_ok=True)
    print(backend.explain(args.stages, args.backend))
    per_rank = launch.run(measure, args.stages, cfg, args.batch_size, seq_len, args.dtype, ms,
                          args.schedules.split(","), args.steps, args.warmup, run_stage, tables,
                          backend=args.backend, timeout=args.timeout)
    rows = summarise(per_rank, args.batch_size, seq_len)
    title = (f"{args.model}, {args.stages} stages, {args.batch_size}x{seq_len} tokens, "
             f"{args.dtype}, {backend.choose(args.stages, args.backend)}")
    print(title)
    print("stages: " + " | ".join(", ".join(layers) for layers in rows[0]["layers"]))
    print(table(rows))
    (args.out / "pp_bench.json").write_text(json.dumps(
        {"title": title, "device": backend.info().gpu_names or ["CPU"], "rows": rows}, indent=1))
    for path in [args.out / "pp_bench.json"] + figures(rows, args.out, title):
        print(f"wrote {path}")
    misses = goal_misses(rows)
    for miss in misses:
        print(f"goal missed: {miss}")
    # CPU timings on shared cores say little about the runtimes: only GPU runs count
    return 1 if misses and backend.choose(args.stages, args.backend) != "gloo" else 0


if __name__ == "__main__":
    raise SystemExit(main())
