"""What the CLI tests share: tiny training budgets, the shape of an error (one line, exit code 2), and a
``conveyor`` command run in its own process."""
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Mapping, Optional

ROOT = Path(__file__).resolve().parents[1]

TINY = ["--set", "env.collector_env_num=2", "--set", "env.evaluator_env_num=2", "--set", "env.n_evaluator_episode=2",
        "--set", "policy.model.hidden_sizes=[8]", "--set", "policy.eval.evaluator.eval_freq=8",
        "--set", "policy.other.replay_buffer.size=500", "--max-env-step", "64", "--no-progress"]
"""``conveyor train cartpole/dqn`` options for a run of a fraction of a second."""


def assert_usage_error(code, capsys, *fragments):
    """Exit code 2, and one line on stderr saying ``conveyor: error: ...`` with each fragment, no traceback."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("conveyor: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def _environ(env: Optional[Mapping[str, str]] = None, unset: tuple = ()) -> dict:
    """This process's environment with this checkout first on PYTHONPATH, ``env`` added, ``unset`` removed."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **(env or {})}
    for name in unset:
        environ.pop(name, None)
    return environ


def start_in_session(argv: List[str], cwd: Path, request) -> subprocess.Popen:
    """``argv`` started in its own session (stdout and stderr piped, as text) with this checkout first on PYTHONPATH;
    its whole process group is killed when the test ends (``request``'s finalizer), whatever happened."""
    proc = subprocess.Popen(argv, cwd=cwd, env=_environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)

    def stop():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
    request.addfinalizer(stop)
    return proc


def run_conveyor(argv: List[str], cwd: Path, *, timeout: float, env: Optional[Mapping[str, str]] = None,
                 unset: tuple = ()) -> subprocess.CompletedProcess:
    """``argv`` (``["conveyor", ...]``) in its own session with this checkout first on PYTHONPATH, ``env`` added and
    the variables in ``unset`` removed; its whole process group is stopped afterwards, also on failure."""
    proc = subprocess.Popen([sys.executable, "-m", "conveyor", *argv[1:]], cwd=cwd, env=_environ(env, unset), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
