"""What both exchangers (:mod:`conveyor.middleware.exchanger`) share: their topics, the side this process plays,
its router subscriptions, the stop and lost-peer wake-ups, bounded waits and ending a run."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from conveyor.engine import CLOSE_EVENT, PEER_LOST_EVENT, STOP_EVENT, task
from conveyor.middleware.messages import Rejections

__all__ = ["COLLECTOR_TOPIC", "DATA_TOPIC", "TRAIN_ITER_TOPIC", "MODEL_TOPIC", "MODEL_REQUEST_TOPIC", "ExchangeTimeout",
           "Exchanger", "anything", "seconds"]

log = logging.getLogger("conveyor.middleware.exchanger")  # where the exchangers always logged

DATA_TOPIC = "conveyor.exchange.data"
"""Collectors -> learners: ``{"node", "trajectories", "episodes", "train_data", "env_step", "env_episode"}``
(increments)."""
TRAIN_ITER_TOPIC = "conveyor.exchange.train_iter"
"""Learners -> collectors and evaluators: ``{"train_iter": int}``."""
MODEL_TOPIC = "conveyor.exchange.model"
"""Learner -> the others: ``policy.acting_state()`` (``version``, ``tensors``, ``extras``)."""
MODEL_REQUEST_TOPIC = "conveyor.exchange.model_request"
"""A receiver -> learners: ``{"node": id}``, asking for the newest version (a late joiner's first one)."""
COLLECTOR_TOPIC = "conveyor.exchange.collector"
"""Subscribed to by collectors, so that learners know them before their first batch; nothing is sent on it."""

_RETRY_S = 0.25  # a receiver waiting for weights repeats its request this often (a request can pass its subscription)


class ExchangeTimeout(TimeoutError):
    """An exchanger's wait for another node ran out. It is raised where that wait began, at an iteration's start,
    before anything of the iteration ran: the pipeline's state is a consistent cut (``at_iteration_start``), so
    a :class:`~conveyor.middleware.CkptSaver` still writes the final checkpoint before the run ends in it."""

    at_iteration_start = True


def anything(value: Any) -> bool:
    """A field check (:func:`~conveyor.middleware.messages.check_fields`) that takes any value."""
    return True


def seconds(where: str, name: str, value: Any, zero_ok: bool = False) -> float:
    """``value`` as a float number of seconds (> 0, or >= 0 with ``zero_ok``); else a ValueError naming it."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value >= 0 if zero_ok else value > 0):
        raise ValueError(f"{where}({name}={value!r}): must be a number of seconds {'>= 0' if zero_ok else '> 0'}")
    return float(value)


def _active_router() -> Any:
    router = task.router
    if router is None or not getattr(router, "is_active", True):
        return None
    return router


class Exchanger:
    """What both exchangers share: the side this process plays, its router subscription, the stop and
    lost-peer wake-ups, and unsubscribing when the ``task.start`` block closes."""

    def __init__(self, name: str, learner_topic: str, learner_fn: Callable[[Any], Any], other_topic: str,
                 other_fn: Callable[[Any], Any]) -> None:
        self._router = _active_router()
        self._cond = threading.Condition()
        self._stopping = False
        self._learner = self._collector = False
        self._subscribed: List[tuple] = []  # (topic, handler)
        self._rejections = Rejections(f"{name} on node {getattr(self._router, 'node_id', '-')}", self._router)
        if self._router is None:
            return
        if not task.roles:
            raise RuntimeError(f"{name} in a multi-process run needs this process's role: call "
                               f"task.add_role(task.role.LEARNER) (or COLLECTOR / EVALUATOR) before making it")
        self._learner = task.has_role(task.role.LEARNER)
        if self._learner and task.has_role(task.role.COLLECTOR):
            raise RuntimeError(f"{name}: this process has both the LEARNER and the COLLECTOR role; in a multi-process "
                               f"run a learner takes its data from collector processes (its own collector would "
                               f"overwrite what they sent): give collecting to other workers, or run one process")
        self._collector = not self._learner and task.has_role(task.role.COLLECTOR)
        topic, fn = (learner_topic, learner_fn) if self._learner else (other_topic, other_fn)
        self._subscribe(topic, self._rejections(fn, topic))
        task.on(STOP_EVENT, self._stop)
        task.on(PEER_LOST_EVENT, self._peer_lost)
        task.on(CLOSE_EVENT, self.close)

    def stats(self) -> Dict[str, int]:
        """``rejected``: messages dropped on receipt as not what their topic carries (see the module docstring)."""
        return {"rejected": self._rejections.count}

    def close(self) -> None:
        """Unsubscribe from the router (called when the ``with task.start():`` block closes)."""
        for topic, fn in self._subscribed:
            self._router.off(topic, fn)
        self._subscribed = []

    def _subscribe(self, topic: str, fn: Callable[[Any], Any]) -> None:
        self._router.on(topic, fn)
        self._subscribed.append((topic, fn))

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _peer_lost(self, node: Any) -> None:
        finished = str(node) in self._router.peers()  # its main returned (a goodbye), else the router lost it
        with self._cond:
            self._forget(str(node), finished)
            self._cond.notify_all()

    def _forget(self, node: str, finished: bool) -> None:
        """A peer has left: ``finished`` (said goodbye), or lost (called holding ``_cond``)."""

    def _wait(self, ready: Callable[[], bool], timeout_s: float,
              poke: Optional[Callable[[], None]] = None) -> Optional[bool]:
        """Wait (holding ``_cond``) until ``ready()``: True; until asked to stop: False; ``timeout_s`` over, or no
        peer live while a node with another secret keeps knocking (:meth:`_knocking`): None. ``poke()`` runs
        every ``_RETRY_S`` while waiting."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self._stopping:
                return False
            left = deadline - time.monotonic()
            if left <= 0 or self._knocking():
                return None
            if poke is not None:
                self._cond.release()
                try:
                    poke()
                finally:
                    self._cond.acquire()
            self._cond.wait(min(left, _RETRY_S))
        return True

    def _knocking(self) -> Optional[str]:
        """While no peer is live: the router's sentence naming an address that keeps failing authentication (a
        node with another secret), else None. A router without that check (a test's fake) has none."""
        check = getattr(self._router, "failing_authentication", None)
        return check() if check is not None and not self._router.peers() else None

    def _timeout(self, what: str, sender: str, timeout_s: float) -> ExchangeTimeout:
        knocking = self._knocking()
        if knocking:
            return ExchangeTimeout(f"node {self._router.node_id}: no {what} and no peer live, while {knocking}: the "
                                   f"node there uses another secret than this one; give every node the same secret "
                                   f"(--secret-file FILE or $CONVEYOR_SECRET)")
        return ExchangeTimeout(f"node {self._router.node_id}: no {what} within {timeout_s}s (live peers: "
                               f"{self._router.peers()}); is a {sender} running, with this exchanger in its chain? "
                               f"Raise timeout_s if it is just slow")

    def _end_run(self, level: int, why: str) -> None:
        """End the run normally after this iteration, entering no further middleware in it."""
        log.log(level, "node %s: %s", self._router.node_id, why)
        task.finish = True
        task.end_iteration()

