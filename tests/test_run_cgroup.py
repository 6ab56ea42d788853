"""A grading run in a cgroup of its own: its pytest, its fork server and every rank of it
counted together against one memory cap and one process cap (issue 43, row 1: fork
servers and everything under them are capped), and the cgroup gone once the run ends."""
import json
import os
import sys

import pytest

from distlab.grading import sandbox
from distlab.runtime import cgroup, confine

_REPORT = """
import os, sys
found = {}
for line in open("/proc/self/cgroup"):
    _, names, path = line.rstrip("\\n").split(":", 2)
    for controller, knob in (("memory", "memory.limit_in_bytes"), ("pids", "pids.max")):
        if controller in names.split(","):
            folder = os.path.join("/sys/fs/cgroup", controller, path.lstrip("/"))
            found[controller] = (folder, open(os.path.join(folder, knob)).read().strip())
print("FOUND", repr(found), flush=True)
"""


@pytest.mark.skipif(not cgroup.make_possible(), reason="no cgroup v1 memory and pids to write here")
def test_a_grading_run_is_capped_as_a_whole_and_its_cgroup_is_removed(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(_REPORT)
    memory_mb, processes = 300, 40
    env = dict(os.environ, DISTLAB_GRADE_MEMORY_MB=str(memory_mb),
               **{confine.ENV: json.dumps({"processes": processes})})
    code, out = sandbox.run_contained([sys.executable, str(script)], env=env, cwd=tmp_path,
                                      timeout=60)
    assert code == 0, out
    found = eval(out.split("FOUND", 1)[1].strip().splitlines()[0])  # noqa: S307 (our own repr)
    limit, tasks = cgroup.run_limits(memory_mb, processes)
    assert found["memory"][1] == str(limit) and found["pids"][1] == str(tasks), found
    for folder, _ in found.values():
        assert os.path.basename(folder).startswith(f"{cgroup.PREFIX}run-"), folder
        assert not os.path.exists(folder), f"{folder} outlived its run"


def test_a_run_that_is_not_graded_gets_no_cgroup(tmp_path):
    """The launcher's own contained runs (no ranks' memory cap in their environment) are
    left where they are."""
    env = {k: v for k, v in os.environ.items() if k != "DISTLAB_GRADE_MEMORY_MB"}
    assert sandbox._run_cgroup(env) is None
