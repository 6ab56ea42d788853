"""The instructors' GitHub Actions workflows (.github/workflows/) are valid and do what
README.md says.

Validity: check-jsonschema (in the ``[dev]`` extra) against the GitHub workflow schema
it vendors (from SchemaStore), so no network is needed; skipped where it is not
installed. A broken workflow must fail the same check, or the check proves nothing.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def schema_errors(*paths: Path) -> str | None:
    """check-jsonschema's complaint about the workflow files, or None when they are valid."""
    pytest.importorskip("check_jsonschema")
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                          "vendor.github-workflows", *map(str, paths)],
                         capture_output=True, text=True, timeout=120)
    return None if run.returncode == 0 else run.stdout + run.stderr


def test_the_workflows_are_valid():
    paths = sorted(WORKFLOWS.glob("*.yml"))
    assert [p.name for p in paths] == ["gpu.yml", "test.yml"]
    problem = schema_errors(*paths)
    assert problem is None, problem


def test_a_broken_workflow_is_caught(tmp_path):
    broken = load("test.yml")
    del broken["jobs"]["cpu"]["runs-on"]                # a job with nowhere to run
    broken["jobs"]["cpu"]["steps"][0] = {"uses": 3}     # and a step that is no action
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump(broken))
    assert schema_errors(path) is not None


def steps(workflow: dict, job: str) -> list[dict]:
    return workflow["jobs"][job]["steps"]


def test_the_cpu_workflow_runs_make_test_with_its_caches():
    wf = load("test.yml")
    runs = [s.get("run", "") for s in steps(wf, "cpu")]
    assert any(r.startswith("make test") for r in runs), "the CPU job must run `make test`"
    assert wf["jobs"]["cpu"]["runs-on"].startswith("ubuntu")
    python = next(s for s in steps(wf, "cpu") if s.get("uses", "").startswith(
        "actions/setup-python"))
    assert python["with"]["cache"] == "pip" and \
        python["with"]["cache-dependency-path"] == "pyproject.toml"
    venv = next(s for s in steps(wf, "cpu") if s.get("uses", "").startswith("actions/cache"))
    assert venv["with"]["path"] == ".venv" and "hashFiles('pyproject.toml'" in venv["with"]["key"]
    assert "touch .venv/.distlab-installed" in runs, (
        "a restored .venv must be marked installed, or make reinstalls it")


def test_the_gpu_workflow_runs_the_gpu_tiers_on_a_self_hosted_runner():
    wf = load("gpu.yml")
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads the key `on` as True
    assert list(on) == ["workflow_dispatch"], "GPU runs start by hand: no push waits for one"
    job = wf["jobs"]["gpu"]
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    assert job["env"]["NCCL_NVLS_ENABLE"] == "0"
    runs = " ".join(s.get("run", "") for s in job["steps"])
    for command in ('-m "gpu or multigpu" tests', "distlab.grading solutions/", "make nbval"):
        assert command in runs, f"the GPU job does not run {command}"
