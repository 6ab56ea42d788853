"""python -m distlab.acceptance on a CPU: the registry, the selection, skipping what needs
GPUs, the result files and their environment, a missed goal's exit status, the time
limit, and the README block rendered from docs/results/ (cheap: no bench runs here)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlab.acceptance import cli, environment, registry, render
from distlab.acceptance.registry import Check, Verdict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def real_env():
    """The environment probe, once (a subprocess importing torch)."""
    return environment.describe(ROOT)


@pytest.fixture
def cpu_only(monkeypatch, real_env):
    """The machine as the checks see it: this one's environment, with no GPU."""
    env = dict(real_env, gpus=0, gpu_names=[], compute_capability=[])
    monkeypatch.setattr(environment, "describe", lambda root, timeout=120: dict(env))
    return env


@pytest.fixture
def fake(monkeypatch):
    """Register checks for one test only."""
    added = []

    def add(name, run, gpus=0, limit=30.0):
        added.append(name)
        registry.register(Check(name, gpus, limit, f"the goal of {name}", run))

    yield add
    for name in added:
        registry.unregister(name)


def test_list_shows_every_check_with_gpus_limit_and_goal(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in ("ring", "bench-vs-nccl-tests", "zero", "tp", "pp", "overlap", "nbval-gpu",
                 "grader-tiers"):
        check = registry.REGISTRY[name]
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert f"{check.gpus}" in line and f"{check.time_limit:.0f}s" in line, line
        assert check.goal.split()[0] in line


def test_the_module_runs_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "distlab.acceptance", "--list"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in registry.REGISTRY)


def test_an_unknown_check_names_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--only", "ring,nonsense"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown check(s) nonsense" in err and "choose from ring, bench-vs-nccl-tests" in err


def test_checks_that_need_gpus_are_skipped_and_write_nothing(tmp_path, capsys, cpu_only):
    code = cli.main(["--only", "ring,zero-1gpu,grader-tiers", "--out", str(tmp_path / "out"),
                     "--work", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert code == 0
    assert "ring: skipped: needs 2 GPUs, this machine has 0" in out
    assert "zero-1gpu: skipped: needs 1 GPU, this machine has 0" in out
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_result_holds_the_goal_the_figures_and_the_environment(tmp_path, fake, real_env,
                                                                 monkeypatch):
    monkeypatch.setattr(environment, "describe", lambda root, timeout=120: dict(real_env))

    def passing(ctx):
        proc = ctx.python("-c", "print('measured 42')").check()
        return Verdict([], {"output": proc.output.strip(), "table": {
            "columns": ["figure", "value"], "rows": [["answer", 42.0]]}})

    fake("fake-pass", passing)
    assert cli.main(["--only", "fake-pass", "--out", str(tmp_path), "--work",
                     str(tmp_path / "work")]) == 0
    result = json.loads((tmp_path / "fake-pass.json").read_text())
    assert result["check"] == "fake-pass" and result["status"] == "pass" and result["passed"]
    assert result["goal"] == "the goal of fake-pass" and result["figures"]["output"] == "measured 42"
    env = result["environment"]
    for field in environment.FIELDS:
        assert field in env, field
    assert env["torch"] and env["hardware"] and env["date"].endswith("+00:00")
    assert env["git_commit"] == "unknown" or len(env["git_commit"]) == 40
    assert env["git_changes"] is None or isinstance(env["git_changes"], list)
    assert "no GPU" in env["hardware"] or env["gpu_names"]


def test_a_missed_goal_exits_non_zero(tmp_path, fake, cpu_only, capsys):
    fake("fake-miss", lambda ctx: Verdict(["the answer was 41, goal 42"], {"answer": 41}))
    fake("fake-pass", lambda ctx: Verdict([], {}))
    code = cli.main(["--only", "fake-pass,fake-miss", "--out", str(tmp_path), "--work",
                     str(tmp_path / "work")])
    assert code == 1
    result = json.loads((tmp_path / "fake-miss.json").read_text())
    assert result["status"] == "fail" and not result["passed"]
    assert result["misses"] == ["the answer was 41, goal 42"]
    assert "goals missed or checks failed: fake-miss" in capsys.readouterr().out


def test_a_bench_past_its_time_limit_is_stopped(tmp_path, fake, cpu_only):
    def hangs(ctx):
        ctx.python("-c", "import time; time.sleep(600)").check()
        return Verdict([], {})

    fake("fake-hang", hangs, limit=1.0)
    start = time.monotonic()
    code = cli.main(["--only", "fake-hang", "--out", str(tmp_path), "--work", str(tmp_path / "w")])
    assert code == 1 and time.monotonic() - start < 30
    result = json.loads((tmp_path / "fake-hang.json").read_text())
    assert result["status"] == "error"
    assert "stopped at the time limit" in result["misses"][0]


def _result(name, status, rows, date):
    return {"check": name, "goal": f"goal of {name}", "status": status, "passed": status == "pass",
            "misses": [] if status == "pass" else ["missed by 0.1"], "seconds": 12.3,
            "figures": {"table": {"columns": ["size", "ratio"], "rows": rows}},
            "environment": {"date": date, "hardware": "1 x GPU (80 GiB)", "torch": "2.11",
                            "nccl": "2.28.9", "git_commit": "a" * 40, "git_changes": []}}


def test_render_is_deterministic_and_rewrites_only_the_block(tmp_path, capsys):
    first, second = tmp_path / "a", tmp_path / "b"
    results = [_result("zero-1gpu", "pass", [["64 MiB", 0.81234]], "2026-12-01T21:00:00+00:00"),
               _result("ring", "fail", [["1 GiB", 0.7]], "2026-12-01T21:05:00+00:00")]
    for folder, order in ((first, results), (second, results[::-1])):
        folder.mkdir()
        for r in order:
            (folder / f"{r['check']}.json").write_text(json.dumps(r))
    text = render.render(first)
    assert text == render.render(first) == render.render(second)
    assert text.index("`ring` (committed result): goals missed") < text.index(
        "`zero-1gpu` (committed result): goals met")  # registry order
    assert "| 64 MiB | 0.812 |" in text and "- missed: missed by 0.1" in text
    assert "commit `aaaaaaaaaaaa`" in text and "No result yet for `bench-vs-nccl-tests`" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{render.BEGIN}\nstale\n{render.END}\noutro\n")
    assert cli.main(["render", "--results", str(first), "--readme", str(readme)]) == 0
    new = readme.read_text()
    assert new.startswith("intro\n") and new.endswith(f"{render.END}\noutro\n")
    assert render.block_of(new).strip() == text.strip()
    assert cli.main(["render", "--results", str(first), "--readme", str(readme)]) == 0
    assert "already current" in capsys.readouterr().out
    readme.write_text("no markers\n")
    assert cli.main(["render", "--results", str(first), "--readme", str(readme)]) == 1
    assert readme.read_text() == "no markers\n"


def test_the_readme_block_is_the_render_of_docs_results():
    text = (ROOT / "README.md").read_text()
    block = render.block_of(text)
    if block is None:
        pytest.skip(f"README.md has no {render.BEGIN} ... {render.END} block yet")
    assert block.strip() == render.render(ROOT / "docs" / "results").strip(), (
        "README.md's acceptance block is not the render of docs/results/: run "
        "python -m distlab.acceptance render --readme README.md")


def test_show_displays_a_result_or_what_to_run(tmp_path, monkeypatch):
    """Notebooks' GPU sections: the committed result's table with its provenance, or the
    command that makes one; an unknown check is an error naming the checks."""
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj.data))
    (tmp_path / "ring.json").write_text(json.dumps(
        _result("ring", "pass", [["1 GiB", 0.97]], "2026-12-01T21:05:00+00:00")))
    got = render.show("ring", tmp_path)
    assert got["status"] == "pass" and "| 1 GiB | 0.970 |" in shown[-1]
    assert "2026-12-01T21:05:00" in shown[-1] and "`aaaaaaaaaaaa`" in shown[-1]
    assert "on a GPU machine and committed" in shown[-1], "a student sees where it came from"
    assert render.show("pp", tmp_path) is None and render.result("pp", tmp_path) is None
    assert "no result yet" in shown[-1] and "--only pp" in shown[-1] and "2 GPUs" in shown[-1]
    (tmp_path / "tp.json").write_text(json.dumps({"check": "ring"}))  # another check's file
    assert render.result("tp", tmp_path) is None
    with pytest.raises(ValueError, match="no acceptance check named 'rnig'.*ring"):
        render.show("rnig", tmp_path)
    assert render.RESULTS == ROOT / "docs" / "results"
