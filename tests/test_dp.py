"""DataParallel (bucketed, overlapped) and OneShotDataParallel (lab 04): broadcast at
construction, averaged gradients, no_sync accumulation, subgroups, and the correctness
rule: N ranks train to the same weights as one process on the global batch (and as
torch's DistributedDataParallel). For the buckets, CommLog checks how: one asynchronous
all-reduce per bucket, in the same order on every rank, issued while backward runs.

One launch per world size runs every case, so each world size costs one cold start."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import dp_cases
from dp_cases import Branchy, branchy_backward, branchy_means, local_loss

from distlab import backend, launch
from distlab.comm import CommLog
from distlab.dp import (MB, DataParallel, OneShotDataParallel, allreduce_gradients,
                        plan_buckets)
from distlab.bench.trace import StepRecorder

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

STEPS = 3
CAPS = (None, 0.002, 25)  # MiB: one bucket per parameter, 2 KiB buckets, one bucket


def make_model(seed=0, unused=True):
    """dp_cases' GPT with a buffer that differs per rank (the broadcast must fix it)."""
    model = dp_cases.make_model(seed, unused)
    model.register_buffer("counter", torch.full((3,), float(seed)))
    return model


def train(model, step_fn, rank=0, world=1, device="cpu"):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5,
                          momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = local_loss(model, step, rank, world, device)
        loss.backward()
        step_fn()
        opt.step()
        losses.append(loss.detach())
    return losses


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def global_losses(losses, world):
    """The global batch's mean loss per step: the mean over ranks of the weighted losses."""
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    return losses / world


def all_cases():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # 1. rank 0's weights and buffers everywhere, whatever each rank started from
    with CommLog() as log:
        model = DataParallel(make_model(seed=rank))
    out["start"] = params(model.module), model.module.counter.clone()
    out["broadcast_bytes"] = log.nbytes("broadcast")
    # 2. training: losses (mean over ranks = global loss) and final weights
    with CommLog() as log:
        losses = train(model.module, model.finish_gradient_synchronization, rank, world)
    out["train"] = global_losses(losses, world), params(model.module)
    out["allreduce"] = log.count("all_reduce"), log.nbytes("all_reduce")
    # 3. the same with torch's DDP, which synchronises inside backward
    ddp = nn.parallel.DistributedDataParallel(make_model(seed=rank), find_unused_parameters=True)
    out["ddp"] = global_losses(train(ddp, lambda: None, rank, world), world), params(ddp.module)
    # 4. gradient accumulation: two micro-batches, one synchronisation
    model = DataParallel(make_model())
    with CommLog() as log:
        with model.no_sync():
            local_loss(model, 0, rank, world).backward()
            model.finish_gradient_synchronization()       # skipped inside no_sync
        synced_inside = log.count("all_reduce")
        local_loss(model, 1, rank, world).backward()
        model.finish_gradient_synchronization()
    out["accumulated"] = grads_of(model.module), synced_inside
    # 5. a subgroup: ranks 0 and 2 average between themselves only
    if world >= 3:
        pair = dist.new_group([0, 2])
        model = make_model(seed=rank)
        if rank in (0, 2):
            model = DataParallel(model, group=pair)
        local_loss(model, 0, rank, world).backward()
        if rank in (0, 2):
            model.finish_gradient_synchronization()
            model = model.module
        out["pair"] = params(model), grads_of(model)
    # 6. gradients of two dtypes: one all-reduce each
    mixed = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(2, 1).double()})
    torch.manual_seed(rank)
    x = torch.randn(4, 3)
    mixed.b(mixed.a(x).double()).sum().backward()
    local = grads_of(mixed)
    with CommLog() as log:
        allreduce_gradients(mixed)
    out["mixed"] = local, grads_of(mixed), log.count("all_reduce")
    # 7. bad input
    try:
        DataParallel(lambda x: x)
    except TypeError as e:
        out["bad"] = str(e)
    # 8. buckets of every size, and lab 04's one-shot version: training and the calls made
    for cap in CAPS + ("one-shot",):
        model = make_model(seed=rank)
        wrapped = OneShotDataParallel(model) if cap == "one-shot" else DataParallel(model, cap)
        with CommLog() as log:
            losses = train(model, wrapped.finish_gradient_synchronization, rank, world)
        out[f"train {cap}"] = (global_losses(losses, world), params(model),
                               [(e.nbytes, e.async_op) for e in log.select("all_reduce")],
                               getattr(wrapped, "bucket_sizes", lambda: None)())
    # 9. overlap: marks when each gradient is ready, then the launches
    for cap in (0.002, None):
        model = make_model(unused=False)
        rec = StepRecorder(model)                         # its hooks run before the wrapper's
        wrapped = DataParallel(model, cap)
        with CommLog() as log:
            local_loss(model, 0, rank, world).backward()
            wrapped.finish_gradient_synchronization()
        out[f"overlap {cap}"] = ([t for _, _, t in rec.marks],
                                 [e.start for e in log.select("all_reduce")])
    # 10. a layer used on some ranks only, in some steps: no hang, the right mean
    for set_to_none in (True, False):
        model = Branchy()
        wrapped = DataParallel(model, None)
        steps = []
        with CommLog() as log:
            for step in range(2):
                model.zero_grad(set_to_none=set_to_none)
                branchy_backward(model, rank, step)
                wrapped.finish_gradient_synchronization()
                steps.append(grads_of(model))
        out[f"branchy {set_to_none}"] = steps, [e.nbytes for e in log.select("all_reduce")]
    # 10b. the same through the wrapper's forward (gradients given as zeroed bucket views)
    model = Branchy()
    wrapped = DataParallel(model, None)
    steps = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        branchy_pass(model, wrapped, rank, step, (rank + step) % 2 == 0)
        wrapped.finish_gradient_synchronization()
        steps.append(grads_of(model))
    out["branchy wrapped"] = steps
    # 10c. the middle layer used only in a no_sync pass: its accumulated gradient counts
    model = Branchy()
    wrapped = DataParallel(model, None)
    with wrapped.no_sync():
        branchy_pass(model, wrapped, rank, 0, True)
    branchy_pass(model, wrapped, rank, 1, False)
    wrapped.finish_gradient_synchronization()
    out["accumulate then skip"] = grads_of(model)
    # 10d. training through the wrapper: forward makes every gradient a view of its
    # bucket, and backward adds into it in place (no copy, no new gradient tensor)
    model = make_model(seed=rank, unused=False)
    wrapped = DataParallel(model, 0.002)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        wrapped(LANG_X)
    untouched = all(p.grad is None for p in model.parameters())
    wrapped(LANG_X)
    views = [(p.grad.data_ptr(), b.ptrs[j], bool(p.grad.any()))
             for b in wrapped.buckets for j, p in enumerate(b.params)]
    losses = train(wrapped, wrapped.finish_gradient_synchronization, rank, world)
    out["through forward"] = (untouched, views, global_losses(losses, world),
                              params(model), [b.ptrs[j] == p.grad.data_ptr()
                                              for b in wrapped.buckets
                                              for j, p in enumerate(b.params)])
    # 11. a second backward without finishing the first is named
    model = make_model(unused=False)
    wrapped = DataParallel(model, 0.002)
    local_loss(model, 0, rank, world).backward()
    try:
        local_loss(model, 0, rank, world).backward()
    except RuntimeError as e:
        out["twice"] = str(e)
    wrapped.finish_gradient_synchronization()
    # 12. a rank outside the group: an inert wrapper
    if world >= 3:
        model = make_model(seed=rank)
        before = params(model)
        with CommLog() as log:
            wrapped = DataParallel(model, 0.002, group=pair)
            local_loss(model, 0, rank, world).backward()
            wrapped.finish_gradient_synchronization()
        out["outsider"] = before, params(model), grads_of(model), log.count()
    return out


LANG_X = dp_cases.LANG.batch(0, dp_cases.BATCH, dp_cases.SEQ, 0, 1)[0]


def branchy_pass(model, call, rank, step, use_mid):
    """One backward of ``Branchy`` through ``call`` (the model or its wrapper)."""
    torch.manual_seed(100 * step + rank)
    model.use_mid = use_mid
    call(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum().backward()


_results = {}


def results(world):
    if world not in _results:
        _results[world] = launch.run(all_cases, world, backend="gloo", timeout=60)
    return _results[world]


def reference():
    model = make_model()
    losses = train(model, lambda: None)
    return torch.stack(losses), params(model), model


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def bucket_bytes(model, cap):
    """What each bucket all-reduces, in launch order: its gradients and one flag per
    parameter (float64 here)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [8 * sum(params[i].numel() + 1 for i in idx) for idx in plan_buckets(params, cap)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_data_parallel(world):
    out = results(world)
    ref_losses, ref_params, ref_model = reference()
    start = params(make_model(seed=0))
    state_bytes = sum(t.numel() * t.element_size() for t in list(ref_model.parameters()) +
                      list(ref_model.buffers()))
    for rank, r in enumerate(out):
        where = f"rank {rank} of {world}"
        for name, value in r["start"][0].items():       # broadcast at construction
            torch.testing.assert_close(value, start[name], msg=f"{where}: {name} at start")
        torch.testing.assert_close(r["start"][1], torch.zeros(3))
        assert r["broadcast_bytes"] == state_bytes
        losses, final = r["train"]                        # the correctness rule
        torch.testing.assert_close(losses, ref_losses, msg=f"{where}: losses")
        torch.testing.assert_close(r["ddp"][0], ref_losses, msg=f"{where}: DDP's losses")
        for name, value in final.items():
            torch.testing.assert_close(value, ref_params[name], msg=f"{where}: {name}")
            torch.testing.assert_close(r["ddp"][1][name], ref_params[name],
                                       msg=f"{where}: DDP {name}")
        count, nbytes = r["allreduce"]                    # one bucket: one all-reduce a step
        assert count == STEPS and nbytes == STEPS * sum(bucket_bytes(ref_model, 25))
    assert torch.equal(out[0]["train"][1]["unused"], start["unused"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_no_sync_accumulates_then_synchronises_once(world):
    out = results(world)
    model = make_model()
    for step in (0, 1):
        local_loss(model, step, 0, 1).backward()
    expected = grads_of(model)
    for rank, r in enumerate(out):
        grads, synced_inside = r["accumulated"]
        assert synced_inside == 0, f"rank {rank}: all-reduced inside no_sync()"
        assert grads.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name], msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("world", [3, 4])
def test_a_subgroup_averages_over_its_ranks_only(world):
    out = results(world)
    local = []
    for rank in range(world):
        model = make_model(seed=rank if rank not in (0, 2) else 0)
        local_loss(model, 0, rank, world).backward()
        local.append(grads_of(model))
    for rank, r in enumerate(out):
        weights, grads = r["pair"]
        for name, g in grads.items():
            want = (local[0][name] + local[2][name]) / 2 if rank in (0, 2) else local[rank][name]
            torch.testing.assert_close(g, want, msg=f"rank {rank} of {world}: grad of {name}")
        if rank in (0, 2):
            torch.testing.assert_close(weights["blocks.0.mlp.up.weight"],
                                       params(make_model(seed=0))["blocks.0.mlp.up.weight"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gradients_of_several_dtypes(world):
    out = results(world)
    for rank, r in enumerate(out):
        assert r["mixed"][2] == 2, "one all-reduce per dtype"
        for name, g in r["mixed"][1].items():
            assert g.dtype == r["mixed"][0][name].dtype
            want = torch.stack([o["mixed"][0][name] for o in out]).mean(0)
            torch.testing.assert_close(g, want, msg=f"rank {rank} of {world}: {name}")


def on_gpus():
    device = backend.device()
    model = DataParallel(make_model(seed=dist.get_rank()).to(device))
    losses = train(model.module, model.finish_gradient_synchronization, dist.get_rank(),
                   dist.get_world_size(), device)
    return global_losses(losses, dist.get_world_size()), params(model.module)


@pytest.mark.gpu
def test_trains_like_one_process_on_gpus():
    """Under NCCL, one rank per GPU (any number of GPUs), in float64."""
    world = backend.gpu_count()
    ref_losses, ref_params, _ = reference()
    for rank, (losses, final) in enumerate(launch.run(on_gpus, world, backend="nccl",
                                                      timeout=120)):
        torch.testing.assert_close(losses, ref_losses, msg=f"rank {rank}: losses")
        for name, value in final.items():
            torch.testing.assert_close(value, ref_params[name], msg=f"rank {rank}: {name}")


def test_bad_input_is_named():
    with pytest.raises(RuntimeError, match="process group"):
        DataParallel(nn.Linear(2, 2))
    assert "nn.Module" in results(1)[0]["bad"]


def test_plan_buckets_follows_ddp():
    """Reverse order, one open bucket per dtype, closed once it holds >= the cap."""
    p = [torch.empty(n) for n in (100, 300, 50, 400, 10)] + [torch.empty(7, dtype=torch.float64)]
    assert plan_buckets(p, 1000 / MB) == [[4, 3], [2, 1], [5], [0]]  # then the open ones
    assert plan_buckets(p, None) == [[5], [4], [3], [2], [1], [0]]
    assert plan_buckets(p, 25) == [[5], [4, 3, 2, 1, 0]]  # open buckets in the order opened
    for bad, error in ((0, ValueError), (-1, ValueError), ("25", TypeError), (True, TypeError)):
        with pytest.raises(error, match="bucket_cap_mb"):
            plan_buckets(p, bad)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_buckets_train_like_one_process(world):
    """Every bucket size, and lab 04's one-shot version, follow the single process; the
    buckets make one asynchronous all-reduce each per step, in the same order everywhere."""
    out = results(world)
    ref_losses, ref_params, ref_model = reference()
    for cap in CAPS + ("one-shot",):
        sizes = [r[f"train {cap}"][2] for r in out]
        for rank, r in enumerate(out):
            losses, final, calls, buckets = r[f"train {cap}"]
            where = f"rank {rank} of {world}, bucket_cap_mb={cap}"
            torch.testing.assert_close(losses, ref_losses, msg=f"{where}: losses")
            for name, value in final.items():
                torch.testing.assert_close(value, ref_params[name], msg=f"{where}: {name}")
            assert calls == sizes[0], f"{where}: not the same all-reduces as rank 0"
            if cap == "one-shot":
                assert not any(a for _, a in calls) and len(calls) == STEPS
                continue
            assert buckets == bucket_bytes(ref_model, cap)
            assert calls == [(n, True) for n in buckets] * STEPS, where


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("cap", [0.002, None])
def test_all_reduces_are_issued_while_backward_runs(world, cap):
    """All but the last bucket are launched before the last gradient is computed; the
    last one from that gradient's hook."""
    model = make_model(unused=False)
    n = len(bucket_bytes(model, cap))
    for rank, r in enumerate(results(world)):
        marks, starts = r[f"overlap {cap}"]
        assert len(starts) == n > 2
        early = sum(t < max(marks) for t in starts)
        assert early == n - 1, f"rank {rank}: {early} of {n} launched before the last gradient"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_layer_used_on_some_ranks_only(world, set_to_none):
    """No hang; ranks that skipped the layer contribute zeros, every rank gets the mean;
    a layer no rank used keeps .grad None (or its zeros, after zero_grad(set_to_none=False))."""
    out = results(world)
    for step in range(2):
        means = branchy_means(world, step)
        nobody = world == 1 and step == 1
        for rank, r in enumerate(out):
            grads, sizes = r[f"branchy {set_to_none}"]
            assert sizes == out[0][f"branchy {set_to_none}"][1]
            for name, want in means.items():
                if name.startswith("mid.") and nobody and set_to_none:
                    assert name not in grads[step], f"{name} was used by no rank"
                    continue
                torch.testing.assert_close(grads[step][name], want,
                                           msg=f"rank {rank} of {world}, step {step}: {name}")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_layer_used_on_some_ranks_only_through_the_wrapper(world):
    """The same through ``DataParallel.forward``, which gives each gradient a zeroed view
    of its bucket: a layer no rank used still ends with ``.grad`` None."""
    out = results(world)
    for step in range(2):
        means = branchy_means(world, step)
        nobody = world == 1 and step == 1
        for rank, r in enumerate(out):
            grads = r["branchy wrapped"][step]
            for name, want in means.items():
                if name.startswith("mid.") and nobody:
                    assert name not in grads, f"{name} was used by no rank: .grad stays None"
                    continue
                torch.testing.assert_close(grads[name], want,
                                           msg=f"rank {rank} of {world}, step {step}: {name}")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_gradient_accumulated_in_no_sync_only_is_averaged(world):
    local = []
    for rank in range(world):
        model = Branchy()
        branchy_pass(model, model, rank, 0, True)
        branchy_pass(model, model, rank, 1, False)
        local.append(grads_of(model))
    for rank, r in enumerate(results(world)):
        grads = r["accumulate then skip"]
        assert grads.keys() == local[0].keys(), f"rank {rank}: {sorted(grads)}"
        for name, g in grads.items():
            want = torch.stack([lg[name] for lg in local]).mean(0)
            torch.testing.assert_close(g, want, msg=f"rank {rank} of {world}: {name}")


@pytest.mark.parametrize("world", [1, 2])
def test_forward_gives_gradients_as_bucket_views(world):
    """After forward (with autograd on) every ``.grad`` is a zeroed view of its bucket,
    backward adds into it in place, and training through the wrapper follows one process."""
    ref_losses, ref_params, _ = reference()
    for rank, r in enumerate(results(world)):
        untouched, views, losses, final, still_views = r["through forward"]
        assert untouched, f"rank {rank}: a forward under no_grad gave gradients"
        for got, want, nonzero in views:
            assert got == want and not nonzero, f"rank {rank}: not a zeroed bucket view"
        assert all(still_views), f"rank {rank}: backward replaced a bucket view"
        torch.testing.assert_close(losses, ref_losses[:len(losses)], msg=f"rank {rank}")


def test_a_second_backward_before_finishing_is_named():
    assert "finish_gradient_synchronization() after every backward" in results(1)[0]["twice"]


@pytest.mark.parametrize("world", [3, 4])
def test_a_rank_outside_the_group_is_left_alone(world):
    for rank, r in enumerate(results(world)):
        if rank in (0, 2):
            continue
        before, after, grads, calls = r["outsider"]
        assert calls == 0, f"rank {rank} made collectives for a group it is not in"
        for name, value in after.items():
            assert torch.equal(value, before[name])
        model = make_model(seed=rank)
        local_loss(model, 0, rank, world).backward()
        for name, g in grads_of(model).items():
            torch.testing.assert_close(grads[name], g)
