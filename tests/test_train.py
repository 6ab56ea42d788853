"""distlab.train: the ZeRO-2 + overlap + mixed-precision step on a dp × pp × tp mesh.

The correctness rule of the kit, on gloo: each layout's losses (3 steps) and final
gathered full weights equal the single process's (torch.optim.AdamW on the whole
global batch, same seed), in fp64 and in fp32, within ``rounding.MULTIPLE`` times the
gap that another order of summation makes in one process (``tests/rounding.py``),
tensor by tensor. The attention key biases in fp32 have their own bound: see
``KEY_BIAS_ATOL``.

The global batch of 5 rows splits unevenly over dp = 2, the tied head/embedding sits
on the first and the last stage when pp = 2, the buckets are small so every stage has
several, with uneven shards. The mixed-precision runs are compared with the fp64 one
within bf16/fp16's own precision.
"""
import functools
import os
import subprocess
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import launch
from distlab.comm import CommLog
from distlab.data import NGramLanguage
from distlab.mesh import Mesh
from distlab.model import GPT, config
from rounding import assert_within, bounds

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

VOCAB, BATCH, SEQ, STEPS, LR = 13, 5, 8, 3, 1e-2
LANG = NGramLanguage(VOCAB, 3, seed=0)
CFG = config("test", vocab_size=VOCAB, n_layer=3)
BUCKET_MB = 0.004     # ~1000 fp32 elements: several buckets per stage
# fp32 only: the key biases' true gradient is exactly zero (softmax ignores a constant
# added to every score), so what backward computes is rounding noise, ~1e-10, which
# AdamW divides by sqrt(v) + eps: a step of up to lr * |g| / (|g| + eps) whose sign
# depends on the order of the sums (measured up to 2e-5). fp64's noise is far below eps.
KEY_BIAS_ATOL = 2e-2 * LR
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


def key_bias(name, w):
    """The key part of a fused qkv bias (rows d_model..2 d_model)."""
    return w[CFG.d_model:2 * CFG.d_model] if name.endswith("attn.qkv.bias") else None


def assert_like_one_process(results, precision):
    """Every rank's losses and rank 0's full weights against one process, within
    rounding (the fp32 key biases within ``KEY_BIAS_ATOL``)."""
    reference, tolerance = one_process(precision)
    full = dict(results[0]["full"])
    for name, w in reference[1].items():
        if precision == "fp32" and key_bias(name, w) is not None:
            torch.testing.assert_close(key_bias(name, full[name]), key_bias(name, w), rtol=0,
                                       atol=KEY_BIAS_ATOL)
            full[name] = full[name].clone()
            key_bias(name, full[name]).copy_(key_bias(name, w))
    for rank, r in enumerate(results):
        assert_within(r["losses"], full, reference, tolerance, f"rank {rank}: ")


@functools.cache
def one_process(precision="fp64"):
    """torch.optim.AdamW on the whole global batch in this process, and the bounds
    around its losses and weights (``rounding.bounds``)."""
    def model():
        torch.manual_seed(0)
        return GPT(CFG).to(DTYPES[precision])
    return bounds(model, LANG, STEPS, BATCH, SEQ, dict(lr=LR))


def run_layout(dp, tp, pp, precision="fp32", microbatches=None, log=False, scaler=None,
               bucket_mb=BUCKET_MB, overlap=True):
    """On each rank: STEPS steps; the losses, the full weights (rank 0) and, with
    ``log``, the CommLog records and hook trace of the last step."""
    from distlab.train import build

    mesh = Mesh(dp=dp, pp=pp, tp=tp)
    trainer = build(CFG, mesh, precision=precision, microbatches=microbatches, lr=LR,
                    bucket_cap_mb=bucket_mb, loss_scaler=scaler, overlap=overlap)
    losses, records = [], None
    for step in range(STEPS):
        batch = trainer.local_batch(LANG, step, BATCH, SEQ)
        if log and step == STEPS - 1:
            trainer.trace = []
            with CommLog() as comm:
                losses.append(trainer.step(batch, global_batch_size=BATCH))
            records = comm.records()
        else:
            losses.append(trainer.step(batch, global_batch_size=BATCH))
    full = trainer.full_state_dict()
    return dict(losses=losses, full=full if dist.get_rank() == 0 else None,
                records=records, trace=trainer.trace, skipped=trainer.skipped,
                buckets=[(b.late, b.flat.numel) for b in trainer.buckets],
                dp_ranks=dist.get_process_group_ranks(mesh.dp_group))


LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)]


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
@pytest.mark.parametrize("dp,tp,pp", LAYOUTS, ids=lambda v: str(v))
def test_each_layout_trains_like_one_process(dp, tp, pp, precision):
    results = launch.run(run_layout, dp * tp * pp, dp, tp, pp, precision, backend="gloo",
                         timeout=60)
    assert_like_one_process(results, precision)
    weights = one_process(precision)[0][1]
    torch.manual_seed(0)
    start = GPT(CFG).state_dict()["blocks.0.mlp.up.weight"]
    assert (weights["blocks.0.mlp.up.weight"] - start).abs().max() > 1e-3   # it did train


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_dp_tp_pp_2_2_2_on_8_ranks(precision):
    """8 gloo processes on 2 cores: about a second a launch here."""
    results = launch.run(run_layout, 8, 2, 2, 2, precision, backend="gloo", timeout=60)
    assert_like_one_process(results, precision)


def test_gradients_are_reduce_scattered_during_backward_and_gathered_after_the_step():
    """CommLog of the last step on (2, 2, 2): the DP group sees one reduce-scatter and
    one all-gather per bucket, nothing else of gradient size; every reduce-scatter but
    the last hook-driven one is issued before backward's last gradient accumulation
    (the tied bucket, summed between stages after the pipeline, after backward); every
    all-gather after the AdamW update. Each moves the bucket's padded size."""
    results = launch.run(run_layout, 8, 2, 2, 2, "fp32", None, True, None, 0.001,
                         backend="gloo", timeout=60)
    for rank, r in enumerate(results):
        log = CommLog.from_records(r["records"], rank)
        dp = tuple(r["dp_ranks"])
        mine = [e for e in log.events if e.group_ranks == dp]
        rs = [e for e in mine if e.op.startswith("reduce_scatter")]
        ag = [e for e in mine if e.op.startswith("all_gather")]
        buckets = r["buckets"]
        assert len(rs) == len(ag) == len(buckets) >= 3, (rank, log.summary())
        assert {e.op.split("_")[0] for e in mine} <= {"reduce", "all"}
        assert not [e for e in mine if e.op == "all_reduce"], log.summary()
        padded = sum(-(-n // 2) * 2 * 4 for _, n in buckets)   # fp32, 2 DP ranks
        assert sum(e.nbytes for e in rs) == sum(e.nbytes for e in ag) == padded
        trace = r["trace"]
        last_grad = max(t for kind, t, _ in trace if kind == "grad")
        backward_end = next(t for kind, t, _ in trace if kind == "backward_end")
        update_end = next(t for kind, t, _ in trace if kind == "update_end")
        launches = {b: t for kind, t, b in trace if kind == "launch"}
        early = [b for b, (late, _) in enumerate(buckets) if not late]
        # the order issued = the order recorded; hook-driven ones before backward ended
        starts = sorted(e.start for e in rs)
        assert sorted(launches.values())[:len(early)] == sorted(launches[b] for b in early)
        assert all(launches[b] <= backward_end for b in early)
        assert sum(starts[i] < last_grad for i in range(len(starts))) >= len(early) - 1 >= 2
        assert all(e.start > update_end for e in ag)
        assert all(e.start < update_end for e in rs)
        assert all(e.async_op for e in rs)           # issued, not waited for, in the hook
        late = [b for b, (lt, _) in enumerate(buckets) if lt]
        assert len(late) == 1  # the tied embedding (stage 0) / head (stage 1)
        assert launches[late[0]] > backward_end


def test_without_overlap_every_reduce_scatter_follows_backward_and_it_trains_alike():
    """overlap=False (the trainer without lab 09's answer) at (2, 2, 2): the same
    traffic, one reduce-scatter and one all-gather per bucket over DP, every
    reduce-scatter issued after backward ended, and the losses and weights of one
    process."""
    results = launch.run(run_layout, 8, 2, 2, 2, "fp64", None, True, None, 0.001, False,
                         backend="gloo", timeout=60)
    assert_like_one_process(results, "fp64")
    for rank, r in enumerate(results):
        log = CommLog.from_records(r["records"], rank)
        mine = [e for e in log.events if e.group_ranks == tuple(r["dp_ranks"])]
        rs = [e for e in mine if e.op.startswith("reduce_scatter")]
        ag = [e for e in mine if e.op.startswith("all_gather")]
        assert len(rs) == len(ag) == len(r["buckets"]) >= 3, (rank, log.summary())
        backward_end = next(t for kind, t, _ in r["trace"] if kind == "backward_end")
        assert all(e.start > backward_end for e in rs), rank
        assert not [kind for kind, _, _ in r["trace"] if kind == "grad"]


def run_mixed(dp, tp, pp, precision, init_scale=None):
    from distlab.zero import DynamicLossScaler
    scaler = None if init_scale is None else DynamicLossScaler(init_scale=init_scale)
    return run_layout(dp, tp, pp, precision, scaler=scaler)


def assert_tracks_fp64(results, rtol):
    """Mixed precision against the fp64 run: losses within ``rtol``; each parameter's
    distance from the fp64 weights under half the fp64 update's own size (measured:
    0.14 in bf16, 0.12 in fp16; a weight left alone is 1 away, a wrong gradient about 1
    or more). Fused qkv biases are left out: their key
    third's gradient is rounding noise (KEY_BIAS_ATOL), which AdamW turns into steps."""
    (losses, weights), _ = one_process("fp64")
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=rtol, atol=0)
    full = results[0]["full"]
    assert all(v.dtype == torch.float32 for v in full.values())   # the fp32 masters
    torch.manual_seed(0)
    start = GPT(CFG).state_dict()
    for name, w in weights.items():
        if not name.endswith("qkv.bias"):
            update = (w - start[name].double()).norm()
            assert (full[name].double() - w).norm() < 0.5 * update, name


def test_bf16_on_every_dimension_tracks_the_fp64_run_with_fp32_masters():
    results = launch.run(run_mixed, 8, 2, 2, 2, "bf16", backend="gloo", timeout=60)
    assert_tracks_fp64(results, rtol=5e-4)      # measured 7e-5


def test_fp16_with_loss_scaling_tracks_the_fp64_run():
    results = launch.run(run_mixed, 2, 2, 1, 1, "fp16", backend="gloo", timeout=60)
    assert [r["skipped"] for r in results] == [0, 0]
    assert_tracks_fp64(results, rtol=1e-4)      # measured 7e-6


def test_fp16_overflow_skips_the_step_on_every_rank():
    """A scale of 2**100 overflows fp16 gradients at every step: each rank holds only
    its shard, yet all skip together and the weights stay the initial ones."""
    results = launch.run(run_mixed, 4, 2, 1, 2, "fp16", 2.0 ** 100, backend="gloo",
                         timeout=60)
    assert [r["skipped"] for r in results] == [STEPS] * 4
    torch.manual_seed(0)
    start = GPT(CFG).state_dict()
    for name, w in start.items():
        torch.testing.assert_close(results[0]["full"][name], w, rtol=0, atol=0)


def bad_layouts():
    from distlab.train import build
    messages = []
    for dp, pp, tp in [(1, 1, 4), (1, 4, 1), (2, 2, 2)]:
        try:
            build(CFG, Mesh(dp=dp, pp=pp, tp=tp))
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_bad_layouts_say_what_to_change():
    heads, stages, product = launch.run(bad_layouts, 4, backend="gloo", timeout=60)[0]
    assert "tp = 4" in heads and "2 attention heads" in heads and "[1, 2]" in heads
    assert "pp = 4" in stages and "3 blocks" in stages and "pp <= 3" in stages
    assert "= 8" in product and "4 ranks" in product


def test_the_cli_runs_under_torchrun_on_four_cpu_processes():
    """Tensor and pipeline parallelism across torchrun's processes (4 processes cost a
    few seconds more than 2 here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DISTLAB_WORKER", None)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "4", "-m", "distlab.train", "--tp", "2",
         "--pp", "2", "--steps", "2", "--model", "test"],
        capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dp=1 × pp=2 × tp=2" in proc.stdout
    assert "step    1  loss" in proc.stdout and "tokens/s  MFU n/a" in proc.stdout
    assert "done: 2 steps on 4 rank(s)" in proc.stdout
