"""Building and running the composed trainer: :func:`build` makes this rank's
:class:`~distlab.train.trainer.Trainer` on a :class:`distlab.mesh.Mesh`, :func:`train`
runs it on :class:`distlab.data.NGramLanguage` (``python -m distlab.train``)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distlab import backend, launch
from distlab import pp as pipeline
from distlab.backend import peak_flops
from distlab.data import NGramLanguage
from distlab.mesh import Mesh
from distlab.model import GPT, GPTConfig, config
from distlab.tp import tensor_parallel
from distlab.train.overlap import OverlappedTrainer
from distlab.train.precision import PRECISIONS
from distlab.train.trainer import Trainer
from distlab.zero import DynamicLossScaler


def build(cfg: GPTConfig, mesh, *, precision: str = "fp32", microbatches: int | None = None,
          bucket_cap_mb: float = 25, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, seed: int = 0, loss_scaler: DynamicLossScaler | None = None,
          device=None, overlap: bool = True) -> Trainer:
    """This rank's part of ``GPT(cfg)`` on ``mesh``, ready to train: TP over
    ``mesh.tp_group``, stage ``mesh.coords[1]`` of ``mesh.pp``, ZeRO-2 over
    ``mesh.dp_group`` (:mod:`distlab.train.trainer`). Every rank builds the same GPT from
    ``seed`` first, as the single-process run does. ``microbatches``: per step, through
    the pipeline (default: ``pp``). ``loss_scaler``: for fp16 (a default one is made).
    ``overlap``: each bucket's reduce-scatter issued from backward
    (:class:`~distlab.train.overlap.OverlappedTrainer`), else after it."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if cfg.n_head % mesh.tp:
        fits = [k for k in range(1, cfg.n_head + 1) if cfg.n_head % k == 0]
        raise ValueError(f"tp = {mesh.tp} does not divide the model's {cfg.n_head} attention "
                         f"heads (tensor parallelism gives each rank whole heads): use tp in "
                         f"{fits}, or a model whose n_head is a multiple of {mesh.tp}")
    if mesh.pp > cfg.n_layer:
        raise ValueError(f"pp = {mesh.pp} pipeline stages for a model of {cfg.n_layer} blocks: "
                         f"use pp <= {cfg.n_layer}, or a model with more layers (n_layer)")
    microbatches = mesh.pp if microbatches is None else microbatches
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    device = backend.device() if device is None else torch.device(device)
    dtype, _ = PRECISIONS[precision]

    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    if PRECISIONS[precision][1] is None:    # full precision: fp64 masters for an fp64 model
        model.to(dtype)                     # (mixed: fp32 init, the masters start from it)
    if mesh.tp > 1:
        tensor_parallel(model, mesh.tp_group)
    stage = pipeline.Stage(model, mesh.coords[1], mesh.pp)
    kind = OverlappedTrainer if overlap else Trainer
    return kind(stage, mesh, precision=precision, microbatches=microbatches,
                bucket_cap_mb=bucket_cap_mb, adamw=dict(lr=lr, betas=betas, eps=eps,
                                                        weight_decay=weight_decay),
                loss_scaler=loss_scaler, device=device, compute_dtype=dtype)



def train(model: str = "test", dp: int = 1, tp: int = 1, pp: int = 1, steps: int = 10,
          batch_size: int = 8, seq_len: int | None = None, vocab_size: int = 16,
          precision: str = "fp32", microbatches: int | None = None, lr: float = 1e-3,
          bucket_cap_mb: float = 25, seed: int = 0, log: bool = True,
          overlap: bool = True) -> list[dict]:
    """Train ``model`` (a :data:`distlab.model.PRESETS` name) on
    :class:`distlab.data.NGramLanguage` for ``steps`` steps on this rank's place in a
    ``dp × pp × tp`` mesh; run it on every rank (:func:`distlab.launch.run`, torchrun).
    ``batch_size`` is the global batch. Returns, per step, the loss, tokens/s and MFU
    (None where :func:`distlab.bench.throughput.peak_flops` knows no peak: CPUs, fp32);
    rank 0 prints them and drives a progress bar."""
    cfg = config(model, vocab_size)
    seq_len = cfg.seq_len if seq_len is None else seq_len
    mesh = Mesh(dp=dp, pp=pp, tp=tp)
    trainer = build(cfg, mesh, precision=precision, microbatches=microbatches, lr=lr,
                    bucket_cap_mb=bucket_cap_mb, seed=seed, overlap=overlap)
    lang = NGramLanguage(vocab_size, 3, seed=seed)
    with torch.device("meta"):
        flops_per_token = GPT(cfg).flops_per_token(seq_len)
    device = trainer.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_flops(name, precision)
    world = dist.get_world_size()
    if log and dist.get_rank() == 0:
        print(f"{mesh}\n{model}: {sum(q.numel() for q in GPT(cfg).parameters()):,} "
              f"parameters, {precision}, {trainer.microbatches} micro-batches, "
              f"{len(trainer.buckets)} ZeRO-2 buckets on this rank; loss floor "
              f"{lang.loss_floor(seq_len):.3f}", flush=True)
    history = []
    for step in launch.progress(range(steps), steps, desc="train"):
        batch = trainer.local_batch(lang, step, batch_size, seq_len)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = trainer.step(batch, global_batch_size=batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        tokens = batch_size * seq_len / seconds
        mfu = None if peak is None else flops_per_token * tokens / (peak * world)
        history.append(dict(step=step, loss=loss, tokens_per_s=tokens, mfu=mfu,
                            seconds=seconds, skipped=trainer.skipped))
        if log and dist.get_rank() == 0:
            print(f"step {step:4d}  loss {loss:.4f}  {tokens:,.0f} tokens/s  MFU "
                  f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}", flush=True)
    return history
