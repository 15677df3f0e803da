"""Message transport throughput: the router path against raw pynng, for 1 KB, 64 KB and 1 MB payloads.

"Ours" is the full router path: ``Router.publish("bench", {"data": <float32 array>})`` in this process
(``codec.encode``, ``frame.pack``, ``frame.sign`` with AES-GMAC under the link's key, ``send`` on the Push0
link), and in a receiver process the router's receive thread (``recv`` on its Pull0 inbox, size check, tag
check, incarnation and replay-window check, sequence check) and its delivery thread (``codec.decode`` into
arrays, then the handler). The baseline sends the same array bytes,
prepared in advance, with plain ``send`` / ``recv`` on a pynng ``Pair0`` pair. Both are timed in the same
run, in alternation, best of the repeats; a run is timed from the first send to the receiver's
acknowledgement of the last message. Issue 16's bar: ratio_64k >= 0.7 and ratio_1m >= 0.85.

Loopback only: ``ipc://`` in a temporary directory (default) or ``tcp://127.0.0.1``. Prints a table, a line
on what MACs cost here (the AES-GMAC the router uses, HMAC-SHA256 and keyed blake2b, over 64 KB and 1 MB),
then one JSON line with ``ratio_1k``, ``ratio_64k``, ``ratio_1m`` (ours / raw, messages per second) and the
figures.

    python -m benchmarks.transport [--quick] [--protocol ipc|tcp]
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import multiprocessing as mp
import queue
import socket
import tempfile
import time

import numpy as np
import pynng

from benchmarks._harness import print_json_line
from conveyor.engine.parallel import generate_secret
from conveyor.engine.parallel.router import Router

SIZES = {"1k": 1 << 10, "64k": 64 << 10, "1m": 1 << 20}
MESSAGES = {"1k": 20000, "64k": 4000, "1m": 400}  # full run; --quick sends a tenth
TIMEOUT_MS = 30_000  # no run may wait longer than this for a message: a stuck peer is an error, not a hang
MAX_SIZE = 4 << 20


def receiver(raw_address: str, router_address: str, secret: bytes) -> None:
    """The far end. Raw: for each ``b"raw N"`` order on the Pair0 socket, take N messages, acknowledge.
    Ours: a router whose handler counts ``bench`` messages and publishes ``done`` after the expected number."""
    expected, seen = [0], [0]
    router = Router("receiver", secret, listen="tcp://127.0.0.1:0" if router_address.startswith("tcp") else None,
                    peers=[router_address], max_message_size=MAX_SIZE, send_timeout_s=TIMEOUT_MS / 1000)

    def expect(n: int) -> None:
        expected[0], seen[0] = n, 0

    def bench(payload: dict) -> None:
        seen[0] += 1
        if seen[0] == expected[0]:
            router.publish("done", seen[0])

    router.on("expect", expect)
    router.on("bench", bench)
    try:
        with pynng.Pair0(dial=raw_address, recv_timeout=TIMEOUT_MS, send_timeout=TIMEOUT_MS) as sock:
            while True:
                order = sock.recv().split()
                if order[0] == b"stop":
                    return
                for _ in range(int(order[1])):
                    sock.recv()
                sock.send(b"done")
    finally:
        router.close()


def timed_raw(sock: pynng.Pair0, n: int, data: bytes) -> float:
    """Seconds from the first raw send of ``n`` messages to the receiver's acknowledgement of the last."""
    sock.send(f"raw {n}".encode())
    start = time.perf_counter()
    for _ in range(n):
        sock.send(data)
    if sock.recv() != b"done":
        raise RuntimeError("the receiver answered something other than 'done'")
    return time.perf_counter() - start


def timed_ours(router: Router, done: "queue.Queue[int]", n: int, payload: dict) -> float:
    """Seconds from the first ``publish`` of ``n`` messages to the receiver's ``done``."""
    router.publish("expect", n)
    start = time.perf_counter()
    for _ in range(n):
        if router.publish("bench", payload) != 1:
            raise RuntimeError("the receiver is no longer subscribed")
    if done.get(timeout=TIMEOUT_MS / 1000) != n:
        raise RuntimeError("the receiver counted another number of messages")
    return time.perf_counter() - start


def mac_speeds(secret: bytes, rounds: int = 50) -> dict:
    """GB/s over 64 KB and 1 MB, best of 3: AES-GMAC (what frame.sign does), HMAC-SHA256 and keyed blake2b."""
    from conveyor.engine.parallel.frame import _link_key, new_incarnation
    gmac = _link_key(secret, new_incarnation(), new_incarnation())
    out = {}
    for label, size in (("64k", 64 << 10), ("1m", 1 << 20)):
        data = np.random.default_rng(1).bytes(size)
        for name, fn in (("aes_gmac", lambda: gmac.encrypt(bytes(12), b"", data)),
                         ("hmac_sha256", lambda: hmac.digest(secret, data, hashlib.sha256)),
                         ("blake2b", lambda: hashlib.blake2b(data, key=secret[:64]).digest())):
            n = rounds * (16 if label == "64k" else 1)
            best = min(_time(fn, n) for _ in range(3))
            out[f"{name}_gb_per_s_{label}"] = round(size * n / best / 1e9, 2)
    return out


def _time(fn, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return time.perf_counter() - start


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the messages, one repeat")
    parser.add_argument("--protocol", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per size and side (default 3, quick 1)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    secret = generate_secret()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-transport-") as tmp:
        if args.protocol == "ipc":
            raw_address, router_listen = f"ipc://{tmp}/raw.ipc", f"ipc://{tmp}/router.ipc"
        else:
            raw_address, router_listen = f"tcp://127.0.0.1:{free_tcp_port()}", "tcp://127.0.0.1:0"
        done: "queue.Queue[int]" = queue.Queue()
        with Router("sender", secret, listen=router_listen, max_message_size=MAX_SIZE,
                    send_timeout_s=TIMEOUT_MS / 1000) as router, \
                pynng.Pair0(listen=raw_address, recv_timeout=TIMEOUT_MS, send_timeout=TIMEOUT_MS) as sock:
            router.on("done", done.put)
            child = mp.get_context("spawn").Process(target=receiver, args=(raw_address, router.address, secret),
                                                    daemon=True)
            child.start()
            try:
                router.wait_for_subscribers("bench", 1, timeout=TIMEOUT_MS / 1000)
                for name, size in SIZES.items():
                    n = MESSAGES[name] // (10 if args.quick else 1)
                    array = np.random.default_rng(0).standard_normal(size // 4).astype(np.float32)
                    raw_bytes, payload = array.tobytes(), {"data": array}
                    timed_raw(sock, max(n // 10, 1), raw_bytes)  # warm-up: connection, page faults, imports
                    timed_ours(router, done, max(n // 10, 1), payload)
                    raw, ours = [], []
                    for _ in range(repeats):
                        raw.append(timed_raw(sock, n, raw_bytes))
                        ours.append(timed_ours(router, done, n, payload))
                    rows[name] = {"bytes": size, "messages": n, "raw_msgs_per_s": n / min(raw),
                                  "msgs_per_s": n / min(ours)}
                stats = router.stats()
                sock.send(b"stop")
            finally:
                child.join(timeout=10)
                if child.is_alive():
                    child.terminate()
                    child.join(timeout=5)
    if child.exitcode != 0:
        raise SystemExit(f"the receiver process ended with exit code {child.exitcode}")
    macs = mac_speeds(secret)

    print(f"transport: {args.protocol} loopback, best of {repeats}; raw = pynng Pair0 send/recv of the array bytes; "
          f"ours = Router.publish -> handler in another process")
    print(f"{'payload':>8} {'messages':>9} {'raw msg/s':>11} {'raw MB/s':>9} {'ours msg/s':>11} {'ours MB/s':>10} {'ratio':>6}")
    summary = {"protocol": args.protocol, "quick": args.quick, "repeats": repeats, **macs}
    for name, r in rows.items():
        mb = r["bytes"] / 1e6
        ratio = r["msgs_per_s"] / r["raw_msgs_per_s"]
        print(f"{name:>8} {r['messages']:>9} {r['raw_msgs_per_s']:>11.0f} {r['raw_msgs_per_s'] * mb:>9.1f} "
              f"{r['msgs_per_s']:>11.0f} {r['msgs_per_s'] * mb:>10.1f} {ratio:>6.2f}")
        summary[f"ratio_{name}"] = round(ratio, 3)
        summary[f"msgs_per_s_{name}"] = round(r["msgs_per_s"], 1)
        summary[f"raw_msgs_per_s_{name}"] = round(r["raw_msgs_per_s"], 1)
        summary[f"mb_per_s_{name}"] = round(r["msgs_per_s"] * mb, 1)
        summary[f"raw_mb_per_s_{name}"] = round(r["raw_msgs_per_s"] * mb, 1)
    print(f"MAC here, 64 KB / 1 MB: AES-GMAC (the router's) {macs['aes_gmac_gb_per_s_64k']} / "
          f"{macs['aes_gmac_gb_per_s_1m']} GB/s, HMAC-SHA256 {macs['hmac_sha256_gb_per_s_64k']} / "
          f"{macs['hmac_sha256_gb_per_s_1m']} GB/s, keyed blake2b {macs['blake2b_gb_per_s_64k']} / "
          f"{macs['blake2b_gb_per_s_1m']} GB/s; router send timeouts {stats['send_timeouts']}")
    print_json_line(summary)


if __name__ == "__main__":
    main()
