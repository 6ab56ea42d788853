"""Tensor parallelism (Megatron-LM: Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3).

Each weight matrix of a block is split over the ``t`` ranks of a group, and every rank
sees the whole batch. Two linear layers pair up so that the activation between them
never needs a collective:

* :class:`ColumnParallelLinear` splits the *output* features: rank r computes
  ``X A_r``, its slice of the output columns, from the full input X;
* :class:`RowParallelLinear` splits the *input* features: rank r computes
  ``Y_r B_r`` from its slice of the input, and the partial products are summed.

Column then row computes ``gelu(X A) B`` with one all-reduce forward (the sum, Megatron's
**g**) and one backward (the input's gradient ``dX = sum_r dY_r A_r^T``, Megatron's
**f**). Attention is split by heads, each rank keeping the q, k and v rows of its heads.
A block therefore costs 2 all-reduces of ``b·s·h`` elements forward and 2 backward
(the paper's figure 4).

:func:`tensor_parallel` applies this to an unmodified :class:`distlab.model.GPT` by
replacing its submodules, as torchtitan does; the model's code knows nothing of it.
Options: a vocabulary-parallel embedding and cross-entropy (Megatron's, three all-reduces
of ``b·s`` floats instead of gathering ``b·s·V`` logits) and sequence parallelism
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models": LayerNorms and residuals on a slice of the sequence, an all-gather and a
reduce-scatter in place of each all-reduce).

Shards follow ``torch.tensor_split``: the first ``n % t`` ranks hold one row more.
Attention heads cannot be split, so the head count must be a multiple of ``t``.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import comm

# ------------------------------------------------------- the communication operators


def shard_sizes(n: int, size: int) -> list[int]:
    """Lengths of the ``torch.tensor_split`` pieces of ``n`` over ``size`` ranks."""
    return [n // size + (r < n % size) for r in range(size)]


def _member(group) -> bool:
    return group is None or dist.get_rank() in dist.get_process_group_ranks(group)


def _all_gather(x: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank r's piece has ``sizes[r]``
    rows there): one all-gather, pieces padded to the longest."""
    longest = max(sizes)
    front = x.movedim(dim, 0)
    if front.shape[0] < longest:
        front = torch.cat([front, front.new_zeros(longest - front.shape[0], *front.shape[1:])])
    out = front.new_empty(len(sizes) * longest, *front.shape[1:])
    comm.all_gather_into(out, front.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(out.split(longest), sizes)]).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of every rank's ``x`` (even slices)."""
    size = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty(front.shape[0] // size, *front.shape[1:])
    comm.reduce_scatter_into(out, front, group=group)
    return out.movedim(0, dim)


def _my_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    return x.tensor_split(size, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # a copy: autograd may hand the same gradient tensor to another branch
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: forward sums over the group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps this rank's slice of the gradient (the
    computation after the gather is replicated, so every rank holds the same gradient)."""

    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return _all_gather(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[:dist.get_rank(ctx.group)])
        piece = grad.narrow(ctx.dim, start, ctx.sizes[dist.get_rank(ctx.group)])
        return piece.contiguous(), None, None, None


class _SplitToGroup(torch.autograd.Function):
    """Keep this rank's slice along ``dim``; backward all-gathers the gradient
    (sequence parallelism's entry, after the embedding)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.length = dim, group, x.shape[dim]
        return _my_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        sizes = shard_sizes(ctx.length, dist.get_world_size(ctx.group))
        return _all_gather(grad, ctx.dim, sizes, ctx.group), None, None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallel, before a column-parallel layer: all-gather the sequence
    forward, reduce-scatter the gradient backward (Korthikanti et al., figure 5's g)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        return _all_gather(x, 1, [x.shape[1]] * size, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel, after a row-parallel layer: reduce-scatter the sequence
    forward, all-gather the gradient backward (figure 5's g-bar)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        return _all_gather(grad, 1, [grad.shape[1]] * size, ctx.group), None


def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: ``x`` unchanged; its gradient is summed over ``group``."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: the sum of every rank's ``x``; the gradient passes through unchanged."""
    return _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, dim: int, sizes: list[int], group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (``sizes``: each rank's length)."""
    return _GatherFromGroup.apply(x, dim, list(sizes), group)


def split_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the sequence (dim 1) of ``x``; backward all-gathers."""
    _check_sequence(x.shape[1], dist.get_world_size(group))
    return _SplitToGroup.apply(x, 1, group)


def _check_sequence(length: int, size: int) -> None:
    if length % size:
        raise ValueError(f"sequence parallelism splits the sequence over the {size} ranks: "
                         f"{length} tokens do not split evenly; use a sequence length that is a "
                         f"multiple of {size}, or sequence_parallel=False")


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on, so that collectives on it (and
    on its gradient) move 2-byte elements, as the matrix product would use anyway."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(kind))
    return x


# ------------------------------------------------------------------------ the layers


def _shard(tensor: torch.Tensor | None, dim: int, group) -> nn.Parameter | None:
    """This rank's ``tensor_split`` shard along ``dim`` as a parameter of its own memory."""
    if tensor is None:
        return None
    piece = tensor.detach().tensor_split(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]
    return nn.Parameter(piece.clone(), requires_grad=tensor.requires_grad)


def _tensors(module: nn.Module, grads: bool) -> dict[str, torch.Tensor | None]:
    """A module's own parameters, or their gradients, detached."""
    pick = (lambda p: None if p.grad is None else p.grad.detach()) if grads else (
        lambda p: p.detach())
    return {n: pick(p) for n, p in module.named_parameters(recurse=False)}


def _gather_or_none(x: torch.Tensor | None, dim: int, sizes: list[int], group):
    return None if x is None else _all_gather(x, dim, sizes, group)


def _check_width(n: int, what: str, size: int, cls: str) -> None:
    if n < size:
        raise ValueError(f"{cls}: {n} {what} cannot be split over {size} ranks (every rank needs "
                         f"at least one); use a tensor-parallel group of at most {n} ranks")


class ColumnParallelLinear(nn.Module):
    """``ColumnParallelLinear(linear, group=None, gather_output=False)``: the output
    features of ``linear`` split over the ranks of ``group``.

    Keeps this rank's ``tensor_split`` shard of the rows of ``linear.weight`` (PyTorch
    stores the output features as rows) and of ``linear.bias``. Takes the full input and
    returns this rank's slice of the output, or the full output with
    ``gather_output=True`` (an all-gather). The input's gradient is summed over the
    group (f). With ``sequence_parallel=True`` the input is this rank's slice of the
    sequence, all-gathered forward and reduce-scattered backward instead.

    A rank that is not a member of ``group`` keeps no shard and its forward returns None
    at once, as torch.distributed's collectives do."""

    def __init__(self, linear: nn.Linear, group=None, gather_output: bool = False, *,
                 sequence_parallel: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        if not _member(group):
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
            return
        _check_width(self.out_features, "output features", dist.get_world_size(group), "ColumnParallelLinear")
        self.weight = _shard(linear.weight, 0, group)
        self.bias = _shard(linear.bias, 0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.weight is None:
            return None
        x = _compute_dtype(x)
        x = _GatherSequence.apply(x, self.group) if self.sequence_parallel else copy_to_group(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            return gather_from_group(y, -1, shard_sizes(self.out_features, dist.get_world_size(self.group)),
                                     self.group)
        return y

    def full_parameters(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """The whole weight and bias (or their gradients), gathered from every rank
        (collective)."""
        sizes = shard_sizes(self.out_features, dist.get_world_size(self.group))
        return {n: _gather_or_none(t, 0, sizes, self.group)
                for n, t in _tensors(self, grads).items()}

    def extra_repr(self) -> str:
        shard = None if self.weight is None else self.weight.shape[0]
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{shard}), bias={self.bias is not None}, gather_output={self.gather_output}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class RowParallelLinear(nn.Module):
    """``RowParallelLinear(linear, group=None)``: the input features of ``linear`` split
    over the ranks of ``group``.

    Keeps this rank's ``tensor_split`` shard of the columns of ``linear.weight`` and the
    whole ``linear.bias``. Takes this rank's slice of the input features and all-reduces
    the partial products (g), then adds the bias once. With ``sequence_parallel=True``
    the sum is reduce-scattered along the sequence instead; the bias's gradient is then
    partial (see :func:`allreduce_sequence_parallel_grads`).

    A rank that is not a member of ``group`` keeps no shard and its forward returns None."""

    def __init__(self, linear: nn.Linear, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group, self.sequence_parallel = group, sequence_parallel
        if not _member(group):
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
            return
        _check_width(self.in_features, "input features", dist.get_world_size(group), "RowParallelLinear")
        self.weight = _shard(linear.weight, 1, group)
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        if sequence_parallel and self.bias is not None:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.weight is None:
            return None
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"RowParallelLinear takes this rank's slice of the input features: "
                             f"{self.weight.shape[1]} of {self.in_features}, got {x.shape[-1]}; feed "
                             f"it the output of a ColumnParallelLinear (gather_output=False)")
        y = F.linear(x, self.weight)
        y = _ReduceScatterSequence.apply(y, self.group) if self.sequence_parallel else \
            reduce_from_group(y, self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def full_parameters(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        sizes = shard_sizes(self.in_features, dist.get_world_size(self.group))
        full = _tensors(self, grads)
        full["weight"] = _gather_or_none(full["weight"], 1, sizes, self.group)
        return full

    def extra_repr(self) -> str:
        shard = None if self.weight is None else self.weight.shape[1]
        return (f"in_features={self.in_features} (this rank: {shard}), out_features="
                f"{self.out_features}, bias={self.bias is not None}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows (the vocabulary) are split over the group: each
    rank looks up the tokens of its range, zeros elsewhere, and g sums the pieces
    (one all-reduce of ``b·s·h`` forward, none backward)."""

    def __init__(self, embedding: nn.Embedding, group=None):
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports plain embeddings only (no "
                             "padding_idx, max_norm or sparse gradients)")
        size = dist.get_world_size(group)
        _check_width(embedding.num_embeddings, "tokens", size, "VocabParallelEmbedding")
        self.group, self.num_embeddings = group, embedding.num_embeddings
        self.start = sum(shard_sizes(self.num_embeddings, size)[:dist.get_rank(group)])
        self.weight = _shard(embedding.weight, 0, group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_group(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def full_parameters(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        sizes = shard_sizes(self.num_embeddings, dist.get_world_size(self.group))
        return {"weight": _gather_or_none(_tensors(self, grads)["weight"], 0, sizes, self.group)}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} tokens, this rank: {self.start}..."
                f"{self.start + self.weight.shape[0] - 1}, dim {self.weight.shape[1]}")


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 group=None) -> torch.Tensor:
    """Mean cross-entropy from this rank's slice of the logits over a vocabulary of
    ``vocab_size`` tokens (the output of a column-parallel head), without gathering them
    (Megatron's algorithm).

    Three all-reduces of one float per token: the largest logit (for a stable
    log-sum-exp), the target's logit (held by one rank, zero on the others) and the sum
    of the exponentials. Gathering the logits would move ``b·s·V`` elements. Backward
    needs no collective: each rank's logits get ``softmax - one_hot`` on its own slice."""
    sizes = shard_sizes(vocab_size, dist.get_world_size(group))
    rank = dist.get_rank(group)
    if logits.shape[-1] != sizes[rank]:
        raise ValueError(f"rank {rank} holds {sizes[rank]} of the {vocab_size} logits, got "
                         f"{logits.shape[-1]}; pass the output of the column-parallel head")
    start = sum(sizes[:rank])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    peak = logits.detach().amax(dim=-1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    local = targets - start
    outside = (local < 0) | (local >= sizes[rank])
    picked = shifted.gather(-1, local.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_group(picked.masked_fill(outside, 0.0), group)
    sum_exp = reduce_from_group(shifted.exp().sum(-1), group)
    return (sum_exp.log() - picked).mean()


# ------------------------------------------------------------------------- the model


def heads_per_rank(n_head: int, size: int) -> int:
    """Heads each rank computes; a clear error when they do not split evenly."""
    if n_head % size:
        fits = [t for t in range(1, n_head + 1) if n_head % t == 0]
        raise ValueError(f"{n_head} attention heads cannot be split over {size} ranks: tensor "
                         f"parallelism gives each rank whole heads. Use a tensor-parallel size that "
                         f"divides {n_head} ({fits}) or a model whose head count is a multiple of {size}")
    return n_head // size


def qkv_rows_by_rank(d_model: int, n_head: int, size: int) -> torch.Tensor:
    """The order of a fused qkv weight's rows (q, k, v stacked, ``d_model`` each) that
    puts rank r's q, k and v rows (those of its heads) in its ``tensor_split`` piece:
    ``grouped = weight[order]``. A plain split of the fused weight would give rank 0
    all the queries."""
    width = heads_per_rank(n_head, size) * (d_model // n_head)
    return torch.cat([torch.arange(r * width, (r + 1) * width) + part * d_model
                      for r in range(size) for part in range(3)])


def _reordered(linear: nn.Linear, order: torch.Tensor) -> nn.Linear:
    """A copy of ``linear`` with its output features (rows) in ``order``."""
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device="meta")
    out.weight = nn.Parameter(linear.weight.detach()[order.to(linear.weight.device)],
                              requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach()[order.to(linear.bias.device)],
                                requires_grad=linear.bias.requires_grad)
    return out


class ParallelSelfAttention(nn.Module):
    """Causal self-attention over this rank's heads: ``qkv`` yields the q, k and v of
    its heads (a column-parallel layer over rows grouped by :func:`qkv_rows_by_rank`),
    ``proj`` is row-parallel over the same heads' features. It computes what
    :class:`distlab.model.CausalSelfAttention` does, with the local head count taken
    from the width of ``qkv``'s output (that class reads it from its config).
    ``qkv_order`` is kept to rebuild the full weight (:func:`full_state_dict`)."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, head_dim: int, qkv_order: torch.Tensor):
        super().__init__()
        self.qkv, self.proj, self.head_dim, self.qkv_order = qkv, proj, head_dim, qkv_order

    def forward(self, x):
        qkv = self.qkv(x)
        b, s, _ = qkv.shape  # under sequence parallelism x holds a slice of the sequence
        q, k, v = (z.view(b, s, -1, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


def _grouped_attention(attn: nn.Module, size: int, column, row) -> ParallelSelfAttention:
    d_model = attn.qkv.in_features
    order = qkv_rows_by_rank(d_model, attn.n_head, size)
    return ParallelSelfAttention(column(_reordered(attn.qkv, order)), row(attn.proj),
                                 d_model // attn.n_head, order)


def parallel_attention(attn: nn.Module, group=None, *,
                       sequence_parallel: bool = False) -> ParallelSelfAttention:
    """The GPT's :class:`~distlab.model.CausalSelfAttention` split by heads over
    ``group``: qkv column-parallel over this rank's heads, proj row-parallel. One
    all-reduce forward (in proj), one backward (at qkv's input)."""
    size = dist.get_world_size(group)
    heads_per_rank(attn.n_head, size)
    return _grouped_attention(
        attn, size, lambda m: ColumnParallelLinear(m, group, sequence_parallel=sequence_parallel),
        lambda m: RowParallelLinear(m, group, sequence_parallel=sequence_parallel))


def parallel_mlp(mlp: nn.Module, group=None, *, sequence_parallel: bool = False) -> nn.Module:
    """The GPT's :class:`~distlab.model.MLP`, in place: up column-parallel, down
    row-parallel, so that GELU runs on this rank's hidden features and one all-reduce
    forward (in down) and one backward (at up's input) remain."""
    mlp.up = ColumnParallelLinear(mlp.up, group, sequence_parallel=sequence_parallel)
    mlp.down = RowParallelLinear(mlp.down, group, sequence_parallel=sequence_parallel)
    return mlp


def tensor_parallel(model: nn.Module, group=None, *, vocab_parallel: bool = False,
                    sequence_parallel: bool = False) -> nn.Module:
    """Make a :class:`distlab.model.GPT` tensor-parallel over ``group``, in place, by
    replacing its submodules; parameter names stay those of the GPT.

    Per block: attention split by heads (qkv column-parallel, proj row-parallel) and
    the MLP (up column-parallel, down row-parallel). Embeddings, LayerNorms and the
    head stay replicated unless ``vocab_parallel``: then the token embedding and the
    head (tied or not) are split over the vocabulary, the model returns this rank's
    slice of the logits, and the loss is :func:`vocab_parallel_cross_entropy`.
    ``sequence_parallel`` runs LayerNorms and residuals on a slice of the sequence;
    after backward, call :func:`allreduce_sequence_parallel_grads`.

    Every rank must start from the same weights (same seed, or a broadcast)."""
    from distlab.model import GPT

    if not isinstance(model, GPT):
        raise TypeError(f"tensor_parallel applies to distlab.model.GPT, got {type(model).__name__}")
    if not _member(group):
        raise ValueError("this rank is not in the tensor-parallel group: call tensor_parallel "
                         "only on the group's ranks")
    if any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules()):
        raise ValueError("this model is already tensor-parallel; build a fresh GPT")
    size = dist.get_world_size(group)
    heads_per_rank(model.cfg.n_head, size)
    tied = model.head.weight is model.tok_emb.weight

    for block in model.blocks:
        block.attn = parallel_attention(block.attn, group, sequence_parallel=sequence_parallel)
        parallel_mlp(block.mlp, group, sequence_parallel=sequence_parallel)
    if vocab_parallel:
        head = model.head
        model.tok_emb = VocabParallelEmbedding(model.tok_emb, group)
        model.head = ColumnParallelLinear(head, group, sequence_parallel=sequence_parallel)
        if tied:  # the same vocabulary rows on this rank: the tie holds shard by shard
            model.head.weight = model.tok_emb.weight
    if sequence_parallel:
        model.blocks[0].register_forward_pre_hook(lambda _, args: (split_sequence(args[0], group),))
        if not vocab_parallel:  # a replicated head needs the whole sequence
            model.ln_f.register_forward_hook(lambda _, __, out: gather_from_group(
                out, 1, [out.shape[1]] * size, group))
        for norm in [b.ln1 for b in model.blocks] + [b.ln2 for b in model.blocks] + [model.ln_f]:
            for p in norm.parameters():
                p.sequence_parallel = True
    return model


def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> None:
    """Sum over ``group`` the gradients of the replicated parameters that see only this
    rank's slice of the sequence (LayerNorms, row-parallel biases; marked
    ``sequence_parallel``): one all-reduce of them all, after backward (as Megatron)."""
    grads = [p.grad for p in model.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the single-process model, gathered on every rank from a model
    made parallel by :func:`tensor_parallel` or :func:`parallelize_with_torch`
    (collective: every rank of the group calls it)."""
    return _gathered(model, dict(model.state_dict()), grads=False)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """The gradients the single-process model would hold, by parameter name (tied
    parameters under each of their names), gathered as :func:`full_state_dict`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return _gathered(model, {n: p.grad for n, p in params.items()}, grads=True)


def _gathered(model: nn.Module, tensors: dict, grads: bool) -> dict:
    # DTensors exist only once torch.distributed.tensor is imported (a slow import)
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    out = {n: None if t is None else t.full_tensor() if isinstance(t, dtensor) else
           t.detach().clone() for n, t in tensors.items()}
    for name, module in model.named_modules(remove_duplicate=False):
        if hasattr(module, "full_parameters"):
            for key, value in module.full_parameters(grads).items():
                out[f"{name}.{key}" if name else key] = value
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ParallelSelfAttention):
            for key in ("weight", "bias"):
                grouped = out.get(f"{name}.qkv.{key}")
                if grouped is not None:
                    original = torch.empty_like(grouped)
                    original[module.qkv_order.to(grouped.device)] = grouped
                    out[f"{name}.qkv.{key}"] = original
    return out


def parallelize_with_torch(model: nn.Module, mesh) -> nn.Module:
    """The same split with PyTorch's own tensor parallelism (DTensor): ``ColwiseParallel``
    on qkv and up, ``RowwiseParallel`` on proj and down, over a 1-D ``DeviceMesh``.

    Torch shards a weight in even ``torch.chunk`` pieces of its rows, so the fused qkv is
    regrouped by heads first, as for :func:`tensor_parallel` (torchtitan's models have
    separate q, k and v projections instead)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    size = mesh.size()
    heads_per_rank(model.cfg.n_head, size)
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    for block in model.blocks:
        block.attn = _grouped_attention(block.attn, size, lambda m: m, lambda m: m)
        parallelize_module(block, mesh, plan)
    return model


def dtensor_param_groups(model: nn.Module) -> list[dict]:
    """The parameters of a model made parallel by :func:`parallelize_with_torch` as two
    optimizer parameter groups: the DTensors (the split linears), then the plain tensors
    (embeddings, LayerNorms, head, replicated on every rank).

    A foreach or fused optimizer step, PyTorch's default for CUDA tensors, runs one
    kernel over a list of tensors and refuses a list that mixes DTensors with plain
    tensors; one group of each keeps that fast step for both. Torch's own examples
    instead make every parameter a DTensor, by also splitting the embedding and running
    the LayerNorms sequence-parallel: a different split from this one."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)],
              [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": group} for group in groups if group]


def allreduce_bytes_per_layer(batch: int, seq: int, hidden: int, tp: int,
                              element_size: int = 2) -> float:
    """Bytes each rank sends (and receives) per transformer layer, forward and backward:
    4 all-reduces of ``b·s·h`` elements, each moving ``2(t-1)/t`` of its size through
    every rank's link in a ring (nccl-tests' bus factor), times the bytes per element:
    ``8·b·s·h·(t-1)/t · element_size`` (Narayanan et al. 2021, section 3.2, count the
    ``8·b·s·h·(t-1)/t`` in elements)."""
    return 4 * batch * seq * hidden * comm.bus_factor("all_reduce", tp) * element_size
