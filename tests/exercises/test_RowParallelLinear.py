"""Exercise RowParallelLinear(linear, group=None) of lab 06.

Built from a full ``nn.Linear``, it keeps this rank's ``torch.tensor_split`` shard of the
input features (columns of the weight) and the whole bias, takes this rank's slice of
the input, all-reduces the partial products (Megatron's g) and adds the bias once.
Tested at 1, 2, 3 and 4 ranks (3 and 4 split 7 features unevenly), with and without a
bias, against the full layer's output and every gradient, with the collectives CommLog
saw; then on a group of two ranks. The cases are in tp_cases.py.
"""
import pytest

import tp_cases as cases

NOTEBOOK = "06_tensor_parallel"
KIND = "row"
PLAIN = ("bias", "no bias")


def check(student, size, check, case_names=PLAIN, forward=True):
    for case in case_names:
        check(KIND, case, cases.run(KIND, student.RowParallelLinear, size, case, forward))


@pytest.mark.parametrize("size", cases.SIZES)
def test_keeps_its_shard_of_weight_and_the_whole_bias(student, size):
    check(student, size, cases.check_shards, forward=False)


@pytest.mark.parametrize("size", cases.SIZES)
def test_output_is_the_full_layers_on_every_rank(student, size):
    check(student, size, cases.check_output)


@pytest.mark.parametrize("size", cases.SIZES)
def test_input_gradient_stays_on_its_rank(student, size):
    check(student, size, cases.check_input_grad)


@pytest.mark.parametrize("size", cases.SIZES)
def test_weight_and_bias_gradients(student, size):
    check(student, size, cases.check_param_grads)


@pytest.mark.parametrize("size", cases.SIZES)
def test_one_all_reduce_forward_none_backward(student, size):
    check(student, size, cases.check_communication)


@pytest.mark.parametrize("size", [3, 4])
def test_a_group_of_two_ranks(student, size):
    check(student, size, cases.check_everything, ["pair"])
