"""distlab.bench.train's CPU path: the composed step beside torch's composition (FSDP2's
fully_shard, DTensor TP) in one gloo launch, its JSON and table, and the goal judged on
rows built to miss it. (torch's pipelining side is bench.pp's ``torch_pipeline``, run
on CPU by tests/test_pp.py; importing it here would cost the ranks seconds.)"""
import json

import pytest

from distlab.bench import train as train_bench


def test_the_bench_runs_on_cpu_beside_torchs_composition(tmp_path, capsys):
    assert train_bench.main(["--out", str(tmp_path), "--model", "test", "--vocab-size", "16",
                             "--layouts", "2,1,1", "1,2,1", "--batch-size", "4", "--steps",
                             "1", "--warmup", "0", "--backend", "gloo"]) == 0  # CPU: no goal
    out = capsys.readouterr().out
    assert "fp32" in out and "gloo       2,1,1" in out and "gloo       1,2,1" in out
    data = json.loads((tmp_path / "train_bench.json").read_text())
    assert data["backend"] == "gloo" and data["goal"] == train_bench.GOAL
    rows = {r["layout"]: r for r in data["rows"]}
    assert set(rows) == {"2,1,1", "1,2,1"}
    for r in rows.values():
        assert r["torch_error"] is None, r["torch_error"]
        (ours, theirs), = r["rounds_s"]  # --steps 1: one round of one step each
        assert r["step_ms"] == pytest.approx(1e3 * ours) and r["vs_torch"] == pytest.approx(
            ours / theirs) and r["tokens_per_s"] == pytest.approx(4 * 16 / ours)
        assert r["mfu"] is None and r["torch_mfu"] is None  # no peak FLOP/s for a CPU

    judged = [dict(rows["2,1,1"], vs_torch=train_bench.GOAL * 1.01),
              dict(rows["1,2,1"], vs_torch=train_bench.GOAL * 0.99),
              dict(rows["1,2,1"], layout="2,2,1", torch_error="NotImplementedError: one dim"),
              {"link": "host", "layout": "1,2,1", "error": "the launch failed: hung"}]
    misses = train_bench.goal_misses(judged)
    assert len(misses) == 3 and "(2,1,1)" in misses[0] and "above 1.25x" in misses[0]
    assert "one dim" in misses[1] and "host" in misses[2] and "hung" in misses[2]
    assert "hung" in train_bench.table(judged) and "torch failed" in train_bench.table(judged)
    with pytest.raises(ValueError, match="dp,tp,pp"):
        train_bench.parse_layout("2,1")
