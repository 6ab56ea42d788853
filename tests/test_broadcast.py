"""The reference pipelined broadcast: equals dist.broadcast on groups of 1 to 4 ranks,
uses P2P only along a chain, and its step model matches a simulation of the pipeline."""
import itertools

import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.collectives import broadcast, broadcast_model
from distlab.comm import CommLog
from distlab.grading import expect_close

GROUPS = [[0], [1, 3], [0, 2, 3], [0, 1, 2, 3]]  # world sizes 1 to 4 in one launch


def _against_dist_broadcast():
    rank = dist.get_rank()
    groups = [dist.new_group(m) for m in GROUPS]
    for members, group in zip(GROUPS, groups):
        if rank not in members:
            continue
        for src, numel, chunks in itertools.product(members, (1, 10, 333), (1, 3, 8)):
            g = torch.Generator().manual_seed(src + numel + chunks)
            data = torch.randn(numel, generator=g) if rank == src else torch.zeros(numel)
            expected = data.clone()
            dist.broadcast(expected, src=src, group=group)
            with CommLog() as log:
                out = broadcast.pipelined_broadcast(data, src, chunks, group=group)
            case = f"rank {rank}, group {members}, src {src}, {numel} elements, {chunks} chunks"
            expect_close(data, expected, case)
            assert out is data, case
            assert not log.collectives(), case
            assert log.bytes_sent() <= 4 * numel, f"{case}: forwards the buffer at most once"
            received = [e.nbytes for e in log.select("irecv")]
            want = [] if rank == src else [4 * c.numel() for c in
                                          torch.tensor_split(data, chunks) if c.numel()]
            assert received == want, case


def test_equals_dist_broadcast_on_groups_of_1_to_4_ranks():
    launch.run(_against_dist_broadcast, 4, backend="gloo", timeout=60)


def _simulated_steps(k, s):
    """Steps for S chunks to cross a chain of K ranks when each link moves one chunk per
    step and a rank forwards a chunk the step after it arrived."""
    arrived = [[0] * s] + [[None] * s for _ in range(k - 1)]  # step at which rank p has chunk c
    for p in range(1, k):
        link_free = 0
        for c in range(s):
            step = max(arrived[p - 1][c], link_free) + 1
            arrived[p][c], link_free = step, step
    return max((arrived[k - 1][c] for c in range(s)), default=0)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_step_count_matches_a_simulated_pipeline(k):
    for s in (1, 2, 5, 16):
        assert broadcast_model.steps(k, s) == _simulated_steps(k, s), (k, s)


def test_model_time_and_the_best_chunk_count():
    n, bw, alpha = 64e6, 10e9, 20e-6
    for k in (2, 4, 8):
        no_latency = [broadcast_model.model_seconds(n, k, s, bw) for s in (1, 2, 4, 1000)]
        assert no_latency == sorted(no_latency, reverse=True)  # lecture: more chunks, faster
        assert no_latency[0] == pytest.approx((k - 1) * n / bw)  # one chunk: store and forward
        best = broadcast_model.best_chunks(n, k, bw, alpha)
        brute = min(range(1, 5000), key=lambda s: broadcast_model.model_seconds(n, k, s, bw, alpha))
        assert broadcast_model.model_seconds(n, k, best, bw, alpha) == pytest.approx(
            broadcast_model.model_seconds(n, k, brute, bw, alpha))
    assert broadcast_model.best_chunks(n, 2, bw, alpha) == 1  # two ranks: chunking cannot help


def _bad_inputs():
    with pytest.raises(ValueError, match="contiguous"):
        broadcast.pipelined_broadcast(torch.zeros(4, 4).t(), 0, 2)
    with pytest.raises(ValueError, match="num_chunks"):
        broadcast.pipelined_broadcast(torch.zeros(4), 0, 0)
    with pytest.raises(ValueError, match="not a rank"):
        broadcast.pipelined_broadcast(torch.zeros(4), 7, 2)


def test_bad_inputs_name_the_fix():
    launch.run(_bad_inputs, 4, backend="gloo", timeout=30)


def test_fit_recovers_the_model():
    n, k = 4 << 20, 4
    for alpha, bw in ((1e-3, 2e9), (5e-6, 4e11)):
        counts = [1, 2, 4, 8, 16, 64]
        times = [broadcast_model.model_seconds(n, k, s, bw, alpha) for s in counts]
        got_alpha, got_bw = broadcast_model.fit(n, k, counts, times)
        assert got_alpha == pytest.approx(alpha, rel=1e-6)
        assert got_bw == pytest.approx(bw, rel=1e-6)
