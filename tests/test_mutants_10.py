"""Lab 10's core exercises, ring_attention and moe_dispatch_combine, graded on wrong
answers a student plausibly writes: each must lose points, with a first failing check
that names the mistake.

Each mutant is the solution's cell with a few lines changed, graded by the real grader
(``runner.grade(path, only=[exercise], first_failure=True)``), one after the other,
each stopped at its first failing check.
"""
import pytest

from mutants import assert_named, grade_mutants

LAB = "10_long_context_experts"

RING = {
    # the known bug class: backward attends to the block of the first step at every step
    # (the forward is right, the gradients silently wrong on an even split)
    "stale_kv_backward": [("            kb, vb = kv[0].to(acc), kv[1].to(acc)",
                           "            kb, vb = k.to(acc), v.to(acc)")],
    # the merge against -inf without a finite reference: exp(-inf - (-inf)) is NaN
    "merge_without_guard": [("                out = (out * torch.exp(lse - _finite(m))[..., None]\n"
                             "                       + o_b * torch.exp(l_b - _finite(m))[..., None])",
                             "                out = (out * torch.exp(lse - m)[..., None]\n"
                             "                       + o_b * torch.exp(l_b - m)[..., None])")],
    # one exchange too many: the last step passes its block on although nobody needs it
    "extra_exchange": [("            if step < world - 1:\n                n = positions(seq_len, world, "
                        "(src - 1) % world, layout).numel()\n                nxt_kv",
                        "            if world > 1:\n                n = positions(seq_len, world, "
                        "(src - 1) % world, layout).numel()\n                nxt_kv")],
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
}

# name -> (verdict, what its first failing check must say)
EXPECTED = {
    "stale_kv_backward": ("partial", ["test_the_gradients_are_whole_sequence_gradients",
                                      "the forward is right"]),
    "merge_without_guard": ("partial", ["test_no_nan_where_a_block_is_masked", "NaN",
                                        "every score is masked"]),
    "extra_exchange": ("partial", ["test_forward_sends_each_block_once_around_the_ring",
                                   "but the next one"]),
    "drops_in_token_order": ("partial", ["test_capacity_is_never_exceeded_and_the_right_"
                                         "assignments_drop", "first choices before second"]),
    "unweighted_sum": ("partial", ["test_identity_experts_with_weights_one_over_k_give_back_"
                                   "the_input", "y must be x"]),
    "detached_dispatch": ("partial", ["test_the_gradients_are_one_process_gradients",
                                      "the gradient of x"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mutants_10")
    found = {}
    (folder / "ring").mkdir()
    (folder / "moe").mkdir()
    found.update(grade_mutants(folder / "ring", LAB, "ring_attention", RING))
    found.update(grade_mutants(folder / "moe", LAB, "moe_dispatch_combine", MOE))
    return found


@pytest.mark.parametrize("name", list(RING) + list(MOE))
def test_a_mutant_fails_and_its_mistake_is_named(results, name):
    exercise = "ring_attention" if name in RING else "moe_dispatch_combine"
    result = results[name]
    assert_named(result, name, exercise, result.max_points, *EXPECTED[name])
