"""The composed train step (:mod:`distlab.train`) against torch's own composition of the
same model, layout by layout: tokens/s, MFU and the step-time ratio.

    NCCL_NVLS_ENABLE=0 python -m distlab.bench.train --layouts 2,1,1 1,2,1 1,1,2 --out DIR

A layout is ``dp,tp,pp``. Layouts of one world size share one launch (NCCL when every
rank can have a GPU, else gloo); with NCCL each ``--links`` setting
(:data:`distlab.bench.overlap.LINKS`: NVLink, host memory, sockets) starts fresh ranks
with its environment, as ``distlab.bench.tp`` does; on gloo the links mean nothing and
one run is labelled "gloo". In each layout both steps train the same GPT from the same
seed on the same global batch and precision (``--precision auto``: bf16 autocast with
fp32 master weights on GPUs, fp32 on CPUs), AdamW with the same hyper-parameters:

* **ours**: :func:`distlab.train.build` on a :class:`distlab.mesh.Mesh` (ZeRO-2 buckets
  reduce-scattered from backward hooks, Megatron TP, 1F1B over ``pp`` micro-batches);
* **torch's**, by the layout's one parallel dimension: for DP, FSDP2's ``fully_shard`` on
  every block and the root with ``reshard_after_forward=False`` (parameters stay
  gathered between forward and backward: ZeRO-2's traffic, Rajbhandari et al. 2020) and
  bf16 parameters and reduction under a ``MixedPrecisionPolicy``; for TP, DTensor
  ``ColwiseParallel``/``RowwiseParallel`` on a ``DeviceMesh``
  (:func:`distlab.tp.parallelize_with_torch`); for PP, ``torch.distributed.pipelining``'s
  ``Schedule1F1B`` (:func:`distlab.bench.pp.torch_pipeline`). A layout with more than one
  parallel dimension gets a row naming that torch's side is not built for it.

After ``--warmup`` steps of each, ``--steps`` rounds time one step of ours and one of
torch's (:func:`distlab.bench.timing.time_each`: after a barrier, to an idle device, the
slowest rank's), so that a drifting machine slows both alike; the ratio is the median
of the rounds' ours / torch's. tokens/s is the global batch's tokens over the median
step; MFU is the model FLOPs per token (``6N + 12LdT``, PaLM's appendix B:
:meth:`distlab.model.GPT.flops_per_token`) times tokens/s over the peak of every GPU
(:func:`distlab.backend.peak_flops`; none on CPUs). Where torch's side cannot
run (an API torch lacks on this backend), its row says why; on gloo CPUs with torch
2.13 all three run. Prints a table, writes ``train_bench.json`` to ``--out``; on NCCL
it exits 1 when a row misses: our step above :data:`GOAL` times torch's, torch's side
not run, or a launch failed (:func:`goal_misses`).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

GOAL = 1.25  # our composed step's time over torch's composition's, at most (NCCL)
LAYOUTS = ("2,1,1", "1,2,1", "1,1,2")
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def parse_layout(text: str) -> tuple[int, int, int]:
    """``"dp,tp,pp"`` -> ``(dp, tp, pp)``."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a layout is dp,tp,pp (three positive integers), got {text!r}")
    return tuple(int(p) for p in parts)


def _autocast(device, precision: str):
    from distlab.train import PRECISIONS

    dtype = PRECISIONS[precision][1]
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def torch_step(cfg, layout, x, y, precision: str, microbatches: int, device):
    """torch's composition of ``GPT(cfg)`` at ``layout = (dp, tp, pp)`` (one dimension
    above 1 at most, over the whole world): a training step ``() -> None`` on the global
    batch ``(x, y)`` (each DP rank takes its ``tensor_split`` rows), AdamW
    (:data:`ADAMW`, foreach) included. NotImplementedError for a layout of several
    parallel dimensions."""
    from distlab import pp
    from distlab.model import GPT

    dp, tp, stages = layout
    if sum(n > 1 for n in layout) > 1:
        raise NotImplementedError("torch's side is built for one parallel dimension at a time "
                                  "(FSDP2, DTensor TP or pipelining alone)")
    rank, world = dist.get_rank(), dist.get_world_size()
    autocast = _autocast(device, precision)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    params = model.parameters()
    if stages > 1:
        from distlab.bench.pp import torch_pipeline

        stage = pp.Stage(model, rank, world)
        pipeline = torch_pipeline(stage, "1f1b", microbatches, device)
        params = stage.parameters()

        def forward_backward():
            with autocast:
                pipeline(x, y)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        if dp > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
            from distlab.train import PRECISIONS

            low = PRECISIONS[precision][1]      # None: full precision, nothing cast
            policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
            for module in [*model.blocks, model]:
                fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
            x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        elif tp > 1:
            from distlab.tp import dtensor_param_groups, parallelize_with_torch

            parallelize_with_torch(model, init_device_mesh(device.type, (world,),
                                                           mesh_dim_names=("tp",)))
            params = dtensor_param_groups(model)

        def forward_backward():
            with autocast:
                logits = model(x)
            F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
    opt = torch.optim.AdamW(params, foreach=True, **ADAMW)

    def step():
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def measure(cfg, layouts, batch_size: int, seq_len: int, precision: str,
            microbatches: int | None, steps: int, warmup: int) -> list[dict]:
    """On every rank, for each layout (all of this world's size): build ours and torch's,
    warm each up, then ``steps`` alternated rounds. Returns one row per layout (the same
    on every rank: :func:`~distlab.bench.timing.time_each` agrees on the slowest)."""
    from distlab import backend, launch
    from distlab.bench.timing import time_each
    from distlab.mesh import Mesh
    from distlab.train import build

    device = backend.device()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(cfg.vocab_size, (batch_size, seq_len + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    rows = []
    for layout in launch.progress(layouts, desc=f"{dist.get_world_size()} ranks"):
        dp, tp, stages = layout
        m = stages if microbatches is None else microbatches
        mesh = Mesh(dp=dp, pp=stages, tp=tp)
        trainer = build(cfg, mesh, precision=precision, microbatches=m, seed=0,
                        lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
                        weight_decay=ADAMW["weight_decay"], device=device)
        d = mesh.coords[0]
        ours = functools.partial(trainer.step, (x.tensor_split(dp)[d], y.tensor_split(dp)[d]),
                                 global_batch_size=batch_size)
        for _ in range(warmup):
            ours()
        theirs, error = None, None
        try:
            theirs = torch_step(cfg, layout, x, y, precision, m, device)
            for _ in range(warmup):
                theirs()
        except Exception as exc:  # noqa: BLE001  (reported in the row; ours is still timed)
            theirs, error = None, f"{type(exc).__name__}: {(str(exc) or '-').splitlines()[0]}"
        rounds = [(time_each(ours, 1), time_each(theirs, 1) if theirs else None)
                  for _ in range(steps)]
        rows.append({"layout": ",".join(map(str, layout)), "microbatches": m,
                     "rounds_s": rounds, "torch_error": error})
        del trainer, ours, theirs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def summarise(rows: list[dict], link: str, cfg, batch_size: int, seq_len: int,
              precision: str, device_name: str, world: int) -> list[dict]:
    """Each launch's row with its figures: median step times, tokens/s, MFU, ratio."""
    from distlab.backend import peak_flops
    from distlab.model import GPT

    with torch.device("meta"):
        flops_per_token = GPT(cfg).flops_per_token(seq_len)
    peak = peak_flops(device_name, precision)
    tokens = batch_size * seq_len
    out = []
    for r in rows:
        ours = statistics.median(o for o, _ in r["rounds_s"])
        theirs = None if r["torch_error"] else statistics.median(t for _, t in r["rounds_s"])
        speed = {"tokens_per_s": tokens / ours,
                 "torch_tokens_per_s": None if theirs is None else tokens / theirs}
        out.append({"link": link, **r, "step_ms": 1e3 * ours,
                    "torch_step_ms": None if theirs is None else 1e3 * theirs, **speed,
                    "vs_torch": None if theirs is None else statistics.median(
                        o / t for o, t in r["rounds_s"]),
                    **{k.replace("tokens_per_s", "mfu"): None if peak is None or v is None else
                       flops_per_token * v / (peak * world) for k, v in speed.items()}})
    return out


def goal_misses(rows: list[dict]) -> list[str]:
    """Each row where our step took more than :data:`GOAL` times torch's, where torch's
    composition did not run, or whose launch failed."""
    def miss(r):
        if r.get("error"):
            return r["error"]
        if r["torch_error"]:
            return f"torch's composition did not run ({r['torch_error']})"
        if r["vs_torch"] > GOAL:
            return (f"our step {r['step_ms']:.1f} ms is {r['vs_torch']:.2f}x torch's "
                    f"{r['torch_step_ms']:.1f} ms, above {GOAL}x")
        return None
    return [f"{r['link']}, (dp, tp, pp) = ({r['layout']}): {miss(r)}" for r in rows if miss(r)]


def table(rows: list[dict]) -> str:
    def pct(v):
        return f"{'n/a':>6}" if v is None else f"{v:6.1%}"

    lines = [f"{'link':<7} {'dp,tp,pp':>8} {'ms':>8} {'tokens/s':>10} {'MFU':>6} "
             f"{'torch ms':>8} {'tokens/s':>10} {'MFU':>6} {'/torch':>6}"]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['link']:<7} {r['layout']:>8} {r['error']}")
            continue
        theirs = (f"torch failed: {r['torch_error']}" if r["torch_error"] else
                  f"{r['torch_step_ms']:8.1f} {r['torch_tokens_per_s']:10,.0f} "
                  f"{pct(r['torch_mfu'])} {r['vs_torch']:6.2f}")
        lines.append(f"{r['link']:<7} {r['layout']:>8} {r['step_ms']:8.1f} "
                     f"{r['tokens_per_s']:10,.0f} {pct(r['mfu'])} {theirs}")
    return "\n".join(lines)


def run(layouts, links, cfg, batch_size: int, seq_len: int, precision: str,
        microbatches, steps: int, warmup: int, backend: str, timeout: float) -> list[dict]:
    """Every row: per link setting (one "gloo" run off NCCL), one launch per world size;
    a launch that fails gives its layouts a row with the error."""
    from distlab import backend as backends
    from distlab import launch
    from distlab.bench.overlap import LINKS, environ

    rows = []
    sizes = sorted({dp * tp * p for dp, tp, p in layouts})
    for world in sizes:
        mine = [lay for lay in layouts if lay[0] * lay[1] * lay[2] == world]
        nccl = backends.choose(world, backend) == "nccl"
        device_name = backends.info().gpu_names[0] if nccl else "CPU"
        for link in links if nccl else ["gloo"]:
            start = time.perf_counter()
            try:
                with environ(**LINKS.get(link, {}), NCCL_NVLS_ENABLE="0"):
                    got = launch.run(measure, world, cfg, mine, batch_size, seq_len, precision,
                                     microbatches, steps, warmup, backend=backend,
                                     timeout=timeout, isolated=nccl)[0]
                rows += summarise(got, link, cfg, batch_size, seq_len, precision, device_name,
                                  world)
            except launch.LaunchError as exc:  # keep the other links' and sizes' figures
                rows += [{"link": link, "layout": ",".join(map(str, lay)),
                          "error": f"the launch failed: {str(exc).splitlines()[0]}"}
                         for lay in mine]
            print(f"# {link}, {world} ranks: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def main(argv=None) -> int:
    from distlab import backend as backends
    from distlab.bench.overlap import LINKS
    from distlab.model import PRESETS, config
    from distlab.train import PRECISIONS

    p = argparse.ArgumentParser(prog="python -m distlab.bench.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for train_bench.json")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), help="each dp,tp,pp")
    p.add_argument("--links", default=",".join(LINKS), help=f"comma-separated, of {list(LINKS)}")
    p.add_argument("--model", default="gpt-100m", choices=sorted(PRESETS))
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per global batch")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    p.add_argument("--precision", default="auto", choices=["auto", *sorted(PRECISIONS)],
                   help="auto: bf16 on NCCL, fp32 on gloo")
    p.add_argument("--microbatches", type=int, default=None, help="default: pp")
    p.add_argument("--steps", type=int, default=8, help="alternated rounds per layout")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=backends.BACKENDS)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    try:
        layouts = [parse_layout(t) for t in args.layouts]
    except ValueError as exc:
        p.error(str(exc))
    links = [s.strip() for s in args.links.split(",") if s.strip()]
    if set(links) - set(LINKS):
        p.error(f"unknown link(s) {sorted(set(links) - set(LINKS))}; choose from {list(LINKS)}")
    cfg = config(args.model, args.vocab_size)
    seq_len = args.seq_len or cfg.seq_len
    worlds = {lay[0] * lay[1] * lay[2] for lay in layouts}
    nccl = all(backends.choose(w, args.backend) == "nccl" for w in worlds)
    precision = ("bf16" if nccl else "fp32") if args.precision == "auto" else args.precision
    for dp, _, stages in layouts:
        m = args.microbatches or stages
        if args.batch_size % (dp * m):
            p.error(f"--batch-size {args.batch_size} must split into dp = {dp} shards of m = {m} "
                    f"micro-batches: use a multiple of {dp * m}")
    args.out.mkdir(parents=True, exist_ok=True)
    for w in sorted(worlds):
        print(f"# {backends.explain(w, args.backend)}")
    title = (f"{args.model}, global batch {args.batch_size}x{seq_len}, {precision}, torch "
             f"{torch.__version__}")
    rows = run(layouts, links, cfg, args.batch_size, seq_len, precision, args.microbatches,
               args.steps, args.warmup, args.backend, args.timeout)
    print(title)
    print(table(rows))
    path = args.out / "train_bench.json"
    path.write_text(json.dumps({"title": title, "goal": GOAL, "backend": "nccl" if nccl else
                                "gloo", "rows": rows}, indent=1))
    print(f"wrote {path}")
    misses = goal_misses(rows)
    for miss in misses:
        print(f"goal missed: {miss}")
    # CPU timings on shared cores say little about either step: only NCCL runs count
    return 1 if misses and nccl else 0


if __name__ == "__main__":
    raise SystemExit(main())
