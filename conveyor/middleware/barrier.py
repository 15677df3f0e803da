"""``Barrier``: the named nodes of a multi-node run meet at one point of the pipeline (DI-engine's ``Barrier``).

Each node counts its passes through the barrier; pass ``k`` of a node waits until every other named node has
reached its own pass ``k``. Arrivals travel as task events over the attached router; a node that is still
waiting repeats its arrival now and then, and a node that has arrived answers a repeat, so an arrival sent
before the other node listened is not lost. A node lost (``PEER_LOST_EVENT``) is not waited for; the wait is
bounded, and a ``TimeoutError`` names the nodes that did not arrive.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional, Set, Tuple

from conveyor.engine import PEER_LOST_EVENT, STOP_EVENT, Task, declares, task

__all__ = ["Barrier"]


@declares()
class Barrier:
    """Middleware making ``nodes`` (node ids: ``task.router.node_id``) meet here at every iteration.

    A node not among ``nodes``, or a process without a router, passes straight through. ``timeout_s`` bounds
    each wait; ``name`` tells barriers of one pipeline apart (each needs its own); ``runtime`` is the task whose
    router carries the arrivals (the global ``task`` unless given, like DI-engine's ``BarrierRuntime``). Once
    ``task.finish`` is set, a waiting node stops waiting and ends its iteration there.

    Reads ctx: nothing. Writes ctx: nothing.
    """

    def __init__(self, *nodes: Any, timeout_s: float = 60.0, name: str = "barrier", resend_s: float = 0.5,
                 runtime: Optional[Task] = None) -> None:
        if not nodes:
            raise ValueError("Barrier(): name the nodes that meet, e.g. Barrier(0, 1, 2)")
        for what, value in (("timeout_s", timeout_s), ("resend_s", resend_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Barrier({what}={value!r}): must be a number of seconds > 0")
        self.nodes: Tuple[str, ...] = tuple(dict.fromkeys(str(n) for n in nodes))
        self.timeout_s, self.resend_s, self.name = float(timeout_s), float(resend_s), name
        self.topic = f"conveyor.barrier.{name}"
        self._task = runtime if runtime is not None else task
        self._cond = threading.Condition()
        self._arrived: Dict[int, Set[str]] = {}
        self._lost: Set[str] = set()
        self._passes = 0  # this node's passes started
        self._me = ""
        self._task.on(self.topic, self._heard)
        self._task.on(PEER_LOST_EVENT, self._peer_lost)
        self._task.on(STOP_EVENT, self._wake)

    def __repr__(self) -> str:
        return f"Barrier({', '.join(self.nodes)}, name={self.name!r})"

    def __call__(self, ctx: Any) -> None:
        router = self._task.router
        me = None if router is None else str(getattr(router, "node_id", ""))
        if me is None or me not in self.nodes:
            return
        with self._cond:
            self._me, k = me, self._passes
            self._passes += 1
            for old in [i for i in self._arrived if i < k]:
                del self._arrived[old]
        self._task.emit(self.topic, me, k, False, only_remote=True)
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._cond:
                missing = self._missing(k)
                if not missing or self._task.finish:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self!r}: node(s) {', '.join(missing)} did not arrive at pass {k} within "
                                       f"{self.timeout_s:g}s (arrived: {sorted(self._arrived.get(k, ())) or 'none'}, "
                                       f"lost: {sorted(self._lost) or 'none'}); raise timeout_s if they are slow")
                if self._cond.wait(min(left, self.resend_s)):
                    continue
            self._task.emit(self.topic, me, k, True, only_remote=True)  # still waiting: say it again
        if missing and self._task.running:  # task.finish: the run ends here, without the others
            self._task.end_iteration()

    def _missing(self, k: int) -> list:
        arrived = self._arrived.get(k, set())
        return [n for n in self.nodes if n != self._me and n not in arrived and n not in self._lost]

    def _heard(self, node: Any, k: int, again: bool) -> None:
        """An arrival: ``node`` reached its pass ``k`` (``again``: it is still waiting, and asks for answers)."""
        node = str(node)
        with self._cond:
            self._lost.discard(node)
            if k >= self._passes - 1:
                self._arrived.setdefault(k, set()).add(node)
            answer = again and k < self._passes and self._me
            self._cond.notify_all()
        if answer:
            self._task.emit(self.topic, self._me, k, False, only_remote=True)

    def _peer_lost(self, node: Any) -> None:
        with self._cond:
            self._lost.add(str(node))
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
