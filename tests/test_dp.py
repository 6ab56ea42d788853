"""DataParallel: broadcast at construction, averaged gradients, no_sync accumulation,
subgroups, and the correctness rule: N ranks train to the same weights as one process
on the global batch (and as torch's DistributedDataParallel).

One launch per world size runs every case, so each world size costs one cold start."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import backend, launch
from distlab.comm import CommLog
from distlab.data import NGramLanguage
from distlab.dp import DataParallel, allreduce_gradients, shard_loss_weight
from distlab.model import GPT, config

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

BATCH, SEQ, STEPS, VOCAB = 10, 8, 3, 13  # 10 rows: uneven over 3 and 4 ranks
LANG = NGramLanguage(VOCAB, 3, seed=0)


def make_model(seed=0):
    torch.manual_seed(seed)
    model = GPT(config("test", vocab_size=VOCAB)).double()
    model.register_buffer("counter", torch.full((3,), float(seed)))
    model.ln_f.bias.requires_grad_(False)                 # a frozen parameter
    model.unused = nn.Parameter(torch.randn(5, dtype=torch.float64))  # never gets a gradient
    return model


def local_loss(model, step, rank, world, device="cpu"):
    x, y = (t.to(device) for t in LANG.batch(step, BATCH, SEQ, rank, world))
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return loss * shard_loss_weight(len(x), BATCH, world)


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
    return out


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


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_data_parallel(world):
    out = results(world)
    ref_losses, ref_params, ref_model = reference()
    start = params(make_model(seed=0))
    grad_bytes = sum(p.numel() * 8 for p in ref_model.parameters() if p.requires_grad
                     and p is not ref_model.unused)
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
        count, nbytes = r["allreduce"]                    # one all-reduce of all gradients
        assert nbytes == STEPS * grad_bytes and count == STEPS
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
