"""The synthetic language: is its entropy exact, does the sampler follow it, and is
the split of a global batch over ranks deterministic for any world size?"""
import itertools
import math

import numpy as np
import pytest
import torch

from distlab.data import NGramLanguage


def _sequence_probabilities(lang: NGramLanguage, length: int) -> dict[tuple, float]:
    """P(x_0..x_{length-1}) of every sequence, by brute force: the first k tokens from
    the stationary distribution, then the n-gram table, token by token."""
    v, k = lang.vocab_size, lang.context
    out = {}
    for seq in itertools.product(range(v), repeat=length):
        state = 0
        for x in seq[:k]:
            state = state * v + x
        p = lang.stationary[state]
        for x in seq[k:]:
            p *= lang.probs[state, x]
            state = (state % v ** (k - 1)) * v + x
        out[seq] = p
    return out


def _marginal_entropy(probs: dict[tuple, float], m: int) -> float:
    marginal: dict[tuple, float] = {}
    for seq, p in probs.items():
        marginal[seq[:m]] = marginal.get(seq[:m], 0.0) + p
    return -sum(p * math.log(p) for p in marginal.values() if p > 0)


@pytest.mark.parametrize("vocab,order,seq_len", [(3, 3, 4), (3, 3, 1), (4, 2, 3), (2, 4, 5)])
def test_loss_floor_is_the_exact_conditional_entropy(vocab, order, seq_len):
    """sum_t H(X_t | X_<t) over the predicted positions, from the probabilities of
    every possible window, equals the closed form."""
    lang = NGramLanguage(vocab, order, concentration=0.7, seed=3)
    probs = _sequence_probabilities(lang, seq_len + 1)
    assert abs(sum(probs.values()) - 1) < 1e-12
    conditional = [_marginal_entropy(probs, t + 1) - _marginal_entropy(probs, t)
                   for t in range(1, seq_len + 1)]
    assert lang.loss_floor(seq_len) == pytest.approx(np.mean(conditional), abs=1e-12)
    if seq_len >= lang.context:  # once k tokens are seen, each prediction costs h
        assert conditional[-1] == pytest.approx(lang.entropy_rate, abs=1e-12)


def test_stationary_distribution_is_stationary():
    lang = NGramLanguage(5, 3, concentration=0.3, seed=1)
    v, k = lang.vocab_size, lang.context
    after = np.zeros_like(lang.stationary)
    for s in range(v ** k):
        for x in range(v):
            after[(s % v ** (k - 1)) * v + x] += lang.stationary[s] * lang.probs[s, x]
    np.testing.assert_allclose(after, lang.stationary, atol=1e-14)
    assert lang.stationary.sum() == pytest.approx(1, abs=1e-14)
    assert lang.loss_floor(1000) > lang.entropy_rate > 0


def test_samples_follow_the_model():
    """On many samples, the mean -log P(token | its two predecessors) under the true
    table comes within 4 standard errors of the entropy rate at every position, and
    windows start in pi."""
    lang = NGramLanguage(6, 3, concentration=0.5, seed=2)
    v = lang.vocab_size
    seqs = lang.global_batch(step=0, batch_size=4000, seq_len=20).numpy()
    context = seqs[:, :-2] * v + seqs[:, 1:-1]
    nll = -np.log(lang.probs[context, seqs[:, 2:]])     # (sequence, position >= 2)
    stderr = nll.std(axis=0) / math.sqrt(len(nll))
    assert np.all(np.abs(nll.mean(axis=0) - lang.entropy_rate) < 4 * stderr)
    state = context[:, 0]
    freq = np.bincount(state, minlength=v * v) / len(state)
    sigma = np.sqrt(lang.stationary * (1 - lang.stationary) / len(state))
    assert np.all(np.abs(freq - lang.stationary) < 5 * sigma + 1e-9)


@pytest.mark.parametrize("batch_size", [1, 7, 12])
def test_ranks_split_the_global_batch_for_any_world_size(batch_size):
    lang = NGramLanguage(16, 3, seed=0)
    whole = lang.global_batch(5, batch_size, 9)
    for world in range(1, 6):
        pieces = [lang.batch(5, batch_size, 9, rank, world) for rank in range(world)]
        sizes = [x.shape[0] for x, _ in pieces]
        assert sizes == [len(r) for r in torch.arange(batch_size).tensor_split(world)]
        torch.testing.assert_close(torch.cat([x for x, _ in pieces]), whole[:, :-1])
        torch.testing.assert_close(torch.cat([y for _, y in pieces]), whole[:, 1:])


def test_batches_depend_on_seed_and_step_only():
    a, b = NGramLanguage(16, 3, seed=0), NGramLanguage(16, 3, seed=0)
    torch.testing.assert_close(a.global_batch(3, 4, 10), b.global_batch(3, 4, 10))
    assert not torch.equal(a.global_batch(3, 4, 10), a.global_batch(4, 4, 10))
    assert not torch.equal(a.global_batch(3, 4, 10), NGramLanguage(16, 3, seed=1).global_batch(3, 4, 10))
    x, y = a.batch(0, 4, 10)
    assert x.shape == y.shape == (4, 10) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 16 and int(x.min()) >= 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="contexts"):
        NGramLanguage(vocab_size=1000, order=3)
    with pytest.raises(ValueError, match="order"):
        NGramLanguage(order=1)
    with pytest.raises(ValueError, match="rank"):
        NGramLanguage().batch(0, 4, 8, rank=2, world_size=2)
