"""A task's events: the local bus, and the router glue that makes them cross processes.

Without a router, events stay in this process (:class:`~conveyor.engine.events.EventBus`). With one
attached (:meth:`Events.attach`), an emitted event is also published to the nodes that listen to it,
and each event this node has handlers for is subscribed to, once per name. The task's own events
(:data:`FINISH_EVENT`, :data:`CLOSE_EVENT`, :data:`STOP_EVENT`, :data:`PEER_LOST_EVENT`) never cross;
``task.finish`` does, as :data:`FINISH_TOPIC`, so that a run set to finish on one node ends on every node.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

from conveyor.engine.events import EventBus
from conveyor.engine.ratelimit import RateLimitedLog

__all__ = ["CLOSE_EVENT", "FINISH_EVENT", "FINISH_TOPIC", "LOCAL_EVENTS", "PEER_LOST_EVENT", "STOP_EVENT", "Events",
           "TaskEvents"]

FINISH_EVENT = "finish"
"""Emitted locally when :meth:`Task.run` ends, with one argument: the exception that ended it, or None."""

CLOSE_EVENT = "close"
"""Emitted locally, no args, when the ``with task.start():`` block exits: close files and bars here."""

STOP_EVENT = "stop"
"""Emitted locally, no args, when this process is asked to stop (SIGTERM to a ``Parallel`` worker inside
:meth:`Task.run`, or ``task.finish`` set on another node): ``task.finish`` is already set; a middleware that
waits for a message stops waiting."""

PEER_LOST_EVENT = "peer_lost"
"""Emitted locally, with the node id, when a peer leaves: the attached router lost it (dead, disconnected
or closed) or, in a ``Parallel`` worker, its ``main`` returned (then again when it closes)."""

FINISH_TOPIC = "conveyor.finish"
"""The router topic that carries ``task.finish = True`` to the other nodes (payload: the sender's node id)."""

log = logging.getLogger(__name__)

LOCAL_EVENTS = (FINISH_EVENT, CLOSE_EVENT, STOP_EVENT, PEER_LOST_EVENT, FINISH_TOPIC)


class Events:
    """The event bus of one task plus, once a router is attached, its subscriptions on that router.

    ``on_remote_finish`` is called (on the router's receive thread) when another node sets ``task.finish``, one of
    :attr:`finishers` where given (as the router authenticates its sender, ``router.sender``); a finish from another
    node is refused, counted in :attr:`refused_finish` and logged at a bounded rate.
    """

    def __init__(self, on_remote_finish: Callable[[Any], None]) -> None:
        self.bus = EventBus()
        self.router: Any = None
        self._routed: Dict[str, Callable[[Any], Any]] = {}
        self._lock = threading.RLock()
        self._on_remote_finish = on_remote_finish
        self.finishers: Optional[FrozenSet[str]] = None  # the node ids whose finish ends this run (None: any node's)
        self.refused_finish = 0
        self._log = RateLimitedLog(log)

    def reset(self) -> None:
        """Forget every handler and subscription, and who may finish the run (the router stays attached)."""
        self._unroute(list(self._routed))
        self.bus = EventBus()
        self.finishers = None

    def finish_from(self, nodes: Optional[Iterable[Any]]) -> None:
        """Let only ``nodes`` (node ids; None: any node) end this run by setting ``task.finish``."""
        self.finishers = None if nodes is None else frozenset(str(node) for node in nodes)

    def _remote_finish(self, router: Any, args: Any) -> None:
        """A finish heard from another node: passed on if its sender may end the run, else refused."""
        if self.router is not router:
            return
        sender, finishers = getattr(router, "sender", None), self.finishers
        if finishers is not None and sender is not None and str(sender) not in finishers:
            self.refused_finish += 1  # the router's delivery thread alone runs this
            self._log.log("finish", "node %s: node %s set task.finish, but only nodes %s may end the run; refused "
                          "(%d so far)", getattr(router, "node_id", None), sender, sorted(finishers),
                          self.refused_finish)
            return
        self._on_remote_finish(args[0] if isinstance(args, (list, tuple)) and args else None)

    # --- the router --------------------------------------------------------------------------------
    def attach(self, router: Any) -> None:
        """Send events through ``router`` and deliver its events here (see ``Task.attach_router``)."""
        if not (callable(getattr(router, "publish", None)) and callable(getattr(router, "on", None))):
            raise TypeError(f"task.attach_router({router!r}): needs a router with publish() and on()")
        if self.router is not None and self.router is not router:
            raise RuntimeError("task.attach_router(): a router is already attached; detach_router() first")
        if self.router is router:
            return
        self.router = router
        if callable(getattr(router, "on_peer_lost", None)):
            router.on_peer_lost(self._peer_lost)
        for name in self.bus.names():
            self._route(name)

    def detach(self) -> None:
        """Stop sending events to other nodes and delivering theirs."""
        router = self.router
        if router is None:
            return
        self._unroute(list(self._routed))
        if callable(getattr(router, "off_peer_lost", None)):
            router.off_peer_lost(self._peer_lost)
        self.router = None

    def hear_finish(self, listen: bool) -> None:
        """Listen (while a run is in progress) or stop listening for ``task.finish`` set on another node."""
        with self._lock:
            router = self.router
            if not listen:
                self._unroute([FINISH_TOPIC])
            elif router is not None and FINISH_TOPIC not in self._routed:
                handler = self._routed[FINISH_TOPIC] = lambda args: self._remote_finish(router, args)
                router.on(FINISH_TOPIC, handler)

    def publish_finish(self) -> None:
        """Tell the other nodes that this one set ``task.finish`` (a no-op without a router, or on a node that is not
        among :attr:`finishers`: the others would refuse it)."""
        router, finishers = self.router, self.finishers
        if router is not None and (finishers is None or str(getattr(router, "node_id", None)) in finishers):
            try:
                router.publish(FINISH_TOPIC, (getattr(router, "node_id", None),))
            except Exception as exc:  # a closed router: the peers will see this node leave instead
                log.warning("could not tell the other nodes that this run finished: %s", exc)

    def _peer_lost(self, node: Any) -> None:
        self.bus.emit(PEER_LOST_EVENT, node)

    def _route(self, name: str) -> None:
        """Deliver ``name`` from other nodes to this node's handlers (subscribing once per name)."""
        with self._lock:
            router = self.router
            if router is None or name in self._routed or name in LOCAL_EVENTS:
                return
            handler = self._routed[name] = lambda args: self.router is router and self.bus.emit(name, *args)
            router.on(name, handler)

    def _unroute(self, names: List[str], only_unused: bool = False) -> None:
        """Remove the router's handlers of ``names`` (only of those with no local handler left, if ``only_unused``)."""
        with self._lock:
            for name in names:
                if name in self._routed and not (only_unused and (name == FINISH_TOPIC or self.bus.handlers(name))):
                    handler = self._routed.pop(name)
                    off = getattr(self.router, "off", None)
                    if callable(off):
                        off(name, handler)

    # --- the events --------------------------------------------------------------------------------
    def on(self, name: str, fn: Callable[..., Any], once: bool = False) -> None:
        """Subscribe ``fn`` to ``name`` (for one call if ``once``), here and on the router."""
        with self._lock:
            (self.bus.once if once else self.bus.on)(name, fn)
            self._route(name)

    def off(self, name: str, fn: Optional[Callable[..., Any]] = None) -> None:
        """Unsubscribe ``fn`` (or every handler) from ``name``; the router's subscription goes with the last."""
        with self._lock:
            self.bus.off(name, fn)
            self._unroute([name], only_unused=True)

    def emit(self, name: str, args: Tuple[Any, ...], only_local: bool = False, only_remote: bool = False) -> None:
        """Deliver ``args`` here unless ``only_remote``, and to listening nodes unless ``only_local``."""
        if only_local and only_remote:
            raise ValueError("task.emit(): only_local and only_remote cannot both be True")
        if self.router is not None and not only_local and name not in LOCAL_EVENTS:
            self.router.publish(name, args)
        if not only_remote:
            self.bus.emit(name, *args)

    def wait_for(self, name: str, timeout: Optional[float]) -> Tuple[Any, ...]:
        """Block until ``name`` is emitted here or on a node the router hears; return its args."""
        self._route(name)
        return self.bus.wait_for(name, timeout)


class TaskEvents:
    """The event methods of :class:`~conveyor.engine.task.Task` (its ``_routing`` is an :class:`Events`)."""

    _routing: Events
    _running: bool
    _finish: bool
    _finish_tell: bool

    @property
    def finish(self) -> bool:
        """Set it to True to end the run after the iteration in progress (DI-engine's ``task.finish``).

        With a router attached it ends the run on every node: the others hear it when this node's run ends, or
        at once when set outside a run (a running node that hears it sets its own ``finish``, emits
        :data:`STOP_EVENT` and passes it on when its run ends). Reset by ``task.start()``.
        """
        return self._finish

    @finish.setter
    def finish(self, value: bool) -> None:
        self._finish = bool(value)
        self._finish_tell = self._finish and self._running  # told when the run ends: no router lock is taken here,
        if self._finish and not self._running and self._routing.router is not None:  # as a signal handler may set it
            threading.Thread(target=self._routing.publish_finish, name="conveyor-finish").start()

    def _finish_heard(self, node: Any) -> None:
        """Another node set ``task.finish``: end this run too, and pass it on to this node's peers when it ends
        (nodes that do not hear each other, as in a star, learn it through the others)."""
        if self._running and not self._finish:
            self._finish = self._finish_tell = True
            self._routing.bus.emit(STOP_EVENT)

    @property
    def _events(self) -> Any:
        """This block's :class:`~conveyor.engine.events.EventBus` (local delivery only)."""
        return self._routing.bus

    @property
    def router(self) -> Any:
        """The router given to :meth:`attach_router`, or None in a single-process run."""
        return self._routing.router

    def attach_router(self, router: Any) -> None:
        """Make events cross processes through ``router`` (a ``conveyor.engine.parallel.Router``).

        From then on :meth:`emit` also publishes to the nodes that listen to the event (``only_local``
        keeps it here, ``only_remote`` skips this node's handlers), and :meth:`on` / :meth:`once` /
        :meth:`wait_for` subscribe this node to it; remote events run the handlers on the router's
        receive thread. :data:`FINISH_EVENT`, :data:`CLOSE_EVENT`, :data:`STOP_EVENT` and
        :data:`PEER_LOST_EVENT` stay local; the router's lost peers are emitted as :data:`PEER_LOST_EVENT`;
        :attr:`finish` set to True crosses (while a run is in progress). The router outlives ``task.start()``
        blocks, its subscriptions do not: leaving a block, or removing an event's last handler with :meth:`off`,
        unsubscribes. :meth:`detach_router` undoes all this.
        """
        self._routing.attach(router)
        if self._running:
            self._routing.hear_finish(True)

    def finish_from(self, nodes: Optional[Iterable[Any]]) -> None:
        """Let only ``nodes`` (node ids; None, as each ``task.start()`` sets it: any node) end this run by setting
        :attr:`finish`; a finish from another node is refused, counted in :attr:`refused_finish` and logged with its
        sender at a bounded rate, and this node, when not among them, does not tell the others its own finish."""
        self._routing.finish_from(nodes)

    @property
    def refused_finish(self) -> int:
        """How many finishes from nodes not allowed by :meth:`finish_from` this task refused."""
        return self._routing.refused_finish

    def detach_router(self) -> None:
        """Stop sending events to other nodes and delivering theirs (the router's subscriptions are removed)."""
        self._routing.detach()

    def on(self, name: str, fn: Callable[..., Any]) -> None:
        """Call ``fn(*args)`` whenever ``name`` is emitted (on any node, once a router is attached)."""
        self._routing.on(name, fn)

    def once(self, name: str, fn: Callable[..., Any]) -> None:
        """Call ``fn(*args)`` the next time ``name`` is emitted."""
        self._routing.on(name, fn, once=True)

    def off(self, name: str, fn: Optional[Callable[..., Any]] = None) -> None:
        """Unsubscribe ``fn`` (or every handler) from ``name``; other nodes stop sending it once none is left."""
        self._routing.off(name, fn)

    def emit(self, name: str, *args: Any, only_local: bool = False, only_remote: bool = False) -> None:
        """Emit an event: to this node's handlers unless ``only_remote``, and, with a router attached, to
        the other nodes listening to ``name`` unless ``only_local`` (``args`` must then be encodable)."""
        self._routing.emit(name, args, only_local, only_remote)

    def wait_for(self, name: str, timeout: Optional[float] = None) -> tuple:
        """Block until ``name`` is emitted (here or, with a router, on another node) and return its args;
        ``TimeoutError`` after ``timeout`` seconds."""
        return self._routing.wait_for(name, timeout)

