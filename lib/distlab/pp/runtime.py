"""Lab 07's answer at the core of ``run_stage``: one training step of one pipeline stage,
driven by a schedule table. This module holds only that answer: while ``run_stage`` is
graded it is absent from the graded ranks (:mod:`distlab.grading.answers`).

    stage = Stage(GPT(cfg), index=dist.get_rank(), num_stages=dist.get_world_size())
    runner = PipelineRunner(stage, one_f_one_b_schedule(p, m))
    loss = runner.step(inputs, targets)    # the batch's mean loss on the last stage
    optimizer.step()

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

``runner.timeline`` keeps what the stage did and when (:mod:`distlab.pp.events`), with
the number of micro-batches whose activations it holds after each action.
"""
from __future__ import annotations

import contextlib
import time

import torch

from distlab.pp.events import StageEvents
from distlab.pp.loss import cross_entropy
from distlab.pp.p2p import StageLink
from distlab.pp.schedule import check_schedule
from distlab.pp.split import Stage


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
