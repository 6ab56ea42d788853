"""Overlap on GPUs, on the links of a cluster: step time of the naive one-shot
all-reduce (lab 04), bucketed DataParallel (lab 08) and torch's DDP, and the share of
communication hidden under computation, measured from a profiler trace.

    python -m distlab.bench.overlap --out overlap-h200                # all links
    python -m distlab.bench.overlap --out overlap-h200 --links socket # one of them

Every GPU of the machine is a rank (NCCL). Two GPUs joined by NVLink are never
communication-bound with this model, so the bench also slows the link down as a
cluster's network would, through NCCL's own settings (read when a communicator is made,
so each link runs on fresh ranks):

- ``nvlink``: the default (NVLink peer-to-peer where the GPUs have it);
- ``host``: ``NCCL_P2P_DISABLE=1``, through host shared memory (about 27 GB/s busbw on
  two H200s: a 200 Gb/s network card);
- ``socket``: ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo``, TCP over
  the loopback interface (about 2.9 GB/s: 25 Gb Ethernet).

For each link: the all-reduce bus bandwidth at 256 MiB, then the GPT of 98M parameters
(``gpt-100m``, vocabulary 16384, bf16 autocast, fused AdamW) at each batch shape, the
variants interleaved round after round (:func:`compare`), then one step
of each under ``torch.profiler``. NCCL kernels are communication, every other kernel
computation (:func:`distlab.bench.trace.kernel_timeline`); "hidden" is the share of the NCCL
kernels' time during which some compute kernel ran. Beside each step time, the host's
time to issue one step (:func:`distlab.bench.timing.host_seconds`): where the two are close the
step is bound by the host, and Python hooks cost step time. Writes ``overlap_bench.json``, rank
0's Chrome traces (``trace_<link>_<tokens>_<variant>.json.gz``, open them in
https://ui.perfetto.dev) and a picture of one step per link drawn from those traces
(``timeline_<link>.png``). NCCL_NVLS_ENABLE=0 is set (NVLink multicast stays off on
shared machines).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from distlab.dp import DataParallel, OneShotDataParallel

LINKS = {
    "nvlink": {},
    "host": {"NCCL_P2P_DISABLE": "1"},
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"},
}
DEFAULT_SHAPES = {"nvlink": ["16x1024", "4x1024"], "host": ["16x1024", "4x1024"],
                  "socket": ["4x1024"]}
VARIANTS = ("naive", "per-parameter", "bucketed", "torch DDP")
BENCHED = ("naive", "bucketed", "torch DDP")  # what the bench runs unless told


@contextlib.contextmanager
def environ(**values):
    """Set environment variables for the block (ranks started inside inherit them),
    then restore the previous values."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_shape(text: str) -> tuple[int, int]:
    """"16x1024" → (16, 1024): sequences per rank and tokens per sequence."""
    try:
        batch, seq = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a batch shape is SEQUENCESxTOKENS, e.g. 16x1024; got {text!r}") from None
    return batch, seq


def link_busbw(nbytes: int = 256 << 20) -> float:
    """All-reduce bus bandwidth (bytes/s) of this launch's link at ``nbytes``."""
    import torch
    import torch.distributed as dist

    from distlab import backend
    from distlab.bench.timing import time_op
    from distlab.comm import bus_factor

    buf = torch.ones(nbytes // 4, device=backend.device())
    seconds = time_op(lambda: dist.all_reduce(buf), warmup=1, iters=3)
    return nbytes / seconds * bus_factor("all_reduce", dist.get_world_size())


def wrap(module, variant: str, bucket_cap_mb: float | None = 25, group=None,
         channel: str = "auto", *, bucketed=DataParallel):
    """``(model, finish)``: ``module`` wrapped for ``variant`` (one of :data:`VARIANTS`),
    and what to call between backward and the optimizer step.

    naive: lab 04's one-shot all-reduce after backward; per-parameter: one asynchronous
    all-reduce per parameter from backward hooks, ``bucketed(module, None, group=group)``;
    bucketed: ``bucketed(module, bucket_cap_mb, group=group)``, lab 08's
    :class:`~distlab.dp.DataParallel` by default (lab 08's cells pass the student's
    ``BucketedDDP``); torch DDP: ``DistributedDataParallel`` with ``bucket_cap_mb`` (25 by
    default, as torch's), which synchronises inside backward. A ``channel`` other than
    "auto" (how the all-reduces are issued, :func:`distlab.dp.channels.channel`) is
    passed on to ``bucketed``."""
    from torch import nn

    options = {} if channel == "auto" else {"channel": channel}
    if variant == "naive":
        model = OneShotDataParallel(module, group=group)
    elif variant == "per-parameter":
        model = bucketed(module, None, group=group, **options)
    elif variant == "bucketed":
        model = bucketed(module, bucket_cap_mb, group=group, **options)
    elif variant == "torch DDP":
        device = next(module.parameters()).device
        model = nn.parallel.DistributedDataParallel(
            module, device_ids=[device] if device.type == "cuda" else None,
            process_group=group, bucket_cap_mb=bucket_cap_mb)
        return model, lambda: None
    else:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return model, model.finish_gradient_synchronization


def compare(steps: dict, rounds: int = 3, iters: int = 3, warmup: int = 2,
            group=None) -> dict[str, float]:
    """Median seconds per call of each of ``steps`` (name → a function running one
    training step), interleaved: every round times ``iters`` calls of each in turn, so
    that a machine whose speed drifts slows them alike. Call on every rank of ``group``;
    each call's time is the slowest rank's (:func:`distlab.bench.timing.time_op`)."""
    import statistics

    from distlab.bench.timing import time_op

    for fn in steps.values():
        for _ in range(warmup):
            fn()
    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            per_round[name].append(time_op(fn, warmup=0, iters=iters, group=group))
    return {name: statistics.median(t) for name, t in per_round.items()}


def bench_rank(shapes, variants, workdir: str, model: str = "gpt-100m",
               vocab_size: int = 16384, rounds: int = 3, iters: int = 3, warmup: int = 2,
               bucket_cap_mb: float = 25, busbw_bytes: int = 256 << 20,
               channel: str = "auto", all_traces: bool = False) -> dict:
    """In each rank: the link's busbw, then for each batch shape the step time of each
    variant, the host's time to issue one step (:func:`distlab.bench.timing.host_seconds`) and
    the hidden fraction from one profiled step. Rank 0 keeps its traces in ``workdir``
    (every rank with ``all_traces``). ``channel``: that of the bucketed and per-parameter variants
    (:func:`distlab.dp.channels.channel`). Returns plain data."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from distlab import backend
    from distlab.bench import trace
    from distlab.bench.timing import host_seconds
    from distlab.model import GPT, config

    rank, device = dist.get_rank(), backend.device()
    cfg = config(model, vocab_size=vocab_size)
    out = {"busbw": link_busbw(busbw_bytes), "shapes": {}}
    for shape in shapes:
        batch, seq = parse_shape(shape)
        gen = torch.Generator(device=device).manual_seed(rank)
        x = torch.randint(vocab_size, (batch, seq + 1), device=device, generator=gen)
        steps = {}
        for variant in variants:
            torch.manual_seed(0)
            net = GPT(cfg).to(device)
            wrapped, finish = wrap(net, variant, bucket_cap_mb, channel=channel)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device.type == "cuda")

            def step(wrapped=wrapped, finish=finish, opt=opt):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    logits = wrapped(x[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
                loss.backward()
                finish()
                opt.step()
                opt.zero_grad(set_to_none=True)
            steps[variant] = step
        seconds = compare(steps, rounds=rounds, iters=iters, warmup=warmup)
        host = {variant: host_seconds(step) for variant, step in steps.items()}
        hidden, comm = {}, {}
        for variant, step in steps.items():
            path = Path(workdir) / f"trace_{shape}_{variant.replace(' ', '_')}_rank{rank}.json.gz"
            dist.barrier()
            trace.profile(step, steps=1, warmup=1, path=path)
            kernels = trace.kernel_timeline(path, rank)
            hidden[variant], comm[variant] = kernels.hidden_fraction(), kernels.comm_seconds()
            if rank != 0 and not all_traces:
                path.unlink()
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        out["shapes"][shape] = {"seconds": seconds, "host_seconds": host, "hidden": hidden,
                                "comm_seconds": comm, "peak_gib": peak}
        del steps
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return out


def run_link(link: str, shapes, variants, world_size: int, workdir: Path, **kw) -> list[dict]:
    """One link on fresh ranks: its NCCL settings set for the launch, then restored."""
    from distlab import launch

    with environ(NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"), **LINKS[link]):
        return launch.run(bench_rank, world_size, list(shapes), list(variants), str(workdir),
                          backend="nccl", isolated=True, timeout=600, **kw)


def table(results: dict) -> str:
    """The step times, their ratios to torch's DDP, the hidden fractions (mean over
    ranks) and the host's time to issue a step (the slowest rank's)."""
    lines = [f"{'link':7} {'busbw':>9} {'tokens':>8} {'naive':>9} {'bucketed':>9} {'DDP':>9} "
             f"{'bkt/DDP':>8} {'naive/DDP':>9}  hidden: naive / bucketed / DDP  "
             f"host: naive / bucketed / DDP"]
    for link, per_rank in results.items():
        r0 = per_rank[0]
        for shape, r in r0["shapes"].items():
            s = r["seconds"]
            hidden = [sum(pr["shapes"][shape]["hidden"].get(v, float("nan")) for pr in per_rank)
                      / len(per_rank) for v in BENCHED]
            ms = lambda v: f"{1e3 * s[v]:7.1f}ms" if v in s else f"{'-':>9}"  # noqa: E731
            ratio = lambda v: f"{s[v] / s['torch DDP']:.3f}" if v in s and "torch DDP" in s \
                else "-"  # noqa: E731
            host = [r.get("host_seconds", {}).get(v, float("nan")) for v in BENCHED]
            lines.append(f"{link:7} {r0['busbw'] / 1e9:6.1f}GB/s {shape:>8} {ms('naive')} "
                         f"{ms('bucketed')} {ms('torch DDP')} {ratio('bucketed'):>8} "
                         f"{ratio('naive'):>9}  " + " / ".join(f"{h:.0%}" for h in hidden)
                         + "  " + " / ".join(f"{1e3 * h:.1f}ms" for h in host))
    return "\n".join(lines)


def draw(link: str, shape: str, traces: dict, path: Path) -> None:
    """One profiled step of each variant (rank 0's kernels), one under the other."""
    from distlab.bench import trace
    from distlab.viz.timeline import timelines_figure

    timelines = {f"{variant}, {link}, {shape} tokens per GPU": trace.kernel_timeline(p)
                 for variant, p in traces.items()}
    timelines_figure(timelines).savefig(path, dpi=110, bbox_inches="tight")


def main(argv=None) -> int:
    import torch

    from distlab import backend
    from distlab.dp.channels import CHANNELS

    p = argparse.ArgumentParser(prog="python -m distlab.bench.overlap",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for JSON, PNG, traces")
    p.add_argument("--links", default="nvlink,host,socket",
                   help=f"comma-separated, of {', '.join(LINKS)}")
    p.add_argument("--shapes", default=None,
                   help="batch shapes per GPU for every link, e.g. 16x1024,4x1024 (default: "
                        "both on nvlink and host, 4x1024 over sockets, which are slow)")
    p.add_argument("--variants", default=",".join(BENCHED),
                   help="comma-separated, of naive, per-parameter, bucketed, torch DDP")
    p.add_argument("--channel", default="auto", choices=CHANNELS,
                   help="how the bucketed variant issues its all-reduces (default: auto, "
                        "torch's work handles; stream: a CUDA stream of our own)")
    p.add_argument("--all-traces", action="store_true",
                   help="keep every rank's traces (trace_..._rankN.json.gz), not only rank 0's")
    p.add_argument("--world-size", type=int, default=None, help="default: every GPU")
    p.add_argument("--model", default="gpt-100m", help="a preset of distlab.model")
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=3, help="timed steps per variant per round")
    args = p.parse_args(argv)
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    unknown = [x for x in links if x not in LINKS]
    if unknown:
        p.error(f"unknown link(s) {unknown}; choose from {list(LINKS)}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    world = args.world_size or backend.gpu_count()
    if world < 2:
        p.error(f"needs 2 or more GPUs (one NCCL rank each); this machine has "
                f"{backend.gpu_count()}")
    args.out.mkdir(parents=True, exist_ok=True)
    results, start = {}, time.perf_counter()
    for link in links:
        shapes = args.shapes.split(",") if args.shapes else DEFAULT_SHAPES[link]
        for shape in shapes:
            parse_shape(shape)
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"overlap-{link}-") as tmp:
            results[link] = run_link(link, shapes, variants, world, Path(tmp), model=args.model,
                                     vocab_size=args.vocab_size, rounds=args.rounds,
                                     iters=args.iters, channel=args.channel,
                                     all_traces=args.all_traces)
            kept = {}
            for f in Path(tmp).glob("trace_*_rank*.json.gz"):
                dst = args.out / f.name.replace("trace_", f"trace_{link}_").replace("_rank0", "")
                shutil.copy(f, dst)
                kept[f.name] = dst
            first = shapes[0]
            traces = {v: kept[f"trace_{first}_{v.replace(' ', '_')}_rank0.json.gz"]
                      for v in variants if f"trace_{first}_{v.replace(' ', '_')}_rank0.json.gz" in kept}
            draw(link, first, traces, args.out / f"timeline_{link}.png")
        print(f"{link}: {time.perf_counter() - t:.0f} s", flush=True)
    print(table(results))
    info = {"torch": torch.__version__, "gpus": world,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available()
            else None, "links": {k: LINKS[k] for k in links},
            "seconds": time.perf_counter() - start}
    (args.out / "overlap_bench.json").write_text(json.dumps(
        {"info": info, "results": results}, indent=1))
    print(f"wrote {args.out}/overlap_bench.json, timeline_<link>.png and the traces "
          f"({time.perf_counter() - start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
