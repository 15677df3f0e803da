"""What keeps a router's receive path bounded and quiet under hostile input.

- :class:`ReplayWindow`: which link counters of one sender incarnation were seen (a sliding window, as
  IPsec and DTLS keep one), so an authentic message delivered twice is refused the second time, and a
  counter that jumps absurdly far ahead cannot push the sender's own messages out of the window.
- :class:`RateLimitedLog`: logs a kind of event at most once per period and counts the rest, so a flood
  of bad messages neither fills the log nor costs more than a counter each.
- :func:`close_socket`: closes a pynng socket and keeps the object alive a while after, so a pipe callback
  nng runs late never reads a collected socket.
- :class:`AuthFailures`: which addresses sent messages that failed authentication, and whether one keeps
  doing so (a node with another secret), so a node waiting for its peers can say so at once.
- :class:`PipeGuard`: bounds the connections an inbox holds, and those not authenticated yet (each of
  which can hold one partial message of up to nng's receive limit), closing the rest.
- :class:`HandshakeGuard`: bounds the TCP connections nng accepted but holds before its handshake, which
  never reach a :class:`PipeGuard` (see there).
"""
from __future__ import annotations

import collections
import errno
import os
import select
import socket
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from conveyor.engine.ratelimit import RateLimitedLog

__all__ = ["AuthFailures", "HandshakeGuard", "PipeGuard", "ReplayWindow"]


class ReplayWindow:
    """Accepts each counter once: one above the highest seen by at most ``max_jump``, or one within ``size``
    below it not seen yet (messages of one sender reordered across two links). Older ones are refused, and
    so is a jump further ahead (:meth:`too_far`): one forged counter near 2**64 would otherwise make every
    later counter of the sender's look old, cutting an honest peer off."""

    def __init__(self, size: int = 1024, max_jump: int = 1 << 32) -> None:
        self.size, self.max_jump = size, max_jump
        self.top = -1
        self._seen = 0  # bit i: counter top - i was seen

    def too_far(self, counter: int) -> bool:
        """Whether ``counter`` is more than ``max_jump`` past the highest seen: not a counter the sender had."""
        return counter - self.top > self.max_jump

    def accept(self, counter: int) -> bool:
        """Whether ``counter`` is new and not :meth:`too_far`; if so it is marked seen."""
        if counter > self.top:
            shift = counter - self.top
            if shift > self.max_jump:
                return False
            self._seen = ((self._seen << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
            self.top = counter
            return True
        back = self.top - counter
        if back >= self.size or self._seen >> back & 1:
            return False
        self._seen |= 1 << back
        return True


class AuthFailures:
    """Messages that failed authentication, per remote host (a dialer reconnects from new ports): the first
    and the latest time, how many, the latest address. At most ``limit`` hosts, the least recent forgotten."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._hosts: Dict[str, List[Any]] = {}  # host -> [first at, latest at, count, latest address]

    def add(self, remote: str, now: float) -> None:
        """A message from ``remote`` (``host:port``) failed its tag at ``now`` (monotonic seconds)."""
        host = remote.rsplit(":", 1)[0]
        with self._lock:
            entry = self._hosts.pop(host, None) or [now, now, 0, remote]
            entry[1:] = [now, entry[2] + 1, remote]
            self._hosts[host] = entry  # most recent last
            if len(self._hosts) > self.limit:
                self._hosts.pop(next(iter(self._hosts)))

    def addresses(self) -> List[str]:
        """The latest address of each host that failed authentication."""
        with self._lock:
            return sorted(entry[3] for entry in self._hosts.values())

    def persistent(self, now: float, span_s: float) -> Optional[str]:
        """A sentence naming a host that kept failing for over ``span_s`` and failed within ``span_s`` of
        ``now`` (a node with another secret retries; a stray message does not), or None."""
        with self._lock:
            for first, latest, count, remote in self._hosts.values():
                if count >= 3 and latest - first > span_s and now - latest <= span_s:
                    return (f"{remote} has sent {count} messages that failed authentication over "
                            f"{latest - first:.1f}s")
        return None


class PipeGuard:
    """Admits at most ``max_connections`` pipes to an inbox, of which at most ``max_pending`` not yet
    authenticated; a pending pipe is closed after ``timeout_s``. ``count(name)`` is told of each refusal."""

    def __init__(self, max_connections: int, max_pending: int, timeout_s: float,
                 count: Callable[[str], None], log: RateLimitedLog, name: str) -> None:
        self.max_connections, self.max_pending, self.timeout_s = max_connections, max_pending, timeout_s
        self._count, self._log, self._name = count, log, name
        self._lock = threading.Lock()
        self._pending: Dict[int, Tuple[float, Any]] = {}  # pipe id -> (opened at, pipe)
        self._trusted: Dict[int, Any] = {}

    def opened(self, pipe: Any) -> None:
        """nng's pre-connect callback: admit the pipe or close it at once."""
        with self._lock:
            total = len(self._pending) + len(self._trusted)
            full = "connections" if total >= self.max_connections else (
                "unauthenticated connections" if len(self._pending) >= self.max_pending else None)
            if full is None:
                self._pending[pipe.id] = (time.monotonic(), pipe)
                return
        limit = self.max_connections if full == "connections" else self.max_pending
        self._refuse(pipe, f"already {limit} {full}, the limit")

    def closed(self, pipe: Any) -> None:
        """nng's post-remove callback."""
        with self._lock:
            self._pending.pop(pipe.id, None)
            self._trusted.pop(pipe.id, None)

    def is_open(self, pipe_id: int) -> bool:
        """Whether the pipe numbered ``pipe_id`` is admitted and not closed yet."""
        with self._lock:
            return pipe_id in self._pending or pipe_id in self._trusted

    def close(self, pipe_id: int) -> None:
        """Close the pipe numbered ``pipe_id`` if it is admitted (nng then calls :meth:`closed`)."""
        with self._lock:
            pipe = self._trusted[pipe_id] if pipe_id in self._trusted else self._pending.get(pipe_id, (0.0, None))[1]
        if pipe is not None:
            _close_pipe(pipe)

    def authenticated(self, pipe: Any) -> None:
        """A message that passed every check of the router came through ``pipe``: it is a peer's, no longer
        pending."""
        if pipe is None:
            return
        with self._lock:
            entry = self._pending.pop(pipe.id, None)
            if entry is not None:
                self._trusted[pipe.id] = entry[1]

    def expire(self) -> None:
        """Close the pending pipes older than ``timeout_s``."""
        now = time.monotonic()
        with self._lock:
            old: List[Any] = [pipe for at, pipe in self._pending.values() if now - at > self.timeout_s]
            for pipe in old:
                self._pending.pop(pipe.id, None)
        for pipe in old:
            self._refuse(pipe, f"nothing authentic came through it within {self.timeout_s}s")

    def remote_ports(self) -> Set[int]:
        """The peers' TCP ports of the pipes admitted now (for :class:`HandshakeGuard`)."""
        with self._lock:
            pipes = [pipe for _, pipe in self._pending.values()] + list(self._trusted.values())
        ports = set()
        for pipe in pipes:
            try:
                ports.add(socket.ntohs(pipe.remote_address.port))  # pynng gives it in network byte order
            except Exception:  # closed meanwhile, or not tcp
                pass
        return ports

    def counts(self) -> Dict[str, int]:
        """Pipes admitted now: ``connections`` in all, ``pending`` of them not authenticated yet."""
        with self._lock:
            return {"connections": len(self._pending) + len(self._trusted), "pending": len(self._pending)}

    def _refuse(self, pipe: Any, why: str) -> None:
        self._count("rejected_connections")
        self._log.log("connections", "router %s: closed a connection from %s (%s)", self._name, _remote(pipe), why)
        _close_pipe(pipe)


class HandshakeGuard:
    """Shuts down TCP connections to ``port`` that nng holds before its handshake: each one's peer has not
    sent the 8-byte SP header, so nng made no pipe of it, called no :class:`PipeGuard` and keeps its file
    descriptor for 10 s (a timeout nng hard-codes, with no bound on how many). A thread reads this process's
    descriptors when a connection comes (at most once per ``busy_s``; every ``period_s`` at least) and shuts
    down those waiting for ``timeout_s``, and the oldest beyond ``max_waiting``; nng then closes them.
    ``admitted()`` gives the peer ports of the pipes nng made. Holds one spare descriptor, so it still works
    when the process has run out."""

    def __init__(self, port: int, admitted: Callable[[], Set[int]], *, max_waiting: int, timeout_s: float,
                 count: Callable[[str], None], log: RateLimitedLog, name: str, period_s: float = 0.2,
                 busy_s: float = 0.01) -> None:
        self.port, self.max_waiting, self.timeout_s = port, max_waiting, timeout_s
        self.period_s, self.busy_s = period_s, busy_s
        self._admitted, self._count, self._log, self._name = admitted, count, log, name
        self._waiting: Dict[Tuple[int, int], float] = {}  # (fd, peer port) -> first seen
        self._listening: Optional[int] = None  # nng's listening socket, once seen
        self._stop = threading.Event()
        self._spare: Optional[int] = _open_spare()
        self._thread = threading.Thread(target=self._loop, name=f"conveyor-router-fds-{name}", daemon=True)

    def start(self) -> None:
        """Start watching (a no-op where the system has no ``/proc/self/fd``)."""
        if os.path.isdir("/proc/self/fd"):
            self.sweep()
            self._thread.start()

    def close(self) -> None:
        """Stop watching and give back the spare descriptor."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    def waiting(self) -> int:
        """Connections seen waiting for their handshake at the last look."""
        return len(self._waiting)

    def _loop(self) -> None:
        while not self._stop.wait(self.busy_s):  # at most one look per busy_s: a flood costs bounded CPU
            try:
                if not self._waiting and self._listening is not None:  # until a connection comes, or period_s
                    poller = select.poll()
                    poller.register(self._listening, select.POLLIN)
                    poller.poll(self.period_s * 1000)
                self.sweep()
            except Exception as e:  # a bug here must not stop the watch
                self._log.log(f"fds:{type(e).__name__}", "router %s: watching connections: %s: %s", self._name,
                              type(e).__name__, e)

    def sweep(self) -> None:
        """Look once: note the connections waiting for their handshake, shut down the old and the surplus."""
        admitted, now, seen = self._admitted(), time.monotonic(), {}
        for fd in self._descriptors():
            peer = _peer_port(fd, self.port)
            if peer == _LISTENING:
                if self._listening != fd:  # first seen: set up once, not at every look
                    _hold_silent_connections(fd, max(1, round(self.timeout_s)), self.max_waiting)
                self._listening = fd
            elif peer is not None and peer not in admitted:
                seen[(fd, peer)] = self._waiting.get((fd, peer), now)
        by_age = sorted(seen.items(), key=lambda item: item[1])
        surplus = len(by_age) - self.max_waiting
        for i, ((fd, peer), first) in enumerate(by_age):
            old = now - first >= self.timeout_s
            if (i < surplus or old) and _shut_down(fd, self.port, peer):
                del seen[(fd, peer)]
                self._count("rejected_connections")
                self._log.log("handshakes", "router %s: shut down a connection from port %d that sent no handshake "
                              "(%s)", self._name, peer, f"none within {self.timeout_s}s" if old else
                              f"already {self.max_waiting} waiting, the limit")
        self._waiting = seen

    def _descriptors(self) -> List[int]:
        """This process's open descriptors; out of them, the spare one is given back for the look."""
        try:
            names = os.listdir("/proc/self/fd")
        except OSError as e:
            if e.errno != errno.EMFILE or self._spare is None:
                raise
            os.close(self._spare)
            try:
                names = os.listdir("/proc/self/fd")
            finally:
                self._spare = _open_spare()
        return [int(name) for name in names]


def _open_spare() -> Optional[int]:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


_LISTENING = -1


def _peer_port(fd: int, port: int) -> Optional[int]:
    """The peer's port where ``fd`` is a TCP connection accepted on local ``port``, ``_LISTENING`` where it is
    the socket listening on ``port``, else None."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket, or closed meanwhile
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        if sock.getsockname()[1] != port:
            return None
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return _LISTENING
        return sock.getpeername()[1]
    except OSError:  # closed meanwhile
        return None
    finally:
        sock.detach()  # the descriptor is nng's: never close it


def _hold_silent_connections(fd: int, defer_s: int, backlog: int) -> None:
    """Give nng's listening socket ``fd`` ``TCP_DEFER_ACCEPT``: connections that send nothing wait in the kernel,
    holding no descriptor of ours, for ``defer_s``; and a backlog of ``backlog`` (the guard's ``max_waiting``): when
    ``defer_s`` ends, no more than that many reach nng's accept at once, so a flood's descriptors stay bounded even
    while the guard's thread waits for a busy CPU (honest dialers retry)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # closed meanwhile
        return
    try:
        if hasattr(socket, "TCP_DEFER_ACCEPT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, defer_s)
        sock.listen(backlog)
    except OSError:  # closed meanwhile
        pass
    finally:
        sock.detach()  # the descriptor is nng's: never close it


def _shut_down(fd: int, port: int, peer: int) -> bool:
    """Shut down ``fd`` if it is still the connection from ``peer`` to ``port`` (nng then closes it)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if sock.getsockname()[1] != port or sock.getpeername()[1] != peer:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


_KEEP_CLOSED_S = 60.0
_closed: Deque[Tuple[float, Any]] = collections.deque()
_closed_lock = threading.Lock()


def close_socket(sock: Any) -> None:
    """Close a pynng socket, holding the Python object for ``_KEEP_CLOSED_S`` after.

    pynng passes each pipe callback a cffi handle to its Socket; nng may run a pipe-removal callback on its
    own thread after ``nng_close`` returns, and had the garbage collector freed the Socket by then the
    callback would read freed memory (our suspect for a learner SIGSEGV seen once in CI after a peer was
    killed). A minute is far longer than any callback in flight; the list holds one entry per closing.
    """
    sock.close()
    now = time.monotonic()
    with _closed_lock:
        _closed.append((now, sock))
        while _closed and now - _closed[0][0] > _KEEP_CLOSED_S:
            _closed.popleft()


def _close_pipe(pipe: Any) -> None:
    try:
        pipe.close()
    except Exception:  # already closed by its peer
        pass


def _remote(pipe: Any) -> str:
    """The peer address of an nng pipe, for messages (``?`` where the transport has none)."""
    try:
        return str(pipe.remote_address)
    except Exception:
        return "?"
