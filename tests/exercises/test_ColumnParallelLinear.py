"""Exercise ColumnParallelLinear(linear, group=None, gather_output=False) of lab 06.

Built from a full ``nn.Linear``, it keeps this rank's ``torch.tensor_split`` shard of the
output features (rows of the weight, elements of the bias), takes the full input and
returns its slice of the output, or the whole output with ``gather_output=True``; the
input's gradient is summed over the group (Megatron's f). Tested at 1, 2, 3 and 4 ranks
(3 and 4 split 10 features unevenly), with and without a bias, against the full layer's
output and every gradient, with the collectives CommLog saw; then with gather_output and
on a group of two ranks. The cases are in tp_cases.py.
"""
import pytest

import tp_cases as cases

NOTEBOOK = "06_tensor_parallel"
KIND = "column"
PLAIN = ("bias", "no bias")


def check(student, size, check, case_names=PLAIN, forward=True):
    for case in case_names:
        check(KIND, case, cases.run(KIND, student.ColumnParallelLinear, size, case, forward))


@pytest.mark.parametrize("size", cases.SIZES)
def test_keeps_its_shard_of_weight_and_bias(student, size):
    check(student, size, cases.check_shards, forward=False)


@pytest.mark.parametrize("size", cases.SIZES)
def test_output_is_this_ranks_slice(student, size):
    check(student, size, cases.check_output)


@pytest.mark.parametrize("size", cases.SIZES)
def test_input_gradient_is_summed_over_the_group(student, size):
    check(student, size, cases.check_input_grad)


@pytest.mark.parametrize("size", cases.SIZES)
def test_weight_and_bias_gradients(student, size):
    check(student, size, cases.check_param_grads)


@pytest.mark.parametrize("size", cases.SIZES)
def test_no_collective_forward_one_all_reduce_backward(student, size):
    check(student, size, cases.check_communication)


@pytest.mark.parametrize("size", cases.SIZES)
def test_gather_output_returns_the_whole_output(student, size):
    check(student, size, cases.check_everything, ["gather"])


@pytest.mark.parametrize("size", [3, 4])
def test_a_group_of_two_ranks(student, size):
    check(student, size, cases.check_everything, ["pair"])
