"""Message transport throughput: the sealed message path against raw pynng, for 1 KB, 64 KB and 1 MB payloads.

One side of the path is what exists so far of the multi-node transport (issue 8): per message,
``codec.encode`` of ``{"data": <float32 array>}``, ``frame.seal`` (HMAC-SHA256), ``send`` on a pynng
``Pair0`` socket, and in a receiver process ``recv``, ``frame.open_frame`` (size check, HMAC check) and
``codec.decode`` (into writable arrays). The baseline sends the same array bytes, prepared in advance,
with plain ``send`` / ``recv`` on the same sockets. Both are timed in the same run, in alternation, best of
the repeats; a run is timed from the first send to the receiver's acknowledgement of the last message.
When the router lands, it replaces the encode/seal/open/decode path here with the full router path
(``task.emit`` to a remote handler), and the issue's bar (ratio >= 0.7 at 64 KB and 1 MB) is judged on that.

Loopback only: ``ipc://`` in a temporary directory (default) or ``tcp://127.0.0.1``. Prints a table, then one
JSON line with ``ratio_1k``, ``ratio_64k``, ``ratio_1m`` (ours / raw, messages per second) and the figures.

    python benchmarks/transport.py [--quick] [--protocol ipc|tcp]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pynng

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from conveyor.engine.parallel import decode, encode, generate_secret, open_frame, seal  # noqa: E402

SIZES = {"1k": 1 << 10, "64k": 64 << 10, "1m": 1 << 20}
MESSAGES = {"1k": 20000, "64k": 4000, "1m": 400}  # full run; --quick sends a tenth
TIMEOUT_MS = 30_000  # no run may wait longer than this for a message: a stuck peer is an error, not a hang
MAX_SIZE = 4 << 20


def receiver(address: str, secret: bytes) -> None:
    """The far end: for each ``b"raw N"`` / ``b"ours N"`` order, take N messages, then acknowledge."""
    with pynng.Pair0(dial=address, recv_timeout=TIMEOUT_MS, send_timeout=TIMEOUT_MS) as sock:
        while True:
            order = sock.recv().split()
            if order[0] == b"stop":
                return
            for _ in range(int(order[1])):
                data = sock.recv()
                if order[0] == b"ours":
                    decode(open_frame(secret, data, MAX_SIZE).payload)
            sock.send(b"done")


def timed(sock: pynng.Pair0, mode: str, n: int, send_one) -> float:
    """Seconds from the first send of ``n`` messages to the receiver's acknowledgement of the last."""
    sock.send(f"{mode} {n}".encode())
    start = time.perf_counter()
    for i in range(n):
        send_one(i)
    if sock.recv() != b"done":
        raise RuntimeError("the receiver answered something other than 'done'")
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
        address = f"ipc://{tmp}/bench.ipc" if args.protocol == "ipc" else f"tcp://127.0.0.1:{free_tcp_port()}"
        child = mp.get_context("spawn").Process(target=receiver, args=(address, secret), daemon=True)
        with pynng.Pair0(listen=address, recv_timeout=TIMEOUT_MS, send_timeout=TIMEOUT_MS) as sock:
            child.start()
            try:
                for name, size in SIZES.items():
                    n = MESSAGES[name] // (10 if args.quick else 1)
                    array = np.random.default_rng(0).standard_normal(size // 4).astype(np.float32)
                    raw_bytes = array.tobytes()

                    def send_raw(i: int) -> None:
                        sock.send(raw_bytes)

                    def send_ours(i: int) -> None:
                        sock.send(seal(secret, "bench", i, "sender", encode({"data": array})))

                    timed(sock, "raw", max(n // 10, 1), send_raw)  # warm-up: connection, page faults, imports
                    timed(sock, "ours", max(n // 10, 1), send_ours)
                    raw, ours = [], []
                    for _ in range(repeats):
                        raw.append(timed(sock, "raw", n, send_raw))
                        ours.append(timed(sock, "ours", n, send_ours))
                    rows[name] = {"bytes": size, "messages": n, "raw_msgs_per_s": n / min(raw),
                                  "msgs_per_s": n / min(ours)}
                sock.send(b"stop")
            finally:
                child.join(timeout=10)
                if child.is_alive():
                    child.terminate()
                    child.join(timeout=5)
    if child.exitcode != 0:
        raise SystemExit(f"the receiver process ended with exit code {child.exitcode}")

    print(f"transport: {args.protocol} loopback, pynng Pair0, best of {repeats}; ours = encode+seal+send+recv+open+decode")
    print(f"{'payload':>8} {'messages':>9} {'raw msg/s':>11} {'raw MB/s':>9} {'ours msg/s':>11} {'ours MB/s':>10} {'ratio':>6}")
    summary = {"protocol": args.protocol, "quick": args.quick, "repeats": repeats}
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
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
