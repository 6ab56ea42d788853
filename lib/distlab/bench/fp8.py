"""FP8 training against BF16 on one GPU, with torchao's float8 training as the production
version (``torchao.float8.convert_to_float8_training``, the ``tensorwise`` recipe: e4m3
inputs and weights, e5m2 output gradients, one dynamic scale per tensor; casts fused by
``torch.compile``).

    python -m distlab.bench.fp8 --out DIR                       # one GPU: the acceptance check
    python -m distlab.bench.fp8 --quick --out DIR               # the same code, tiny, on a CPU

Sections (``--sections``):

* **linear**: a linear layer's forward and backward (``y = x·Wᵀ``, then ``y.backward(dy)``),
  BF16 eager (three cuBLAS matmuls: compiling adds nothing to them) against torchao's
  Float8Linear compiled, casts included, on (tokens, in, out) shapes from small to large
  (:data:`SHAPES`), timed as nccl-tests times a collective
  (:func:`distlab.bench.timing.time_op`). The crossover is the smallest shape (in FLOPs)
  from which FP8 is faster on every larger one.
* **gpt**: the kit's GPT, a compiled training step (BF16 autocast, float32 master
  weights, fused AdamW) with and without the conversion of its block linears (the tied
  head stays BF16, as torchao and torchtitan advise for the last layer), at the 98M
  preset and a 1.25B configuration (:data:`GPTS`). Both precisions start from the same
  weights and train on the same batches of the synthetic language
  (:class:`distlab.data.NGramLanguage`); tokens/s over the steps after ``--warmup``; MFU
  from ``6N + 12LdT`` over the BF16 peak (:func:`distlab.bench.throughput.peak_flops`);
  the final loss of each is the mean of its last :data:`TAIL` steps.

Without a GPU (``--quick``, or no CUDA) the same code runs with torchao's ``emulate=True``
(the FP8 matmuls emulated in float32) on tiny shapes, without compiling: it checks the
code path, not the speed. Writes ``fp8_bench.json`` to ``--out``; :func:`goal_misses`
judges it against :data:`GOALS` (the acceptance check ``fp8``), and
:func:`distlab.viz.fp8.plot_fp8` draws it.

torchao must match torch: :data:`TORCHAO` is the release built for torch 2.11 (torchao's
compatibility table: 0.17.0 for torch 2.11.0, ABI-stable from there on);
``tools/fp8-wheels.sh`` carries its wheel to a GPU machine without internet.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

TORCHAO = "0.17.0"
# (tokens, in, out): torchao's float8 README's small and large shapes, the 98M GPT's MLP
# at two batch sizes, a square middle one
SHAPES = [(1024, 2048, 1024), (4096, 768, 3072), (16384, 768, 3072), (8192, 2048, 8192),
          (4096, 8192, 16384)]
QUICK_SHAPES = [(32, 64, 32), (64, 128, 64)]
# name -> (GPT fields, batch size, steps); seq_len is the sequence trained on; the 98M
# preset's vocabulary (98M parameters with it) for both
GPTS = {
    "98M": (dict(vocab_size=16384, seq_len=1024, n_layer=12, n_head=12, d_model=768), 16, 40),
    "1.25B": (dict(vocab_size=16384, seq_len=2048, n_layer=24, n_head=16, d_model=2048), 4, 200),
}
QUICK_GPTS = {"tiny": (dict(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=64), 2, 12)}
# the synthetic language trained on (its tokens are ids of the GPT's vocabulary)
LANGUAGE = dict(vocab_size=2048, order=2, concentration=0.2, seed=0)
QUICK_LANGUAGE = dict(vocab_size=32, order=2, concentration=0.2, seed=0)
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
WARMUP_LR = 20         # steps of linear learning-rate warm-up
TAIL = 20              # the final loss: the mean of the last TAIL steps
GOALS = {"linear speedup": 1.4, "gpt speedup": 1.2, "final loss gap": 0.01, "bf16 mfu": 0.60}
BIG = "1.25B"          # the GPT the goals judge


def float8_config(emulate: bool):
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    return Float8LinearConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                                 "emulate": emulate})


def to_float8(module: nn.Module, emulate: bool) -> nn.Module:
    """``module`` with its linears (both dimensions multiples of 16, not the head)
    swapped for torchao's Float8Linear."""
    from torchao.float8 import convert_to_float8_training

    def eligible(mod, fqn):
        return fqn != "head" and (not isinstance(mod, nn.Linear) or (
            mod.in_features % 16 == 0 and mod.out_features % 16 == 0))

    return convert_to_float8_training(module, module_filter_fn=eligible,
                                      config=float8_config(emulate))


# --------------------------------------------------------------------- measuring


def linear_rows(shapes, emulate: bool, compile: bool, iters: int) -> list[dict]:
    """One row per shape: BF16 and FP8 ms for forward + backward, and their ratio."""
    from distlab import backend
    from distlab.bench.timing import time_op

    device = backend.device()
    rows = []
    for m, k, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        plain = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        fast = to_float8(nn.Sequential(nn.Linear(k, n, bias=False, device=device,
                                                 dtype=torch.bfloat16)), emulate)
        fast[0].weight.data.copy_(plain.weight.data)
        torch._dynamo.reset()
        fast = torch.compile(fast) if compile else fast
        ms = {}
        for name, layer in (("bf16", plain), ("fp8", fast)):
            def step(layer=layer):
                x.grad = None
                layer(x).backward(dy)
            ms[name] = 1e3 * time_op(step, warmup=3, iters=iters)
        rows.append({"shape": [m, k, n], "bf16_ms": ms["bf16"], "fp8_ms": ms["fp8"],
                     "speedup": ms["bf16"] / ms["fp8"], "gflop": 6 * m * k * n / 1e9})
    return rows


def crossover(rows: list[dict]) -> list | None:
    """The smallest shape (in FLOPs) from which FP8 is faster on it and every larger one."""
    found = None
    for row in sorted(rows, key=lambda r: r["gflop"], reverse=True):
        if row["speedup"] < 1.0:
            break
        found = row["shape"]
    return found


def gpt_run(fields: dict, data: list, precision: str, emulate: bool, compile: bool,
            warmup: int) -> dict:
    """Train the GPT on ``data`` (one batch per step) in ``precision`` ("bf16", "fp8"):
    every step's loss, and tokens/s and BF16 MFU over the steps after ``warmup``."""
    from distlab import backend
    from distlab.bench.throughput import peak_flops
    from distlab.bench.timing import sync
    from distlab.model import GPT, GPTConfig

    device = backend.device()
    cfg = GPTConfig(**fields)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    params, flops = model.num_params(), model.flops_per_token(cfg.seq_len)
    if precision == "fp8":
        model = to_float8(model, emulate)
    run = torch.compile(model) if compile else model
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP_LR))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    losses = []
    data = [b.to(device, non_blocking=True) for b in data]
    start = None
    for step, tokens in enumerate(data):
        if step == warmup:
            sync(device)
            start = time.perf_counter()
        with autocast:
            logits = run(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync(device)
    seconds = (time.perf_counter() - start) / (len(data) - warmup)
    tokens_per_s = data[0].shape[0] * cfg.seq_len / seconds
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_flops(name, "bf16")
    losses = torch.stack(losses).float().tolist()
    return {"params": params, "step_ms": 1e3 * seconds, "tokens_per_s": tokens_per_s,
            "mfu": None if peak is None else flops * tokens_per_s / peak, "losses": losses,
            "final_loss": sum(losses[-TAIL:]) / len(losses[-TAIL:])}


def gpt_rows(gpts: dict, language: dict, emulate: bool, compile: bool,
             warmup: int) -> list[dict]:
    """Per GPT of ``gpts``: both precisions on the same batches of ``language``."""
    from distlab.data import NGramLanguage

    language = NGramLanguage(**language)
    rows = []
    for name, (fields, batch, steps) in gpts.items():
        data = [language.global_batch(step, batch, fields["seq_len"]) for step in range(steps)]
        runs = {}
        for precision in ("bf16", "fp8"):
            torch._dynamo.reset()
            runs[precision] = gpt_run(fields, data, precision, emulate, compile, warmup)
        bf16, fp8 = runs["bf16"], runs["fp8"]
        rows.append({"config": name, **fields, "batch": batch, "steps": steps,
                     "params": bf16["params"], "bf16": bf16, "fp8": fp8,
                     "speedup": fp8["tokens_per_s"] / bf16["tokens_per_s"],
                     "final_loss_gap": abs(fp8["final_loss"] - bf16["final_loss"])
                     / bf16["final_loss"],
                     "loss_floor": language.loss_floor(fields["seq_len"])})
    return rows


def measure(sections, quick: bool, emulate: bool, compile: bool, iters: int,
            warmup: int) -> dict:
    """Inside a launched rank (its device is the GPU under NCCL): every section."""
    import torchao

    result = {"meta": {"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                       else "CPU", "torch": torch.__version__, "torchao": torchao.__version__,
                       "emulate": emulate, "compile": compile, "quick": quick,
                       "recipe": "tensorwise"}}
    if "linear" in sections:
        result["linear"] = linear_rows(QUICK_SHAPES if quick else SHAPES, emulate, compile, iters)
        result["crossover"] = crossover(result["linear"])
    if "gpt" in sections:
        result["gpt"] = gpt_rows(QUICK_GPTS if quick else GPTS,
                                 QUICK_LANGUAGE if quick else LANGUAGE, emulate, compile, warmup)
    return result


# --------------------------------------------------------------------- judging


def goal_misses(result: dict) -> list[str]:
    """The goals of the acceptance check ``fp8`` this result misses, in words."""
    misses = []
    linear = result.get("linear") or []
    if linear:
        top = max(linear, key=lambda r: r["gflop"])
        if top["speedup"] < GOALS["linear speedup"]:
            misses.append(f"linear {tuple(top['shape'])}: FP8 {top['speedup']:.2f}x BF16, below "
                          f"{GOALS['linear speedup']}x")
    else:
        misses.append("no linear shape was measured")
    rows = {r["config"]: r for r in result.get("gpt") or []}
    big = rows.get(BIG)
    if big is None:
        misses.append(f"the {BIG} GPT was not measured")
        return misses
    if big["speedup"] < GOALS["gpt speedup"]:
        misses.append(f"{BIG} GPT step: FP8 {big['speedup']:.2f}x BF16's tokens/s, below "
                      f"{GOALS['gpt speedup']}x")
    if not big["final_loss_gap"] <= GOALS["final loss gap"]:
        misses.append(f"{BIG} GPT: final losses {big['fp8']['final_loss']:.4f} (FP8) and "
                      f"{big['bf16']['final_loss']:.4f} (BF16) differ by "
                      f"{big['final_loss_gap']:.2%}, above {GOALS['final loss gap']:.0%}")
    mfu = big["bf16"]["mfu"]
    if mfu is None or mfu < GOALS["bf16 mfu"]:
        misses.append(f"{BIG} GPT: BF16 MFU {'unknown' if mfu is None else f'{mfu:.1%}'}, "
                      f"below {GOALS['bf16 mfu']:.0%}")
    return misses


def table(result: dict) -> dict:
    """The rows the acceptance check shows: one per linear shape, one per GPT."""
    rows = [[f"linear {tuple(r['shape'])}", r["bf16_ms"], r["fp8_ms"], r["speedup"],
             "crossover" if r["shape"] == result.get("crossover") else ""]
            for r in result.get("linear") or []]
    for r in result.get("gpt") or []:
        mfu = r["bf16"]["mfu"]
        rows.append([f"GPT {r['config']} ({r['batch']} x {r['seq_len']} tokens), tokens/s",
                     r["bf16"]["tokens_per_s"], r["fp8"]["tokens_per_s"], r["speedup"],
                     f"BF16 MFU {'-' if mfu is None else f'{mfu:.1%}'}; final loss "
                     f"{r['bf16']['final_loss']:.3f} / {r['fp8']['final_loss']:.3f} "
                     f"(gap {r['final_loss_gap']:.2%}, floor {r['loss_floor']:.3f})"])
    return {"columns": ["case", "BF16 (ms or tokens/s)", "FP8 (ms or tokens/s)",
                        "FP8 speedup", "note"], "rows": rows}


# --------------------------------------------------------------------- command line


def main(argv=None) -> int:
    from distlab import launch

    p = argparse.ArgumentParser(prog="python -m distlab.bench.fp8", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for fp8_bench.json")
    p.add_argument("--sections", default="linear,gpt", help="comma-separated: linear, gpt")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and GPT, few steps (the default without a GPU)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per linear shape")
    p.add_argument("--warmup", type=int, default=10,
                   help="GPT steps before the timing starts (compilation happens there)")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"linear", "gpt"}
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from linear, gpt")
    gpu = torch.cuda.is_available()
    quick = args.quick or not gpu
    warmup = min(args.warmup, 2) if quick else args.warmup
    try:
        import torchao  # noqa: F401
    except ImportError:
        print(f"torchao is not installed: pip install torchao=={TORCHAO} (the release built for "
              f"torch 2.11; on a machine without internet, the wheel of tools/fp8-wheels.sh)")
        return 2
    result = launch.run(measure, 1, sections, quick, not gpu, gpu, args.iters, warmup,
                        backend="nccl" if gpu else "gloo", timeout=1500)[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    for row in table(result)["rows"]:
        print("  ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in row))
    if "crossover" in result:
        print(f"crossover: FP8 faster from {result['crossover']} on" if result["crossover"]
              else "crossover: FP8 is not faster at the largest shape")
    misses = goal_misses(result) if gpu and not quick else []
    for miss in misses:
        print(f"missed: {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
