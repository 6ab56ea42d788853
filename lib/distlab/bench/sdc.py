"""What lab 12's silent-data-corruption check costs on one GPU: the kit's GPT, a training
step with and without the replay (:mod:`distlab.resilience.sdc`: the gradient computed
a second time from the same weights and batch, the two SHA-256 hashes compared), and
with the replay on one step in ``k`` (its cost divided by ``k``).

    python -m distlab.bench.sdc --out DIR              # one GPU
    python -m distlab.bench.sdc --quick --out DIR      # the same code, tiny, on a CPU

Deterministic kernels are asked for (``torch.use_deterministic_algorithms``, cuBLAS's
``CUBLAS_WORKSPACE_CONFIG``), without which a replay need not give the same bits. Each
configuration first checks the check: a replay of a clean step agrees, and one bit
flipped in the first computation's gradient is found. Writes ``sdc_bench.json`` to
``--out``: per configuration, the seconds of a plain step, of a checked one, and of the
hashing alone (:func:`distlab.bench.timing.per_call`).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from distlab.bench.timing import per_call
from distlab.data import NGramLanguage
from distlab.model import GPT, config
from distlab.resilience import sdc

GPTS = {"gpt-100m": dict(batch=8)}                 # one GPU
QUICK = {"test": dict(batch=2)}                    # a CPU: the code path, not the speed
VOCAB = 64                                         # NGramLanguage: at most 8192 contexts


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def measure(preset: str, batch: int, device: torch.device, calls: int) -> dict:
    """One configuration: whether the replay finds a flipped bit and agrees on a clean
    step, and the seconds of a plain step, a checked one and the hashing."""
    torch.manual_seed(0)
    cfg = config(preset, VOCAB)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = tuple(t.to(device) for t in NGramLanguage(vocab_size=VOCAB).batch(0, batch, cfg.seq_len))
    first = sdc.gradients(model, loss_fn, data)
    clean = sdc.digest(first) == sdc.digest(sdc.gradients(model, loss_fn, data))
    sdc.flip_bit(first[0], 0, 20)
    found = sdc.digest(first) != sdc.digest(sdc.gradients(model, loss_fn, data))

    def step(replay):
        grads = sdc.gradients(model, loss_fn, data)
        if replay and sdc.digest(grads) != sdc.digest(sdc.gradients(model, loss_fn, data)):
            raise RuntimeError("a replay of a clean step gave other bits")
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        optimizer.step()

    step(True)                                                # warm up both paths
    plain = per_call(lambda: step(False), calls, device)
    checked = per_call(lambda: step(True), calls, device)
    hashing = per_call(lambda: sdc.digest(first), calls, device)
    return {"preset": preset, "batch": batch, "params": sum(p.numel() for p in model.parameters()),
            "clean_replay_equal": clean, "flip_found": found, "plain_s": plain,
            "checked_s": checked, "hash_s": hashing, "ratio": checked / plain}


def goal_misses(rows: list[dict]) -> list[str]:
    """Each configuration whose check failed: a flipped bit not found, or a replay of a
    clean step that gave other bits (the kernels not deterministic). The cost is
    reported, not judged: what it may be depends on the model and the checking interval."""
    return [f"{r['preset']}: " + ("a flipped bit went unnoticed" if not r["flip_found"] else
                                  "a replay of a clean step gave other bits")
            for r in rows if not (r["flip_found"] and r["clean_replay_equal"])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlab.bench.sdc",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for sdc_bench.json")
    p.add_argument("--quick", action="store_true", help="tiny, on a CPU (the default without a GPU)")
    p.add_argument("--calls", type=int, default=10, help="timed steps per configuration")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.quick
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda" if gpu else "cpu")
    rows = [measure(preset, c["batch"], device, args.calls if gpu else 2)
            for preset, c in (GPTS if gpu else QUICK).items()]
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sdc_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['preset']} ({r['params']:,} parameters, batch {r['batch']}): plain "
              f"{r['plain_s'] * 1e3:.2f} ms, checked {r['checked_s'] * 1e3:.2f} ms "
              f"({r['ratio']:.2f}x), hashing {r['hash_s'] * 1e3:.2f} ms; flip found "
              f"{r['flip_found']}, clean replay equal {r['clean_replay_equal']}")
    return 1 if goal_misses(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
