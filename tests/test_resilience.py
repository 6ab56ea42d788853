"""distlab.resilience: the failure model's formulas, the flight records and the
analyzer's reading of them, the bit flip and its hashes, and replicas that survive a
SIGKILL in the middle of an all-reduce, run inside a PID namespace (as root) with the
guard that refuses, and records, any signal to PID <= 1."""
import json
import math
import pickle
import sys
from pathlib import Path

import pytest
import torch

from pid_guard import SETTLE, run_guarded

from distlab.resilience import daly_interval, failures, flight, goodput, mtbf_s, sdc, young_interval

EXERCISES = Path(__file__).resolve().parents[1] / "lib" / "distlab" / "grading" / "exercises"
sys.path.insert(0, str(EXERCISES))
import lab12_cases  # noqa: E402  (the generated flight records of the exercise's tests)


def test_young_and_daly_against_their_formulas():
    m = mtbf_s(54, 466)
    assert m == pytest.approx(54 * 86400 / 466)
    assert young_interval(60, m) == pytest.approx(math.sqrt(2 * 60 * m))
    r = 60 / (2 * m)
    assert daly_interval(60, m) == pytest.approx(
        math.sqrt(2 * 60 * m) * (1 + math.sqrt(r) / 3 + r / 9) - 60)
    assert daly_interval(3 * m, m) == m                      # a checkpoint past 2M: M
    taus = [young_interval(60, m) * f for f in (0.25, 0.5, 1, 2, 4)]
    best = max(taus, key=lambda t: goodput(t, 60, 600, m))
    assert best == taus[2], "goodput peaks at Young's interval among these"
    with pytest.raises(ValueError):
        mtbf_s(54, 0)


def test_failures_arrive_as_a_poisson_process():
    steps = failures.failure_steps(200_000, 100, seed=1)
    assert steps == sorted(steps) and 0 <= steps[0] and steps[-1] < 200_000
    assert len(steps) == pytest.approx(2000, rel=0.1)


def test_a_flipped_bit_is_one_bit_and_changes_the_hash():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = torch.randn(5, dtype=dtype)
        before, hashed = t.clone(), sdc.digest([t])
        sdc.flip_bit(t, 3, 2)
        diff = (t.view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
                ^ before.view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]))
        assert diff.tolist() == [0, 0, 0, 4, 0] and sdc.digest([t]) != hashed
        sdc.flip_bit(t, 3, 2)
        assert torch.equal(t, before) and sdc.digest([t]) == hashed
    sign = torch.ones(2)
    sdc.flip_bit(sign, 1, 31)
    assert sign.tolist() == [1.0, -1.0]


def test_records_keep_what_the_recorder_kept_and_the_analyzer_reads_the_dumps():
    case = next(c for c in lab12_cases.scenarios()
                if c["kind"] == "dp" and c["expected"]["rank"] == 2 and len(c["groups"]["dp"]) == 5)
    rec = flight.record(case["dumps"][0])
    raw = pickle.loads(case["dumps"][0])["entries"]
    assert rec["dropped"] == 0 and [e["seq"] for e in rec["entries"]] == \
        [e["collective_seq_id"] for e in raw]
    assert rec["entries"][0]["op"] == "all_reduce" and rec["entries"][0]["group"] == "dp"
    short = flight.record(flight.keep_last(case["dumps"][0], 3))
    assert short["dropped"] == len(raw) - 3 and short["entries"] == rec["entries"][-3:]
    (verdict,) = flight.analyze(case["dumps"])
    assert verdict["culprits"] == [2] and verdict["group"] == "dp" and \
        verdict["seq"] == case["expected"]["seq"]


_TRIAL = """
import json, sys
sys.path.insert(0, sys.argv[1])
import lab12_cases
from distlab import launch
from distlab.resilience import replicas
from distlab.resilience.recovery import fault_tolerant_step
found = replicas.run(fault_tolerant_step, 2, lab12_cases.JOB, kill_in_step=lab12_cases.KILL_AT)
victim = found[1]
out = {"victim": [type(victim).__name__, getattr(victim, "returncode", None)],
       "survivor": found[0]["calls"][-1]["returned"][0],
       "equal": all(bool((a == b).all()) for a, b in zip(found[0]["state"], found["replacement"]["state"]))}
launch.shutdown()
print(json.dumps(out))
"""

_DRIVER = """
import json, os, subprocess, sys, time
done = subprocess.run([sys.executable, sys.argv[1], sys.argv[2]], capture_output=True, text=True,
                      timeout=240)
""" + SETTLE + """
print(json.dumps({"code": done.returncode, "out": done.stdout.strip(), "err": done.stderr[-3000:],
                  "pid": os.getpid(), "left": left}))
"""


def test_a_replica_killed_mid_all_reduce_is_survived_and_nothing_outlives_it(tmp_path):
    """Two replicas: the second dies by SIGKILL in step 1's all-reduce, the first keeps
    training, a replacement rejoins bit for bit; in a PID namespace nothing is left
    after, and no process signalled PID <= 1."""
    done, namespace, log = run_guarded(tmp_path, {"trial.py": _TRIAL, "driver.py": _DRIVER},
                                       ["driver.py", tmp_path / "trial.py", EXERCISES], 300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, report["err"]
    trial = json.loads(report["out"].splitlines()[-1])
    assert trial == {"victim": ["RankCrashed", -9], "survivor": lab12_cases.STEPS, "equal": True}
    assert not log.exists(), f"a signal to PID <= 1 was attempted:\n{log.read_text()}"
    if namespace:
        assert report["pid"] == 1 and report["left"] == [], (
            f"processes outlived their launchers: {report['left']}")
