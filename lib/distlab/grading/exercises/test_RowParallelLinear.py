"""Exercise RowParallelLinear(linear, group=None) of lab 06.

Built from a full ``nn.Linear``, it keeps this rank's ``torch.tensor_split`` shard of the
input features (columns of the weight) and the whole bias, takes this rank's slice of
the input, all-reduces the partial products (Megatron's g) and adds the bias once, after
the sum. Tested at 1, 2, 3 and 4 ranks (3 and 4 split 7 features unevenly), with and
without a bias, against the full layer's output and every gradient, with the collectives
CommLog saw (at one rank they may be skipped); then on a group of ranks 0 and 2 of 3 and
4, where a rank outside the group must keep no shard and return None at once, without a
call and without touching the nn.Linear or the input. The cases and checks are in
tp_cases.py.
"""
import tp_cases

NOTEBOOK = "06_tensor_parallel"
_tests = tp_cases.make_tests("row", "RowParallelLinear")

# The hint under the exercise (1: where the bias goes, 2: g as an autograd function,
# 3: the whole recipe, with the group's rank test) a student failing each test opens.
HINTS = {
    "test_keeps_its_shard_of_weight_and_the_whole_bias": 3,
    "test_output_is_the_full_layers_on_every_rank": 1,
    "test_input_gradient_stays_on_its_rank": 2,
    "test_weight_and_bias_gradients": 1,
    "test_one_all_reduce_forward_none_backward": 2,
    "test_a_group_of_two_ranks": 3,
    "test_a_rank_outside_the_group_returns_none_at_once": 3,
}

test_keeps_its_shard_of_weight_and_the_whole_bias = _tests["shards"]
test_output_is_the_full_layers_on_every_rank = _tests["output"]
test_input_gradient_stays_on_its_rank = _tests["input_grad"]
test_weight_and_bias_gradients = _tests["param_grads"]
test_one_all_reduce_forward_none_backward = _tests["communication"]
test_a_group_of_two_ranks = _tests["group"]
test_a_rank_outside_the_group_returns_none_at_once = _tests["outside"]
