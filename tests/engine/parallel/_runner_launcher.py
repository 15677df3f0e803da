"""A launcher process for the signal tests: ``python _runner_launcher.py OUT_DIR IPC_DIR N``.

Runs ``ready_then_wait`` on N mesh workers over ipc sockets in IPC_DIR (``-``: the runner's own directory
under $TMPDIR) until it is signalled.
"""
import signal
import sys

from conveyor.engine import Parallel
from tests.engine.parallel._runner_mains import ready_then_wait

if __name__ == "__main__":  # the workers import this file as their main module too
    # Ctrl-C as from a terminal: a shell starts background jobs (a test run with `&` included) with SIGINT ignored,
    # and Python then leaves it ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out_dir, ipc_dir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    Parallel.runner(n, topology="mesh", protocol="ipc", address=None if ipc_dir == "-" else ipc_dir,
                    grace_s=5)(ready_then_wait, out_dir)
