"""The launcher: results, warm ranks, and every failure mode ending promptly and cleanly."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from distlab import launch


def _rank_and_pid(offset, scale=1):
    assert torch.get_num_threads() == 1, "each rank computes on one thread"
    return dist.get_rank() * scale + offset, dist.get_world_size(), os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("world_size", [1, 3])
def test_results_come_back_in_rank_order_with_args_and_kwargs(world_size):
    out = launch.run(_rank_and_pid, world_size, 100, scale=10, backend="gloo")
    assert [o[0] for o in out] == [100 + 10 * r for r in range(world_size)]
    assert all(o[1] == world_size for o in out)
    assert len({o[2] for o in out}) == world_size, "each rank is a process of its own"


def test_ranks_stay_warm_and_are_replaced_after_a_failure():
    first = {o[2] for o in launch.run(_rank_and_pid, 2, 0, backend="gloo")}
    start = time.perf_counter()
    second = {o[2] for o in launch.run(_rank_and_pid, 2, 0, backend="gloo")}
    warm = time.perf_counter() - start
    assert first == second, "a second launch of the same shape reuses the ranks"
    assert warm < 2.0, f"a warm launch took {warm:.2f} s"
    with pytest.raises(launch.RankError):
        launch.run(_raise_on, 2, 1, backend="gloo")
    third = {o[2] for o in launch.run(_rank_and_pid, 2, 0, backend="gloo")}
    assert not third & first, "ranks that saw a failure are never reused"
    isolated = {o[2] for o in launch.run(_rank_and_pid, 2, 0, backend="gloo", isolated=True)}
    assert not isolated & third, "isolated=True runs on fresh processes"
    assert all(not _alive(pid) for pid in isolated), "an isolated launch leaves no process"


def _raise_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} is unhappy")
    t = torch.zeros(3)
    dist.all_reduce(t)  # the others block here, waiting for the failed rank


def test_a_rank_that_raises_names_itself_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(launch.RankError) as info:
        launch.run(_raise_on, 4, 2, backend="gloo", timeout=60)
    assert time.monotonic() - start < 20, "the others must be stopped, not left to time out"
    e = info.value
    assert e.rank == 2 and e.exc_type == "ValueError"
    assert isinstance(e.original, ValueError) and str(e.original) == "rank 2 is unhappy"
    assert 'raise ValueError(f"rank {bad_rank} is unhappy")' in e.remote_traceback, \
        "the traceback shows the source line of a function defined in the caller"
    text = str(e)
    for r in (0, 1, 3):
        assert f"rank {r}: waiting in all_reduce" in text, text


# A notebook whose launched function fails inside the standard library (json): what the
# RankError says first, as IPython runs the cells
IN_IPYTHON = """
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("import json\\nfrom distlab import launch", store_history=True)
shell.run_cell("def parse():\\n    text = '{'\\n    return json.loads(text)", store_history=True)
shell.run_cell("try:\\n    launch.run(parse, 2, backend='gloo')\\n"
               "except launch.RankError as e:\\n    print(str(e))", store_history=True)
print("--- uncaught, as a notebook shows it:")
shell.run_cell("launch.run(parse, 2, backend='gloo')", store_history=True)
"""


def test_a_rank_error_says_first_what_was_raised_and_at_which_line_of_the_callers_code():
    run = subprocess.run([sys.executable, "-c", IN_IPYTHON], capture_output=True, text=True,
                         timeout=120)
    lines = run.stdout.splitlines()
    assert lines[:2] == [
        "rank 0 raised JSONDecodeError: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)",
        "  at Cell In[2], line 3, in parse: return json.loads(text)"], run.stdout + run.stderr
    assert lines[3] == "Traceback (most recent call last):", "then the details"
    shown = lines[lines.index("--- uncaught, as a notebook shows it:") + 1:]
    # the message first, not the launcher's frames above it
    assert shown[0].endswith("RankError: rank 0 raised JSONDecodeError: Expecting property "
                             "name enclosed in double quotes: line 1 column 2 (char 1)"), shown
    assert shown[1] == lines[1], shown


def _deadlock():
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.zeros(8)
    dist.recv(t, src=(rank + 1) % world)  # every rank receives first: nobody sends
    dist.send(t, dst=(rank - 1) % world)


def test_a_hang_is_stopped_after_the_timeout_with_stacks_and_last_calls():
    start = time.monotonic()
    with pytest.raises(launch.LaunchTimeout) as info:
        launch.run(_deadlock, 3, backend="gloo", timeout=2)
    assert time.monotonic() - start < 15
    e = info.value
    assert sorted(e.where) == [0, 1, 2]
    for r in range(3):
        assert e.where[r].startswith(f"waiting in recv(32 B float32 from {(r + 1) % 3})"), e.where
        assert "in _deadlock" in e.stacks[r], e.stacks[r]
    assert "deadlock" in str(e)


def _crash_rank(victim):
    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_reported_and_the_rest_stopped():
    with pytest.raises(launch.RankCrashed) as info:
        launch.run(_crash_rank, 3, 1, backend="gloo", timeout=60)
    assert info.value.rank == 1 and info.value.returncode == -signal.SIGKILL
    assert "SIGKILL" in str(info.value)


def _mismatched_sizes():
    t = torch.ones(4 if dist.get_rank() == 0 else 8)
    dist.all_reduce(t)


def test_ranks_that_disagree_on_a_collective_are_told_so():
    with pytest.raises(launch.RankCrashed) as info:
        launch.run(_mismatched_sizes, 2, backend="gloo", timeout=30)
    assert "mismatched shapes across ranks" in str(info.value)
    assert "Received data size doesn't match" in str(info.value), "the backend's own words"


def test_output_is_grouped_by_rank_and_tagged(capsys):
    def talk():
        for i in range(3):
            print(f"line {i}")
        print("to stderr", file=sys.stderr)

    launch.run(talk, 2, backend="gloo")
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"[rank {r}] line {i}" for r in range(2) for i in range(3)]
    assert err.splitlines() == ["[rank 0] to stderr", "[rank 1] to stderr"]


def test_bad_input_gets_errors_that_name_the_fix():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="positive integer"):
            launch.run(_rank_and_pid, bad, 0)
    with pytest.raises(ValueError, match="backend='gloo'"):
        launch.run(_rank_and_pid, 64, 0, backend="nccl")
    with pytest.raises(ValueError, match="backend must be one of"):
        launch.run(_rank_and_pid, 1, 0, backend="mpi")
    with pytest.raises(launch.LaunchError, match="cannot send"):
        launch.run(_rank_and_pid, 1, threading.Lock())


def test_a_world_the_machine_cannot_hold_is_refused_before_any_rank_starts(monkeypatch):
    """launch.run(fn, 10000) once ran the machine out of memory and the caller was killed:
    now it is refused at once, saying why and how many ranks fit."""
    from distlab.runtime import pool

    start = time.monotonic()
    with pytest.raises(launch.LaunchError, match=r"world_size=10000 is more ranks than this "
                                                 r"machine can start: each rank is a process"):
        launch.run(_rank_and_pid, 10000, 0, backend="gloo", isolated=True)
    assert time.monotonic() - start < 5, "refused before any rank started"
    monkeypatch.setattr(pool, "available_mb", lambda: 10 * pool.RANK_MB + 5)
    with pytest.raises(launch.LaunchError, match=r"room for 10 ranks\. Ask for at most 10"):
        launch.run(_rank_and_pid, 11, 0, backend="gloo", isolated=True)


def _nested(world_size):
    return launch.run(dist.get_rank, world_size)


def test_a_launch_inside_a_launch_of_another_size_says_what_to_do():
    assert launch.run(_nested, 2, 2, backend="gloo") == [[0, 1], [0, 1]]
    with pytest.raises(launch.RankError, match=r"launch.run\(\.\.\., 3\) was called inside a "
                                               r"launched function, on a rank of a launch of 2"):
        launch.run(_nested, 2, 3, backend="gloo")


def test_an_unpicklable_result_and_a_missing_package_are_explained():
    def generator():
        return (i for i in range(3))

    with pytest.raises(launch.RankError, match="cannot be sent back") as info:
        launch.run(generator, 2, backend="gloo")
    assert info.value.exc_type == "UnpicklableResult"

    def needs_missing_package():
        import distlab_no_such_package  # noqa: F401

    with pytest.raises(launch.RankError, match="pip install distlab_no_such_package"):
        launch.run(needs_missing_package, 2, backend="gloo")


def test_progress_reports_from_rank_zero(capsys):
    def loop():
        total = 0
        for i in launch.progress(range(5), desc="steps"):
            total += i
        return total

    assert launch.run(loop, 2, backend="gloo") == [10, 10]
    assert "steps" in capsys.readouterr().err, "rank 0 drives a progress bar in the caller"


def _tqdm_bar(steps):
    from tqdm import tqdm

    for _ in tqdm(range(steps), desc="steps", mininterval=0, miniters=1, ascii=True):
        pass


def test_a_progress_bar_in_a_rank_prints_what_a_terminal_shows(capfd):
    """A 50-step tqdm bar in a rank (50 carriage-return redraws) printed 53 lines; a
    terminal shows one, the bar's last state."""
    launch.run(_tqdm_bar, 1, 50, backend="gloo")
    lines = [line for line in capfd.readouterr().err.splitlines() if "steps" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("[rank 0] steps: 100%") and "50/50" in lines[0], lines


def test_many_launches_in_parallel_never_collide():
    """Each pool rendezvouses through a file of its own, and gloo connects on ports the
    OS picks: parallel launches never collide."""
    results, errors = {}, []

    def one(i):
        try:
            results[i] = launch.run(_rank_and_pid, 2, i, backend="gloo", isolated=True)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert {i: [o[0] for o in out] for i, out in results.items()} == {
        i: [i, i + 1] for i in range(10)}


_SCRIPT = """
import os, sys, time
import torch.distributed as dist
from distlab import launch

def sleeper(path):
    with open(path + f".{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)

launch.run(sleeper, 2, sys.argv[1], backend="gloo", timeout=600)
"""


def _start_script(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "pid")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    pids = []
    while time.monotonic() < deadline and len(pids) < 2:
        pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)
                if (tmp_path / f"pid.{r}").exists() and (tmp_path / f"pid.{r}").read_text()]
        time.sleep(0.1)
    assert len(pids) == 2, proc.communicate(timeout=5)
    return proc, pids


def _all_gone(pids, seconds=10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_interrupting_the_caller_stops_every_rank(tmp_path):
    proc, pids = _start_script(tmp_path)
    proc.send_signal(signal.SIGINT)  # what Jupyter's "interrupt kernel" sends
    out, err = proc.communicate(timeout=30)
    assert "KeyboardInterrupt" in err
    assert _all_gone(pids), "ranks outlived an interrupted launch"


def test_no_rank_outlives_a_killed_launcher(tmp_path):
    proc, pids = _start_script(tmp_path)
    proc.kill()  # SIGKILL: no Python cleanup runs in the launcher
    proc.wait()
    assert _all_gone(pids), "ranks outlived their launcher"


def test_under_torchrun_the_same_call_runs_in_process(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch.distributed as dist
        from distlab import launch

        def work(x):
            return dist.get_rank() + x

        results = launch.run(work, 2, 10)
        sys.stdout.write(f"results {results}\\n")  # one write: the ranks share stdout
    """))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started
    assert proc.returncode == 0, err
    assert out.count("results [10, 11]") == 2, out


def _nccl_all_reduce():
    t = torch.ones(4, device=f"cuda:{os.environ['LOCAL_RANK']}") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_backend(), t


@pytest.mark.gpu
def test_nccl_world_size_one_on_a_gpu():
    backend_name, t = launch.run(_nccl_all_reduce, 1, backend="nccl")[0]
    assert backend_name == "nccl" and t.tolist() == [1.0] * 4


@pytest.mark.gpu
def test_more_nccl_ranks_than_gpus_is_a_clear_error_not_duplicate_gpu():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"world_size={n + 1}.*backend='gloo'"):
        launch.run(_nccl_all_reduce, n + 1, backend="nccl")
    assert launch.run(dist.get_backend, n + 1, backend="auto") == ["gloo"] * (n + 1)
