"""The launcher under clumsy and hostile use: interrupts at any moment, descriptors past
1024, threads, odd output, bad arguments, ranks that leave the group or hoard memory.

The interrupt test runs in a PID namespace where one can be made (as root), with a guard
in every Python process it starts that refuses, and records, any signal to PID <= 1.
"""
import json
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

from pid_guard import SETTLE, run_guarded

from distlab import launch
from distlab.comm import StatusBoard
from distlab.runtime import pool as pool_module
from distlab.runtime.forkserver import ForkServer, ForkServerError


_TRIAL = """
import sys, threading, time, _thread, os
import torch.distributed as dist
from distlab import launch

delay = float(sys.argv[1])
timer = threading.Timer(delay, _thread.interrupt_main)
first = "finished"
try:
    timer.start()     # on a loaded machine the interrupt may land while its thread starts
    launch.run(dist.get_rank, 2, backend="gloo", timeout=60)
except KeyboardInterrupt:
    first = "interrupted"
try:
    timer.cancel()
    timer.join()
    time.sleep(0.05)  # a late interrupt lands here, not in the launches below
except KeyboardInterrupt:
    timer.join()
results = [launch.run(dist.get_rank, 2, backend="gloo", timeout=60) for _ in range(2)]
launch.shutdown()
print(first, results)
"""

_DRIVER = """
import json, os, subprocess, sys, time
delays = [float(x) for x in sys.argv[2:]]
procs = [subprocess.Popen([sys.executable, sys.argv[1], str(d)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) for d in delays]
outs = []
for p in procs:
    out, err = p.communicate(timeout=240)
    outs.append({"code": p.returncode, "out": out.strip(), "err": err[-2000:]})
""" + SETTLE + """
print(json.dumps({"trials": outs, "left": left, "pid": os.getpid()}))
"""


def test_interrupting_the_cold_launch_at_any_moment_never_signals_pid_1(tmp_path):
    """Ctrl-C while the fork server starts, forks, or answers: later launches work and
    nothing ever signals PID <= 1 (the defect: a reply left unread made a later launch
    take PID 1 for a rank and SIGKILL it)."""
    delays = ["0.05", "0.3", "0.6", "0.9", "1.3", "2.0", "3.0"]
    done, namespace, log = run_guarded(tmp_path, {"trial.py": _TRIAL, "driver.py": _DRIVER},
                                       ["driver.py", tmp_path / "trial.py", *delays], 300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not log.exists(), f"a signal to PID <= 1 was attempted:\n{log.read_text()}"
    for delay, trial in zip(delays, report["trials"]):
        assert trial["code"] == 0, f"interrupt after {delay} s: {trial['err']}"
        assert trial["out"].endswith("[[0, 1], [0, 1]]"), (delay, trial)
    if namespace:
        assert report["pid"] == 1 and report["left"] == [], (
            f"processes outlived their launchers: {report['left']}")


def test_an_interrupted_exchange_discards_the_fork_server(monkeypatch):
    """No exchange is left half done: the reply to a request is never read by the next."""
    import socket

    server = ForkServer()
    real = socket.recv_fds
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(socket, "recv_fds", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.reap(12345)
    monkeypatch.setattr(socket, "recv_fds", real)
    assert calls and server.broken and server.proc.poll() is not None
    with pytest.raises(ForkServerError, match="discarded"):
        server.spawn({}, 0, 1, 2)


_PREFORK = """
import json, os, sys, threading
from distlab.runtime.forkserver import ForkServer

secret_r, secret_w = os.pipe()  # stands for the grader's report pipe
server = ForkServer.forked()
pid = server.proc.pid
read, write = os.pipe()
child = server.spawn({"PATH": os.environ.get("PATH", "")}, read, write, write)
os.close(read)
os.close(write)
exited = child.wait(30)
code = child.returncode()  # a later round trip: the pidfd the server sent is closed by now
fds = sorted(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
child.close()
session = os.getsid(pid)
server.close()
stop = threading.Event()
thread = threading.Thread(target=stop.wait)
thread.start()
refused = ForkServer.forked() is None
stop.set()
thread.join()
print(json.dumps({"fds": fds, "pipes": [os.readlink(f"/proc/self/fd/{fd}") for fd in (secret_r, secret_w)],
                  "rank": [exited, code], "session": session, "server": pid,
                  "closed": server.proc.returncode, "refused": refused}))
"""


def test_a_fork_server_forked_from_its_launcher_keeps_nothing_of_it(tmp_path):
    """The grader's pytest forks its ranks' server from itself before it imports a test
    (``ForkServer.forked``): the server keeps only its socket and the standard three of
    the launcher's descriptors, leads a session of its own, forks ranks, exits when its
    socket closes, and is refused in a process that runs another Python thread."""
    done, _, log = run_guarded(tmp_path, {"prefork.py": _PREFORK}, ["prefork.py"], 120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not log.exists(), f"a signal to PID <= 1 was attempted:\n{log.read_text()}"
    sockets = [fd for fd in report["fds"] if fd.startswith("socket:")]
    assert len(sockets) == 1 and len(report["fds"]) == 4, report["fds"]
    assert not set(report["pipes"]) & set(report["fds"]), "the launcher's pipe reached the server"
    assert report["rank"] == [True, 1], "a rank without its environment exits at once, with 1"
    assert report["session"] == report["server"] and report["closed"] == 0
    assert report["refused"], "forked from a process with another Python thread"


def _exits_at_once():
    return os.getpid()


def test_the_fork_server_signals_only_its_own_unreaped_children():
    """A group kill is refused for a PID the server has reaped (it may be recycled) or
    never forked; a signal to PID 1 is refused outright."""
    server = ForkServer()
    try:
        read, write = os.pipe()
        child = server.spawn({"PATH": os.environ.get("PATH", "")}, read, write, write)
        os.close(read)
        os.close(write)
        assert child.pid > 1
        assert child.wait(30), "a rank without its environment exits at once"
        assert child.returncode() == 1
        assert server.kill_group(child.pid) is False, "reaped: its PID is no longer ours"
        assert server.kill_group(1) is False and server.kill_group(os.getpid()) is False
        child.kill()  # after reaping: a no-op through the pidfd, no group kill
        child.close()
    finally:
        server.close()


_MANY_FDS = """
import os, resource
import torch.distributed as dist
from distlab import launch
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
assert max(held) > 1024
print(launch.run(dist.get_rank, 2, backend="gloo", timeout=60),
      launch.run(dist.get_rank, 3, backend="gloo", timeout=60))
"""


def test_launches_work_with_descriptors_above_1024(tmp_path):
    script = tmp_path / "fds.py"
    script.write_text(_MANY_FDS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[0, 1] [0, 1, 2]"


def _pids():
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_second_interrupt_during_shutdown_leaves_no_rank_and_no_half_pool(monkeypatch):
    pids = launch.run(_pids, 3, backend="gloo", timeout=60)
    pool = launch._pool

    def interrupted_wait(ranks, timeout):
        raise KeyboardInterrupt  # the second Ctrl-C, during the graceful wait

    monkeypatch.setattr(pool_module, "wait_exit", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        launch.shutdown()
    monkeypatch.undo()
    assert launch._pool is None, "the pool is cleared even when its shutdown is interrupted"
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, pids)), "ranks outlived an interrupted shutdown"
    pool.close()  # closing again is harmless
    launch.shutdown()
    assert launch.run(_pids, 3, backend="gloo", timeout=60) != pids


def test_a_rank_that_dies_while_starting_says_why(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(launch.LaunchError) as info:
        launch.run(_pids, 2, backend="gloo", timeout=60, isolated=True)
    text = str(info.value)
    assert "while starting" in text and "nosuchif0" in text, text


def _leave_the_group():
    rank = dist.get_rank()
    dist.destroy_process_group()  # as PyTorch's tutorials end their functions
    return rank


def test_a_function_that_destroys_the_group_does_not_break_later_launches():
    assert launch.run(_leave_the_group, 2, backend="gloo", timeout=60) == [0, 1]
    assert launch.run(dist.get_world_size, 2, backend="gloo", timeout=60) == [2, 2]


def _print_unfinished(i):
    print(f"partial {i}", end="")
    print("\r 10%|#   \r 100%|##########", end="\r", file=sys.stderr)
    print("\x00distlab-end-of-launch\x00")  # the old in-band marker, printed by a user
    return i


def test_output_without_newlines_or_with_the_old_marker_never_shifts_or_stalls(capfd):
    start = time.monotonic()
    for i in range(3):
        assert launch.run(_print_unfinished, 2, i, backend="gloo", timeout=60) == [i, i]
        out, err = capfd.readouterr()
        for r in range(2):
            assert f"[rank {r}] partial {i}" in out, out
            assert f"[rank {r}]  100%|##########" in err, err
    assert time.monotonic() - start < 30, "warm launches must not wait for an end marker"


def test_threads_take_turns_on_the_warm_ranks():
    errors, results = [], {}

    def one(i):
        try:
            results[i] = launch.run(_rank_plus, 2, i, backend="gloo", timeout=120)
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    for _ in range(3):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors
        assert results == {i: [i, i + 1] for i in range(8)}


def _rank_plus(i):
    return dist.get_rank() + i


@pytest.mark.parametrize("bad, error", [
    (float("nan"), ValueError), (float("inf"), ValueError), (-1, ValueError), (0, ValueError),
    ("5", TypeError), (True, TypeError), (None, TypeError)])
def test_bad_timeouts_are_refused_with_the_fix(bad, error):
    with pytest.raises(error, match="timeout"):
        launch.run(_pids, 1, backend="gloo", timeout=bad)


def _unbuildable():
    def explode():
        raise RuntimeError("this class cannot be rebuilt")

    class Fragile:
        def __reduce__(self):
            return explode, ()

    return Fragile()


def test_a_result_that_cannot_be_rebuilt_names_its_rank():
    with pytest.raises(launch.LaunchError, match=r"rank 0's result could not be rebuilt"):
        launch.run(_unbuildable, 2, backend="gloo", timeout=60)


def _hoard(megabytes):
    sys.distlab_hoard = bytearray(megabytes << 20)
    return os.getpid()


def test_ranks_that_keep_too_much_memory_are_not_reused(monkeypatch):
    first = launch.run(_hoard, 2, 1, backend="gloo", timeout=60)
    assert launch.run(_pids, 2, backend="gloo", timeout=60) == first, "under the limit: warm"
    monkeypatch.setattr(pool_module, "WARM_MEMORY_MB", 1.0)
    launch.run(_hoard, 2, 1, backend="gloo", timeout=60)
    monkeypatch.undo()
    assert not set(launch.run(_pids, 2, backend="gloo", timeout=60)) & set(first)


def test_another_launchers_environment_is_not_taken_for_torchrun(monkeypatch):
    """A Kubeflow pod sets RANK, WORLD_SIZE and MASTER_ADDR for its own use."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    pids = launch.run(_pids, 2, backend="gloo", timeout=60)
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_under_torchrun_the_timeout_bounds_a_deadlock(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from distlab import launch

        def stuck():
            if dist.get_rank() == 0:
                dist.all_reduce(torch.ones(1))  # rank 1 never joins

        launch.run(stuck, 2, backend="gloo", timeout=3)
    """))
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers, not reaped yet
            proc.wait()
    assert proc.returncode != 0
    assert time.monotonic() - start < 150, "the 3 s timeout, not PyTorch's default, applied"
    assert "timed out" in err.lower() or "timeout" in err.lower(), err[-2000:]


def test_the_status_board_is_never_read_half_written():
    import mmap

    board = StatusBoard(mmap.mmap(-1, StatusBoard.SIZE))
    texts = ["in all_reduce(16.0 MiB float32) since 1764500000.125",
             "after recv(4 B int64 from 3) at 1764500001.5"]
    stop = threading.Event()

    def write():
        i = 0
        while not stop.is_set():
            board.post(texts[i % 2])
            i += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        seen = {StatusBoard.read(board.buffer) for _ in range(20000)}
    finally:
        stop.set()
        writer.join()
    assert seen <= set(texts) | {""}, seen - set(texts)


def test_work_directories_of_dead_launchers_are_removed(tmp_path, monkeypatch):
    import fcntl

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale = tmp_path / "distlab-999999-abc"
    stale.mkdir()
    (stale / ".lock").write_text("")
    os.utime(stale, (time.time() - 120,) * 2)
    live = tmp_path / "distlab-888888-def"
    live.mkdir()
    held = os.open(live / ".lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    os.utime(live, (time.time() - 120,) * 2)
    young = tmp_path / "distlab-777777-ghi"  # created by a launcher that has yet to lock it
    young.mkdir()
    (young / ".lock").write_text("")
    try:
        launch.run(_pids, 1, backend="gloo", timeout=60, isolated=True)
        assert not stale.exists(), "a directory nobody holds is removed"
        assert live.exists(), "a directory whose launcher is alive is kept"
        assert young.exists(), "a directory younger than a minute is kept (its lock may be coming)"
        assert not [p for p in tmp_path.iterdir() if p.name not in (live.name, young.name)], \
            "the launch removed its own directory"
    finally:
        os.close(held)


def config(x):
    return x


def _mentions_torch_submodule_names():
    return config(dist.get_rank()), torch.ops.aten.add(torch.ones(1), 1)


def test_a_function_naming_a_torch_submodule_still_travels():
    """`config` is also torch.distributed.config, a module whose class torch replaced;
    cloudpickle would try to copy it (and torch.ops) instead of importing it by name."""
    fn = cloudpickle_by_value(_mentions_torch_submodule_names)
    assert [r[0] for r in launch.run(fn, 2, backend="gloo", timeout=60)] == [0, 1]


def cloudpickle_by_value(fn):
    """``fn`` as a notebook cell's function: its module is pickled by value."""
    import types

    clone = types.FunctionType(fn.__code__, {**fn.__globals__, "__name__": "__main__"},
                               fn.__name__)
    return clone
