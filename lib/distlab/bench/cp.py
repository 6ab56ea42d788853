"""Context parallelism on GPUs: the library's ring attention (zigzag, causal, bf16)
against torch's own ``context_parallel`` and against Llama 3's all-gather
(:func:`distlab.cp.allgather_attention`, Dubey et al. 2024, section 3.3.2) with full
multi-head K/V and with grouped-query K/V, on the same shapes, alternated in one run;
and the causal work per rank of both layouts, as time.

``python -m distlab.bench.cp --out DIR [--world-size 2] [--seq-len 8192 32768]
[--backend nccl|gloo]`` writes ``DIR/cp_bench.json``: per sequence length, the
forward+backward seconds of each contender (median of rounds, the slowest rank's), the
ratios, the bytes on the wire per rank of the ring and of the all-gathers
(forward+backward, ``CommLog.bus_bytes``; torch's are not traced), the error of the ring
and of the all-gather against fp64 attention on the same bf16 inputs (largest, relative
to the largest magnitude), and each rank's time in each layout of the ring. Q has
:data:`HEADS` heads of :data:`DIM`; the ring's contract takes K/V with as many heads, so
it gets them expanded in the GQA case too (the same time: one ring serves both); the
all-gather runs with :data:`HEADS` K/V heads (MHA) and with :data:`KV_HEADS` (GQA, 4
query heads per K/V head as Llama 3 8B's 32/8).

The goals (:data:`GOALS`, :func:`allgather_bound`): ours within 1.15x torch's time,
the zigzag layout's slowest rank within 1.1x its fastest (the issue's), the ring's and
the all-gather's error within one bf16 step at the largest magnitude, 2^-8 (the result
is rounded to bf16 once: half a step alone), and the all-gather with GQA within lab
10's model of the ring's time (section 1.6): a ring that hides its transfer takes the
attention's time, the all-gather adds its exposed transfer. The issue's first accuracy
goal, 1e-3·W against fp64 on the unrounded inputs, is below what bf16 itself allows: on
a CPU at 4,096 tokens, 16 heads of 128, torch's own bf16 SDPA missed it by 1.9x
(docs/measurements.md). With ``--backend gloo`` (CPU) the times are a smoke test's.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import backend, launch
from distlab.bench.timing import per_call, sync
from distlab.comm import CommLog
from distlab.cp import allgather_attention, positions, ring_attention, shard
from distlab.cp.allgather import visible

GOALS = {"ours / torch": 1.15, "zigzag max/min": 1.1, "bf16 error": 2.0 ** -8}
HEADS, KV_HEADS, DIM = 16, 4, 128
# Lab 10 section 1.6's model with this check's GPUs: F, an H100's or H200's dense bf16
# peak; B, the all-gather's bus bandwidth over NVLink between two H200s (nccl-tests at
# 512 MiB, docs/measurements.md, 2026-11-30).
PEAK_FLOPS, LINK_BYTES_S = backend.peak_flops("H100", "bf16"), 255e9
CONTENDERS = {"ours_s": "ring (ours)", "torch_s": "torch context_parallel",
              "allgather_mha_s": f"all-gather, {HEADS} K/V heads",
              "allgather_gqa_s": f"all-gather, {KV_HEADS} K/V heads"}


def allgather_bound(seq_len: int, world: int, kv_heads: int = KV_HEADS) -> float:
    """The all-gather's time over the ring's in lab 10's model (section 1.6, after Ring
    Attention, Liu et al. 2023, section 3): ``1 + (W-1)/W · c_min/c``, ``c = seq_len/W``
    tokens per rank, ``c_min = 2·(F/B)·H_kv/H`` the smallest causal zigzag block whose
    bf16 K/V transfer hides behind its computation (:data:`PEAK_FLOPS`,
    :data:`LINK_BYTES_S`)."""
    c_min = 2 * PEAK_FLOPS / LINK_BYTES_S * kv_heads / HEADS
    return 1 + (world - 1) / world * c_min / (seq_len / world)


def _rank_time(fn, iters, dev):
    """This rank's own seconds per call (not the slowest rank's): the work it did."""
    fn()
    dist.barrier()
    return per_call(fn, iters, dev)


def _reference(whole, seq_len, world, rank, dev):
    """fp64 causal attention of this rank's zigzag queries, one head at a time (the whole
    sequence's scores of every head at once would not fit a GPU at 32K tokens)."""
    mine = positions(seq_len, world, rank, "zigzag")
    mask = visible(mine, torch.arange(seq_len), causal=True).to(dev)
    q, k, v = (t.to(dev, torch.bfloat16).double() for t in whole[:3])
    return torch.cat([F.scaled_dot_product_attention(q[:, h:h + 1, mine.to(dev)], k[:, h:h + 1],
                                                     v[:, h:h + 1], attn_mask=mask)
                      for h in range(q.shape[1])], dim=1)


def _measure(seq_lens, rounds, iters):
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = backend.device()
    out = []
    for n in seq_lens:
        g = torch.Generator().manual_seed(n)
        whole = [torch.randn(1, HEADS, n, DIM, generator=g) for _ in range(4)]
        row = {"seq_len": n, **{key: [] for key in CONTENDERS}, "rank_s": {}, "bytes": {}}
        want = _reference(whole, n, world, rank, dev)
        do = shard(whole[3], world, rank, "zigzag").to(dev, torch.bfloat16)

        def ours(layout="zigzag"):
            qkv = [shard(t, world, rank, layout).to(dev, torch.bfloat16).requires_grad_()
                   for t in whole[:3]]
            return lambda: ring_attention(*qkv, n, causal=True, layout=layout).backward(do)

        def gathered(kv_heads):
            q, k, v = (shard(t, world, rank, "zigzag").to(dev, torch.bfloat16) for t in whole[:3])
            qkv = [t.requires_grad_() for t in (q, k[:, :kv_heads].contiguous(),
                                                 v[:, :kv_heads].contiguous())]
            return lambda: allgather_attention(*qkv, n, causal=True, layout="zigzag").backward(do)

        def theirs():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel

            mesh = init_device_mesh(dev.type, (world,))
            full = [t.to(dev, torch.bfloat16) for t in whole]

            def step():  # the buffers are resized in place: leaves that need no grad
                bufs = [t.clone() for t in full]
                with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2],
                                      no_restore_buffers=set(bufs)):
                    qkv = [t.detach().requires_grad_() for t in bufs[:3]]
                    F.scaled_dot_product_attention(*qkv, is_causal=True).backward(bufs[3])
            return step

        mine = [shard(t, world, rank, "zigzag").to(dev, torch.bfloat16) for t in whole[:3]]
        for key, attend in (("error", ring_attention), ("allgather_error", allgather_attention)):
            got = attend(*mine, n, causal=True, layout="zigzag")
            row[key] = ((got.double() - want).abs().max() / want.abs().max()).item()
        del want, mine
        runs = {"ours_s": ours(), "torch_s": None, "allgather_mha_s": gathered(HEADS),
                "allgather_gqa_s": gathered(KV_HEADS)}
        if dev.type != "cuda":
            row["torch_error"] = ("not run: context_parallel shards only CUDA attention "
                                  "kernels (torch has no CPU sharding strategy for SDPA)")
        else:
            try:
                runs["torch_s"] = theirs()
                runs["torch_s"]()
            except Exception as exc:  # torch's API is experimental: say what failed
                row["torch_error"] = f"{type(exc).__name__}: {exc}"
                runs["torch_s"] = None
        for key in ("ours_s", "allgather_mha_s", "allgather_gqa_s"):
            with CommLog() as log:
                runs[key]()
            row["bytes"][key[:-2]] = max(_all(log.bus_bytes(), dev))
        for _ in range(rounds):               # alternated, so drift hits every contender
            for key, fn in runs.items():
                if fn is not None:
                    sync(dev)
                    dist.barrier()
                    row[key].append(max(_all(_rank_time(fn, iters, dev), dev)))
        for layout in ("contiguous", "zigzag"):
            row["rank_s"][layout] = _all(_rank_time(ours(layout), iters, dev), dev)
        out.append(row)
    return out


def _all(value: float, dev) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [p.item() for p in parts]


def summarise(row: dict, world: int) -> dict:
    """``row`` with each contender's median, the ratios to the ring, the model's bounds
    and each layout's max/min rank time."""
    for key in CONTENDERS:
        row[key[:-2] + "_median_s"] = statistics.median(row[key]) if row[key] else None
    ring = row["ours_median_s"]
    row["ratio"] = ring / row["torch_median_s"] if row["torch_median_s"] else None
    for heads, name in ((HEADS, "mha"), (KV_HEADS, "gqa")):
        row[f"allgather_{name}_ratio"] = row[f"allgather_{name}_median_s"] / ring
        row[f"allgather_{name}_model"] = allgather_bound(row["seq_len"], world, heads)
    for layout in ("contiguous", "zigzag"):
        t = row["rank_s"][layout]
        row[f"{layout}_balance"] = max(t) / min(t)
    return row


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
        for key, name in (("error", "ring"), ("allgather_error", "all-gather")):
            if r[key] > GOALS["bf16 error"]:
                misses.append(f"{n} tokens: {name}'s bf16 error {r[key]:.2e} above one bf16 "
                              f"step ({GOALS['bf16 error']:.2e})")
        if r["allgather_gqa_ratio"] > r["allgather_gqa_model"]:
            misses.append(f"{n} tokens: all-gather with {KV_HEADS} K/V heads "
                          f"{r['allgather_gqa_ratio']:.2f}x the ring's time, above the model's "
                          f"{r['allgather_gqa_model']:.2f}x")
    return misses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlab.bench.cp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    args = p.parse_args(argv)
    rows = launch.run(_measure, args.world_size, args.seq_len, args.rounds, args.iters,
                      backend=backend.choose(args.world_size, args.backend), timeout=900)[0]
    rows = [summarise(r, args.world_size) for r in rows]
    misses = goal_misses(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cp_bench.json").write_text(json.dumps(
        {"meta": {"world_size": args.world_size, "heads": HEADS, "kv_heads": KV_HEADS,
                  "head_dim": DIM, "dtype": "bf16", "backend": args.backend,
                  "torch": torch.__version__, "contenders": CONTENDERS,
                  "model": {"peak_flops": PEAK_FLOPS, "link_bytes_s": LINK_BYTES_S}},
         "rows": rows, "misses": misses}, indent=1))
    for line in misses:
        print("missed:", line)
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
