"""Ring attention on GPUs: the library's (zigzag, causal, bf16) against torch's own
``context_parallel`` on the same shapes, alternated in one run, and the causal work per
rank of both layouts, as time.

``python -m distlab.bench.cp --out DIR [--world-size 2] [--seq-len 32768]`` writes
``DIR/cp_bench.json``: per sequence length, the forward+backward seconds of ours and
torch's (median of rounds), their ratio, the error of ours against fp64 SDPA on the same
bf16 inputs (largest, relative to the largest magnitude), and each rank's time in each
layout. The goals (:data:`GOALS`): ours within 1.15x torch's time, the zigzag layout's
slowest rank within 1.1x its fastest (the issue's), and the error within one bf16 step
at the largest magnitude, 2^-8 (the result is rounded to bf16 once: half a step alone).
The issue's first accuracy goal, 1e-3·W against fp64 on the unrounded inputs, is below
what bf16 itself allows: on a CPU at 4,096 tokens, 16 heads of 128, torch's own bf16
SDPA missed it by 1.9x (docs/measurements.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import launch
from distlab.bench.timing import sync
from distlab.cp import ring_attention, shard

GOALS = {"ours / torch": 1.15, "zigzag max/min": 1.1, "bf16 error": 2.0 ** -8}
HEADS, DIM = 16, 128


def _rank_time(fn, iters):
    """This rank's own seconds per call (not the slowest rank's): the work it did."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _measure(seq_lens, rounds, iters):
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    for n in seq_lens:
        g = torch.Generator().manual_seed(n)
        whole = [torch.randn(1, HEADS, n, DIM, generator=g) for _ in range(4)]
        row = {"seq_len": n, "ours_s": [], "torch_s": [], "rank_s": {}}
        # accuracy: fp64 reference on the whole sequence of the same bf16 inputs (on the GPU)
        q, k, v = (t.to(dev, torch.bfloat16).double() for t in whole[:3])
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mine = [shard(t, world, rank, "zigzag").to(dev, torch.bfloat16).requires_grad_()
                for t in whole[:3]]
        got = ring_attention(*mine, n, causal=True, layout="zigzag")
        want = shard(ref.detach(), world, rank, "zigzag")
        row["error"] = ((got.double() - want).abs().max() / want.abs().max()).item()
        del q, k, v, ref
        do = shard(whole[3], world, rank, "zigzag").to(dev, torch.bfloat16)

        def ours(layout="zigzag"):
            qkv = [shard(t, world, rank, layout).to(dev, torch.bfloat16).requires_grad_()
                   for t in whole[:3]]
            return lambda: ring_attention(*qkv, n, causal=True, layout=layout).backward(do)

        def theirs():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel

            mesh = init_device_mesh("cuda", (world,))
            full = [t.to(dev, torch.bfloat16) for t in whole]

            def step():
                qkv = [t.clone().requires_grad_() for t in full[:3]]
                g_out = full[3].clone()
                with context_parallel(mesh, buffers=[*qkv, g_out], buffer_seq_dims=[2, 2, 2, 2]):
                    F.scaled_dot_product_attention(*qkv, is_causal=True).backward(g_out)
            return step

        runs = {"ours_s": ours(), "torch_s": None}
        try:
            runs["torch_s"] = theirs()
            runs["torch_s"]()
        except Exception as exc:  # torch's API is experimental: say what failed
            row["torch_error"] = f"{type(exc).__name__}: {exc}"
            runs["torch_s"] = None
        for _ in range(rounds):               # alternated, so drift hits both
            for key, fn in runs.items():
                if fn is not None:
                    sync(dev)
                    dist.barrier()
                    row[key].append(max(_all(_rank_time(fn, iters))))
        for layout in ("contiguous", "zigzag"):
            row["rank_s"][layout] = _all(_rank_time(ours(layout), iters))
        out.append(row)
    return out


def _all(value: float) -> list[float]:
    t = torch.tensor([value], device="cuda")
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [p.item() for p in parts]


def goal_misses(rows: list[dict]) -> list[str]:
    misses = []
    for r in rows:
        n = r["seq_len"]
        if r.get("torch_error"):
            misses.append(f"{n} tokens: torch's context_parallel did not run ({r['torch_error']})")
        elif r["ratio"] > GOALS["ours / torch"]:
            misses.append(f"{n} tokens: ours {r['ratio']:.2f}x torch's time, above "
                          f"{GOALS['ours / torch']}")
        if r["zigzag_balance"] > GOALS["zigzag max/min"]:
            misses.append(f"{n} tokens: zigzag ranks' times max/min {r['zigzag_balance']:.2f}, "
                          f"above {GOALS['zigzag max/min']}")
        if r["error"] > GOALS["bf16 error"]:
            misses.append(f"{n} tokens: bf16 error {r['error']:.2e} above one bf16 step "
                          f"({GOALS['bf16 error']:.2e})")
    return misses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlab.bench.cp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    rows = launch.run(_measure, args.world_size, args.seq_len, args.rounds, args.iters,
                      backend="nccl", timeout=900)[0]
    for r in rows:
        r["ours_median_s"] = statistics.median(r["ours_s"])
        r["torch_median_s"] = statistics.median(r["torch_s"]) if r["torch_s"] else None
        r["ratio"] = (r["ours_median_s"] / r["torch_median_s"]) if r["torch_median_s"] else None
        for layout in ("contiguous", "zigzag"):
            t = r["rank_s"][layout]
            r[f"{layout}_balance"] = max(t) / min(t)
    misses = goal_misses(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cp_bench.json").write_text(json.dumps(
        {"meta": {"world_size": args.world_size, "heads": HEADS, "head_dim": DIM,
                  "dtype": "bf16", "torch": torch.__version__}, "rows": rows,
         "misses": misses}, indent=1))
    for line in misses:
        print("missed:", line)
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
