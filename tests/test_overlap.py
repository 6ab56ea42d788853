"""distlab.dp.channels (channels, variants, the interleaved comparison) and
distlab.bench.overlap (the GPU bench's rank function on CPU ranks; the CLI on GPUs)."""
import json
import os
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import backend, launch
from distlab.bench import overlap as overlap_bench
from distlab.dp import channels as overlap
from distlab.comm import CommLog
from distlab.dp import DataParallel
from distlab.model import GPT, config

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = config("test", vocab_size=13)


def batch(rank, device="cpu"):
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(13, (3, 9), generator=g).to(device)
    return x[:, :-1], x[:, 1:]


def loss_of(model, rank, device="cpu"):
    x, y = batch(rank, device)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def cases():
    rank = dist.get_rank()
    out = {"channel": type(overlap.channel("auto", None, torch.device("cpu"))).__name__}
    for kind in ("stream", "raw-nccl", "nope"):
        try:
            overlap.channel(kind, None, torch.device("cpu"))
        except ValueError as e:
            out[kind] = str(e)
    # a channel averages, asynchronously
    ch = overlap.Handles()
    t = torch.full((5,), float(rank + 1), dtype=torch.float64)
    with CommLog() as log:
        handle = ch.launch(t)
        ch.wait([handle])
    out["mean"], out["async"] = t, [e.async_op for e in log.events]
    # every variant gives the same averaged gradients
    grads, steps = {}, {}
    for variant in overlap_bench.VARIANTS:
        torch.manual_seed(0)
        net = GPT(CFG).double()
        model, finish = overlap_bench.wrap(net, variant, 0.002)
        loss_of(model, rank).backward()
        finish()
        grads[variant] = {n: p.grad.clone() for n, p in net.named_parameters()}

        def step(model=model, finish=finish, net=net):
            loss_of(model, rank).backward()
            finish()
            net.zero_grad()
        steps[variant] = step
    out["grads"] = grads
    out["times"] = overlap_bench.compare(steps, rounds=2, iters=1, warmup=1)
    try:
        overlap_bench.wrap(GPT(CFG), "fastest")
    except ValueError as e:
        out["bad variant"] = str(e)
    return out


_results = {}


def results(world=2):
    if world not in _results:
        _results[world] = launch.run(cases, world, backend="gloo", timeout=60)
    return _results[world]


def test_channels_on_cpu():
    r = results()[0]
    assert r["channel"] == "Handles"
    assert "CUDA" in r["stream"] and "CUDA" in r["raw-nccl"] and "one of" in r["nope"]
    for rank, r in enumerate(results()):
        torch.testing.assert_close(r["mean"], torch.full((5,), 1.5, dtype=torch.float64))
        assert r["async"] == [True]


def test_every_variant_averages_the_same():
    out = results()
    for rank, r in enumerate(out):
        for variant, grads in r["grads"].items():
            for name, g in grads.items():
                want = torch.stack([o["grads"]["naive"][name] for o in out]).mean(0)
                torch.testing.assert_close(g, want, msg=f"rank {rank}, {variant}: {name}")
    assert "fastest" in out[0]["bad variant"]


def test_compare_times_each_variant_on_every_rank_alike():
    out = results()
    assert set(out[0]["times"]) == set(overlap_bench.VARIANTS)
    assert all(t > 0 for t in out[0]["times"].values())
    assert out[0]["times"] == out[1]["times"]  # the slowest rank's time, everywhere


def test_environ_sets_and_restores():
    os.environ["DISTLAB_TEST_A"] = "old"
    os.environ.pop("DISTLAB_TEST_B", None)
    with overlap_bench.environ(DISTLAB_TEST_A="new", DISTLAB_TEST_B="1"):
        assert os.environ["DISTLAB_TEST_A"] == "new" and os.environ["DISTLAB_TEST_B"] == "1"
    assert os.environ.pop("DISTLAB_TEST_A") == "old" and "DISTLAB_TEST_B" not in os.environ
    with pytest.raises(ValueError, match="16x1024"):
        overlap_bench.parse_shape("16*1024")


def test_bench_rank_on_cpu_ranks(tmp_path):
    """The GPU bench's rank function, on gloo ranks and the test GPT: every variant timed,
    traces written by rank 0 only (no GPU kernels here, so nothing is 'hidden')."""
    out = launch.run(overlap_bench.bench_rank, 2, ["2x8"], list(overlap_bench.BENCHED),
                     str(tmp_path), model="test", vocab_size=13, rounds=1, iters=1, warmup=0,
                     busbw_bytes=4096, channel="handles", all_traces=True, backend="gloo",
                     timeout=120)
    for r in out:
        assert r["busbw"] > 0
        shape = r["shapes"]["2x8"]
        for kind in ("seconds", "host_seconds"):
            assert set(shape[kind]) == set(overlap_bench.BENCHED)
            assert all(t > 0 for t in shape[kind].values())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"trace_2x8_{v.replace(' ', '_')}_rank{r}.json.gz"
                           for v in overlap_bench.BENCHED for r in (0, 1))
    text = overlap_bench.table({"cpu": out})
    assert "cpu" in text.splitlines()[1] and "2x8" in text and "host:" in text


def on_gpus(channel):
    rank = dist.get_rank()
    device = backend.device()
    torch.manual_seed(0)
    net = GPT(CFG).double().to(device)
    model = DataParallel(net, 0.002, channel=channel)   # auto: torch's NCCL stream
    for _ in range(2):
        net.zero_grad()
        loss_of(model, rank, device).backward()
        model.finish_gradient_synchronization()
    return {n: p.grad for n, p in net.named_parameters()}


@pytest.mark.multigpu
@pytest.mark.parametrize("channel", ["auto", "stream", "raw-nccl"])
def test_channels_on_gpus(channel):
    """The CUDA communication stream and raw NCCL through cupy average like one process."""
    if channel == "raw-nccl":
        pytest.importorskip("cupy")
    world = backend.gpu_count()
    out = launch.run(on_gpus, world, channel, backend="nccl", timeout=120)
    local = []
    for rank in range(world):
        torch.manual_seed(0)
        net = GPT(CFG).double()
        loss_of(net, rank).backward()
        local.append({n: p.grad for n, p in net.named_parameters()})
    for rank, grads in enumerate(out):
        for name, g in grads.items():
            want = torch.stack([x[name] for x in local]).mean(0)
            torch.testing.assert_close(g, want, msg=f"{channel}, rank {rank}: {name}")


@pytest.mark.multigpu
def test_overlap_bench_cli_on_gpus(tmp_path):
    """The CLI end to end on every GPU, one link, a small model: table, JSON, picture,
    traces."""
    assert overlap_bench.main(["--out", str(tmp_path), "--links", "nvlink", "--shapes", "2x64",
                               "--model", "tiny", "--vocab-size", "256", "--rounds", "1",
                               "--iters", "1", "--all-traces"]) == 0
    data = json.loads((tmp_path / "overlap_bench.json").read_text())
    r = data["results"]["nvlink"][0]["shapes"]["2x64"]
    assert set(r["seconds"]) == set(overlap_bench.BENCHED)
    assert 0 <= r["hidden"]["bucketed"] <= 1
    assert (tmp_path / "timeline_nvlink.png").stat().st_size > 0
    assert (tmp_path / "trace_nvlink_2x64_bucketed.json.gz").exists()
    assert (tmp_path / "trace_nvlink_2x64_bucketed_rank1.json.gz").exists()
