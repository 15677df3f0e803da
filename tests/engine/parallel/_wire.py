"""Hand-made traffic for the router tests: messages sealed as a known peer would, raw sockets, memory."""
import itertools
import socket
import struct
import time

import pynng

from conveyor.engine.parallel import encode, generate_secret, seal
from conveyor.engine.parallel.frame import join, new_incarnation, pack, sign
from conveyor.engine.parallel.router import CONTROL_TOPIC

WAIT = 10  # seconds: the bound on every wait; a healthy exchange takes milliseconds
SECRET = generate_secret()
FAST = dict(heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0)


def as_peer(sender, receiver, secret):
    """A sealer of messages from ``sender``'s incarnation to ``receiver``'s, as if ``sender`` sent them (link
    counters from 2**31): what a recording or a forgery in its name can carry. ``receiver`` takes none of them
    through another connection than ``sender``'s own while that one is open. ``frames=`` sends raw codec frames."""
    deadline = time.monotonic() + WAIT
    while sender.node_id not in receiver.peers():  # its state reached the receiver: its incarnation is known
        assert time.monotonic() < deadline, f"{receiver.node_id} never heard {sender.node_id}"
        time.sleep(0.01)
    counter = iter(range(1 << 31, 1 << 32))
    keys = dict(sender_incarnation=bytes.fromhex(sender.incarnation),
                receiver_incarnation=bytes.fromhex(receiver.incarnation))

    def sealed(topic, seq, payload=None, *, frames=None, key=secret):
        return seal(key, topic, seq, sender.node_id, encode(payload) if frames is None else frames,
                    counter=next(counter), **keys)
    return sealed


def join_as(raw, receiver, node_id="injector", secret=SECRET):
    """Make ``node_id`` a peer of ``receiver`` that speaks through ``raw`` (a :func:`raw_sender`): its state, sealed
    for ``receiver`` from a new incarnation. Returns a sealer of that incarnation's messages (link counters from 1,
    or ``counter=``; ``frames=`` sends raw codec frames; ``also=[(topic, seq, payload), ...]`` a batch), which ``receiver`` takes through ``raw`` only. It sends
    no heartbeat: ``receiver`` loses it after ``peer_timeout_s`` (and closes ``raw``'s connection, which redials)."""
    keys = dict(sender_incarnation=new_incarnation(), receiver_incarnation=bytes.fromhex(receiver.incarnation))
    counters = itertools.count()
    state = {"kind": "state", "address": receiver.address, "topics": [], "heard": [receiver.node_id]}
    raw.send(seal(secret, CONTROL_TOPIC, 0, node_id, encode(state), counter=next(counters), **keys))
    eventually(lambda: node_id in receiver.peers(), f"{receiver.node_id} hears {node_id}")

    def sealed(topic, seq, payload=None, *, frames=None, key=secret, counter=None, also=()):
        if also:  # a batch: this message, then each (topic, seq, payload) of ``also``, under one tag
            batch = join([pack(t, s, node_id, encode(p)) for t, s, p in [(topic, seq, payload), *also]])
            return bytes(sign(batch, key, counter=next(counters) if counter is None else counter, **keys))
        return seal(key, topic, seq, node_id, encode(payload) if frames is None else frames,
                    counter=next(counters) if counter is None else counter, **keys)
    return sealed


def raw_sender(address):
    """A bare pynng socket dialing a router's inbox, for sending hand-made messages."""
    return pynng.Push0(dial=address, send_timeout=WAIT * 1000)


def tcp_connect(address, timeout=WAIT):
    """A plain TCP connection to ``tcp://host:port``."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def sp_connect(address, timeout=WAIT):
    """A TCP connection that speaks nng's Push0 handshake to ``tcp://host:port``; the caller writes
    length-prefixed messages (8 bytes big-endian, then the bytes) or parts of them."""
    sock = tcp_connect(address, timeout)
    sock.sendall(b"\x00SP\x00\x00\x50\x00\x00")  # SP over TCP, protocol Push0 (0x50)
    sock.recv(8)
    return sock


def sp_length(n):
    return struct.pack(">Q", n)


def rss_bytes():
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def eventually(check, what):
    """Wait (bounded) for ``check()`` to hold: for effects of nng's own threads, which signal nothing."""
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, f"not within {WAIT}s: {what}"
        time.sleep(0.02)
