"""distlab.collectives.ring (the reference ring), its layout and traffic, distlab.bench.ring
and distlab.viz.ring.

Correctness is equality with the sum computed on one process. One launch per world
size runs every case; the tests of 4 ranks come last so that they share warm ranks.
"""
import pytest
import torch
import torch.distributed as dist

from distlab import backend, launch
from distlab.collectives import ring, ring_layout, ring_traffic
from distlab.shards import shard_sizes
from distlab.bench import ring as ring_bench
from distlab.comm import CommLog

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)


def _inputs(numel, dtype, K, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return [torch.randint(-2**50, 2**50, (numel,), generator=g) for _ in range(K)]
    return [torch.randint(-8, 8, (numel,), generator=g).to(dtype) for _ in range(K)]


def _all_cases():
    """Every case at the backend's piece size and at 12-byte pieces (many pieces per
    chunk, so that the pipeline and its receive slots wrap around); returns the failures."""
    default = ring_layout.PIECE_BYTES
    try:
        return [f for piece_bytes in (None, 12) for f in _cases(piece_bytes)]
    finally:
        ring_layout.PIECE_BYTES = default  # the ranks stay warm for the next launch


def _cases(piece_bytes):
    rank, K = dist.get_rank(), dist.get_world_size()
    device = backend.device()
    ring_layout.PIECE_BYTES = piece_bytes
    failures = []
    lengths = {0, 1, max(K - 1, 1), 13, 101} | ({4099} if piece_bytes is None else set())
    for numel in sorted(lengths):
        for dtype in DTYPES:
            case = f"{numel} x {dtype}, K={K}, pieces of {piece_bytes or 'default'} B"
            xs = [x.to(device) for x in _inputs(numel, dtype, K, seed=numel)]
            total = sum(x.double() for x in xs).to(dtype) if dtype != torch.int64 else sum(xs)
            mine = torch.tensor_split(total, K)[rank]

            x = xs[rank].clone()
            with CommLog() as log:
                out = ring.ring_allreduce(x)
            if out is not x or not torch.equal(x, total):
                failures.append(f"ring_allreduce {case}")
            problem = ring_traffic.check_traffic(log, "all_reduce", numel, x.element_size())
            if problem:
                failures.append(f"ring_allreduce traffic {case}: {problem}")

            x = xs[rank].clone()
            with CommLog() as log:
                got = ring.ring_reduce_scatter(x)
            if not torch.equal(got, mine) or not torch.equal(x, xs[rank]):
                failures.append(f"ring_reduce_scatter {case} (or it changed its input)")
            if ring_traffic.check_traffic(log, "reduce_scatter", numel, x.element_size()):
                failures.append(f"ring_reduce_scatter traffic {case}")

            with CommLog() as log:
                got = ring.ring_all_gather(mine.clone(), numel)
            if not torch.equal(got, total):
                failures.append(f"ring_all_gather {case}")
            if ring_traffic.check_traffic(log, "all_gather", numel, x.element_size()):
                failures.append(f"ring_all_gather traffic {case}")

            y = xs[rank].clone()
            ring.plain_ring_allreduce(y)
            if not torch.equal(y, total):
                failures.append(f"plain_ring_allreduce {case}")
    x = _inputs(35, torch.float32, K, seed=7)[rank].reshape(5, 7).to(device)  # any shape
    ring.ring_allreduce(x)
    if not torch.equal(x.cpu(), sum(_inputs(35, torch.float32, K, seed=7)).reshape(5, 7)):
        failures.append("ring_allreduce of a 5x7 tensor")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equals_the_single_process_sum(world_size):
    for rank, failures in enumerate(launch.run(_all_cases, world_size, backend="gloo",
                                               timeout=120)):
        assert failures == [], f"rank {rank}: {failures[:5]}"


@pytest.mark.multigpu
def test_equals_the_single_process_sum_on_gpus():
    """NCCL, 2 GPUs: every rank's calls run in order on one stream there, and a group
    ends only when all its operations have; the reference obeys (test_p2p_check)."""
    for rank, failures in enumerate(launch.run(_all_cases, 2, backend="nccl", timeout=300)):
        assert failures == [], f"rank {rank}: {failures[:5]}"


def _large(sizes, piece_bytes):
    """Large buffers on GPUs, of odd lengths: whole chunks (NCCL's pieces), then pieces."""
    rank, K, device = dist.get_rank(), dist.get_world_size(), backend.device()
    failures = []
    saved, ring_layout.PIECE_BYTES = ring_layout.PIECE_BYTES, piece_bytes
    try:
        for numel in sizes:
            g = torch.Generator(device=device).manual_seed(numel)
            xs = [torch.randint(-8, 8, (numel,), generator=g, device=device).float()
                  for _ in range(K)]
            x = xs[rank].clone()
            ring.ring_allreduce(x)
            if not torch.equal(x, sum(xs)):
                failures.append(f"ring_allreduce of {numel} float32 on {K} GPUs, pieces of "
                                f"{piece_bytes or 'default'} B")
    finally:
        ring_layout.PIECE_BYTES = saved
    return failures


@pytest.mark.multigpu
@pytest.mark.parametrize("piece_bytes", [None, 48 << 20])
def test_large_buffers_on_gpus(piece_bytes):
    """256 MiB hung before the ring issued the same groups on every rank; 48 MiB pieces
    cut its 128 MiB chunks in three."""
    sizes = [(1 << 20) + 3, (64 << 18) + 5, 256 << 18]
    for rank, failures in enumerate(launch.run(_large, 2, sizes, piece_bytes, backend="nccl",
                                               timeout=300)):
        assert failures == [], f"rank {rank}: {failures}"


@pytest.mark.multigpu
def test_bench_in_cuda_graphs_on_gpus():
    """The ring's grouped sends and receives, its waits and additions, captured in a CUDA
    graph and replayed, beside NCCL's all_reduce captured the same way."""
    result = ring_bench.measure("all_reduce", [1 << 20], 2, "nccl", rounds=1, iters=2,
                                graph=True, timeout=180)
    assert all(r > 0 for rs in result.ratio.values() for r in rs)
    assert "CUDA graphs" in result.table()


def test_piece_count_follows_the_backend():
    MiB = 1 << 20
    assert [ring_layout.piece_count(c * MiB, "nccl")
            for c in (32, 256, 512, 768, 2048)] == [1, 1, 1, 2, 4]
    # gloo: at most 4 MiB, and LOOKAHEAD + 1 pieces while each keeps 2 MiB
    assert [ring_layout.piece_count(c * MiB, "gloo")
            for c in (1, 3, 4, 6, 16, 64)] == [1, 1, 2, 3, 4, 16]
    assert ring_layout.piece_count(0, "nccl") == 1


@pytest.mark.parametrize("numel,K,size,backend_name", [
    (1 << 28, 2, 4, "nccl"), ((3 << 28) // 2, 2, 4, "nccl"), ((1 << 26) + 7, 3, 4, "nccl"),
    ((1 << 24) + 5, 4, 2, "gloo"), (101, 3, 8, "gloo"), (5, 7, 4, "gloo"), (0, 2, 4, "gloo")])
def test_pieces_are_aligned_and_cover_every_chunk(numel, K, size, backend_name):
    P, width = ring_layout.piece_layout(numel, K, size, backend_name)
    biggest = max(shard_sizes(numel, K))
    assert width * size % ring_layout.ALIGN_BYTES == 0      # each piece starts 256 B into its chunk
    # rounding up merges pieces, never adds one
    assert P <= ring_layout.piece_count(biggest * size, backend_name)
    if biggest:                                       # no empty piece in the largest chunk
        assert (P - 1) * width < biggest <= P * width


def test_pieces_of_a_third_of_512_MiB_are_aligned():
    """The layout that halved the ring's speed: a 512 MiB chunk in three, at 4-byte offsets."""
    saved, ring_layout.PIECE_BYTES = ring_layout.PIECE_BYTES, 171 << 20
    try:
        P, width = ring_layout.piece_layout(1 << 28, 2, 4, "nccl")
    finally:
        ring_layout.PIECE_BYTES = saved
    assert P == 3 and width * 4 % 256 == 0 and 3 * width >= 1 << 27


def _subgroups():
    """Rings over groups that are not the default one (group ranks are not global ranks)."""
    rank = dist.get_rank()
    results = {}
    groups = {tuple(m): dist.new_group(m) for m in ([1, 2, 3], [0, 2], [3])}  # all ranks
    for members, group in groups.items():
        if rank not in members:  # outside: None at once, inputs untouched
            x = torch.ones(3)
            results[members] = (ring.ring_allreduce(x, group=group),
                                ring.ring_reduce_scatter(x, group=group),
                                ring.ring_all_gather(x, 7, group=group), x.tolist())
            continue
        x = torch.arange(10, dtype=torch.float64) * (rank + 1)
        ring.ring_allreduce(x, group=group)
        chunk = ring.ring_reduce_scatter(torch.full((7,), float(rank)), group=group)
        full = ring.ring_all_gather(chunk, 7, group=group)
        results[members] = (x.tolist(), full.tolist())
    return results


def test_subgroups():
    runs = launch.run(_subgroups, 4, backend="gloo", timeout=60)
    for members in ([1, 2, 3], [0, 2], [3]):
        scale = sum(r + 1 for r in members)
        want_sum = [float(i * scale) for i in range(10)]
        want_full = [float(sum(members))] * 7
        for r in members:
            assert runs[r][tuple(members)] == (want_sum, want_full), (members, r)
        for r in set(range(4)) - set(members):
            assert runs[r][tuple(members)] == (None, None, None, [1.0] * 3), (members, r)


def _misuse():
    errors = []
    for call in (lambda: ring.ring_allreduce(torch.zeros(4, 6).t()),
                 lambda: ring.ring_reduce_scatter([1.0, 2.0]),
                 lambda: ring.ring_all_gather(torch.zeros(5), 13)):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    return errors


def test_bad_input_names_the_fix():
    contiguous, not_tensor, wrong_chunk = launch.run(_misuse, 4, backend="gloo", timeout=60)[0]
    assert contiguous and "contiguous()" in contiguous
    assert not_tensor and "torch.Tensor" in not_tensor
    assert wrong_chunk and "4 elements" in wrong_chunk and "has 5" in wrong_chunk


def _traffic_of_wrong_rings():
    """check_traffic must catch what is not a ring."""
    rank, K = dist.get_rank(), dist.get_world_size()
    x = torch.ones(12)
    with CommLog() as collective:
        dist.all_reduce(x)
    with CommLog() as whole:  # the whole buffer around the ring, K-1 times
        for _ in range(K - 1):
            buf = torch.empty(12)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % K),
                                             dist.P2POp(dist.irecv, buf, (rank - 1) % K)]):
                w.wait()
    with CommLog() as star:   # everyone sends its chunk to everyone
        ops = []
        for q in range(K):
            if q != rank:
                ops += [dist.P2POp(dist.isend, x[:3].clone(), q),
                        dist.P2POp(dist.irecv, torch.empty(3), q)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return [ring_traffic.check_traffic(log, "all_gather", 12, 4)
            for log in (collective, whole, star)]


def test_check_traffic_catches_what_is_not_a_ring():
    for collective, whole, star in launch.run(_traffic_of_wrong_rings, 4, backend="gloo"):
        assert "all_reduce" in collective and "collective" in collective
        assert "more than one chunk" in whole
        assert "sends only to its next neighbour" in star


@pytest.mark.parametrize("K", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [0, 1, 5, 13, 1000])
def test_bytes_sent_total_is_the_ring_volume(K, numel):
    sizes = shard_sizes(numel, K)
    assert sizes == [c.numel() for c in torch.tensor_split(torch.empty(numel), K)]
    total = sum(ring_traffic.bytes_sent("all_reduce", numel, 2, r, K) for r in range(K))
    assert total == 2 * (K - 1) * numel * 2  # K ranks x 2(K-1)/K of N bytes
    for direction in (1, -1):
        rs = [ring_traffic.bytes_sent("reduce_scatter", numel, 1, r, K, direction)
              for r in range(K)]
        ag = [ring_traffic.bytes_sent("all_gather", numel, 1, r, K, direction)
              for r in range(K)]
        assert sum(rs) == sum(ag) == (K - 1) * numel


@pytest.fixture(scope="module")
def record4():
    return ring_traffic.record(4, numel=10)


def test_record_follows_the_algorithm(record4):
    rec, K = record4, 4
    assert rec.steps == 2 * (K - 1) and rec.chunk_sizes == [3, 3, 2, 2]
    everyone = frozenset(range(K))
    assert all(rec.holds[0][r][c] == {r} for r in range(K) for c in range(K))
    for k in range(1, rec.steps + 1):
        for r in range(K):
            c = rec.moved[k][r]
            before, after = rec.holds[k - 1][r][c], rec.holds[k][r][c]
            sender = rec.holds[k - 1][(r - 1) % K][c]
            if k < K:   # reduce-scatter: the sender's partial sum is added to ours
                assert c == (r - k - 1) % K and after == before | sender and len(after) == k + 1
            else:       # all-gather: a complete chunk replaces ours
                assert after == everyone and sender == everyone
            sent = [(op, peer, b) for op, peer, b in rec.calls[k][r] if op in ("send", "isend")]
            got = [(op, peer, b) for op, peer, b in rec.calls[k][r] if op in ("recv", "irecv")]
            chunk_bytes = 4 * rec.chunk_sizes[c]   # float32, record()'s default
            assert got == [("irecv", (r - 1) % K, chunk_bytes)]
            assert [(peer, b) for _, peer, b in sent] == [
                ((r + 1) % K, 4 * rec.chunk_sizes[rec.moved[k][(r + 1) % K]])]
    assert all(rec.holds[K - 1][r][r] == everyone for r in range(K))
    assert all(h == everyone for row in rec.holds[-1] for h in row)


def test_stepper_steps_and_draws(record4):
    from distlab.viz.ring import RingStepper, cell_label, steps_figure

    stepper = RingStepper(record4)
    assert stepper.next.description == "next" and stepper.step == 0
    first = stepper.image.value
    stepper.next.click()
    assert stepper.step == 1 and "step 1 of 6" in stepper.label.value
    assert "reduce-scatter 1/3" in stepper.label.value and stepper.image.value != first
    for _ in range(10):
        stepper.next.click()
    assert stepper.step == 6 and stepper.next.disabled and "all-gather 3/3" in stepper.label.value
    stepper.reset.click()
    assert stepper.step == 0 and stepper.prev.disabled
    bundle = stepper._repr_mimebundle_()
    assert bundle["image/png"].startswith(b"\x89PNG") and "RingStepper" in bundle["text/plain"]
    assert len(steps_figure(record4).axes) == 8
    assert cell_label(frozenset({0, 2}), 3, 4) == "a3+c3"
    assert cell_label(frozenset(range(4)), 1, 4) == "Σ1"


def test_bench_checks_answers_and_reports_ratios(tmp_path):
    def wrong(x):
        x.mul_(2)

    with pytest.raises(launch.RankError, match="wrong all_reduce"):
        ring_bench.measure("all_reduce", [4096], 4, rounds=1, contenders={"wrong": wrong})
    result = ring_bench.measure("all_reduce", [4096, 65536], 4, rounds=2)
    assert list(result.seconds) == ["backend", "plain ring", "reference ring"]
    assert all(t > 0 for ts in result.seconds.values() for t in ts)
    assert all(r > 0 for rs in result.ratio.values() for r in rs)
    for name, ratios in result.ratio.items():  # the median lies within the rounds' range
        assert all(low <= r <= high for r, (low, high) in zip(ratios, result.spread[name]))
    assert "median (min-max) of 2 rounds" in result.table()
    assert "reference ring" in result.table()
    assert list(result.host) == list(result.seconds), "the host's time of every contender"
    assert all(len(ts) == 2 and all(t > 0 for t in ts) for ts in result.host.values())
    assert "host's time to issue one call" in result.table()
    with pytest.raises(ValueError, match="needs GPUs"):
        ring_bench.measure("all_reduce", [4096], 2, rounds=1, graph=True)
    rs = ring_bench.measure("reduce_scatter", [65536], 4, rounds=1)
    assert list(rs.ratio) == ["reference ring", "all_reduce, keep a chunk"]
    from distlab.viz.ring import plot_bench

    plot_bench(result).savefig(tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_check_against_the_backend():
    assert ring_bench.check(3, "gloo", [(3, "uint8"), (1, "float32"), (4097, "bfloat16")]) == []


def test_bench_cli(tmp_path, capsys):
    assert ring_bench.main(["-b", "16K", "-e", "64K", "--rounds", "1", "--pieces", "8K",
                            "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "16 KiB" in out and "64 KiB" in out and "ring, 8 KiB" in out
    assert (tmp_path / "ring_bench.png").stat().st_size > 0
    assert '"reference ring, 8 KiB pieces"' in (tmp_path / "ring_bench.json").read_text()
