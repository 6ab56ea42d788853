"""Lab 05 on GPUs: the sharded AdamW kernel, memory per rank of each ZeRO stage, and
ZeRO-3's step time against FSDP2, in one launch of one NCCL rank per GPU.

    NCCL_NVLS_ENABLE=0 python -m distlab.bench.zero --out results/zero

On the 98M-parameter GPT of lab 04 (``config("gpt-100m", vocab_size=16384)``), each rank:

1. **kernel**: :class:`distlab.zero.kernel.ShardAdamW` on its shard of a flat buffer of
   the GPT's size plus one element (uneven shards), against
   ``torch.optim.AdamW(fused=True)`` on the same shard: largest difference after one step,
   time per step, and achieved bandwidth at 28 bytes per parameter, next to a plain
   device copy of the same buffer measured in the same run;
2. **memory**: data parallelism (lab 04's ``DataParallel`` with fp32 master weights) and
   ZeRO-1, 2, 3 in bf16, each built after the previous one is deleted, above a baseline
   read just before (cuBLAS workspaces, the tokens): the model states in use at the end
   of backward against :func:`distlab.zero.memory.accounting`; the optimizer step's buffers
   (its peak above the end of backward) against :func:`distlab.zero.memory.step_buffers`; the
   peak against states + the larger of activations (the bare bf16 model's forward and
   backward, measured apart) and step buffers; and what the strategy left behind;
3. **speed**: ZeRO-3 (``FullyShardedDataParallel``) against FSDP2's ``fully_shard`` per
   block, set up alike (bf16 parameters and reduction, fp32 master weights, blocks
   resharded after forward, warm-up excluded), with AdamW foreach and fused, interleaved
   in the same run; the backward and the optimizer step also timed apart, and each
   one's collectives per step counted (CommLog), so that skipped work would show.

It prints a table and writes ``zero_bench.json`` and ``zero_bench.png`` into ``--out``.
Goals: kernel within 1.2x of the fused AdamW; model states, step buffers and the peak
each within 10 % of the accounting, nothing left behind; ZeRO-3 / FSDP2 step time at
most 1.15; a miss exits 1 (:func:`goal_misses`). With gloo (``--backend gloo``, the tiny
model) it runs on CPUs as a smoke test: the kernel is skipped and memory is measured by
a :class:`distlab.zero.memory.StorageTracker`; there only a failed section is a miss.
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

from distlab import backend
from distlab.bench.timing import sync
from distlab.units import decimal_bytes

STRATEGIES = ("data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3")
GOALS = {"kernel / fused AdamW": 1.2, "memory error": 0.10, "ZeRO-3 / FSDP2": 1.15}


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
    from distlab.shards import shard_range
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


def _wrap(strategy, model, solo, optimizer=None):
    """(module, optimizer) in bf16 with fp32 master weights, as lab 05 builds them;
    AdamW with ``optimizer`` keywords (default: foreach, as on GPUs; CPUs would pick the
    per-tensor loop, whose scratch differs)."""
    from distlab.dp import DataParallel
    from distlab.zero import FullyShardedDataParallel, ShardedOptimizer

    kwargs = optimizer or {"foreach": True}
    if strategy in ("data parallel", "ZeRO-1"):
        model = model.to(torch.bfloat16)
        if strategy == "data parallel":
            return DataParallel(model), ShardedOptimizer(model.parameters(), torch.optim.AdamW,
                                                         solo, average_gradients=False, **kwargs)
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, **kwargs)
    net = FullyShardedDataParallel(model, torch.bfloat16, shard_parameters=strategy == "ZeRO-3")
    return net, torch.optim.AdamW(net.parameters(), **kwargs)


def _backward(net, tokens) -> None:
    """Forward, backward and the wrapper's gradient synchronisation."""
    _loss(net, tokens).backward()
    if hasattr(net, "finish_gradient_synchronization"):
        net.finish_gradient_synchronization()


def _synced_backward(net, tokens) -> float:
    """Seconds of :func:`_backward`, the device synchronised at its end."""
    begin = time.perf_counter()
    _backward(net, tokens)
    sync(backend.device())
    return time.perf_counter() - begin


def _train_step(net, opt, tokens):
    opt.zero_grad(set_to_none=False)      # gradients held between steps, as the paper counts
    _backward(net, tokens)
    opt.step()


def _measured_step(net, opt, tokens, meter, baseline: int) -> dict:
    """One step, synced between phases: bytes in use at its start, after backward (once
    down to ``baseline`` + ``held_bytes`` + DP's flags: gloo frees late) and after it."""
    from distlab.zero import memory

    opt.zero_grad(set_to_none=False)
    sync(backend.device())
    out = {"start": meter.allocated()}
    meter.reset_peak()
    backward_seconds = _synced_backward(net, tokens)
    out["held"] = memory.held_bytes(net, opt).as_dict()
    flags = sum(b.flags.nbytes for b in getattr(net, "buckets", ()))  # DataParallel's
    out.update(end_of_backward=meter.settle(baseline + out["held"]["total"] + flags, 2.0),
               backward_peak=meter.peak())
    meter.reset_peak()
    middle = time.perf_counter()
    opt.step()
    sync(backend.device())
    out.update(end_of_step=meter.allocated(), step_peak=meter.peak(),
               backward_seconds=backward_seconds, step_seconds=time.perf_counter() - middle)
    return out


def _release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_section(cfg, batch: int, seq: int, steps: int) -> dict:
    """Per strategy, bytes per rank in three parts: model states at the end of backward
    (against :func:`distlab.zero.memory.accounting`), the optimizer step's buffers (against
    :func:`distlab.zero.memory.step_buffers`), and the activations (the bare bf16 model's
    forward and backward, measured apart), all above a baseline read before the strategy
    is built (what the process already holds: cuBLAS workspaces, the tokens). Each
    strategy is deleted before the next is built, and what it left is reported."""
    from distlab import backend
    from distlab.zero import memory

    device = backend.device()
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]
    tokens = torch.randint(cfg.vocab_size, (batch, seq + 1), device=device,
                           generator=torch.Generator(device).manual_seed(rank))
    out = {}
    with memory.meter(device) as meter:
        bare = _model(cfg, device).to(torch.bfloat16)
        for _ in range(3):                          # warm-up: kernels, workspaces, gradients
            bare.zero_grad(set_to_none=False)
            sync(backend.device())
            start = meter.allocated()
            meter.reset_peak()
            _loss(bare, tokens).backward()
            sync(backend.device())
        out["activations"] = meter.peak() - start
        del bare
    for strategy in STRATEGIES:
        stage = STRATEGIES.index(strategy)
        _release(device)
        with memory.meter(device) as meter:
            baseline = meter.allocated()
            net, opt = _wrap(strategy, _model(cfg, device), solo)
            units, whole = memory.units_of((opt, net)[hasattr(net, "flat_params")].flat_params())
            for _ in range(2):                      # warm-up: the optimizer's lazy state
                _train_step(net, opt, tokens)
            runs = [_measured_step(net, opt, tokens, meter, baseline) for _ in range(steps)]
            del net, opt
            _release(device)
            left = meter.settle(baseline) - baseline
        account = memory.accounting(units, 1 if stage == 0 else world,
                                    0 if stage == 0 else rank, stage, whole).as_dict()
        step_account = memory.step_buffers(units, world, rank, stage, whole)
        states = max(r["end_of_backward"] for r in runs) - baseline
        backward = max(r["backward_peak"] - r["start"] for r in runs)
        step = max(r["step_peak"] - r["end_of_backward"] for r in runs)
        peak = max(max(r["backward_peak"], r["step_peak"]) for r in runs) - baseline
        transient = max(out["activations"], step_account)
        out[strategy] = {
            "units": units, "whole": whole, "held": runs[-1]["held"], "accounting": account,
            "baseline": baseline, "states": states,
            "states error": states / account["total"] - 1,
            "backward transient": backward,
            "backward buffers": backward - out["activations"],
            "step buffers": step, "step buffers accounted": step_account,
            "step buffers error": step / step_account - 1 if step_account else None,
            "peak": peak, "peak accounted": account["total"] + transient,
            "memory error": (peak - transient) / account["total"] - 1,
            "left behind": left,
            "backward_seconds": statistics.median(r["backward_seconds"] for r in runs),
            "step_seconds": statistics.median(r["step_seconds"] for r in runs)}
    return out


OPTIMIZERS = {"foreach": {"foreach": True}, "fused": {"fused": True}}
TRAFFIC = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast")


def speed_section(cfg, batch: int, seq: int, steps: int, warmup: int, rounds: int = 2) -> dict:
    """ZeRO-3 against FSDP2 ``fully_shard`` per block, set up alike: bf16 parameters and
    gradient reduction with fp32 master weights, every block resharded after forward,
    AdamW foreach (the default on GPUs) and fused (torchtitan's choice with FSDP2),
    warm-up steps excluded, interleaved ``rounds`` times (best kept). Per run: the step
    time of ``steps`` back-to-back steps; the backward and the optimizer step timed apart
    (synchronised), with the host's time to issue the optimizer step; and the bytes each
    collective moved in one step (CommLog), which shows that neither skips work."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from distlab import backend
    from distlab.zero import FullyShardedDataParallel

    device = backend.device()
    tokens = torch.randint(cfg.vocab_size, (batch, seq + 1), device=device,
                           generator=torch.Generator(device).manual_seed(dist.get_rank()))

    def ours(kwargs):
        net = FullyShardedDataParallel(_model(cfg, device), torch.bfloat16)
        return net, torch.optim.AdamW(net.parameters(), **kwargs)

    def fsdp2(kwargs):
        model = _model(cfg, device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), **kwargs)

    runs: dict[str, dict[str, dict]] = {o: {} for o in OPTIMIZERS}
    for round_ in range(rounds):
        for opt_name, kwargs in OPTIMIZERS.items():
            for name, build in (("ZeRO-3", ours), ("FSDP2", fsdp2)):
                _release(device)
                best = runs[opt_name].get(name)
                if best is not None and "error" in best:
                    continue
                try:
                    run = _timed_run(build, kwargs, tokens, steps, warmup, traffic=best is None)
                except Exception as e:  # one failing setup must not cost the others' figures
                    runs[opt_name][name] = {"error": f"{type(e).__name__}: {e}"}
                    continue
                if best is None:
                    runs[opt_name][name] = run
                else:
                    for k in ("step", "backward", "optimizer", "optimizer host"):
                        best[k] = min(best[k], run[k])
    ratios = {o: r["ZeRO-3"]["step"] / r["FSDP2"]["step"] for o, r in runs.items()
              if "step" in r.get("ZeRO-3", {}) and "step" in r.get("FSDP2", {})}
    return {"runs": runs, "ZeRO-3 / FSDP2": ratios, "tokens_per_rank": batch * seq}


def _timed_run(build, kwargs, tokens, steps: int, warmup: int, traffic: bool) -> dict:
    """One wrapper with one AdamW: seconds per step over ``steps`` back-to-back steps,
    the best of 3 of its backward and its optimizer step timed apart (and the host's time
    to issue the step), and with ``traffic`` the calls and bytes of each collective of
    one step."""
    from distlab.comm import CommLog

    net, opt = build(kwargs)
    for _ in range(warmup):
        _train_step(net, opt, tokens)
    sync(backend.device())
    start = time.perf_counter()
    for _ in range(steps):
        _train_step(net, opt, tokens)
    sync(backend.device())
    run = {"step": (time.perf_counter() - start) / steps}
    phases = {"backward": [], "optimizer": [], "optimizer host": []}
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        sync(backend.device())
        phases["backward"].append(_synced_backward(net, tokens))
        middle = time.perf_counter()
        opt.step()
        issued = time.perf_counter()
        sync(backend.device())
        phases["optimizer"].append(time.perf_counter() - middle)
        phases["optimizer host"].append(issued - middle)
    run.update({k: min(v) for k, v in phases.items()})
    if traffic:
        with CommLog() as log:
            _train_step(net, opt, tokens)
        sync(backend.device())
        run["traffic"] = {op: [log.count(op), log.nbytes(op)] for op in TRAFFIC if log.count(op)}
    return run


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
        lines += _memory_table(mem)
    elif mem and mem[0]:
        lines.append(f"memory: {mem[0]}")
    speed = results[0].get("speed", {})
    if "runs" in speed:
        lines += _speed_table(speed)
    elif speed:
        lines.append(f"speed: {speed}")
    return "\n".join(lines)


def goal_misses(results: list[dict]) -> list[str]:
    """Goals missed and sections failed, in words; on CPUs (the smoke test) only failures."""
    gpu, speed = results[0].get("device", "CPU") != "CPU", results[0].get("speed", {})
    kernel, memory, zero3 = (GOALS[k] for k in ("kernel / fused AdamW", "memory error",
                                                 "ZeRO-3 / FSDP2"))
    out = [f"rank {i} {n}: {r[n]['error']}" for i, r in enumerate(results)
           for n in ("kernel", "memory", "speed") if "error" in r.get(n, {})] + [
        f"speed, AdamW {o}, {n}: {x['error']}" for o, runs in speed.get("runs", {}).items()
        for n, x in runs.items() if "error" in x]
    for i, r in enumerate(results if gpu else ()):
        k, m = r.get("kernel", {}).get("kernel / fused AdamW"), r.get("memory", {})
        out += [f"rank {i} kernel / fused AdamW {k or 0:.3f} > {kernel}"] * ((k or 0) > kernel)
        out += [f"rank {i} {s} {n} {x:+.4g}" for s in STRATEGIES if s in m for n, x in m[s].items()
                if n.endswith("error") and abs(x or 0) > memory or n == "left behind" and x > 0]
    return out + [f"ZeRO-3 / FSDP2 with AdamW {o} {x:.3f} > {zero3}" for o, x in
                  speed.get("ZeRO-3 / FSDP2", {}).items() if gpu and x > zero3]


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def _memory_table(mem: list[dict]) -> list[str]:
    big = mem[0][STRATEGIES[0]]["accounting"]["total"] > 1e7
    mb, unit = (1e6, "MB") if big else (1e3, "kB")
    lines = [
        f"memory per rank, {unit} (activations measured apart: {mem[0]['activations'] / mb:.1f}; "
        f"every figure above the baseline the rank held before building the strategy)",
        "  states: bytes in use at the end of backward vs distlab.zero.memory.accounting; step: the "
        "optimizer step's",
        "  buffers vs distlab.zero.memory.step_buffers; bwd buf: what the forward/backward peak held "
        "besides activations;",
        "  peak vs states + max(activations, step buffers), error relative to the states; left: "
        "after deleting it",
        f"{'strategy':<14}{'rank':>5}{'baseline':>9}{'states':>8}{'acct.':>8}{'error':>7}"
        f"{'step':>8}{'acct.':>8}{'error':>7}{'bwd buf':>8}{'peak':>8}{'acct.':>8}{'error':>7}"
        f"{'left':>6}{'ms/step':>8}"]
    for strategy in STRATEGIES:
        for rank, m in enumerate(mem):
            s = m[strategy]
            lines.append(
                f"{strategy:<14}{rank:>5}{s['baseline'] / mb:>9.1f}{s['states'] / mb:>8.1f}"
                f"{s['accounting']['total'] / mb:>8.1f}{_pct(s['states error']):>7}"
                f"{s['step buffers'] / mb:>8.1f}{s['step buffers accounted'] / mb:>8.1f}"
                f"{_pct(s['step buffers error']):>7}{s['backward buffers'] / mb:>8.1f}"
                f"{s['peak'] / mb:>8.1f}{s['peak accounted'] / mb:>8.1f}"
                f"{_pct(s['memory error']):>7}{s['left behind'] / mb:>6.1f}"
                f"{1e3 * (s['backward_seconds'] + s['step_seconds']):>8.1f}")
    lines.append(f"goals: |error| <= {100 * GOALS['memory error']:.0f}% in each column, "
                 f"nothing left behind")
    return lines


def _speed_table(speed: dict) -> list[str]:
    lines = [f"speed, {speed['tokens_per_rank']} tokens per rank, ms per step (backward and "
             f"optimizer step also timed apart, synchronised; host: issuing the optimizer step)",
             f"{'AdamW':<9}{'':<8}{'step':>8}{'fwd+bwd':>9}{'optimizer':>11}{'host':>7}"
             f"   per step and rank: calls x bytes"]
    for opt_name, runs in speed["runs"].items():
        for name, r in runs.items():
            if "error" in r:
                lines.append(f"{opt_name:<9}{name:<8}{r['error']}")
                continue
            moved = ", ".join(f"{op} {n} x {decimal_bytes(b)}"
                              for op, (n, b) in r.get("traffic", {}).items())
            lines.append(f"{opt_name:<9}{name:<8}{1e3 * r['step']:>8.1f}"
                         f"{1e3 * r['backward']:>9.1f}{1e3 * r['optimizer']:>11.1f}"
                         f"{1e3 * r['optimizer host']:>7.1f}   {moved}")
    lines.append("ZeRO-3 / FSDP2 step time: " + ", ".join(
        f"AdamW {o} {r:.3f}" for o, r in speed["ZeRO-3 / FSDP2"].items())
        + f" (goal <= {GOALS['ZeRO-3 / FSDP2']})")
    return lines


def main(argv=None) -> int:
    from distlab import backend, launch
    from distlab.model import PRESETS, config

    p = argparse.ArgumentParser(prog="python -m distlab.bench.zero",
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
    print("\n".join(f"goal missed: {m}" for m in goal_misses(results)) or "every goal met")
    return 1 if goal_misses(results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
