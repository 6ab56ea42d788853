"""Per-rank memory of data-parallel training: what the ZeRO paper predicts, what
:mod:`distlab.zero` holds exactly, and what a rank measures.

With mixed-precision Adam each parameter costs 2 bytes of fp16/bf16 weights, 2 of
gradients and K = 12 of optimizer state (fp32 master weights, momentum and variance)
(Rajbhandari et al. 2020, "ZeRO", section 3.1). Over N ranks, per rank
(``zero_bytes(num_params, world_size, stage, k=12)``, lab 05's exercise, whose code is in
:mod:`distlab.zero.formula`):

| stage | shards | bytes per rank |
| --- | --- | --- |
| 0 (data parallel) | nothing | (2 + 2 + K)Ψ = 16Ψ |
| 1 | optimizer state | 4Ψ + KΨ/N |
| 2 | + gradients | 2Ψ + (2 + K)Ψ/N |
| 3 | + parameters | (4 + K)Ψ/N |

:func:`accounting` gives the exact bytes :mod:`distlab.zero` holds at the end of
backward, shard by shard (uneven shards included); it differs from the paper in one
place: stages 2 and 3 keep the gradient shard in fp32, the optimizer's dtype (4 bytes,
not 2), and stage 3 keeps no low-precision copy of its parameter shard (the all-gather
casts the master shard), so stage 3 adds up to 16Ψ/N all the same and stage 2 to
2Ψ + 16Ψ/N. :func:`live_bytes` counts the storage a rank's objects hold (exact, on any
device).

The paper counts model states only. A step also needs buffers that live for part of it:
activations (forward to backward), and in :mod:`distlab.zero` the buffers of the
optimizer step, which :func:`step_buffers` gives exactly: the fp32 gradient shard the
optimizer reads, the reduce-scatter and all-gather buffers, and the optimizer's own
scratch (``torch.optim.AdamW(foreach=True)`` makes one temporary the size of its shard).
They are real and unavoidable in this design, but not model states, so they are counted
apart. What a rank measures, the CUDA allocator's counters or on CPUs a
:class:`StorageTracker` (:func:`meter`), is model states + the largest of those
transients + whatever the framework keeps (cuBLAS workspaces: measure a baseline first).
"""
from __future__ import annotations

import dataclasses
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distlab.shards import shard_range
from distlab.zero.flat import Layout
from distlab.zero.formula import zero_bytes

STAGES = (0, 1, 2, 3)  # 0: plain data parallelism
__all__ = ["STAGES", "STAGE_NAMES", "CudaMeter", "RankBytes", "StorageTracker", "accounting",
           "held_bytes", "live_bytes", "meter", "step_buffers", "units_of", "zero_bytes"]
STAGE_NAMES = {0: "data parallel", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


@dataclasses.dataclass
class RankBytes:
    """Bytes one rank holds, by what they are."""

    params: int = 0       # the model's weights as forward uses them
    grads: int = 0        # gradients (whole or shard)
    master: int = 0       # fp32 master weights of the shard (none in plain DP with fp32)
    optimizer: int = 0    # optimizer state per element (Adam's two moments)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def units_of(flat_params) -> tuple[list[int], int]:
    """``(unit_numels, whole)`` of :class:`~distlab.zero.FlatParams` units, as
    :func:`accounting` takes them: the element counts of the sharded units, and the
    elements of the units kept whole on every rank (``replicate=True``)."""
    flat_params = list(flat_params)
    return ([f.numel for f in flat_params if not f.replicated],
            sum(f.numel for f in flat_params if f.replicated))


def accounting(unit_numels: list[int], world_size: int, rank: int, stage: int, whole: int = 0,
               param_bytes: int = 2, grad_bytes: int = 2, master_bytes: int = 4,
               state_bytes: int = 8) -> RankBytes:
    """Exact bytes rank ``rank`` holds at the end of backward in :mod:`distlab.zero`,
    for units (flat buffers) of ``unit_numels`` elements each sharded the
    ``torch.tensor_split`` way, and ``whole`` elements kept whole on every rank, weights
    included (the persistent parameters of stages 2 and 3; :func:`units_of` gives
    both). Stage 0 is data parallelism with fp32 master weights (a
    :class:`~distlab.zero.ShardedOptimizer` over a group of one rank)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    total = sum(unit_numels) + whole
    shard = total if stage == 0 else _shard_total(unit_numels, world_size, rank) + whole
    return RankBytes(params=total * param_bytes if stage < 3 else whole * param_bytes,
                     grads=total * grad_bytes if stage < 2 else shard * master_bytes,
                     master=shard * master_bytes, optimizer=shard * state_bytes)


def _shard_total(unit_numels: list[int], world_size: int, rank: int) -> int:
    """Elements rank ``rank`` holds of the sharded units: its ``tensor_split`` shard of
    each."""
    return sum(end - start for start, end in (shard_range(n, rank, world_size)
                                              for n in unit_numels))


def live_bytes(params=(), grads=(), master=(), optimizer=None) -> RankBytes:
    """Bytes of storage the given tensors span, each byte counted once: views into one
    flat buffer add up to the buffer, and bytes of a buffer that none of them spans
    (the flag per parameter that :class:`distlab.dp.DataParallel` keeps after its
    gradients) are not counted; a freed buffer counts 0. ``optimizer``: a torch
    optimizer whose per-element state counts (its moments; scalar step counters are left
    out). DTensors count their local shard."""
    def nbytes(tensors):
        spans: dict[tuple, list[tuple[int, int]]] = {}
        for t in tensors:
            if t is None:
                continue
            t = t.to_local() if hasattr(t, "to_local") else t
            storage = t.untyped_storage()
            if not storage.nbytes() or not t.numel():
                continue
            extent = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
            lo = t.storage_offset() * t.element_size()
            spans.setdefault((storage.data_ptr(), str(t.device)), []).append(
                (lo, lo + extent * t.element_size()))
        total = 0
        for intervals in spans.values():
            covered = 0
            for lo, hi in sorted(intervals):
                total += max(0, hi - max(lo, covered))
                covered = max(covered, hi)
        return total

    state = [] if optimizer is None else [
        v for s in optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0]
    return RankBytes(nbytes(params), nbytes(grads), nbytes(master), nbytes(state))


def step_buffers(unit_numels: list[int], world_size: int, rank: int, stage: int,
                 whole: int = 0, param_bytes: int = 2, master_bytes: int = 4,
                 scratch_bytes: int = 4) -> int:
    """The most bytes of temporary buffers alive at once during the optimizer step of
    :mod:`distlab.zero` on rank ``rank`` (from the end of backward to the end of the
    step, above :func:`accounting`'s model states), every parameter having a gradient,
    as the bench and lab 05 build each stage (stage 0: a
    :class:`~distlab.zero.ShardedOptimizer` over a group of one after
    :class:`~distlab.dp.DataParallel`). ``scratch_bytes``: the optimizer's temporaries
    per element of the shard (4: ``torch.optim.AdamW(foreach=True)``'s ``sqrt(v)``);
    ``whole``: as in :func:`accounting` (stages 2 and 3).

    Step by step (``b`` = ``param_bytes``, ``m`` = ``master_bytes``, shard ``s`` of
    ``S``, unit of ``n`` elements padded to ``p = N·c``):

    - stages 2 and 3 reduce-scattered the gradients during backward; the step is the
      optimizer alone: ``scratch·S``;
    - stage 0 copies the averaged gradients to fp32 (``m·S``), then the optimizer's
      scratch or the bf16 copy of the updated weights: ``m·S + max(scratch, b)·S``;
    - stage 1 issues every unit's reduce-scatter (flat gradient copy ``b·n``, its padded
      form ``b·p`` when uneven, output ``b·c``), then per unit waits (the input is
      freed) and widens the shard into the pieces' gradients (``m·s``); the optimizer
      adds its scratch; the all-gathers send a bf16 copy of the shard (``b·s``; when
      uneven, a padded chunk ``b·c`` and a padded output ``b·p``).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if stage >= 2:
        return scratch_bytes * (_shard_total(unit_numels, world_size, rank) + whole)
    world = 1 if stage == 0 else world_size
    layouts = [Layout(n, world) for n in unit_numels]
    shards = [end - start for start, end in (lay.bounds(0 if stage == 0 else rank)
                                             for lay in layouts)]
    total = sum(shards)
    b, m = param_bytes, master_bytes
    if stage == 0:
        return m * total + max(scratch_bytes, b) * total
    padded = [0 if lay.even else b * lay.padded_numel for lay in layouts]
    inputs = [p if p else b * lay.numel for p, lay in zip(padded, layouts)]
    outputs = [b * lay.chunk for lay in layouts]
    live = peak = 0
    for lay, pad, inp, out in zip(layouts, padded, inputs, outputs):
        peak = max(peak, live + b * lay.numel + pad + out)   # cat, output, padded copy
        live += inp + out
    for s, inp in zip(shards, inputs):                     # wait, widen into the pieces
        live += m * s - inp
        peak = max(peak, live)
    live = m * total                                       # the outputs are dropped
    peak = max(peak, live + scratch_bytes * total)
    for lay, s in zip(layouts, shards):                    # the all-gathers
        extra = 0 if lay.even else b * (lay.chunk + lay.padded_numel)
        peak = max(peak, live + b * s + extra)
        live += extra if extra else b * s
    return peak


class StorageTracker(TorchDispatchMode):
    """Bytes of tensor storage in use now and at peak, counting every storage that a
    torch op creates while the tracker is active (and its resizes) until it is freed:
    on CPUs, a stand-in for the CUDA allocator's ``memory_allocated`` and
    ``max_memory_allocated``. Buffers a backend allocates inside its own kernels (gloo's,
    NCCL's) are not seen, as the CUDA allocator does not see NCCL's. ::

        with StorageTracker() as tracker:
            ...
            tracker.reset_peak()
            ...
            tracker.allocated(), tracker.peak()
    """

    def __init__(self):
        super().__init__()
        self._sizes: dict[int, list] = {}     # storage key -> [bytes, weak reference]
        self._live = self._peak = 0

    def allocated(self) -> int:
        return self._live

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._live

    def settle(self, nbytes: int, timeout: float = 1.0) -> int:
        """The bytes in use once they are down to ``nbytes``, or after ``timeout``
        seconds: gloo's worker thread drops its last reference to a finished
        collective's tensors a moment after ``wait()`` has returned."""
        deadline = time.monotonic() + timeout
        while self._live > nbytes and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._live

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            before = storage.nbytes()
            out = tracker._resize(storage, size)
            entry = tracker._sizes.get(storage._cdata)
            if entry is not None:
                entry[0] = storage.nbytes()
                tracker._add(entry[0] - before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def _add(self, nbytes: int) -> None:
        self._live += nbytes
        self._peak = max(self._peak, self._live)

    def _freed(self, key, _ref) -> None:
        self._live -= self._sizes.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._sizes:
                continue
            self._sizes[key] = [storage.nbytes(),
                                weakref.ref(storage, lambda ref, key=key: self._freed(key, ref))]
            self._add(storage.nbytes())
        return out


class CudaMeter:
    """The CUDA caching allocator's bytes in use and at peak on ``device``, shaped like
    :class:`StorageTracker` (a context manager that does nothing)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def settle(self, nbytes: int, timeout: float = 1.0) -> int:
        """The bytes in use (NCCL releases a collective's tensors in ``wait()``)."""
        return self.allocated()


def meter(device) -> CudaMeter | StorageTracker:
    """What measures a rank's memory on ``device``: the CUDA allocator on a GPU, a
    :class:`StorageTracker` elsewhere (use it as a context manager around what it
    measures)."""
    device = torch.device(device)
    return CudaMeter(device) if device.type == "cuda" else StorageTracker()


def held_bytes(model, optimizer) -> RankBytes:
    """What this rank holds for ``model`` and ``optimizer``: distlab's
    :class:`~distlab.zero.ShardedOptimizer` or
    :class:`~distlab.zero.FullyShardedDataParallel` (their flat buffers, master shards,
    gradients and the local optimizer's state), or any other module (a DataParallel
    wrapper, an FSDP2-sharded model) with its optimizer (torch's
    ZeroRedundancyOptimizer counts its local optimizer)."""
    flats = [f for obj in (model, optimizer) if hasattr(obj, "flat_params")
             for f in obj.flat_params()]
    local = getattr(optimizer, "optim", optimizer)
    if flats:
        grads = [p.grad for f in flats for p in list(f.params) + list(f.pieces)]
        return live_bytes([f.full for f in flats], grads, [f.master for f in flats], local)
    module = getattr(model, "module", model)
    params = list(module.parameters())
    return live_bytes(params, [p.grad for p in params], (), local)
