"""The process layer: children start, report, die visibly, stop within a grace period, and leave nothing behind."""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conveyor.processes import (Child, ChildLost, RemoteTraceback, Zygote, create_shared_block, describe_exit,
                                pack_exception, private_dir, release_shared_block, stop, unpack_exception)

WAIT = 20  # seconds: the bound on every wait below


def echo(conn, prefix):
    """A child: answers each message with ``prefix`` + it, until it is told to close."""
    while True:
        data = conn.recv_bytes()
        if data == pickle.dumps(("close", None)):
            return
        conn.send_bytes(prefix + data)


def deaf(conn):
    """A child that never answers and ignores the goodbye (it still dies of SIGKILL)."""
    conn.recv_bytes()
    signal.pause()


@pytest.fixture
def children():
    """Children made by a test, killed and reaped at its end even if it fails."""
    made = []
    yield made
    for child in made:
        child.kill()
        child.wait()
        child.close()


def test_a_child_answers_on_its_pipe_and_leaves_on_the_goodbye(children):
    child = Child(echo, (b"re: ",), name="echo", label="the echo child")
    children.append(child)
    assert child.send_bytes(b"hello") and child.recv_bytes(WAIT) == b"re: hello"
    child.stop(WAIT)
    assert child.poll() == 0


def test_a_dead_child_is_reported_with_how_it_died(children):
    child = Child(echo, (b"",), name="echo", label="worker process 7 (pid {pid})")
    children.append(child)
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(ChildLost, match=rf"worker process 7 \(pid {child.pid}\) was killed by SIGKILL"):
        child.recv_bytes()


def test_a_child_that_does_not_answer_in_time_is_killed(children):
    child = Child(deaf, name="deaf", label="the deaf child")
    children.append(child)
    child.send_bytes(b"anyone?")
    with pytest.raises(ChildLost, match=r"the deaf child did not answer within step_timeout=0.2s and was killed"):
        child.recv_bytes(0.2, "step_timeout")
    assert child.wait(WAIT) == -signal.SIGKILL


def test_stop_asks_every_child_at_once_and_kills_those_still_there_after_the_grace(children):
    polite = Child(echo, (b"",), name="polite", label="polite")
    rude = Child(deaf, name="rude", label="rude")
    children.extend([polite, rude])
    started = time.monotonic()
    stop([polite, rude], grace_s=0.5, goodbye=pickle.dumps(("close", None)))
    assert (polite.poll(), rude.poll()) == (0, -signal.SIGKILL)
    assert time.monotonic() - started < WAIT


def test_an_exception_travels_back_with_its_traceback_as_the_cause():
    try:
        raise ValueError("broken in the child")
    except ValueError as exc:
        packed = pickle.loads(pickle.dumps(pack_exception(exc)))
    rebuilt = unpack_exception(packed)
    assert type(rebuilt) is ValueError and str(rebuilt) == "broken in the child"
    assert isinstance(rebuilt.__cause__, RemoteTraceback) and "raise ValueError" in rebuilt.__cause__.tb


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no")


def test_an_exception_that_does_not_pickle_arrives_as_the_fallback_with_its_type_and_message():
    rebuilt = unpack_exception(pack_exception(Unpicklable("odd")), fallback=RuntimeError)
    assert type(rebuilt) is RuntimeError and str(rebuilt) == "Unpicklable: odd"


def test_describe_exit_names_the_signal_or_the_code():
    assert describe_exit(-signal.SIGTERM) == "was killed by SIGTERM"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(None) == "is still running"


def test_a_private_dir_removes_those_whose_parent_is_gone(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (tmp_path / f"test-run-{dead}-left").mkdir()
    live = tmp_path / f"test-run-{os.getpid()}-still-used"
    live.mkdir()
    made = Path(private_dir("test-run-"))
    assert made.name.startswith(f"test-run-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, made.name])


def test_a_shared_block_is_freed_by_its_maker_and_also_when_the_maker_is_killed():
    block = create_shared_block(100)
    name = block.name
    release_shared_block(block, unlink=True)
    assert not Path(f"/dev/shm/{name.lstrip('/')}").exists()
    code = textwrap.dedent("""
        import os, signal, sys
        from conveyor.processes import create_shared_block
        block = create_shared_block(100)
        print(block.name, flush=True)
        sys.stdin.read(1)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        path = Path(f"/dev/shm/{proc.stdout.readline().strip().lstrip('/')}")
        assert path.exists()
        proc.stdin.write("x")
        proc.stdin.close()
        assert proc.wait(timeout=WAIT) == -signal.SIGKILL
        deadline = time.monotonic() + WAIT
        while path.exists() and time.monotonic() < deadline:  # the tracker unlinks it (no event to wait on: poll)
            time.sleep(0.02)
        assert not path.exists()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the resource tracker, if it is still there
        except ProcessLookupError:
            pass


def serve_pid(conn):
    """A zygote child's entry: tell the parent its pid, then wait to be told to leave (or stopped)."""
    conn.send(os.getpid())
    return 5 if conn.recv() == "leave" else 0


def test_a_zygote_forks_children_and_reports_their_exit_codes():
    zygote = Zygote(["json"], WAIT, "tests.test_processes:serve_pid")
    forked = []
    try:
        first, first_conn = zygote.fork("first")
        second, second_conn = zygote.fork("second")
        forked += [first, second]
        assert (first_conn.recv(), second_conn.recv()) == (first.pid, second.pid)
        first_conn.send("leave")
        assert first.wait(WAIT) == 5
        second.terminate()  # SIGTERM raises SystemExit(143) in a child
        assert second.wait(WAIT) == 143
    finally:
        stop(forked, 1.0)
        zygote.close(WAIT)
    assert zygote.proc.returncode == 0


def crash_in_native_code(conn):
    """A zygote child's entry that dereferences a null pointer (as a bug in a C extension would)."""
    import ctypes
    conn.send("crashing")
    ctypes.string_at(0)


def test_a_zygote_child_that_crashes_in_native_code_prints_where_before_it_dies(capfd):
    zygote = Zygote(["json"], WAIT, "tests.test_processes:crash_in_native_code")
    try:
        child, conn = zygote.fork("crasher")
        assert conn.recv() == "crashing"
        assert child.wait(WAIT) == -signal.SIGSEGV
    finally:
        zygote.close(WAIT)
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err and "crash_in_native_code" in err


def _zygote_importing(tmp_path, monkeypatch, name, code, ready_timeout_s):
    """A zygote that preloads module ``name`` (``code``, written under ``tmp_path``) and forks serve_pid."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(tmp_path))  # the zygote gets the parent's sys.path
    return Zygote([name], ready_timeout_s, "tests.test_processes:serve_pid")


def test_a_zygote_whose_imports_outlast_ready_timeout_s_while_working_still_forks(tmp_path, monkeypatch):
    # 0.45 s of CPU spread over >= 2.7 s: a slow import on a loaded machine, not a hung one
    zygote = _zygote_importing(tmp_path, monkeypatch, "slow_import", """
        import time
        for _ in range(15):
            start = time.process_time()
            while time.process_time() - start < 0.03:
                pass
            time.sleep(0.15)
        """, ready_timeout_s=2.0)
    forked = []
    try:
        child, conn = zygote.fork("after a slow import")
        forked.append(child)
        assert conn.recv() == child.pid
        conn.send("leave")
        assert child.wait(WAIT) == 5
    finally:
        stop(forked, 1.0)
        zygote.close(WAIT)


@pytest.mark.parametrize("code, why", [("import time\ntime.sleep(3600)\n", r"has used no CPU for 1.0s while importing"),
                                       ("while True:\n    pass\n", r"used 1s of CPU importing")])
def test_a_zygote_whose_import_hangs_raises_naming_the_module(tmp_path, monkeypatch, code, why):
    zygote = _zygote_importing(tmp_path, monkeypatch, "hung_import", code, ready_timeout_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=rf"{why} hung_import"):
            zygote.fork("never")
    finally:
        zygote.kill()
    assert time.monotonic() - started < WAIT
