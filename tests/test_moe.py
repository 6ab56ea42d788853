"""distlab.moe: routing, capacity and the load-balancing loss do what their formulas say;
the MoE layer sums the kept experts' weighted outputs; the MoE GPT's experts spread over
2 and 4 ranks (expert_parallel, sync_gradients) train exactly like one process (fp64,
no capacity, so that the ranks' local capacities cannot differ); with a capacity each
rank's output is one process's on its own tokens; bad layouts are refused; DeepSeek-V3's
balance bias moves the choice of experts, not their weights, and evens a skewed load."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import launch
from distlab.comm import CommLog
from distlab.data import NGramLanguage
from distlab.model import config
from distlab.moe import (capacity, expert_parallel, load_balancing_loss, moe_gpt,
                         moe_layers, route, sync_gradients)
from distlab.moe.layer import MoE, combine_local
from distlab.moe.router import balance_bias_step, kept

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get these helpers by value

CFG = config("test", 13, seq_len=8, d_model=8, n_head=2, n_layer=2)
LANG = NGramLanguage(13, 3, seed=0)
STEPS, BATCH = 3, 8


def test_routing_capacity_and_the_balancing_loss():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    r = route(logits, 2)
    assert r.expert_ids.tolist() == [[0, 2], [2, 3]]
    torch.testing.assert_close(r.weights, torch.softmax(logits, -1).gather(1, r.expert_ids))
    assert capacity(10, 4, 2, 1.25) == 7 and capacity(10, 4, 2, None) is None
    even = torch.full((8, 4), 0.25)
    assert load_balancing_loss(even, torch.arange(8).reshape(4, 2) % 4).item() == pytest.approx(1.0)
    one = torch.zeros(8, 4)
    one[:, 0] = 1.0
    assert load_balancing_loss(one, torch.zeros(8, 1, dtype=torch.long)).item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="1 <= k"):
        route(logits, 5)


def test_kept_takes_first_choices_first_then_token_order():
    ids = torch.tensor([[1, 0], [0, 1], [1, 2], [0, 1]])
    # first choices fill experts 1 (tokens 0, 2) and 0 (tokens 1, 3): of the second
    # choices only token 2's (expert 2) finds room
    assert kept(ids, 3, 2).tolist() == [[True, False], [True, False], [True, True], [True, False]]
    assert kept(ids, 3, None).all() and not kept(ids, 3, 0).any()


def test_the_layer_sums_the_kept_experts_weighted_outputs():
    torch.manual_seed(0)
    experts = [nn.Linear(4, 4).double() for _ in range(3)]
    x = torch.randn(5, 4, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 0], [0, 2]])
    w = torch.rand(5, 2, dtype=torch.float64)
    keep = kept(ids, 3, 2)
    want = torch.stack([sum((w[n, j] * experts[ids[n, j]](x[n]) for j in range(2) if keep[n, j]),
                            torch.zeros(4, dtype=torch.float64)) for n in range(5)])
    torch.testing.assert_close(combine_local(x, ids, w, experts, 2), want)


def model():
    torch.manual_seed(0)
    return moe_gpt(CFG, num_experts=4, k=2, every=2, capacity_factor=None).double()


def train(parallel):
    rank, world = (dist.get_rank(), dist.get_world_size()) if parallel else (0, 1)
    m = expert_parallel(model()) if parallel else model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, ops = [], set()
    for step in range(STEPS):
        x, y = LANG.batch(step, BATCH, CFG.seq_len, rank, world)
        with CommLog() as log:
            loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            loss.backward()
        ops |= set(log.ops())
        if parallel:
            sync_gradients(m)
            total = loss.detach().reshape(1)
            dist.all_reduce(total)
            loss = total / world
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    experts = {id(p) for layer in moe_layers(m) for p in layer.experts.parameters()}
    shared = [p.detach() for p in m.parameters() if id(p) not in experts]
    local = [p.detach() for layer in moe_layers(m) for p in layer.experts.parameters()]
    return losses, shared, local, sorted(ops)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_trains_like_one_process(world):
    runs = launch.run(train, world, True, backend="gloo", timeout=60)
    losses, shared, local, _ = train(False)
    per_rank = len(local) // world
    for rank, (got_losses, got_shared, got_local, ops) in enumerate(runs):
        assert got_losses == pytest.approx(losses, abs=1e-12)
        for a, b in zip(got_shared, shared):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        for a, b in zip(got_local, local[rank * per_rank:(rank + 1) * per_rank]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        assert ops == ["all_to_all_single"]


def capped(c):
    rank, world = dist.get_rank(), dist.get_world_size()
    m = model()
    for layer in moe_layers(m):
        layer.capacity_factor = c
    expert_parallel(m)
    x, _ = LANG.batch(0, BATCH, CFG.seq_len, rank, world)
    return m(x).detach(), x


def test_with_a_capacity_each_rank_is_one_process_on_its_tokens():
    runs = launch.run(capped, 2, 0.5, backend="gloo", timeout=60)
    one = model()
    for layer in moe_layers(one):
        layer.capacity_factor = 0.5
    for y, x in runs:
        torch.testing.assert_close(y, one(x).detach(), rtol=0, atol=1e-12)


def refuse():
    try:
        expert_parallel(moe_gpt(CFG, num_experts=3))
    except ValueError as exc:
        return str(exc)


def test_experts_that_do_not_split_evenly_are_refused():
    assert all("multiple of 2" in r for r in launch.run(refuse, 2, backend="gloo"))


def test_the_loss_free_bias_moves_the_choice_not_the_weights():
    """DeepSeek-V3, section 2.1.2: the bias picks the experts, the unbiased probabilities
    weight them, and after a step an overloaded expert's bias falls by the speed, an
    underloaded one's rises, one at the mean stays."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.5, 0.0, 5.0, 1.0]], requires_grad=True)
    probs = torch.softmax(logits, -1)
    r = route(logits, 2, bias=torch.tensor([0.0, 0.0, -1.0, 0.0]))
    assert r.expert_ids.tolist() == [[0, 1], [3, 0]]
    torch.testing.assert_close(r.weights, probs.gather(1, r.expert_ids))
    r.weights.sum().backward()
    assert logits.grad.abs().sum() > 0
    bias = balance_bias_step(torch.zeros(4), torch.tensor([5, 1, 3, 3]), 0.01)
    torch.testing.assert_close(bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))


def test_a_layer_with_the_bias_steers_its_load_toward_even():
    """An MoE layer whose router sends most tokens to expert 0: the bias, moved after each
    step, brings every expert within 20 % of the even share; the bias-free layer has no
    bias to move."""
    g = torch.Generator().manual_seed(0)
    layer = MoE(CFG, 4, k=1, capacity_factor=None, bias_speed=0.02)
    x = torch.randn(256, CFG.d_model, generator=g)
    x[:, 0] = x[:, 0].abs() + 0.5
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(4, CFG.d_model, generator=g))
        layer.router.weight[0, 0] = 3.0          # expert 0 first for most tokens
    loads = []
    for _ in range(30):
        layer(x)
        loads.append(torch.bincount(layer.last_ids.reshape(-1), minlength=4))
        layer.update_bias()
    assert loads[0].max() > 128
    assert all(((load - 64).abs() <= 0.2 * 64).all() for load in loads[-5:])
    assert layer.balance_bias[0] < 0
    with pytest.raises(ValueError, match="bias_speed"):
        MoE(CFG, 4).update_bias()
