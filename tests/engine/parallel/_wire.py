"""Hand-made traffic for the router tests: messages sealed as a known peer would, raw sockets, memory."""
import socket
import struct
import time

import pynng

from conveyor.engine.parallel import encode, generate_secret, seal

WAIT = 10  # seconds: the bound on every wait; a healthy exchange takes milliseconds
SECRET = generate_secret()
FAST = dict(heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0)


def as_peer(sender, receiver, secret):
    """A sealer of messages from ``sender``'s incarnation to ``receiver``'s, as if ``sender`` sent them. Their
    link counters are far above the router's own, so none repeats one of its, and the receiver then refuses
    ``sender``'s own later messages as too old: seal as a router kept for injecting only. ``frames=`` sends
    raw codec frames."""
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
