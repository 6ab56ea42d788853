"""Lab 07's answers: the schedule tables of ``gpipe_schedule``, ``one_f_one_b_schedule``
and ``bubble_fraction``, and the stage runtime at the core of ``run_stage``
(:class:`PipelineRunner`). The rest of the library uses them through
:mod:`distlab.pp.schedule` and :mod:`distlab.pp.runtime`.

A schedule is a table with one row per stage: the ordered list of that stage's
actions, ``("F", i)`` the forward of micro-batch ``i`` and ``("B", i)`` its backward.

* **GPipe** (Huang et al. 2019, "GPipe"): every stage runs the m forwards, then the m
  backwards, first in first out (the order of torch's ``ScheduleGPipe``). Each stage
  holds the activations of all m micro-batches before its first backward.
* **1F1B**, PipeDream-Flush (Narayanan et al. 2021, "Memory-efficient pipeline-parallel
  DNN training", the schedule of Megatron-LM): stage s of p runs ``min(p-s-1, m)``
  forwards (warm-up), then alternates one forward and one backward (steady state),
  then runs the backwards left (cool-down). Stage s never holds more than
  ``min(p-s, m)`` micro-batches.

With the same forward time and the same backward time on every stage and free
communication, both keep each stage idle for ``(p-1)/(m+p-1)`` of the step (the
*bubble* of the GPipe paper).

:meth:`PipelineRunner.step` cuts the global batch into m micro-batches
(``tensor_split``) and runs this stage's row of the table, action by action:

* ``("F", i)``: take micro-batch i's input (the tokens on the first stage, else the
  activation received from the stage before), run the stage, keep the input and the
  output for the backward, send the output on. The last stage computes the loss of the
  micro-batch scaled by its share of the batch, ``rows_i / B`` (1/m when m divides B),
  so that the gradients accumulated over the m backwards are those of the batch's mean
  loss, as one process computes them.
* ``("B", i)``: backward from micro-batch i's output with the gradient received from
  the stage after (from the loss on the last stage); send the input's gradient back.

The transfers go through :class:`distlab.pp.p2p.StageLink`, grouped as NCCL needs; the
first step begins by connecting each link both ways (:meth:`StageLink.connect
<distlab.pp.p2p.StageLink.connect>`, NCCL's lazy connection setup). The step ends by
summing the gradients of tied parameters between the stages that hold them
(:attr:`distlab.pp.split.Stage.tied`), and leaves the optimizer step to the caller.

Import order: :mod:`distlab.pp` re-exports this module, so the runner imports the
submodules of :mod:`distlab.pp` it uses where it uses them, not at the top (imported
first, this module would otherwise import :mod:`distlab.pp`, which imports it back
before it is defined; ``tests/test_layout.py`` imports every module of
:mod:`distlab.reference` first).
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from distlab.pp.events import StageEvents
    from distlab.pp.p2p import StageLink
    from distlab.pp.split import Stage

Table = list[list[tuple[str, int]]]  # one row of actions per stage


def _check_sizes(num_stages, num_microbatches) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Table:
    """Per stage: F0 ... F(m-1), then B0 ... B(m-1)."""
    _check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            for _ in range(num_stages)]


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Table:
    """Per stage s: min(p-s-1, m) forwards (warm-up), then one forward and one backward
    alternating (steady state), then the backwards left (cool-down); micro-batches in
    increasing order."""
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    table = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]
        table.append(actions)
    return table


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}
TITLES = {"gpipe": "GPipe", "1f1b": "1F1B"}  # the names to print


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> Table:
    """The table of schedule ``name`` ("gpipe" or "1f1b")."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction of GPipe and 1F1B on equal stages: (p-1)/(m+p-1)."""
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)



def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of a micro-batch, in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class PipelineRunner:
    """Run ``stage``'s row of ``table`` (one row of actions per stage; see
    :mod:`distlab.pp.schedule`) over the ranks of ``group`` (the default group when
    None; stage s is rank s of the group).

    ``check``: refuse a table that cannot run (:func:`~distlab.pp.schedule.check_schedule`)
    before any rank waits for a message that never comes; ``check=False`` trusts the
    table (a deadlocking one then hangs until the launcher's timeout).
    ``pad_to``: ``(forward, backward)`` seconds; each action is padded with a sleep to
    last that long, which gives every micro-batch the same compute time without
    keeping a core busy (for honest bubble measurements on a shared CPU; a host's
    sleep does not pad a GPU's work).
    ``grouped``: see :class:`~distlab.pp.p2p.StageLink`. ``dtype``: of the
    activations between stages (the parameters' by default)."""

    def __init__(self, stage: Stage, table, group=None, loss_fn=cross_entropy,
                 check: bool = True, pad_to: tuple[float, float] | None = None,
                 grouped: bool = True, dtype: torch.dtype | None = None):
        # imported here, not at the top: see the module's note on import order
        from distlab.pp.p2p import StageLink
        from distlab.pp.schedule import check_schedule

        if check:
            problem = check_schedule(table, stage.num_stages)
            if problem:
                raise ValueError(f"this schedule cannot run: {problem}")
        self.link = StageLink(group, grouped)
        if self.link.index != stage.index or len(self.link.ranks) != stage.num_stages:
            raise ValueError(f"rank {self.link.index} of a group of {len(self.link.ranks)} "
                             f"holds stage {stage.index} of {stage.num_stages}: stage s must "
                             f"run on rank s of the pipeline's group")
        self.stage, self.actions = stage, [tuple(a) for a in table[stage.index]]
        self.num_microbatches = sum(1 for kind, _ in self.actions if kind == "F")
        self.loss_fn, self.pad_to = loss_fn, pad_to
        param = next(stage.parameters())
        self.device, self.dtype = param.device, dtype or param.dtype
        self.timeline: list[dict] = []

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of the global batch ``(inputs, targets)``, both (B, T):
        the first stage reads the tokens, the last the targets, every stage their shape
        (which fixes every message's shape). Returns the batch's mean loss on the last
        stage (detached), None on the others. Call it with zeroed gradients (after
        ``optimizer.zero_grad()``): it ends by summing the tied parameters' gradients
        across their stages, which would count what an earlier step left there twice."""
        m, s = self.num_microbatches, self.stage
        if inputs.dim() != 2 or inputs.shape != targets.shape:
            raise ValueError(f"inputs and targets must both be (batch, time), got "
                             f"{tuple(inputs.shape)} and {tuple(targets.shape)}")
        batch, t = inputs.shape
        if batch < m:
            raise ValueError(f"a batch of {batch} rows cannot make {m} micro-batches; use at "
                             f"most {batch} micro-batches or a larger batch")
        rows = [len(r) for r in torch.arange(batch).tensor_split(m)]
        xs = inputs.to(self.device).tensor_split(m)
        ys = targets.to(self.device).tensor_split(m)
        from distlab.pp.events import StageEvents  # here, not at the top: the module's note
        timeline = StageEvents(s.index, self.device)
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        received: dict[tuple[str, int], torch.Tensor] = {}
        total = torch.zeros((), device=self.device)

        def incoming(k: int) -> list[tuple[torch.Tensor, int]]:
            """The receive that action k needs, with its buffer."""
            if k >= len(self.actions):
                return []
            kind, i = self.actions[k]
            peer = s.index - 1 if kind == "F" else s.index + 1
            if (kind == "F" and s.is_first) or (kind == "B" and s.is_last):
                return []
            buffer = torch.empty(rows[i], t, s.d_model, device=self.device, dtype=self.dtype)
            received[self.actions[k]] = buffer
            return [(buffer, peer)]

        fresh = [n for n in (s.index - 1, s.index + 1)
                 if 0 <= n < s.num_stages and n not in self.link.connected]
        if fresh:  # the first step: open both directions of each link (NCCL's setup)
            with timeline.record("comm", what=", ".join(f"connect to {n}" for n in fresh)):
                self.link.connect(fresh, self.device)
        self._transfer(timeline, [], incoming(0))
        for k, (kind, i) in enumerate(self.actions):
            with timeline.record(kind, i) as event:
                start = time.perf_counter()
                if kind == "F":
                    x = xs[i] if s.is_first else received.pop((kind, i)).requires_grad_()
                    out = s(x)
                    if s.is_last:
                        out = self.loss_fn(out, ys[i]) * (rows[i] / batch)
                        total += out.detach()
                    elif out.dtype != self.dtype:
                        raise ValueError(f"stage {s.index} outputs {out.dtype} activations but "
                                         f"the stages agreed on {self.dtype}; pass dtype= to "
                                         f"PipelineRunner")
                    saved[i] = (x, out)
                    sends = [] if s.is_last else [(out.detach(), s.index + 1)]
                else:
                    x, out = saved.pop(i)
                    out.backward(None if s.is_last else received.pop((kind, i)))
                    sends = [] if s.is_first else [(x.grad, s.index - 1)]
                if self.pad_to:
                    time.sleep(max(0.0, self.pad_to[kind == "B"] - (time.perf_counter() - start)))
                event["live"] = len(saved)
            self._transfer(timeline, sends, incoming(k + 1))
        sum_tied_gradients(self.stage, self.link, timeline)
        self.link.finish()
        self.timeline = timeline.finish()
        return total if s.is_last else None

    def _transfer(self, timeline: StageEvents, sends, recvs) -> None:
        if not sends and not recvs:
            return
        names = {True: "act", False: "grad"}
        what = [f"send {names[p > self.stage.index]} to {p}" for _, p in sends]
        what += [f"recv {names[p < self.stage.index]} from {p}" for _, p in recvs]
        with timeline.record("comm", what=", ".join(what)):
            self.link.exchange(sends, recvs)


def sum_tied_gradients(stage: Stage, link: StageLink, timeline: StageEvents | None = None) -> None:
    """Each tied parameter's gradient (:attr:`Stage.tied`) becomes the sum over the
    stages holding it, added in stage order on every one of them, so the copies stay
    identical (Megatron-LM's all-reduce in the embedding group, here one grouped
    exchange between the holders). Grouped, the exchange is the same on both sides of
    each pair (send to and receive from every other holder), so it also connects the
    first and the last stage as NCCL needs when they are not neighbours."""
    for name, holders in sorted(stage.tied.items()):
        param = stage.module.get_parameter(name)
        if not param.requires_grad:
            continue
        mine = param.grad if param.grad is not None else torch.zeros_like(param)
        others = [h for h in holders if h != stage.index]
        got = {h: torch.empty_like(mine) for h in others}
        what = f"sum the gradient of {name} with stages {others}"
        with timeline.record("comm", what=what) if timeline else contextlib.nullcontext():
            link.exchange([(mine, h) for h in others], [(got[h], h) for h in others])
        got[stage.index] = mine
        param.grad = sum(got[h] for h in holders)
