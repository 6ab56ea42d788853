"""A small GPT (GPT-2 style, pre-LayerNorm) with no parallel code in it.

Token and position embeddings, ``n_layer`` blocks of causal self-attention and a GELU
MLP, a final LayerNorm and a language-model head, optionally tied to the token
embedding (Press & Wolf 2017). Parallel strategies wrap this model; it never imports
``torch.distributed``.

Sizes (:data:`PRESETS`) run from ``"test"`` (a few thousand parameters, milliseconds
a step on a CPU) to ``"gpt-100m"`` for GPU runs. :meth:`GPT.num_params` counts the
parameters and :meth:`GPT.flops_per_token` the training FLOPs of one token, which
:mod:`distlab.bench.throughput` turns into model FLOPs utilisation (MFU).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int          # the longest context the position embedding holds
    n_layer: int
    n_head: int
    d_model: int
    tie_weights: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head} "
                             f"(each head gets d_model/n_head features); change one of them")


PRESETS = {
    "test": dict(seq_len=16, n_layer=2, n_head=2, d_model=16),
    "tiny": dict(seq_len=64, n_layer=2, n_head=4, d_model=64),
    "small": dict(seq_len=256, n_layer=6, n_head=6, d_model=384),
    "gpt-100m": dict(seq_len=1024, n_layer=12, n_head=12, d_model=768),
}


def config(name: str, vocab_size: int, **overrides) -> GPTConfig:
    """A preset size for a language of ``vocab_size`` tokens; ``overrides`` change fields."""
    if name not in PRESETS:
        raise ValueError(f"unknown model size {name!r}; choose one of {sorted(PRESETS)}")
    return GPTConfig(vocab_size=vocab_size, **{**PRESETS[name], **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``GPT(cfg)(tokens)`` maps a (batch, time) tensor of token ids to (batch, time,
    vocab) logits of the next token at every position."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: residual projections scaled by 1/sqrt(2 n_layer)
            for proj in (block.attn.proj, block.mlp.down):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream entering the first block: token plus position embeddings."""
        if tokens.dim() != 2:
            raise ValueError(f"GPT takes a (batch, time) tensor of token ids, got shape "
                             f"{tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len="
                             f"{self.cfg.seq_len}; cut it or build the model with a longer one")
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(t, device=tokens.device))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits from the residual stream leaving the last block."""
        return self.head(self.ln_f(x))

    def num_params(self, matmul_only: bool = False) -> int:
        """Parameters of the model, each tied tensor once.

        ``matmul_only`` leaves out the embedding tables that are only looked up (the
        position embedding, and the token embedding unless it is tied to the head,
        whose matrix multiply does cost FLOPs): the N of the 6N rule."""
        params = {id(p): p for p in self.parameters()}
        if matmul_only:
            params.pop(id(self.pos_emb.weight))
            if not self.cfg.tie_weights:
                params.pop(id(self.tok_emb.weight))
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token at context ``seq_len``:
        ``6 N + 12 L d T``.

        6N: each of the N matmul weights costs 2 FLOPs (multiply, add) per token forward
        and 4 backward (Kaplan et al. 2020, "Scaling laws", section 2.1). 12 L d T: the
        attention scores QK^T and their product with V, 2·2·d·T FLOPs per token and
        layer forward, times 3 for training (Chowdhery et al. 2022, PaLM, appendix B).
        Like PaLM (and the MFU figures people publish), it counts the full T×T score
        matrix although a causal mask needs only half of it."""
        t = self.cfg.seq_len if seq_len is None else seq_len
        return 6 * self.num_params(matmul_only=True) + 12 * self.cfg.n_layer * self.cfg.d_model * t
