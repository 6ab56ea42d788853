"""The acceptance checks: each starts its bench (``python -m distlab.bench.NAME``, the
notebooks' tests, the grader) in a subprocess and judges what it wrote. The benches
hold the measuring; the goals of zero and tp live beside them
(:func:`distlab.bench.zero.goal_misses`, :func:`distlab.bench.tp.goal_misses`); the others'
goals are stated here, each where its check judges it."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from distlab.acceptance import nccl_tests
from distlab.acceptance.registry import Check, CheckError, Context, Verdict, register

RING_GOAL = 0.8          # the reference ring's busbw over NCCL's all_reduce's, at least
NCCL_TESTS_GOAL = 1.15   # distlab.bench.collectives --api nccl over nccl-tests' time, at most
OVERLAP_GOAL = 1.05      # bucketed DataParallel's step time over torch DDP's, at most
BUBBLE_TOLERANCE = 0.05  # measured idle fraction against (p-1)/(m+p-1) at m <= 2, at most


def _json(path: Path, proc) -> dict:
    """The JSON a bench wrote; CheckError (with its output) if it wrote none."""
    if not path.exists():
        raise CheckError(f"{proc.describe()}; no {path.name} was written\n{proc.tail()}")
    return json.loads(path.read_text())


def _table(columns: list[str], rows: list[list]) -> dict:
    return {"columns": columns, "rows": rows}


def ring(ctx: Context) -> Verdict:
    from distlab.bench.ring import Result
    from distlab.units import size_label

    out = ctx.scratch / "ring"
    proc = ctx.python("-m", "distlab.bench.ring", "--backend", "nccl", "-n", "2", "-b", "64M",
                      "-e", "1G", "-f", "2", "--graph", "--out", out)
    result = Result(**_json(out / "ring_bench.json", proc))
    proc.check()
    ours, nccl = result.busbw("reference ring"), result.busbw("backend")
    ratios, spread = result.ratio["reference ring"], result.spread["reference ring"]
    misses = [f"{size_label(s)}: reference ring at {r:.3f}x NCCL's busbw, below {RING_GOAL}x"
              for s, r in zip(result.sizes, ratios) if r < RING_GOAL]
    rows = [[size_label(s), n / 1e9, o / 1e9, r, f"{lo:.2f}-{hi:.2f}"]
            for s, n, o, r, (lo, hi) in zip(result.sizes, nccl, ours, ratios, spread)]
    return Verdict(misses, {
        "sizes": result.sizes, "busbw_nccl": nccl, "busbw_ring": ours, "ratio": ratios,
        "spread": spread, "rounds": result.rounds, "graph": result.graph,
        "table": _table(["size", "NCCL all_reduce busbw (GB/s)", "reference ring (GB/s)",
                         "ratio (median)", "range over rounds"], rows)})


def bench_vs_nccl_tests(ctx: Context) -> Verdict:
    from distlab.units import size_label

    capability = (ctx.environment.get("compute_capability") or ["9.0"])[0]
    binaries, env = nccl_tests.build(ctx, capability)
    reference = nccl_tests.run_all(ctx, binaries, env, 2, ctx.scratch / "nccl-tests")
    out = ctx.scratch / "bench"
    proc = ctx.python("-m", "distlab.bench.collectives", "-n", "2", "--backend", "nccl", "-b", "8",
                      "-e", "1G", "-f", "2", "-w", "10", "-i", "50", "-r", "3", "--api", "nccl",
                      "--nccl-tests", reference, "--out", out)
    compared = _json(out / "bench.json", proc).get("vs_nccl_tests") or []
    proc.check()
    if not compared:
        raise CheckError("the bench compared no size with nccl-tests' outputs")
    misses = [f"{c['op']} at {size_label(c['size'])}: {c['ratio']:.3f}x nccl-tests' time, "
              f"above {NCCL_TESTS_GOAL}x" for c in compared if c["ratio"] > NCCL_TESTS_GOAL]
    rows = []
    for op in dict.fromkeys(c["op"] for c in compared):
        mine = [c for c in compared if c["op"] == op]
        worst = max(mine, key=lambda c: c["ratio"])
        rows.append([op, f"{size_label(mine[0]['size'])} - {size_label(mine[-1]['size'])}",
                     statistics.median(c["ratio"] for c in mine), worst["ratio"],
                     size_label(worst["size"])])
    return Verdict(misses, {"compared": compared, "table": _table(
        ["op", "sizes", "ratio to nccl-tests (median)", "worst", "at"], rows)})


def _zero(ctx: Context, world: int, sections: str) -> Verdict:
    from distlab.bench import zero

    out = ctx.scratch / "zero"
    proc = ctx.python("-m", "distlab.bench.zero", "--world-size", str(world), "--backend", "nccl",
                      "--sections", sections, "--out", out)
    results = _json(out / "zero_bench.json", proc)
    misses = zero.goal_misses(results)
    if proc.returncode != 0 and not misses:
        proc.check()
    rows = [[f"kernel / fused AdamW, rank {rank}", r["kernel"]["kernel / fused AdamW"],
             f"<= {zero.GOALS['kernel / fused AdamW']}"] for rank, r in enumerate(results)
            if "kernel / fused AdamW" in r.get("kernel", {})]
    memory = [r["memory"] for r in results if "activations" in r.get("memory", {})]
    for s in zero.STRATEGIES if memory else ():
        worst = max(abs(m[s][k] or 0) for m in memory for k in ("states error",
                                                                "step buffers error", "memory error"))
        rows.append([f"{s}: largest |error| against the accounting (states, step buffers, "
                     f"peak; every rank)", worst, f"<= {zero.GOALS['memory error']}"])
        rows.append([f"{s}: bytes left behind (most of any rank)",
                     max(m[s]["left behind"] for m in memory), "0"])
    for opt, ratio in results[0].get("speed", {}).get("ZeRO-3 / FSDP2", {}).items():
        rows.append([f"ZeRO-3 / FSDP2 step time, AdamW {opt}", ratio,
                     f"<= {zero.GOALS['ZeRO-3 / FSDP2']}"])
    return Verdict(misses, {"results": results, "world_size": world, "sections": sections,
                            "table": _table(["figure", "measured", "goal"], rows)})


def zero_two(ctx: Context) -> Verdict:
    return _zero(ctx, 2, "kernel,memory,speed")


def zero_one(ctx: Context) -> Verdict:
    return _zero(ctx, 1, "kernel,memory")


def tp(ctx: Context) -> Verdict:
    from distlab.bench import tp as tp_bench

    out = ctx.scratch / "tp"
    proc = ctx.python("-m", "distlab.bench.tp", "--world-size", "2", "--out", out)
    data = _json(out / "tp_bench.json", proc)
    misses = tp_bench.goal_misses(data["links"], data["meta"]["backend"])
    if proc.returncode != 0 and not misses:
        proc.check()
    rows = []
    for link, r in data["links"].items():
        if "error" in r:
            rows.append([link, r["error"], "", "", ""])
            continue
        ms = [1e3 * r.get(v, {}).get("step_s", float("nan")) for v in tp_bench.VARIANTS]
        rows.append([link, *ms[:2], ms[0] / ms[1], *ms[2:]])
    return Verdict(misses, {**data, "table": _table(
        ["link", "distlab TP (ms/step)", "torch TP (ms/step)", "distlab / torch TP",
         "torch DDP (ms/step)", "distlab DP (ms/step)"], rows)})


def pp(ctx: Context) -> Verdict:
    from distlab.bench import pp as pp_bench
    from distlab.pp import TITLES

    misses = []
    test = ctx.root / "tests" / "test_pp.py"
    if test.exists():
        proc = ctx.python("-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-m",
                          "multigpu", test, limit=240)
        if proc.returncode != 0:
            misses.append(f"the multigpu tests of tests/test_pp.py (2 NCCL stages against one "
                          f"process): {proc.describe()}: {proc.tail(3)}")
    else:
        misses.append(f"no {test}: run the acceptance suite from a checkout of the kit")
    out = ctx.scratch / "pp"
    proc = ctx.python("-m", "distlab.bench.pp", "--stages", "2", "--out", out)
    data = _json(out / "pp_bench.json", proc)
    rows = data["rows"]
    torch_misses = pp_bench.goal_misses(rows)
    if proc.returncode != 0 and not torch_misses:
        proc.check()
    misses += torch_misses
    misses += [f"{TITLES[r['schedule']]}, m = {r['m']}: idle {r['idle']:.1%} against the formula's "
               f"{r['formula']:.1%}" for r in rows
               if r["m"] <= 2 and abs(r["idle"] - r["formula"]) > BUBBLE_TOLERANCE]
    ms = sorted({r["m"] for r in rows})
    middle = ms[len(ms) // 2]  # the Gantt charts' (distlab.bench.pp.draw)
    return Verdict(misses, {"title": data["title"], "rows": [
        {k: v for k, v in r.items() if k != "timeline" or r["m"] == middle} for r in rows],
        "table": _table(
        ["schedule", "m", "ms/step", "torch ms/step", "ours / torch", "idle", "formula",
         "peak live per stage", "peak GiB per stage"],
        [[TITLES[r["schedule"]], r["m"], r["step_ms"], r["torch_step_ms"], r["vs_torch"],
          r["idle"], r["formula"], str(r["peak_live"]),
          " / ".join("-" if g is None else f"{g:.2f}" for g in r["peak_gib"])] for r in rows])})


def overlap(ctx: Context) -> Verdict:
    out = ctx.scratch / "overlap"
    proc = ctx.python("-m", "distlab.bench.overlap", "--world-size", "2", "--rounds", "7",
                      "--iters", "5", "--out", out)
    results = _json(out / "overlap_bench.json", proc)["results"]
    proc.check()
    misses, rows = [], []
    for link, per_rank in results.items():
        for shape, r in per_rank[0]["shapes"].items():
            s = r["seconds"]
            ratio = s["bucketed"] / s["torch DDP"]
            rows.append([link, shape, per_rank[0]["busbw"] / 1e9, 1e3 * s["naive"],
                         1e3 * s["bucketed"], 1e3 * s["torch DDP"], ratio])
            if ratio > OVERLAP_GOAL:
                misses.append(f"{link}, {shape} tokens per GPU: bucketed / DDP {ratio:.3f}, "
                              f"above {OVERLAP_GOAL}")
    return Verdict(misses, {"results": results, "table": _table(
        ["link", "tokens per GPU", "busbw (GB/s)", "naive (ms)", "bucketed (ms)",
         "torch DDP (ms)", "bucketed / DDP"], rows)})


def train(ctx: Context) -> Verdict:
    from distlab.bench import train as train_bench

    out = ctx.scratch / "train"
    proc = ctx.python("-m", "distlab.bench.train", "--layouts", *train_bench.LAYOUTS,
                      "--model", "gpt-100m", "--backend", "nccl", "--out", out)
    data = _json(out / "train_bench.json", proc)
    misses = train_bench.goal_misses(data["rows"])
    if proc.returncode != 0 and not misses:
        proc.check()
    rows = [[r["link"], r["layout"], r.get("error") or r["tokens_per_s"],
             r.get("torch_tokens_per_s"), r.get("vs_torch"), r.get("mfu"), r.get("torch_mfu")]
            for r in data["rows"]]
    return Verdict(misses, {**data, "table": _table(
        ["link", "(dp, tp, pp)", "ours (tokens/s)", "torch (tokens/s)", "ours / torch step time",
         "ours MFU", "torch MFU"], rows)})


def cp(ctx: Context) -> Verdict:
    from distlab.bench import cp as cp_bench

    out = ctx.scratch / "cp"
    proc = ctx.python("-m", "distlab.bench.cp", "--world-size", "2", "--out", out)
    data = _json(out / "cp_bench.json", proc)
    misses = cp_bench.goal_misses(data["rows"])
    if proc.returncode != 0 and not misses:
        proc.check()
    rows = [[r["seq_len"], 1e3 * r["ours_median_s"],
             None if r["torch_median_s"] is None else 1e3 * r["torch_median_s"], r["ratio"],
             1e3 * r["allgather_mha_median_s"], r["allgather_mha_ratio"],
             r["allgather_mha_model"], 1e3 * r["allgather_gqa_median_s"],
             r["allgather_gqa_ratio"], r["allgather_gqa_model"],
             *(r["bytes"][k] / 2**20 for k in ("ours", "allgather_mha", "allgather_gqa")),
             r["contiguous_balance"], r["zigzag_balance"], r["error"], r["allgather_error"]]
            for r in data["rows"]]
    heads, kv = data["meta"]["heads"], data["meta"]["kv_heads"]
    return Verdict(misses, {**data, "table": _table(
        ["tokens", "ring (ours) fwd+bwd (ms)", "torch context_parallel (ms)", "ours / torch",
         f"all-gather, {heads} K/V heads (ms)", "over the ring", "model",
         f"all-gather, {kv} K/V heads (ms)", "over the ring", "model (goal)",
         "ring MiB/rank", f"all-gather {heads} MiB/rank", f"all-gather {kv} MiB/rank",
         "contiguous max/min rank time", "zigzag max/min rank time", "ring bf16 error",
         "all-gather bf16 error"], rows)})


def ep(ctx: Context) -> Verdict:
    from distlab.bench import ep as ep_bench

    out = ctx.scratch / "ep"
    proc = ctx.python("-m", "distlab.bench.ep", "--world-size", "2", "--out", out)
    data = _json(out / "ep_bench.json", proc)
    misses = ep_bench.goal_misses(data["rows"])
    if proc.returncode != 0 and not misses:
        proc.check()
    rows = [[r["tokens"], r["bytes"], 1e3 * r["seconds"], r["busbw"] / 1e9, r["a2a_busbw"] / 1e9,
             r["ratio"]] for r in data["rows"]]
    return Verdict(misses, {**data, "table": _table(
        ["tokens per rank", "bytes of rows", "dispatch+combine (ms)", "its busbw (GB/s)",
         "all_to_all_single busbw (GB/s)", "ratio"], rows)})


def sdc(ctx: Context) -> Verdict:
    from distlab.bench import sdc as sdc_bench

    out = ctx.scratch / "sdc"
    proc = ctx.python("-m", "distlab.bench.sdc", "--out", out)
    data = _json(out / "sdc_bench.json", proc)
    misses = sdc_bench.goal_misses(data["rows"])
    if proc.returncode != 0 and not misses:
        proc.check()
    rows = [[r["preset"], r["params"], r["batch"], 1e3 * r["plain_s"], 1e3 * r["checked_s"],
             r["ratio"], 1e3 * r["hash_s"]] for r in data["rows"]]
    return Verdict(misses, {**data, "table": _table(
        ["model", "parameters", "batch", "plain step (ms)", "checked step (ms)", "ratio",
         "hashing (ms)"], rows)})


def fp8(ctx: Context) -> Verdict:
    from distlab.bench import fp8 as fp8_bench

    _needs("torchao", f"it is FP8's production version (torchao=={fp8_bench.TORCHAO}, built for "
                      f"torch 2.11; tools/fp8-wheels.sh carries it to a machine without internet)")
    out = ctx.scratch / "fp8"
    proc = ctx.python("-m", "distlab.bench.fp8", "--out", out)
    data = _json(out / "fp8_bench.json", proc)
    misses = fp8_bench.goal_misses(data)
    if proc.returncode != 0 and not misses:
        proc.check()
    return Verdict(misses, {**data, "table": fp8_bench.table(data)})


def _needs(module: str, why: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise CheckError(f"{module} is not installed: {why} (pip install -e '.[dev]'; on a machine "
                         f"without internet, the wheels of ../shared/tools/device-prep.sh)")


def nbval_gpu(ctx: Context) -> Verdict:
    import xml.etree.ElementTree as ET

    _needs("nbval", "it replays the notebooks")
    _needs("ipykernel", "nbval runs the notebooks in a kernel")
    notebooks = sorted((ctx.root / "solutions").glob("*.ipynb"))
    if not notebooks:
        raise CheckError(f"no notebooks in {ctx.root / 'solutions'}")
    misses, rows = [], []
    for nb in notebooks:
        xml = ctx.scratch / f"nbval_{nb.stem}.xml"
        proc = ctx.python("-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--nbval",
                          "--nbval-current-env", f"--junitxml={xml}", nb,
                          log=ctx.scratch / f"nbval_{nb.stem}.txt")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if xml.exists():
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in counts}
        if proc.returncode != 0:
            misses.append(f"{nb.name}: {proc.describe()}: {proc.tail(2)}")
        rows.append([nb.name, counts["tests"] - counts["failures"] - counts["errors"]
                     - counts["skipped"], counts["failures"] + counts["errors"], counts["skipped"],
                     proc.seconds])
    return Verdict(misses, {"notebooks": rows, "table": _table(
        ["notebook", "cells passed", "failed", "skipped", "seconds"], rows)})


def _tier_counts(ctx: Context, tests_dir: Path, marker: str) -> dict[str, int]:
    """Exercise name -> its tests marked ``marker`` (collected, not run)."""
    from distlab.grading.plugin import exercise_of

    proc = ctx.python("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                      marker, tests_dir, limit=120)
    if proc.returncode not in (0, 5):  # 5: none collected
        proc.check()
    counts: dict[str, int] = {}
    for line in proc.output.splitlines():
        if "::" in line:
            name = exercise_of(line.split("::")[0])
            counts[name] = counts.get(name, 0) + 1
    return counts


def grader_tiers(ctx: Context) -> Verdict:
    from distlab.grading.runner import TESTS

    _needs("nbformat", "the grader reads the notebooks")
    notebooks = sorted((ctx.root / "solutions").glob("*.ipynb"))
    if not notebooks:
        raise CheckError(f"no notebooks in {ctx.root / 'solutions'}")
    multi, single = _tier_counts(ctx, TESTS, "multigpu"), _tier_counts(ctx, TESTS, "gpu")
    report = ctx.scratch / "grades.json"
    proc = ctx.python("-m", "distlab.grading", *notebooks, "--json", report)
    grades = _json(report, proc)
    proc.check()
    misses, rows = [], []
    for nb, exercises in grades.items():
        if "error" in exercises:
            misses.append(f"{Path(nb).name}: {exercises['error']}")
            continue
        for name, g in exercises.items():
            allowed = multi.get(name, 0) * (ctx.gpus < 2) + single.get(name, 0) * (ctx.gpus < 1)
            if g["points"] < g["max"] or g["verdict"] != "pass":
                misses.append(f"{Path(nb).name}, {name}: {g['points']}/{g['max']} ({g['verdict']}: "
                              f"{g['message']})")
            if g["blocked"] > allowed:
                misses.append(f"{Path(nb).name}, {name}: {g['blocked']} test(s) blocked with "
                              f"{ctx.gpus} GPU(s) present ({allowed} need more GPUs than that)")
            rows.append([Path(nb).name, name, f"{g['points']}/{g['max']}", g["verdict"],
                         g["blocked"], multi.get(name, 0) + single.get(name, 0)])
    return Verdict(misses, {"grades": grades, "table": _table(
        ["notebook", "exercise", "points", "verdict", "blocked", "gpu/multigpu tests"], rows)})


def _register_all() -> None:
    from distlab.bench import cp as cp_bench
    from distlab.bench import ep as ep_bench
    from distlab.bench import fp8 as fp8_bench
    from distlab.bench import pp as pp_bench
    from distlab.bench import tp as tp_bench
    from distlab.bench import train as train_bench
    from distlab.bench import zero as zero_bench

    g, f8 = zero_bench.GOALS, fp8_bench.GOALS
    zero_goal = (f"sharded AdamW kernel within {g['kernel / fused AdamW']}x the fused AdamW; "
                 f"model states, step buffers and peak within {g['memory error']:.0%} of "
                 f"distlab.zero.memory's accounting, nothing left behind")
    for check in (
        Check("ring", 2, 300, f"reference ring all-reduce busbw >= {RING_GOAL}x NCCL's all_reduce "
              f"at every size from 64 MiB to 1 GiB, 2 NCCL ranks, in CUDA graphs (--graph)", ring),
        Check("bench-vs-nccl-tests", 2, 540, f"python -m distlab.bench.collectives --api nccl "
              f"within {NCCL_TESTS_GOAL}x nccl-tests' time per op at every size (8 B - 1 GiB, six "
              f"ops, 2 GPUs; nccl-tests built from source against torch's NCCL)",
              bench_vs_nccl_tests),
        Check("zero", 2, 420, f"{zero_goal}; ZeRO-3 step time <= {g['ZeRO-3 / FSDP2']}x FSDP2's "
              f"(2 NCCL ranks, the 98M GPT)", zero_two),
        Check("zero-1gpu", 1, 240, f"{zero_goal} (one NCCL rank: the kernel and memory sections "
              f"of distlab.bench.zero, which need no second GPU)", zero_one),
        Check("tp", 2, 420, f"distlab TP step time <= {tp_bench.GOAL}x torch's DTensor TP on "
              f"every link (NVLink, host memory, sockets), every variant runs", tp),
        Check("pp", 2, 420, f"2 NCCL stages train like one process (tests/test_pp.py, multigpu); "
              f"distlab.bench.pp's step within {pp_bench.GOAL}x the step of "
              f"torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) on the same model, "
              f"micro-batches and stages, in the same run, for every schedule and m (1F1B with "
              f"m < p, which torch refuses, excepted); its idle fraction within "
              f"{BUBBLE_TOLERANCE * 100:.0f} points of (p-1)/(m+p-1) at m <= 2", pp),
        Check("overlap", 2, 560, f"bucketed DataParallel step time <= {OVERLAP_GOAL}x torch DDP's "
              f"on every link and batch shape of distlab.bench.overlap (7 rounds of 5 steps)",
              overlap),
        Check("train", 2, 600, f"distlab.train's composed step (ZeRO-2, TP, 1F1B) within "
              f"{train_bench.GOAL}x the step time of torch's composition of the 98M GPT (FSDP2 "
              f"fully_shard without resharding after forward, DTensor TP on a DeviceMesh, "
              f"torch.distributed.pipelining's Schedule1F1B) at (dp, tp, pp) = "
              f"{', '.join(f'({lay})' for lay in train_bench.LAYOUTS)}, bf16, 2 NCCL ranks, on "
              f"every link (NVLink, host memory, sockets); torch's side runs in each", train),
        Check("cp", 2, 420, f"distlab.cp's ring attention (zigzag, causal, bf16, forward and "
              f"backward) within {cp_bench.GOALS['ours / torch']}x the time of torch's "
              f"context_parallel on the same shapes, alternated; the zigzag ranks' times within "
              f"{cp_bench.GOALS['zigzag max/min']}x of each other; the ring and Llama 3's "
              f"all-gather (distlab.cp.allgather_attention) within one bf16 step (2^-8 of the "
              f"largest value) of fp64 attention on the same bf16 inputs; the all-gather with "
              f"GQA ({cp_bench.KV_HEADS} K/V heads for {cp_bench.HEADS} query heads), alternated "
              f"with the ring in the same run, within lab 10 section 1.6's model of the ring's "
              f"time, 1 + (W-1)/W * c_min/c (c tokens per rank): the model's ring hides its "
              f"K/V transfer from blocks of c_min = 2 * F/B * H_kv/H tokens on, and the "
              f"all-gather exposes its own, so at F = {cp_bench.PEAK_FLOPS / 1e12:.0f} TFLOPS "
              f"(H100/H200 bf16) and B = {cp_bench.LINK_BYTES_S / 1e9:.0f} GB/s (NVLink "
              f"all-gather, measured) it may cost up to "
              f"{cp_bench.allgather_bound(8192, 2):.2f}x the ring at 8,192 tokens and "
              f"{cp_bench.allgather_bound(32768, 2):.2f}x at 32,768 (with full multi-head "
              f"K/V the model says {cp_bench.allgather_bound(8192, 2, cp_bench.HEADS):.2f}x "
              f"and {cp_bench.allgather_bound(32768, 2, cp_bench.HEADS):.2f}x: reported, "
              f"not a goal); each one's bytes per rank reported (2 NCCL ranks)", cp),
        Check("ep", 2, 300, f"distlab.moe's expert-parallel dispatch+combine at least "
              f"{ep_bench.GOAL} of all_to_all_single's bus bandwidth at the same bytes (2 NCCL "
              f"ranks, bf16, d_model {ep_bench.D_MODEL})", ep),
        Check("fp8", 1, 900, f"torchao's float8 training (tensorwise) against BF16, compiled, "
              f"1 GPU: a linear layer's forward and backward >= {f8['linear speedup']}x at the "
              f"largest shape (the crossover shape printed); the {fp8_bench.BIG} GPT step >= "
              f"{f8['gpt speedup']}x BF16's tokens/s with final losses within "
              f"{f8['final loss gap']:.0%}; BF16 MFU of that GPT >= {f8['bf16 mfu']:.0%}", fp8),
        Check("sdc", 1, 240, "lab 12's silent-data-corruption check on one GPU "
              "(distlab.bench.sdc, the 98M GPT, deterministic kernels): a replay of a clean "
              "step gives the same SHA-256 of the gradients and one flipped bit is found; a "
              "checked step's time against a plain one's, and the hashing's, reported", sdc),
        Check("nbval-gpu", 1, 540, "every solution notebook replays its outputs (pytest --nbval) "
              "with the GPUs present", nbval_gpu),
        Check("grader-tiers", 1, 540, "python -m distlab.grading solutions/*.ipynb gives full "
              "marks, and no gpu/multigpu test is blocked unless it needs more GPUs than present",
              grader_tiers),
    ):
        register(check)


_register_all()
