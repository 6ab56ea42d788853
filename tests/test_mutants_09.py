"""Lab 09's exercises graded on wrong answers: the course material's own "final train
step" mistakes and those a student makes writing it right, each a clause of the
statement broken alone. Each must lose points, with a first failing check that names
the clause.

Each mutant is the solution's cell with a few lines changed, graded by the real grader
(``runner.grade(path, only=[exercise], first_failure=True)``), one after the other, each
stopped at its first failing check.
"""
import pytest

from mutants import assert_named, lazy_grades

LAB, NAME, GRID = "09_capstone", "distributed_train_step", "mesh_groups"

MUTANTS = {
    # the course material: the compute stream synchronised, not the all-gather's event (on
    # gloo: a barrier, and the handles never waited)
    "wrong_stream": [("""    for gather in state.pop("gathers", []):
        gather.wait()""", """    state.pop("gathers", [])
    dist.barrier(group)""")],
    # the gradient averaged over every rank of the world, then reduce-scattered in the group
    "world_mean": [("""            pending[i] = reduce_scatter_mean(flat, bucket.layout, bucket.group, async_op=True)""",
                    """            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            pending[i] = reduce_scatter_mean(flat, bucket.layout, bucket.group, async_op=True)""")],
    # the course material: every reduce-scatter issued after backward, overlap or not
    "after_backward": [("    if overlap:\n        for i, bucket", "    if False:\n        for i, bucket")],
    # the loss scaled for backward and never divided out of the gradients
    "unscaled": [("grad = work.wait().to(bucket.master_dtype) / loss_scale",
                  "grad = work.wait().to(bucket.master_dtype)")],
    # the hooks registered at every step and never removed
    "hooks_kept": [("""    finally:
        for h in hooks:
            h.remove()""", """    finally:
        pass""")],
    # full gradients dropped only on the hooks' path: overlap=False keeps them
    "grads_kept": [("""            p.grad = None                          # ZeRO-2: no full gradient is kept""",
                    """            if overlap:
                p.grad = None""")],
    # the gradients reduce-scattered in the master dtype: twice the bytes under bf16
    "master_dtype_traffic": [(
        "flat = torch.cat([p.grad.reshape(-1).to(bucket.dtype) if p.grad is not None",
        "flat = torch.cat([p.grad.reshape(-1).to(bucket.master_dtype) if p.grad is not None"),
        ("else p.new_zeros(p.numel(), dtype=bucket.dtype)",
         "else p.new_zeros(p.numel(), dtype=bucket.master_dtype)"),
        ("grad = work.wait().to(bucket.master_dtype) / loss_scale",
         "grad = work.wait() / loss_scale")],
    # a parameter without a gradient read as if it had one (p.grad is None: a crash)
    "no_grad_param": [("""            flat = torch.cat([p.grad.reshape(-1).to(bucket.dtype) if p.grad is not None
                              else p.new_zeros(p.numel(), dtype=bucket.dtype)
                              for p in bucket.params])""",
                       """            flat = torch.cat([p.grad.reshape(-1).to(bucket.dtype) for p in bucket.params])""")],
    # the loss taken in the compute dtype (bf16 under autocast)
    "bf16_loss": [("wide = torch.promote_types(logits.dtype, torch.float32)",
                   "wide = logits.dtype")],
    # forward without autocast: on CPU with bf16 weights the logits are the same
    "no_autocast": [("enabled=autocast_dtype is not None", "enabled=False")],
}
GRID_MUTANTS = {
    # pp required to divide the layers
    "pp_divides_layers": [("if num_layers is not None and pp > num_layers:",
                           "if num_layers is not None and num_layers % pp:")],
    # a bool taken for a size (True == 1)
    "pp_bool": [('sizes = {"dp": dp, "tp": tp, "pp": pp}', 'sizes = {"dp": dp, "tp": tp, "pp": int(pp)}')],
    # the whole model-parallel block required to fit a node
    "tp_pp_in_a_node": [("if gpus_per_node is not None and tp > gpus_per_node:",
                         "if gpus_per_node is not None and tp * pp > gpus_per_node:")],
}

# name -> (verdict, what its first failing check must say)
EXPECTED = {
    "wrong_stream": ("fail", ["test_two_ranks_train_like_one_process", "BEFORE the last update",
                              "were not waited before forward", "event"]),
    "world_mean": ("partial", ["test_one_reduce_scatter_and_one_all_gather_per_bucket",
                               "(the whole world): the gradients all-reduced, averaged"]),
    "after_backward": ("partial", ["test_reduce_scatters_start_during_backward",
                                   "post-accumulate-grad hook", "not after backward"]),
    "unscaled": ("partial", ["test_the_loss_scale_is_divided_out", "still carry the loss scale",
                             "Divide each reduced shard by loss_scale"]),
    "hooks_kept": ("partial", ["test_the_step_leaves_no_hook_behind", "still on the model",
                               "remove every hook"]),
    "grads_kept": ("partial", ["test_without_overlap", "overlap=False", "still hold a full gradient",
                               "in both modes"]),
    "master_dtype_traffic": ("partial", ["test_one_reduce_scatter_and_one_all_gather_per_bucket",
                                         "bf16 autocast", "compute dtype", "not the master dtype"]),
    "no_grad_param": ("partial", ["test_a_parameter_without_a_gradient_contributes_zeros",
                                  "NoneType"]),
    "bf16_loss": ("partial", ["test_bf16_autocast_with_fp32_masters", "take the loss in fp32"]),
    "no_autocast": ("partial", ["test_bf16_autocast_with_fp32_masters", "autocast [None",
                                "under torch.autocast"]),
}
GRID_EXPECTED = {
    "pp_bool": ("partial", ["test_bad_layouts_raise_value_error", "pp = True (a bool is not a size)"]),
    "pp_divides_layers": ("partial", ["test_limits_that_hold_are_accepted",
                                      "a valid layout refused", "pp need not divide the layers"]),
    "tp_pp_in_a_node": ("partial", ["test_limits_that_hold_are_accepted",
                                    "a valid layout refused", "only tp must fit a node"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return lazy_grades(tmp_path_factory.mktemp("mutants_09"), LAB, NAME, MUTANTS)


@pytest.fixture(scope="module")
def grid_results(tmp_path_factory):
    return lazy_grades(tmp_path_factory.mktemp("mutants_09_grid"), LAB, GRID, GRID_MUTANTS)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutant_fails_and_its_mistake_is_named(results, name):
    assert_named(results(name), name, NAME, 10, *EXPECTED[name])


@pytest.mark.parametrize("name", list(GRID_MUTANTS))
def test_a_grid_mutant_fails_and_its_clause_is_named(grid_results, name):
    assert_named(grid_results(name), name, GRID, 4, *GRID_EXPECTED[name])
