"""Lab 09's answer ``distributed_train_step``, grown into a trainer: ZeRO-2 with overlap
and mixed precision on a data × pipeline × tensor-parallel rank grid
(:class:`distlab.mesh.Mesh`). Used through :mod:`distlab.train`, whose documentation
says what it does; this module says how.

Composition (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", the 3D layout; Rajbhandari et al. 2020, "ZeRO"):

* **TP**: the GPT is made tensor-parallel over ``mesh.tp_group``
  (:func:`distlab.tp.tensor_parallel`, Megatron's column/row split);
* **PP**: it is then cut into ``pp`` stages (:class:`distlab.pp.Stage`, stage index
  ``mesh.coords[1]``) run by a 1F1B :class:`distlab.pp.PipelineRunner` over
  ``mesh.pp_group`` (its :class:`~distlab.pp.p2p.StageLink` turns stage indices into the
  global ranks of the neighbouring stages, so a pp group of any ranks works);
* **ZeRO-2 over DP**: the stage's trainable parameters are cut into buckets
  (:func:`distlab.dp.plan_buckets`, reverse order, as backward produces them); each
  bucket is one :class:`distlab.zero.FlatParams` over ``mesh.dp_group``: the compute-dtype
  parameters view its flat buffer, and this rank keeps only its ``tensor_split`` shard
  of the fp32 master weights and of AdamW's moments. A bucket's gradients are
  reduce-scattered (:func:`distlab.zero.flat.reduce_scatter_mean`, asynchronous) from a
  post-accumulate-grad hook as soon as its last gradient of the last micro-batch is
  accumulated, while backward computes the earlier layers; the full gradients are then
  dropped (stage 2). After backward, AdamW (:func:`distlab.zero.adamw_`, the same
  arithmetic as ``torch.optim.AdamW``) updates each master shard, and the shards are
  all-gathered back into the parameters (:meth:`FlatParams.gather`).
* **Mixed precision** (Micikevicius et al. 2018): ``precision="bf16"`` keeps the
  parameters and gradients in bf16 under ``torch.autocast`` with fp32 masters;
  ``"fp16"`` the same with a :class:`distlab.zero.DynamicLossScaler` (the sharded
  gradients unscaled before the step, the step skipped on every rank on overflow);
  ``"fp32"`` and ``"fp64"`` compute in full precision (the tests' reference mode).

One exception to the overlap: a weight tied between the first and the last stage
(the embedding and the head, pp > 1) gets its gradient summed between the two stages
by the runner *after* the pipeline's backward, so its bucket is reduce-scattered then.

Why not the library's wrappers: :class:`distlab.zero.ShardedOptimizer` reduce-scatters
inside ``step()``, after backward; :class:`distlab.zero.FullyShardedDataParallel` with
``shard_parameters=False`` reduce-scatters from hooks, but once per backward (per
micro-batch: m times the traffic under a pipeline), expects each forward to be followed
by its backward (1F1B runs several forwards first), and takes its units from
``nn.ModuleList`` children (a :class:`~distlab.pp.Stage` keeps its blocks in an
``nn.ModuleDict``). The hook path here counts each parameter's accumulations up to
the number of micro-batches instead.

"""
from __future__ import annotations

import contextlib
import functools
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import pp as pipeline
from distlab.dp import plan_buckets, shard_loss_weight
from distlab.mesh import Mesh
from distlab.model import GPT, GPTConfig
from distlab.train.precision import PRECISIONS
from distlab.zero import DynamicLossScaler, FlatParams, adamw_
from distlab.zero.flat import reduce_scatter_mean


def build(cfg: GPTConfig, mesh, *, precision: str = "fp32", microbatches: int | None = None,
          bucket_cap_mb: float = 25, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, seed: int = 0, loss_scaler: DynamicLossScaler | None = None,
          device=None) -> Trainer:
    """This rank's part of ``GPT(cfg)`` on ``mesh``, ready to train: TP over
    ``mesh.tp_group``, stage ``mesh.coords[1]`` of ``mesh.pp``, ZeRO-2 over
    ``mesh.dp_group`` (see the module). Every rank builds the same GPT from ``seed``
    first, as the single-process run does. ``microbatches``: per step, through the
    pipeline (default: ``pp``). ``loss_scaler``: for fp16 (a default one is made)."""
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
    from distlab import backend
    device = backend.device() if device is None else torch.device(device)
    dtype, _ = PRECISIONS[precision]

    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    if PRECISIONS[precision][1] is None:    # full precision: fp64 masters for an fp64 model
        model.to(dtype)                     # (mixed: fp32 init, the masters start from it)
    if mesh.tp > 1:
        from distlab.tp import tensor_parallel
        tensor_parallel(model, mesh.tp_group)
    stage = pipeline.Stage(model, mesh.coords[1], mesh.pp)
    return Trainer(stage, mesh, precision=precision, microbatches=microbatches,
                   bucket_cap_mb=bucket_cap_mb, adamw=dict(lr=lr, betas=betas, eps=eps,
                                                           weight_decay=weight_decay),
                   loss_scaler=loss_scaler, device=device, compute_dtype=dtype)


class _Bucket:
    """One ZeRO-2 unit: a :class:`FlatParams` over the DP group, the hook count that says
    when its gradients are complete, its reduce-scatter in flight, this rank's reduced
    gradient shard (master dtype) and AdamW's state for the shard."""

    def __init__(self, flat: FlatParams, late: bool):
        self.flat, self.late = flat, late
        self.expected, self.seen = 0, 0
        self.pending = None
        self.grad: torch.Tensor | None = None    # scaler reads and unscales .grad
        self.state: dict = {}

    def launch(self, trace: list | None, index: int) -> None:
        """Reduce-scatter (mean) the bucket's gradients, asynchronously; drop them."""
        f = self.flat
        with torch.no_grad():
            grads = torch.cat([p.grad.reshape(-1).to(f.dtype) if p.grad is not None else
                               p.new_zeros(n, dtype=f.dtype) for p, n in zip(f.params, f.numels)])
            self.pending = reduce_scatter_mean(grads, f.layout, f.group, async_op=True)
        for p in f.params:
            p.grad = None                       # ZeRO-2: no full gradient survives backward
        if trace is not None:
            trace.append(("launch", time.perf_counter(), index))

    def finish(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        self.grad = pending.wait().to(self.flat.master_dtype, copy=True)


class Trainer:
    """One rank's training state; made by :func:`build`. ``model`` is the stage's
    module (the tensor-parallel GPT cut to this stage, parameters in the compute dtype,
    viewing the buckets' flat buffers), ``buckets`` its ZeRO-2 units, ``runner`` the
    pipeline runner, ``step`` one training step, :meth:`full_state_dict` the whole
    model's weights. Setting ``trace = []`` records, per step, when each gradient was
    accumulated, each bucket's reduce-scatter issued, backward and the update ended."""

    def __init__(self, stage, mesh, *, precision, microbatches, bucket_cap_mb, adamw,
                 loss_scaler, device, compute_dtype):
        self.stage, self.model, self.mesh = stage, stage.module, mesh
        self.precision, self.microbatches, self.adamw = precision, microbatches, adamw
        self.device, self.compute_dtype = device, compute_dtype
        self.autocast_dtype = PRECISIONS[precision][1]
        if precision == "fp16" and loss_scaler is None:
            loss_scaler = DynamicLossScaler()
        if loss_scaler is not None:
            loss_scaler.group = None             # every rank's shards take one decision
        self.scaler = loss_scaler
        self.steps, self.skipped = 0, 0
        self.trace: list | None = None           # set to a list to record hook timings
        trainable = [(n, q) for n, q in self.model.named_parameters() if q.requires_grad]
        if not trainable:
            raise ValueError("the stage has no trainable parameter")
        tied = set(stage.tied)
        early = [(n, q) for n, q in trainable if n not in tied]
        late = [(n, q) for n, q in trainable if n in tied]
        self.buckets: list[_Bucket] = []
        for idx in plan_buckets([q for _, q in early], bucket_cap_mb):
            self.buckets.append(_Bucket(FlatParams([early[i] for i in idx], mesh.dp_group,
                                                   compute_dtype), late=False))
        if late:   # summed across stages by the runner after backward: reduced then
            self.buckets.append(_Bucket(FlatParams(late, mesh.dp_group, compute_dtype), True))
        me = weakref.ref(self)
        for b, bucket in enumerate(self.buckets):
            if not bucket.late:
                for q in bucket.flat.params:
                    q.register_post_accumulate_grad_hook(functools.partial(_grad_ready, me, b))
        if not stage.is_last:     # autocast may hand back fp32 (LayerNorm): one agreed dtype
            stage.register_forward_hook(lambda _m, _a, out: out.to(compute_dtype))
        self.runner = pipeline.PipelineRunner(
            stage, pipeline.one_f_one_b_schedule(mesh.pp, microbatches),
            group=mesh.pp_group, loss_fn=self._loss, dtype=compute_dtype)
        self._weight, self._scale, self._rows = 1.0, 1.0, 1
        self._loss_sum = torch.zeros((), dtype=torch.float64)

    # ------------------------------------------------------------------ the step

    def _loss(self, logits, targets):
        # the runner scales by the micro-batch's share; this adds the DP shard's weight
        # (dp.shard_loss_weight) and the fp16 loss scale
        # (pp.cross_entropy's float() would drop an fp64 model's precision)
        wide = torch.promote_types(logits.dtype, torch.float32)
        loss = F.cross_entropy(logits.flatten(0, 1).to(wide), targets.flatten())
        share = loss * (self._weight * self._scale)
        # the runner adds the micro-batches' losses in an fp32 tensor; keep ours wide
        self._loss_sum += loss.detach().double() * (self._weight * logits.shape[0] /
                                                    self._rows)
        return share

    def _bucket_ready(self, b: int) -> None:
        bucket = self.buckets[b]
        bucket.seen += 1
        if self.trace is not None:
            self.trace.append(("grad", time.perf_counter(), b))
        if bucket.seen == bucket.expected:
            bucket.launch(self.trace, b)

    def local_batch(self, lang, step: int, batch_size: int, seq_len: int | None = None):
        """This DP rank's ``(inputs, targets)`` of step ``step`` (rows ``tensor_split``
        of the global batch), on this rank's device."""
        seq_len = self.model.cfg.seq_len if seq_len is None else seq_len
        x, y = lang.batch(step, batch_size, seq_len, self.mesh.coords[0], self.mesh.dp)
        return x.to(self.device), y.to(self.device)

    def step(self, batch, global_batch_size: int | None = None) -> float:
        """Forward, backward and update on this DP rank's ``batch = (inputs, targets)``;
        returns the mean loss over the global batch (``global_batch_size`` rows;
        default: this rank's rows times dp, an even split), the same on every rank.
        After an fp16 overflow the update is skipped (``self.skipped`` counts them)."""
        x, y = batch
        dp = self.mesh.dp
        rows = x.shape[0]
        total = rows * dp if global_batch_size is None else global_batch_size
        self._weight = shard_loss_weight(rows, total, dp)
        self._scale = self.scaler.scale_value if self.scaler else 1.0
        self._rows = rows
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for bucket in self.buckets:
            bucket.seen, bucket.grad = 0, None
            bucket.expected = 0 if bucket.late else self.microbatches * len(bucket.flat.params)
            for q in bucket.flat.params:
                q.grad = None
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype else contextlib.nullcontext())
        with autocast:
            self.runner.step(x, y)
        if self.trace is not None:
            self.trace.append(("backward_end", time.perf_counter(), None))
        for b, bucket in enumerate(self.buckets):  # the tied bucket, any a hook missed
            if bucket.pending is None and bucket.grad is None:
                bucket.launch(self.trace, b)
        for bucket in self.buckets:
            bucket.finish()
        reported = self._global_loss()
        if self.scaler:      # unscale the shards, agree on overflow, step or skip
            stepped = self.scaler.step(_Shards(self))
            self.scaler.update()
        else:
            self._update()
            stepped = True
        self.steps += 1
        self.skipped += not stepped
        return reported

    def _global_loss(self) -> float:
        """The last stage's weighted loss summed over DP (tp rank 0 only): one tiny
        all-reduce over the world, so every rank returns it."""
        out = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.stage.is_last and self.mesh.coords[2] == 0:
            out += self._loss_sum.to(self.device) / self.mesh.dp
        dist.all_reduce(out)
        return out.item()

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.grad = None

    def _update(self) -> None:
        """AdamW on each master shard, then all-gather the shards into the parameters."""
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.grad is not None:
                    adamw_(bucket.flat.master, bucket.grad, bucket.state, **self.adamw)
            if self.trace is not None:
                self.trace.append(("update_end", time.perf_counter(), None))
            for pending in [bucket.flat.gather(async_op=True) for bucket in self.buckets]:
                pending.wait()
        self.zero_grad()

    # ------------------------------------------------------------------ the weights

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (fp32 masters, or fp64), by the single-process GPT's
        names, on every rank: a collective over the world (DP all-gathers of the
        masters, TP gathers of the shards, the stages' dicts exchanged)."""
        from distlab.tp import full_state_dict as tp_full

        views = []
        for bucket in self.buckets:
            f = bucket.flat
            whole = f.gather_master()
            for name, q in zip(f.names, f.params):
                views.append((q, q.data))
                q.data = whole[name]
        try:
            local = tp_full(self.model) if self.mesh.tp > 1 else {
                k: v.detach().clone() for k, v in self.model.state_dict().items()}
        finally:
            for q, data in views:
                q.data = data
        stages = [None] * self.mesh.pp
        dist.all_gather_object(stages, {k: v.cpu() for k, v in local.items()},
                               group=self.mesh.pp_group)
        return {k: v for part in stages for k, v in part.items()}


class _Shards:
    """The optimizer face :class:`DynamicLossScaler` steps: ``param_groups`` holding the
    buckets (their ``.grad`` is this rank's reduced shard), ``step`` and ``zero_grad``."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.param_groups = [{"params": trainer.buckets}]

    def step(self) -> None:
        self.trainer._update()

    def zero_grad(self) -> None:
        self.trainer.zero_grad()


def _grad_ready(trainer_ref, index: int, _param) -> None:
    trainer = trainer_ref()
    if trainer is not None:
        trainer._bucket_ready(index)


# ------------------------------------------------------------------ the training loop


def train(model: str = "test", dp: int = 1, tp: int = 1, pp: int = 1, steps: int = 10,
          batch_size: int = 8, seq_len: int | None = None, vocab_size: int = 16,
          precision: str = "fp32", microbatches: int | None = None, lr: float = 1e-3,
          bucket_cap_mb: float = 25, seed: int = 0, log: bool = True) -> list[dict]:
    """Train ``model`` (a :data:`distlab.model.PRESETS` name) on
    :class:`distlab.data.NGramLanguage` for ``steps`` steps on this rank's place in a
    ``dp × pp × tp`` mesh; run it on every rank (:func:`distlab.launch.run`, torchrun).
    ``batch_size`` is the global batch. Returns, per step, the loss, tokens/s and MFU
    (None where :func:`distlab.bench.throughput.peak_flops` knows no peak: CPUs, fp32);
    rank 0 prints them and drives a progress bar."""
    from distlab import launch
    from distlab.backend import peak_flops
    from distlab.data import NGramLanguage
    from distlab.model import config

    cfg = config(model, vocab_size)
    seq_len = cfg.seq_len if seq_len is None else seq_len
    mesh = Mesh(dp=dp, pp=pp, tp=tp)
    trainer = build(cfg, mesh, precision=precision, microbatches=microbatches, lr=lr,
                    bucket_cap_mb=bucket_cap_mb, seed=seed)
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
