"""Parallel.runner: workers exchange events, a failing worker fails the job, signals stop every worker."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conveyor.engine import Parallel
from conveyor.engine.parallel.runner import RemoteTraceback, zygote_ahead
from tests.engine.parallel import _runner_mains as mains
from tests.engine.parallel._groups import ROOT, kill_group, script_groups

WAIT = 20  # seconds: the bound on every wait below; a healthy run takes a second or two
FAST = dict(heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0)
LAUNCHER = Path(__file__).with_name("_runner_launcher.py")


def runner(n, **kwargs):
    return Parallel.runner(n, ready_timeout_s=WAIT, router_options=FAST, **kwargs)


def children():
    """The pids of this process's children."""
    return {int(pid) for tid in os.listdir("/proc/self/task")
            for pid in Path(f"/proc/self/task/{tid}/children").read_text().split()}


def assert_gone(pid):
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("protocol, topology, n", [("ipc", "star", 2), ("ipc", "mesh", 3), ("tcp", "mesh", 2),
                                                   ("tcp", "star", 3)])
def test_workers_exchange_events_through_task_emit_and_on(tmp_path, protocol, topology, n):
    assert runner(n, topology=topology, protocol=protocol)(mains.exchange, str(tmp_path), topology) == list(range(n))
    heard = {i: json.loads((tmp_path / f"{i}.json").read_text()) for i in range(n)}
    for i in range(n):
        senders = [j for j in range(n) if j != i] if i == 0 or topology == "mesh" else [0]
        assert heard[i] == [[j, f"hello from {j}"] for j in senders]


def test_each_worker_knows_its_node_id_and_gets_the_secret_neither_by_env_nor_by_command_line():
    secret = b"runner-test-secret-" + os.urandom(16).hex().encode()
    got = runner(2, secret=secret)(mains.whoami, 7)
    assert [(r["node_id"], r["n_workers"], r["is_active"], r["x"]) for r in got] == [(0, 2, True, 7), (1, 2, True, 7)]
    assert len({r["pid"] for r in got} | {os.getpid()}) == 3
    for r in got:
        for leak in (secret, secret.hex().encode()):
            assert leak not in r["cmdline"] and leak not in r["environ"]


def test_workers_fork_from_one_zygote_run_their_exit_handlers_and_leave_no_child_process(tmp_path):
    before = children()  # an earlier test's helpers (multiprocessing's resource tracker) may live on
    parents = runner(3)(mains.note_at_exit, str(tmp_path))
    assert len(set(parents)) == 1 and parents[0] != os.getpid()  # one zygote forked them all
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit-0", "exit-1", "exit-2"]
    assert_gone(parents[0])
    assert children() == before


def test_one_worker_alone_runs_main_in_this_process_without_a_router():
    [got] = Parallel.runner(1, topology="alone")(mains.whoami, 1)
    assert (got["pid"], got["node_id"], got["n_workers"], got["is_active"]) == (os.getpid(), 0, 1, False)


def test_restarts_before_is_where_the_restart_count_of_every_worker_starts():
    assert [r["restarts"] for r in runner(2)(mains.whoami, 0)] == [0, 0]
    assert [r["restarts"] for r in runner(2, restarts_before=2)(mains.whoami, 0)] == [2, 2]
    [alone] = Parallel.runner(1, topology="alone", restarts_before=1)(mains.whoami, 0)
    assert alone["restarts"] == 1
    with pytest.raises(ValueError, match="restarts_before=-1"):
        Parallel.runner(1, restarts_before=-1)


def test_a_guessable_secret_is_refused_at_once_with_the_command_that_makes_a_good_one():
    with pytest.raises(ValueError, match=r"secret=\.\.\.\) is too easy to guess.*token_hex\(32\)"):
        Parallel.runner(2, secret=b"a" * 32)


def test_a_worker_that_raises_makes_the_runner_raise_its_error_and_leaves_no_worker(tmp_path):
    with pytest.raises(ValueError, match="boom from worker 1") as info:
        runner(2)(mains.fail_on, str(tmp_path), 1, "boom from worker 1")
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "in fail_on" in info.value.__cause__.tb and "boom from worker 1" in info.value.__cause__.tb
    assert any("worker 1" in n for n in info.value.__notes__)
    for pid_file in ("pid-0", "pid-1"):
        assert_gone(int((tmp_path / pid_file).read_text()))


UNGUARDED = """
    from conveyor.engine import Parallel


    def main():
        return 1


    Parallel.runner(2)(main)  # no `if __name__ == "__main__":` around it
"""


def test_a_script_without_a_main_guard_is_refused_at_once_with_the_fix(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(UNGUARDED))
    proc = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=WAIT)  # not the ready_timeout_s of 60 s
    finally:
        kill_group(proc, WAIT)
    assert proc.returncode == 1
    assert err.splitlines()[-1].endswith(f"{script} calls the runner again in the zygote that imports it to find "
                                         f"main: put the call under `if __name__ == \"__main__\":`, as "
                                         f"multiprocessing asks"), err


def test_a_worker_is_forked_with_sigterm_held_not_ignored_so_one_sent_at_its_birth_is_not_lost():
    """A worker inherits the zygote's signal state until its own handler is in: SIGTERM must wait there."""
    sigterm = 1 << (signal.SIGTERM - 1)
    for masks in runner(2)(mains.parent_signals):
        assert masks["blocked"] & sigterm and not masks["ignored"] & sigterm


def test_a_sigterm_during_a_workers_exit_handlers_ends_it_without_a_traceback(tmp_path, capfd):
    fifo = tmp_path / "exiting"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(ValueError, match="node 0 fails"):
        Parallel.runner(2, topology="alone", ready_timeout_s=WAIT, grace_s=WAIT)(mains.fail_while_the_other_is_exiting,
                                                                               str(fifo))
    assert time.monotonic() - started < WAIT  # node 1 ended on SIGTERM, not on SIGKILL after grace_s
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "_Terminated" not in err, err


@pytest.fixture
def short_tmp():
    """A fresh folder right under the system's temp dir: ipc paths under a test worker's ``tmp_path``
    (``.../popen-gw0/<test name>/...``) pass the 107 bytes a Unix socket takes."""
    path = Path(tempfile.mkdtemp(prefix="cv-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_launch_removes_the_ipc_directories_that_killed_launchers_left(short_tmp, launcher, monkeypatch):
    tmp = short_tmp
    monkeypatch.setenv("TMPDIR", str(tmp))
    proc = launcher(2, "-")  # ipc files in the runner's own directory under $TMPDIR
    kill_and_wait_for_its_workers(proc, read_ready_lines(proc, 2))  # killed, it cannot remove its directory
    assert [p.name.startswith("conveyor-run-") for p in tmp.iterdir()] == [True]
    live = tmp / f"conveyor-run-{os.getpid()}-of-a-launcher-still-running"
    live.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    assert runner(2)(mains.whoami, 1)
    assert list(tmp.iterdir()) == [live]


def test_a_launch_takes_the_zygote_started_ahead_and_one_left_untaken_is_ended(tmp_path, monkeypatch):
    before = children()
    with zygote_ahead(["tests.engine.parallel._runner_mains"]):
        [spare] = children() - before
        parents = runner(2)(mains.note_at_exit, str(tmp_path))
    assert set(parents) == {spare}  # no second zygote was started
    with zygote_ahead():
        [spare] = children() - before
    assert children() == before  # not taken: ended on the way out
    with zygote_ahead():
        [spare] = children() - before
        monkeypatch.chdir(tmp_path)  # the workers would start elsewhere than the zygote started ahead
        parents = runner(2)(mains.note_at_exit, str(tmp_path))
    assert spare not in parents and children() == before


def test_an_ipc_folder_too_long_for_a_unix_socket_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    long = tmp_path / ("d" * (110 - len(str(tmp_path))))
    long.mkdir()
    before = children()
    with pytest.raises(OSError, match=r"Parallel.runner: the path of ipc://.*node0.ipc is 1\d\d bytes, more than the "
                                      r"107 a Unix socket takes"):
        runner(2, protocol="ipc", address=str(long))(mains.whoami, 1)
    monkeypatch.setenv("TMPDIR", str(long))  # the run's own folder under it
    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(OSError, match=r"the path of ipc://.*conveyor-run-.* is 1\d\d bytes"):
        runner(2)(mains.whoami, 1)
    assert list(long.iterdir()) == [] and children() == before


def test_a_misspelt_topology_is_refused_with_the_closest_name():
    with pytest.raises(ValueError, match="did you mean 'mesh'"):
        Parallel.runner(2, topology="mesj")


@pytest.fixture
def launcher(tmp_path):
    """Start ``_runner_launcher.py`` in its own session; kill its process group at the end."""
    with script_groups(WAIT) as start:
        yield lambda n, ipc_dir: start(LAUNCHER, tmp_path, ipc_dir, n)


def read_ready_lines(proc, n):
    """The workers' pids, from the "ready NODE PID" lines they print once their ready file is written."""
    fd, text, deadline = proc.stdout.fileno(), b"", time.monotonic() + WAIT
    while text.count(b"\n") < n:
        readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if readable else b""
        assert chunk, f"{n} workers not ready within {WAIT}s (got {text!r}; launcher exit code {proc.poll()})"
        text += chunk
    return [int(line.split()[2]) for line in text.decode().splitlines()]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_to_the_launcher_stops_every_worker_and_removes_the_ipc_files(tmp_path, launcher, signum, code):
    ipc_dir = tmp_path / "ipc"
    ipc_dir.mkdir()
    proc = launcher(3, ipc_dir)
    pids = read_ready_lines(proc, 3)
    assert sorted(p.name for p in tmp_path.glob("ready-*")) == ["ready-0", "ready-1", "ready-2"]
    assert len(list(ipc_dir.iterdir())) == 3
    proc.send_signal(signum)  # the launcher only, as `kill PID` would
    assert proc.wait(timeout=WAIT) == code  # SIGINT: KeyboardInterrupt re-raised, Python then dies by SIGINT
    for pid in pids:
        assert_gone(pid)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its process group is left
    assert list(ipc_dir.iterdir()) == []


def test_the_workers_and_their_zygote_stop_themselves_when_the_launcher_is_killed(tmp_path, launcher):
    ipc_dir = tmp_path / "ipc"
    ipc_dir.mkdir()
    proc = launcher(2, ipc_dir)
    pids = read_ready_lines(proc, 2)
    parents = {parent_of(pid) for pid in pids}
    assert len(parents) == 1 and proc.pid not in parents  # forked by one zygote, not by the launcher
    kill_and_wait_for_its_workers(proc, pids)


def parent_of(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def kill_and_wait_for_its_workers(proc, pids):
    """SIGKILL the launcher ``proc``; wait until its workers ``pids`` and their zygote have stopped themselves."""
    fds = [os.pidfd_open(pid) for pid in {*pids, *map(parent_of, pids)}]  # readable once the process has ended
    try:
        proc.kill()
        proc.wait(timeout=WAIT)
        deadline = time.monotonic() + WAIT
        for fd in fds:
            assert select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0], "a process outlived its launcher"
        while time.monotonic() < deadline:  # they ended; init reaps them (no event to wait on: poll)
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
    finally:
        for fd in fds:
            os.close(fd)


def test_once_the_runs_owner_returned_a_worker_still_waiting_is_stopped_as_on_sigterm_after_the_peer_timeout(
        caplog):
    started = time.monotonic()
    results = runner(3, ends_with=[0])(mains.end_or_wait_for_a_rejoin)
    assert results == ["owner", "stopped", "stopped"]  # each ended its run normally, with its result
    assert time.monotonic() - started < WAIT  # the peer timeout (2 s) after the owner's end, not their 3 * WAIT
    assert "node 0 returned" in caplog.text and "worker 1" in caplog.text


def test_a_worker_that_does_not_stop_after_the_runs_end_is_killed_after_grace_s_and_fails_nothing(caplog):
    started = time.monotonic()
    results = runner(2, ends_with=[0], grace_s=1.0)(mains.end_or_wait_for_a_rejoin, True)
    assert results == ["owner", None] and time.monotonic() - started < WAIT
    assert "did not stop within 1.0s" in caplog.text


def test_ends_with_names_node_ids():
    with pytest.raises(ValueError, match=r"ends_with=\['0'\].*node ids"):
        Parallel.runner(2, ends_with=["0"])
