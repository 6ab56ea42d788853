"""distlab.tp: the library's column- and row-parallel layers pass the exercises' checks;
a tensor-parallel GPT (plain, vocabulary-parallel, sequence-parallel, both) trains like
one process on the same batch, at 1, 2, 3 and 4 ranks, with a frozen parameter, one
that gets no gradient, tied embedding and head, and a vocabulary that does not split
evenly; CommLog sees 2 all-reduces forward and 2 backward per block; torch's own
tensor parallelism gives the same outputs and gradients; bad input gets a clear error.

One launch per world size runs every model case (each world size costs one start)."""
import json
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import backend, launch, tp
from distlab.bench import tp as tp_bench
from distlab.comm import CommLog, bus_factor
from distlab.data import NGramLanguage
from distlab.grading import expect_close
from distlab.model import GPT, config
from distlab.tp import vocab_parallel_cross_entropy
from distlab.shards import shard_sizes
from distlab.viz.tp import plot_bench
import tp_cases

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

VOCAB, SEQ, BATCH, STEPS = 13, 12, 5, 3  # 13 tokens: uneven over 2, 3 and 4 ranks
CFG = config("test", vocab_size=VOCAB, seq_len=SEQ, n_head=12, d_model=24)  # 12 heads: 1-4 ranks
TWO_HEADS = config("test", vocab_size=VOCAB, n_head=2)
LANG = NGramLanguage(VOCAB, 3, seed=0)
VARIANTS = {"plain": {}, "vocab": {"vocab_parallel": True}, "seq": {"sequence_parallel": True},
            "vocab+seq": {"vocab_parallel": True, "sequence_parallel": True}}
SIZES = (1, 2, 3, 4)
TOL = dict(rtol=1e-9, atol=1e-12)


def make_model():
    torch.manual_seed(0)
    model = GPT(CFG).double()
    model.blocks[0].mlp.up.bias.requires_grad_(False)                # frozen, and sharded
    model.unused = nn.Parameter(torch.randn(5, dtype=torch.float64))  # never gets a gradient
    return model


def loss_of(model, step, opts, device="cpu"):
    x, y = (t.to(device) for t in LANG.batch(step, BATCH, SEQ))
    logits = model(x).flatten(0, 1)
    if opts.get("vocab_parallel"):
        return vocab_parallel_cross_entropy(logits, y.flatten(), VOCAB)
    return F.cross_entropy(logits, y.flatten())


def train(opts=None, parallel=True, device="cpu"):
    """AdamW steps; the losses, the first step's gradients and the final weights (full,
    gathered) and the first step's communication."""
    opts = opts or {}
    model = make_model().to(device)
    if parallel:
        tp.tensor_parallel(model, **opts)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    losses, out = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        with CommLog() as fwd:
            loss = loss_of(model, step, opts, device)
        with CommLog() as bwd:
            loss.backward()
            if opts.get("sequence_parallel"):
                tp.allreduce_sequence_parallel_grads(model)
        if step == 0:
            out["grads"] = tp.full_grads(model) if parallel else {
                n: None if p.grad is None else p.grad.clone()
                for n, p in model.named_parameters(remove_duplicate=False)}
            out["forward"], out["backward"] = fwd.records(), bwd.records()
        opt.step()
        losses.append(loss.detach())
    out["losses"] = torch.stack(losses)
    out["weights"] = tp.full_state_dict(model) if parallel else {
        n: v.clone() for n, v in model.state_dict().items()}
    return out


def with_torch_tp():
    """Ours and torch's (DTensor ColwiseParallel/RowwiseParallel) on the same batch, then
    one AdamW step with foreach (CUDA's default; it refuses DTensors mixed with tensors)."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for name in ("distlab", "torch"):
        model = make_model()
        if name == "distlab":
            params = tp.tensor_parallel(model).parameters()
        else:
            tp.parallelize_with_torch(model, init_device_mesh("cpu", (dist.get_world_size(),)))
            params = tp.dtensor_param_groups(model)
        loss = loss_of(model, 0, {})
        loss.backward()
        out[name] = {"loss": loss.detach().reshape(1), "grads": tp.full_grads(model)}
        torch.optim.AdamW(params, lr=0.01, foreach=True).step()
        out[name]["weights"] = tp.full_state_dict(model)
    return out


def error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return None


def errors():
    size = dist.get_world_size()
    found = {"heads": error_of(tp.tensor_parallel, GPT(TWO_HEADS)),
             "narrow": error_of(tp.ColumnParallelLinear, nn.Linear(4, 1)) if size > 1 else None,
             "not a GPT": error_of(tp.tensor_parallel, nn.Linear(2, 2))}
    model = tp.tensor_parallel(make_model(), sequence_parallel=True)
    found["twice"] = error_of(tp.tensor_parallel, model)
    found["sequence"] = error_of(model, LANG.batch(0, 2, SEQ - 1)[0]) if size > 1 else None
    return found


def autocast_dtypes():
    """The dtypes the collectives of a bf16-autocast step move."""
    model = tp.tensor_parallel(make_model().float())
    with CommLog() as log:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, 0, {})
        loss.backward()
    return sorted({e.dtype for e in log.events})


def shared_gradient():
    """f's backward must not change a gradient tensor autograd also hands to another
    branch: here the addition passes the same gradient to f and to x directly."""
    x = torch.ones(3, requires_grad=True)
    ((tp.copy_to_group(x) + x) * torch.ones(3)).sum().backward()  # a contiguous gradient
    return x.grad


def rank_all():
    size = dist.get_world_size()
    out = {name: train(opts) for name, opts in VARIANTS.items()}
    out["shared"] = shared_gradient()
    if size in (2, 4):
        out["torch"] = with_torch_tp()
    out["errors"], out["autocast"] = errors(), autocast_dtypes()
    return out


_runs, _alone = {}, {}


def run(size):
    if size not in _runs:
        try:
            _runs[size] = launch.run(rank_all, size, backend="gloo", timeout=120)
        except launch.LaunchError as exc:
            _runs[size] = exc
    if isinstance(_runs[size], Exception):
        raise _runs[size]
    return _runs[size]


def alone():
    if not _alone:
        _alone.update(train(parallel=False))
    return _alone


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trains_like_one_process(size, variant):
    for rank, found in enumerate(run(size)):
        check_like_one_process(found[variant], f"{variant} on rank {rank} of {size}", TOL)


def check_like_one_process(got, what, tol):
    """``got`` (what :func:`train` returned in a rank) against one process on the CPU."""
    want = alone()
    assert want["grads"]["unused"] is None and want["grads"]["blocks.0.mlp.up.bias"] is None
    expect_close(got["losses"], want["losses"], f"{what}: losses", **tol)
    for name, value in want["weights"].items():
        expect_close(got["weights"][name], value, f"{what}: final {name}", **tol)
    for name, grad in want["grads"].items():
        if grad is None:
            assert got["grads"][name] is None, f"{what}: {name} got a gradient"
        else:
            expect_close(got["grads"][name], grad, f"{what}: gradient of {name}", **tol)


def _ops(records):
    return [(e["op"], e["nbytes"]) for e in records]


@pytest.mark.parametrize("size", SIZES)
def test_two_all_reduces_forward_two_backward_per_block(size):
    act = BATCH * SEQ * CFG.d_model * 8  # one b·s·h activation, float64
    blocks = CFG.n_layer
    for found in run(size):
        plain = found["plain"]
        assert _ops(plain["forward"]) == [("all_reduce", act)] * 2 * blocks
        assert _ops(plain["backward"]) == [("all_reduce", act)] * 2 * blocks
        # vocabulary-parallel: the embedding's sum forward, three per-token floats for the
        # loss, and the head's input gradient backward
        vocab = found["vocab"]
        tokens = BATCH * SEQ * 8
        assert _ops(vocab["forward"]) == ([("all_reduce", act)] * (2 * blocks + 1)
                                          + [("all_reduce", tokens)] * 3)
        assert _ops(vocab["backward"]) == [("all_reduce", act)] * (2 * blocks + 1)


@pytest.mark.parametrize("size", SIZES)
def test_formula_per_layer_matches_commlog(size):
    """8·b·s·h·(t-1)/t elements per layer (4 all-reduces at the ring's 2(t-1)/t)."""
    plain = run(size)[0]["plain"]
    moved = CommLog.from_records(plain["forward"] + plain["backward"]).bus_bytes()
    per_layer = tp.allreduce_bytes_per_layer(BATCH, SEQ, CFG.d_model, size, element_size=8)
    assert moved == pytest.approx(CFG.n_layer * per_layer)
    assert per_layer == pytest.approx(8 * BATCH * SEQ * CFG.d_model * (size - 1) / size * 8)


def _bus(events):
    return sum(e.nbytes * bus_factor(e.op, e.group_size) for e in events)


@pytest.mark.parametrize("size", SIZES)
def test_sequence_parallel_moves_the_bytes_of_the_all_reduces(size):
    """An all-gather and a reduce-scatter in place of each all-reduce: the same bus bytes
    in the blocks. Besides: the gather of the whole sequence for the replicated head
    (forward) and of the embedding's gradient (backward), and one small all-reduce of
    the LayerNorm and bias gradients after backward."""
    found = run(size)[0]
    blocks, act = CFG.n_layer, BATCH * SEQ * CFG.d_model * 8
    fwd, bwd = (CommLog.from_records(found["seq"][k]) for k in ("forward", "backward"))
    plain = CommLog.from_records(found["plain"]["forward"] + found["plain"]["backward"])
    assert fwd.ops() == ["all_gather_into_tensor", "reduce_scatter_tensor"] * 2 * blocks + [
        "all_gather_into_tensor"]
    scatters, gathers = bwd.select("reduce_scatter_tensor"), bwd.select("all_gather_into_tensor")
    assert len(scatters) == 2 * blocks and len(gathers) == 2 * blocks + 1
    assert bwd.count("all_reduce") == 1 and bwd.events[-1].op == "all_reduce"
    in_blocks = fwd.events[:-1] + scatters + gathers[:-1]
    assert all(e.nbytes == act for e in in_blocks)
    assert _bus(in_blocks) == pytest.approx(plain.bus_bytes())


@pytest.mark.parametrize("size", [2, 4])
def test_torch_tensor_parallel_gives_the_same(size):
    for rank, found in enumerate(run(size)):
        ours, torch_tp = found["torch"]["distlab"], found["torch"]["torch"]
        expect_close(torch_tp["loss"], ours["loss"], f"rank {rank}: loss", **TOL)
        for name, grad in ours["grads"].items():
            if grad is None:
                assert torch_tp["grads"][name] is None, name
            else:
                expect_close(torch_tp["grads"][name], grad, f"rank {rank}: gradient of {name}", **TOL)
        for name, value in ours["weights"].items():
            expect_close(torch_tp["weights"][name], value, f"rank {rank}: {name} after a step", **TOL)


@pytest.mark.parametrize("size", SIZES)
def test_bf16_autocast_moves_bf16(size):
    assert run(size)[0]["autocast"] == ["bfloat16"]


@pytest.mark.parametrize("size", SIZES)
def test_clear_errors(size):
    found = run(size)[0]["errors"]
    assert found["not a GPT"].startswith("TypeError") and "distlab.model.GPT" in found["not a GPT"]
    assert "already tensor-parallel" in found["twice"]
    if size in (1, 2):
        assert found["heads"] is None
    else:
        assert "2 attention heads cannot be split over" in found["heads"] and "[1, 2]" in found["heads"]
    if size > 1:
        assert "1 output features cannot be split" in found["narrow"]
        assert f"multiple of {size}" in found["sequence"]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", ["column", "row"])
def test_library_layers_pass_the_exercise_checks(size, kind):
    cls = tp.ColumnParallelLinear if kind == "column" else tp.RowParallelLinear
    names = tp_cases.cases(kind, size)
    for case in names:
        tp_cases.check_everything(kind, case, tp_cases.run(kind, cls, size, case))


@pytest.mark.parametrize("size", SIZES)
def test_f_leaves_a_shared_gradient_alone(size):
    for found in run(size):  # the sum over ranks through f, plus 1 from the direct path
        assert found["shared"].tolist() == [size + 1.0] * 3


def test_shard_sizes_follow_tensor_split():
    for n in (1, 7, 10, 16):
        for size in (1, 2, 3, 4):
            assert shard_sizes(n, size) == [len(p) for p in torch.arange(n).tensor_split(size)]


def test_qkv_rows_give_each_rank_its_heads():
    order = tp.qkv_rows_by_rank(d_model=8, n_head=4, size=2)   # head_dim 2, 2 heads per rank
    q, k, v = range(0, 4), range(8, 12), range(16, 20)          # rank 0: heads 0 and 1
    assert order[:12].tolist() == [*q, *k, *v]
    assert sorted(order.tolist()) == list(range(24))


def test_bench_command_line_on_gloo(tmp_path, capsys):
    """The GPU benchmark's code path on two CPU ranks (no link settings there), torch's
    TP with the foreach optimizer step as on GPUs."""
    code = tp_bench.main(["--out", str(tmp_path), "--model", "test", "--vocab-size", "32",
                          "--batch-size", "2", "--seq-len", "8", "--dtype", "fp32", "--backend",
                          "gloo", "--world-size", "2", "--variants", "distlab TP,torch TP,distlab DP",
                          "--steps", "1", "--rounds", "1"])
    printed = capsys.readouterr().out
    found = json.loads((tmp_path / "tp_bench.json").read_text())["links"]
    assert code == 0 and not tp_bench.failures(found), printed
    assert list(found) == ["gloo"] and list(found["gloo"]) == ["distlab TP", "torch TP", "distlab DP"]
    assert found["gloo"]["distlab TP"]["collectives"] == 2 * 2 * 2  # 2 blocks, 2 + 2 each
    assert (tmp_path / "tp_bench.png").stat().st_size > 0
    assert "distlab DP" in printed


def test_bench_keeps_the_figures_of_the_variants_that_ran():
    cfg = config("test", vocab_size=32, seq_len=8)
    results = {"gloo": launch.run(tp_bench.measure, 2, cfg, 2, 8, ["distlab DP", "nonsense"], 1, 1,
                                  warmup=1, dtype="fp32", backend="gloo", timeout=120)[0]}
    assert results["gloo"]["distlab DP"]["step_s"] > 0
    assert tp_bench.failures(results) == [
        "gloo, nonsense: ValueError: unknown variant 'nonsense'; choose from "
        f"{list(tp_bench.VARIANTS)}"]
    assert "gloo     nonsense    failed: ValueError" in tp_bench.table(results)
    legend = plot_bench(results).axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["distlab DP"]


def rank_gpu():
    return {name: train(opts, device=backend.device()) for name, opts in VARIANTS.items()}


@pytest.mark.multigpu
def test_trains_like_one_process_on_nccl():
    """Two GPUs, NCCL, float64: every variant against one process on the CPU."""
    for rank, found in enumerate(launch.run(rank_gpu, 2, backend="nccl", timeout=120)):
        for variant in VARIANTS:
            check_like_one_process(found[variant], f"{variant} on GPU rank {rank}",
                                   dict(rtol=1e-7, atol=1e-9))
        assert found["plain"]["forward"][0]["op"] == "all_reduce"


@pytest.mark.multigpu
def test_bench_on_gpus(tmp_path):
    """The benchmark's NCCL path, small: every variant, the profiler's NCCL share."""
    code = tp_bench.main(["--out", str(tmp_path), "--model", "small", "--vocab-size", "1024",
                          "--batch-size", "4", "--seq-len", "128", "--world-size", "2",
                          "--links", "nvlink", "--steps", "2", "--rounds", "1"])
    results = json.loads((tmp_path / "tp_bench.json").read_text())["links"]
    assert code == 0, "failed: " + "; ".join(tp_bench.failures(results))
    found = results["nvlink"]
    assert set(found) == set(tp_bench.VARIANTS)
    for name, r in found.items():
        assert r["step_s"] > 0 and 0 < r["nccl_share"] < 1, (name, r)


def test_answers_refuse_every_library_piece_of_the_vocabulary_parallel_loss():
    """Lab 06's core exercise: every distlab.tp function or class whose code computes part
    of the answer (the max over the ranks, ReduceOp.MAX; the masked pick of a token's row
    or logit, masked_fill) is named in ANSWERS, so that a student who calls it scores 0."""
    import inspect

    from distlab.grading.labs import ANSWERS
    from distlab.tp import layers, ops, parallelize, sequence

    found = set()
    for module in (layers, ops, parallelize, sequence):
        for name, obj in vars(module).items():
            if ((inspect.isfunction(obj) or inspect.isclass(obj))
                    and obj.__module__ == module.__name__):
                source = inspect.getsource(obj)
                if "ReduceOp.MAX" in source or "masked_fill" in source:
                    found.add(f"{module.__name__}:{name}")
    assert "distlab.tp.layers:vocab_parallel_cross_entropy" in found, found
    missing = found - set(ANSWERS["vocab_parallel_cross_entropy"])
    assert not missing, f"library code that answers vocab_parallel_cross_entropy, not refused: {missing}"
