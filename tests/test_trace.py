"""distlab.bench.trace (interval arithmetic, timelines, Chrome traces, the profiler) and
distlab.viz.timeline (the timeline plot, the step-time plot, the bucket-size picker)."""
import gzip
import json
import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import launch
from distlab.bench import trace
from distlab.comm import CommLog
from distlab.dp import DataParallel
from distlab.model import GPT, config
from distlab import timeline
from distlab.timeline import Span, Timeline
from distlab.viz.timeline import TimelinePicker, plot_step_times, plot_timeline, timelines_figure

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = config("test", vocab_size=13)


def test_union_and_hidden_fraction():
    assert timeline.union([(3, 4), (0, 1), (0.5, 2), (4, 5)]) == [(0, 2), (3, 5)]
    assert timeline.covered((1, 4), [(0, 2), (3, 10)]) == 2
    assert timeline.hidden_fraction([(0, 2)], [(1, 5)]) == 0.5
    assert timeline.hidden_fraction([(0, 2), (1, 3)], [(0, 3)]) == 1.0  # overlapping comm counts once
    assert timeline.hidden_fraction([(0, 1)], []) == 0.0
    assert math.isnan(timeline.hidden_fraction([], [(0, 1)]))


def synthetic():
    spans = [Span(0, "compute", "forward", 0.0, 1.0), Span(0, "compute", "backward", 1.0, 3.0),
             Span(0, "wait", "wait", 3.0, 3.5), Span(0, "comm", "all_reduce", 2.0, 3.5, 4096),
             Span(1, "compute", "backward", 1.0, 3.0), Span(1, "comm", "all_reduce", 1.5, 2.5, 8)]
    return Timeline(spans, [(0, "w", 2.0), (1, "w", 1.5)])


def test_timeline_hidden_fraction_ignores_waiting():
    t = synthetic()
    assert t.ranks == [0, 1]
    assert t.hidden_fraction(0) == pytest.approx(1 / 1.5)   # the wait is not compute
    assert t.hidden_fraction(1) == 1.0
    assert t.hidden_fraction() == pytest.approx((1 / 1.5 + 1) / 2)
    assert t.comm_seconds(0) == 1.5 and t.duration == 3.5
    again = Timeline.from_records([Timeline(t.select(rank=r), [m for m in t.marks if m[0] == r])
                                   .records() for r in (0, 1)])
    assert again == t


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_chrome_trace_export(tmp_path, name):
    path = synthetic().to_chrome_trace(tmp_path / name)
    raw = path.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == name.endswith(".gz")
    events = trace.load_chrome_trace(path)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 6 and {e["pid"] for e in spans} == {0, 1}
    comm = [e for e in spans if e["cat"] == "comm" and e["pid"] == 0][0]
    assert comm["ts"] == pytest.approx(2e6) and comm["dur"] == pytest.approx(1.5e6)
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"rank 0", "rank 1", "compute", "comm"} <= names


def test_kernel_timeline_reads_gpu_kernels():
    chrome = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
         "ts": 50, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
        {"ph": "X", "cat": "Kernel", "name": "elementwise", "ts": 120, "dur": 10}]}
    t = trace.kernel_timeline(chrome, rank=3)
    assert [s.lane for s in t.spans] == ["compute", "comm", "compute"]
    assert t.ranks == [3]
    assert t.hidden_fraction() == pytest.approx(0.6)     # 50 + 10 of 100 us


def recorded_step(cap):
    """One step of the test GPT on gloo ranks, timed by a StepRecorder."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = GPT(CFG)
    rec = trace.StepRecorder(net)
    model = DataParallel(net, cap)
    x = torch.randint(13, (2, 9), generator=torch.Generator().manual_seed(rank))
    with CommLog() as log:
        with rec.span("forward"):
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        with rec.span("backward"):
            loss.backward()
        with rec.span("wait"):
            model.finish_gradient_synchronization()
    return rec.timeline(log.records()).records(), len(model.buckets)


def test_step_recorder_on_ranks():
    out = launch.run(recorded_step, 2, 0.002, backend="gloo", timeout=60)
    timeline = Timeline.from_records([r for r, _ in out])
    n_params = sum(1 for _ in GPT(CFG).parameters())
    for rank, (_, buckets) in enumerate(out):
        assert len(timeline.select("comm", rank)) == buckets > 1
        assert len([m for m in timeline.marks if m[0] == rank]) == n_params
        assert [s.name for s in timeline.select("compute", rank)] == ["forward", "backward"]
        assert [s.name for s in timeline.select("wait", rank)] == ["wait"]
        assert 0 <= timeline.hidden_fraction(rank) <= 1
    fig = plot_timeline(timeline, title="test")
    assert "hidden under compute" in fig.axes[0].get_title()
    picker = TimelinePicker({"small": timeline, "synthetic": synthetic()})
    assert bytes(picker.image.value).startswith(b"\x89PNG")
    picker.choice.value = "synthetic"
    assert set(picker._frames) == {"small", "synthetic"}
    bundle = picker._repr_mimebundle_()
    assert bundle["image/png"].startswith(b"\x89PNG") and "2 timelines" in bundle["text/plain"]


def test_plots_draw():
    fig = plot_step_times({0.25: 0.1, 1: 0.08, 4: 0.09}, {"naive": 0.1, "torch DDP": 0.085})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels[0] == "bucketed" and "naive 100 ms" in labels
    assert len(timelines_figure({"a": synthetic(), "b": synthetic()}).axes) == 2
    # collectives in flight together: the bars tile the union of [issued, done]
    queued = Timeline([Span(0, "compute", "backward", 0.0, 0.1),
                       Span(0, "comm", "first issued", 0.026, 0.110),
                       Span(0, "comm", "first done", 0.040, 0.060)])
    bars = [c.get_paths()[0].vertices[:, 0] for c in plot_timeline(queued).axes[0].collections[1:3]]
    assert [(round(b.min()), round(b.max())) for b in bars] == [(26, 60), (60, 110)]
    with pytest.raises(ValueError, match="at least one"):
        TimelinePicker({})


def test_profile_exports_a_chrome_trace(tmp_path, capfd):
    torch.manual_seed(0)
    net = GPT(CFG)
    x = torch.randint(13, (2, 8))

    def step():
        net(x).sum().backward()

    trace.profile(step, steps=1, warmup=0, path=tmp_path / "p.json.gz")
    events = trace.load_chrome_trace(tmp_path / "p.json.gz")["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert not (tmp_path / "p.json").exists()
    with gzip.open(tmp_path / "p.json.gz") as f:
        json.load(f)
    assert "USDT" not in capfd.readouterr().err, "Kineto's start/stop markers reached stderr"


def test_the_plots_and_the_trainer_import_no_bench():
    """What :mod:`distlab.viz` and :mod:`distlab.train` need from measurements (the
    timeline's data, the alpha-beta fit, a device's peak) lives below both: neither
    imports a :mod:`distlab.bench` module, at the top or inside a function."""
    import ast
    from pathlib import Path

    import distlab

    root = Path(distlab.__file__).parent
    found = []
    for path in sorted(root.glob("viz/*.py")) + sorted(root.glob("train/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith("distlab.bench")]
    assert not found, found
