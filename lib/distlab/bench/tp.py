"""Tensor parallelism on GPUs: our TP against torch's, and TP against DP on the links
of a cluster.

    python -m distlab.bench.tp --out DIR                    # 2 GPUs: every link, ~1-2 minutes
    python -m distlab.bench.tp --out DIR --links nvlink     # the default link only

Each link setting starts fresh NCCL ranks with its environment (NCCL reads it when a
communicator is created), the settings of :data:`distlab.bench.overlap.LINKS`: ``nvlink``
is NCCL's default (NVLink P2P between GPUs of one node), ``host`` disables P2P so traffic
goes through host shared memory (27 GB/s busbw on two H200s, about a 200 Gb/s NIC),
``socket`` also disables shared memory and uses TCP on the loopback interface (2.9 GB/s,
about 25 GbE); figures from docs/design.md. ``NCCL_NVLS_ENABLE=0`` throughout.

On each, the same global batch of the GPT in bf16 autocast (fp32 weights, AdamW with
its foreach step) runs as:

* ``distlab TP``: :func:`distlab.tp.tensor_parallel`, every rank on the whole batch (its
  collectives move bf16 forward and backward, as Megatron's do);
* ``torch TP``: :func:`distlab.tp.parallelize_with_torch` (DTensor ColwiseParallel /
  RowwiseParallel), the same split; its DTensor and plain parameters in separate
  optimizer groups (:func:`distlab.tp.dtensor_param_groups`), so that it keeps the
  foreach step too;
* ``torch DDP`` and ``distlab DP``: data parallel, each rank on ``batch/N`` sequences.

Steps are timed in interleaved rounds (a drifting machine slows every variant alike);
the figure is the median over rounds. A torch.profiler trace of a few steps gives the
share of the step during which an NCCL kernel ran (:func:`distlab.bench.trace.kernel_timeline`:
the union of the NCCL kernels' spans, over the time from the first kernel to the last). Prints a table; writes
``tp_bench.json``, ``tp_bench.png`` and rank 0's traces (``trace_<link>_<variant>.json.gz``,
for https://ui.perfetto.dev) to ``--out``. It exits 1 when a variant failed or, on NCCL,
distlab TP took more than :data:`GOAL` times torch TP's step on a link (:func:`goal_misses`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.bench.timing import per_call
from distlab.bench.overlap import LINKS, environ

VARIANTS = ("distlab TP", "torch TP", "torch DDP", "distlab DP")


def _build(variant: str, cfg, device, tp_options: dict):
    """(model to call, parameters or parameter groups to optimise, whether each rank
    takes its slice of the batch, after-backward). ``tp_options``: keyword arguments of
    :func:`distlab.tp.tensor_parallel` (lab 06 passes its own layers)."""
    from torch.nn.parallel import DistributedDataParallel

    from distlab import tp
    from distlab.dp import DataParallel
    from distlab.model import GPT

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {list(VARIANTS)}")
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if variant == "distlab TP":
        return tp.tensor_parallel(model, **tp_options), model.parameters(), False, None
    if variant == "torch TP":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        tp.parallelize_with_torch(model, mesh)
        return model, tp.dtensor_param_groups(model), False, None
    if variant == "torch DDP":
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids), model.parameters(), True, None
    wrapped = DataParallel(model)
    return wrapped, model.parameters(), True, wrapped.finish_gradient_synchronization


def measure(cfg, batch: int, seq: int, variants, steps: int = 5, rounds: int = 3,
            warmup: int = 3, profile_steps: int = 3, dtype: str = "bf16", workdir=None,
            label: str = "", tp_options: dict | None = None) -> dict:
    """Run in every rank: time each variant; rank 0's figures come back (plain data).
    Rank 0 keeps its profiler traces in ``workdir`` (when given).

    Every variant steps AdamW with ``foreach=True`` (PyTorch's default for CUDA
    tensors, made explicit so that CPU runs take the same path). A variant that raises
    (alike on every rank) comes back as ``{"error": message}`` and the others go on."""
    from distlab import backend
    from distlab.comm import CommLog
    from distlab.bench.throughput import DTYPES

    device, world = backend.device(), dist.get_world_size()
    if batch % world:
        raise ValueError(f"the global batch of {batch} sequences must split evenly over the "
                         f"{world} data-parallel ranks; pick a multiple of {world}")
    autocast = contextlib.nullcontext() if dtype == "fp32" else torch.autocast(
        device.type, dtype=DTYPES[dtype])
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
    failed = {}

    def attempt(name, fn, *args):
        """``fn(*args)``, or None once ``name`` has failed (its error kept)."""
        if name in failed:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported in the table; the others go on
            failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if dist.get_rank() == 0:
                traceback.print_exc()  # the launcher shows it, marked [rank 0]
            return None

    def prepare(name):
        model, params, data_parallel, after = _build(name, cfg, device, tp_options or {})
        x = tokens.tensor_split(world)[dist.get_rank()] if data_parallel else tokens
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

        def step():
            with autocast:
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward()
            if after is not None:
                after()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        return step

    runs = {name: attempt(name, prepare, name) for name in variants}
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, step in runs.items():
            times[name].append(attempt(name, per_call, step, steps, device))
    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, step in runs.items():
            keep = workdir is not None and dist.get_rank() == 0
            path = Path(workdir if keep else scratch) / \
                f"trace_{label}_{name.replace(' ', '_')}.json.gz"
            with CommLog() as log:
                attempt(name, step)
            share = attempt(name, _nccl_share, step, device, profile_steps, path)
            out[name] = {"error": failed[name]} if name in failed else {
                "step_s": statistics.median(times[name]), "rounds_s": times[name],
                "comm_bytes": log.bus_bytes(), "collectives": log.count(), "nccl_share": share}
    return out




def _nccl_share(step, device, steps: int, path: Path) -> float | None:
    """Share of ``steps`` profiled steps during which an NCCL kernel ran on this rank's
    GPU, from the first kernel to the last (None on CPUs)."""
    if device.type != "cuda":
        return None
    from distlab.bench import trace

    trace.profile(step, steps=steps, warmup=0, path=path)
    kernels = trace.kernel_timeline(path)
    return kernels.comm_seconds() / kernels.duration


def run(links, cfg, batch, seq, world_size, backend, variants, steps, rounds, timeout=120,
        workdir=None, tp_options=None):
    """{link: {variant: figures}}: one launch on fresh ranks per link setting (``links``:
    names of :data:`LINKS`; on gloo they mean nothing and one run is labelled "gloo").
    ``tp_options``: keyword arguments of :func:`distlab.tp.tensor_parallel` for
    "distlab TP" (``column=`` and ``row=``: the layers to build it from)."""
    from distlab import backend as backends
    from distlab import launch

    if backends.choose(world_size, backend) != "nccl":
        links = ["gloo"]
    results = {}
    for link in links:
        env = dict(LINKS.get(link, {}), NCCL_NVLS_ENABLE="0")
        start = time.perf_counter()
        try:
            with environ(**env):
                results[link] = launch.run(
                    measure, world_size, cfg, batch, seq, variants, steps, rounds,
                    workdir=None if workdir is None else str(workdir), label=link,
                    tp_options=tp_options, backend=backend, timeout=timeout, isolated=True)[0]
        except launch.LaunchError as exc:  # keep the other links' figures
            results[link] = {"error": str(exc).splitlines()[0]}
        print(f"# {link}: {time.perf_counter() - start:.0f} s", flush=True)
    return results


def failures(results: dict) -> list[str]:
    """What failed: "link: error" for a link whose launch failed, "link, variant: error"
    for a variant that failed on a link that ran."""
    found = []
    for link, rows in results.items():
        if "error" in rows:
            found.append(f"{link}: {rows['error']}")
        else:
            found += [f"{link}, {name}: {r['error']}" for name, r in rows.items() if "error" in r]
    return found


GOAL = 1.15  # distlab TP's step time over torch TP's, at most, on every link (NCCL only)


def goal_misses(results: dict, backend: str) -> list[str]:
    """What :func:`failures` finds, and on NCCL each link where distlab TP's step took
    more than :data:`GOAL` times torch TP's (on gloo the times are a smoke test's)."""
    found = failures(results)
    for link, rows in results.items() if backend == "nccl" else ():
        ours, theirs = (rows.get(v, {}).get("step_s") for v in ("distlab TP", "torch TP"))
        if ours and theirs and ours / theirs > GOAL:
            found.append(f"{link}: distlab TP / torch TP {ours / theirs:.3f} > {GOAL}")
    return found


def table(results: dict) -> str:
    from distlab.units import human_bytes

    lines = [f"{'link':<9}{'variant':<12}{'ms/step':>9}{'vs torch TP':>12}{'NCCL share':>12}"
             f"{'bus bytes':>13}{'calls':>7}"]
    for link, rows in results.items():
        if "error" in rows:
            lines.append(f"{link:<9}failed: {rows['error']}")
            continue
        ref = rows.get("torch TP", {}).get("step_s")
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"{link:<9}{name:<12}failed: {r['error']}")
                continue
            ratio = f"{r['step_s'] / ref:.2f}x" if ref else "-"
            share = "-" if r["nccl_share"] is None else f"{100 * r['nccl_share']:.0f}%"
            traced = r["collectives"] > 0  # torch's collectives run in C++, unseen by CommLog
            lines.append(f"{link:<9}{name:<12}{1e3 * r['step_s']:9.1f}{ratio:>12}{share:>12}"
                         + (f"{human_bytes(r['comm_bytes']):>13}{r['collectives']:7d}" if traced else
                            f"{'(C++)':>13}{'-':>7}"))
    return "\n".join(lines)


def main(argv=None) -> int:
    from distlab import backend as backends
    from distlab.model import PRESETS, config
    from distlab.bench.throughput import DTYPES

    p = argparse.ArgumentParser(prog="python -m distlab.bench.tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON and PNG")
    p.add_argument("--links", default=",".join(LINKS), help=f"comma-separated, of {list(LINKS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    p.add_argument("--model", default="gpt-100m", choices=sorted(PRESETS))
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--n-head", type=int, default=None,
                   help="override the preset's head count (TP needs a multiple of the ranks)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch, sequences")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--world-size", type=int, default=None, help="default: GPUs present (>= 1)")
    p.add_argument("--backend", default="auto", choices=backends.BACKENDS)
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    links = [s.strip() for s in args.links.split(",") if s.strip()]
    variants = [s.strip() for s in args.variants.split(",") if s.strip()]
    for bad, known, what in ((set(links) - set(LINKS), LINKS, "link"),
                             (set(variants) - set(VARIANTS), VARIANTS, "variant")):
        if bad:
            p.error(f"unknown {what}(s) {sorted(bad)}; choose from {list(known)}")
    world = args.world_size or max(backends.gpu_count(), 1)
    name = backends.choose(world, args.backend)
    if name != "nccl":
        print("# not NCCL: the link settings mean nothing here; one run on gloo")
    overrides = {} if args.n_head is None else {"n_head": args.n_head}
    cfg = config(args.model, args.vocab_size, **overrides)
    if cfg.n_head % world:
        p.error(f"{cfg.n_head} heads cannot be split over {world} ranks: pass --world-size with a "
                f"divisor of {cfg.n_head}, or --n-head with a multiple of {world} (d_model "
                f"{cfg.d_model} must stay divisible by it)")
    seq = args.seq_len or cfg.seq_len
    print(f"# {backends.explain(world, args.backend)}; torch {torch.__version__}; {args.model} "
          f"({cfg.n_layer} layers, d={cfg.d_model}, {cfg.n_head} heads), global batch "
          f"{args.batch_size}x{seq}, {args.dtype}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(links, cfg, args.batch_size, seq, world, args.backend, variants, args.steps,
                  args.rounds, workdir=args.out.resolve())
    print(table(results))
    meta = {"world_size": world, "backend": name, "model": args.model, "config": dataclasses.asdict(cfg),
            "batch": args.batch_size, "seq": seq, "dtype": args.dtype, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if name == "nccl" else "CPU"}
    (args.out / "tp_bench.json").write_text(json.dumps({"meta": meta, "links": results}, indent=1))
    from distlab.viz.tp import plot_bench

    plot_bench(results, title=f"{args.model}, TP={world} vs DP={world}, global batch "
               f"{args.batch_size}x{seq}, {args.dtype}").savefig(args.out / "tp_bench.png", dpi=120,
                                                                  bbox_inches="tight")
    print(f"# wrote {args.out / 'tp_bench.json'} and {args.out / 'tp_bench.png'}")
    misses = goal_misses(results, name)
    print("\n".join(f"# goal missed: {m}" for m in misses) or f"# every goal met (distlab TP "
          f"within {GOAL}x torch TP's step time on NCCL; every variant ran)")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
