"""One host of the two-host test: ``python _netns_launcher.py learner|collectors SECRET_FILE ADDRESS PORT [LEARNER_URL]``.

The learner host runs node 0; the collector host runs nodes 1 and 2, attached to the learner's URL. Each
prints the runner's results as one JSON line.
"""
import json
import sys

from conveyor.engine import Parallel
from conveyor.engine.parallel import load_secret
from tests.engine.parallel._fault_mains import WAIT, learn_through_faults

if __name__ == "__main__":  # the workers import this file as their main module too
    side, secret_file, address, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    hosts = {"learner": dict(n_parallel_workers=1, node_ids=0),
             "collectors": dict(n_parallel_workers=2, node_ids=[1, 2], attach_to=sys.argv[5:])}
    results = Parallel.runner(**hosts[side], protocol="tcp", address=address, ports=port, secret=load_secret(secret_file),
                              ready_timeout_s=WAIT, router_options=dict(heartbeat_s=0.05, peer_timeout_s=WAIT))(
        learn_through_faults, {}, ("sent_by_each", [1, 2], 3))
    print(json.dumps(results), flush=True)
