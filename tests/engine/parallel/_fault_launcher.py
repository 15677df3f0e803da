"""A launcher process for the SIGTERM test: ``python _fault_launcher.py OUT_DIR ipc IPC_DIR`` or
``python _fault_launcher.py OUT_DIR tcp FIRST_PORT``.

Runs ``train_until_signalled`` on a learner and a collector until signalled.
"""
import sys

from conveyor.engine import Parallel
from tests.engine.parallel._fault_mains import WAIT, train_until_signalled

if __name__ == "__main__":  # the workers import this file as their main module too
    out_dir, protocol, where = sys.argv[1], sys.argv[2], sys.argv[3]
    place = dict(address=where) if protocol == "ipc" else dict(address="127.0.0.1", ports=int(where))
    Parallel.runner(2, protocol=protocol, **place, ready_timeout_s=WAIT, grace_s=WAIT,
                    router_options=dict(heartbeat_s=0.05, peer_timeout_s=WAIT))(train_until_signalled, out_dir)
