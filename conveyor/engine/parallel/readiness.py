"""Who of a router's peers is there: live, ready (the handshake complete both ways), and the wait for them with
errors that name what is missing (an address answering nothing authentic, one failing authentication: another
secret). A part of :class:`~conveyor.engine.parallel.membership.Membership`, under the router's lock like the rest."""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

from conveyor.engine.parallel.guard import AuthFailures
from conveyor.engine.parallel.peers import Link, Peer, PeerTable

__all__ = ["Readiness"]


class Readiness:
    """The readiness half of :class:`~conveyor.engine.parallel.membership.Membership` (which sets its fields)."""

    _router: Any
    _lock: threading.RLock
    _changed: threading.Condition
    _auth_failures: AuthFailures
    links: Dict[str, Link]
    peers: PeerTable

    def live(self) -> List[str]:
        """Ids of the live peers."""
        with self._lock:
            return sorted(p.node_id for p in self.peers.values() if p.alive)

    def ready(self) -> List[str]:
        """Live peers that know this node too."""
        with self._lock:
            return sorted(p.node_id for p in self.peers.values() if self._ready(p))

    def _ready(self, peer: Peer) -> bool:
        link = self.links.get(peer.address)
        return (peer.alive and self._router.node_id in peer.heard and link is not None and link.hello_sent
                and link.peer_inc == peer.incarnation)

    def wait_ready(self, n: int, timeout: float) -> List[str]:
        """Block until ``n`` peers are ready (see :meth:`Router.wait_for_peers`)."""
        r = self._router
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                ready = [p.node_id for p in self.peers.values() if self._ready(p)]
                if len(ready) >= n:
                    return sorted(ready)
                now = time.monotonic()
                left = deadline - now
                unanswered = sorted(url for url, link in self.links.items()
                                    if not link.learned and self._unanswered(link, now))
                if unanswered:
                    raise TimeoutError(self._no_answer(", ".join(unanswered)))
                knocking = self.knocking()
                if knocking:
                    raise TimeoutError(f"router {r.node_id!r}: {knocking} while this node waits for its peers: the node "
                                       f"there uses another secret than this one; give every node the same secret "
                                       f"(--secret-file FILE or $CONVEYOR_SECRET)")
                if left <= 0 or r.closed:
                    break
                self._changed.wait(min(left, r.heartbeat_s))
            heard = sorted(p.node_id for p in self.peers.values() if p.alive and not self._ready(p))
            silent = sorted(url for url, link in self.links.items() if link.peer_inc is None)
            failed = self._auth_failures.addresses()
        raise TimeoutError(f"router {r.node_id!r}: {len(ready)} of {n} peers ready after {timeout}s "
                           f"(ready: {sorted(ready)}; heard but not yet knowing us: {heard}; dialed, nothing "
                           f"authentic heard from: {silent}; failed authentication: {failed}); check that those "
                           f"nodes run, use the same secret, and are given this node's address {r.address}")

    def knocking(self) -> Optional[str]:
        """A sentence naming an address that kept failing authentication for over ``auth_timeout_s``, or None."""
        return self._auth_failures.persistent(time.monotonic(), self._router.auth_timeout_s)

    def _unanswered(self, link: Link, now: float) -> bool:
        """Whether ``link`` has been connected for over ``auth_timeout_s`` with nothing authentic back."""
        return bool(link.unproven_since) and now - link.unproven_since > self._router.auth_timeout_s

    def _no_answer(self, urls: str) -> str:
        r = self._router
        return (f"router {r.node_id!r}: connected to {urls} for over {r.auth_timeout_s}s and nothing authentic "
                f"came back: the node there uses another secret than this one (check --secret-file / "
                f"$CONVEYOR_SECRET on both hosts), or is not a Conveyor node")
