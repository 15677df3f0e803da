"""The router: topic messages between nodes over nng, authenticated per link, replay-proof, with membership.

Design (one socket per pattern, as nng's examples keep them):

- Every node binds one ``Pull0`` socket, its inbox, at ``listen``; a receive thread reads it and a
  delivery thread decodes payloads and calls the handlers, so a large message or a slow handler never
  delays the messages that keep peers alive.
- For every peer it holds one ``Push0`` socket dialing that peer's inbox (a *link*). Peers named in
  ``peers`` are dialed at once; a node that hears from a peer it has no link to dials back the address
  that peer announces, so a star (collectors given the learner's address) becomes two-way by itself.

Why Push/Pull and not one Bus0 or Pair1-polyamorous socket: both of those drop a message silently when
the peer's queue is full (best effort, no back-pressure), so a fast publisher would lose trajectories;
Bus0 also floods every peer. A Push0 link has back-pressure (a send waits, at most ``send_timeout_s``,
for a slow receiver) and reaches exactly one peer, so a message goes only to the peers that subscribed
to its topic, and each link's messages arrive in order.

Trust (:mod:`~conveyor.engine.parallel.frame` has the message format). Each router draws a random
*incarnation* when it starts. A message is tagged with a key derived from the shared secret and the
incarnations of its sender and its receiver, so it only authenticates at the receiver incarnation it
was sealed for. The handshake, per pair of nodes: a node that does not know a peer's incarnation sends
it a *hello* (its state, sealed for "anyone": replayable, so it makes nothing live and delivers nothing);
the peer answers with its state sealed for the hello's incarnation, which proves the answer is fresh;
from then on both seal everything for each other's incarnation. A peer whose genuine (freshly keyed)
state comes from a new incarnation has restarted: the old one is lost and *retired*, so its recorded
messages are refused. Within an incarnation, link counters are checked against a :class:`ReplayWindow`.
Refusals are counted: ``rejected_size``, ``rejected_auth``, ``rejected_replay``, ``malformed``.

Membership: a node's *state* (advertised address, subscribed topics, the ids of the peers it has heard)
goes on each link as soon as the link connects, whenever it changes, and every ``heartbeat_s``. Any
authentic message refreshes the sender's liveness; one silent for ``peer_timeout_s`` is declared dead,
its subscriptions dropped and the :meth:`Router.on_peer_lost` callbacks called. Two faster paths need no
timeout: a closing router says goodbye, and a link whose connection closes (the peer's process died)
loses its peer at once. A lost peer that speaks again is live again. A peer is *ready*
(:meth:`Router.wait_for_peers`) when its state lists this node among those it heard. Messages are
numbered per (sender, topic): gaps count as ``lost``, repeats as ``duplicated``.

Bounds: nng refuses a message over twice ``max_message_size`` (dropping that connection); the inbox
admits ``max_connections`` connections, of which only as many not yet authenticated as keep their
partial messages under ``max_pending_bytes``, each for at most ``auth_timeout_s``; the delivery queue
holds at most ``max_backlog_bytes`` (the receive thread waits for room, and judges no peer silent while
it waits). No input ends the receive loop: every exception there is counted in ``receive_errors`` and
logged at most once per kind per minute.

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

import collections
import ipaddress
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple
from urllib.parse import urlsplit

import pynng

from conveyor.engine.parallel import codec as _codec
from conveyor.engine.parallel.frame import HELLO, Frame, generate_secret, new_incarnation, pack, sign
from conveyor.engine.parallel.guard import RateLimitedLog, ReplayWindow
from conveyor.engine.parallel.inbox import CONTROL_TOPIC, Inbox, nng_os_error

__all__ = ["CONTROL_TOPIC", "Router"]

log = logging.getLogger(__name__)

_SEND_BUFFER = 8  # messages a link queues before a send waits: room for a heartbeat beside data
_MAX_SEQ_JUMP = 1 << 32  # a sender's seq moves by one per message: a bigger jump is a bad message
_MAX_CANDIDATES = 64  # hellos of incarnations not proven fresh yet, answered until they expire
_RETIRED_PER_NODE = 16  # incarnations of one node id remembered as replaced


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
        self.unproven_since = 0.0  # connected since then with no proven peer behind it (0: not so)
        self.hello_sent = False  # our state, sealed for peer_inc, went out since it connected
        self.dropped_at = 0.0  # when its connection closed, until the control thread judged it (0: not so)
        self.learned = False  # dialed back after a peer's hello, not asked for with connect()
        self.for_hello = False  # dialed for a hello only, not yet for a proven peer: closed when it expires
        self.warned = False  # told that nothing authentic came back from it
        self.peer_id: Optional[str] = None
        self.peer_inc: Optional[bytes] = None  # the proven incarnation of the peer behind it


class _Peer:
    """What this node knows of one incarnation of another node, from its state messages."""

    def __init__(self, node_id: str, address: str, incarnation: bytes) -> None:
        self.node_id, self.address, self.incarnation = node_id, address, incarnation
        self.topics: frozenset = frozenset()
        self.heard: frozenset = frozenset()
        self.last_seen = time.monotonic()
        self.control_seq = -1
        self.alive = False
        self.window = ReplayWindow()
        self.last_seq: Dict[str, int] = {}


class Router:
    """Publishes topic messages to the peers that subscribed to them and delivers theirs to handlers.

    ``secret``: the shared secret (bytes, same on every node), or None for a single-host run (see the
    module docstring). ``listen``: this node's inbox address (None: ipc in a temporary directory).
    ``peers``: inbox addresses to dial. Every timeout is in seconds. ``codec`` encodes payloads
    (default: :mod:`codec`'s; a ``PickleCodec`` opts into pickle on every node). The bounds of the
    receive path (``max_connections``, ``max_pending_bytes``, ``max_backlog_bytes``, ``auth_timeout_s``,
    default ``peer_timeout_s``) are in the module docstring.
    """

    def __init__(self, node_id: str, secret: Optional[bytes] = None, *, listen: Optional[str] = None,
                 peers: Iterable[str] = (), advertise: Optional[str] = None, max_message_size: int = 64 << 20,
                 heartbeat_s: float = 0.5, peer_timeout_s: float = 5.0, send_timeout_s: float = 10.0,
                 codec: Optional[_codec.Codec] = None, max_connections: int = 64,
                 max_pending_bytes: int = 1 << 30, max_backlog_bytes: Optional[int] = None,
                 auth_timeout_s: Optional[float] = None) -> None:
        if not isinstance(node_id, str) or not node_id or node_id.startswith("\x00"):
            raise ValueError(f"Router(node_id={node_id!r}): the node id must be a non-empty string")
        auth_timeout_s = peer_timeout_s if auth_timeout_s is None else auth_timeout_s
        for name, value in (("heartbeat_s", heartbeat_s), ("peer_timeout_s", peer_timeout_s),
                            ("send_timeout_s", send_timeout_s), ("auth_timeout_s", auth_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Router({name}={value!r}): must be a number of seconds > 0")
        if peer_timeout_s <= heartbeat_s:
            raise ValueError(f"Router(peer_timeout_s={peer_timeout_s}) must exceed heartbeat_s={heartbeat_s}, "
                             f"or every peer would be declared dead between two heartbeats")
        for name, value in (("max_message_size", max_message_size), ("max_connections", max_connections),
                            ("max_pending_bytes", max_pending_bytes)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Router({name}={value!r}): must be a positive int")
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
        self.auth_timeout_s = auth_timeout_s
        self._encode = codec.encode if codec is not None else _codec.encode
        self._inc = new_incarnation()

        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._closing = False
        self._closed = False
        self._links: Dict[str, _Link] = {}
        self._peers: Dict[str, _Peer] = {}
        self._retired: Dict[str, Deque[bytes]] = {}
        self._candidates: Dict[Tuple[str, bytes], Tuple[str, float]] = {}  # (node, inc) -> (address, expiry)
        self._auth_failures: Dict[str, int] = {}  # remote address -> messages that failed their tag
        self._topics: Set[str] = set()
        self._handlers: Dict[str, List[Callable[[Any], Any]]] = {}
        self._lost_callbacks: List[Callable[[str], Any]] = []
        self._seq: Dict[str, int] = {}
        self._counter: Dict[bytes, int] = {}  # per receiver incarnation: the next link counter
        self._send_locks: Dict[str, threading.Lock] = {}
        self._counts = dict.fromkeys(("sent", "received", "rejected_auth", "rejected_size", "rejected_replay",
                                      "rejected_connections", "malformed", "lost", "duplicated", "send_timeouts",
                                      "handler_errors", "receive_errors", "peers_lost"), 0)
        self._log = RateLimitedLog(log)
        self._inbox = Inbox(self, self._inc, listen, decode=codec.decode if codec is not None else _codec.decode,
                            max_connections=max_connections, max_pending_bytes=max_pending_bytes,
                            auth_timeout_s=auth_timeout_s, max_backlog_bytes=max_backlog_bytes or 2 * max_message_size,
                            log=self._log)
        self.listen_address = self._inbox.address
        self.address = advertise or self.listen_address
        self._control = threading.Thread(target=self._control_loop, name=f"conveyor-router-ctl-{node_id}", daemon=True)
        self._inbox.start()
        self._control.start()
        for url in peers:
            self.connect(url)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closing

    @property
    def incarnation(self) -> str:
        """This router's incarnation, in hex: drawn afresh by every router, so a restarted node has a new one."""
        return self._inc.hex()

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
            try:
                sock = pynng.Push0(send_timeout=int(self.send_timeout_s * 1000), send_buffer_size=_SEND_BUFFER,
                                   reconnect_time_min=50, reconnect_time_max=int(max(self.heartbeat_s, 0.1) * 1000))
            except pynng.NNGException as e:
                raise nng_os_error(f"Router {self.node_id!r} cannot open a link to {url}", e) from None
            link = self._links[url] = _Link(url, sock)
            link.learned = learned

        def connected(pipe: Any) -> None:
            with self._lock:
                link.connected, link.hello_sent = True, False
                if link.peer_inc is None:  # kept over reconnects: a listener closes unauthenticated connections
                    link.unproven_since = link.unproven_since or time.monotonic()
            self._wake.set()

        def removed(pipe: Any) -> None:
            with self._lock:
                link.dropped_at = time.monotonic()
                link.connected = link.hello_sent = False
                link.peer_inc = None  # whoever answers the reconnect proves itself afresh (it may have restarted)
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
        """Call ``fn(payload)`` on the delivery thread for each message on ``topic``; subscribes to it."""
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
            if (peer.alive and topic in peer.topics and link is not None and link.hello_sent
                    and link.peer_inc == peer.incarnation):
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
            message = pack(topic, seq, self.node_id, frames, self.max_message_size)
            return sum(self._send(link, message, link.peer_inc) for link in links)

    def _send(self, link: _Link, message: bytearray, to: Optional[bytes], block: bool = True,
              count: bool = True) -> bool:
        """Seal ``message`` for incarnation ``to`` (None: a hello) and send it on ``link``."""
        to = HELLO if to is None else to
        with self._lock:
            counter = self._counter.get(to, 0)
            self._counter[to] = counter + 1
        sign(message, self.secret, self._inc, to, counter)
        try:
            link.sock.send(pynng.ffi.from_buffer(message), block=block)  # nng copies it: no bytes() of our own
        except pynng.Timeout:
            if count:
                self._count("send_timeouts")
                self._log.log(f"send-timeout {link.url}", "router %s: a send to %s timed out after %ss; message "
                              "dropped", self.node_id, link.url, self.send_timeout_s)
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
        return (peer.alive and self.node_id in peer.heard and link is not None and link.hello_sent
                and link.peer_inc == peer.incarnation)

    def wait_for_peers(self, n: int, timeout: float) -> List[str]:
        """Block until ``n`` peers are ready; returns their ids. ``TimeoutError`` naming who is missing, at once
        (after ``auth_timeout_s``) where an address we dialed answers nothing authentic: another secret."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                ready = [p.node_id for p in self._peers.values() if self._ready(p)]
                if len(ready) >= n:
                    return sorted(ready)
                now = time.monotonic()
                left = deadline - now
                unanswered = sorted(url for url, link in self._links.items()
                                    if not link.learned and self._unanswered(link, now))
                if unanswered:
                    raise TimeoutError(self._no_answer(", ".join(unanswered)))
                if left <= 0 or self._closing:
                    break
                self._changed.wait(min(left, self.heartbeat_s))
            heard = sorted(p.node_id for p in self._peers.values() if p.alive and not self._ready(p))
            silent = sorted(url for url, link in self._links.items() if link.peer_inc is None)
            failed = sorted(self._auth_failures)
        raise TimeoutError(f"router {self.node_id!r}: {len(ready)} of {n} peers ready after {timeout}s "
                           f"(ready: {sorted(ready)}; heard but not yet knowing us: {heard}; dialed, nothing "
                           f"authentic heard from: {silent}; failed authentication: {failed}); check that those "
                           f"nodes run, use the same secret, and are given this node's address {self.address}")

    def _unanswered(self, link: _Link, now: float) -> bool:
        """Whether ``link`` has been connected for over ``auth_timeout_s`` with nothing authentic back."""
        return bool(link.unproven_since) and now - link.unproven_since > self.auth_timeout_s

    def _no_answer(self, urls: str) -> str:
        return (f"router {self.node_id!r}: connected to {urls} for over {self.auth_timeout_s}s and nothing authentic "
                f"came back: the node there uses another secret than this one (check --secret-file / "
                f"$CONVEYOR_SECRET on both hosts), or is not a Conveyor node")

    def _state(self) -> bytearray:
        with self._lock:
            state = {"kind": "state", "address": self.address, "topics": sorted(self._topics),
                     "heard": sorted(p.node_id for p in self._peers.values() if p.alive)}
            seq = self._seq.get(CONTROL_TOPIC, -1) + 1
            self._seq[CONTROL_TOPIC] = seq
        return pack(CONTROL_TOPIC, seq, self.node_id, _codec.encode(state))

    def _control_loop(self) -> None:
        last_beat = 0.0
        while not self._closing:
            woken = self._wake.wait(self.heartbeat_s)
            self._wake.clear()
            if self._closing:
                return
            try:
                now = time.monotonic()
                beat = now - last_beat >= self.heartbeat_s * 0.9
                if woken or beat:
                    self._announce()
                    if beat:
                        last_beat = now
                self._check_timeouts()
                self._inbox.guard.expire()
            except Exception as e:  # a bug here must not stop the heartbeats
                self._inbox.error("control", e)

    def _announce(self) -> None:
        """Send our state on every connected link: sealed for the proven peer behind it, and for each fresh
        hello heard from that address; a hello of our own where nobody is known yet."""
        now = time.monotonic()
        with self._lock:
            self._candidates = {k: v for k, v in self._candidates.items() if v[1] > now}
            wanted = {address for address, _ in self._candidates.values()}
            targets, stale = [], []
            for url, link in list(self._links.items()):
                if link.for_hello and url not in wanted:
                    stale.append(self._links.pop(url))  # dialed back for a hello never proven fresh
                    continue
                if not link.warned and self._unanswered(link, now):
                    link.warned = True
                    log.warning("%s", self._no_answer(url))
                if not link.connected:
                    continue
                incs = [inc for (_, inc), (address, _) in self._candidates.items()
                        if address == url and inc != link.peer_inc]
                targets.append((link, [link.peer_inc] if link.peer_inc is not None else [], incs))
        for link in stale:
            link.sock.close()  # outside the lock: nng runs the link's callbacks, which take it, before returning
        for link, proven, others in targets:
            for to in proven + others or [None]:
                ok = self._send(link, self._state(), to, block=False, count=False)
                if ok and proven and to == proven[0]:
                    with self._lock:
                        link.hello_sent = link.connected and link.peer_inc == to
                        self._changed.notify_all()

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._inbox.stalled:  # our receive thread is behind: silence is ours, not theirs
                return
            dead = [(p, f"silent for {self.peer_timeout_s}s") for p in self._peers.values()
                    if p.alive and now - p.last_seen > self.peer_timeout_s]
            # a connection that closed is a loss once a goodbye sent before it could have been read (it goes
            # through the inbox, the closing is seen on the link): half a heartbeat later
            dropped = {url for url, link in self._links.items()
                       if link.dropped_at and now - link.dropped_at >= self.heartbeat_s / 2}
            for url in dropped:
                self._links[url].dropped_at = 0.0
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

    def _on_hello(self, frame: Frame, message: Dict[str, Any]) -> None:
        """A hello: remember its incarnation as a candidate to answer (sealed for it) until it expires."""
        sender, inc = frame.sender, frame.sender_incarnation
        with self._lock:
            if inc in self._retired.get(sender, ()):
                self._counts["rejected_replay"] += 1
                return
            if len(self._candidates) >= _MAX_CANDIDATES and (sender, inc) not in self._candidates:
                self._candidates.pop(next(iter(self._candidates)))
            self._candidates[(sender, inc)] = (message["address"], time.monotonic() + self.auth_timeout_s)
            known = message["address"] in self._links
        if not known:
            self._dial_back(message["address"], None)
        self._wake.set()

    def _dial_back(self, address: str, inc: Optional[bytes]) -> None:
        """Dial the address a peer announced (learned: closed again if it never proves fresh)."""
        try:
            self._connect(address, learned=True)
        except (ValueError, OSError) as e:
            self._count("malformed")
            return self._log.log(f"dial {address}", "router %s: not dialing %s: %s", self.node_id, address, e)
        with self._lock:
            link = self._links.get(address)
            if link is not None and inc is not None:
                link.peer_inc, link.unproven_since = inc, 0.0
            elif link is not None and link.peer_inc is None and link.peer_id is None:
                link.for_hello = True

    def _on_control(self, frame: Frame, message: Dict[str, Any]) -> None:
        """State or goodbye sealed for us: proof that ``frame``'s incarnation runs now."""
        sender, inc = frame.sender, frame.sender_incarnation
        with self._lock:
            old = self._peers.get(sender)
        if old is not None and old.incarnation != inc:
            if message["kind"] == "bye":
                return
            self._lose(old, "it restarted")  # its callbacks run before the new incarnation is live
            with self._lock:
                self._retired.setdefault(sender, collections.deque(maxlen=_RETIRED_PER_NODE)).append(old.incarnation)
        with self._lock:
            peer = self._peers.get(sender)
            if peer is None or peer.incarnation != inc:
                if message["kind"] == "bye":
                    return
                peer = self._peers[sender] = _Peer(sender, message["address"], inc)
            if not peer.window.accept(frame.counter):
                self._counts["rejected_replay"] += 1
                return
            if frame.seq <= peer.control_seq:
                return  # an older state overtaken by a newer one
            peer.control_seq = frame.seq
            if message["kind"] == "bye":
                new_link = False
            else:
                self._candidates.pop((sender, inc), None)
                was_alive, peer.alive = peer.alive, True
                peer.address = message["address"]
                peer.topics, peer.heard = frozenset(message["topics"]), frozenset(message["heard"])
                peer.last_seen = time.monotonic()
                link = self._links.get(peer.address)
                new_link = link is None
                if link is not None and link.peer_inc != inc:
                    link.peer_inc, link.hello_sent, link.peer_id, link.unproven_since = inc, False, sender, 0.0
                    link.for_hello = False
                self._changed.notify_all()
        if message["kind"] == "bye":
            return self._lose(peer, "it closed")
        if new_link:
            self._dial_back(peer.address, inc)
        if not was_alive or self.node_id not in peer.heard or new_link:
            self._wake.set()  # tell it (again) that we heard it

    # --- what the inbox hands over ------------------------------------------------------------------
    def _accept(self, frame: Frame) -> List[Callable[[Any], Any]]:
        """The handlers to deliver an authentic data message to: none where its sender incarnation is not a
        known peer's, its counter was seen, or its seq is a repeat or an absurd jump (each counted)."""
        with self._lock:
            peer = self._peers.get(frame.sender)
            if peer is None or peer.incarnation != frame.sender_incarnation:
                retired = frame.sender_incarnation in self._retired.get(frame.sender, ())
                self._counts["rejected_replay" if retired else "malformed"] += 1
                return []
            if not peer.window.accept(frame.counter):
                self._counts["rejected_replay"] += 1
                return []
            if peer.alive:
                peer.last_seen = time.monotonic()
            last = peer.last_seq.get(frame.topic, -1)
            if frame.seq <= last:
                self._counts["duplicated"] += 1
                return []
            if frame.seq - last > _MAX_SEQ_JUMP:
                self._counts["malformed"] += 1  # would make every later message of its look old
                return []
            self._counts["lost"] += frame.seq - last - 1 if last >= 0 else 0
            peer.last_seq[frame.topic] = frame.seq
            self._counts["received"] += 1
            return list(self._handlers.get(frame.topic, ()))

    def _auth_failed(self, remote: str) -> None:
        """A message from ``remote`` failed its tag: remember the address for errors, warn once a minute."""
        with self._lock:
            self._auth_failures[remote] = self._auth_failures.get(remote, 0) + 1
            if len(self._auth_failures) > 64:
                self._auth_failures.pop(next(iter(self._auth_failures)))
        self._log.log("auth", "router %s: a message from %s failed authentication: the node there uses another "
                      "secret (check --secret-file / $CONVEYOR_SECRET on both hosts), or is not a Conveyor node",
                      self.node_id, remote)

    def _resumed(self) -> None:
        """The inbox waited for its handlers: its peers' messages queued meanwhile; count them as heard now."""
        with self._lock:
            now = time.monotonic()
            for peer in self._peers.values():
                peer.last_seen = max(peer.last_seen, now - self.heartbeat_s)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> Dict[str, Any]:
        """Counters: ``sent``, ``received``, ``rejected_auth``, ``rejected_size``, ``rejected_replay``,
        ``rejected_connections``, ``malformed``, ``lost``, ``duplicated``, ``send_timeouts``, ``handler_errors``,
        ``receive_errors``, ``peers_lost``; ``peers``: live peer ids; ``connections`` and ``pending``: the
        inbox's connections now, and those not authenticated yet; ``backlog_bytes``: received, not yet delivered."""
        with self._lock:
            return {**self._counts, "peers": sorted(p.node_id for p in self._peers.values() if p.alive),
                    **self._inbox.guard.counts(), "backlog_bytes": self._inbox.backlog_bytes}

    # --- closing -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Say goodbye to the peers, stop the threads and close every socket (the ipc file goes with it)."""
        with self._lock:
            if self._closed:
                return
            links = [link for link in self._links.values() if link.hello_sent and link.peer_inc is not None]
            seq = self._seq.get(CONTROL_TOPIC, -1) + 1
        for link in links:  # waiting a little for room: a goodbye dropped on a full link reads as a loss there
            link.sock.send_timeout = int(min(self.heartbeat_s, self.send_timeout_s) * 1000)
            self._send(link, pack(CONTROL_TOPIC, seq, self.node_id, _codec.encode({"kind": "bye"})), link.peer_inc,
                       count=False)
        with self._lock:
            self._closing = self._closed = True
            links = list(self._links.values())
            self._changed.notify_all()
        self._wake.set()
        self._inbox.close()
        if self._control is not threading.current_thread():
            self._control.join(timeout=5)
        for link in links:
            link.sock.close()
