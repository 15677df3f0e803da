"""Stopping the process groups that tests start with ``start_new_session=True``."""
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def kill_group(proc, timeout):
    """SIGKILL ``proc``'s whole process group, reap ``proc``, and check that nothing of the group is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=timeout)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its group is left


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
