"""Exercise ColumnParallelLinear(linear, group=None, gather_output=False) of lab 06.

Built from a full ``nn.Linear``, it keeps this rank's ``torch.tensor_split`` shard of the
output features (rows of the weight, elements of the bias), takes the full input and
returns its slice of the output, or the whole output with ``gather_output=True``; the
input's gradient is summed over the group (Megatron's f). Tested at 1, 2, 3 and 4 ranks
(3 and 4 split 10 features unevenly), with and without a bias, against the full layer's
output and every gradient, with the collectives CommLog saw (at one rank they may be
skipped); then with gather_output, and on a group of ranks 0 and 2 of 3 and 4, where a
rank outside the group must keep no shard and return None at once, without a call and
without touching the nn.Linear or the input; and with gather_output on that group of 3
(the whole output gathered over the group's ranks only). The cases and checks are in tp_cases.py.
"""
import tp_cases

NOTEBOOK = "06_tensor_parallel"
_tests = tp_cases.make_tests("column", "ColumnParallelLinear")

# The hint under the exercise (1: rank and size within the group, 2: a shard of its own
# memory, 3: an autograd function, 4: the whole recipe) a student failing each test opens.
HINTS = {
    "test_keeps_its_shard_of_weight_and_bias": 2,
    "test_output_is_this_ranks_slice": 4,
    "test_input_gradient_is_summed_over_the_group": 3,
    "test_weight_and_bias_gradients": 2,
    "test_no_collective_forward_one_all_reduce_backward": 3,
    "test_gather_output_returns_the_whole_output": 4,
    "test_a_group_of_two_ranks": 1,
    "test_a_rank_outside_the_group_returns_none_at_once": 1,
    "test_gather_output_on_a_group_of_two_ranks": 4,
}

test_keeps_its_shard_of_weight_and_bias = _tests["shards"]
test_output_is_this_ranks_slice = _tests["output"]
test_input_gradient_is_summed_over_the_group = _tests["input_grad"]
test_weight_and_bias_gradients = _tests["param_grads"]
test_no_collective_forward_one_all_reduce_backward = _tests["communication"]
test_gather_output_returns_the_whole_output = _tests["gather"]
test_a_group_of_two_ranks = _tests["group"]
test_a_rank_outside_the_group_returns_none_at_once = _tests["outside"]
test_gather_output_on_a_group_of_two_ranks = _tests["gather group"]
