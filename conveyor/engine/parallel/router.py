"""The router: topic messages between nodes over nng, authenticated per link, replay-proof, with membership.

Design (one socket per pattern, as nng's examples keep them):

- Every node binds one ``Pull0`` socket, its inbox, at ``listen``; a receive thread reads it and a
  delivery thread decodes payloads and calls the handlers, so a large message or a slow handler never
  delays the messages that keep peers alive.
- For every peer it holds one ``Push0`` socket dialing that peer's inbox (a *link*). Peers named in
  ``peers`` are dialed at once; a node that hears from a peer it has no link to dials back the address
  that peer announces, so a star (collectors given the learner's address) becomes two-way by itself.

Why Push/Pull and not one Bus0 or Pair1-polyamorous socket: both of those drop a message silently when the peer's queue
is full (best effort, no back-pressure), so a fast publisher would lose trajectories; Bus0 also floods every peer. A
Push0 link has back-pressure (a send waits, at most ``send_timeout_s``, for a slow receiver) and reaches exactly one
peer, so a message goes only to the peers that subscribed to its topic, and each link's messages arrive in order.

Batches (:mod:`~conveyor.engine.parallel.outbox` has the queues and their bounds): :meth:`Router.publish` packs a
message once and queues it on each subscribed link; each link's sender thread sends what piled up meanwhile as one
batch (one header, counter, tag and socket send; laid out once, in the nng message that is sent), so many small
messages cost one send and one tag check. A full queue makes publish wait at most ``send_timeout_s``, then drop that
message for that link (``send_timeouts``); ``sent`` counts messages as their batch leaves; :meth:`Router.close`
sends what is queued first. Membership messages skip the queue: their counters may reach a peer out of order with
the batches', which its replay window accepts.

Trust (:mod:`~conveyor.engine.parallel.frame` has the message format). Each router draws a random
*incarnation* when it starts. A message is tagged with a key derived from the shared secret and the
incarnations of its sender and its receiver, so it only authenticates at the receiver incarnation it
was sealed for; a handshake proves each peer's incarnation fresh, and restarted peers' old incarnations
are retired (:mod:`~conveyor.engine.parallel.membership` has the handshake). The secret is shared, so each
incarnation is also bound to the inbox connection it speaks through: another holder of the secret sealing
in its name through another connection is refused. Refusals are counted: ``rejected_size``,
``rejected_auth``, ``rejected_replay``, ``malformed`` (a counter or seq that jumps further than its sender
could have counted, too), ``rejected_foreign_pipe``, ``rejected_impersonation``, ``rejected_peers``.

Membership (:mod:`~conveyor.engine.parallel.membership`): a node's state (address, topics, peers heard) goes to its
peers when it changes and every ``heartbeat_s``. A peer silent for ``peer_timeout_s``, one that says goodbye, and
one whose connection closes is lost: its subscriptions dropped and the :meth:`Router.on_peer_lost` callbacks called.
A peer is *ready* (:meth:`Router.wait_for_peers`) when it has heard this node too. Messages are numbered per
(sender, topic): gaps count as ``lost``, repeats as ``duplicated``.

Bounds: nng refuses a message over twice ``max_message_size`` (dropping that connection); the inbox admits
``max_connections`` connections, of which only as many not yet authenticated as keep their partial messages under
``max_pending_bytes``, each for at most ``auth_timeout_s``; on tcp, connections that have not sent nng's handshake
(which nng holds 10 s unseen) wait in the kernel, and of those it hands nng at most ``max_connections`` (an eighth
of the file descriptor limit, if less) are kept, each for at most ``auth_timeout_s``
(:class:`~conveyor.engine.parallel.guard.HandshakeGuard`); the delivery queue holds at most ``max_backlog_bytes``
(the receive thread waits for room, and judges no peer silent while it waits). No input ends the receive loop: every
exception there is counted in ``receive_errors`` and logged at most once per kind per minute.

No secret (``secret=None``): the router generates one (:attr:`Router.secret`; a local launcher hands it to the children
it starts, privately) and stays on this host: it listens only on ``ipc://`` or tcp loopback and dials only such
addresses; anything else is refused with the reason. Across hosts every node must load the same secret
(``--secret-file``, ``$CONVEYOR_SECRET``; see :func:`frame.load_secret`).

Addresses: ``listen=None`` listens on ``ipc://`` in a private temporary directory (removed on close);
``tcp://127.0.0.1:0`` takes a port from the OS (:attr:`Router.address` has it). Peers must be given the address a
node advertises (``advertise=``, default its listen address, needed when listening on ``0.0.0.0``)."""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

import pynng

from conveyor.engine.parallel import codec as _codec
from conveyor.engine.parallel.frame import HELLO, Frame, batch_parts, generate_secret, new_incarnation, pack, sign
from conveyor.engine.parallel.guard import close_socket
from conveyor.engine.ratelimit import RateLimitedLog
from conveyor.engine.parallel.inbox import CONTROL_TOPIC, Inbox
from conveyor.engine.parallel.membership import PEER_TIMEOUT_S, REJOIN_S, Link, Membership, is_local_address
from conveyor.engine.parallel.nngmsg import Outgoing
from conveyor.engine.parallel.outbox import Outbox

__all__ = ["CONTROL_TOPIC", "Router", "is_local_address"]

log = logging.getLogger(__name__)


class Router:
    """Publishes topic messages to the peers that subscribed to them and delivers theirs to handlers.

    ``secret``: the shared secret (bytes, same on every node), or None for a single-host run (see the
    module docstring). ``listen``: this node's inbox address (None: ipc in a temporary directory).
    ``peers``: inbox addresses to dial. Every timeout is in seconds (``heartbeat_s``: 0.5, or a quarter of a
    ``peer_timeout_s`` under 2). ``codec`` encodes payloads (default: :mod:`codec`'s; a ``PickleCodec`` opts into
    pickle on every node). The bounds of the receive path (``max_connections``, ``max_pending_bytes``,
    ``max_backlog_bytes``, ``auth_timeout_s``, default ``peer_timeout_s``) and ``batch_bytes`` (default 1 MiB, at
    most ``max_message_size``) are in the module docstring. ``rejoin_s``: how long the link to a peer lost with its
    connection open (stopped, cut off) is kept for it to come back, and read what was queued there, before it closes.
    """

    def __init__(self, node_id: str, secret: Optional[bytes] = None, *, listen: Optional[str] = None,
                 peers: Iterable[str] = (), advertise: Optional[str] = None, max_message_size: int = 64 << 20,
                 heartbeat_s: Optional[float] = None, peer_timeout_s: float = PEER_TIMEOUT_S,
                 send_timeout_s: float = 10.0, codec: Optional[_codec.Codec] = None, max_connections: int = 64,
                 max_pending_bytes: int = 1 << 30, max_backlog_bytes: Optional[int] = None, batch_bytes: int = 1 << 20,
                 auth_timeout_s: Optional[float] = None, rejoin_s: float = REJOIN_S) -> None:
        if not isinstance(node_id, str) or not node_id or node_id.startswith("\x00"):
            raise ValueError(f"Router(node_id={node_id!r}): the node id must be a non-empty string")
        auth_timeout_s = peer_timeout_s if auth_timeout_s is None else auth_timeout_s
        if heartbeat_s is None:  # at least four heartbeats before a peer is lost
            heartbeat_s = min(0.5, peer_timeout_s / 4) if isinstance(peer_timeout_s, (int, float)) else 0.5
        for name, value in (("peer_timeout_s", peer_timeout_s), ("heartbeat_s", heartbeat_s), ("rejoin_s", rejoin_s),
                            ("send_timeout_s", send_timeout_s), ("auth_timeout_s", auth_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Router({name}={value!r}): must be a number of seconds > 0")
        if peer_timeout_s <= heartbeat_s:
            raise ValueError(f"Router(peer_timeout_s={peer_timeout_s}) must exceed heartbeat_s={heartbeat_s}, "
                             f"or every peer would be declared dead between two heartbeats")
        for name, value in (("max_message_size", max_message_size), ("max_connections", max_connections),
                            ("max_pending_bytes", max_pending_bytes), ("batch_bytes", batch_bytes)):
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
        self.max_message_size, self.auth_timeout_s, self.rejoin_s = max_message_size, auth_timeout_s, rejoin_s
        self.heartbeat_s, self.peer_timeout_s, self.send_timeout_s = heartbeat_s, peer_timeout_s, send_timeout_s
        self._encode = codec.encode if codec is not None else _codec.encode
        self._inc = new_incarnation()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._closing = False
        self._closed = False
        self._topics: Set[str] = set()
        self._handlers: Dict[str, List[Callable[[Any], Any]]] = {}
        self._seq: Dict[str, int] = {}
        self._counter: Dict[bytes, int] = {}  # per receiver incarnation: the next link counter
        self._send_locks: Dict[str, threading.Lock] = {}
        self._delivering = threading.local()  # the delivery thread: the sender of the message being handled
        self._counts = dict.fromkeys(("sent", "received", "rejected_auth", "rejected_size", "rejected_replay",
                                      "rejected_connections", "malformed", "lost", "duplicated", "send_timeouts",
                                      "handler_errors", "receive_errors", "peers_lost", "rejected_peers",
                                      "rejected_foreign_pipe", "rejected_impersonation", "sent_batches"), 0)
        self._log = RateLimitedLog(log)
        self._members = Membership(self, self._lock, self._changed, self._wake, self._log)
        batch_bytes = min(batch_bytes, max_message_size)  # a batch is one message to its receiver
        self._outbox = Outbox(self._send_batch, max_bytes=2 * batch_bytes, batch_bytes=batch_bytes,
                              timeout_s=send_timeout_s, log=self._log, name=node_id)
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

    @property
    def sender(self) -> Optional[str]:
        """Inside a handler given to :meth:`on`: the node id of the peer that sent the message it handles, as
        authenticated (the tag covers it, and membership knows that peer's incarnation); None elsewhere."""
        return getattr(self._delivering, "sender", None)

    def __repr__(self) -> str:
        return f"<Router {self.node_id!r} at {self.address}, peers {self.peers()}>"

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def connect(self, url: str) -> None:
        """Dial another node's inbox at ``url`` (retried in the background until it answers, also after it was lost)."""
        self._members.dial(url, learned=False)

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
            self._members.lost_callbacks.append(fn)

    def off_peer_lost(self, fn: Callable[[str], Any]) -> None:
        """Remove a callback given to :meth:`on_peer_lost`."""
        with self._lock:
            if fn in self._members.lost_callbacks:
                self._members.lost_callbacks.remove(fn)

    def subscribers(self, topic: str) -> List[str]:
        """Ids of the live peers subscribed to ``topic`` that :meth:`publish` can reach now."""
        return sorted(self.subscriber_incarnations(topic))

    def subscriber_incarnations(self, topic: str) -> Dict[str, str]:
        """:meth:`subscribers` with the incarnation (hex) each one proved to this node: which life of it gets a send."""
        with self._lock:
            return {link.peer_id: link.peer_inc.hex() for link in self._members.subscribed(topic)}

    def wait_for_subscribers(self, topic: str, n: int, timeout: float) -> List[str]:
        """Block until ``n`` live peers subscribed to ``topic`` can be reached; returns their ids, or raises
        ``TimeoutError``. Publish after this when the first messages matter."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._members.subscribed(topic)) >= n or self._closing, timeout)
            found = sorted(self.subscriber_incarnations(topic))
        if len(found) < n:
            raise TimeoutError(f"router {self.node_id!r}: {len(found)} of {n} peers subscribed to {topic!r} after "
                               f"{timeout}s (subscribed: {found}; live peers: {self.peers()})")
        return found

    def publish(self, topic: str, payload: Any, to_lost: bool = False) -> int:
        """Queue ``payload`` for every live peer subscribed to ``topic``; returns how many links it was queued on.

        Each link's sender thread sends it, batched with what else is queued there (the module docstring). A
        full queue waits at most ``send_timeout_s`` for a slow peer; a message that finds no room in that time
        is counted in ``send_timeouts`` and skipped. Raises ``OversizeError`` for a message over
        ``max_message_size``. ``to_lost``: also send it, without waiting and uncounted, to the subscribed peers
        lost while their connection stayed open (a stopped process reads it when it continues): a run's last words."""
        self._check_topic(topic)
        frames = self._encode(payload)
        with self._lock:
            if self._closing:
                raise RuntimeError(f"router {self.node_id!r} is closed")
            links = self._members.subscribed(topic)
            lost = self._members.subscribed(topic, lost=True) if to_lost else []
            if not links and not lost:
                return 0
            send_lock = self._send_locks.get(topic) or self._send_locks.setdefault(topic, threading.Lock())
        with send_lock:  # seq order is send order on every link
            seq = self._seq.get(topic, -1) + 1
            self._seq[topic] = seq
            message = pack(topic, seq, self.node_id, frames, self.max_message_size)  # the one copy of the payload
            for link in lost:
                self._send(link, message, link.peer_inc, block=False)
            queued = 0
            for link in links:  # shared: each link's thread lays its batch out, and seals it, in its own nng message
                if self._outbox.put(link, message):
                    queued += 1
                else:
                    self._count("send_timeouts")
                    self._log.log(f"send-timeout {link.url}", "router %s: no room to queue a message for %s within "
                                  "%ss; message dropped", self.node_id, link.url, self.send_timeout_s)
            return queued

    def _send_batch(self, link: Link, messages: List[bytearray]) -> None:
        """The outbox's send: ``messages`` (from :meth:`publish`) sealed as one batch for ``link``'s live peer."""
        with self._lock:  # a peer lost since gets no more, as from publish: its socket keeps room for to_lost's words
            peer = self._members.peers.get(link.peer_id)
            live = peer is not None and peer.alive and peer.incarnation == link.peer_inc
        if live:  # laid out once, in the nng message that is sent
            self._send(link, Outgoing.join(batch_parts(messages)), link.peer_inc, count=len(messages))

    def _send(self, link: Link, message: Union[bytearray, Outgoing], to: Optional[bytes], block: bool = True,
              count: int = 0) -> bool:
        """Seal ``message`` for incarnation ``to`` (None: a hello) in place and send it on ``link``; ``count``: the data
        messages it carries, counted in ``sent`` or ``send_timeouts`` (0: a membership message, not counted)."""
        to = HELLO if to is None else to
        out = message if type(message) is Outgoing else Outgoing.join([message])
        with self._lock:
            counter = self._counter.get(to, 0)
            self._counter[to] = counter + 1
        sign(out.body, self.secret, self._inc, to, counter)
        try:
            out.send(link.sock, block=block)
        except pynng.Timeout:
            if count:
                self._count("send_timeouts", count)
                self._log.log(f"send-timeout {link.url}", "router %s: a send to %s timed out after %ss; %d "
                              "message(s) dropped", self.node_id, link.url, self.send_timeout_s, count)
            return False
        except (pynng.TryAgain, pynng.Closed):
            return False
        if count:
            with self._lock:
                self._counts["sent"] += count
                self._counts["sent_batches"] += 1
        return True

    @staticmethod
    def _check_topic(topic: str) -> None:
        if not isinstance(topic, str) or not topic or topic.startswith("\x00"):
            raise ValueError(f"topic {topic!r}: must be a non-empty string not starting with NUL")

    # --- membership --------------------------------------------------------------------------------
    def peers(self) -> List[str]:
        """Ids of the live peers (those heard from within ``peer_timeout_s``)."""
        return self._members.live()

    def ready_peers(self) -> List[str]:
        """Live peers that know this node too (the handshake is complete both ways)."""
        return self._members.ready()

    def wait_for_peers(self, n: int, timeout: float) -> List[str]:
        """Block until ``n`` peers are ready; returns their ids. ``TimeoutError`` naming who is missing, at once
        (after ``auth_timeout_s``) where an address we dialed answers nothing authentic, or one keeps sending us
        messages that fail authentication: another secret."""
        return self._members.wait_ready(n, timeout)

    def failing_authentication(self) -> Optional[str]:
        """A sentence naming an address that has kept sending messages that fail authentication for over
        ``auth_timeout_s``, up to now (a node with another secret), or None: for a node waiting for its peers."""
        return self._members.knocking()

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
                    self._members.announce()
                    if beat:
                        last_beat = now
                self._members.check_timeouts(judge=not self._inbox.stalled)  # stalled: the silence is ours
                self._inbox.guard.expire()
            except Exception as e:  # a bug here must not stop the heartbeats
                self._inbox.error("control", e)

    # --- what the inbox hands over (inbox._Router) ---------------------------------------------------
    def _accept(self, frames: List[Frame], pipe: int) -> Optional[List[Tuple[Frame, List[Callable[[Any], Any]]]]]:
        """The messages of an authentic data batch that came through inbox connection ``pipe`` to deliver, each
        with its handlers; None where membership takes none of them."""
        with self._lock:
            taken = self._members.accept(frames, pipe)
            if not any(taken):
                return None
            self._counts["received"] += sum(taken)
            calls = {t: [functools.partial(self._deliver, frames[0].sender, fn) for fn in self._handlers.get(t, ())]
                     for t in {f.topic for f in frames}}  # per topic, not per message: a batch has one sender
            return [(f, calls[f.topic]) for f, ok in zip(frames, taken) if ok]

    def _deliver(self, sender: str, fn: Callable[[Any], Any], payload: Any) -> None:
        """Call a handler with :attr:`sender` set to the message's sender."""
        self._delivering.sender = sender
        try:
            fn(payload)
        finally:
            self._delivering.sender = None

    def _on_hello(self, frame: Frame, message: Dict[str, Any]) -> None:
        self._members.on_hello(frame, message)

    def _on_control(self, frame: Frame, message: Dict[str, Any], pipe: int) -> bool:
        return self._members.on_control(frame, message, pipe)

    def _pipe_open(self, pipe: int) -> bool:
        return self._inbox.guard.is_open(pipe)

    def _close_pipe(self, pipe: int) -> None:
        self._inbox.guard.close(pipe)

    def _auth_failed(self, remote: str) -> None:
        self._members.auth_failed(remote)

    def _resumed(self) -> None:
        self._members.resumed()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> Dict[str, Any]:
        """Counters: ``sent`` (messages), ``sent_batches`` (the sends that took them), ``received``, ``rejected_auth``,
        ``rejected_size``, ``rejected_replay``, ``rejected_connections``, ``malformed``, ``lost``, ``duplicated``,
        ``send_timeouts``, ``handler_errors``, ``receive_errors``, ``peers_lost``, ``rejected_peers`` (new node ids
        refused while every known one lives), ``rejected_foreign_pipe`` (messages in the name of an incarnation that
        speaks through another connection) and ``rejected_impersonation`` (new incarnations of a live node id announced
        through another connection); ``peers``: live peer ids; ``connections`` and ``pending``: the inbox's connections
        now, and those not authenticated yet; ``handshaking``: tcp connections nng holds before its handshake;
        ``backlog_bytes``: received, not yet delivered."""
        with self._lock:
            return {**self._counts, "peers": self._members.live(), **self._inbox.guard.counts(),
                    "handshaking": self._inbox.handshakes.waiting() if self._inbox.handshakes else 0,
                    "backlog_bytes": self._inbox.backlog_bytes}

    # --- closing -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Send what is queued (waiting at most ``send_timeout_s``), say goodbye to the peers, stop the threads and
        close every socket (the ipc file goes with it)."""
        with self._lock:
            if self._closed:
                return
        self._outbox.flush(self.send_timeout_s)
        self._members.goodbye()
        with self._lock:
            self._closing = self._closed = True
            links = list(self._members.links.values())
            self._changed.notify_all()
        self._wake.set()
        self._inbox.close()
        if self._control is not threading.current_thread():
            self._control.join(timeout=5)
        for link in links:
            close_socket(link.sock)
        self._outbox.close()  # after the sockets: a send still waiting on a slow peer ends with them
