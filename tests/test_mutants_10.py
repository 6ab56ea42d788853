"""Lab 10's core exercises, ring_attention and moe_dispatch_combine, graded on wrong
answers a student plausibly writes: each must lose points, with a first failing check
that names the mistake.

Each mutant is the solution's cell with a few lines changed, graded by the real grader
(``runner.grade(path, only=[exercise], first_failure=True)``), one after the other,
each stopped at its first failing check.
"""
import pytest

from mutants import assert_named, grade_mutant

LAB = "10_long_context_experts"

RING = {
    # the known bug class: backward attends to the block of the first step at every step
    # (the forward is right, the gradients silently wrong on an even split; on an uneven
    # one the ranks' sizes disagree and gloo aborts)
    "stale_kv_backward": [("            kb, vb = kv[0].to(acc), kv[1].to(acc)",
                           "            kb, vb = k.to(acc), v.to(acc)")],
    # a block's softmax against its own log-sum-exp, unguarded: a row of the block whose
    # every score is masked gives exp(-inf - (-inf)), NaN
    "block_without_guard": [("o_b = torch.exp(s - _finite(l_b)[..., None]) @ kv[1].to(acc)",
                             "o_b = torch.exp(s - l_b[..., None]) @ kv[1].to(acc)")],
    # one exchange too many: the last step passes its block on although nobody needs it
    "extra_exchange": [("            if step < world - 1:\n                n = positions(seq_len, world, "
                        "(src - 1) % world, layout).numel()\n                nxt_kv",
                        "            if world > 1:\n                n = positions(seq_len, world, "
                        "(src - 1) % world, layout).numel()\n                nxt_kv")],
    # the global rank, the global world size and the world's ring (issue 51): right on the
    # default group, every test of which it passes
    "ignores_the_group": [
        ("    world = dist.get_world_size(group) if dist.is_initialized() else 1\n"
         "    rank = dist.get_rank(group) if dist.is_initialized() else 0\n",
         "    world = dist.get_world_size() if dist.is_initialized() else 1\n"
         "    rank = dist.get_rank() if dist.is_initialized() else 0\n"),
        ("        world = dist.get_world_size(group) if dist.is_initialized() else 1\n"
         "        rank = dist.get_rank(group) if dist.is_initialized() else 0\n        acc = torch",
         "        world = dist.get_world_size() if dist.is_initialized() else 1\n"
         "        rank = dist.get_rank() if dist.is_initialized() else 0\n        acc = torch"),
        ("        world = dist.get_world_size(group) if dist.is_initialized() else 1\n"
         "        rank = dist.get_rank(group) if dist.is_initialized() else 0\n        acc = out",
         "        world = dist.get_world_size() if dist.is_initialized() else 1\n"
         "        rank = dist.get_rank() if dist.is_initialized() else 0\n        acc = out"),
        ("    if dist.is_initialized() and dist.get_world_size(group) > 1:\n"
         "        prev, nxt = ring_neighbours(group)\n"
         "        ops = [dist.P2POp(dist.isend, t, nxt, group) for t in send if t.numel()]\n"
         "        ops += [dist.P2POp(dist.irecv, t, prev, group) for t in land if t.numel()]",
         "    if dist.is_initialized() and dist.get_world_size() > 1:\n"
         "        prev, nxt = ring_neighbours()\n"
         "        ops = [dist.P2POp(dist.isend, t, nxt) for t in send if t.numel()]\n"
         "        ops += [dist.P2POp(dist.irecv, t, prev) for t in land if t.numel()]")],
    # q pre-scaled once, in place (issue 51): q.to(acc) is q itself in fp32 and fp64, so the
    # caller's q comes back scaled; the output and the gradients are right in every dtype
    # (the scaled copy is what backward gets, the scale moved from dS to dQ)
    "scales_q_in_place": [
        ("qa, qpos = q.to(acc), positions(seq_len, world, rank, layout)",
         "qa, qpos = q.to(acc).mul_(1 / math.sqrt(q.shape[-1])), "
         "positions(seq_len, world, rank, layout)"),
        ("    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])",
         "    s = q @ k.transpose(-1, -2)"),
        ("ctx.save_for_backward(q, k, v, out, lse)", "ctx.save_for_backward(qa, k, v, out, lse)"),
        ("ds = p * (do @ vb.transpose(-1, -2) - delta) / math.sqrt(q.shape[-1])",
         "ds = p * (do @ vb.transpose(-1, -2) - delta)"),
        ("dq = dq + ds @ kb", "dq = dq + ds @ kb / math.sqrt(q.shape[-1])"),
        ("return dq.to(q.dtype),", "return dq.to(grad.dtype),")],
    # a length checked only against k and v (issue 51): q, k and v alike but short of this
    # rank's share go on into the ring
    "checks_shapes_only": [("if q.dim() != 4 or q.shape[2] != mine or k.shape",
                            "if q.dim() != 4 or k.shape")],
    # the softmax in bf16 (issue 51): right in fp32 and fp64, where acc is the input's dtype
    "accumulates_in_bf16": [("acc = torch.promote_types(q.dtype, torch.float32)",
                             "acc = q.dtype")],
}

MOE = {
    # capacity filled in token order, a token's second choice before a later first choice
    "drops_in_token_order": [("        for j in range(expert_ids.shape[1]):\n"
                              "            hot = F.one_hot(expert_ids[:, j], num_experts)\n"
                              "            slot = (taken + hot.cumsum(0) - 1).gather(1, expert_ids[:, j:j + 1])[:, 0]\n"
                              "            keep[:, j] = slot < capacity\n"
                              "            taken += hot.sum(0)",
                              "        flat = expert_ids.reshape(-1)\n"
                              "        hot = F.one_hot(flat, num_experts)\n"
                              "        slot = (hot.cumsum(0) - 1).gather(1, flat[:, None])[:, 0]\n"
                              "        keep = (slot < capacity).reshape(expert_ids.shape)")],
    # the experts' outputs summed without the router's weights
    "unweighted_sum": [("back * weights[n, j].unsqueeze(1).to(x.dtype)", "back")],
    # the rows sent out of autograd's sight: no gradient reaches x on more than one rank
    "detached_dispatch": [("rows = _AllToAllRows.apply(rows, out_splits, in_splits, group)",
                           "rows = _AllToAllRows.apply(rows.detach(), out_splits, in_splits, group)")],
    # no exchange of counts where no row can be kept (capacity 0): correct numbers, but the
    # contract's three exchanges on every call (the statement says so since a trial asked)
    "counts_skipped_when_empty": [("        dist.all_to_all_single(got, counts, group=group)",
                                   "        if capacity == 0:\n            got.zero_()\n"
                                   "        else:\n"
                                   "            dist.all_to_all_single(got, counts, group=group)")],
    # the experts counted over the world, not the group: right on the default group, every
    # test of which it passes
    "experts_over_the_world": [
        ("    world = dist.get_world_size(group) if dist.is_initialized() else 1\n    local",
         "    world = dist.get_world_size() if dist.is_initialized() else 1\n    local")],
}

MAX_POINTS = {"ring_attention": 28, "moe_dispatch_combine": 17}
# name -> (verdict, what its first failing check must say)
EXPECTED = {
    "stale_kv_backward": ("fail", ["test_an_even_split",
                                      "the forward is right"]),
    "block_without_guard": ("fail", ["test_an_even_split", "NaN",
                                        "every score is masked"]),
    "extra_exchange": ("partial", ["test_forward_sends_each_block_once_around_the_ring",
                                   "but the next one"]),
    "ignores_the_group": ("partial", ["test_the_ring_runs_over_the_ranks_of_group",
                                      "rank 0 of the group", "dist.get_rank(group)"]),
    "scales_q_in_place": ("partial", ["test_the_inputs_are_left_as_they_were",
                                      "changed the caller's q", "q.to(torch.float32) returns q"]),
    "checks_shapes_only": ("partial", ["test_a_wrong_length_raises_before_any_communication",
                                       "one token short of this rank's share of seq_len",
                                       "raise ValueError before any"]),
    "accumulates_in_bf16": ("partial", ["test_bf16_accumulates_in_fp32_on_cpu",
                                        "more than one bf16 step", "accumulate in fp32"]),
    "drops_in_token_order": ("partial", ["test_capacity_is_never_exceeded_and_the_right_"
                                         "assignments_drop", "first choices before second"]),
    "unweighted_sum": ("fail", ["test_identity_experts_with_weights_one_over_k_give_back_"
                                   "the_input", "y must be x"]),
    "detached_dispatch": ("partial", ["test_the_gradients_are_one_process_gradients",
                                      "x.grad is None"]),
    "counts_skipped_when_empty": ("partial", ["test_rows_cross_once_each_way",
                                              "on every call"]),
    "experts_over_the_world": ("partial", ["test_the_experts_are_spread_over_the_ranks_of_group",
                                           "rank 0 of the group", "dist.get_world_size(group)"]),
}


@pytest.mark.parametrize("name", list(RING) + list(MOE))
def test_a_mutant_fails_and_its_mistake_is_named(tmp_path, name):
    exercise, changes = ("ring_attention", RING) if name in RING else ("moe_dispatch_combine", MOE)
    result = grade_mutant(tmp_path, LAB, exercise, name, changes[name])
    assert_named(result, name, exercise, MAX_POINTS[exercise], *EXPECTED[name])
