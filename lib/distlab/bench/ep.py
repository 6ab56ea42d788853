"""Expert parallelism's dispatch and combine on GPUs, against the all-to-all itself.

``python -m distlab.bench.ep --out DIR [--world-size 2]`` writes ``DIR/ep_bench.json``:
for each token count, the seconds of the library's dispatch+combine (``distlab.moe``'s
expert-parallel layer, identity experts, so that only the routing work and the two
all-to-alls are timed), the bytes its rows moved, their bandwidth, and the bandwidth of
one ``all_to_all_single`` moving the same bytes, bus bandwidth as nccl-tests counts it
(``(W-1)/W`` of the message per rank). Goal (:data:`GOAL`): dispatch+combine at least 0.7
of the all-to-all's bus bandwidth.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab import launch
from distlab.bench.timing import time_op
from distlab.comm import CommLog, bus_factor
from distlab.moe import expert_parallel
from distlab.moe.layer import MoE
from distlab.model import config

GOAL = 0.7
D_MODEL, EXPERTS, K = 4096, 8, 2


def _measure(tokens_list, iters):
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = config("test", 16, d_model=D_MODEL, n_head=32)
    layer = MoE(cfg, EXPERTS, K, capacity_factor=None)
    layer.experts = nn.ModuleList(nn.Identity() for _ in range(EXPERTS))
    holder = nn.Sequential(layer)
    expert_parallel(holder)
    layer.to(dev, torch.bfloat16)
    rows = []
    for n in tokens_list:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(n, D_MODEL, generator=g).to(dev, torch.bfloat16)
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(n)]).to(dev)
        w = torch.full((n, K), 1.0 / K, device=dev, dtype=torch.bfloat16)
        call = lambda: layer.dispatch(x, ids, w, layer.experts, None)  # noqa: E731
        with CommLog() as log:
            call()
        moved = sum(e.nbytes for e in log.select("all_to_all_single") if e.dtype == "bfloat16")
        seconds = time_op(call, warmup=3, iters=iters)
        msg = torch.empty(moved // 2 // 2, dtype=torch.bfloat16, device=dev)  # one direction
        out = torch.empty_like(msg)
        a2a = time_op(lambda: dist.all_to_all_single(out, msg), warmup=3, iters=iters)
        factor = bus_factor("all_to_all", world)
        rows.append({"tokens": n, "bytes": moved, "seconds": seconds,
                     "busbw": moved * factor / seconds, "a2a_seconds": a2a,
                     "a2a_busbw": msg.numel() * 2 * factor / a2a})
    return rows


def goal_misses(rows):
    return [f"{r['tokens']} tokens: dispatch+combine {r['ratio']:.2f} of the all-to-all's busbw, "
            f"below {GOAL}" for r in rows if r["ratio"] < GOAL]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlab.bench.ep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    rows = launch.run(_measure, args.world_size, args.tokens, args.iters, backend="nccl",
                      timeout=900)[0]
    for r in rows:
        r["ratio"] = r["busbw"] / r["a2a_busbw"]
    misses = goal_misses(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ep_bench.json").write_text(json.dumps(
        {"meta": {"world_size": args.world_size, "d_model": D_MODEL, "experts": EXPERTS, "k": K,
                  "torch": torch.__version__}, "rows": rows, "misses": misses}, indent=1))
    for line in misses:
        print("missed:", line)
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
