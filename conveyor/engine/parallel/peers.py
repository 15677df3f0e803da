"""What a router remembers of the other nodes: one :class:`Link` per address it dials, one :class:`Peer` per node
id, and the incarnations replaced.

A node id's incarnation, once replaced by a newer one, must never come back through a recording: the
:class:`PeerTable` keeps the last :data:`RETIRED_PER_NODE` replaced incarnations of each node *with their
replay windows and state numbers*, so their recorded messages are refused as replays; older ones are
refused by age (an incarnation carries its start time, see :func:`~conveyor.engine.parallel.frame.new_incarnation`),
so a recorder cannot cycle them out. A replaced incarnation may come back only with a message it never
sent before (an unseen link counter and a newer state number): proof that its process still runs, which a
recording cannot give.

Each incarnation speaks through one connection to our inbox (one nng pipe of its link's Push0 socket at a
time): :meth:`Peer.admit` binds it to the connection of its first message taken, and refuses its messages
through any other connection while that one is open. The secret is shared, so anyone holding it can seal
a message in another node's name; the connection is what such a forger cannot share, so it cannot touch
the replay window of a node that speaks, and cannot cut it off by numbering its messages ahead.

Everything here is keyed by ids a holder of the secret chooses, so it is bounded: at most :data:`MAX_PEERS`
node ids (a dead peer is forgotten to make room for a new one; a live one never is) and
:data:`MAX_TOPICS_PER_PEER` topics numbered per peer. Not thread-safe: the router's lock guards it.
"""
from __future__ import annotations

import collections
import ipaddress
import logging
import time
from typing import Any, Callable, Deque, Dict, Iterable, Optional, Union
from urllib.parse import urlsplit

from conveyor.engine.parallel.frame import incarnation_started
from conveyor.engine.parallel.guard import ReplayWindow

__all__ = ["Link", "MAX_PEERS", "MAX_SEQ_JUMP", "MAX_TOPICS_PER_PEER", "PEER_TIMEOUT_S", "Pause", "Peer", "PeerTable",
           "REFUSALS", "REJOIN_S", "RETIRED_PER_NODE", "is_local_address"]

PEER_TIMEOUT_S = 5.0
"""A router's default ``peer_timeout_s``: how long a peer may stay silent before it is lost."""
REJOIN_S = 120.0
"""A router's default ``rejoin_s``: how long the link to a peer lost while its connection stayed open (stopped, cut
off) is kept for it to come back (and read what was queued for it) before it is closed."""

MAX_SEQ_JUMP = 1 << 32  # a sender's seq moves by one per message: a bigger jump is a bad message
RETIRED_PER_NODE = 16  # replaced incarnations of one node id kept with their windows; older ones refused by age
MAX_PEERS = 1024  # node ids remembered; a dead one is forgotten to make room, a live one never
MAX_TOPICS_PER_PEER = 1024  # topics whose seq is tracked per peer
REFUSALS = {  # kinds of refused message (Peer.admit's, membership's): (counter in stats(), log level, why)
    "replay": ("rejected_replay", logging.INFO, "it was sent before, or by an incarnation that restarted since"),
    "unknown": ("malformed", logging.INFO, "data from an incarnation that is no known peer's"),
    "jump": ("malformed", logging.WARNING, "numbered far past its last one: not one its sender could have counted"),
    "topics": ("malformed", logging.WARNING, f"a new topic from a peer that already sent on {MAX_TOPICS_PER_PEER}"),
    "foreign pipe": ("rejected_foreign_pipe", logging.WARNING, "that incarnation speaks through another connection, "
                     "still open: sealed in its name by another holder of the secret"),
    "impersonation": ("rejected_impersonation", logging.WARNING, "a new incarnation of a live node that speaks "
                      "through another connection, still open: announced in its name by another holder of the "
                      "secret"),
}


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


class Link:
    """Our Push0 socket dialing one peer's inbox."""

    def __init__(self, url: str, sock: Any) -> None:
        self.url, self.sock = url, sock
        self.connected = False
        self.unproven_since = 0.0  # connected since then with no proven peer behind it (0: not so)
        self.hello_sent = False  # our state, sealed for peer_inc, went out since it connected
        self.dropped_at = 0.0  # when its connection closed, until the control thread judged it (0: not so)
        self.learned = False  # dialed back after a peer's hello, not asked for with connect()
        self.for_hello = False  # dialed for a hello only, not yet for a proven peer: closed when it expires
        self.greet = False  # its connection closed since its last hello: the next one gets a hello whatever it knows
        self.warned = False  # told that nothing authentic came back from it
        self.kept_since = 0.0  # when its peer was lost with the link kept for it to come back (0: not so)
        self.peer_id: Optional[str] = None
        self.peer_inc: Optional[bytes] = None  # the proven incarnation of the peer behind it


class Peer:
    """What this node knows of one incarnation of another node, from its state messages."""

    def __init__(self, node_id: str, address: str, incarnation: bytes) -> None:
        self.node_id, self.address, self.incarnation = node_id, address, incarnation
        self.topics: frozenset = frozenset()
        self.heard: frozenset = frozenset()
        self.last_seen = time.monotonic()
        self.control_seq = -1
        self.alive = False
        self.window = ReplayWindow(max_jump=MAX_SEQ_JUMP)
        self.last_seq: Dict[str, int] = {}
        self.pipe: Optional[int] = None  # id of the inbox connection it speaks through (None: not bound, or lost)

    def bound_elsewhere(self, pipe: int, pipe_open: Callable[[int], bool]) -> bool:
        """Whether this incarnation speaks through another inbox connection than ``pipe`` that is still open
        (``pipe_open(id)``): a message of its through ``pipe`` was then sealed by someone else."""
        return self.pipe is not None and self.pipe != pipe and pipe_open(self.pipe)

    def admit(self, counter: int, pipe: int, pipe_open: Callable[[int], bool]) -> Optional[str]:
        """Why a message of this incarnation with link counter ``counter``, through inbox connection ``pipe``,
        is refused: ``"foreign pipe"`` (:meth:`bound_elsewhere`), ``"jump"`` (a counter it could not have
        reached) or ``"replay"`` (seen before); None: the counter is new, and marked seen. The caller binds
        ``pipe`` (``peer.pipe = pipe``) once every check of its own passed too."""
        if self.bound_elsewhere(pipe, pipe_open):
            return "foreign pipe"
        if self.window.too_far(counter):
            return "jump"
        return None if self.window.accept(counter) else "replay"

    def number(self, topic: str, seq: int) -> Union[str, int]:
        """Check a message's ``seq`` on ``topic`` against its last one: ``"duplicated"`` (not past it), ``"jump"``
        (past it by over :data:`MAX_SEQ_JUMP`) or ``"topics"`` (one topic too many) refuse it; otherwise it is
        recorded, and how many messages were lost before it is returned."""
        last = self.last_seq.get(topic, -1)
        if seq <= last:
            return "duplicated"
        if seq - last > MAX_SEQ_JUMP:
            return "jump"  # would make every later message of its look old
        if last < 0 and len(self.last_seq) >= MAX_TOPICS_PER_PEER:
            return "topics"
        self.last_seq[topic] = seq
        return seq - last - 1 if last >= 0 else 0


class Pause:
    """Whether this node itself stood still (SIGSTOP, a suspended host, a starved CPU): its control thread, which
    judges its peers every heartbeat, came back over ``limit_s`` after its last look. Its peers then look silent
    for a time they spoke in (their messages wait unread in its inbox): the node must not lose them for that."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._looked = time.monotonic()

    def stood_still(self, now: float) -> float:
        """The seconds since the last look if over ``limit_s``, else 0.0; ``now`` is the new last look."""
        gap, self._looked = now - self._looked, now
        return gap if gap > self.limit_s else 0.0

    @staticmethod
    def forgive(peers: Iterable[Peer], links: Iterable[Link], now: float) -> None:
        """After a standstill: every live peer is judged silent only a whole timeout from ``now``, and a link
        whose connection closed meanwhile half a heartbeat from ``now`` (once the inbox read what queued)."""
        for peer in peers:
            peer.last_seen = max(peer.last_seen, now)
        for link in links:
            if link.dropped_at:
                link.dropped_at = now


class PeerTable(Dict[str, Peer]):
    """The current :class:`Peer` of each node id, and the incarnations each one replaced (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._retired: Dict[str, Deque[Peer]] = {}
        self._replaced_before: Dict[str, int] = {}  # node id -> start time (ns) of the newest incarnation dropped

    def retired(self, node_id: str, incarnation: bytes) -> Optional[Peer]:
        """The replaced incarnation ``incarnation`` of ``node_id`` if it is kept, else None."""
        for peer in self._retired.get(node_id, ()):
            if peer.incarnation == incarnation:
                return peer
        return None

    def replaced(self, node_id: str, incarnation: bytes) -> bool:
        """Whether ``incarnation`` of ``node_id`` was replaced: kept as retired, or no newer than one dropped."""
        return (self.retired(node_id, incarnation) is not None
                or incarnation_started(incarnation) <= self._replaced_before.get(node_id, -1))

    def retire(self, peer: Peer) -> None:
        """Remember ``peer``'s incarnation as replaced; the oldest kept one is dropped, refused by age from then."""
        kept = self._retired.setdefault(peer.node_id, collections.deque())
        if len(kept) >= RETIRED_PER_NODE:
            dropped = incarnation_started(kept.popleft().incarnation)
            self._replaced_before[peer.node_id] = max(dropped, self._replaced_before.get(peer.node_id, -1))
        kept.append(peer)

    def reinstate(self, peer: Peer) -> None:
        """``peer``, a retired incarnation, proved it still runs: it is no longer retired."""
        kept = self._retired.get(peer.node_id)
        if kept is not None and peer in kept:
            kept.remove(peer)

    def make_room(self, node_id: str) -> bool:
        """Whether a peer ``node_id`` may be added: there is room, or a dead peer was forgotten to make it."""
        if node_id in self or len(self) < MAX_PEERS:
            return True
        dead = [p for p in self.values() if not p.alive]
        if not dead:
            return False
        oldest = min(dead, key=lambda p: p.last_seen).node_id
        del self[oldest]
        self._retired.pop(oldest, None)
        self._replaced_before.pop(oldest, None)
        return True
