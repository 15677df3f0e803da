"""A launcher process for the SIGTERM test: ``python _fault_launcher.py OUT_DIR IPC_DIR``.

Runs ``train_until_signalled`` on a learner and a collector over ipc sockets in IPC_DIR until signalled.
"""
import sys

from conveyor.engine import Parallel
from tests.engine.parallel._fault_mains import WAIT, train_until_signalled

if __name__ == "__main__":  # the workers import this file as their main module too
    out_dir, ipc_dir = sys.argv[1], sys.argv[2]
    Parallel.runner(2, protocol="ipc", address=ipc_dir, ready_timeout_s=WAIT, grace_s=WAIT,
                    router_options=dict(heartbeat_s=0.05, peer_timeout_s=WAIT))(train_until_signalled, out_dir)
