"""What Ray's restart of a collector's actor rests on, without Ray: a worker whose launcher dies (an actor process
killed) ends the run on the other nodes without ``auto_recover``, and leaves it at once, as a killed worker, with
it (the others go on; a launcher started again in its place starts it again). Two launches of one node each, as
two actors are: node 0 here, node 1 from this file run as a script, killed by SIGKILL once it trains."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conveyor.engine import PEER_LOST_EVENT, STOP_EVENT, Parallel, task
from conveyor.engine.parallel.frame import SECRET_ENV, generate_secret
from benchmarks._harness import free_ports

ROOT = Path(__file__).resolve().parents[1]
WAIT = 60  # seconds: the bound on every wait; a healthy test takes a few


def stays(out_dir):
    """Node 0: trains until node 1 leaves; returns what it heard first: "finish" (node 1 ended the run) or "lost"."""
    heard, left = [], threading.Event()

    def hear(what):
        heard.append(what)
        task.finish = True
        left.set()

    assert task.router.wait_for_peers(1, WAIT)
    with task.start():
        task.on(STOP_EVENT, lambda: hear("finish"))
        task.on(PEER_LOST_EVENT, lambda node: hear("lost"))
        task.use(lambda ctx: left.wait(0.05))
        task.run(max_step=int(WAIT / 0.05))
    return heard


def trains(out_dir):
    """Node 1: says it trains (a file in ``out_dir``), then trains until it is stopped."""
    def step(ctx):
        Path(out_dir, "training").touch()
        threading.Event().wait(0.05)

    with task.start():
        task.use(step)
        task.run(max_step=int(WAIT / 0.05))


@pytest.mark.parametrize("auto_recover, first", [(False, "finish"), (True, "lost")])
def test_a_worker_whose_launcher_is_killed_ends_the_run_only_without_auto_recover(tmp_path, monkeypatch, auto_recover,
                                                                                  first):
    monkeypatch.setenv(SECRET_ENV, generate_secret().hex())
    port = free_ports(2)
    heard = []
    hub = threading.Thread(target=lambda: heard.extend(Parallel.runner(
        1, protocol="tcp", ports=[port], node_ids=[0], ready_timeout_s=WAIT)(stays, str(tmp_path))), daemon=True)
    hub.start()
    proc = subprocess.Popen([sys.executable, __file__, str(tmp_path), str(port), str(auto_recover)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT
        while not (tmp_path / "training").exists():  # polling the file node 1 writes as it trains
            assert time.monotonic() < deadline and proc.poll() is None, "node 1 did not train"
            time.sleep(0.05)
        proc.kill()  # the launcher only: its worker is orphaned
        proc.wait(WAIT)
        hub.join(WAIT)
        assert heard[0][0] == first and ("finish" in heard[0]) is not auto_recover, heard
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":  # node 1's launcher; its worker imports this file as its main module too
    out, hub_port, recover = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "True"
    Parallel.runner(1, protocol="tcp", ports=[hub_port + 1], node_ids=[1], attach_to=[f"tcp://127.0.0.1:{hub_port}"],
                    auto_recover=recover, ready_timeout_s=WAIT)(trains, out)
