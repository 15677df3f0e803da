"""Stopping the process groups that tests start with ``start_new_session=True``."""
import os
import signal

import pytest


def kill_group(proc, timeout):
    """SIGKILL ``proc``'s whole process group, reap ``proc``, and check that nothing of the group is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=timeout)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its group is left
