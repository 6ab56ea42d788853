"""The answer to lab 12's ``fault_tolerant_step``: a data-parallel step that commits only
when every member of its quorum got through it, and a replica that rejoins by copying a
healthy peer's state (torchft's ``Manager.should_commit`` and its live recovery)."""
from __future__ import annotations

import io

import torch

from distlab.resilience.quorum import ReplicaLost


def fault_tolerant_step(model, optimizer, batch, loss_fn, manager, step):
    """One step of a replica; returns ``(next_step, loss)``: the quorum's step + 1 and the
    mean loss over the members' rows if it committed, the quorum's step and None if not."""
    quorum = manager.quorum(step)
    top = max(quorum.steps.values())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    try:
        if any(s < top for s in quorum.steps.values()):
            healthy = min(r for r, s in quorum.steps.items() if s == top)
            _copy_state(model, optimizer, quorum, healthy)
        flat = torch.zeros(sum(p.numel() for p in params) + 2, dtype=torch.float64)
        if quorum.steps[quorum.me] == top:
            rows = len(batch[0])
            loss = loss_fn(model, batch)
            (loss * rows).backward()
            flat[:-2] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                                   .reshape(-1).double() for p in params])
            flat[-2], flat[-1] = float(loss.detach()) * rows, rows
        quorum.all_reduce(flat)
        ok = True
    except ReplicaLost:
        ok = False
    if not quorum.agree(ok):
        optimizer.zero_grad(set_to_none=True)
        return top, None
    total = flat[-1]
    offset = 0
    for p in params:
        p.grad = (flat[offset:offset + p.numel()] / total).reshape(p.shape).to(p.dtype)
        offset += p.numel()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return top + 1, float(flat[-2] / total)


def _copy_state(model, optimizer, quorum, src):
    """Every member: ``src``'s weights and optimizer state, bitwise, on each of them."""
    data = torch.zeros(1, dtype=torch.int64)
    if quorum.me == src:
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        data[0] = payload.numel()
    quorum.broadcast(data, src)
    if quorum.me != src:
        payload = torch.zeros(int(data[0]), dtype=torch.uint8)
    quorum.broadcast(payload, src)
    if quorum.me != src:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
