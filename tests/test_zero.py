"""ZeRO stages 1-3 (distlab.zero): the correctness rule at 1-4 ranks on the awkward GPT
(tied embedding, a frozen parameter, one that never gets a gradient, shards of uneven
size), how it was done (CommLog), what each rank holds (distlab.zero.memory), state dicts,
fp16 loss scaling, subgroups, bad input, and the AdamW kernel's index arithmetic.

One launch of 4 ranks runs every case at 4, 3, 2 and 1 ranks (process groups of those
sizes), so the module costs one start of 4 ranks."""
import sys

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import backend, launch
from distlab.zero import memory
from distlab.comm import CommLog
from distlab.data import NGramLanguage
from distlab.dp import DataParallel, shard_loss_weight
from distlab.model import GPT, config
from distlab.zero import (DynamicLossScaler, FullyShardedDataParallel, Layout,
                          ShardedOptimizer, shard_range)
from distlab.zero.kernel import coverage, kernel_indices, material_indices

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

BATCH, SEQ, STEPS, VOCAB = 10, 8, 3, 13      # 10 rows: uneven over 3 and 4 ranks
LANG = NGramLanguage(VOCAB, 3, seed=0)
ADAMW = dict(lr=1e-2, weight_decay=0.1)
KINDS = ("stage1", "stage1 after DataParallel", "stage2", "stage3")


def awkward(dtype=torch.float64):
    """The test GPT with the cases that break naive sharding."""
    torch.manual_seed(0)
    model = GPT(config("test", vocab_size=VOCAB)).to(dtype)
    model.ln_f.bias.requires_grad_(False)
    model.unused = nn.Parameter(torch.randn(5, dtype=dtype))
    return model


def tied(dtype=torch.float32, vocab_size=VOCAB):
    """The test GPT as it comes: every parameter trains (the tied embedding included).
    (Not inlined below: cloudpickle would then try to send ``torch.distributed.config``,
    a function that names ``config`` and uses ``dist`` being taken for one that uses
    that submodule.)"""
    torch.manual_seed(0)
    return GPT(config("test", vocab_size=vocab_size)).to(dtype)


def loss_of(model, step, rank=0, world=1, device="cpu"):
    x, y = (t.to(device) for t in LANG.batch(step, BATCH, SEQ, rank, world))
    loss = F.cross_entropy(model(x).flatten(0, 1).double(), y.flatten())
    return loss * shard_loss_weight(len(x), BATCH, world)


def wrap(kind, model, group=None, compute_dtype=None, **optim):
    """(the module to call, the optimizer) of each strategy; ``optim``: more AdamW
    keywords."""
    optim = {**ADAMW, **optim}
    if kind == "stage1":
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, group, **optim)
    if kind == "stage1 after DataParallel":
        return DataParallel(model, group=group), ShardedOptimizer(
            model.parameters(), torch.optim.AdamW, group, average_gradients=False, **optim)
    fsdp = FullyShardedDataParallel(model, compute_dtype, group,
                                    shard_parameters=kind == "stage3")
    return fsdp, torch.optim.AdamW(fsdp.parameters(), **optim)


def weights(model, net):
    if hasattr(net, "gather_full_params"):
        return net.gather_full_params()
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def train(kind, rank, world, steps=STEPS, group=None, device="cpu"):
    model = awkward().to(device)
    net, opt = wrap(kind, model, group)
    losses = []
    with CommLog() as log:
        for step in range(steps):
            opt.zero_grad()
            loss = loss_of(net, step, rank, world, device)
            loss.backward()
            if hasattr(net, "finish_gradient_synchronization"):
                net.finish_gradient_synchronization()
            opt.step()
            losses.append(loss.detach())
    losses = torch.stack(losses)
    dist.all_reduce(losses, group=group)
    return losses / world, weights(model, net), log.records(), opt


def bf16_bytes(kind, group, solo):
    """What a rank holds at the end of backward of the second bf16 step, every
    parameter training (the accounting counts a gradient and moments for each), on a
    GPT of 7,088 parameters (uneven over 3 ranks); and what a StorageTracker measures
    from before the model is built: bytes in use at the end of backward, the most the
    optimizer step adds (foreach AdamW, as on GPUs), and what is left once the strategy
    is dropped."""
    import gc

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    with memory.StorageTracker() as tracker:
        model = tied(vocab_size=VOCAB + 2)
        if kind == "stage0":           # data parallel: an optimizer over a group of one
            model = model.to(torch.bfloat16)
            net, opt = DataParallel(model, group=group), ShardedOptimizer(
                model.parameters(), torch.optim.AdamW, solo, average_gradients=False,
                foreach=True, **ADAMW)
        elif kind == "stage1":
            net, opt = wrap(kind, model.to(torch.bfloat16), group, foreach=True)
        else:
            net, opt = wrap(kind, model, group, compute_dtype=torch.bfloat16, foreach=True)
        for step in range(2):
            opt.zero_grad()
            loss_of(net, step, rank, world).backward()
            if hasattr(net, "finish_gradient_synchronization"):
                net.finish_gradient_synchronization()
            if step == 0:
                opt.step()
        held = memory.held_bytes(net, opt).as_dict()
        flags = sum(b.flags.nbytes for b in getattr(net, "buckets", ()))  # DataParallel's
        # Read once down to what the accounting holds (5 s at most): gloo's worker thread
        # lets go of a finished collective's tensors a moment after wait() returns (about
        # 1 read in 50 found 896 bytes more, gone 5 ms later). More bytes than that still
        # outlast the wait, and fewer return at once: either fails below.
        measured = {"states": tracker.settle(held["total"] + flags, 5.0)}
        tracker.reset_peak()
        units = memory.units_of((net if hasattr(net, "flat_params") else opt).flat_params())
        opt.step()
        measured["step"] = tracker.peak() - measured["states"]
        params = len(list(model.parameters()))
        del model, net, opt
        gc.collect()
        measured["left"] = tracker.settle(0)
    return held, units, measured, params


def fp16_skip(group):
    """A step whose gradient overflows on rank 1 only is skipped on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    net = FullyShardedDataParallel(awkward(torch.float32), torch.float16, group)
    opt = torch.optim.AdamW(net.parameters(), **ADAMW)
    scaler = DynamicLossScaler(init_scale=1024.0, group=group)
    stepped, scales = [], []
    for step in range(3):
        opt.zero_grad()
        before = net.gather_full_params()
        scaler.scale(loss_of(net, step, rank, world)).backward()
        if step == 1 and rank == min(1, world - 1):
            next(p for p in net.parameters() if p.grad is not None and p.numel()).grad[0] = \
                float("inf")
        stepped.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.scale_value)
        after = net.gather_full_params()
        stepped[-1] = (stepped[-1], all(torch.equal(before[n], after[n]) for n in before))
    return stepped, scales


def fp32_runs(rank, world, group):
    """The awkward GPT in float32, 3 AdamW steps: the weights of DataParallel and of
    stages 2 and 3 (default persistence, and with none), and, for stage 3 after its first
    backward, each parameter's shape and gradient as ``named_parameters()`` shows them."""
    out = {}
    for kind, threshold in (("dp", None), ("stage2", None), ("stage3", None), ("stage3", 0)):
        model = awkward(torch.float32)
        if kind == "dp":
            net = DataParallel(model, group=group)
            opt = torch.optim.AdamW([p for p in model.parameters()], **ADAMW)
        else:
            net = FullyShardedDataParallel(model, group=group, shard_parameters=kind == "stage3",
                                           persistence_threshold=threshold)
            opt = torch.optim.AdamW(net.parameters(), **ADAMW)
        for step in range(STEPS):
            opt.zero_grad()
            loss_of(net, step, rank, world).backward()
            net.finish_gradient_synchronization()
            if step == 0 and kind == "stage3" and threshold is None:
                out["seen"] = {n: (tuple(p.shape), None if p.grad is None else p.grad.clone())
                               for n, p in net.named_parameters()}
            opt.step()
        out[kind, threshold] = weights(model, net)
    return out


def bad_input():
    out = []
    for call in (lambda: FullyShardedDataParallel(lambda x: x),
                 lambda: FullyShardedDataParallel(nn.Sequential(nn.Linear(2, 2),
                                                                nn.Linear(2, 2).double()))):
        try:
            call()
            out.append(None)
        except (TypeError, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def with_groups(optimizer_cls, rank=0, world=1, group=None):
    """Two param groups (no weight decay on vectors), the second added after
    construction, and a learning-rate schedule: the weights after 3 steps."""
    model = awkward()
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    opt = optimizer_cls(matrices, group) if group is not None else optimizer_cls(matrices)
    opt.add_param_group({"params": vectors, "weight_decay": 0.0})
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, step, rank, world).backward()
        opt.step()
        schedule.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded_adamw(params, group):
    return ShardedOptimizer(params, torch.optim.AdamW, group, **ADAMW)


def cases(group, solo):
    """Every case on the ranks of ``group`` (a world of its size)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = {kind: train(kind, rank, world, group=group)[:3] for kind in KINDS}
    out["state_dict"] = train("stage1", rank, world, steps=2, group=group)[3].state_dict()
    out["bytes"] = {kind: bf16_bytes(kind, group, solo)
                    for kind in ("stage0", "stage1", "stage2", "stage3")}
    out["fp16"] = fp16_skip(group)
    out["groups"] = with_groups(sharded_adamw, rank, world, group)
    if world == 2:
        out["fp32"] = fp32_runs(rank, world, group)
    return out


def all_cases():
    """One launch of 4 ranks: every case on groups of 4, 3, 2 and 1 ranks (4 first, so
    that every rank makes its first optimizer at once), then ranks 0 and 2 as a pair."""
    rank = dist.get_rank()
    solo = [dist.new_group([r]) for r in range(4)][rank]
    out = {}
    for world in (4, 3, 2, 1):
        group = dist.new_group(list(range(world)))
        if rank < world:
            out[world] = cases(group, solo)
    pair = dist.new_group([0, 2])
    out["pair"] = train("stage3", [0, 2].index(rank), 2, group=pair)[:2] \
        if rank in (0, 2) else None
    out["bad"] = bad_input()
    return out


def resume(state):
    """A ShardedOptimizer on 4 ranks loads ``state`` (saved after 2 steps on fewer
    ranks) and takes the third step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = awkward()
    ref = awkward()
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(2):                 # the weights after 2 steps, from one process
        opt.zero_grad()
        loss_of(ref, step).backward()
        opt.step()
    model.load_state_dict(ref.state_dict())
    sharded = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    sharded.load_state_dict(state)
    loss_of(model, 2, rank, world).backward()
    sharded.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


_results = []


def run_all():
    if not _results:
        _results.append(launch.run(all_cases, 4, backend="gloo", timeout=300))
    return _results[0]


def results(world):
    """Each rank's cases at ``world`` ranks."""
    return [r[world] for r in run_all()[:world]]


def reference(steps=STEPS):
    model = awkward()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}, opt


# ------------------------------------------------------------------------- shards


def test_shards_are_tensor_splits_pieces():
    for numel in (0, 1, 5, 10, 11, 97):
        for world in (1, 2, 3, 4, 7):
            pieces = torch.arange(numel).tensor_split(world)
            for rank in range(world):
                start, end = shard_range(numel, rank, world)
                assert torch.equal(torch.arange(numel)[start:end], pieces[rank])
    for bad in ((5, 3, 3), (5, -1, 2), (5, 0, 0), (-1, 0, 1)):
        with pytest.raises(ValueError):
            shard_range(*bad)


def test_padded_layout_round_trips():
    for numel, world in ((10, 4), (12, 4), (3, 4), (0, 2), (7, 1)):
        layout = Layout(numel, world)
        flat = torch.arange(1, numel + 1, dtype=torch.float32)
        padded = layout.pad(flat)
        assert padded.numel() == world * -(-numel // world)
        rows = padded.view(world, layout.chunk) if numel else padded
        for rank in range(world if numel else 0):
            start, end = layout.bounds(rank)
            assert torch.equal(rows[rank, :end - start], flat[start:end])
            assert not rows[rank, end - start:].any()
        assert torch.equal(layout.unpad(padded, torch.empty(numel)), flat)
    assert Layout(12, 4).pad(flat := torch.ones(12)) is flat, "no copy when shards are equal"


# ------------------------------------------------------------- the correctness rule


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_stage_trains_like_one_process(world):
    ref_losses, ref_weights, _ = reference()
    for kind in KINDS:
        for rank, r in enumerate(results(world)):
            losses, final, _ = r[kind]
            where = f"{kind}, rank {rank} of {world}"
            torch.testing.assert_close(losses, ref_losses, msg=f"{where}: losses")
            assert final.keys() == ref_weights.keys()
            for name, value in final.items():
                torch.testing.assert_close(value, ref_weights[name], msg=f"{where}: {name}")
    assert torch.equal(results(world)[0]["stage3"][1]["unused"], awkward().unused.detach())


def comm(world, kind):
    from distlab.comm import CommLog as Log
    return [Log.from_records(r[kind][2]) for r in results(world)]


def units_of(kind):
    """Flat buffer sizes: one per dtype for the optimizer; for the wrapper, per block
    and the root (tied embedding, positions) the matrices, sharded, and every vector
    (norms, biases, the frozen ln_f.bias, unused), replicated, last."""
    model = awkward()
    if kind.startswith("stage1"):
        return [sum(p.numel() for p in model.parameters())]
    blocks = [sum(p.numel() for p in b.parameters() if p.dim() > 1) for b in model.blocks]
    vectors = sum(p.numel() for p in model.parameters() if p.dim() <= 1)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    return blocks + [matrices - sum(blocks), vectors]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_traffic_is_what_each_stage_should_move(world):
    """Bytes as nccl-tests counts them (an all-gather's output, a reduce-scatter's
    input), padded to equal pieces: stage 1 and 2 one reduce-scatter and one all-gather
    of Ψ per step, stage 3 one more all-gather, stage 1 after DataParallel an all-reduce
    of its buckets in place of the reduce-scatter; stages 2 and 3 one all-reduce of the
    replicated vectors, whose Ψ' elements no other collective moves."""
    sharded = {kind: units_of(kind)[:-1] if kind != "stage1" else units_of(kind)
               for kind in KINDS}
    padded = {kind: sum(world * -(-n // world) for n in units) * 8
              for kind, units in sharded.items()}
    expected = {"stage1": {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1},
                "stage2": {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1},
                "stage3": {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 2}}
    for kind, ops in expected.items():
        for rank, log in enumerate(comm(world, kind)):
            want = set(ops) | ({"all_reduce"} if kind != "stage1" else set())
            assert set(log.ops()) == want, (kind, log.summary())
            for op, times in ops.items():
                assert log.count(op) == STEPS * times * len(sharded[kind]), (kind, op)
                assert log.nbytes(op) == STEPS * times * padded[kind], (kind, op, rank)
            if kind != "stage1":
                assert log.count("all_reduce") == STEPS, (kind, log.summary())
                assert log.nbytes("all_reduce") == STEPS * units_of(kind)[-1] * 8, kind
    # DataParallel's buckets: every trainable parameter's gradient (zeros for the unused
    # one) and a flag per parameter that says whether any rank produced it
    trainable = [p for p in awkward().parameters() if p.requires_grad]
    bucket_bytes = sum(p.numel() + 1 for p in trainable) * 8
    for log in comm(world, "stage1 after DataParallel"):
        assert log.nbytes("all_reduce") == STEPS * bucket_bytes
        assert log.nbytes("all_gather_into_tensor") == STEPS * padded["stage1"]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_param_groups_added_later_and_a_schedule(world):
    want = with_groups(lambda params: torch.optim.AdamW(params, **ADAMW))
    for rank, r in enumerate(results(world)):
        for name, value in r["groups"].items():
            torch.testing.assert_close(value, want[name], msg=f"rank {rank} of {world}: {name}")


@pytest.mark.parametrize("world", [1, 3, 4])
def test_state_dict_is_the_whole_models(world):
    _, _, opt = reference(steps=2)
    want = opt.state_dict()
    got = results(world)[0]["state_dict"]
    assert got["state"].keys() == want["state"].keys()   # no state for frozen or unused
    for i, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][i][key], value, msg=f"param {i}: {key}")
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in
                                                          want["param_groups"]]
    torch.optim.AdamW(awkward().parameters(), **ADAMW).load_state_dict(got)  # a plain one's


def test_a_state_dict_saved_on_3_ranks_continues_on_4():
    ref_weights = reference()[1]
    state = results(3)[0]["state_dict"]
    for rank, final in enumerate(launch.run(resume, 4, state, backend="gloo", timeout=60)):
        for name, value in final.items():
            torch.testing.assert_close(value, ref_weights[name], msg=f"rank {rank}: {name}")


def test_fp32_at_two_ranks_is_bitwise_data_parallel():
    """fp32, 2 ranks: every weight after 3 AdamW steps is bit for bit DataParallel's, for
    stage 2 and stage 3 with and without replicated vectors (the same sum, then the same
    division by 2, of the same gradients); so stage 3 equals one process wherever data
    parallelism does."""
    for rank, r in enumerate(results(2)):
        runs = r["fp32"]
        dp = runs["dp", None]
        for key in (("stage2", None), ("stage3", None), ("stage3", 0)):
            for name, value in dp.items():
                assert torch.equal(runs[key][name].float(), value.float()), (rank, key, name)
    dp = results(2)[0]["fp32"]["dp", None]
    assert not torch.equal(dp["tok_emb.weight"], awkward(torch.float32).tok_emb.weight), \
        "the weights moved"


def test_vectors_stay_replicated_with_their_shape_and_gradient():
    """Default persistence: each vector (norms, biases, one dimension) is whole on both
    ranks, with the same averaged gradient (None for the frozen and the unused one);
    every matrix is a 1-D piece whose sizes add up to the matrix."""
    model = awkward(torch.float32)
    full = dict(model.named_parameters())
    seen = [r["fp32"]["seen"] for r in results(2)]
    assert seen[0].keys() == seen[1].keys() == full.keys()
    for name, p in full.items():
        (shape0, grad0), (shape1, grad1) = seen[0][name], seen[1][name]
        if p.dim() <= 1:
            assert shape0 == shape1 == tuple(p.shape), name
            assert (grad0 is None) == (grad1 is None) == (name in ("ln_f.bias", "unused")), name
            if grad0 is not None:
                assert torch.equal(grad0, grad1) and grad0.shape == p.shape, name
        else:
            assert len(shape0) == len(shape1) == 1 and shape0[0] + shape1[0] == p.numel(), name


def _embedding_norm_linear():
    torch.manual_seed(3)
    return nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 4))


def _module_grads(stage3):
    """One backward of the Embedding-LayerNorm-Linear model wrapped in ZeRO-3 on this
    rank's half of the batch: the gradient of every parameter ``wrapper.module`` shows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = FullyShardedDataParallel(_embedding_norm_linear(), shard_parameters=stage3)
    tokens = torch.arange(8).remainder(11).view(4, 2).tensor_split(world)[rank]
    wrapper(tokens).pow(2).mean().backward()
    wrapper.finish_gradient_synchronization()
    return {n: None if p.grad is None else p.grad.clone()
            for n, p in wrapper.module.named_parameters()}


def test_every_parameter_the_module_shows_carries_its_averaged_gradient():
    """After finish_gradient_synchronization(), ``wrapper.module.named_parameters()`` is
    what an optimizer or a user iterating the model sees: the norm's weight and bias and
    the linear bias, kept whole on every rank, carry the averaged gradient there too (an
    Embedding-LayerNorm-Linear model on 2 ranks, against one process)."""
    model = _embedding_norm_linear()
    tokens = torch.arange(8).remainder(11).view(4, 2)
    halves = [model(t).pow(2).mean() for t in tokens.tensor_split(2)]
    (sum(halves) / 2).backward()
    want = dict(model.named_parameters())
    for rank, grads in enumerate(launch.run(_module_grads, 2, True, backend="gloo",
                                            timeout=60)):
        assert set(grads) == set(want), (rank, sorted(grads))
        for name, grad in grads.items():
            assert grad is not None, f"rank {rank}: wrapper.module's {name} has no gradient"
            if want[name].dim() <= 1:            # kept whole: the whole averaged gradient
                torch.testing.assert_close(grad, want[name].grad, msg=f"rank {rank}: {name}")


# ------------------------------------------------------------------------ memory


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_rank_holds_what_the_accounting_says(world):
    """bf16 weights and gradients, fp32 master weights and AdamW moments, at the end of
    backward: distlab.zero.memory's exact accounting, byte for byte, counted on the objects
    (held_bytes) and measured as storage in use (StorageTracker); the optimizer step's
    buffers are distlab.zero.memory.step_buffers; dropping a strategy frees everything."""
    for rank, r in enumerate(results(world)):
        for kind, (held, units, measured, params) in r["bytes"].items():
            stage = int(kind[-1])
            where = f"{kind}, rank {rank} of {world}"
            (sharded, whole) = units
            want = memory.accounting(sharded, 1 if stage == 0 else world, 0 if stage == 0
                                     else rank, stage, whole).as_dict()
            assert held == want, f"{where}: {held} != {want}"
            flags = 2 * params if stage == 0 else 0   # DataParallel's flag per parameter
            assert measured["states"] == want["total"] + flags, where
            assert measured["step"] == memory.step_buffers(sharded, world, rank, stage,
                                                           whole), where
            assert measured["left"] == 0, f"{where}: {measured['left']} bytes outlive it"


# -------------------------------------------------------------------- the rest


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(world):
    for rank, r in enumerate(results(world)):
        stepped, scales = r["fp16"]
        assert [s for s, _ in stepped] == [True, False, True], f"rank {rank}"
        assert [unchanged for _, unchanged in stepped] == [False, True, False], f"rank {rank}"
        assert scales == [1024.0, 512.0, 512.0]


def test_a_group_of_ranks_0_and_2_trains_like_two_ranks():
    two = results(2)[0]["stage3"]
    for rank in (0, 2):
        losses, final = run_all()[rank]["pair"]
        torch.testing.assert_close(losses, two[0])
        for name, value in final.items():
            torch.testing.assert_close(value, two[1][name])
    assert run_all()[1]["pair"] is None and run_all()[3]["pair"] is None


def test_bad_input_is_named():
    with pytest.raises(RuntimeError, match="process group"):
        ShardedOptimizer([nn.Parameter(torch.ones(1))], torch.optim.AdamW)
    with pytest.raises(RuntimeError, match="process group"):
        FullyShardedDataParallel(nn.Linear(2, 2))
    wrapper, mixed = run_all()[0]["bad"]
    assert "nn.Module" in wrapper and "share a dtype" in mixed


def test_kernel_index_arithmetic_covers_each_element_once():
    for total, world in ((10, 4), (1000, 3), (1025, 4), (1 << 20, 8), (103168, 3)):
        assert (coverage(kernel_indices, total, world) == 1).all()
    # the material's offset rank * (total // world): with exactly total // world threads
    # per rank the remainder is never updated ...
    lost = coverage(material_indices, 1025, 4, block=1)
    assert np.flatnonzero(lost == 0).tolist() == [1024]
    # ... and with whole blocks of threads ranks run into each other's shards
    assert (coverage(material_indices, 1000, 3) > 1).sum() == 358


def kernel_against_adamw(numel):
    from distlab.zero.kernel import ShardAdamW

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    param = torch.randn(numel, device=backend.device())
    start_values = param.cpu()
    ref = param.clone().requires_grad_()
    start, end = shard_range(numel, rank, world)
    grad = torch.empty_like(param)
    kernel = ShardAdamW(param, grad, start, end, **ADAMW)
    opt = torch.optim.AdamW([ref], **ADAMW)
    for _ in range(5):
        grad.normal_()
        ref.grad = grad.clone()
        kernel.step()
        opt.step()
    torch.cuda.synchronize()
    return param[start:end].cpu(), ref.detach()[start:end].cpu(), param.cpu(), start_values


@pytest.mark.gpu
def test_the_kernel_matches_torch_adamw_on_its_shard_only():
    world = backend.gpu_count()
    numel = 100_003                       # not a multiple of any world size above 1
    for rank, (mine, ref, whole, start_values) in enumerate(
            launch.run(kernel_against_adamw, world, numel, backend="nccl")):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
        start, end = shard_range(numel, rank, world)
        assert torch.equal(whole[:start], start_values[:start]), "wrote before its shard"
        assert torch.equal(whole[end:], start_values[end:]), "wrote after its shard"


def on_gpus(kind):
    return train(kind, dist.get_rank(), dist.get_world_size(), device=backend.device())[:2]


@pytest.mark.multigpu
def test_every_stage_trains_like_one_process_on_gpus():
    ref_losses, ref_weights, _ = reference()
    for kind in KINDS:
        for rank, (losses, final) in enumerate(launch.run(on_gpus, backend.gpu_count(), kind,
                                                          backend="nccl", timeout=120)):
            torch.testing.assert_close(losses, ref_losses, msg=f"{kind}, rank {rank}")
            for name, value in final.items():
                torch.testing.assert_close(value.cpu(), ref_weights[name], msg=f"{kind}: {name}")


def test_the_gpu_bench_runs_on_cpus_and_reports():
    """python -m distlab.bench.zero's sections on 4 gloo ranks and the test GPT, memory
    measured by a StorageTracker: each strategy's model states, step buffers and
    leftovers are what the GPU run compares (exact here), the speed section runs both
    wrappers with both AdamWs and counts their traffic, the table and figure come out."""
    from distlab.bench import zero as zero_bench
    from distlab.viz.zero import plot_gpu_figures

    results = launch.run(zero_bench.rank_bench, 4, config("test", vocab_size=VOCAB), 2, 8, 2, 1,
                         ("kernel", "memory", "speed"), backend="gloo", timeout=300)
    assert results[0]["kernel"] == {"skipped": "needs CUDA and cupy"}
    params = len(list(tied().parameters()))
    for rank, r in enumerate(results):
        assert "error" not in r["memory"] and "error" not in r["speed"], r
        for strategy in zero_bench.STRATEGIES:
            m, where = r["memory"][strategy], f"rank {rank}, {strategy}"
            assert m["held"] == m["accounting"], where
            flags = 2 * params if strategy == "data parallel" else 0
            assert m["states"] == m["accounting"]["total"] + flags, where
            assert m["step buffers"] == m["step buffers accounted"], where
            assert m["left behind"] == 0, where
    runs = results[0]["speed"]["runs"]
    for opt_name in zero_bench.OPTIMIZERS:
        ours, theirs = runs[opt_name]["ZeRO-3"]["traffic"], runs[opt_name]["FSDP2"]["traffic"]
        assert set(theirs) == {"all_gather_into_tensor", "reduce_scatter_tensor"}
        assert set(ours) == set(theirs) | {"all_reduce"}   # our replicated vectors' gradients
        # FSDP2 keeps the root gathered from forward to backward; both reduce everything
        assert ours["all_gather_into_tensor"][0] == theirs["all_gather_into_tensor"][0] + 1
    text = zero_bench.report(results)
    assert "ZeRO-3 / FSDP2 step time: AdamW foreach" in text and "ZeRO-2" in text
    assert plot_gpu_figures(results).axes
    # a variant that failed (FSDP2 with the fused AdamW, say) keeps the others' figures
    runs["fused"]["FSDP2"] = {"error": "RuntimeError: no fused AdamW here"}
    del results[0]["speed"]["ZeRO-3 / FSDP2"]["fused"]
    text = zero_bench.report(results)
    assert "FSDP2   RuntimeError: no fused AdamW here" in text and "AdamW foreach" in text
    assert plot_gpu_figures(results).axes
