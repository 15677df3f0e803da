"""A router's membership: the links it dials, the peers it has proven, and when it loses them.

Handshake, per pair of nodes (the keys are :mod:`~conveyor.engine.parallel.frame`'s). A node that does
not know a peer's incarnation sends it a *hello* (its state, sealed for "anyone": replayable, so it makes
nothing live and delivers nothing); the peer keeps the hello's incarnation as a *candidate* for
``auth_timeout_s`` and answers with its state sealed for it, which proves the answer is fresh; from then
on both seal everything for each other's incarnation. A peer whose genuine (freshly keyed) state comes
from a new incarnation has restarted: the old one is lost and *retired*, so its recorded messages are
refused (:mod:`~conveyor.engine.parallel.peers` keeps them, bounded, and says why none can come back).
Within an incarnation, link counters are checked against a
:class:`~conveyor.engine.parallel.guard.ReplayWindow`, and counters and state numbers that jump further
than the sender could have counted are refused. An incarnation is bound to the inbox connection it speaks
through (:meth:`~conveyor.engine.parallel.peers.Peer.admit`): while that is open and the peer live, its messages
through another one and a new incarnation of its node id are refused (a holder of the secret cannot move its
window or retire it); a lost peer's connection is closed and its binding released, for it to bind afresh.

State: a node's *state* (advertised address, subscribed topics, the ids of the peers it has heard) goes
on each link as soon as the link connects, whenever it changes, and every ``heartbeat_s``
(:meth:`Membership.announce`, called by the router's control thread). Any authentic message refreshes
the sender's liveness; one silent for ``peer_timeout_s`` is declared dead, its subscriptions dropped and
the lost callbacks called. Two faster paths need no timeout: a closing router says goodbye, and a link
whose connection closes (the peer's process died) loses its peer half a heartbeat later. A lost peer
that speaks again is live again: a process stopped (SIGSTOP) or cut off past the timeout rejoins when it
continues. The link we dialed back to a lost peer stays while its connection does, so what we queue for it there
(:meth:`Router.publish`'s ``to_lost``, our goodbye) is read when it continues; one whose peer is not back within
``rejoin_s`` is closed (a half-open connection to a host gone holds a descriptor and nng's buffers). A link whose
connection closed says hello on its next one even where it knows an incarnation there again (a late state of one that
died, read after the closing, names it): a restarted peer at that address refuses what is sealed for the dead one, and
learns of us only from a hello. A node that itself stood still (:class:`~conveyor.engine.parallel.peers.Pause`) gives
its peers a fresh timeout instead of losing them all. A peer is *ready* when its state lists this node among those it
heard.
A node waiting for its peers while an address keeps failing authentication stops waiting at once, naming it.
Messages are numbered per (sender, topic): gaps count as ``lost``, repeats as ``duplicated``.

Everything here is guarded by the router's lock: the router reads topics and handlers under the same
lock, so a message is accepted and its handlers chosen in one step.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import pynng

from conveyor.engine.parallel import codec as _codec
from conveyor.engine.parallel.frame import Frame, pack
from conveyor.engine.parallel.guard import AuthFailures, close_socket
from conveyor.engine.ratelimit import RateLimitedLog
from conveyor.engine.parallel.inbox import CONTROL_TOPIC, nng_os_error
from conveyor.engine.parallel.readiness import Readiness
from conveyor.engine.parallel.peers import (MAX_SEQ_JUMP, PEER_TIMEOUT_S, REFUSALS, REJOIN_S, Link, Pause, Peer,
                                           PeerTable, is_local_address)

__all__ = ["Link", "Membership", "PEER_TIMEOUT_S", "Peer", "REJOIN_S", "is_local_address"]  # but one: peers.py's

_SEND_BUFFER = 8  # messages a link queues before a send waits: room for a heartbeat beside data
_MAX_CANDIDATES = 64  # hellos of incarnations not proven fresh yet, answered until they expire
_REDIAL_MS = 50  # a link's first redial after its connection closed: a peer that hung up on us only is back by then


class _Router(Protocol):
    """What membership asks of its router (:class:`~conveyor.engine.parallel.router.Router`)."""
    node_id: str
    address: str
    local_only: bool
    heartbeat_s: float
    peer_timeout_s: float
    send_timeout_s: float
    auth_timeout_s: float
    rejoin_s: float

    @property
    def closed(self) -> bool: ...
    def topics(self) -> List[str]: ...
    def _count(self, name: str, n: int = 1) -> None: ...
    def _pipe_open(self, pipe: int) -> bool: ...
    def _close_pipe(self, pipe: int) -> None: ...
    def _send(self, link: Link, message: bytearray, to: Optional[bytes], block: bool = True,
              count: int = 0) -> bool: ...


class Membership(Readiness):
    """The links and peers of ``router``, under its ``lock``: ``changed`` is notified when who is ready or
    subscribed changes, ``wake`` asks the router's control thread to announce our state now. Losses and
    warnings go to ``log``'s logger."""

    def __init__(self, router: _Router, lock: threading.RLock, changed: threading.Condition,
                 wake: threading.Event, log: RateLimitedLog) -> None:
        self._router, self._lock, self._changed, self._wake, self._log = router, lock, changed, wake, log
        self.links: Dict[str, Link] = {}
        self.peers = PeerTable()
        self.lost_callbacks: List[Callable[[str], Any]] = []
        self._candidates: Dict[Tuple[str, bytes], Tuple[str, float]] = {}  # (node, inc) -> (address, expiry)
        self._auth_failures = AuthFailures()
        self._control_seq = -1
        self._pause = Pause(router.peer_timeout_s / 2)
        self._leaving = False  # our goodbye is numbered: no state follows it (one would make us live again there)

    # --- links -------------------------------------------------------------------------------------
    def dial(self, url: str, learned: bool) -> None:
        """Open a link to the inbox at ``url`` (``learned``: announced by a peer, not asked for)."""
        r = self._router
        if r.local_only and not is_local_address(url):
            raise ValueError(f"Router {r.node_id!r}: refusing to dial {url} without a secret; give every node "
                             f"the same secret (--secret-file FILE or $CONVEYOR_SECRET)")
        with self._lock:
            if r.closed or url in self.links or url == r.address:
                return
            try:
                sock = pynng.Push0(send_timeout=int(r.send_timeout_s * 1000), send_buffer_size=_SEND_BUFFER,
                                   reconnect_time_min=_REDIAL_MS, reconnect_time_max=int(max(r.heartbeat_s, 0.1) * 1000))
            except pynng.NNGException as e:
                raise nng_os_error(f"Router {r.node_id!r} cannot open a link to {url}", e) from None
            link = self.links[url] = Link(url, sock)
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
                link.greet = True  # also if a late state of the one that died names its incarnation again meanwhile
            self._wake.set()  # the control thread loses its peer (nng's thread must not run the callbacks)

        sock.add_post_pipe_connect_cb(connected)
        sock.add_post_pipe_remove_cb(removed)
        sock.dial(url, block=False)

    def _dial_back(self, address: str, inc: Optional[bytes]) -> None:
        """Dial the address a peer announced (learned: closed again if it never proves fresh)."""
        try:
            self.dial(address, learned=True)
        except (ValueError, OSError) as e:
            self._router._count("malformed")
            return self._log.log(f"dial {address}", "router %s: not dialing %s: %s", self._router.node_id, address, e)
        with self._lock:
            link = self.links.get(address)
            if link is not None and inc is not None:
                link.peer_inc, link.unproven_since = inc, 0.0
            elif link is not None and link.peer_inc is None and link.peer_id is None:
                link.for_hello = True

    def subscribed(self, topic: str, lost: bool = False) -> List[Link]:
        """The links to live peers (``lost``: to lost peers whose link is still connected: stopped, or cut off
        and not yet closed) subscribed to ``topic`` that have our state (call with the lock held)."""
        links = []
        for peer in self.peers.values():
            link = self.links.get(peer.address)
            if (peer.alive != lost and topic in peer.topics and link is not None and link.hello_sent
                    and link.peer_inc == peer.incarnation and (link.connected or not lost)):
                link.peer_id = peer.node_id
                links.append(link)
        return links

    # --- what we send ------------------------------------------------------------------------------
    def _state(self) -> Optional[bytearray]:
        r = self._router
        with self._lock:
            if self._leaving:
                return None
            state = {"kind": "state", "address": r.address, "topics": r.topics(),
                     "heard": sorted(p.node_id for p in self.peers.values() if p.alive)}
            self._control_seq += 1
            seq = self._control_seq
        return pack(CONTROL_TOPIC, seq, r.node_id, _codec.encode(state))

    def announce(self) -> None:
        """Send our state on every connected link: sealed for the proven peer behind it, and for each fresh
        hello heard from that address; a hello of our own where nobody is known yet."""
        now = time.monotonic()
        with self._lock:
            self._candidates = {k: v for k, v in self._candidates.items() if v[1] > now}
            wanted = {address for address, _ in self._candidates.values()}
            targets, stale = [], []
            for url, link in list(self.links.items()):
                if link.for_hello and url not in wanted:
                    stale.append(self.links.pop(url))  # dialed back for a hello never proven fresh
                    continue
                if not link.warned and self._unanswered(link, now):
                    link.warned = True
                    self._log.logger.warning("%s", self._no_answer(url))
                if not link.connected:
                    continue
                incs = [inc for (_, inc), (address, _) in self._candidates.items()
                        if address == url and inc != link.peer_inc]
                proven = [link.peer_inc] if link.peer_inc is not None else []
                targets.append((link, proven, incs + [None] * (link.greet and bool(proven))))
        for link in stale:
            close_socket(link.sock)  # outside the lock: nng runs the link's callbacks, which take it, before returning
        for link, proven, others in targets:
            for to in proven + others or [None]:
                state = self._state()
                if state is None:
                    return
                ok = self._router._send(link, state, to, block=False)
                if ok and to is None:
                    with self._lock:
                        link.greet = False
                if ok and proven and to == proven[0]:
                    with self._lock:
                        link.hello_sent = link.connected and link.peer_inc == to
                        self._changed.notify_all()

    def goodbye(self) -> None:
        """Tell the peers that have our state that we close, waiting a little for room on each link: a
        goodbye dropped on a full link reads as a loss there."""
        r = self._router
        with self._lock:
            links = [link for link in self.links.values() if link.hello_sent and link.peer_inc is not None]
            self._leaving, self._control_seq = True, self._control_seq + 1
            seq = self._control_seq  # a state numbered before it and read after it is refused as older
        for link in links:
            link.sock.send_timeout = int(min(r.heartbeat_s, r.send_timeout_s) * 1000)
            r._send(link, pack(CONTROL_TOPIC, seq, r.node_id, _codec.encode({"kind": "bye"})), link.peer_inc)

    # --- losses ------------------------------------------------------------------------------------
    def check_timeouts(self, judge: bool = True) -> None:
        """Lose the peers silent for ``peer_timeout_s``, and those whose connection closed half a heartbeat ago
        (a goodbye sent before the closing goes through the inbox, the closing is seen on the link); not when this
        node stood still meanwhile (:class:`~conveyor.engine.parallel.peers.Pause`), nor unless ``judge`` (our
        inbox is behind: the silence is ours)."""
        r = self._router
        now = time.monotonic()
        paused = self._pause.stood_still(now)
        if not judge:
            return
        with self._lock:
            if paused:  # our silence, not theirs: a fresh timeout for each peer, once what queued is read
                self._pause.forgive(self.peers.values(), self.links.values(), now)
            dead = [(p, f"silent for {r.peer_timeout_s}s") for p in self.peers.values()
                    if p.alive and now - p.last_seen > r.peer_timeout_s]
            dropped = {url for url, link in self.links.items()
                       if link.dropped_at and now - link.dropped_at >= max(r.heartbeat_s / 2, 2 * _REDIAL_MS / 1000)}
            for url in dropped:
                self.links[url].dropped_at = 0.0
            dead += [(p, "its connection closed") for p in self.peers.values()
                     if p.alive and p.address in dropped and not self.links[p.address].connected]
            gone = [self.links.pop(url) for url in dropped if self._kept_for_lost(url)]
            expired = [url for url, kept in self.links.items()
                       if kept.kept_since and now - kept.kept_since > r.rejoin_s]
            gone += [self.links.pop(url) for url in expired]  # its peer never came back: a half-open link
            # a silent one's connection is closed; a closed one's is read to its end (its last words, its goodbye)
            pipes = [p.pipe for p, why in dead if p.pipe is not None and why.startswith("silent")]
        if paused:
            self._log.log("paused", "router %s: this node stood still for %.1fs (stopped, or starved of CPU); its "
                          "peers get a fresh peer timeout", r.node_id, paused)
        for link in gone:
            close_socket(link.sock)
        for url in expired:
            self._log.logger.info("router %s: closed the link kept for the peer at %s: not back within rejoin_s=%ss",
                                  r.node_id, url, r.rejoin_s)
        for peer, why in dead:
            self._lose(peer, why)
        for pipe in pipes:  # half open, or silent: whatever comes back reconnects and binds afresh
            self._router._close_pipe(pipe)

    def _kept_for_lost(self, url: str) -> bool:
        """Whether the link at ``url`` was only kept for a lost peer (dialed back, its connection now closed)."""
        link = self.links[url]
        return link.learned and not link.connected and not any(
            p.alive and p.address == url for p in self.peers.values())

    def _lose(self, peer: Peer, why: str) -> None:
        node_id = self._router.node_id
        with self._lock:
            if not peer.alive:
                return
            peer.alive, peer.pipe = False, None  # its next message binds whichever connection it comes through
            self._router._count("peers_lost")
            self._changed.notify_all()
            link = self.links.get(peer.address)
            # a dialed-back link still connected is kept (a stopped peer reads what it queues when it continues),
            # one closed goes: its hello makes us dial again if it comes back
            closed = link is not None and link.learned and not link.connected
            if closed:
                del self.links[peer.address]
            elif link is not None and link.learned:
                link.kept_since = time.monotonic()  # closed after rejoin_s unless its peer comes back
            callbacks = list(self.lost_callbacks)
        if closed:
            close_socket(link.sock)
        self._log.logger.log(logging.INFO if why == "it closed" else logging.WARNING, "router %s: peer %s lost (%s)",
                             node_id, peer.node_id, why)
        for fn in callbacks:
            try:
                fn(peer.node_id)
            except Exception:
                self._log.logger.exception("router %s: an on_peer_lost callback raised", node_id)
        self._wake.set()  # our "heard" list changed

    # --- what the inbox hands over -----------------------------------------------------------------
    def on_hello(self, frame: Frame, message: Dict[str, Any]) -> None:
        """A hello: remember its incarnation as a candidate to answer (sealed for it) until it expires."""
        sender, inc = frame.sender, frame.sender_incarnation
        with self._lock:
            if self.peers.replaced(sender, inc):
                return self._refuse("replay", frame)
            if len(self._candidates) >= _MAX_CANDIDATES and (sender, inc) not in self._candidates:
                self._candidates.pop(next(iter(self._candidates)))
            self._candidates[(sender, inc)] = (message["address"], time.monotonic() + self._router.auth_timeout_s)
            known = message["address"] in self.links
        if not known:
            self._dial_back(message["address"], None)
        self._wake.set()

    def on_control(self, frame: Frame, message: Dict[str, Any], pipe: int) -> bool:
        """State or goodbye sealed for us, through inbox connection ``pipe``: proof that ``frame``'s incarnation
        runs now, unless it is a replay (its counter seen, or its incarnation replaced and this nothing new from
        it), jumps too far, or comes through another connection than its incarnation's, or than a live
        previous incarnation's of its node id. Returns whether it was taken."""
        sender, inc, bye = frame.sender, frame.sender_incarnation, message["kind"] == "bye"
        with self._lock:
            old = self.peers.get(sender)
            new = None
            if old is None or old.incarnation != inc:
                new = self.peers.retired(sender, inc)
                if (new is None or bye) and self.peers.replaced(sender, inc):
                    return self._refuse("replay", frame)
                if bye:
                    return False
                returning, new = new is not None, new or Peer(sender, message["address"], inc)
                if not self._fresh(new, frame, pipe, replaced=returning):
                    return False
                if old is not None and old.alive and old.bound_elsewhere(pipe, self._router._pipe_open):
                    return self._refuse("impersonation", frame)
                if old is None and not self.peers.make_room(sender):
                    self._router._count("rejected_peers")
                    self._log.log("peers full", "router %s: refused peer %r: already %d peers, all live",
                                  self._router.node_id, sender, len(self.peers))
                    return False
            elif not self._fresh(old, frame, pipe, replaced=False):
                return False
        if new is not None:
            if old is not None:
                self._lose(old, "it restarted")  # its callbacks run before the new incarnation is live
            with self._lock:
                if old is not None:
                    self.peers.retire(old)
                self.peers.reinstate(new)
                self.peers[sender] = new
        with self._lock:
            peer = self.peers[sender]
            peer.pipe = pipe  # bound to the connection it speaks through (released if it is lost)
            if bye:
                new_link, back = False, None
            else:
                self._candidates.pop((sender, inc), None)
                was_alive, peer.alive = peer.alive, True
                peer.address = message["address"]
                peer.topics, peer.heard = frozenset(message["topics"]), frozenset(message["heard"])
                back = None if was_alive or new is not None else time.monotonic() - peer.last_seen  # lost, not died
                peer.last_seen = time.monotonic()
                link = self.links.get(peer.address)
                new_link = link is None
                if link is not None:
                    link.kept_since = 0.0  # its peer is back
                if link is not None and link.peer_inc != inc:
                    link.peer_inc, link.hello_sent, link.peer_id, link.unproven_since = inc, False, sender, 0.0
                    link.for_hello = False
                self._changed.notify_all()
        if bye:
            self._lose(peer, "it closed")
            return True
        if back is not None:
            self._log.logger.warning("router %s: peer %s is back, heard again after %.1fs; taken back",
                                     self._router.node_id, sender, back)
        if new_link:
            self._dial_back(peer.address, inc)
        if not was_alive or self._router.node_id not in peer.heard or new_link:
            self._wake.set()  # tell it (again) that we heard it
        return True

    def _fresh(self, peer: Peer, frame: Frame, pipe: int, replaced: bool) -> bool:
        """Whether a control message of ``peer``'s incarnation through ``pipe`` is new (:meth:`Peer.admit`), its
        state number newer (not absurdly). ``replaced``: an older state is then a replay."""
        if frame.seq - peer.control_seq > MAX_SEQ_JUMP:
            return self._refuse("jump", frame)
        refused = peer.admit(frame.counter, pipe, self._router._pipe_open)
        if refused is None and replaced and frame.seq <= peer.control_seq:
            refused = "replay"
        if refused is not None:
            return self._refuse(refused, frame)
        if frame.seq <= peer.control_seq:
            return False  # an older state overtaken by a newer one
        peer.control_seq = frame.seq
        return True

    def _refuse(self, kind: str, frame: Frame) -> bool:
        """Count a message refused as ``kind`` (a key of ``REFUSALS``), log it at a bounded rate; False."""
        name, level, why = REFUSALS[kind]
        self._router._count(name)
        self._log.log(kind, "router %s: refused a message from %r (incarnation %s) on %r (counter %d, seq %d): %s",
                      self._router.node_id, frame.sender, frame.sender_incarnation.hex(), frame.topic, frame.counter,
                      frame.seq, why, level=level)
        return False

    def accept(self, frames: List[Frame], pipe: int) -> List[bool]:
        """Which messages of an authentic data batch through inbox connection ``pipe`` are new from a known peer:
        none when its sender incarnation is not a known peer's or :meth:`Peer.admit` refuses the batch's counter;
        of the others, those :meth:`Peer.number` takes (refusals counted). If any is taken, the incarnation is
        bound to ``pipe``. Call with the lock held."""
        first = frames[0]
        peer = self.peers.get(first.sender)
        if peer is None or peer.incarnation != first.sender_incarnation:
            refused = "replay" if self.peers.replaced(first.sender, first.sender_incarnation) else "unknown"
        else:
            refused = peer.admit(first.counter, pipe, self._router._pipe_open)
        if refused is not None:
            self._refuse(refused, first)
            return [False] * len(frames)
        if peer.alive:
            peer.last_seen = time.monotonic()
        taken = []
        for frame in frames:
            lost = peer.number(frame.topic, frame.seq)
            if lost == "duplicated":
                self._router._count("duplicated")
            elif isinstance(lost, str):
                self._refuse(lost, frame)
            elif lost:
                self._router._count("lost", lost)  # counted only on a gap: the common case takes no lock call
            taken.append(not isinstance(lost, str))
        if any(taken):
            peer.pipe = pipe
        return taken

    def auth_failed(self, remote: str) -> None:
        """A message from ``remote`` failed its tag: remember the address for errors, warn once a minute."""
        self._auth_failures.add(remote, time.monotonic())
        self._log.log("auth", "router %s: a message from %s failed authentication: the node there uses another "
                      "secret (check --secret-file / $CONVEYOR_SECRET on both hosts), or is not a Conveyor node",
                      self._router.node_id, remote)

    def resumed(self) -> None:
        """The inbox waited for its handlers: its peers' messages queued meanwhile; count them as heard now."""
        with self._lock:
            now = time.monotonic()
            for peer in self.peers.values():
                peer.last_seen = max(peer.last_seen, now - self._router.heartbeat_s)
