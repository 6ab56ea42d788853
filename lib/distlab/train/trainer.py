"""The composed trainer: ZeRO-2 and mixed precision on a data × pipeline ×
tensor-parallel rank grid (:class:`distlab.mesh.Mesh`), each bucket's gradients
reduced once the pipeline's backward has returned. Made by :func:`distlab.train.build`,
whose documentation says what it does; this module says how. Issuing the reduce-scatters
from backward instead is :mod:`distlab.train.overlap` (lab 09's exercise, grown).

Composition (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", the 3D layout; Rajbhandari et al. 2020, "ZeRO"):

* **TP**: the GPT is made tensor-parallel over ``mesh.tp_group``
  (:func:`distlab.tp.tensor_parallel`, Megatron's column/row split);
* **PP**: it is then cut into ``pp`` stages (:class:`distlab.pp.Stage`, stage index
  ``mesh.coords[1]``) run by a 1F1B :class:`distlab.pp.PipelineRunner` over
  ``mesh.pp_group`` (its :class:`~distlab.pp.p2p.StageLink` turns stage indices into the
  global ranks of the neighbouring stages, so a pp group of any ranks works);
* **ZeRO-2 over DP** (lab 05's step, bucket by bucket): the stage's trainable parameters
  are cut into buckets (:func:`distlab.dp.plan_buckets`, reverse order, as backward
  produces them); each bucket is one :class:`distlab.zero.FlatParams` over
  ``mesh.dp_group``: the compute-dtype parameters view its flat buffer, and this rank
  keeps only its ``tensor_split`` shard of the fp32 master weights and of AdamW's
  moments. After the pipeline's backward each bucket's gradients are reduce-scattered
  (:func:`distlab.zero.flat.reduce_scatter_mean`) and dropped; AdamW
  (:func:`distlab.zero.adamw_`, the same arithmetic as ``torch.optim.AdamW``) updates
  each master shard, and the shards are all-gathered back into the parameters
  (:meth:`FlatParams.gather`).
* **Mixed precision** (Micikevicius et al. 2018): ``precision="bf16"`` keeps the
  parameters and gradients in bf16 under ``torch.autocast`` with fp32 masters;
  ``"fp16"`` the same with a :class:`distlab.zero.DynamicLossScaler` (the sharded
  gradients unscaled before the step, the step skipped on every rank on overflow);
  ``"fp32"`` and ``"fp64"`` compute in full precision (the tests' reference mode).

Why not the library's wrappers: :class:`distlab.zero.ShardedOptimizer` steps the whole
model as one flat group; :class:`distlab.zero.FullyShardedDataParallel` with
``shard_parameters=False`` reduce-scatters once per backward (per micro-batch: m times
the traffic under a pipeline), expects each forward to be followed by its backward
(1F1B runs several forwards first), and takes its units from ``nn.ModuleList`` children
(a :class:`~distlab.pp.Stage` keeps its blocks in an ``nn.ModuleDict``).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import pp as pipeline
from distlab.dp import plan_buckets, shard_loss_weight
from distlab.tp import full_state_dict as tp_full_state_dict
from distlab.train.precision import PRECISIONS
from distlab.zero import DynamicLossScaler, FlatParams, adamw_
from distlab.zero.flat import reduce_scatter_mean


class _Bucket:
    """One ZeRO-2 unit: a :class:`FlatParams` over the DP group, whether its gradients
    are complete only after the pipeline (``late``: the tied weight), its reduce-scatter
    in flight, this rank's reduced gradient shard (master dtype) and AdamW's state for
    the shard."""

    def __init__(self, flat: FlatParams, late: bool):
        self.flat, self.late = flat, late
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
    model's weights. Setting ``trace = []`` records, per step, when each bucket's
    reduce-scatter was issued, and when backward and the update ended."""

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
        self.trace: list | None = None           # set to a list to record the step's timings
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
        self._begin()
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype else contextlib.nullcontext())
        with autocast:
            self.runner.step(x, y)
        if self.trace is not None:
            self.trace.append(("backward_end", time.perf_counter(), None))
        for b, bucket in enumerate(self.buckets):  # every bucket not issued from backward
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

    def _begin(self) -> None:
        """Before a step's pipeline: no gradient, no reduced shard."""
        for bucket in self.buckets:
            bucket.grad = None
            for q in bucket.flat.params:
                q.grad = None

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
        views = []
        for bucket in self.buckets:
            f = bucket.flat
            whole = f.gather_master()
            for name, q in zip(f.names, f.params):
                views.append((q, q.data))
                q.data = whole[name]
        try:
            local = tp_full_state_dict(self.model) if self.mesh.tp > 1 else {
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
