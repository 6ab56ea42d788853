"""Tokens per second and model FLOPs utilisation (MFU) of the GPT on this machine.

    python -m distlab.bench.throughput --model gpt-100m --dtype bf16 --batch-size 16 \\
        --seq-len 1024 --world-size 1 --backend nccl

Each rank trains :class:`distlab.model.GPT` wrapped in :class:`distlab.dp.DataParallel`
(or the wrapper :func:`measure` is given; forward, backward, gradient all-reduce, AdamW
step) on random tokens and times the steps after a warm-up. MFU (Chowdhery et al. 2022, PaLM, appendix B) is the model
FLOPs the step performs, ``flops_per_token × tokens/s`` (``6N + 12 L d T``, see
:meth:`distlab.model.GPT.flops_per_token`), over the device's peak dense throughput
for the dtype; recomputation and padding do not count as model FLOPs.

Peak figures (:func:`distlab.backend.peak_flops`) are dense (no 2:4 sparsity)
tensor-core throughput from the vendors' datasheets. MFU is reported only where the
table knows the device and dtype (not on CPUs).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from distlab.backend import peak_flops
from distlab.bench.timing import per_call
from distlab.dp import DataParallel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass
class Throughput:
    """One rank's measurement."""

    device: str
    dtype: str
    params: int
    flops_per_token: int
    tokens_per_step: int
    step_seconds: float
    peak_flops: float | None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def model_flops(self) -> float:
        """Model FLOP/s achieved."""
        return self.flops_per_token * self.tokens_per_second

    @property
    def mfu(self) -> float | None:
        return None if self.peak_flops is None else self.model_flops / self.peak_flops

    def __str__(self) -> str:
        mfu = "n/a (no peak figure for this device/dtype)" if self.mfu is None else \
            f"{100 * self.mfu:.1f}% of {self.peak_flops / 1e12:.0f} TFLOP/s"
        return (f"{self.device}, {self.dtype}, {self.params / 1e6:.1f}M params: "
                f"{self.tokens_per_second:,.0f} tokens/s, {self.step_seconds * 1e3:.1f} ms/step, "
                f"{self.model_flops / 1e12:.2f} TFLOP/s, MFU {mfu}")


def measure(cfg, batch_size: int, seq_len: int | None = None, dtype: str = "bf16",
            steps: int = 10, warmup: int = 3, compile: bool = False, *,
            wrap=DataParallel) -> Throughput:
    """Time ``steps`` training steps of ``GPT(cfg)`` on this rank's device.

    Runs inside a launched function (the model is wrapped in ``wrap(model)`` over the
    running group: any wrapper with ``finish_gradient_synchronization()``, lab 08's
    bucketed one by default) or in a plain process (a group of one is not needed: no
    wrapping)."""
    import torch.distributed as dist

    from distlab import backend
    from distlab.model import GPT

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    seq_len = cfg.seq_len if seq_len is None else seq_len
    device = backend.device() if dist.is_initialized() else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    params, flops = model.num_params(), model.flops_per_token(seq_len)
    ddp = wrap(model) if dist.is_initialized() else None
    run = torch.compile(model) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    autocast = contextlib.nullcontext() if dtype == "fp32" else torch.autocast(
        device.type, dtype=DTYPES[dtype])
    x = torch.randint(cfg.vocab_size, (batch_size, seq_len + 1), device=device)

    def step():
        with autocast:
            logits = run(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        if ddp is not None:
            ddp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    seconds = per_call(step, steps, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return Throughput(name, dtype, params, flops, batch_size * seq_len, seconds,
                      peak_flops(name, dtype))


def main(argv=None) -> int:
    from distlab import backend, launch
    from distlab.model import PRESETS, config

    p = argparse.ArgumentParser(prog="python -m distlab.bench.throughput", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-100m", choices=sorted(PRESETS))
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's seq_len")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                   help="autocast compute dtype (weights and AdamW state stay fp32)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--backend", default="auto", choices=backend.BACKENDS)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = p.parse_args(argv)
    cfg = config(args.model, args.vocab_size)
    print(backend.explain(args.world_size, args.backend))
    results = launch.run(measure, args.world_size, cfg, args.batch_size, args.seq_len,
                         args.dtype, args.steps, args.warmup, args.compile,
                         backend=args.backend, timeout=600)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
    total = sum(r.tokens_per_second for r in results)
    print(f"all {args.world_size} rank(s): {total:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
