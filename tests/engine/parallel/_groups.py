"""Stopping the process groups that tests start with ``start_new_session=True``."""
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks._cluster import wait_until
from tests.launcher_helpers import group_gone

ROOT = Path(__file__).resolve().parents[3]


def kill_group(proc, timeout):
    """SIGKILL ``proc``'s whole process group, reap ``proc``, and check that nothing of the group is left within
    ``timeout`` (a member killed a moment ago stays a zombie, still in the group, until its new parent reaps it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=timeout)
    wait_until(lambda: group_gone(proc.pid), timeout,
               f"the members of process group {proc.pid} to be reaped after SIGKILL")


@contextlib.contextmanager
def script_groups(timeout):
    """Yields ``start(script, *args, prefix=())``: runs a Python script of this repository (after the command
    ``prefix``, e.g. ``ip netns exec NS``) in its own session, stdout piped; every group started is killed
    (and checked to be gone) at the end."""
    procs = []

    def start(script, *args, prefix=()):
        proc = subprocess.Popen([*prefix, sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            kill_group(proc, timeout)
