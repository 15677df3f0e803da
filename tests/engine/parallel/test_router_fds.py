"""An outsider's silent TCP connections (no SP handshake) must not use up a node's file descriptors."""
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine.parallel._wire import SECRET, WAIT, tcp_connect

ROOT = Path(__file__).resolve().parents[3]
FD_LIMIT = 128  # the node's soft RLIMIT_NOFILE: small, so that a few hundred connections would exhaust it
FLOOD = 4 * FD_LIMIT  # silent connections, the 1,100 under 1,024 scaled down

NODE = """
import json, os, queue, resource, sys
from conveyor.engine.parallel.router import Router
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
r = Router("node", bytes.fromhex(sys.argv[1]), listen="tcp://127.0.0.1:0", heartbeat_s=0.05, peer_timeout_s=2.0)
got = queue.Queue()
r.on("x", got.put)
print(r.address, flush=True)
for line in sys.stdin:
    try:
        if line.startswith("write"):  # a checkpoint's worth of writing: open, write, replace
            path = os.path.join(sys.argv[3], "ckpt")
            with open(path + ".tmp", "wb") as f:
                f.write(os.urandom(1 << 16))
            os.replace(path + ".tmp", path)
            answer = "written"
        else:
            answer = got.get(timeout=10)
    except Exception as e:
        answer = f"{type(e).__name__}: {e}"
    print(json.dumps([answer, len(os.listdir("/proc/self/fd"))]), flush=True)
r.close()
"""


@pytest.fixture
def node(tmp_path):
    """A router in a process limited to FD_LIMIT descriptors; ``ask(cmd)`` -> (answer, its open fds)."""
    proc = subprocess.Popen([sys.executable, "-c", NODE, SECRET.hex(), str(FD_LIMIT), str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})

    def ask(command):
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"the node ended (exit {proc.wait(WAIT)})"
        return json.loads(line)
    try:
        yield proc, proc.stdout.readline().strip(), ask
    finally:
        proc.kill()
        proc.wait(WAIT)


def test_silent_connections_never_use_up_the_descriptors_of_a_node_that_still_writes_and_hears_peers(
        node, make_router):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 256:
        pytest.skip(f"this test holds {FLOOD} connections; the hard limit of descriptors is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 256), hard))
    proc, address, ask = node
    answers, socks = [], []
    deadline = time.monotonic() + 4 * WAIT
    try:
        for _ in range(FLOOD):  # bounded in count and time; every socket is closed below
            if time.monotonic() > deadline:
                break
            try:
                socks.append(tcp_connect(address, timeout=0.5))
            except OSError:  # the node's backlog is full: it no longer accepts
                pass
        answers.append(ask("write"))  # with the flood's sockets all open, within nng's 10 s hold
        peer = make_router("peer", peers=[address])  # an honest peer, while the flood's sockets are all open
        peer.wait_for_subscribers("x", 1, WAIT)
        peer.publish("x", "during")
        answers.append(ask("get"))
    finally:
        for sock in socks:
            sock.close()
    peer.close()
    late = make_router("late", peers=[address])  # and one after the flood
    late.wait_for_subscribers("x", 1, WAIT)
    late.publish("x", "after")
    answers.append(ask("get"))
    answers.append(ask("write"))
    assert proc.poll() is None
    assert [a for a, _ in answers] == ["written", "during", "after", "written"], answers
    assert len(socks) > 2 * FD_LIMIT, f"the flood reached the node with only {len(socks)} connections"
    assert max(fds for _, fds in answers) < FD_LIMIT * 3 // 4, answers
