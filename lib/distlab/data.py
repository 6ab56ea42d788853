"""A synthetic language whose best reachable loss is known exactly.

Text is drawn from a random n-gram model: a Markov chain of order ``k = order - 1``
over ``vocab_size`` tokens whose next-token distribution for each of the ``V**k``
contexts is a draw from a Dirichlet(``concentration``) distribution (small values give
peaked, predictable rows). Sequences start in the chain's stationary distribution, so
every position looks alike and the entropy is computed exactly, not estimated:

* the entropy rate ``h = sum_s pi(s) H(P[s])`` (nats/token) is the loss of a perfect
  model that has seen at least ``k`` tokens of context;
* :meth:`NGramLanguage.loss_floor` is the exact minimum of the mean next-token
  cross-entropy over a training window, whose first ``k - 1`` predictions see less
  context (Cover & Thomas, *Elements of Information Theory*, ch. 4: the chain rule
  ``sum_t H(X_t | X_<t) = H(X_0..X_T) - H(X_0)``).

Batches are a function of ``(seed, step)`` only: rank ``r`` of ``world_size`` gets rows
``tensor_split(global_batch, world_size)[r]``, so the ranks' pieces put together are the
global batch of the single-process run, for any world size. Nothing is downloaded.
"""
from __future__ import annotations

import numpy as np
import torch

MAX_CONTEXTS = 8192  # the stationary distribution is a dense solve over V**k contexts


class NGramLanguage:
    """``NGramLanguage(vocab_size=16, order=3, concentration=0.2, seed=0)``.

    ``order`` counts the predicted token: order 3 predicts each token from the two
    before it (a trigram model)."""

    def __init__(self, vocab_size: int = 16, order: int = 3, concentration: float = 0.2,
                 seed: int = 0):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if order < 2:
            raise ValueError(f"order must be >= 2 (order 2 is a bigram model), got {order}")
        if concentration <= 0:
            raise ValueError(f"concentration must be > 0, got {concentration}")
        k = order - 1
        if vocab_size ** k > MAX_CONTEXTS:
            raise ValueError(f"vocab_size**(order-1) = {vocab_size ** k} contexts is more than "
                             f"{MAX_CONTEXTS}; use a smaller vocabulary or a lower order")
        self.vocab_size, self.order, self.context = vocab_size, order, k
        self.concentration, self.seed = concentration, seed
        rng = np.random.default_rng([seed, 0])
        # P[s, x]: probability of token x after context s (s = base-V digits, oldest first)
        self.probs = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size ** k)
        self.stationary = self._stationary()
        self._cum = torch.from_numpy(_cumulative(self.probs))
        self._cum_start = torch.from_numpy(_cumulative(self.stationary[None]))[0]

    def __repr__(self) -> str:
        return (f"NGramLanguage(vocab_size={self.vocab_size}, order={self.order}, "
                f"concentration={self.concentration}, seed={self.seed})")

    # ---------------------------------------------------------------- exact entropy

    def _next_state(self) -> np.ndarray:
        """``next[s, x]``: the context after token ``x`` follows context ``s``."""
        v, n = self.vocab_size, self.vocab_size ** self.context
        return (np.arange(n)[:, None] % (n // v)) * v + np.arange(v)[None, :]

    def _stationary(self) -> np.ndarray:
        """pi with pi T = pi, T the chain's transition matrix over contexts (dense solve)."""
        n = self.vocab_size ** self.context
        trans = np.zeros((n, n))
        np.add.at(trans, (np.repeat(np.arange(n), self.vocab_size), self._next_state().ravel()),
                  self.probs.ravel())
        a = trans.T - np.eye(n)
        a[-1] = 1.0  # replace one (redundant) balance equation by sum(pi) = 1
        b = np.zeros(n)
        b[-1] = 1.0
        pi = np.linalg.solve(a, b)
        return np.clip(pi, 0.0, None) / np.clip(pi, 0.0, None).sum()

    @property
    def entropy_rate(self) -> float:
        """h = sum_s pi(s) H(P[s]) in nats/token: the best loss once k tokens are seen."""
        return float(self.stationary @ _entropy(self.probs))

    def _prefix_entropy(self, m: int) -> float:
        """H(X_0..X_{m-1}) of the first m <= k tokens, in nats."""
        marginal = self.stationary.reshape(self.vocab_size ** m, -1).sum(axis=1)
        return float(_entropy(marginal))

    def loss_floor(self, seq_len: int) -> float:
        """The smallest mean cross-entropy (nats) any model can reach predicting tokens
        1..seq_len of a window from the tokens before each: ``(H(X_0..X_T) - H(X_0)) / T``."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        k = self.context
        if seq_len + 1 <= k:
            joint = self._prefix_entropy(seq_len + 1)
        else:
            joint = self._prefix_entropy(k) + (seq_len + 1 - k) * self.entropy_rate
        return (joint - self._prefix_entropy(1)) / seq_len

    # -------------------------------------------------------------------- sampling

    def sample(self, num: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``num`` sequences of ``length`` tokens (int64), from the stationary chain."""
        if length < self.context:
            raise ValueError(f"length must be >= {self.context} (the context of an order-"
                             f"{self.order} model), got {length}")
        # one row of uniforms per step, so that each step's slice is contiguous
        u = torch.rand(length - self.context + 1, num, 1, generator=generator,
                       dtype=torch.float64)
        v, k = self.vocab_size, self.context
        state = torch.searchsorted(self._cum_start, u[0, :, 0], right=True)
        digits = v ** torch.arange(k - 1, -1, -1)
        out = torch.empty(num, length, dtype=torch.int64)
        out[:, :k] = (state[:, None] // digits) % v
        for t in range(k, length):
            x = torch.searchsorted(self._cum[state], u[t - k + 1], right=True)[:, 0]
            out[:, t] = x
            state = (state % v ** (k - 1)) * v + x
        return out

    def global_batch(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """The ``batch_size`` windows of ``seq_len + 1`` tokens of training step ``step``."""
        seed = int(np.random.SeedSequence([self.seed, 1, step]).generate_state(1)[0])
        return self.sample(batch_size, seq_len + 1, torch.Generator().manual_seed(seed))

    def batch(self, step: int, batch_size: int, seq_len: int, rank: int = 0,
              world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` of step ``step``: rows
        ``tensor_split(range(batch_size), world_size)[rank]`` of the global batch
        (the first ``batch_size % world_size`` ranks get one row more). Targets are the
        inputs shifted by one token. A rank may get no rows when batch_size < world_size.
        Each rank draws the whole global batch and keeps its rows: cheap at the sizes of
        the labs, and the reason the split can never depend on the world size."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rows = self.global_batch(step, batch_size, seq_len).tensor_split(world_size)[rank]
        return rows[:, :-1], rows[:, 1:]


def _cumulative(probs: np.ndarray) -> np.ndarray:
    cum = np.cumsum(probs, axis=-1)
    cum[..., -1] = 1.0  # so that every u in [0, 1) lands on a token despite rounding
    return cum


def _entropy(p: np.ndarray) -> np.ndarray:
    """Shannon entropy in nats along the last axis (0 log 0 = 0)."""
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(axis=-1)
