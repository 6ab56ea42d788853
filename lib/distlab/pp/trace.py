"""A pipeline stage's step timed from outside: any ``run_stage(stage, table, inputs,
targets, group)`` (lab 07's exercise) runs as it is, and :func:`traced_step` returns its
result with the stage's timeline, the events of :mod:`distlab.pp.events`.

Hooks on the stage time each forward (from the stage's call to its output) and each
backward (from the moment the gradient reaches the stage's output to the moment it
reaches its input, or the token embedding's output on the first stage); the micro-batch
of the k-th forward or backward is the one the stage's row of the table names there. A
:class:`~distlab.comm.CommLog` gives the transfers: each ``batch_isend_irecv`` (one
NCCL group) or single call becomes one "comm" event. ``pad_to`` pads the actions with a
sleep as :class:`~distlab.pp.runtime.PipelineRunner` does (section 6 of lab 07: equal
compute times on a shared CPU).
"""
from __future__ import annotations

import time

import torch

from distlab.comm import SENDS, CommLog
from distlab.pp.events import StageEvents
from distlab.pp.split import Stage


class _Mark(torch.autograd.Function):
    """The identity; ``fn()`` is called when the gradient passes back through it."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


def traced_step(run_stage, stage: Stage, table, inputs: torch.Tensor, targets: torch.Tensor,
                group=None, pad_to: tuple[float, float] | None = None):
    """``run_stage(stage, table, inputs, targets, group)``, timed: returns what it
    returned and the timeline of this stage's step (each forward and backward with the
    micro-batches held after it, ``"live"``, and each transfer group). The token
    embedding of the first stage must train (its gradient marks the backwards' end)."""
    row = [tuple(a) for a in table[stage.index]]
    order = {kind: [i for k, i in row if k == kind] for kind in ("F", "B")}
    device = next(stage.parameters()).device
    record = StageEvents(stage.index, device)
    done = {"F": 0, "B": 0}
    open_: dict[str, tuple] = {}

    def begin(kind):
        timer = record.record(kind, order[kind][done[kind]])
        open_[kind] = (timer, timer.__enter__(), time.perf_counter())

    def end(kind):
        timer, event, start = open_.pop(kind)
        if pad_to:
            time.sleep(max(0.0, pad_to[kind == "B"] - (time.perf_counter() - start)))
        done[kind] += 1
        event["live"] = done["F"] - done["B"]
        timer.__exit__(None, None, None)

    def before(_, args):
        begin("F")
        x = args[0]
        if x.is_floating_point() and x.requires_grad:  # a received activation
            return (_Mark.apply(x, lambda: end("B")),) + tuple(args[1:])
        return None

    def after(_, __, out):
        end("F")
        return _Mark.apply(out, lambda: begin("B"))

    hooks = [stage.register_forward_pre_hook(before), stage.register_forward_hook(after)]
    if stage.is_first:
        hooks.append(stage.module.tok_emb.register_forward_hook(
            lambda _, __, out: _Mark.apply(out, lambda: end("B"))))
    try:
        with CommLog() as log:
            result = run_stage(stage, table, inputs, targets, group)
    finally:
        for hook in hooks:
            hook.remove()
    return result, sorted(record.finish() + _transfers(log, stage), key=lambda e: e["start"])


def _transfers(log: CommLog, stage: Stage) -> list[dict]:
    """One "comm" event per transfer group of ``log``: "send act to 2, recv grad from
    2", a tied parameter's gradient "tied grad", a one-element message "link"."""
    tied = {p.numel() * p.element_size() for name in stage.tied
            for p in [stage.module.get_parameter(name)]}
    groups: dict = {}
    for k, e in enumerate(log.events):
        groups.setdefault(e.batch or -1 - k, []).append(e)
    out = []
    for events in groups.values():
        what = []
        for e in events:
            send, peer = e.op in SENDS, e.group_ranks.index(e.peer)  # a stage: a group rank
            label = ("tied grad" if e.nbytes in tied else "link" if e.nbytes <= 8 else
                     "act" if (peer > stage.index) == send else "grad")
            what.append(f"{'send' if send else 'recv'} {label} {'to' if send else 'from'} {peer}")
        out.append({"stage": stage.index, "kind": "comm", "mb": None, "what": ", ".join(what),
                    "start": min(e.start for e in events),
                    "end": max(e.end or e.start for e in events)})
    return out
