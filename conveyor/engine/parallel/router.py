"""The router: topic messages between nodes over nng, authenticated, sequence-numbered, with membership.

Design (one socket per pattern, as nng's examples keep them):

- Every node binds one ``Pull0`` socket, its inbox, at ``listen``; a receive thread reads it.
- For every peer it holds one ``Push0`` socket dialing that peer's inbox (a *link*). Peers named in
  ``peers`` are dialed at once; a node that hears from a peer it has no link to dials back the address
  that peer announces, so a star (collectors given the learner's address) becomes two-way by itself.

Why Push/Pull and not one Bus0 or Pair1-polyamorous socket: both of those drop a message silently when
the peer's queue is full (best effort, no back-pressure), so a fast publisher would lose trajectories;
Bus0 also floods every peer. A Push0 link has back-pressure (a send waits, at most ``send_timeout_s``,
for a slow receiver) and reaches exactly one peer, so a message goes only to the peers that subscribed
to its topic, and each link's messages arrive in order.

Membership: a node announces its *state* (node id, advertised address, an incarnation nonce, its
subscribed topics, and the ids of the peers it has heard) on each link as soon as the link connects
(the hello, always before any data on that link), whenever it changes (a subscription, a new peer),
and every ``heartbeat_s``. Any authenticated message refreshes the sender's liveness; one silent for
``peer_timeout_s`` is declared dead, its subscriptions dropped and the :meth:`Router.on_peer_lost`
callbacks called. Two faster paths need no timeout: a closing router says goodbye, and a link whose
connection closes (the peer's process died: the kernel closes its sockets, as after SIGKILL) loses its
peer at once. A lost peer that speaks again (a dropped connection that comes back, or a restarted
process under the same id, whose new incarnation starts afresh) is live again. A peer is *ready*
(:meth:`Router.wait_for_peers`) when its state has arrived and lists this node among those it heard:
both ends then know each other and can deliver. A restarted peer (new incarnation) starts afresh.

Every message is sealed with the shared secret (:mod:`~conveyor.engine.parallel.frame`) and numbered
per (sender, topic); the receiver checks its size, then its HMAC, before decoding a byte, counts and
drops what fails (``rejected_size``, ``rejected_auth``, ``malformed``), counts gaps as ``lost`` and drops
repeats or older messages as ``duplicated``. The first message seen on a (sender, topic) sets the count's
start, since a subscriber that joins late has not missed the earlier ones. nng itself refuses a message
over twice ``max_message_size`` (dropping that connection), so no peer can make a node allocate more.

No secret (``secret=None``): the router generates one (:attr:`Router.secret`; a local launcher hands it
to the children it starts, privately) and stays on this host: it listens only on ``ipc://`` or tcp
loopback and dials only such addresses; anything else is refused with the reason. Across hosts every
node must load the same secret (``--secret-file``, ``$CONVEYOR_SECRET``; see :func:`frame.load_secret`).

Addresses: ``listen=None`` listens on ``ipc://`` in a private temporary directory (removed on close);
``tcp://127.0.0.1:0`` takes a port from the OS (:attr:`Router.address` has it). Peers must be given
the address a node advertises (``advertise=``, default its listen address, needed when listening on
``0.0.0.0``).
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple
from urllib.parse import urlsplit

import pynng

from conveyor.engine.parallel import codec as _codec
from conveyor.engine.parallel.frame import (AuthError, MalformedFrame, OversizeError, generate_secret, open_frame,
                                            seal)

__all__ = ["CONTROL_TOPIC", "Router"]

log = logging.getLogger(__name__)

CONTROL_TOPIC = "\x00router"
"""Reserved topic of the router's own state and goodbye messages."""

_SEND_BUFFER = 8  # messages a link queues before a send waits: room for a heartbeat beside data


def is_local_address(url: str) -> bool:
    """Whether ``url`` stays on this host: ``ipc://``, ``inproc://``, or tcp to a loopback address."""
    parts = urlsplit(url)
    if parts.scheme in ("ipc", "inproc"):
        return True
    if not parts.scheme.startswith("tcp"):
        return False
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Link:
    """Our Push0 socket dialing one peer's inbox."""

    def __init__(self, url: str, sock: Any) -> None:
        self.url, self.sock = url, sock
        self.connected = False
        self.hello_sent = False
        self.dropped = False  # its connection closed since the control thread last looked
        self.learned = False  # dialed back after a peer's hello, not asked for with connect()
        self.peer_id: Optional[str] = None


class _Peer:
    """What this node knows of another, from its state messages."""

    def __init__(self, node_id: str, address: str, incarnation: str) -> None:
        self.node_id, self.address, self.incarnation = node_id, address, incarnation
        self.topics: frozenset = frozenset()
        self.heard: frozenset = frozenset()
        self.last_seen = time.monotonic()
        self.control_seq = -1
        self.alive = True


class Router:
    """Publishes topic messages to the peers that subscribed to them and delivers theirs to handlers.

    ``secret``: the shared secret (bytes, same on every node), or None for a single-host run (see the
    module docstring). ``listen``: this node's inbox address (None: ipc in a temporary directory).
    ``peers``: inbox addresses to dial. Every timeout is in seconds. ``codec`` encodes payloads
    (default: :mod:`codec`'s; a ``PickleCodec`` opts into pickle on every node).
    """

    def __init__(self, node_id: str, secret: Optional[bytes] = None, *, listen: Optional[str] = None,
                 peers: Iterable[str] = (), advertise: Optional[str] = None, max_message_size: int = 64 << 20,
                 heartbeat_s: float = 0.5, peer_timeout_s: float = 5.0, send_timeout_s: float = 10.0,
                 codec: Optional[_codec.Codec] = None) -> None:
        if not isinstance(node_id, str) or not node_id or node_id.startswith("\x00"):
            raise ValueError(f"Router(node_id={node_id!r}): the node id must be a non-empty string")
        for name, value in (("heartbeat_s", heartbeat_s), ("peer_timeout_s", peer_timeout_s),
                            ("send_timeout_s", send_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Router({name}={value!r}): must be a number of seconds > 0")
        if peer_timeout_s <= heartbeat_s:
            raise ValueError(f"Router(peer_timeout_s={peer_timeout_s}) must exceed heartbeat_s={heartbeat_s}, "
                             f"or every peer would be declared dead between two heartbeats")
        peers = list(peers)
        self.node_id = node_id
        self.local_only = secret is None
        self.secret = generate_secret() if secret is None else secret
        if self.local_only:
            for url in ([listen] if listen is not None else []) + peers:
                if not is_local_address(url):
                    raise ValueError(f"Router {node_id!r}: refusing {url} without a secret: a node reachable from "
                                     f"other hosts must authenticate them. Give every node the same secret "
                                     f"(--secret-file FILE or $CONVEYOR_SECRET), or use ipc:// or tcp://127.0.0.1")
        self.max_message_size = max_message_size
        self.heartbeat_s, self.peer_timeout_s, self.send_timeout_s = heartbeat_s, peer_timeout_s, send_timeout_s
        self._encode = codec.encode if codec is not None else _codec.encode
        self._decode = codec.decode if codec is not None else _codec.decode
        self.incarnation = secrets.token_hex(8)

        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._closing = False
        self._closed = False
        self._links: Dict[str, _Link] = {}
        self._peers: Dict[str, _Peer] = {}
        self._topics: Set[str] = set()
        self._handlers: Dict[str, List[Callable[[Any], Any]]] = {}
        self._lost_callbacks: List[Callable[[str], Any]] = []
        self._seq: Dict[str, int] = {}
        self._send_locks: Dict[str, threading.Lock] = {}
        self._last_seq: Dict[Tuple[str, str], int] = {}
        self._counts = dict.fromkeys(("sent", "received", "rejected_auth", "rejected_size", "malformed", "lost",
                                      "duplicated", "send_timeouts", "handler_errors", "peers_lost"), 0)
        self._tmpdir: Optional[str] = None
        if listen is None:
            self._tmpdir = tempfile.mkdtemp(prefix="conveyor-router-")
            listen = f"ipc://{self._tmpdir}/{node_id.replace('/', '_')}.ipc"
        self._inbox = pynng.Pull0(recv_max_size=2 * max_message_size)
        try:
            listener = self._inbox.listen(listen)
        except pynng.AddressInUse:
            self._cleanup_sockets()
            raise OSError(errno.EADDRINUSE, f"Router {node_id!r} cannot listen on {listen}: the address is already "
                                            f"in use (another run or process holds it); choose another port or "
                                            f"path, or stop that process") from None
        except pynng.NNGException as e:
            self._cleanup_sockets()
            raise OSError(f"Router {node_id!r} cannot listen on {listen}: {e}") from None
        self.listen_address = listen
        if urlsplit(listen).scheme.startswith("tcp") and urlsplit(listen).port == 0:
            port = socket.ntohs(listener.local_address.port)  # pynng gives it in network byte order
            parts = urlsplit(listen)
            listen = f"{parts.scheme}://{parts.netloc.rsplit(':', 1)[0]}:{port}"
            self.listen_address = listen
        self.address = advertise or self.listen_address
        self._ipc_path = urlsplit(listen).path if listen.startswith("ipc://") else None

        self._receiver = threading.Thread(target=self._receive_loop, name=f"conveyor-router-recv-{node_id}",
                                          daemon=True)
        self._control = threading.Thread(target=self._control_loop, name=f"conveyor-router-ctl-{node_id}",
                                         daemon=True)
        self._receiver.start()
        self._control.start()
        for url in peers:
            self.connect(url)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closing

    def __repr__(self) -> str:
        return f"<Router {self.node_id!r} at {self.address}, peers {self.peers()}>"

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- links -------------------------------------------------------------------------------------
    def connect(self, url: str) -> None:
        """Dial another node's inbox at ``url`` (retried in the background until it answers, also after it was lost)."""
        self._connect(url, learned=False)

    def _connect(self, url: str, learned: bool) -> None:
        if self.local_only and not is_local_address(url):
            raise ValueError(f"Router {self.node_id!r}: refusing to dial {url} without a secret; give every node "
                             f"the same secret (--secret-file FILE or $CONVEYOR_SECRET)")
        with self._lock:
            if self._closing or url in self._links or url == self.address:
                return
            sock = pynng.Push0(send_timeout=int(self.send_timeout_s * 1000), send_buffer_size=_SEND_BUFFER,
                               reconnect_time_min=50, reconnect_time_max=int(max(self.heartbeat_s, 0.1) * 1000))
            link = self._links[url] = _Link(url, sock)
            link.learned = learned

        def connected(pipe: Any) -> None:
            with self._lock:
                link.connected, link.hello_sent = True, False
            self._wake.set()

        def removed(pipe: Any) -> None:
            with self._lock:
                link.dropped = True
                link.connected = link.hello_sent = False
            self._wake.set()  # the control thread loses its peer (nng's thread must not run the callbacks)

        sock.add_post_pipe_connect_cb(connected)
        sock.add_post_pipe_remove_cb(removed)
        sock.dial(url, block=False)

    # --- topics ------------------------------------------------------------------------------------
    def subscribe(self, topic: str) -> None:
        """Ask peers to send this node the messages on ``topic`` (announced to them at once)."""
        self._check_topic(topic)
        with self._lock:
            if topic in self._topics:
                return
            self._topics.add(topic)
        self._wake.set()

    def on(self, topic: str, fn: Callable[[Any], Any]) -> None:
        """Call ``fn(payload)`` on the receive thread for each message on ``topic``; subscribes to it."""
        if not callable(fn):
            raise TypeError(f"router.on({topic!r}, fn): fn must be callable, got {fn!r}")
        self._check_topic(topic)
        with self._lock:
            self._handlers.setdefault(topic, []).append(fn)
        self.subscribe(topic)

    def topics(self) -> List[str]:
        """The topics this node subscribes to (announced to its peers)."""
        with self._lock:
            return sorted(self._topics)

    def off(self, topic: str, fn: Callable[[Any], Any]) -> None:
        """Remove a handler given to :meth:`on`; the last one of a topic unsubscribes from it (announced at once)."""
        with self._lock:
            handlers = self._handlers.get(topic, [])
            if fn in handlers:
                handlers.remove(fn)
            if handlers or topic not in self._topics:
                return
            self._handlers.pop(topic, None)
            self._topics.discard(topic)
        self._wake.set()

    def on_peer_lost(self, fn: Callable[[str], Any]) -> None:
        """Call ``fn(node_id)`` (on the router's control thread) when a peer is declared dead, its connection
        closes or it says goodbye."""
        if not callable(fn):
            raise TypeError(f"router.on_peer_lost(fn): fn must be callable, got {fn!r}")
        with self._lock:
            self._lost_callbacks.append(fn)

    def off_peer_lost(self, fn: Callable[[str], Any]) -> None:
        """Remove a callback given to :meth:`on_peer_lost`."""
        with self._lock:
            if fn in self._lost_callbacks:
                self._lost_callbacks.remove(fn)

    def subscribers(self, topic: str) -> List[str]:
        """Ids of the live peers subscribed to ``topic`` that :meth:`publish` can reach now."""
        with self._lock:
            return sorted(link.peer_id for link in self._subscribed_links(topic))

    def _subscribed_links(self, topic: str) -> List[_Link]:
        links = []
        for peer in self._peers.values():
            link = self._links.get(peer.address)
            if peer.alive and topic in peer.topics and link is not None and link.hello_sent:
                link.peer_id = peer.node_id
                links.append(link)
        return links

    def wait_for_subscribers(self, topic: str, n: int, timeout: float) -> List[str]:
        """Block until ``n`` live peers subscribed to ``topic`` can be reached; returns their ids, or raises
        ``TimeoutError``. Publish after this when the first messages matter."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = sorted(link.peer_id for link in self._subscribed_links(topic))
                left = deadline - time.monotonic()
                if len(found) >= n or left <= 0 or self._closing:
                    break
                self._changed.wait(left)
        if len(found) < n:
            raise TimeoutError(f"router {self.node_id!r}: {len(found)} of {n} peers subscribed to {topic!r} after "
                               f"{timeout}s (subscribed: {found}; live peers: {self.peers()})")
        return found

    def publish(self, topic: str, payload: Any) -> int:
        """Send ``payload`` to every live peer subscribed to ``topic``; returns how many it was handed to.

        A send waits at most ``send_timeout_s`` for a slow peer; one that times out is counted in
        ``send_timeouts`` and skipped. Raises ``OversizeError`` for a message over ``max_message_size``.
        """
        self._check_topic(topic)
        frames = self._encode(payload)
        with self._lock:
            if self._closing:
                raise RuntimeError(f"router {self.node_id!r} is closed")
            links = self._subscribed_links(topic)
            if not links:
                return 0
            send_lock = self._send_locks.setdefault(topic, threading.Lock())
        with send_lock:  # seq order is send order on every link
            seq = self._seq.get(topic, -1) + 1
            self._seq[topic] = seq
            data = seal(self.secret, topic, seq, self.node_id, frames, self.max_message_size)
            return sum(self._send(link, data) for link in links)

    def _send(self, link: _Link, data: bytes, block: bool = True, count: bool = True) -> bool:
        try:
            link.sock.send(data, block=block)
        except pynng.Timeout:
            self._count("send_timeouts")
            log.warning("router %s: a send to %s timed out after %ss; message dropped", self.node_id, link.url,
                        self.send_timeout_s)
            return False
        except (pynng.TryAgain, pynng.Closed):
            return False
        if count:
            self._count("sent")
        return True

    @staticmethod
    def _check_topic(topic: str) -> None:
        if not isinstance(topic, str) or not topic or topic.startswith("\x00"):
            raise ValueError(f"topic {topic!r}: must be a non-empty string not starting with NUL")

    # --- membership --------------------------------------------------------------------------------
    def peers(self) -> List[str]:
        """Ids of the live peers (those heard from within ``peer_timeout_s``)."""
        with self._lock:
            return sorted(p.node_id for p in self._peers.values() if p.alive)

    def ready_peers(self) -> List[str]:
        """Live peers that know this node too (the handshake is complete both ways)."""
        with self._lock:
            return sorted(p.node_id for p in self._peers.values() if self._ready(p))

    def _ready(self, peer: _Peer) -> bool:
        link = self._links.get(peer.address)
        return peer.alive and self.node_id in peer.heard and link is not None and link.hello_sent

    def wait_for_peers(self, n: int, timeout: float) -> List[str]:
        """Block until ``n`` peers are ready; returns their ids. ``TimeoutError`` naming who is missing."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                ready = [p.node_id for p in self._peers.values() if self._ready(p)]
                if len(ready) >= n:
                    return sorted(ready)
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    break
                self._changed.wait(left)
            heard = sorted(p.node_id for p in self._peers.values() if p.alive and not self._ready(p))
            known = {p.address for p in self._peers.values()}
            silent = sorted(url for url in self._links if url not in known)
        raise TimeoutError(f"router {self.node_id!r}: {len(ready)} of {n} peers ready after {timeout}s "
                           f"(ready: {sorted(ready)}; heard but not yet knowing us: {heard}; dialed, never "
                           f"heard from: {silent}); check that those nodes run, use the same secret, and are "
                           f"given this node's address {self.address}")

    def _state(self) -> bytes:
        with self._lock:
            state = {"kind": "state", "address": self.address, "incarnation": self.incarnation,
                     "topics": sorted(self._topics), "heard": sorted(p.node_id for p in self._peers.values() if p.alive)}
            seq = self._seq.get(CONTROL_TOPIC, -1) + 1
            self._seq[CONTROL_TOPIC] = seq
        return seal(self.secret, CONTROL_TOPIC, seq, self.node_id, _codec.encode(state))

    def _control_loop(self) -> None:
        last_beat = 0.0
        while not self._closing:
            woken = self._wake.wait(self.heartbeat_s)
            self._wake.clear()
            if self._closing:
                return
            now = time.monotonic()
            with self._lock:
                links = [link for link in self._links.values() if link.connected]
            beat = now - last_beat >= self.heartbeat_s * 0.9
            if woken or beat:
                data = self._state()
                for link in links:
                    if self._send(link, data, block=False, count=False):
                        with self._lock:
                            link.hello_sent = link.connected
                            self._changed.notify_all()
                if beat:
                    last_beat = now
            self._check_timeouts()

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        with self._lock:
            dead = [(p, f"silent for {self.peer_timeout_s}s") for p in self._peers.values()
                    if p.alive and now - p.last_seen > self.peer_timeout_s]
            dropped = {url for url, link in self._links.items() if link.dropped}
            for url in dropped:
                self._links[url].dropped = False
            dead += [(p, "its connection closed") for p in self._peers.values()
                     if p.alive and p.address in dropped and not self._links[p.address].connected]
        for peer, why in dead:
            self._lose(peer, why)

    def _lose(self, peer: _Peer, why: str) -> None:
        with self._lock:
            if not peer.alive:
                return
            peer.alive = False
            peer.topics = frozenset()
            self._counts["peers_lost"] += 1
            self._changed.notify_all()
            link = self._links.get(peer.address)
            if link is not None and link.learned:  # its hello makes us dial again if it comes back
                del self._links[peer.address]
            callbacks = list(self._lost_callbacks)
        if link is not None and link.learned:
            link.sock.close()
        log.log(logging.INFO if why == "it closed" else logging.WARNING, "router %s: peer %s lost (%s)",
                self.node_id, peer.node_id, why)
        for fn in callbacks:
            try:
                fn(peer.node_id)
            except Exception:
                log.exception("router %s: an on_peer_lost callback raised", self.node_id)
        self._wake.set()  # our "heard" list changed

    def _on_control(self, sender: str, seq: int, message: Dict[str, Any]) -> None:
        with self._lock:
            old = self._peers.get(sender)
        if old is not None and old.alive and message["kind"] == "state" and old.incarnation != message["incarnation"]:
            self._lose(old, "it restarted")  # its callbacks run before the new incarnation is live
        with self._lock:
            peer = self._peers.get(sender)
            if message["kind"] == "bye":
                if peer is None or seq <= peer.control_seq:
                    return
                peer.control_seq = seq
            else:
                if peer is None or peer.incarnation != message["incarnation"]:
                    for key in [k for k in self._last_seq if k[0] == sender]:  # restarted: seq starts again
                        del self._last_seq[key]
                    peer = self._peers[sender] = _Peer(sender, message["address"], message["incarnation"])
                    peer.alive = False
                elif seq <= peer.control_seq:
                    self._counts["duplicated"] += 1
                    return
                peer.control_seq = seq
                was_alive, peer.alive = peer.alive, True
                peer.address = message["address"]
                peer.topics, peer.heard = frozenset(message["topics"]), frozenset(message["heard"])
                peer.last_seen = time.monotonic()
                new_link = peer.address not in self._links
                self._changed.notify_all()
        if message["kind"] == "bye":
            return self._lose(peer, "it closed")
        if new_link:
            self._connect(peer.address, learned=True)
        if not was_alive or self.node_id not in peer.heard:
            self._wake.set()  # tell it (again) that we heard it

    # --- receiving ---------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while True:
            try:
                data = self._inbox.recv()
            except pynng.Closed:
                return
            except pynng.NNGException:
                if self._closing:
                    return
                continue
            try:
                self._handle(data)
            except Exception:  # a bug here must not stop the node from receiving
                log.exception("router %s: handling a message failed", self.node_id)

    def _handle(self, data: bytes) -> None:
        try:
            frame = open_frame(self.secret, data, self.max_message_size)
        except OversizeError:
            return self._count("rejected_size")
        except AuthError:
            return self._count("rejected_auth")
        except MalformedFrame:
            return self._count("malformed")
        sender, topic, seq = frame.sender, frame.topic, frame.seq
        with self._lock:
            peer = self._peers.get(sender)
            if peer is not None and peer.alive:
                peer.last_seen = time.monotonic()
        if topic == CONTROL_TOPIC:
            try:
                message = _codec.decode(frame.payload)
                if message["kind"] == "state":
                    _ = (str(message["address"]), str(message["incarnation"]), list(message["topics"]),
                         list(message["heard"]))
                elif message["kind"] != "bye":
                    raise ValueError(message["kind"])
            except Exception:
                return self._count("malformed")
            return self._on_control(sender, seq, message)
        with self._lock:
            key = (sender, topic)
            last = self._last_seq.get(key)
            if last is not None and seq <= last:
                self._counts["duplicated"] += 1
                return
            if last is not None and seq > last + 1:
                self._counts["lost"] += seq - last - 1
            self._last_seq[key] = seq
            self._counts["received"] += 1
            handlers = list(self._handlers.get(topic, ()))
        if not handlers:
            return
        try:
            payload = self._decode(frame.payload)
        except Exception:
            log.exception("router %s: cannot decode a message on %r from %s", self.node_id, topic, sender)
            return self._count("malformed")
        for fn in handlers:
            try:
                fn(payload)
            except Exception:
                self._count("handler_errors")
                log.exception("router %s: handler %r for topic %r raised", self.node_id, fn, topic)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> Dict[str, Any]:
        """Counters: ``sent``, ``received``, ``rejected_auth``, ``rejected_size``, ``malformed``, ``lost``,
        ``duplicated``, ``send_timeouts``, ``handler_errors``, ``peers_lost``; ``peers``: live peer ids."""
        with self._lock:
            return {**self._counts, "peers": sorted(p.node_id for p in self._peers.values() if p.alive)}

    # --- closing -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Say goodbye to the peers, stop both threads and close every socket (the ipc file goes with it)."""
        with self._lock:
            if self._closed:
                return
            self._closing = self._closed = True
            links = list(self._links.values())
            self._changed.notify_all()
        bye = seal(self.secret, CONTROL_TOPIC, self._seq.get(CONTROL_TOPIC, -1) + 1, self.node_id,
                   _codec.encode({"kind": "bye"}))
        for link in links:
            if link.hello_sent:
                self._send(link, bye, block=False, count=False)
        self._wake.set()
        self._inbox.close()
        self._receiver.join(timeout=5)
        self._control.join(timeout=5)
        for link in links:
            link.sock.close()
        self._cleanup_sockets()

    def _cleanup_sockets(self) -> None:
        self._inbox.close() if hasattr(self, "_inbox") else None
        path = getattr(self, "_ipc_path", None)
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
