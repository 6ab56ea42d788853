"""The models and batches data-parallel tests run on (lab 08's exercise tests and
tests/test_dp.py): the course's small GPT in float64 with the awkward cases (the head
tied to the token embedding, a frozen ``ln_f.bias``, a parameter ``unused`` that never
gets a gradient), a global batch of 10 sequences (uneven over 3 and 4 ranks), and
``Branchy``, whose middle layer a rank uses only in some steps.
"""
import sys

import cloudpickle
import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.data import NGramLanguage
from distlab.dp import shard_loss_weight
from distlab.model import GPT, config

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

BATCH, SEQ, VOCAB = 10, 8, 13
LANG = NGramLanguage(VOCAB, 3, seed=0)


def make_model(seed=0, unused=True, dtype=torch.float64):
    torch.manual_seed(seed)
    model = GPT(config("test", vocab_size=VOCAB)).to(dtype)
    model.ln_f.bias.requires_grad_(False)                 # frozen
    if unused:                                            # never gets a gradient
        model.unused = nn.Parameter(torch.randn(5, dtype=dtype))
    return model


def local_loss(model, step, rank, world, device="cpu"):
    """This rank's share of the global batch's mean loss (see dp.shard_loss_weight)."""
    x, y = (t.to(device) for t in LANG.batch(step, BATCH, SEQ, rank, world))
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return loss * shard_loss_weight(len(x), BATCH, world)


def one_process(model, steps: int, lr: float):
    """SGD on the whole global batch in one process: the run every data-parallel one
    must reproduce. Returns the losses (a tensor) and the final weights by name."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = local_loss(model, step, 0, 1)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), snapshot(model)


def snapshot(model, what="param"):
    """Parameters (or gradients, None where there is none) by name, cloned."""
    if what == "grad":
        return {n: None if p.grad is None else p.grad.detach().clone()
                for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Branchy(nn.Module):
    """A chain whose middle layer a rank uses only when rank + step is even: its
    bucket gets no gradient on the other ranks, which must still reduce it, in the same
    order as everyone else."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.mid, self.b = nn.Linear(3, 7), nn.Linear(7, 7), nn.Linear(7, 2)
        self.double()
        self.use_mid = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_mid:
            h = h + torch.tanh(self.mid(h))
        return self.b(h)


def branchy_backward(model, rank, step):
    """One backward of ``Branchy`` on this rank's data of ``step``."""
    torch.manual_seed(100 * step + rank)
    model.use_mid = (rank + step) % 2 == 0
    model(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum().backward()


def branchy_means(world, step):
    """The gradients every rank must hold after ``step``: the mean over the ranks, zeros
    from the ranks that skipped the middle layer."""
    local = []
    for rank in range(world):
        model = Branchy()
        branchy_backward(model, rank, step)
        local.append({n: p.grad if p.grad is not None else torch.zeros_like(p)
                      for n, p in model.named_parameters()})
    return {name: torch.stack([g[name] for g in local]).mean(0) for name in local[0]}
