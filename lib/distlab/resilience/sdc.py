"""Silent data corruption: a flipped bit that raises no error, found by replaying a step
deterministically and comparing hashes (torchtitan's ``docs/silent_data_corruption.md``;
Meta's and Google's fleets report such faulty CPUs and GPUs at about one in a thousand
machines: Dixit et al. 2021, Hochschild et al. 2021).

A replica hashes the gradient it computed, computes it again from the same weights and
batch (deterministic kernels give the same bits), and hashes that: a fault in either
computation makes the hashes differ, on that replica, within the step. After the
all-reduce the replicas hold the same weights, so their weights' hashes must be equal
too: a fault in one replica's update shows there.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


def digest(tensors) -> str:
    """SHA-256 of the tensors' bytes, in order (a GPU's copied to the host)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """In place: bit ``bit`` of element ``index`` of ``tensor`` (flattened) flipped."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    word = tensor.view(-1).view(ints)[index:index + 1]
    word ^= torch.tensor(1 << bit, dtype=torch.int64).to(ints) if bit < 8 * tensor.element_size() - 1 \
        else torch.tensor(torch.iinfo(ints).min, dtype=ints)


def gradients(model, loss_fn, batch) -> list[torch.Tensor]:
    """The gradient of ``loss_fn(model, batch)`` in each parameter (zeros where none)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_fn(model, batch), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def checked_step(model, optimizer, batch, loss_fn, *, replay=True, corrupt=None, group=None):
    """One data-parallel step (gradients averaged over ``group``) that checks itself:
    with ``replay``, the gradient computed twice and the two hashes compared; after the
    update, every replica's weights hash all-gathered. ``corrupt(grads)``: a fault
    injected into the first computation. Returns {"replay_equal": bool or None,
    "weights_equal": bool}: this rank's verdicts."""
    grads = gradients(model, loss_fn, batch)
    if corrupt is not None:
        corrupt(grads)
    same = None
    if replay:
        same = digest(grads) == digest(gradients(model, loss_fn, batch))
    world = dist.get_world_size(group)
    for p, g in zip((p for p in model.parameters() if p.requires_grad), grads):
        dist.all_reduce(g, group=group)
        p.grad = g / world
    optimizer.step()
    hashes = [None] * world
    dist.all_gather_object(hashes, digest(model.parameters()), group=group)
    return {"replay_equal": same, "weights_equal": len(set(hashes)) == 1}
