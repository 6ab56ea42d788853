"""Exercise distributed_train_step(model, buckets, state, inputs, targets, group=None, *,
overlap=True, autocast_dtype=None, loss_scale=1.0, **adamw) of lab 09.

The course material's final train step done right: ZeRO-2 over ``group`` with each
bucket's reduce-scatter issued from backward's hooks (``overlap``), AdamW on this rank's
fp32 master shard, the all-gathers left in flight and waited before the next forward,
a loss scale divided out, autocast for mixed precision. Two launches (see
``capstone_cases``): 2 ranks run four cases (fp64 with and without overlap, a loss scale,
bf16 autocast), 4 ranks two DP groups of 2 on different data. Everything is held to
``torch.optim.AdamW`` in one process on the group's whole batch. The first message names
the clause broken: the course material's own mistakes (the all-gather not waited before
forward, the reduce-scatter after backward), and those a student makes writing it right
(the loss scale kept, gradients averaged over the whole world, hooks left behind, full
gradients kept, the reduce-scatter in the master dtype, the loss in bf16, forward
without autocast).
"""
import sys

import cloudpickle
import torch

from capstone_cases import (ADAMW, AG_OPS, RS_OPS, RUNS, SCALE, STEPS, UNUSED, bucket_shard,
                            largest_gap, make_model, one_process, plan, tolerance, train)
from distlab import launch
from distlab.comm import CommLog

NOTEBOOK = "09_capstone"
CORE = True  # one of its lab's core exercises (listed so in the lab and the README)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

# The hint to open beside each test's failure (lab 09, section 2): 1 the order of a step,
# 2 when a bucket is complete (the hooks), 3 the mean, the dtype and the scale, 4 the recipe.
HINTS = {"test_two_ranks_train_like_one_process": 1,
         "test_each_group_averages_over_its_own_ranks_only": 3,
         "test_reduce_scatters_start_during_backward_when_overlap_is_asked": 2,
         "test_without_overlap_they_start_after_backward_and_train_the_same": 2,
         "test_one_reduce_scatter_and_one_all_gather_per_bucket": 3,
         "test_the_loss_scale_is_divided_out": 3,
         "test_bf16_autocast_with_fp32_masters": 3,
         "test_no_full_gradient_survives_a_step": 2,
         "test_the_step_leaves_no_hook_behind": 2,
         "test_a_parameter_without_a_gradient_contributes_zeros": 3}
TIMEOUT = 90
GROUPS = [[0, 1], [2, 3]]
_runs = {}


# the launches: 2 ranks run RUNS; 2 ranks the model with an unused parameter; 4 ranks, fp64
LAUNCHES = {"2": (2, RUNS), UNUSED: (2, {UNUSED: dict(overlap=True)}),
            "4": (4, {"fp64": RUNS["fp64"]})}


def run(student, world, launch_name=None):
    name = launch_name or str(world)
    if name not in _runs:
        ranks, runs = LAUNCHES[name]
        try:
            _runs[name] = launch.run(train, ranks, student.distributed_train_step, runs,
                                     GROUPS if ranks == 4 else None, backend="gloo",
                                     timeout=TIMEOUT)
        except launch.LaunchError as e:
            _runs[name] = e
    if isinstance(_runs[name], launch.LaunchTimeout):
        raise AssertionError(f"distributed_train_step on {world} ranks did not finish in "
                             f"{TIMEOUT} s: a rank waits for a collective the others never "
                             f"issue (each bucket's reduce-scatter exactly once per step, on "
                             f"every rank, in the same order)")
    if isinstance(_runs[name], Exception):
        raise _runs[name]
    return _runs[name]


def check_forward_reads(out, ref, where):
    """The weights each forward read are those after the previous update."""
    for step in range(1, STEPS):
        if step >= len(out["seen"]):
            raise AssertionError(f"{where}: step {step} made no forward pass through the model")
        gap, name = largest_gap(out["seen"][step], ref["seen"][step])
        if gap > tolerance():
            stale, _ = largest_gap(out["seen"][step], ref["seen"][step - 1])
            untrained, _ = largest_gap(out["seen"][step], ref["seen"][0])
            if min(stale, untrained) <= tolerance():
                raise AssertionError(
                    f"{where}: the forward of step {step} read the weights of BEFORE the last "
                    f"update ({name} off by {gap:.3g}): the all-gathers the previous step left "
                    f"in state['gathers'] were not waited before forward. Wait each handle "
                    f"(.wait()) first; on a GPU the compute stream must wait on the "
                    f"all-gather's event: synchronising the compute stream, or a barrier, "
                    f"waits for the ranks, not for the data")
            raise AssertionError(f"{where}: the forward of step {step} read weights that are "
                                 f"not those after step {step - 1}'s update ({name} off by "
                                 f"{gap:.3g})")


def check_no_gradient_kept(out, where):
    for step, kept in enumerate(out["kept"]):
        assert not kept, (f"{where}, step {step}: after the step {kept[:3]} still hold a full "
                          f"gradient (p.grad); ZeRO-2 keeps only the reduced shard, in both "
                          f"modes: drop each parameter's gradient once its bucket's is handed "
                          f"to the reduce-scatter (a gradient left behind also adds into the "
                          f"next step's)")


def check_like_one_process(out, ref, where):
    tol = tolerance()
    check_no_gradient_kept(out, where)
    check_forward_reads(out, ref, where)
    for step, (got, want) in enumerate(zip(out["losses"], ref["losses"])):
        assert isinstance(got, float), (f"{where}: step {step} returned {got}; return the "
                                        f"group's mean loss as a Python float")
        assert abs(got - want) <= tol, (
            f"{where}: step {step} returned the loss {got:.6f}, one process on the group's "
            f"whole batch has {want:.6f}: return the mean over the group's ranks of their "
            f"mean losses (all-reduce, then divide by the group's size)")
    gap, name = largest_gap(out["weights"], ref["weights"])
    assert gap <= tol, (f"{where}: after {STEPS} steps {name} differs from one process's by "
                        f"{gap:.3g} (torch.optim.AdamW on the whole batch)")


def test_two_ranks_train_like_one_process(student):
    ref = one_process()
    for rank, out in enumerate(run(student, 2)):
        check_like_one_process(out["fp64"], ref, f"rank {rank} of 2, fp64, overlap=True")


def test_reduce_scatters_start_during_backward_when_overlap_is_asked(student):
    buckets = len(plan(make_model()))
    for rank, out in enumerate(run(student, 2)):
        for step, count in enumerate(out["fp64"]["counts"]):
            assert count is not None and count >= buckets - 1, (
                f"rank {rank} of 2, step {step}, overlap=True: when backward's last gradient "
                f"arrived, {count} of the {buckets} buckets' reduce-scatters had been issued; "
                f"all but the last bucket's (the embeddings') should be. Issue each bucket's "
                f"reduce-scatter from a post-accumulate-grad hook as soon as its last gradient "
                f"is accumulated, not after backward: then it runs while backward computes "
                f"the earlier layers")


def test_without_overlap_they_start_after_backward_and_train_the_same(student):
    ref = one_process()
    for rank, out in enumerate(run(student, 2)):
        got = out["no_overlap"]
        for step, count in enumerate(got["counts"]):
            assert count == 0, (f"rank {rank} of 2, step {step}, overlap=False: {count} "
                                f"reduce-scatter(s) were issued during backward; without "
                                f"overlap issue them after backward returns")
        check_like_one_process(got, ref, f"rank {rank} of 2, fp64, overlap=False")


def test_one_reduce_scatter_and_one_all_gather_per_bucket(student):
    names = plan(make_model())
    numels = [sum(dict(make_model().named_parameters())[n].numel() for n in b) for b in names]
    for rank, out in enumerate(run(student, 2)):
        for step, records in enumerate(out["bf16"]["logs"]):
            sizes = sorted(e.nbytes for e in CommLog.from_records(records).select(RS_OPS))
            want = sorted(2 * (n + n % 2) for n in numels)    # bf16, 2 equal pieces
            assert sizes == want, (
                f"rank {rank} of 2, step {step}, bf16 autocast: reduce-scatters of {sizes} "
                f"bytes, expected {want}: reduce-scatter each bucket in its compute dtype "
                f"(bucket.dtype, bf16 here, 2 bytes an element), not the master dtype (fp32 "
                f"moves twice the bytes); convert the reduced shard afterwards")
        for step, records in enumerate(out["fp64"]["logs"]):
            log = CommLog.from_records(records)
            where = f"rank {rank} of 2, step {step}"
            for ops, what in ((RS_OPS, "reduce-scatter"), (AG_OPS, "all-gather")):
                assert log.count(ops) <= len(names), (
                    f"{where}: {log.count(ops)} {what}s for {len(names)} buckets; one per "
                    f"bucket per step")
            # this step's all-gathers may still be in flight: they count in the step issued
            sizes = sorted(e.nbytes for e in log.select(RS_OPS))
            want = sorted(8 * (n + n % 2) for n in numels)   # fp64, padded to 2 equal pieces
            assert sizes == want, (f"{where}: reduce-scatters of {sizes} bytes; each bucket's "
                                   f"gradients once, {want} bytes (padded to equal pieces)")
            assert log.count(AG_OPS) == len(names), (
                f"{where}: {log.count(AG_OPS)} all-gathers issued; one per bucket "
                f"(bucket.gather(async_op=True)) at the end of each step")
            reduces = log.select("all_reduce")
            large = [e for e in reduces if e.nbytes > 8]
            assert not large, (
                f"{where}: all_reduce of {[e.nbytes for e in large]} bytes over ranks "
                f"{large[0].group_ranks}" + (" (the whole world)" if large[0].group_ranks == (0, 1)
                                           else "") + ": the gradients all-reduced, averaged "
                "over every rank the call spans. Reduce-scatter each bucket over `group` "
                "only (reduce_scatter_mean with bucket.group): the world may hold other DP "
                "groups, and an all-reduce moves twice a reduce-scatter's bytes")
            assert len(reduces) <= 1, (f"{where}: {len(reduces)} all-reduces; the only one a "
                                       f"ZeRO-2 step needs is the loss's, one number")


def test_the_loss_scale_is_divided_out(student):
    names = plan(make_model())
    ref = one_process()
    for rank, out in enumerate(run(student, 2)):
        got = out["scaled"]
        where = f"rank {rank} of 2, loss_scale={SCALE:g}"
        fp64 = out["fp64"]
        gap, name = largest_gap(got["weights"], ref["weights"])
        if gap > tolerance() and largest_gap(fp64["weights"], ref["weights"])[0] <= tolerance():
            raise AssertionError(
                f"{where}: with the loss scaled by {SCALE:g} the weights differ from one "
                f"process's by {gap:.3g} ({name}), without a scale they do not: the gradients "
                f"still carry the loss scale. Divide each reduced shard by loss_scale, after "
                f"converting it to the master dtype, before the update (Adam's update hides "
                f"most of a scale, its moments and eps do not)")
        for i, (moment, bounds) in enumerate(zip(got["moments"] or [], got["bounds"])):
            want = bucket_shard(ref["exp_avg"], names[i], bounds)
            if moment.shape != want.shape:
                raise AssertionError(f"{where}: bucket {i}'s exp_avg has {moment.numel()} "
                                     f"elements, this rank's shard {want.numel()}")
            if torch.allclose(moment, SCALE * want, rtol=1e-6, atol=1e-12) and want.abs().max() > 0:
                raise AssertionError(
                    f"{where}: bucket {i}'s first moment is {SCALE:g} times too large: the "
                    f"gradients still carry the loss scale. Divide each reduced shard by "
                    f"loss_scale before AdamW (Adam's update hides most of it, its moments "
                    f"and eps do not)")
            gap = (moment - want).abs().max().item()
            assert gap <= tolerance(), (f"{where}: bucket {i}'s first moment after step 0 differs "
                                 f"from AdamW's on the mean gradient by {gap:.3g}")
        check_like_one_process(got, ref, where)


# The loss the step returns under bf16 autocast, against fp32 cross-entropy of the very
# logits forward produced: fp32 rounds a loss near 2.7 to about 3e-7, bf16 to about 1e-2;
# the bound sits halfway between the two, on a log scale.
LOSS_TOL = (torch.finfo(torch.float32).eps * torch.finfo(torch.bfloat16).eps) ** 0.5 * 4


def test_bf16_autocast_with_fp32_masters(student):
    ref = one_process(dtype=torch.float32)
    results = run(student, 2)
    for rank, out in enumerate(results):
        got = out["bf16"]
        where = f"rank {rank} of 2, bf16 autocast, fp32 masters"
        modes = got["autocast"]
        assert modes and all(m == str(torch.bfloat16) for m in modes), (
            f"{where}: forward ran with autocast {modes or 'never called'} (per forward; None: "
            f"off): run the model's forward under torch.autocast(device type, "
            f"dtype=autocast_dtype) when autocast_dtype is given (with bf16 weights on CPU the "
            f"logits can look the same without it; on a GPU with fp32 layers they do not)")
        check_no_gradient_kept(got, where)
        for step, loss in enumerate(got["losses"]):
            local = [r["bf16"]["fp32_losses"][step] for r in results]
            if None in local or not isinstance(loss, float):
                continue
            want = sum(local) / len(local)
            assert abs(loss - want) <= LOSS_TOL, (
                f"{where}: step {step} returned the loss {loss:.6f}; the cross-entropy of "
                f"forward's logits in fp32, averaged over the group, is {want:.6f} (off by "
                f"{abs(loss - want):.2g}, bf16's rounding): take the loss in fp32 or wider "
                f"(cast the logits up before the cross-entropy), not in the compute dtype")
        for step, (loss, want) in enumerate(zip(got["losses"], ref["losses"])):
            assert isinstance(loss, float) and abs(loss - want) < 0.02, (
                f"{where}: step {step} returned {loss}, one fp32 process {want:.4f}; run the "
                f"forward under torch.autocast(..., dtype=autocast_dtype) and take the loss "
                f"in fp32")
        # Adam moves each weight by about lr per step whatever the gradient's size, so a
        # gradient rounded to bf16 may move a weight the other way: 2 lr per step at most
        bound = 2 * ADAMW["lr"] * STEPS
        gap, name = largest_gap(got["weights"], ref["weights"])
        assert gap < bound, (f"{where}: {name} drifted {gap:.3g} from one fp32 process, more "
                             f"than AdamW's steps can move it ({bound:g})")
        assert all(m.dtype == torch.float32 for m in got["moments"] or []), (
            f"{where}: AdamW's moments are not fp32: update the master shard (fp32) with the "
            f"reduced gradient cast to bucket.master_dtype")


def test_no_full_gradient_survives_a_step(student):
    for rank, out in enumerate(run(student, 2)):
        for run_name, mode in (("fp64", "overlap=True"), ("no_overlap", "overlap=False"),
                               ("bf16", "bf16 autocast")):
            check_no_gradient_kept(out[run_name], f"rank {rank} of 2, {mode}")


def test_the_step_leaves_no_hook_behind(student):
    for rank, out in enumerate(run(student, 2)):
        for run_name, mode in (("fp64", "overlap=True"), ("no_overlap", "overlap=False")):
            for step, extra in enumerate(out[run_name]["hooks"]):
                assert extra == 0, (
                    f"rank {rank} of 2, {mode}, step {step}: {extra} hook(s) the step registered "
                    f"are still on the model after it returned (they pile up, step after "
                    f"step, and fire in the next backward): remove every hook the step "
                    f"registers before it returns, also when forward or backward raises "
                    f"(keep the handles, .remove() them in a finally:)")


def test_each_group_averages_over_its_own_ranks_only(student):
    """Ranks 0, 1 and ranks 2, 3 are two DP groups, each on a batch of its own."""
    for rank, out in enumerate(run(student, 4)):
        g = rank // 2
        ref = one_process((1000 * g,))
        got = out["fp64"]
        gap, _ = largest_gap(got["weights"], ref["weights"])
        if gap > tolerance():
            world, _ = largest_gap(got["weights"], one_process((0, 1000))["weights"])
            if world <= tolerance():
                raise AssertionError(
                    f"rank {rank} of 4 (group {GROUPS[g]}): the weights are those of the "
                    f"gradients averaged over the WHOLE WORLD (both groups' batches), not over "
                    f"its DP group: reduce over `group` (bucket.group) only; the other group "
                    f"holds another replica with data of its own (in a 3D layout: another "
                    f"stage or another tensor shard)")
        check_like_one_process(got, ref, f"rank {rank} of 4, group {GROUPS[g]}")
        for step, records in enumerate(got["logs"]):
            outside = {e.group_ranks for e in CommLog.from_records(records).collectives()
                       if e.group_ranks != tuple(GROUPS[g])}
            assert not outside, (f"rank {rank} of 4, step {step}: a collective over ranks "
                                 f"{sorted(outside)}; every collective of the step belongs "
                                 f"to `group`, {GROUPS[g]}")


def test_a_parameter_without_a_gradient_contributes_zeros(student):
    """A model with one more parameter that no forward reads, in the first bucket that
    backward completes (overlap=True): the step still reduces that bucket once per step,
    with zeros for the parameter, and trains like one process stepping the parameter with
    a zero gradient (AdamW's weight decay still moves it)."""
    ref = one_process(unused=True)
    model = make_model(unused=True)
    buckets = len(plan(model))
    for rank, out in enumerate(run(student, 2, UNUSED)):
        got = out[UNUSED]
        where = f"rank {rank} of 2, a parameter that gets no gradient, overlap=True"
        for step, records in enumerate(got["logs"]):
            count = CommLog.from_records(records).count(RS_OPS)
            assert count == buckets, (
                f"{where}, step {step}: {count} reduce-scatters for {buckets} buckets: a "
                f"bucket whose parameter gets no gradient in this backward is still complete "
                f"once backward returns; reduce it then, once, with zeros for that parameter")
        check_like_one_process(got, ref, where)
