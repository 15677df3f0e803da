"""The router under hostile input: no input ends its receive loop, recorded traffic never replays, decoding and
connections stay bounded, and a peer with another secret is named within seconds."""
import gc
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.engine.parallel import DecodeError, decode, encode, generate_secret, open_batch
from conveyor.engine.parallel.frame import HELLO
from tests.engine.parallel._wire import (FAST, SECRET, WAIT, as_peer, eventually, join_as, raw_sender, rss_bytes,
                                        sp_connect, sp_length)

ROOT = Path(__file__).resolve().parents[3]



def pair(make_router, **receiver_options):
    """A receiver, a genuine sender subscribed to by it on topic "x", and the queue of what it receives."""
    receiver = make_router("receiver", listen="tcp://127.0.0.1:0", **receiver_options)
    sender = make_router("sender", peers=[receiver.address])
    got = queue.Queue()
    receiver.on("x", got.put)
    sender.wait_for_subscribers("x", 1, WAIT)
    return receiver, sender, got


def still_receives(sender, got, value="still here"):
    """``sender``'s message reaches the receiver (past whatever hand-made messages were delivered before it)."""
    assert sender.publish("x", value) == 1
    deadline = time.monotonic() + WAIT
    while got.get(timeout=max(deadline - time.monotonic(), 0.01)) != value:
        pass


def test_an_empty_message_is_counted_and_the_node_keeps_receiving(make_router):
    receiver, sender, got = pair(make_router)
    with raw_sender(receiver.address) as raw:
        for _ in range(3):
            raw.send(b"")
        eventually(lambda: receiver.stats()["rejected_auth"] == 3, "three empty messages counted")
    still_receives(sender, got)
    stats = receiver.stats()
    assert stats["receive_errors"] == 0 and stats["peers"] == ["sender"]


# ---- fuzzing the receive path ---------------------------------------------------------------------------------

def _hostile_header():
    """JSON trees of the codec's tags, pointing at buffers that may or may not exist or fit."""
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 5), st.floats(allow_nan=False), st.text(max_size=4))
    node = st.recursive(leaf, lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["t", "D", "d", "b", "B", "n", "s", "T", "tt", "x", "p", "?"]),
                        inner, min_size=1, max_size=2),
        st.tuples(st.sampled_from(["<f4", "|u1", ">i8", "V3", "O"]), st.lists(st.integers(-1, 9), max_size=3),
                  st.sampled_from(["C", "F"]), st.integers(0, 3)).map(lambda t: {"n": list(t)}),
        st.tuples(st.sampled_from(["float32", "int64", "bool", "nope"]), st.lists(st.integers(-1, 9), max_size=3),
                  st.integers(0, 3)).map(lambda t: {"T": list(t)})), max_leaves=12)
    return node.map(lambda tree: json.dumps(tree).encode())


hostile = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=300)),
    st.tuples(st.just("truncate"), st.integers(0, 400)),
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 7)),
    st.tuples(st.just("structure"), _hostile_header(), st.lists(st.binary(max_size=64), max_size=3)),
    st.tuples(st.just("structure"), st.sampled_from([b"[" + unit * n + b"[]]" for unit in (b"[],", b"{},", b"0,")
                                                     for n in (1000, 1 << 20)]), st.just([])),
    st.tuples(st.just("topic"), st.sampled_from(["\x00router", "x", "y"]), st.integers(0, 2 ** 64 - 1),
              st.binary(max_size=40)),
)


def test_no_input_of_any_length_or_content_ends_the_receive_loop(make_router):
    receiver, sender, got = pair(make_router)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(hostile)
    def send(case):
        kind = case[0]
        if kind == "bytes":
            data = case[1]
        elif kind == "truncate":
            data = valid[:case[1]]
        elif kind == "flip":
            data = bytearray(valid)
            data[case[1] % len(data)] ^= 1 << case[2]
            data = bytes(data)
        elif kind == "structure":
            data = sealed("x", 2, frames=[case[1], *case[2]])
        else:
            data = sealed(case[1], case[2], frames=[case[3]])
        raw.send(data)

    with raw_sender(receiver.address) as raw:
        sealed = join_as(raw, receiver)
        valid = sealed("x", 1, {"obs": np.arange(12.0).reshape(3, 4)})
        send()
    still_receives(sender, got)
    stats = receiver.stats()
    assert stats["receive_errors"] == 0 and "sender" in stats["peers"]
    assert stats["rejected_auth"] + stats["malformed"] + stats["rejected_replay"] + stats["duplicated"] > 0


# ---- replay ---------------------------------------------------------------------------------------------------

class Tap:
    """A recording relay: a peer dials it as if it were the receiver; it records and forwards every message."""

    def __init__(self, listen, forward_to):
        import pynng
        self.recorded = []
        self._forward_to = forward_to
        self._in = pynng.Pull0(listen=listen, recv_timeout=100)
        self._out = pynng.Push0(dial=forward_to, send_timeout=WAIT * 1000)
        self._sending = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self):
        import pynng
        while not self._stop.is_set():
            try:
                data = self._in.recv()
            except pynng.Timeout:
                continue
            self.recorded.append(data)
            with self._sending:
                self._out.send(data)

    def reconnect(self, closed):
        """Close the connection it forwards on, wait for ``closed()`` (the receiver saw it close), and forward on a
        new one: what a link whose connection broke does, its sender's incarnation unchanged."""
        import pynng
        with self._sending:
            self._out.close()
            eventually(closed, "the receiver sees the old connection closed")
            self._out = pynng.Push0(dial=self._forward_to, send_timeout=WAIT * 1000)

    def close(self):
        self._stop.set()
        self._thread.join(WAIT)
        self._in.close()
        self._out.close()


def recorded_run(make_router, tmp_path, name):
    """A learner and a collector of one run, everything the collector sends passing a tap; returns the
    collector's recorded traffic and what the learner got (events, a "solved" stop, weights, then goodbye)."""
    learner_listen, tap_listen = f"ipc://{tmp_path}/{name}-learner.ipc", f"ipc://{tmp_path}/{name}-tap.ipc"
    learner = make_router("learner", listen=learner_listen, advertise=tap_listen)
    tap = Tap(tap_listen, learner_listen)
    collector = make_router("collector", peers=[tap_listen])
    got = queue.Queue()
    for topic in ("data", "stop"):
        learner.on(topic, got.put)
    collector.wait_for_subscribers("stop", 1, WAIT)
    collector.publish("data", {"weights": np.ones(4)})
    collector.publish("stop", {"reason": "solved"})
    received = [got.get(timeout=WAIT), got.get(timeout=WAIT)]
    collector.close()
    learner.close()
    tap.close()
    return tap.recorded, received


def test_traffic_recorded_in_one_run_is_refused_by_another_with_the_same_secret(make_router, tmp_path):
    recorded, received = recorded_run(make_router, tmp_path, "first")
    assert received[1] == {"reason": "solved"} and len(recorded) > 3
    victim = make_router("learner", listen=f"ipc://{tmp_path}/first-learner.ipc")  # same id, address, secret
    got = queue.Queue()
    for topic in ("data", "stop"):
        victim.on(topic, got.put)
    with raw_sender(victim.address) as raw:
        for data in recorded:
            raw.send(data)
        keyed = [d for d in recorded if open_batch(SECRET, d, 1 << 30)[0].receiver_incarnation != HELLO]
        messages = sum(len(open_batch(SECRET, d, 1 << 30)) for d in keyed)  # data and stop may share a batch
        eventually(lambda: victim.stats()["rejected_replay"] >= len(keyed), "every recorded keyed message refused")
        genuine = make_router("collector2", peers=[victim.address])  # a real peer after the replay
        genuine.wait_for_subscribers("data", 1, WAIT)
        genuine.publish("data", "genuine")
        assert got.get(timeout=WAIT) == "genuine"
    assert got.empty(), "a recorded message was delivered"
    assert messages >= 4 and "collector" not in victim.stats()["peers"]


def test_a_restarted_incarnation_refuses_the_old_ones_traffic_and_hears_the_new_one(make_router, tmp_path):
    learner = make_router("learner", listen=f"ipc://{tmp_path}/learner.ipc")
    got = queue.Queue()
    learner.on("data", got.put)
    old = make_router("collector", peers=[learner.address])
    old.wait_for_subscribers("data", 1, WAIT)
    sealed_old = as_peer(old, learner, SECRET)
    recorded = [sealed_old("data", 100 + i, f"old {i}") for i in range(5)]  # as the old incarnation sent them
    old.close()  # an auto-recover restart: the same node id comes back as a new incarnation
    new = make_router("collector", peers=[learner.address])
    new.wait_for_subscribers("data", 1, WAIT)
    assert new.publish("data", "new 0") == 1
    assert got.get(timeout=WAIT) == "new 0"
    with raw_sender(learner.address) as raw:
        for data in recorded:
            raw.send(data)
        eventually(lambda: learner.stats()["rejected_replay"] >= len(recorded), "the old incarnation's refused")
    assert new.publish("data", "new 1") == 1
    assert got.get(timeout=WAIT) == "new 1"
    assert got.empty()
    stats = learner.stats()
    assert stats["duplicated"] == 0 and stats["peers"] == ["collector"]


# ---- bounded decoding -----------------------------------------------------------------------------------------

def test_arrays_sharing_one_buffer_are_refused_instead_of_multiplying_it():
    frames = encode({"a": np.zeros(1 << 16, np.uint8)})
    header = json.loads(frames[0])
    node = header["D"]["a"]
    amplified = json.dumps({"t": [node] * 1000}).encode()
    with pytest.raises(DecodeError, match="backs two values"):
        decode([amplified, frames[1]])


def test_an_amplifying_message_is_dropped_and_heartbeats_go_on(make_router):
    receiver, sender, got = pair(make_router, max_message_size=32 << 20)
    buffer = np.zeros(16 << 20, np.uint8)
    node = json.loads(encode(buffer)[0])
    frames = [json.dumps({"t": [node] * 150}).encode(), memoryview(buffer)]  # ~2.4 GB if each array were decoded
    gc.collect()
    before = rss_bytes()
    with raw_sender(receiver.address) as raw:
        sealed = join_as(raw, receiver)
        raw.send(sealed("x", 1, frames=frames))
        eventually(lambda: receiver.stats()["malformed"] == 1, "the amplifying message refused")
    still_receives(sender, got)
    assert rss_bytes() - before < 200 << 20
    stats = receiver.stats()
    assert stats["malformed"] == 1 and stats["peers_lost"] == 0 and sorted(stats["peers"]) == ["injector", "sender"]


def test_a_slow_handler_does_not_make_healthy_peers_look_silent(make_router):
    receiver, sender, got = pair(make_router)
    release = threading.Event()
    entered = threading.Event()

    def slow(payload):
        entered.set()
        release.wait(WAIT)

    receiver.on("slow", slow)
    sender.wait_for_subscribers("slow", 1, WAIT)
    sender.publish("slow", 1)
    assert entered.wait(WAIT)
    deadline = time.monotonic() + 2 * FAST["peer_timeout_s"]  # longer than a silent peer would last
    while time.monotonic() < deadline:
        assert receiver.stats()["peers_lost"] == 0
        time.sleep(0.1)
    release.set()
    still_receives(sender, got)
    assert receiver.peers() == ["sender"] and sender.peers() == ["receiver"]


def test_a_seq_near_two_to_the_64_does_not_block_its_sender(make_router):
    receiver, sender, got = pair(make_router)
    with raw_sender(receiver.address) as raw:
        sealed = join_as(raw, receiver)
        raw.send(sealed("x", 0, "first"))
        raw.send(sealed("x", 2 ** 64 - 2, "far future"))
        raw.send(sealed("x", 1, "second"))
    assert [got.get(timeout=WAIT), got.get(timeout=WAIT)] == ["first", "second"]
    assert receiver.stats()["malformed"] == 1


# ---- bounded connections --------------------------------------------------------------------------------------

def test_connections_holding_partial_messages_are_bounded_counted_and_timed_out(make_router):
    limit = 4 << 20  # nng's cut-off is twice this: 8 MiB per partial message
    receiver, sender, got = pair(make_router, max_message_size=limit, max_pending_bytes=2 * (2 * limit),
                                 auth_timeout_s=1.0)
    gc.collect()
    before = rss_bytes()
    attackers = []
    try:
        for _ in range(16):
            sock = sp_connect(receiver.address)
            attackers.append(sock)
            try:
                sock.sendall(sp_length(2 * limit - 1) + b"\x01" * (2 * limit - 1024))
            except OSError:  # refused: the router closed it
                pass
        eventually(lambda: receiver.stats()["rejected_connections"] >= 14, "the extra connections refused")
        grown = rss_bytes() - before
        assert receiver.stats()["pending"] <= 2
        assert grown < 3 * 2 * limit + (32 << 20), f"RSS grew {grown >> 20} MiB"
        still_receives(sender, got)
        eventually(lambda: receiver.stats()["pending"] == 0, "unauthenticated connections closed after auth_timeout_s")
    finally:
        for sock in attackers:
            sock.close()
    still_receives(sender, got, "after the attack")


def test_more_connections_than_the_limit_are_refused_and_counted(make_router):
    receiver, sender, got = pair(make_router, max_connections=3)
    socks = [sp_connect(receiver.address) for _ in range(6)]
    try:
        eventually(lambda: receiver.stats()["rejected_connections"] >= 4, "connections over the limit refused")
        assert receiver.stats()["connections"] <= 3
        still_receives(sender, got)
    finally:
        for sock in socks:
            sock.close()


# ---- the wrong secret -----------------------------------------------------------------------------------------

def test_a_node_with_another_secret_is_named_within_seconds_on_both_sides(make_router, caplog):
    caplog.set_level(logging.WARNING, logger="conveyor.engine.parallel.router")
    receiver = make_router("receiver", listen="tcp://127.0.0.1:0", auth_timeout_s=1.0)
    stranger = make_router("stranger", secret=generate_secret(), peers=[receiver.address], auth_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"connected to {receiver.address} .* another secret"):
        stranger.wait_for_peers(1, timeout=WAIT)
    eventually(lambda: any("router receiver" in r.getMessage() for r in caplog.records), "the listener's warning")
    listener = [r.getMessage() for r in caplog.records if "router receiver" in r.getMessage()]
    assert any("failed authentication" in m and "127.0.0.1" in m for m in listener), listener
    assert time.monotonic() - start < 5


FD_CHILD = """
import json, os, queue, resource, sys
from conveyor.engine.parallel.router import Router
secret = b"k" * 32
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
r = Router("fd", secret, listen="tcp://127.0.0.1:0", max_pending_bytes=1 << 40)
got = queue.Queue()
r.on("x", got.put)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 3, hard))
print(r.address, flush=True)
sys.stdin.readline()  # the parent holds more connections than this process may open
try:
    Router("more", secret, listen="tcp://127.0.0.1:0")
    error = None
except OSError as e:
    error = str(e)
print(json.dumps(error), flush=True)
sys.stdin.readline()  # the parent closed them
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
with Router("peer", secret, peers=[r.address]) as peer:
    peer.wait_for_subscribers("x", 1, 10)
    peer.publish("x", "after")
    print(json.dumps([got.get(timeout=10), r.stats()["receive_errors"]]), flush=True)
r.close()
"""


def test_running_out_of_file_descriptors_is_a_one_line_error_naming_the_limit_and_no_abort():
    proc = subprocess.Popen([sys.executable, "-c", FD_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        address = proc.stdout.readline().strip()
        socks = []
        for _ in range(20):  # until nng's accept meets EMFILE: the handshake of the last one never comes
            try:
                socks.append(sp_connect(address, timeout=1))
            except OSError:
                break
        assert len(socks) < 20
        proc.stdin.write("go\n")
        proc.stdin.flush()
        error = json.loads(proc.stdout.readline())
        for sock in socks:
            sock.close()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        received = json.loads(proc.stdout.readline())
        assert proc.wait(WAIT) == 0
    finally:
        proc.kill()
        proc.wait(WAIT)
    assert "out of file descriptors" in error and "ulimit -n" in error and "\n" not in error
    assert received == ["after", 0]
