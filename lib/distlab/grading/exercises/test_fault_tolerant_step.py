"""Exercise fault_tolerant_step(model, optimizer, batch, loss_fn, manager, step) of lab 12.

Replicas of a small fp64 MLP (AdamW), 2 to 4 of them, each a launch of its own, meet on
a lighthouse served by this process (lab12_cases.run). The last replica SIGKILLs itself
in the middle of the gradient all-reduce of step 1 (its Manager's ``kill_in_step``: the
process dies with the collective in flight); a replacement with other weights and an
empty optimizer starts once it is dead and joins the first quorum it reaches (the
survivors wait for it before step 3); every replica runs to step 5. Batches differ in size (replica r has 2 + r rows). Checked here, on what each
replica returned: its calls (step, what the call returned, the quorum it formed) and its
final weights and optimizer state, against one process (lab12_cases.one_process) over
the samples of each committed step's members.
"""
import sys
import threading

import cloudpickle
import pytest
import torch

from distlab import launch
from distlab.grading import expect_close
import lab12_cases
from lab12_cases import KILL_AT, STEPS

NOTEBOOK = "12_failures_at_scale"
CORE = True  # one of its lab's core exercises (listed so in the lab and the README)
RANK_IMPORTS = ("torch._dynamo",)  # AdamW's first step imports it: once, in the fork server
# the hint to open (1: the quorum and the vote; 2: the gradient's weights; 3: the rejoin)
HINTS = {"test_the_survivors_keep_training": 1,
         "test_the_step_a_replica_died_in_is_discarded_by_every_survivor": 1,
         "test_committed_losses_equal_one_process_over_the_same_samples": 2,
         "test_the_survivors_weights_equal_one_process": 2,
         "test_the_rejoined_replica_equals_its_peers_bitwise": 3}
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

WORLDS = (2, 3, 4)
_runs = {}


def run(student, replicas):
    """The run of ``replicas`` replicas; the first call runs every world size at once."""
    if not _runs:
        threads = [threading.Thread(target=lambda w=w: _runs.__setitem__(
            w, lab12_cases.run(student.fault_tolerant_step, w))) for w in WORLDS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return _runs[replicas]


def survivors(student, replicas):
    """{replica: its findings} of the replicas that were not killed; a launch that failed
    otherwise than by the kill fails the test, saying how."""
    found = run(student, replicas)
    victim = found[replicas - 1]
    # -9: SIGKILL (a confined rank's relay, runtime.confine._relay, dies of it too)
    if not isinstance(victim, launch.RankCrashed) or victim.returncode != -9:
        pytest.fail(f"{replicas} replicas: replica {replicas - 1} was to be killed by SIGKILL in "
                    f"the middle of step {KILL_AT}'s all-reduce, but its launch "
                    + (f"ended with {type(victim).__name__}: {str(victim).splitlines()[0]}"
                       if isinstance(victim, Exception) else "finished")
                    + ": reach the other replicas only through the quorum's collectives")
    alive = {r: found[r] for r in range(replicas - 1)}
    alive["replacement"] = found["replacement"]
    for r, got in alive.items():
        if isinstance(got, Exception):
            pytest.fail(f"{replicas} replicas: replica {r}'s launch failed: "
                        f"{str(got).splitlines()[0]}")
        for call in got["calls"]:
            assert "raised" not in call, (
                f"{replicas} replicas, replica {r}, step {call['step']}: fault_tolerant_step "
                f"raised {call['raised']}; a lost replica discards the step, it raises nothing")
            assert isinstance(call["returned"], list) and len(call["returned"]) == 2, (
                f"{replicas} replicas, replica {r}, step {call['step']}: fault_tolerant_step "
                f"returned {call['returned']}; return (next_step, loss)")
    return alive


def committed(calls):
    """[(step, members that trained on it, the loss returned)] of the committed calls."""
    out = []
    for call in calls:
        nxt, loss = call["returned"]
        if loss is not None:
            out.append((nxt - 1, [m for m in call["members"] if call["steps"][str(m)] == nxt - 1],
                        loss))
    return out


def test_the_survivors_keep_training(student):
    for replicas in WORLDS:
        for r, got in survivors(student, replicas).items():
            last = got["calls"][-1]["returned"][0] if got["calls"] else 0
            assert last == STEPS, (f"{replicas} replicas, replica {r}: its last call returned "
                                   f"step {last}; every replica left reaches step {STEPS}")


def test_the_step_a_replica_died_in_is_discarded_by_every_survivor(student):
    for replicas in WORLDS:
        victim = replicas - 1
        for r, got in survivors(student, replicas).items():
            if r == "replacement":
                continue
            lost = [c for c in got["calls"] if c["step"] == KILL_AT and victim in c["members"]]
            assert lost, f"{replicas} replicas, replica {r}: no quorum of step {KILL_AT} held " \
                         f"replica {victim}"
            assert lost[0]["returned"] == [KILL_AT, None], (
                f"{replicas} replicas, replica {r}: the step {KILL_AT} in whose all-reduce "
                f"replica {victim} died returned {lost[0]['returned']}; expected "
                f"[{KILL_AT}, None]: a step that a member did not get through is discarded "
                f"on every member")


def test_the_rejoined_replica_equals_its_peers_bitwise(student):
    for replicas in WORLDS:
        alive = survivors(student, replicas)
        back, peer = alive["replacement"], alive[0]
        first = back["calls"][0] if back["calls"] else None
        joined = max(first["steps"].values()) if first else None
        assert first is not None and joined > 0 and first["returned"][0] == joined + 1, (
            f"{replicas} replicas: the replacement's first call, in a quorum at step {joined}, "
            f"returned {first and first['returned']}; it takes a healthy peer's state and "
            f"trains that step with it (expected next step {joined and joined + 1})")
        assert len(back["state"]) == len(peer["state"]) and all(
            torch.equal(a, b) for a, b in zip(back["state"], peer["state"])), (
            f"{replicas} replicas: after step {STEPS} the replacement's weights and optimizer "
            f"state differ from replica 0's: a replica that rejoins takes both from a healthy "
            f"peer, and then equals it bit for bit")


def reference(alive, replicas):
    """[(step, members)] of the run's committed steps, as every replica that committed
    them saw them (they must agree), and each step in order once."""
    seen = {}
    for r, got in alive.items():
        for step, members, _ in committed(got["calls"]):
            assert seen.setdefault(step, members) == members, (
                f"{replicas} replicas: replica {r} committed step {step} with the rows of "
                f"{members}, another replica with those of {seen[step]}: the members of a "
                f"committed step all commit it, with the same quorum")
    assert sorted(seen) == list(range(STEPS)), (
        f"{replicas} replicas: the steps committed were {sorted(seen)}; expected each of 0 to "
        f"{STEPS - 1}")
    return [(s, seen[s]) for s in range(STEPS)]


@pytest.mark.parametrize("replicas", WORLDS)
def test_committed_losses_equal_one_process_over_the_same_samples(student, replicas):
    alive = survivors(student, replicas)
    steps = reference(alive, replicas)
    want, _ = lab12_cases.one_process(steps)
    for r, got in alive.items():
        mine = committed(got["calls"])
        assert [s for s, _, _ in mine] == sorted({s for s, _, _ in mine}), (
            f"{replicas} replicas, replica {r} committed the steps {[s for s, _, _ in mine]}: "
            f"each step once, in order")
        for step, members, loss in mine:
            expect_close(torch.tensor(loss), torch.tensor(want[step]),
                         f"{replicas} replicas, replica {r}, step {step}: the loss returned "
                         f"(against one process on the rows of the members {members})",
                         rtol=1e-10, atol=0)


@pytest.mark.parametrize("replicas", WORLDS)
def test_the_survivors_weights_equal_one_process(student, replicas):
    alive = survivors(student, replicas)
    _, want = lab12_cases.one_process(reference(alive, replicas))
    for r in range(replicas - 1):
        got = alive[r]["state"]
        assert len(got) == len(want), (f"{replicas} replicas, replica {r}: its optimizer "
                                       f"holds {len(got)} tensors; one process holds {len(want)}")
        for i, (a, b) in enumerate(zip(got, want)):
            expect_close(a, b, f"{replicas} replicas, replica {r}: weights and optimizer state "
                         f"#{i} after step {STEPS} (against one process)", rtol=1e-9, atol=1e-12)
