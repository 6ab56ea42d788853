"""Lab 05 on GPUs: the sharded AdamW kernel, memory per rank of each ZeRO stage, and
ZeRO-3's step time against FSDP2, in one launch of one NCCL rank per GPU.

    NCCL_NVLS_ENABLE=0 python -m distlab.zero_bench --out results/zero

On the 98M-parameter GPT of lab 04 (``config("gpt-100m", vocab_size=16384)``), each rank:

1. **kernel**: :class:`distlab.zero.kernel.ShardAdamW` on its shard of a flat buffer of
   the GPT's size plus one element (uneven shards), against
   ``torch.optim.AdamW(fused=True)`` on the same shard: largest difference after one step,
   time per step, and achieved bandwidth at 28 bytes per parameter, next to a plain
   device copy of the same buffer measured in the same run;
2. **memory**: data parallelism (lab 04's ``DataParallel`` with fp32 master weights) and
   ZeRO-1, 2, 3 in bf16: peak memory of a training step (``max_memory_allocated``) and
   memory at the end of backward, against :func:`distlab.memory.accounting`, with the
   activations measured apart (the bare bf16 model's forward and backward, no optimizer);
3. **speed**: ZeRO-3 (``FullyShardedDataParallel``, bf16) against FSDP2's ``fully_shard``
   per block (bf16 parameters and reduction), interleaved in the same run.

It prints a table and writes ``zero_bench.json`` and ``zero_bench.png`` into ``--out``.
Goals: kernel within 1.2x of the fused AdamW; peak minus activations within 10 % of the
accounting; ZeRO-3 / FSDP2 step time at most 1.15. With gloo (``--backend gloo``, the
tiny model) it runs on CPUs as a smoke test: sections that need CUDA are skipped.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

STRATEGIES = ("data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3")
GOALS = {"kernel / fused AdamW": 1.2, "memory error": 0.10, "ZeRO-3 / FSDP2": 1.15}


def _sync():
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _model(cfg, device):
    from distlab.model import GPT

    torch.manual_seed(0)
    return GPT(cfg).to(device)


def kernel_section(numel: int, repeats: int) -> dict:
    """The kernel against the fused AdamW on this rank's shard, and a device copy."""
    from distlab import backend
    from distlab.zero.flat import shard_range
    from distlab.zero.kernel import BYTES_PER_PARAM, ShardAdamW

    device = backend.device()
    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = shard_range(numel, rank, world)
    torch.manual_seed(rank)
    param, grad = torch.randn(numel, device=device), torch.randn(numel, device=device)
    ref = torch.nn.Parameter(param[start:end].clone())
    ref.grad = grad[start:end].clone()
    ours = ShardAdamW(param, grad, start, end)
    fused = torch.optim.AdamW([ref], fused=True)
    ours.step()
    fused.step()
    error = float((param[start:end] - ref.detach()).abs().max())
    # a copy of n floats reads and writes 8n bytes: n = 28/8 per parameter of the shard
    copy_src = torch.empty(BYTES_PER_PARAM * (end - start) // 8, device=device)
    copy_dst = torch.empty_like(copy_src)

    def timed(fn):
        fn()
        begin, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(stop) / 1e3 / repeats

    seconds = {"kernel": timed(ours.step), "fused AdamW": timed(fused.step),
               "device copy": timed(lambda: copy_dst.copy_(copy_src))}
    moved = BYTES_PER_PARAM * (end - start)
    return {"shard": end - start, "max_abs_error": error, "seconds": seconds,
            "tb_per_s": {k: moved / s / 1e12 for k, s in seconds.items()},
            "kernel / fused AdamW": seconds["kernel"] / seconds["fused AdamW"]}


def _wrap(strategy, model, solo):
    """(module, optimizer) in bf16 with fp32 master weights, as lab 05 builds them."""
    from distlab.dp import DataParallel
    from distlab.zero import FullyShardedDataParallel, ShardedOptimizer

    if strategy in ("data parallel", "ZeRO-1"):
        model = model.to(torch.bfloat16)
        if strategy == "data parallel":
            return DataParallel(model), ShardedOptimizer(model.parameters(), torch.optim.AdamW,
                                                         solo, average_gradients=False)
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW)
    net = FullyShardedDataParallel(model, torch.bfloat16, shard_parameters=strategy == "ZeRO-3")
    return net, torch.optim.AdamW(net.parameters())


def _train_step(net, opt, tokens, measure=None):
    opt.zero_grad(set_to_none=False)      # gradients held between steps, as the paper counts
    _loss(net, tokens).backward()
    if hasattr(net, "finish_gradient_synchronization"):
        net.finish_gradient_synchronization()
    if measure is not None:
        measure()
    opt.step()


def memory_section(cfg, batch: int, seq: int, steps: int) -> dict:
    """Per strategy: peak of a training step and bytes at the end of backward, against
    the accounting; the activations measured apart."""
    from distlab import backend, memory

    device = backend.device()
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]
    tokens = torch.randint(cfg.vocab_size, (batch, seq + 1), device=device,
                           generator=torch.Generator(device).manual_seed(rank))
    cuda = device.type == "cuda"
    out = {}
    bare = _model(cfg, device).to(torch.bfloat16)
    _loss(bare, tokens).backward()                  # warm-up (kernels, workspaces)
    bare.zero_grad(set_to_none=True)
    _sync()
    base = memory.cuda_memory(device)["allocated"]
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    _loss(bare, tokens).backward()
    _sync()
    out["activations"] = memory.cuda_memory(device)["peak"] - base
    del bare
    for strategy in STRATEGIES:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        net, opt = _wrap(strategy, _model(cfg, device), solo)
        for _ in range(2):
            _train_step(net, opt, tokens)
        _sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        seen, times = {}, []
        for _ in range(steps):
            start = time.perf_counter()
            _train_step(net, opt, tokens, lambda: seen.update(
                memory.cuda_memory(device), held=memory.held_bytes(net, opt).as_dict()))
            _sync()
            times.append(time.perf_counter() - start)
        flats = (net if hasattr(net, "flat_params") else opt).flat_params()
        stage = STRATEGIES.index(strategy)
        account = memory.accounting([f.numel for f in flats], 1 if stage == 0 else world,
                                    0 if stage == 0 else rank, stage).as_dict()
        peak = memory.cuda_memory(device)["peak"]
        out[strategy] = {
            "held": seen["held"], "accounting": account, "end_of_backward": seen["allocated"],
            "peak": peak, "peak_minus_activations": peak - out["activations"],
            "memory error": (peak - out["activations"]) / account["total"] - 1 if cuda else None,
            "step_seconds": statistics.median(times)}
        del net, opt
    return out


def speed_section(cfg, batch: int, seq: int, steps: int, warmup: int, rounds: int = 2) -> dict:
    """ZeRO-3 against FSDP2 ``fully_shard`` per block, bf16, interleaved ``rounds`` times."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from distlab import backend
    from distlab.zero import FullyShardedDataParallel

    device = backend.device()
    tokens = torch.randint(cfg.vocab_size, (batch, seq + 1), device=device,
                           generator=torch.Generator(device).manual_seed(dist.get_rank()))

    def ours():
        net = FullyShardedDataParallel(_model(cfg, device), torch.bfloat16)
        return net, torch.optim.AdamW(net.parameters())

    def fsdp2():
        model = _model(cfg, device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters())

    seconds = {"ZeRO-3": [], "FSDP2": []}
    for _ in range(rounds):
        for name, build in (("ZeRO-3", ours), ("FSDP2", fsdp2)):
            gc.collect()
            net, opt = build()
            for _ in range(warmup):
                _train_step(net, opt, tokens)
            _sync()
            start = time.perf_counter()
            for _ in range(steps):
                _train_step(net, opt, tokens)
            _sync()
            seconds[name].append((time.perf_counter() - start) / steps)
            del net, opt
    best = {k: min(v) for k, v in seconds.items()}
    return {"seconds": seconds, "best": best, "ZeRO-3 / FSDP2": best["ZeRO-3"] / best["FSDP2"],
            "tokens_per_rank": batch * seq}


def rank_bench(cfg, batch: int, seq: int, steps: int, warmup: int, sections: tuple) -> dict:
    from distlab import backend

    cuda = backend.device().type == "cuda"
    out = {"device": torch.cuda.get_device_name() if cuda else "CPU",
           "torch": torch.__version__, "world_size": dist.get_world_size()}
    from distlab.model import GPT

    with torch.device("meta"):
        numel = GPT(cfg).num_params() + 1       # + 1: shards of unequal size
    for name, run in (("kernel", lambda: kernel_section(numel, 50)),
                      ("memory", lambda: memory_section(cfg, batch, seq, steps)),
                      ("speed", lambda: speed_section(cfg, batch, seq, steps, warmup))):
        if name not in sections:
            continue
        if name == "kernel" and not cuda:
            out[name] = {"skipped": "needs CUDA and cupy"}
            continue
        try:
            out[name] = run()
        except Exception as e:  # one failing section must not cost the others' figures
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def report(results: list[dict]) -> str:
    """The figures of every rank as a table, with the goals."""
    first = results[0]
    lines = [f"{first['device']}, {first['world_size']} rank(s), torch {first['torch']}"]
    for rank, r in enumerate(results):
        k = r.get("kernel", {})
        if "seconds" in k:
            lines.append(
                f"rank {rank} kernel: shard {k['shard']:,}, max |kernel - fused| "
                f"{k['max_abs_error']:.1e}; " + ", ".join(
                    f"{n} {1e3 * s:.3f} ms ({k['tb_per_s'][n]:.2f} TB/s)"
                    for n, s in k["seconds"].items())
                + f"; kernel / fused {k['kernel / fused AdamW']:.2f} (goal <= "
                  f"{GOALS['kernel / fused AdamW']})")
        elif k:
            lines.append(f"rank {rank} kernel: {k}")
    mem = [r.get("memory", {}) for r in results]
    if mem and "activations" in mem[0]:
        lines.append(f"{'memory (MB)':<16}{'rank':>5}{'accounting':>12}{'end of bwd':>12}"
                     f"{'peak':>10}{'activations':>13}{'peak - act':>12}{'error':>8}{'ms/step':>9}")
        for strategy in STRATEGIES:
            for rank, m in enumerate(mem):
                s = m[strategy]
                err = "" if s["memory error"] is None else f"{100 * s['memory error']:+.1f}%"
                lines.append(f"{strategy:<16}{rank:>5}{s['accounting']['total'] / 1e6:>12.1f}"
                             f"{s['end_of_backward'] / 1e6:>12.1f}{s['peak'] / 1e6:>10.1f}"
                             f"{m['activations'] / 1e6:>13.1f}"
                             f"{s['peak_minus_activations'] / 1e6:>12.1f}{err:>8}"
                             f"{1e3 * s['step_seconds']:>9.1f}")
        lines.append(f"goal: |error| <= {100 * GOALS['memory error']:.0f}%")
    elif mem and mem[0]:
        lines.append(f"memory: {mem[0]}")
    speed = results[0].get("speed", {})
    if "best" in speed:
        lines.append(f"speed, {speed['tokens_per_rank']} tokens per rank: ZeRO-3 "
                     f"{1e3 * speed['best']['ZeRO-3']:.1f} ms, FSDP2 "
                     f"{1e3 * speed['best']['FSDP2']:.1f} ms per step; ratio "
                     f"{speed['ZeRO-3 / FSDP2']:.3f} (goal <= {GOALS['ZeRO-3 / FSDP2']})")
    elif speed:
        lines.append(f"speed: {speed}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from distlab import backend, launch
    from distlab.model import PRESETS, config

    p = argparse.ArgumentParser(prog="python -m distlab.zero_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for JSON and PNG")
    p.add_argument("--model", default="gpt-100m", choices=sorted(PRESETS))
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--world-size", type=int, default=None, help="default: every GPU, or 2")
    p.add_argument("--backend", default="auto", choices=backend.BACKENDS)
    p.add_argument("--sections", default="kernel,memory,speed")
    args = p.parse_args(argv)
    cfg = config(args.model, args.vocab_size)
    seq = args.seq_len or cfg.seq_len
    world = args.world_size or max(backend.gpu_count(), 2)
    print(backend.explain(world, args.backend))
    start = time.perf_counter()
    results = launch.run(rank_bench, world, cfg, args.batch_size, seq, args.steps, args.warmup,
                         tuple(args.sections.split(",")), backend=args.backend, timeout=600)
    text = report(results)
    print(text)
    print(f"({time.perf_counter() - start:.0f} s)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zero_bench.json").write_text(json.dumps(results, indent=1))
    try:
        from distlab.viz.zero import plot_gpu_figures

        plot_gpu_figures(results).savefig(args.out / "zero_bench.png", dpi=110,
                                          bbox_inches="tight")
    except ImportError as e:
        print(f"no figure ({e}); the JSON has every number")
    print(f"wrote {args.out / 'zero_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
