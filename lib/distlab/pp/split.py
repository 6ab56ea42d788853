"""Cutting the GPT into pipeline stages by layer, from outside the model.

The model is a sequence of layers: the embeddings, ``n_layer`` blocks, and the final
norm with the head. A stage is a contiguous run of them, the embeddings always on the
first stage and the head on the last. :class:`Stage` keeps this rank's run of layers
and drops the others from the model (as torchtitan does: the model itself has no
pipeline code).

**Balance.** A pipeline runs at the pace of its slowest stage, so the cut minimises
the largest stage cost (:func:`balance`, the linear partition problem, solved exactly
by dynamic programming). A layer's cost is its training FLOPs per token, the terms of
:meth:`distlab.model.GPT.flops_per_token` (``6N + 12 L d T``) split by layer: 6 per
parameter of a block plus ``12 d T`` for its attention scores; 6 per parameter of the
final norm and the head (a ``d x V`` matrix product); the embeddings are lookups and
cost nothing. The costs add up to ``flops_per_token`` exactly.

**Tied weights.** When the head is tied to the token embedding (Press & Wolf 2017) the
first and the last stage each hold a copy of that one tensor. As in Megatron-LM (its
"embedding group"), the two copies start equal and their gradients are summed between
the two stages after every backward (:meth:`distlab.pp.runtime.PipelineRunner.step`),
so both take the very step the single model takes. :attr:`Stage.tied` says which
parameters are shared with which stages.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from distlab.model import GPT


def layers(model: GPT) -> list[tuple[str, dict[str, nn.Module]]]:
    """The model's layers in order, as (name, {attribute path: module}): "embed",
    "blocks.0", ..., "head" (the final norm with the head)."""
    if not isinstance(model, GPT):
        raise TypeError(f"distlab.pp cuts a distlab.model.GPT into stages, got "
                        f"{type(model).__name__}")
    return ([("embed", {"tok_emb": model.tok_emb, "pos_emb": model.pos_emb})] +
            [(f"blocks.{i}", {f"blocks.{i}": b}) for i, b in enumerate(model.blocks)] +
            [("head", {"ln_f": model.ln_f, "head": model.head})])


def _parameters(modules: dict[str, nn.Module]) -> dict[str, nn.Parameter]:
    """Every parameter of a layer under its name in the model, a tied one under each."""
    return {f"{prefix}.{n}": p for prefix, m in modules.items()
            for n, p in m.named_parameters(remove_duplicate=False)}


def layer_costs(model: GPT, seq_len: int | None = None) -> list[tuple[str, int]]:
    """(name, training FLOPs per token) of each layer at context ``seq_len`` (the
    model's own by default); they sum to ``model.flops_per_token(seq_len)``."""
    t = model.cfg.seq_len if seq_len is None else seq_len
    attention = 12 * model.cfg.d_model * t
    costs = []
    for name, modules in layers(model):
        params = sum(p.numel() for p in {id(p): p for p in _parameters(modules).values()}.values())
        if name == "embed":
            costs.append((name, 0))
        else:
            costs.append((name, 6 * params + (attention if name.startswith("blocks") else 0)))
    return costs


def balance(costs: list[float], num_stages: int) -> list[range]:
    """Cut ``costs`` (one per layer, in order) into ``num_stages`` contiguous non-empty
    runs whose largest sum is as small as possible; returns each run's layer indices.
    Ties go to the cut that puts fewer layers on the earlier stages."""
    n = len(costs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"{num_stages} stages for {n} layers: every stage needs a layer at "
                         f"least; use at most {n} stages or a model with more blocks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: the smallest largest-stage cost of layers [0, j) on k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                worst = max(best[k - 1][i], prefix[j] - prefix[i])
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    bounds, j = [], n
    for k in range(num_stages, 0, -1):
        bounds.append(range(cut[k][j], j))
        j = cut[k][j]
    return bounds[::-1]


class Stage(nn.Module):
    """``Stage(model, index, num_stages)``: stage ``index`` of a pipeline of
    ``num_stages``, cut from ``model`` in place (the layers of the other stages are
    dropped from it; build one model per rank, the same on every rank).

    ``layers`` overrides the cut (a range of layer indices per stage, as
    :func:`balance` returns); by default it balances :func:`layer_costs`.
    ``stage(x)`` maps the stage's input (token ids on the first stage, the residual
    stream elsewhere) to its output (logits on the last stage). ``.module`` is the cut
    model, whose parameters keep their names in the whole model."""

    def __init__(self, model: GPT, index: int, num_stages: int,
                 layers_per_stage: list[range] | None = None):
        super().__init__()
        named = layers(model)
        cuts = layers_per_stage or balance([c for _, c in layer_costs(model)], num_stages)
        if len(cuts) != num_stages or [i for r in cuts for i in r] != list(range(len(named))):
            raise ValueError(f"layers_per_stage must cut the {len(named)} layers into "
                             f"{num_stages} contiguous runs in order, got {cuts}")
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index must be in [0, {num_stages}), got {index}")
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.layer_names = [named[i][0] for i in cuts[index]]
        self.tied = _tied(model, named, cuts, index)
        blocks = [int(n.split(".")[1]) for n in self.layer_names if n.startswith("blocks.")]
        model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if not self.is_first:
            model.tok_emb = model.pos_emb = None
        if not self.is_last:
            model.ln_f = model.head = None
        self.module = model
        self.d_model = model.cfg.d_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.module.embed(x)
        for block in self.module.blocks.values():
            x = block(x)
        return self.module.logits(x) if self.is_last else x

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.num_stages}: {', '.join(self.layer_names)}"


def _tied(model: GPT, named, cuts, index: int) -> dict[str, list[int]]:
    """Parameters of stage ``index`` that other stages hold too: name -> the stages
    holding it. A parameter outside every layer is an error."""
    stages_of: dict[int, set[int]] = {}
    for s, run in enumerate(cuts):
        for i in run:
            for p in _parameters(named[i][1]).values():
                stages_of.setdefault(id(p), set()).add(s)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in stages_of:
            raise ValueError(f"parameter {name} belongs to no layer (embeddings, blocks, final "
                             f"norm and head), so no pipeline stage would own it; register it "
                             f"inside a block")
    mine = {n: p for i in cuts[index] for n, p in _parameters(named[i][1]).items()}
    return {n: sorted(stages_of[id(p)]) for n, p in mine.items() if len(stages_of[id(p)]) > 1}
