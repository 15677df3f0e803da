"""A router's inbox: the Pull0 socket its peers send to, the checks every message passes, and delivery.

Two threads keep receiving apart from the handlers:

- the *receive* thread reads the socket and checks each batch (size, tag, incarnation, message count and
  length: :func:`~conveyor.engine.parallel.frame.open_batch`, which splits it into views of its messages);
  control messages (which travel alone) go to the router at once; of a data batch, the messages the router
  accepts (known sender, new counter, sane seq) join a backlog bounded in bytes, one entry per batch;
- the *delivery* thread decodes them and calls their handlers in arrival order, so decoding a large
  message or a slow handler never delays the messages that keep peers alive. While the backlog is
  full the receive thread waits, and :attr:`Inbox.stalled` tells the router that silence is ours.

Nothing a peer or a stranger sends ends either loop: refusals are counted by kind, and any other
exception is counted in ``receive_errors`` and logged at most once a minute per kind. The socket's
connections are bounded by a :class:`~conveyor.engine.parallel.guard.PipeGuard`, and on tcp those nng holds
before its handshake by a :class:`~conveyor.engine.parallel.guard.HandshakeGuard`.
"""
from __future__ import annotations

import collections
import errno
import os
import resource
import shutil
import socket
import tempfile
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Tuple
from urllib.parse import urlsplit

import pynng

from conveyor.engine.parallel import codec as _codec
from conveyor.engine.parallel.frame import (HELLO, AuthError, Frame, MalformedFrame, OversizeError, ReplayError,
                                            VersionError, open_batch)
from conveyor.engine.parallel.guard import HandshakeGuard, PipeGuard, _remote, close_socket
from conveyor.engine.ratelimit import RateLimitedLog

__all__ = ["CONTROL_TOPIC", "Inbox"]

CONTROL_TOPIC = "\x00router"
"""Reserved topic of the router's own state and goodbye messages."""

_MAX_CONTROL_BYTES = 1 << 16  # a state message is a few hundred bytes; more is not one of ours
_UNDECODABLE = object()


class _Router(Protocol):
    """What the inbox asks of its router (:class:`~conveyor.engine.parallel.router.Router`)."""
    node_id: str
    secret: bytes
    max_message_size: int
    heartbeat_s: float

    def _count(self, name: str, n: int = 1) -> None: ...
    def _on_hello(self, frame: Frame, message: Dict[str, Any]) -> None: ...
    def _on_control(self, frame: Frame, message: Dict[str, Any], pipe: int) -> bool: ...
    def _accept(self, frames: List[Frame], pipe: int) -> Optional[List[Tuple[Frame, List[Callable[[Any], Any]]]]]: ...
    def _auth_failed(self, remote: str) -> None: ...
    def _resumed(self) -> None: ...


class Inbox:
    """Listens at ``listen`` (None: ipc in a private temporary directory) for ``router``, whose incarnation
    is ``incarnation``; see the module docstring. :attr:`address` is where it listens (a port of 0 filled in)."""

    def __init__(self, router: _Router, incarnation: bytes, listen: Optional[str], *, decode: Callable[..., Any],
                 max_connections: int, max_pending_bytes: int, auth_timeout_s: float, max_backlog_bytes: int,
                 log: RateLimitedLog) -> None:
        self._router, self._inc, self._decode, self._log = router, incarnation, decode, log
        self.max_backlog_bytes = max_backlog_bytes
        self._lock = threading.Lock()
        self._has_room = threading.Condition(self._lock)
        self._backlog: Deque[Tuple[Any, List[Tuple[Frame, List[Callable[[Any], Any]]]], int]] = collections.deque()
        self._backlog_bytes = 0
        self.stalled = False
        self._closing = False
        node_id = router.node_id
        self._tmpdir: Optional[str] = None
        if listen is None:
            self._tmpdir = tempfile.mkdtemp(prefix="conveyor-router-")
            listen = f"ipc://{self._tmpdir}/{node_id.replace('/', '_')}.ipc"
        try:
            check_ipc_address(listen, f"Router {node_id!r} cannot listen")
        except OSError:
            self._remove_tmpdir()
            raise
        recv_max = 2 * router.max_message_size
        self.guard = PipeGuard(max_connections, max(1, max_pending_bytes // recv_max), auth_timeout_s,
                               router._count, log, node_id)
        try:
            self._sock = pynng.Pull0(recv_max_size=recv_max)
        except pynng.NNGException as e:
            self._remove_tmpdir()
            raise nng_os_error(f"Router {node_id!r} cannot open its inbox", e) from None
        self._sock.add_pre_pipe_connect_cb(self.guard.opened)
        self._sock.add_post_pipe_remove_cb(self.guard.closed)
        try:
            listener = self._sock.listen(listen)
        except pynng.AddressInUse:
            self.close_socket()
            raise OSError(errno.EADDRINUSE, f"Router {node_id!r} cannot listen on {listen}: the address is already "
                                            f"in use (another run or process holds it); choose another port or "
                                            f"path, or stop that process") from None
        except pynng.NNGException as e:
            self.close_socket()
            raise nng_os_error(f"Router {node_id!r} cannot listen on {listen}", e) from None
        parts = urlsplit(listen)
        self.handshakes: Optional[HandshakeGuard] = None
        if parts.scheme.startswith("tcp"):
            port = socket.ntohs(listener.local_address.port)  # pynng gives it in network byte order
            if parts.port == 0:
                listen = f"{parts.scheme}://{parts.netloc.rsplit(':', 1)[0]}:{port}"
            waiting = max(1, min(max_connections, soft_fd_limit() // 8))  # room for honest links, files, logs
            self.handshakes = HandshakeGuard(port, self.guard.remote_ports, max_waiting=waiting,
                                             timeout_s=auth_timeout_s, count=router._count, log=log, name=node_id)
        self.address = listen
        self._ipc_path = parts.path if listen.startswith("ipc://") else None
        self.threads = [threading.Thread(target=fn, name=f"conveyor-router-{what}-{node_id}", daemon=True)
                        for what, fn in (("recv", self._receive_loop), ("deliver", self._deliver_loop))]

    def start(self) -> None:
        """Start receiving (once the router knows its own address)."""
        for thread in self.threads:
            thread.start()
        if self.handshakes is not None:
            self.handshakes.start()

    @property
    def backlog_bytes(self) -> int:
        """Bytes received and accepted, not yet delivered."""
        return self._backlog_bytes

    # --- the receive thread ------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while True:
            try:
                msg = self._sock.recv_msg()
            except pynng.Closed:
                return
            except Exception as e:
                if self._closing:
                    return
                self.error("recv", e)
                continue
            try:
                self._handle(msg)
            except Exception as e:  # a bug or an input nobody foresaw: count it, keep receiving
                self.error("handle", e)

    def error(self, where: str, error: BaseException) -> None:
        """Count an unexpected exception in ``receive_errors``; log its kind at most once a minute."""
        self._router._count("receive_errors")
        self._log.log(f"{where}:{type(error).__name__}", "router %s: %s: %s: %s", self._router.node_id, where,
                      type(error).__name__, error)

    def _handle(self, msg: Any) -> None:
        """Check one received batch and hand it to the router, or queue its messages for delivery. Its connection
        counts as a peer's (:meth:`PipeGuard.authenticated`) once the router took a message from it: not for a replay."""
        router = self._router
        view = memoryview(msg._buffer)  # pynng's view of the nng message: no copy until decoding
        try:
            frames = open_batch(router.secret, view, router.max_message_size, self._inc)
        except VersionError as e:  # not another secret: say what it is
            router._count("rejected_auth")
            return self._log.log("version", "router %s: refused a message from %s: %s", router.node_id,
                                 _remote(msg.pipe) if msg.pipe is not None else "?", e)
        except OversizeError:
            return router._count("rejected_size")
        except ReplayError:
            return router._count("rejected_replay")
        except AuthError:
            router._count("rejected_auth")
            return router._auth_failed(_remote(msg.pipe) if msg.pipe is not None else "?")
        except MalformedFrame:
            return router._count("malformed")
        pipe = msg.pipe.id if msg.pipe is not None else -1  # the connection it came through (-1: none known)
        frame = frames[0]
        if len(frames) > 1 and any(f.topic == CONTROL_TOPIC for f in frames):
            return router._count("malformed")  # ours travel alone
        if frame.topic == CONTROL_TOPIC:
            message = control_message(frame)
            if message is None:
                return router._count("malformed")
            if frame.receiver_incarnation == HELLO:
                return router._on_hello(frame, message) if message["kind"] == "state" else router._count("malformed")
            if router._on_control(frame, message, pipe):
                self.guard.authenticated(msg.pipe)
            return
        if frame.receiver_incarnation == HELLO:
            return router._count("malformed")  # a hello carries our state only: nothing else is replayable
        accepted = router._accept(frames, pipe)
        if accepted is None:
            return
        self.guard.authenticated(msg.pipe)
        deliveries = [(f, handlers) for f, handlers in accepted if handlers]
        if deliveries:
            self._queue(msg, deliveries, len(view))

    def _queue(self, msg: Any, deliveries: List[Tuple[Frame, List[Callable[[Any], Any]]]], size: int) -> None:
        with self._lock:
            stalled = False
            while self._backlog and self._backlog_bytes + size > self.max_backlog_bytes and not self._closing:
                self.stalled = stalled = True  # handlers are behind: wait for room, judging no peer meanwhile
                self._has_room.wait(self._router.heartbeat_s)
            self.stalled = False
            self._backlog.append((msg, deliveries, size))
            self._backlog_bytes += size
            self._has_room.notify_all()
        if stalled:
            self._router._resumed()

    # --- the delivery thread -----------------------------------------------------------------------
    def _deliver_loop(self) -> None:
        """Decode queued messages and call their handlers, in arrival order, off the receive thread."""
        router = self._router
        while True:
            with self._lock:
                while not self._backlog and not self._closing:
                    self._has_room.wait()
                if self._closing:
                    return
                msg, deliveries, size = self._backlog[0]
            try:
                decoded = [(self._decoded(frame), handlers) for frame, handlers in deliveries]
            finally:  # every payload is out of nng's message now, which is freed
                with self._lock:
                    self._backlog.popleft()
                    self._backlog_bytes -= size
                    self._has_room.notify_all()
                del msg, deliveries
            for payload, handlers in decoded:
                if payload is _UNDECODABLE:
                    continue
                for fn in handlers:
                    try:
                        fn(payload)
                    except Exception:
                        router._count("handler_errors")
                        self._log.logger.exception("router %s: handler %r raised", router.node_id, fn)

    def _decoded(self, frame: Frame) -> Any:
        """The payload of ``frame``, copied out of the received buffer; ``_UNDECODABLE`` (counted) if it is not one."""
        try:
            return self._decode(frame.payload, copy=True)
        except Exception as e:
            self._router._count("malformed")
            self._log.log(f"decode {frame.topic}", "router %s: cannot decode a message on %r from %s: %s",
                          self._router.node_id, frame.topic, frame.sender, e)
            return _UNDECODABLE

    # --- closing -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop both threads, drop what was not delivered, close the socket (the ipc file goes with it)."""
        with self._lock:
            self._closing = True
            self._has_room.notify_all()
        if self.handshakes is not None:
            self.handshakes.close()
        close_socket(self._sock)
        for thread in self.threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=5)
        self._backlog.clear()
        self.close_socket()

    def close_socket(self) -> None:
        close_socket(self._sock)
        path = getattr(self, "_ipc_path", None)
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass
        self._remove_tmpdir()

    def _remove_tmpdir(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


def control_message(frame: Frame) -> Optional[Dict[str, Any]]:
    """The router's own message in ``frame`` if it is well formed, else None."""
    if sum(len(p) for p in frame.payload) > _MAX_CONTROL_BYTES:
        return None
    try:
        message = _codec.decode(frame.payload, copy=True)
        if message["kind"] == "state":
            if not (isinstance(message["address"], str) and all(isinstance(t, str) for t in message["topics"])
                    and all(isinstance(h, str) for h in message["heard"])):
                return None
        elif message["kind"] != "bye":
            return None
    except Exception:
        return None
    return message


UNIX_SOCKET_PATH_MAX = 107
"""Bytes in the longest path a Unix socket takes on Linux (``sockaddr_un.sun_path`` holds 108 with its NUL)."""


def check_ipc_address(url: str, what: str) -> None:
    """Refuse in one line an ``ipc://`` address whose path no Unix socket takes (nng says only 'Address
    invalid', or a dialer retries it for ever)."""
    if url.startswith("ipc://"):
        size = len(os.fsencode(url[len("ipc://"):]))
        if size > UNIX_SOCKET_PATH_MAX:
            raise OSError(errno.ENAMETOOLONG, f"{what}: the path of {url} is {size} bytes, more than the "
                                              f"{UNIX_SOCKET_PATH_MAX} a Unix socket takes; use a shorter folder "
                                              f"(the address given, or $TMPDIR for a run's own) or tcp")


def soft_fd_limit() -> int:
    """The file descriptors this process may open (``ulimit -n``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def nng_os_error(what: str, error: Exception) -> OSError:
    """A one-line OSError for a failed nng call; running out of file descriptors names the limit."""
    if "file" in str(error).lower():
        return OSError(errno.EMFILE, f"{what}: out of file descriptors (this process may open {soft_fd_limit()}, "
                                     f"`ulimit -n`); raise the limit, or run fewer nodes or connections per process")
    return OSError(f"{what}: {error}")
