"""``python -m distlab.train``: :func:`distlab.train.train` on every rank of a launch."""
from __future__ import annotations

import argparse

import torch.distributed as dist

from distlab.train.precision import PRECISIONS
from distlab.train.compose import train


def main(argv=None) -> int:
    from distlab import backend, launch
    from distlab.model import PRESETS

    ap = argparse.ArgumentParser(prog="python -m distlab.train",
                                 description="train a GPT on a dp × pp × tp mesh")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default="test", choices=sorted(PRESETS))
    ap.add_argument("--vocab-size", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8, help="the global batch, in sequences")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    ap.add_argument("--microbatches", type=int, default=None, help="default: pp")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bucket-mb", type=float, default=25, help="ZeRO-2 bucket size, MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overlap", default=True, action=argparse.BooleanOptionalAction,
                    help="issue each bucket's reduce-scatter from backward (default), or after it")
    ap.add_argument("--backend", default="auto", choices=backend.BACKENDS)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    world = args.dp * args.tp * args.pp
    results = launch.run(train, world, args.model, args.dp, args.tp, args.pp, args.steps,
                         args.batch_size, args.seq_len, args.vocab_size, args.precision,
                         args.microbatches, args.lr, args.bucket_mb, args.seed, True,
                         args.overlap, backend=args.backend, timeout=args.timeout, stream=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        last = results[0][-1] if results[0] else None
        if last is not None:
            print(f"done: {args.steps} steps on {world} rank(s), final loss {last['loss']:.4f}")
    if dist.is_initialized():  # under torchrun: leave the group together, before teardown
        dist.barrier()         # (a rank that exits first breaks the others' gloo pairs)
        dist.destroy_process_group()
    return 0
